"""xla tier: absorbed-MLA decode attention in plain JAX over the filled blocks only (report §2.1),
any platform.

A `lax.fori_loop` with a traced trip count cdiv(max(lengths), block) walks the cache in blocks
of `block` positions, keeping the online softmax's running max m, sum l and output accumulator
in fp32 (FlashAttention-2's recurrence, Dao 2023): the blocks past max(lengths) are never read,
so the cost follows the longest filled row, not the allocated S. Block j covers positions
[j * block, (j + 1) * block); the last block of a cache whose S is no multiple of `block` is
read from S - block on, its positions before j * block masked (already counted), so the cache is
never padded.

Products take the promoted dtype of q and the cache with fp32 accumulation (p is cast to it for
the value product, as in flash kernels); HIGHEST precision when that dtype is fp32. Positions
at or past a row's length must hold finite values (init_cache's zeros or older tokens): their
probabilities are 0, and 0 times a NaN would still be NaN.
"""
import jax
import jax.numpy as jnp

SCORE_BUDGET = 2 ** 21        # fp32 scores [B, T, H, block] of one block, in elements
MIN_BLOCK = 512
MAX_BLOCK = 8192
_NEG = -1e30  # initial running max: finite, so no -inf - -inf while nothing is seen


def supports(q, cache, lengths, *, v_dim: int, q_positions, interpret: bool = False
             ) -> str | None:
  """Takes every valid call."""
  return None


def block_size(b: int, t: int, h: int, s: int) -> int:
  """Positions per block: the largest power of two whose scores fit SCORE_BUDGET, clamped to
  [MIN_BLOCK, MAX_BLOCK], and at most S (B = 1, H = 64: 8192; B = 16, H = 64: 2048)."""
  rows = b * t * h
  block = 1 << (max(SCORE_BUDGET // rows, 1).bit_length() - 1)
  return min(max(block, MIN_BLOCK), MAX_BLOCK, s)


def decode_attention(q: jax.Array, cache: jax.Array, lengths: jax.Array, positions: jax.Array,
                     *, v_dim: int, scale: float, block: int | None = None) -> jax.Array:
  """q [B, T, H, Dk], cache [B, S, Dk], lengths [B] int32 (in [0, S]), positions [B, T] int32
  -> o [B, T, H, v_dim] fp32 (`block`: positions per loop step, default `block_size`)."""
  b, t, h, _ = q.shape
  s_len = cache.shape[1]
  bk = min(block or block_size(b, t, h, s_len), s_len)
  dtype = jnp.promote_types(q.dtype, cache.dtype)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  qc = q.astype(dtype)
  steps = (jnp.max(lengths) + bk - 1) // bk

  def step(j, carry):
    m, l, acc = carry
    start = j * bk
    first = jnp.minimum(start, s_len - bk)
    blk = jax.lax.dynamic_slice_in_dim(cache, first, bk, axis=1).astype(dtype)
    s = jnp.einsum("bthd,bkd->bthk", qc, blk, preferred_element_type=jnp.float32,
                   precision=precision) * scale
    slots = first + jnp.arange(bk, dtype=jnp.int32)[None, None, :]
    visible = ((slots >= start) & (slots < lengths[:, None, None])
               & (slots <= positions[:, :, None]))
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bthk,bkv->bthv", p.astype(dtype), blk[..., :v_dim],
                    preferred_element_type=jnp.float32, precision=precision)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

  init = (jnp.full((b, t, h), _NEG, jnp.float32), jnp.zeros((b, t, h), jnp.float32),
          jnp.zeros((b, t, h, v_dim), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, steps, step, init)
  return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
