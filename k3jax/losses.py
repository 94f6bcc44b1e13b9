"""LM head + masked next-token cross-entropy without materialising [N, V] logits.

CE_i = logsumexp_v(h_i . w_v) - h_i . w_{t_i}; the loss is sum_i m_i CE_i / max(sum_i m_i, 1)
(the main loss and MTP's, report §4.1.4). The dense form writes [N, V] fp32 logits (V = 163,840:
10.7 GB at B 2 x T 8192) and their gradient. Here the logits exist one [bt, bv] block at a time
(`lax.scan` over token blocks, inside it over vocabulary blocks): an online logsumexp in fp32
gives each row's normaliser, then dlogits = m_i (softmax - onehot) forms dh += dlogits w_blk^T
and dW_blk += h_blk^T dlogits in fp32. As the loss is a scalar, a `jax.custom_vjp` forms these
gradients in its forward pass (for a cotangent of 1) and its backward only scales them: with one
vocabulary block (the default) that is 3 matmuls of [N, d, V], the dense form's count. Matmuls
take the operands' dtype (bf16 in training) with fp32 accumulation (`preferred_element_type`);
dlogits is cast to that dtype for its two matmuls.

Sizes need not divide the blocks: the last block of each axis is shifted back to end at N (or V)
and its rows (columns) already covered by the previous block are masked out.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax

# H100, N 16384 x d 1024 x V 163840 bf16, fwd+bwd (benchmarks/lm_head.py, 2026-12-06): 34.3 ms
# (2048: 35.5, 8192: 33.8 for twice the logits block, dense 60.9).
BLOCK_TOKENS = 4096


def lm_head_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, *,
                          block_tokens: int = BLOCK_TOKENS, block_vocab: int | None = None
                          ) -> tuple[jax.Array, jax.Array]:
  """h [..., d], LM head w [d, V], targets and mask [...] -> (mean CE over mask, count).

  Equals `optax.softmax_cross_entropy_with_integer_labels(h @ w in fp32, targets)` averaged with
  weights `mask` over max(sum(mask), 1), the count. h and w are multiplied in their promoted
  dtype; cotangents come back in each one's own dtype. Blocks larger than N or V are clipped;
  block_vocab None: the whole vocabulary (each block's logits serve the loss and the gradients).
  """
  if h.ndim < 2:
    raise ValueError(f"h must be [..., d] with at least one token axis, got {h.shape}")
  if w.ndim != 2 or w.shape[0] != h.shape[-1]:
    raise ValueError(f"w must be [d, V] with d = {h.shape[-1]} (h's last axis), got {w.shape}")
  if targets.shape != h.shape[:-1] or mask.shape != h.shape[:-1]:
    raise ValueError(f"targets and mask must be h's token axes {h.shape[:-1]}, got "
                     f"{targets.shape} and {mask.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
  block_vocab = w.shape[1] if block_vocab is None else block_vocab
  for name, value in (("block_tokens", block_tokens), ("block_vocab", block_vocab)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  n = targets.size
  if n == 0:
    raise ValueError(f"h must hold at least one token, got {h.shape}")
  dtype = jnp.promote_types(h.dtype, w.dtype)
  weights = mask.reshape(n).astype(jnp.float32)
  with jax.named_scope("lm_head_ce"):
    loss_sum = _ce_sum(h.reshape(n, -1).astype(dtype), w.astype(dtype),
                       targets.reshape(n).astype(jnp.int32), weights,
                       min(block_tokens, n), min(block_vocab, w.shape[1]), jnp.dtype(dtype).name)
    count = jnp.maximum(jnp.sum(weights), 1.0)
    return loss_sum / count, count


def _block_start(index: jax.Array, block: int, size: int) -> jax.Array:
  """First row (column) of block `index`; the last block ends at `size`."""
  return jnp.minimum(index * block, size - block)


def _block_logits(h_blk: jax.Array, w: jax.Array, j: jax.Array, bv: int):
  """Logits [bt, bv] fp32 of vocabulary block j, columns of earlier blocks at -inf; the block's
  w [d, bv], and its column ids [bv] with those of earlier blocks at -1 (no target matches)."""
  v = w.shape[1]
  start = _block_start(j, bv, v)
  w_blk = lax.dynamic_slice_in_dim(w, start, bv, axis=1)
  cols = start + jnp.arange(bv, dtype=jnp.int32)
  new = cols >= j * bv
  logits = jnp.dot(h_blk, w_blk, preferred_element_type=jnp.float32)
  return jnp.where(new[None, :], logits, -jnp.inf), w_blk, jnp.where(new, cols, -1)


def _logsumexp(logits: jax.Array) -> jax.Array:
  """Row logsumexp [bt] of logits [bt, bv] fp32 in one read: a reduce of (running max, sum of
  exp(x - max)) pairs with one exp an element (`jax.nn.logsumexp` reads the logits twice, for the
  max and then for the sum)."""
  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    d = m2 - m1
    e = jnp.where(jnp.isnan(d), 0.0, jnp.exp(-jnp.abs(d)))  # both -inf: nothing to add
    return jnp.maximum(m1, m2), jnp.where(d > 0, s2 + s1 * e, s1 + s2 * e)

  m, s = lax.reduce((logits, jnp.ones_like(logits)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                    combine, (1,))
  return m + jnp.log(s)


def _ce_and_grads(h, w, targets, weights, bt: int, bv: int, grads: bool):
  """Per-token CE [N] fp32 and, with `grads`, the gradients of sum_i weights_i CE_i w.r.t. h
  [N, d] and w [d, V] (fp32; else None).

  Per token block: its logsumexp over vocabulary blocks (online: running max and sum), then
  dlogits = weights (softmax - onehot) block by block. With one vocabulary block (bv = V) the
  block's logits serve both (one matmul for the logits, two for the gradients); with more, each
  block's logits are computed again for the gradients (once the row's logsumexp is known).
  """
  n, v = targets.shape[0], w.shape[1]
  nv = -(-v // bv)

  def token_block(carry, i):
    ce_all, dh, dw = carry
    r0 = _block_start(i, bt, n)
    h_blk = lax.dynamic_slice_in_dim(h, r0, bt)
    t_blk = lax.dynamic_slice_in_dim(targets, r0, bt)
    if nv == 1:
      logits, w_blk, cols = _block_logits(h_blk, w, 0, bv)
      lse = _logsumexp(logits)
      tgt = jnp.sum(jnp.where(cols[None, :] == t_blk[:, None], logits, 0.0), axis=1)
    else:
      def vocab_block(c, j):
        m, s, tgt = c
        logits, _, cols = _block_logits(h_blk, w, j, bv)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols[None, :] == t_blk[:, None], logits, 0.0), axis=1)
        return (m_new, s, tgt), None

      zeros = jnp.zeros((bt,), jnp.float32)
      (m, s, tgt), _ = lax.scan(vocab_block, (jnp.full((bt,), -jnp.inf), zeros, zeros),
                                jnp.arange(nv))
      lse = m + jnp.log(s)
    ce_all = lax.dynamic_update_slice_in_dim(ce_all, lse - tgt, r0, 0)
    if not grads:
      return (ce_all, dh, dw), None
    rows = r0 + jnp.arange(bt, dtype=jnp.int32)
    sc = jnp.where(rows >= i * bt, lax.dynamic_slice_in_dim(weights, r0, bt), 0.0)

    def grad_block(dh_blk, dw, j, logits, w_blk, cols):
      onehot = cols[None, :] == t_blk[:, None]
      dlogits = (sc[:, None] * (jnp.exp(logits - lse[:, None]) - onehot)).astype(h.dtype)
      dh_blk = dh_blk + jnp.dot(dlogits, w_blk.T, preferred_element_type=jnp.float32)
      c0 = _block_start(j, bv, v)
      dw_blk = lax.dynamic_slice_in_dim(dw, c0, bv, axis=1) + jnp.dot(
          h_blk.T, dlogits, preferred_element_type=jnp.float32)
      return dh_blk, lax.dynamic_update_slice_in_dim(dw, dw_blk, c0, axis=1)

    dh_blk = jnp.zeros(h_blk.shape, jnp.float32)
    if nv == 1:
      dh_blk, dw = grad_block(dh_blk, dw, 0, logits, w_blk, cols)
    else:
      def vocab_grad_block(c, j):
        logits, w_blk, cols = _block_logits(h_blk, w, j, bv)
        return grad_block(*c, j, logits, w_blk, cols), None

      (dh_blk, dw), _ = lax.scan(vocab_grad_block, (dh_blk, dw), jnp.arange(nv))
    dh = lax.dynamic_update_slice_in_dim(
        dh, lax.dynamic_slice_in_dim(dh, r0, bt) + dh_blk, r0, 0)
    return (ce_all, dh, dw), None

  init = (jnp.zeros((n,), jnp.float32),
          jnp.zeros(h.shape, jnp.float32) if grads else None,
          jnp.zeros(w.shape, jnp.float32) if grads else None)
  (ce, dh, dw), _ = lax.scan(token_block, init, jnp.arange(-(-n // bt)))
  return ce, dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ce_sum(h, w, targets, weights, bt: int, bv: int, dtype: str) -> jax.Array:
  """sum_i weights_i CE_i: h [N, d], w [d, V] (both `dtype`), targets [N] int32, weights [N]
  fp32."""
  del dtype
  ce, _, _ = _ce_and_grads(h, w, targets, weights, bt, bv, grads=False)
  return jnp.sum(weights * ce)


def _ce_sum_fwd(h, w, targets, weights, bt, bv, dtype):
  """The loss is a scalar: its gradients for a cotangent of 1 are formed in the forward pass
  (no logits kept, none recomputed in the backward) and scaled by the cotangent there."""
  with jax.named_scope("lm_head_ce"):
    ce, dh, dw = _ce_and_grads(h, w, targets, weights, bt, bv, grads=True)
    return jnp.sum(weights * ce), (dh, dw, ce)


def _ce_sum_bwd(bt, bv, dtype, res, g):
  del bt, bv
  dh, dw, ce = res
  with jax.named_scope("lm_head_ce"):
    return (g * dh).astype(dtype), (g * dw).astype(dtype), None, g * ce


_ce_sum.defvjp(_ce_sum_fwd, _ce_sum_bwd)
