"""Reference tier: absorbed-MLA decode attention written out in fp32 over the whole cache (report
§2.1's decoding over the latent cache); the oracle of the other tiers.

Query t of row b (at position pos[b, t]) sees cache position s iff s < lengths[b] and
s <= pos[b, t]; its logits are scale * q . cache[s, :Dk] and its values cache[s, :v_dim]. A query
that sees nothing gets o = 0. Products at HIGHEST precision on fp32 copies of the inputs.
"""
import jax
import jax.numpy as jnp


def supports(q, cache, lengths, *, v_dim: int, q_positions, interpret: bool = False
             ) -> str | None:
  """Takes every valid call."""
  return None


def mask(lengths: jax.Array, positions: jax.Array, s: int) -> jax.Array:
  """[B, T, S] bool: True where query t of row b sees cache position s."""
  slots = jnp.arange(s, dtype=jnp.int32)[None, None, :]
  return (slots < lengths[:, None, None]) & (slots <= positions[:, :, None])


def decode_attention(q: jax.Array, cache: jax.Array, lengths: jax.Array, positions: jax.Array,
                     *, v_dim: int, scale: float) -> jax.Array:
  """q [B, T, H, Dk], cache [B, S, Dk], lengths [B] int32 (in [0, S]), positions [B, T] int32
  -> o [B, T, H, v_dim] fp32."""
  hi = jax.lax.Precision.HIGHEST
  c = cache.astype(jnp.float32)
  s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), c, precision=hi) * scale
  visible = mask(lengths, positions, cache.shape[1])[:, :, None, :]
  s = jnp.where(visible, s, -jnp.inf)
  row_max = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  denom = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(denom > 0, denom, 1.0)
  return jnp.einsum("bths,bsv->bthv", p, c[..., :v_dim], precision=hi)
