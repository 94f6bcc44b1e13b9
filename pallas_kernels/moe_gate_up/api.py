"""Public op: the MoE experts' first product, gather + grouped [W1 | W3] matmul + SiTU-GLU
(report §2.3, Eq. 11: SiTU(W1_j z, W3_j z) for each routed copy of each token).

`gate_up(x [N, K], rows [M], w1 [G, K, F], w3 [G, K, F], group_sizes [G])` returns
h [M, F] = SiTU(x[rows] @ W1_g, x[rows] @ W3_g) for the rows of group g (rows sorted by group,
as `jax.lax.ragged_dot`), in x's dtype, from fp32 products; rows past sum(group_sizes) give
zeros. `return_situ_grads=True` also returns SiTU's partial derivatives [dh/d gate | dh/d up]
[M, 2F] (x's dtype; `k3jax.situ.situ_partials`), so that a backward is one multiply. In the
MoE, rows = order // top_k gathers each routed copy's token, so the dispatched copies [M, K]
are never written to HBM.

Tiers ("impl"): "xla" (gather, `jax.lax.ragged_dot`, SiTU: the reference) and "triton" (one
Pallas kernel on the Triton backend, `triton.py`). impl=None tries triton then xla on Hopper
GPUs, where its tests passed, and xla elsewhere; a call the kernel declines runs on xla (fail
closed). `plan(...)` returns the tier and every reason a tier declined.

A forward op, not differentiable. `k3jax.latent_moe.fused_gate_up` runs it for the layer's
forward and, under differentiation (`gate_up_train="kernel"`, the default), with
return_situ_grads, so that its backward is one multiply and the grouped matmul's VJP.
"""
import types

import jax
import jax.numpy as jnp

from pallas_kernels import tiers
from pallas_kernels.moe_gate_up import triton
from pallas_kernels.moe_gate_up import xla

IMPLS = ("xla", "triton")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton}
Plan = tiers.Plan


def default_impls() -> tuple[str, ...]:
  """Tier order for impl=None on the default device."""
  return ("triton", "xla") if triton.is_hopper() else ("xla",)


def _validate(x, rows, w1, w3, group_sizes) -> None:
  if len(x.shape) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating [N, K] array, got {x.dtype}{list(x.shape)}")
  if len(w1.shape) != 3 or w1.shape[1] != x.shape[1] or tuple(w3.shape) != tuple(w1.shape):
    raise ValueError(f"w1 and w3 must both be [G, K, F] with K = {x.shape[1]}, got "
                     f"{tuple(w1.shape)} and {tuple(w3.shape)}")
  if len(rows.shape) != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f"rows must be an integer [M] array, got {rows.dtype}{list(rows.shape)}")
  if tuple(group_sizes.shape) != (w1.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                        jnp.integer):
    raise ValueError(f"group_sizes must be an integer [G] = ({w1.shape[0]},) array, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")


def plan(x, rows, w1, w3, group_sizes, *, impl: str | None = None, interpret: bool = False,
         config=None) -> Plan:
  """The tier `gate_up` would use for these arguments (arrays or ShapeDtypeStructs)."""
  _validate(x, rows, w1, w3, group_sizes)
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls()),
      lambda name: TIERS[name].supports(x, rows, w1, w3, group_sizes, interpret=interpret,
                                        config=config if name == "triton" else None),
      interpret)


def gate_up(x: jax.Array, rows: jax.Array, w1: jax.Array, w3: jax.Array,
            group_sizes: jax.Array, *, beta1: float, beta2: float,
            return_situ_grads: bool = False, impl: str | None = None, interpret: bool = False,
            config: triton.Config | None = None):
  """h [M, F] = SiTU(x[rows] W1_g, x[rows] W3_g) (report Eq. 11), and [dh/d gate | dh/d up]
  [M, 2F] with return_situ_grads. rows: int indices into x's N rows (in range; they are not
  checked on the device). impl: None (platform default) or one of IMPLS; config: the triton
  tier's tiles. interpret=True runs the kernel in Pallas's interpreter (CPU tests). Not
  differentiable."""
  p = plan(x, rows, w1, w3, group_sizes, impl=impl, interpret=interpret, config=config)
  return TIERS[p.impl].gate_up(x, rows, w1, w3, group_sizes, beta1=beta1, beta2=beta2,
                               return_situ_grads=return_situ_grads, interpret=interpret,
                               config=config if p.impl == "triton" else None)
