"""Public row-wise top-k for the MoE router (report Eq. 13: T = argtop_k(s + b); QB's token
cutoffs alpha, the (k+1)-th largest s + b, §2.3.3).

`top_k(x [N, E], k)` returns `jax.lax.top_k(x, k)`'s result with int32 indices: values largest
first, equal values in increasing column order (IEEE total order, so -0.0 ranks below +0.0 and
-inf entries are picked like any other value). NaN inputs are not supported.

Tiers ("impl"): "xla" (`jax.lax.top_k`, a sort on the GPU; the reference) and "triton" (a Pallas
kernel on the Triton backend, `triton.py`). impl=None tries triton then xla on a GPU, xla
elsewhere; an explicit impl="triton" also falls through to xla for calls the kernel declines
(fail closed). `plan(...)` returns the tier and every reason a tier declined.

The kernel tier is meant for selection (the router applies it to stop_gradient'ed scores), but
a custom JVP makes it a drop-in replacement: the value tangent is x's tangent at the picked
indices (so the cotangent is scattered back to them), as lax.top_k's.
"""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tiers
from pallas_kernels.top_k import triton
from pallas_kernels.top_k import xla

IMPLS = ("xla", "triton")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton}
Plan = tiers.Plan


def default_impls() -> tuple[str, ...]:
  """Tier order for impl=None on the default device."""
  return ("triton", "xla") if triton.is_gpu() else ("xla",)


def _validate(x, k) -> None:
  if len(x.shape) != 2:
    raise ValueError(f"x must be 2-D [N, E], got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating array (float32, bfloat16, float16, ...), "
                     f"got dtype {jnp.dtype(x.dtype)}")
  e = x.shape[1]
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= e:
    raise ValueError(f"k must be an int in [1, E] = [1, {e}], got {k!r}")


def plan(x, k: int, *, impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `top_k` would use for x (an array or ShapeDtypeStruct) and k."""
  _validate(x, k)
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls()),
      lambda name: TIERS[name].supports(x, int(k), interpret=interpret), interpret)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _kernel_top_k(x: jax.Array, k: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
  return triton.top_k(x, k, interpret=interpret)


@_kernel_top_k.defjvp
def _kernel_top_k_jvp(k, interpret, primals, tangents):
  """d values = dx at the picked indices (transposed: a scatter-add to them); indices are int."""
  (x,), (dx,) = primals, tangents
  values, indices = _kernel_top_k(x, k, interpret)
  d_indices = np.zeros(indices.shape, jax.dtypes.float0)
  return (values, indices), (jnp.take_along_axis(dx, indices, axis=1), d_indices)


def top_k(x: jax.Array, k: int, *, impl: str | None = None,
          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Row-wise top-k: x [N, E] floating -> (values [N, k] x.dtype, indices [N, k] int32).

  Exactly `jax.lax.top_k(x, k)` (ties to the lower index), differentiable in x on every tier.
  impl: None (platform default) or one of IMPLS; a call the kernel declines runs on "xla"
  (see `plan`). interpret=True runs the kernel in Pallas's interpreter (CPU tests).
  """
  p = plan(x, k, impl=impl, interpret=interpret)
  if p.impl == "xla":
    return xla.top_k(x, int(k))
  return _kernel_top_k(x, int(k), interpret)
