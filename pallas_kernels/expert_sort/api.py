"""Public sort of the MoE's token copies by expert (dropless routing, report Eq. 11).

`sort_by_expert(experts [N, k], E)` returns (order, inverse [N*k] int32, group_sizes [E]
int32): `order` lists the copies (n k + j) grouped by expert, stably, `inverse` undoes it.

Tiers ("impl"): "xla" (the reference, `xla.py`) and "triton" (one program's counting sort for
few copies, `triton.py`). impl=None runs triton then xla on a GPU (while TRITON_IS_DEFAULT),
xla elsewhere; an explicit impl="triton" falls through to xla for calls the kernel
declines. `plan(...)` returns the tier and every reason a tier declined.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tiers
from pallas_kernels.expert_sort import triton
from pallas_kernels.expert_sort import xla

IMPLS = ("xla", "triton")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton}
# On since its GPU tests passed on an H100 (2026-12-07; benchmarks/decode.py --expert_sort=xla
# turns it off).
TRITON_IS_DEFAULT = True
Plan = tiers.Plan


def default_impls() -> tuple[str, ...]:
  return ("triton", "xla") if TRITON_IS_DEFAULT and triton.is_gpu() else ("xla",)


def plan(experts, num_experts: int, *, impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `sort_by_expert` would use for experts (an array or ShapeDtypeStruct)."""
  if len(experts.shape) != 2 or not jnp.issubdtype(experts.dtype, jnp.integer):
    raise ValueError(f"experts must be an integer [N, k] array, got {experts.dtype} "
                     f"{tuple(experts.shape)}")
  if (isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer))
      or num_experts < 1):
    raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls()),
      lambda name: TIERS[name].supports(experts, int(num_experts), interpret=interpret),
      interpret)


def sort_by_expert(experts: jax.Array, num_experts: int, *, impl: str | None = None,
                   interpret: bool = False) -> tuple[jax.Array, ...]:
  """experts [N, k] ids in [0, E) -> (order, inverse [N*k] int32, group_sizes [E] int32)."""
  p = plan(experts, num_experts, impl=impl, interpret=interpret)
  if p.impl == "triton":
    return triton.sort_by_expert(experts, int(num_experts), interpret=p.interpret)
  return xla.sort_by_expert(experts, int(num_experts))
