"""XLA tier (the reference): one KDA decode step written out in fp32 (report §2.1).

Per row b (one new token) and head h, from the projections proj [q | k | v | z | f_a | beta]:
  [q k v] = SiLU(sum_w [tail | x]_w conv_w)        causal depthwise conv over the W-1 cached
                                                  inputs and this one; the tail moves by one
  q = L2Norm(q) * scale, k = L2Norm(k)
  g = gate(f_a W_fb + dt_bias)                      `kda.reference.forget_gate`
  S = S * exp(g)[:, None];  S = S + beta k (v - S^T k)^T;  o = S^T q
  o = RMSNorm(o) * o_norm * sigmoid(z)
A row with lengths[b] == 0 is padding: g = 0, beta = 0 (its state passes unchanged) and its
conv tail stays.
"""
import jax
import jax.numpy as jnp

from k3jax.norms import rms_norm
from pallas_kernels.kda import reference

_F32 = jnp.float32


def supports(proj, conv_tail, *, f_b, interpret: bool = False) -> str | None:
  del proj, conv_tail, f_b, interpret
  return None


def kda_decode_step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths,
                    *, gate: str, lower_bound: float, scale: float, norm_eps: float):
  """See `api.kda_decode_step`."""
  r, h, k = f_b.shape
  b, hk = proj.shape[0], h * k
  x = proj.astype(_F32)
  tail = conv_tail.astype(_F32)
  xp = jnp.concatenate([tail, x[:, None, :3 * hk].reshape(b, 1, 3, hk)], axis=1)  # [B, W, 3, HK]
  y = jax.nn.silu(jnp.sum(xp * conv_weight.astype(_F32)[None], axis=1))   # [B, 3, HK]
  q, kk, v = (y[:, i].reshape(b, h, k) for i in range(3))
  q = reference.l2_normalize(q) * scale
  kk = reference.l2_normalize(kk)
  z = x[:, 3 * hk:4 * hk].reshape(b, h, k)
  f = jnp.einsum("br,rhk->bhk", x[:, 4 * hk:4 * hk + r], f_b.astype(_F32),
                 precision=jax.lax.Precision.HIGHEST)
  g = reference.forget_gate(f, a_log, dt_bias.reshape(h, k), gate, lower_bound)
  beta = jax.nn.sigmoid(x[:, 4 * hk + r:])                                  # [B, H]
  valid = jnp.ones((b,), bool) if lengths is None else lengths > 0
  g = jnp.where(valid[:, None, None], g, 0.0)
  beta = jnp.where(valid[:, None], beta, 0.0)
  s = state.astype(_F32) * jnp.exp(g)[..., None]
  u = v - jnp.einsum("bhkv,bhk->bhv", s, kk, precision=jax.lax.Precision.HIGHEST)
  s = s + (beta[..., None] * kk)[..., None] * u[..., None, :]
  o = jnp.einsum("bhkv,bhk->bhv", s, q, precision=jax.lax.Precision.HIGHEST)
  o = rms_norm(o, o_norm, norm_eps) * jax.nn.sigmoid(z)
  new_tail = jnp.where(valid[:, None, None, None], xp[:, 1:], tail).astype(conv_tail.dtype)
  return o.reshape(b, hk).astype(proj.dtype), new_tail, s
