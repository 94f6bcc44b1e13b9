"""Block Attention Residuals (report Eq. 8-10; k3_techniques.md §3, exact K3 wiring).

There is no ordinary residual stream. Layer outputs are summed into the current block's partial
sum; each sublayer's input is a softmax mix over the completed block sums [b_0 (the embedding),
b_1, ...] and the partial sum, scored by a learned pseudo-query against RMS-normalised keys
(values are not normalised).
"""
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import params


def attn_res_mix(sources: list[jax.Array], query: jax.Array, norm_scale: jax.Array,
                 eps: float) -> jax.Array:
  """h = sum_i softmax_i(<v_i / rms(v_i), norm_scale * query>) v_i, in fp32 (Eq. 9).

  sources: S arrays [B, T, d]; query, norm_scale: [d]. Returns [B, T, d] in the sources' dtype.
  """
  v = jnp.stack(sources).astype(jnp.float32)  # [S, B, T, d]
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  w = norm_scale.astype(jnp.float32) * query.astype(jnp.float32)
  alpha = jax.nn.softmax(jnp.einsum("sbtd,d->sbt", keys, w), axis=0)
  return jnp.einsum("sbt,sbtd->btd", alpha, v).astype(sources[-1].dtype)


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
  v = jnp.concatenate([blocks, partial[None].astype(blocks.dtype)]).astype(jnp.float32)
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  w = norm_scale.astype(jnp.float32) * query.astype(jnp.float32)
  slots = jnp.arange(n + 1)
  valid = (slots < count) | (slots == n)
  logits = jnp.where(valid[:, None, None], jnp.einsum("sbtd,d->sbt", keys, w), -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sbt,sbtd->btd", alpha, v).astype(partial.dtype)


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
