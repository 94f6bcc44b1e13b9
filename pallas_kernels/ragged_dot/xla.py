"""XLA tier (the reference): `jax.lax.ragged_dot` and `jax.lax.ragged_dot_general`.

Same entry points as the kernel tiers (gmm, tgmm and their `supports_*`), so the API can fall
back to it product by product. Accumulates in fp32 and casts to the requested dtype.
"""
import jax
import jax.numpy as jnp

# out[g] = lhs_g^T rhs_g: contract the (ragged) row dim of both operands, no group dim in rhs.
TGMM_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def supports_gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None,
                 interpret: bool = False) -> None:
  """XLA takes every valid call."""
  del lhs, rhs, group_sizes, transpose_rhs, out_dtype, interpret


def supports_tgmm(lhs, rhs, group_sizes, *, out_dtype=None, interpret: bool = False) -> None:
  """XLA takes every valid call."""
  del lhs, rhs, group_sizes, out_dtype, interpret


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
        out_dtype=None, interpret: bool = False) -> jax.Array:
  """lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N]."""
  del interpret
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
         interpret: bool = False) -> jax.Array:
  """lhs [M, K], rhs [M, N] -> [G, K, N], out[g] = lhs_g^T rhs_g."""
  del interpret
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, TGMM_DIMENSION_NUMBERS,
                                   preferred_element_type=jnp.float32)
  return out.astype(out_dtype)
