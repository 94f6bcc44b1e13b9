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


def _scores(v: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """<v / rms(v), w> over the last axis, fp32: [..., d] -> [...] (Eq. 9's logits)."""
  v = v.astype(jnp.float32)
  return jnp.sum(v * w, axis=-1) * jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)


def _mix(blocks: jax.Array, valid: jax.Array, partial: jax.Array, query: jax.Array,
         norm_scale: jax.Array, eps: float) -> jax.Array:
  """Softmax mix of blocks [N, B, T, d] (where `valid` [N]) and partial [B, T, d] (Eq. 9).

  Written as per-source reductions and weighted sums, not as einsums: an einsum over the
  source axis lowers to B*T matmuls of [1, S] x [S, d], far slower than one elementwise pass.
  The keys v / rms(v) are never formed: <v / rms(v), w> = <v, w> / rms(v).
  """
  w = norm_scale.astype(jnp.float32) * query.astype(jnp.float32)
  sb = jnp.where(valid[:, None, None], _scores(blocks, w, eps), -jnp.inf)  # [N, B, T]
  sp = _scores(partial, w, eps)  # [B, T]
  m = jnp.maximum(jnp.max(sb, axis=0, initial=-jnp.inf), sp)
  eb, ep = jnp.exp(sb - m), jnp.exp(sp - m)
  z = eb.sum(axis=0) + ep
  out = jnp.sum((eb / z)[..., None] * blocks.astype(jnp.float32), axis=0)
  return (out + (ep / z)[..., None] * partial.astype(jnp.float32)).astype(partial.dtype)


def attn_res_mix(sources: list[jax.Array], query: jax.Array, norm_scale: jax.Array,
                 eps: float) -> jax.Array:
  """h = sum_i softmax_i(<v_i / rms(v_i), norm_scale * query>) v_i, in fp32 (Eq. 9).

  sources: S arrays [B, T, d]; query, norm_scale: [d]. Returns [B, T, d] in the sources' dtype.
  """
  blocks = jnp.stack(sources[:-1]) if len(sources) > 1 else sources[-1][None][:0]
  return _mix(blocks, jnp.ones(blocks.shape[0], bool), sources[-1], query, norm_scale, eps)


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
  return _mix(blocks, jnp.arange(blocks.shape[0]) < count, partial, query, norm_scale, eps)


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
