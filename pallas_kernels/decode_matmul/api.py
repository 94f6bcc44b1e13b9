"""Public x [M, K] @ w [K, N] for few rows: a decode step's dense projections (the KDA layers'
merged input product, the MoE's merged W_in / W_out, MLA's and the LM head's), where M is the
batch (16 at the decode target) and the time is the weight's read.

`matmul(x, w, preferred_element_type=None)` is `jnp.dot(x, w, preferred_element_type=...)`
with fp32 sums, the output in x's dtype unless preferred_element_type. Tiers ("impl"): "xla"
(`xla.py`, the reference) and "triton" (`triton.py`: bf16 x and w, M <= 16, one program per
column block, optionally a share of K each with the shares summed by XLA). impl=None takes
triton on GPUs while TRITON_IS_DEFAULT for weights of at most TRITON_DEFAULT_MAX_BYTES, else
xla; a call the kernel declines falls through to xla. `plan(...)` returns the tier and every
reason a tier declined.
"""
import types

import jax
import jax.numpy as jnp

from pallas_kernels import tiers
from pallas_kernels.decode_matmul import triton
from pallas_kernels.decode_matmul import xla

IMPLS = ("xla", "triton")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton}
# On since its GPU tests passed on an H100 (2026-12-08), where `benchmarks/decode_matmul.py`
# timed it faster than XLA's GEMM at each of k3_small's decode products of 0.6-8.7 MB (3.4-6.1
# us against 3.6-6.7) and slower at the LM head's 335 MB (174 us against XLA's 111, its copy
# rate): impl=None leaves weights above TRITON_DEFAULT_MAX_BYTES to XLA.
TRITON_IS_DEFAULT = True
TRITON_DEFAULT_MAX_BYTES = 16 << 20
Plan = tiers.Plan


def default_impls(w=None) -> tuple[str, ...]:
  """Tier order for impl=None on the default device (for weight `w`, an array or a
  ShapeDtypeStruct: xla alone above TRITON_DEFAULT_MAX_BYTES)."""
  small = w is None or w.size * jnp.dtype(w.dtype).itemsize <= TRITON_DEFAULT_MAX_BYTES
  return ("triton", "xla") if TRITON_IS_DEFAULT and small and triton.is_gpu() else ("xla",)


def _validate(x, w, preferred_element_type) -> None:
  if len(x.shape) != 2 or len(w.shape) != 2:
    raise ValueError(f"x must be [M, K] and w [K, N], got shapes {tuple(x.shape)} and "
                     f"{tuple(w.shape)}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"x's K ({x.shape[1]}) must equal w's K ({w.shape[0]})")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating, got {jnp.dtype(a.dtype)}")
  if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type,
                                                               jnp.floating):
    raise ValueError(f"preferred_element_type must be floating or None, got "
                     f"{preferred_element_type!r}")


def plan(x, w, *, preferred_element_type=None, impl: str | None = None,
         interpret: bool = False, config: triton.Config | None = None) -> Plan:
  """The tier `matmul` would use (arrays or ShapeDtypeStructs)."""
  _validate(x, w, preferred_element_type)
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls(w)),
      lambda name: TIERS[name].supports(x, w, preferred_element_type=preferred_element_type,
                                        interpret=interpret, config=config), interpret)


def matmul(x: jax.Array, w: jax.Array, *, preferred_element_type=None, impl: str | None = None,
           interpret: bool = False, config: triton.Config | None = None) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N] (module docstring). interpret=True runs the kernel in
  Pallas's interpreter (CPU tests); config: the triton tier's tile (`triton.CONFIGS`)."""
  p = plan(x, w, preferred_element_type=preferred_element_type, impl=impl,
           interpret=interpret, config=config)
  return TIERS[p.impl].matmul(x, w, preferred_element_type=preferred_element_type,
                              interpret=p.interpret, config=config)
