"""xla_blockwise tier: flash attention in plain JAX (FlashAttention-2, Dao 2023), any platform.

The queries are cut in blocks of `block_q` rows (`lax.map`, one block at a time); for each, a
`fori_loop` runs over the key blocks of `block_k` columns that the causal mask leaves visible,
keeping the online softmax's running row max m, sum l and output accumulator in fp32. No
[T, S] array is live: at most [B, H, block_q, block_k]. The running max of the visible logits
is the exact row max, so the per-head max logit (QK-Clip, report §2.5) comes with the output.
A custom VJP recomputes the scores blockwise from (q, k, v, o, logsumexp): dq by query blocks,
dk and dv by key blocks. Lengths are padded to whole blocks with segment id 0 (masked).
`q_offset` (an int32 scalar, traced or not) puts query i at causal position q_offset + i: a
context-parallel rank's queries against the gathered keys (report §5.2).
Matmuls take the inputs' dtype with fp32 accumulation (p and dS are cast to it, as in flash
kernels); softmax statistics stay fp32. `max_logit` is the scores-and-max pass alone.
"""
import functools

import jax
import jax.numpy as jnp

BLOCK_Q = 512
BLOCK_K = 512


def supports(q, k, v, *, segments: str, causal: bool, interpret: bool = False) -> str | None:
  """Takes every valid call."""
  return None


