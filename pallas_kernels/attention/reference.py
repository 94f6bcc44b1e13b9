"""Reference tier: softmax attention written out in fp32 over the whole [B, H, T, S] score array
(report §2.1's MLA attention, moved from `k3jax.mla`); the oracle of the other tiers.

Mask: key j is visible to query i iff (not causal or j <= q_offset + i) and, with segment ids,
q_segment_ids[i] == kv_segment_ids[j] != 0 (0 is padding: it neither attends nor is attended).
A query with no visible key gets o = 0. The per-head max logit is the max of scale * q.k over
the visible (b, i, j), -inf for a head with none.
"""
import jax
import jax.numpy as jnp


def mask(t: int, s: int, q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None,
         causal: bool, q_offset=0) -> jax.Array:
  """[B or 1, 1, T, S] bool: True where query i may attend key j."""
  m = jnp.ones((1, 1, t, s), bool)
  if causal:
    m = m & ((q_offset + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :])[None, None]
  if q_segment_ids is not None:
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    m = m & (same & (q_segment_ids[:, :, None] != 0))[:, None]
  return m


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float, q_offset=0
              ) -> tuple[jax.Array, jax.Array]:
  """q [B, T, H, Dk], k [B, S, H, Dk], v [B, S, H, Dv] -> (o [B, T, H, Dv] fp32, max logit [H]).

  q_offset: the causal position of query 0 (int or int32 scalar). Differentiable by JAX (the
  max logit too; the public op stops its gradient)."""
  s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  m = mask(q.shape[1], k.shape[1], q_segment_ids, kv_segment_ids, causal, q_offset)
  s = jnp.where(m, s, -jnp.inf)
  max_logit = jnp.max(s, axis=(0, 2, 3))
  row_max = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  e = jnp.exp(s - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  denom = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(denom > 0, denom, 1.0)
  o = jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32))
  return o, max_logit
