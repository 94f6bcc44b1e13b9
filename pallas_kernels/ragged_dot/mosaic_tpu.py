"""Mosaic TPU tier of the grouped matmul: JAX's megablox kernels, called as they are.

`jax.experimental.pallas.ops.tpu.megablox.gmm.gmm` (forward; with transpose_rhs, d_lhs) and
`.tgmm` (d_rhs). This wrapper only adapts shapes: M is padded with zero rows to a multiple of
the row tile (megablox needs m % tm == 0), the rows past sum(group_sizes), which megablox
leaves unwritten, are set to zero, and tiles come from `tiles()`. `interpret=True` runs the
kernels through Pallas's HLO interpreter (any backend).

Shapes: gmm lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N];
tgmm lhs [M, K], rhs [M, N] -> [G, K, N] with out[g] = lhs_g^T rhs_g.
"""
import sys

import jax
import jax.numpy as jnp
import jax.experimental.pallas.ops.tpu.megablox.gmm  # noqa: F401  (registers the module)

# The package re-exports the custom_vjp `gmm` under the submodule's name; take the module.
megablox = sys.modules["jax.experimental.pallas.ops.tpu.megablox.gmm"]

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
ROW_TILES = (512, 256, 128)        # tm for large / medium / small M
MINOR_TILES = (512, 256, 128)      # tk, tn: multiples of the 128-lane vreg width


def _minor_tile(dim: int) -> int | None:
  """The largest tile of MINOR_TILES dividing dim, or dim itself when dim <= 128 and a
  multiple of 8 (a block equal to the full dim is always legal)."""
  if dim <= MINOR_TILES[-1]:
    return dim if dim % 8 == 0 else None
  return next((t for t in MINOR_TILES if dim % t == 0), None)


def tiles(m: int, k: int, n: int) -> tuple[int, int, int] | str:
  """(tm, tk, tn) for out [m, n] with contraction k (gmm; for tgmm k, n are the output dims
  and m the rows), or why no tile fits."""
  tm = next((t for t in ROW_TILES if m >= 4 * t), ROW_TILES[-1])
  tk, tn = _minor_tile(k), _minor_tile(n)
  if tk is None:
    return f"K={k} is neither <= 128 (and a multiple of 8) nor a multiple of 128"
  if tn is None:
    return f"N={n} is neither <= 128 (and a multiple of 8) nor a multiple of 128"
  return tm, tk, tn


def _check_common(lhs, rhs, interpret: bool) -> str | None:
  if not interpret and jax.devices()[0].platform != "tpu":
    return f"not a TPU ({jax.devices()[0].device_kind}) and interpret=False"
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
      return f"{name} must be bf16 or f32 for megablox, got {x.dtype}"
  return None


def supports_gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None,
                 interpret: bool = False) -> str | None:
  """None if `gmm` takes this call, else the reason it does not."""
  del group_sizes, out_dtype
  if reason := _check_common(lhs, rhs, interpret):
    return reason
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  t = tiles(lhs.shape[0], lhs.shape[1], n)
  return t if isinstance(t, str) else None


def supports_tgmm(lhs, rhs, group_sizes, *, out_dtype=None,
                  interpret: bool = False) -> str | None:
  """None if `tgmm` takes this call, else the reason it does not."""
  del group_sizes, out_dtype
  if reason := _check_common(lhs, rhs, interpret):
    return reason
  t = tiles(lhs.shape[0], lhs.shape[1], rhs.shape[1])
  return t if isinstance(t, str) else None


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
  pad = -x.shape[0] % multiple
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _clip_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  return jnp.diff(ends, prepend=0).astype(jnp.int32)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
        out_dtype=None, interpret: bool = False) -> jax.Array:
  """out[M, N] = lhs[M, K] @ rhs[g] (rhs[g]^T with transpose_rhs) for the rows of group g;
  rows past sum(group_sizes) are zero. Call `supports_gmm` first."""
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = tiles(m, k, n)
  sizes = _clip_sizes(group_sizes, m)
  out = megablox.gmm(_pad_rows(lhs, tm), rhs, sizes, preferred_element_type=out_dtype,
                     tiling=(tm, tk, tn), transpose_rhs=transpose_rhs, interpret=interpret)
  rows = jax.lax.broadcasted_iota(jnp.int32, (m, n), 0)
  return jnp.where(rows < jnp.sum(sizes), out[:m], jnp.zeros((), out_dtype))


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
         interpret: bool = False) -> jax.Array:
  """out[g] = lhs[rows of g]^T @ rhs[rows of g]: lhs [M, K], rhs [M, N] -> [G, K, N]; empty
  groups give zeros and rows past sum(group_sizes) take no part. Call `supports_tgmm` first."""
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  m, k = lhs.shape
  tm, tk, tn = tiles(m, k, rhs.shape[1])
  sizes = _clip_sizes(group_sizes, m)
  return megablox.tgmm(_pad_rows(lhs, tm).T, _pad_rows(rhs, tm), sizes,
                       preferred_element_type=out_dtype, tiling=(tm, tk, tn),
                       num_actual_groups=group_sizes.shape[0], interpret=interpret)
