"""Top-k over the experts of each token, the selection of Eq. 13 and of QB's cutoffs.

`jax.lax.top_k` on [N, E] rows lowers to a sort of (value, index) pairs on the GPU: 51 us of
the k3_small MoE layer's forward on the H200 (16384 x 64, k = 8). For narrow rows the same
result comes from ranks: rank_i = #{j : x_j > x_i, or x_j == x_i and j < i} is one fused
compare-and-count over [N, E, E] (ties go to the lower index, as in `jax.lax.top_k`), and the
entry of rank r is picked by a compare-and-sum over [N, k, E]. Wider rows keep the sort.
"""
import jax
import jax.numpy as jnp

RANK_MAX_WIDTH = 128   # E up to which ranks replace the sort (N E^2 compares)


def ranks(x: jax.Array) -> jax.Array:
  """x [N, E] -> int32 [N, E]: the place of each entry in its row sorted in descending order,
  ties in index order (0 = largest)."""
  idx = jnp.arange(x.shape[1], dtype=jnp.int32)
  xi, xj = x[:, :, None], x[:, None, :]
  ahead = (xj > xi) | ((xj == xi) & (idx[None, None, :] < idx[None, :, None]))
  return jnp.sum(ahead, axis=2, dtype=jnp.int32)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(x, k)` for x [N, E] without NaNs: (values [N, k], indices [N, k] int32),
  largest first, ties to the lower index. Rows of at most RANK_MAX_WIDTH entries go by
  `ranks`; the values are exact (one nonzero term per sum) and carry the same gradient."""
  if x.ndim != 2 or not 1 <= k <= x.shape[1]:
    raise ValueError(f"x must be [N, E] with 1 <= k <= E, got shape {x.shape} and k={k}")
  if x.shape[1] > RANK_MAX_WIDTH:
    values, indices = jax.lax.top_k(x, k)
    return values, indices.astype(jnp.int32)
  pick = jax.lax.stop_gradient(ranks(x))[:, None, :] == jnp.arange(k)[None, :, None]
  idx = jnp.arange(x.shape[1], dtype=jnp.int32)
  indices = jnp.sum(jnp.where(pick, idx, 0), axis=2, dtype=jnp.int32)
  values = jnp.sum(jnp.where(pick, x[:, None, :], jnp.zeros((), x.dtype)), axis=2)
  return values, indices
