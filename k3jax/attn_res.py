"""Block Attention Residuals (report Eq. 8-10; k3_techniques.md §3, exact K3 wiring).

There is no ordinary residual stream. Layer outputs are summed into the current block's partial
sum; each sublayer's input is a softmax mix over the completed block sums [b_0 (the embedding),
b_1, ...] and the partial sum, scored by a learned pseudo-query against RMS-normalised keys
(values are not normalised).
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import params


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mix(sources: tuple, valid: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """Softmax mix of sources (S arrays [B, T, d], those where `valid` [S]) scored by w [d] (Eq. 9).

  Per-source reductions and weighted sums, no einsum over the source axis (that lowers to B*T
  matmuls of [1, S] x [S, d]) and no stack of the sources; the keys v / rms(v) are never formed:
  <v / rms(v), w> = <v, w> / rms(v). The softmax over sources is elementwise over S arrays
  [B, T] (no reduction over a stacked axis), so XLA fuses it into the weighted sum: a mix is
  two kernels in a decode step, not three. Returns [B, T, d] in the last source's dtype.
  """
  return _mix_fwd(sources, valid, w, eps)[0]


def _mix_fwd(sources, valid, w, eps):
  a = [jnp.sum(v.astype(jnp.float32) * w, axis=-1) for v in sources]  # S x [B, T]
  r = [jax.lax.rsqrt(jnp.mean(jnp.square(v.astype(jnp.float32)), axis=-1) + eps)
       for v in sources]
  s = [jnp.where(valid[i], a[i] * r[i], -jnp.inf) for i in range(len(sources))]
  top = functools.reduce(jnp.maximum, s)
  e = [jnp.exp(si - top) for si in s]
  den = sum(e)
  p = [ei / den for ei in e]
  out = sum(pi[..., None] * v.astype(jnp.float32) for pi, v in zip(p, sources))
  return out.astype(sources[-1].dtype), (sources, valid, w, jnp.stack(a), jnp.stack(r),
                                         jnp.stack(p))


def _mix_bwd(eps, res, g):
  """Eq. 9's gradients from the forward's [S, B, T] statistics, one pass over each source for
  its dp and one for its dv (autodiff of the forward took 10x the forward's time in the k3_small
  step on an H200, 2026-12-03): dp_i = <g, v_i>, ds_i = p_i (dp_i - sum_j p_j dp_j), and
  with s_i = a_i r_i (a_i = <v_i, w>, r_i = rsqrt(mean(v_i^2) + eps), dr_i/dv_i = -r_i^3 v_i / d)
  dv_i = p_i g + ds_i r_i (w - a_i r_i^2 v_i / d), dw = sum_i sum_bt ds_i r_i v_i."""
  del eps
  sources, valid, w, a, r, p = res
  g = g.astype(jnp.float32)
  dp = jnp.stack([jnp.sum(g * v.astype(jnp.float32), axis=-1) for v in sources])
  valid = valid[:, None, None]  # masked sources get zeros, whatever their (unread) values
  pdp = jnp.where(valid, p * dp, 0.0)
  c = jnp.where(valid, (pdp - p * jnp.sum(pdp, axis=0)) * r, 0.0)  # ds_i r_i, [S, B, T]
  e = jnp.where(valid, c * a * r * r / w.shape[0], 0.0)
  # The barrier keeps each source's cotangent a buffer of its own dtype: a block feeds every
  # later mix, and without it XLA fused all of a block's terms (each mix's g in fp32) into one
  # kernel with the following norm's reduction (2.7 ms for the embedding's at k3_small, H200).
  dsources = jax.lax.optimization_barrier(tuple(
      (p[i][..., None] * g + c[i][..., None] * w - e[i][..., None] * v.astype(jnp.float32)
       ).astype(v.dtype) for i, v in enumerate(sources)))
  dw = sum(jnp.einsum("bt,btd->d", c[i], v.astype(jnp.float32)) for i, v in enumerate(sources))
  return dsources, None, dw


_mix.defvjp(_mix_fwd, _mix_bwd)


def _score_weight(query: jax.Array, norm_scale: jax.Array) -> jax.Array:
  return norm_scale.astype(jnp.float32) * query.astype(jnp.float32)


def attn_res_mix(sources: list[jax.Array], query: jax.Array, norm_scale: jax.Array,
                 eps: float) -> jax.Array:
  """h = sum_i softmax_i(<v_i / rms(v_i), norm_scale * query>) v_i, in fp32 (Eq. 9).

  sources: S arrays [B, T, d]; query, norm_scale: [d]. Returns [B, T, d] in the sources' dtype.
  """
  return _mix(tuple(sources), jnp.ones(len(sources), bool), _score_weight(query, norm_scale), eps)


def pseudo_query(dim: int, *, rngs: nnx.Rngs) -> tuple[nnx.Dict, nnx.Dict]:
  """(key-norm weight `*_res_norm.scale`, pseudo-query `*_res_proj.kernel`), both [d].

  The pseudo-query starts at zero, so every mix starts as a uniform average (report §2.2).
  """
  norm = nnx.Dict(scale=params.param(rngs, params.ones_init, (dim,), ("norm",)))
  proj = nnx.Dict(kernel=params.param(rngs, params.zeros_init, (dim,), ("norm",)))
  return norm, proj


def mix(sources: list[jax.Array], norm: nnx.Dict, proj: nnx.Dict, eps: float) -> jax.Array:
  return attn_res_mix(sources, proj["kernel"][...], norm["scale"][...], eps)


def attn_res_mix_masked(blocks: jax.Array, count: jax.Array, partial: jax.Array,
                        query: jax.Array, norm_scale: jax.Array, eps: float) -> jax.Array:
  """`attn_res_mix([blocks[0], ..., blocks[count - 1], partial], ...)` on a fixed-size buffer.

  blocks: [N, B, T, d], of which the first `count` (int32 scalar in [0, N]) are completed block
  sums; partial: [B, T, d]. The unused slots are masked out of the softmax over sources (Eq. 9),
  so they get zero weight. Returns [B, T, d] in partial's dtype.
  """
  n = blocks.shape[0]
  sources = tuple(jnp.squeeze(b, 0) for b in jnp.split(blocks, n)) + (partial,)
  valid = jnp.concatenate([jnp.arange(n) < count, jnp.ones(1, bool)])
  return _mix(sources, valid, _score_weight(query, norm_scale), eps)


def push_block(blocks: jax.Array, count: jax.Array, partial: jax.Array, boundary: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """At a block boundary (bool scalar), partial becomes completed block `count` and restarts at 0.

  blocks [N, B, T, d], count int32 scalar, partial [B, T, d] -> (blocks, count, partial). Only
  slot min(count, N - 1) is rewritten (with itself when not at a boundary), so the update can
  stay in place inside a loop.
  """
  slot = jnp.minimum(count, blocks.shape[0] - 1)
  kept = jax.lax.dynamic_index_in_dim(blocks, slot, 0, keepdims=False)
  blocks = jax.lax.dynamic_update_index_in_dim(
      blocks, jnp.where(boundary, partial.astype(blocks.dtype), kept), slot, 0)
  return (blocks, count + boundary.astype(count.dtype),
          jnp.where(boundary, jnp.zeros_like(partial), partial))


def mix_masked(blocks: jax.Array, count: jax.Array, partial: jax.Array, norm: nnx.Dict,
               proj: nnx.Dict, eps: float) -> jax.Array:
  return attn_res_mix_masked(blocks, count, partial, proj["kernel"][...], norm["scale"][...], eps)