def _blocks(n: int, block: int) -> tuple[int, int]:
  """(block size, number of blocks) for a length n: the block shrinks to n when n is smaller."""
  b = min(block, n)
  return b, -(-n // b)


def _heads_first(x: jax.Array, padded: int) -> jax.Array:
  """[B, N, H, D] -> [B, H, padded, D], zero rows appended."""
  return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _segments(ids: jax.Array | None, b: int, n: int, padded: int) -> jax.Array:
  """[B, padded] int32 segment ids: ones where none were given, 0 on the padding."""
  ids = jnp.ones((b, n), jnp.int32) if ids is None else ids.astype(jnp.int32)
  return jnp.pad(ids, ((0, 0), (0, padded - n)))


def _kv_blocks_for(i, q_offset, bq: int, bk: int, nk: int, causal: bool):
  """Number of key blocks query block i sees (the causal ones stop at its last row)."""
  return jnp.clip((q_offset + (i + 1) * bq - 1) // bk + 1, 0, nk) if causal else nk


def _q_block_start(j, q_offset, bq: int, bk: int, causal: bool):
  """First query block that sees key block j."""
  return jnp.maximum((j * bk - q_offset) // bq, 0) if causal else 0


def _scores(q_i, k_j, qs_i, ks_j, i, j, q_offset, bq: int, bk: int, causal: bool, scale: float):
  """[B, H, bq, bk] fp32 scaled logits of query block i and key block j, -inf where masked."""
  s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
  vis = (qs_i[:, :, None] == ks_j[:, None, :]) & (qs_i[:, :, None] != 0)
  if causal:
    rows = q_offset + i * bq + jnp.arange(bq)
    cols = j * bk + jnp.arange(bk)
    vis = vis & (rows[:, None] >= cols[None, :])[None]
  return jnp.where(vis[:, None], s, -jnp.inf)


def _slice(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _forward(q, k, v, qs, ks, q_offset, causal, scale, block_q, block_k, with_output=True):
  """Padded heads-first blockwise forward.

  Returns (o [B, H, Tp, Dv] fp32 or None, lse [B, H, Tp], row max m [B, H, Tp]) with the
  padded lengths; rows without a visible key get o = 0, lse = 0, m = -inf."""
  b, t, h, _ = q.shape
  s_len = k.shape[1]
  bq, nq = _blocks(t, block_q)
  bk, nk = _blocks(s_len, block_k)
  qh, kh = _heads_first(q, nq * bq), _heads_first(k, nk * bk)
  vh = _heads_first(v, nk * bk) if with_output else None
  qs = _segments(qs, b, t, nq * bq)
  ks = _segments(ks, b, s_len, nk * bk)
  dv = v.shape[-1]

  def q_block(i):
    q_i, qs_i = _slice(qh, i * bq, bq, 2), _slice(qs, i * bq, bq, 1)

    def step(j, carry):
      m, l, acc = carry
      s = _scores(q_i, _slice(kh, j * bk, bk, 2), qs_i, _slice(ks, j * bk, bk, 1), i, j,
                  q_offset, bq, bk, causal, scale)
      m_new = jnp.maximum(m, s.max(-1))
      if not with_output:
        return m_new, l, acc
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[..., None])
      pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(vh.dtype), _slice(vh, j * bk, bk, 2),
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = (jnp.full((b, h, bq), -jnp.inf, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, dv if with_output else 0), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, _kv_blocks_for(i, q_offset, bq, bk, nk, causal), step,
                                  init)
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return o, lse, m

  o, lse, m = jax.lax.map(q_block, jnp.arange(nq))
  join = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, nq * bq, *x.shape[4:])
  return (join(o) if with_output else None), join(lse), join(m)


def max_logit(q: jax.Array, k: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> jax.Array:
  """Per-head max of the visible scaled logits [H] fp32 (-inf for a head with none), blockwise;
  not differentiated."""
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  _, _, m = _forward(q, k, k[..., :0], q_segment_ids, kv_segment_ids, 0, causal, scale,
                     block_q, block_k, with_output=False)
  return m.max(axis=(0, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, qs, ks, q_offset, causal, scale, block_q, block_k):
  return _flash_fwd(q, k, v, qs, ks, q_offset, causal, scale, block_q, block_k)[0]


def _flash_fwd(q, k, v, qs, ks, q_offset, causal, scale, block_q, block_k):
  t = q.shape[1]
  o, lse, m = _forward(q, k, v, qs, ks, q_offset, causal, scale, block_q, block_k)
  out = o[:, :, :t].transpose(0, 2, 1, 3).astype(q.dtype)
  return (out, m.max(axis=(0, 2))), (q, k, v, qs, ks, q_offset, out, lse)


def _flash_bwd(causal, scale, block_q, block_k, res, cotangents):
  """dq over query blocks, then dk and dv over key blocks (the max logit has no gradient)."""
  q, k, v, qs_in, ks_in, q_offset, out, lse = res
  do = cotangents[0]
  b, t, h, _ = q.shape
  s_len = k.shape[1]
  bq, nq = _blocks(t, block_q)
  bk, nk = _blocks(s_len, block_k)
  qh, kh, vh = _heads_first(q, nq * bq), _heads_first(k, nk * bk), _heads_first(v, nk * bk)
  doh = _heads_first(do.astype(q.dtype), nq * bq)
  delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, nq * bq - t)))
  qs, ks = _segments(qs_in, b, t, nq * bq), _segments(ks_in, b, s_len, nk * bk)

  def grads_of(i, j):
    """p [B, H, bq, bk] and dS (fp32) of block (i, j)."""
    q_i, k_j = _slice(qh, i * bq, bq, 2), _slice(kh, j * bk, bk, 2)
    s = _scores(q_i, k_j, _slice(qs, i * bq, bq, 1), _slice(ks, j * bk, bk, 1), i, j, q_offset,
                bq, bk, causal, scale)
    p = jnp.exp(s - _slice(lse, i * bq, bq, 2)[..., None])
    do_i = _slice(doh, i * bq, bq, 2)
    dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, _slice(vh, j * bk, bk, 2),
                    preferred_element_type=jnp.float32)
    return p, p * (dp - _slice(delta, i * bq, bq, 2)[..., None]), q_i, k_j, do_i

  def dq_block(i):
    def step(j, dq):
      _, ds, _, k_j, _ = grads_of(i, j)
      return dq + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(k.dtype), k_j,
                             preferred_element_type=jnp.float32)
    return jax.lax.fori_loop(0, _kv_blocks_for(i, q_offset, bq, bk, nk, causal), step,
                             jnp.zeros((b, h, bq, q.shape[-1]), jnp.float32)) * scale

  def dkv_block(j):
    def step(i, carry):
      dk, dv = carry
      p, ds, q_i, _, do_i = grads_of(i, j)
      dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p.astype(v.dtype), do_i,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds.astype(q.dtype), q_i,
                           preferred_element_type=jnp.float32)
      return dk, dv
    init = (jnp.zeros((b, h, bk, k.shape[-1]), jnp.float32),
            jnp.zeros((b, h, bk, v.shape[-1]), jnp.float32))
    dk, dv = jax.lax.fori_loop(_q_block_start(j, q_offset, bq, bk, causal), nq, step, init)
    return dk * scale, dv

  back = lambda x, n: jnp.moveaxis(x, 0, 2).reshape(b, h, -1, x.shape[-1])[:, :, :n].transpose(
      0, 2, 1, 3)
  dq = back(jax.lax.map(dq_block, jnp.arange(nq)), t)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(nk))
  return (dq.astype(q.dtype), back(dk, s_len).astype(k.dtype), back(dv, s_len).astype(v.dtype),
          None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float, q_offset=0,
              block_q: int = BLOCK_Q, block_k: int = BLOCK_K, interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:
  """(o [B, T, H, Dv] in q's dtype, per-head max logit [H] fp32); see the module docstring."""
  del interpret
  return _flash(q, k, v, q_segment_ids, kv_segment_ids, jnp.asarray(q_offset, jnp.int32), causal,
                float(scale), int(block_q), int(block_k))
