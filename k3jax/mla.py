"""Gated Multi-head Latent Attention with NoPE (report §2.1; k3_hf_names.md "Gated MLA layer").

q = W_qb RMSNorm(W_qa x) per head [nope | rope]; [c | k_rope] = W_kva x; [k_nope | v] = W_kvb
RMSNorm(c); k = [k_nope | k_rope] with the 64 "rope" channels never rotated; causal softmax at
scale (dn + dr)^-1/2; output W_o[sigmoid(W_g x) * o]. Training expands K/V per head; prefill
into the cache and decoding use the absorbed form over the 576-value latent cache
[RMSNorm(c) | k_rope].
Training attention is `pallas_kernels.attention` (flash attention tiers; the written-out form is
its reference tier), which also returns each head's max logit for QK-Clip; decoding is
`pallas_kernels.decode_attention`, which reads only the filled part of the cache.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import context_parallel
from k3jax import params
from k3jax.norms import rms_norm
from pallas_kernels import attention as attention_op
from pallas_kernels import decode_attention as decode_op
from pallas_kernels import decode_matmul


def expand_latent(lat: jax.Array, w_kv: jax.Array, kr: int, dn: int
                  ) -> tuple[jax.Array, jax.Array]:
  """Per-head keys and values from latents: lat [B, S, kr + dr], w_kv [kr, H, dn + dv] ->
  (k [B, S, H, dn + dr] = [k_nope | k_rope (unrotated, NoPE)], v [B, S, H, dv])."""
  kv = jnp.einsum("btr,rhk->bthk", lat[..., :kr], w_kv)
  k_rope = jnp.broadcast_to(lat[:, :, None, kr:], kv.shape[:3] + (lat.shape[-1] - kr,))
  return jnp.concatenate([kv[..., :dn], k_rope], axis=-1), kv[..., dn:]


class GatedMLA(nnx.Module):
  """A gated MLA token mixer; parameter paths follow the HF checkpoint."""

  def __init__(self, dim: int, *, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
               use_output_gate: bool, lora_norm_eps: float, rngs: nnx.Rngs,
               dtype=jnp.float32, param_dtype=jnp.float32, attention_impl: str = "",
               decode_attention_impl: str = ""):
    """attention_impl, decode_attention_impl: `pallas_kernels.attention` and
    `pallas_kernels.decode_attention` tiers ("" = the platform default)."""
    h, dn, dr, dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    self.num_heads, self.dn, self.dr, self.dv, self.kr = h, dn, dr, dv, kv_lora_rank
    self.eps, self.dtype, self.q_lora_rank = lora_norm_eps, dtype, q_lora_rank
    self.scale = (dn + dr) ** -0.5
    self.attention_impl = attention_impl or None
    self.decode_attention_impl = decode_attention_impl or None
    lin = params.fan_in_init((0,))
    proj = lambda shape, axes, init=lin: nnx.Dict(
        kernel=params.param(rngs, init, shape, axes, param_dtype))
    scale = lambda n, ax: nnx.Dict(scale=params.param(rngs, params.ones_init, (n,), (ax,)))
    if q_lora_rank:
      self.q_a_proj = proj((dim, q_lora_rank), ("embed", "q_lora"))
      self.q_a_layernorm = scale(q_lora_rank, "q_lora")
      self.q_b_proj = proj((q_lora_rank, h, dn + dr), ("q_lora", "heads", "kv"))
    else:
      self.q_proj = proj((dim, h, dn + dr), ("embed", "heads", "kv"))
    self.kv_a_proj_with_mqa = proj((dim, kv_lora_rank + dr), ("embed", "kv_lora"))
    self.kv_a_layernorm = scale(kv_lora_rank, "kv_lora")
    self.kv_b_proj = proj((kv_lora_rank, h, dn + dv), ("kv_lora", "heads", "kv"))
    self.use_output_gate = use_output_gate
    if use_output_gate:
      self.g_proj = proj((dim, h, dv), ("embed", "heads", "kv"))
    self.o_proj = proj((h, dv, dim), ("heads", "kv", "embed"), params.fan_in_init((0, 1)))
    self.prepared_decode_weights = nnx.data(None)   # `prepare_decode`'s, in a decode trace

  def _query(self, x):
    w = lambda p: p["kernel"][...].astype(self.dtype)
    if self.q_lora_rank:
      qa = rms_norm(x @ w(self.q_a_proj), self.q_a_layernorm["scale"][...], self.eps)
      return jnp.einsum("btr,rhk->bthk", qa, w(self.q_b_proj))
    return jnp.einsum("btd,dhk->bthk", x, w(self.q_proj))

  def latent(self, x: jax.Array) -> jax.Array:
    """The per-token cache entry [B, T, kr + dr] = [RMSNorm(c_kv) | k_rope] (576 for K3)."""
    kv_a = x.astype(self.dtype) @ self.kv_a_proj_with_mqa["kernel"][...].astype(self.dtype)
    c = rms_norm(kv_a[..., :self.kr], self.kv_a_layernorm["scale"][...], self.eps)
    return jnp.concatenate([c, kv_a[..., self.kr:]], axis=-1)

  def _gate(self, x):
    return jnp.einsum("btd,dhk->bthk", x, self.g_proj["kernel"][...].astype(self.dtype))

  def _output(self, x, o, z=None):
    """W_o[sigmoid(z) * o], z = W_g x unless given."""
    if self.use_output_gate:
      z = self._gate(x) if z is None else z
      o = o * jax.nn.sigmoid(z.astype(jnp.float32))
    return jnp.einsum("bthk,hkd->btd", o.astype(self.dtype),
                      self.o_proj["kernel"][...].astype(self.dtype))

  def _w_uk(self) -> jax.Array:
    """W_UK [kr, H, dn] fp32, sliced from kv_b_proj before its convert (so that the convert
    fuses into the product)."""
    return self.kv_b_proj["kernel"][...][..., :self.dn].astype(jnp.float32)

  def _absorb(self, q: jax.Array) -> jax.Array:
    """q [B, T, H, dn + dr] -> the absorbed query [B, T, H, kr + dr] fp32: [W_UK,h^T q_nope,h |
    q_rope,h]."""
    q = q.astype(jnp.float32)
    q_abs = jnp.einsum("bthn,rhn->bthr", q[..., :self.dn], self._w_uk())
    return jnp.concatenate([q_abs, q[..., self.dn:]], axis=-1)

  def _absorbed_weight(self, w_q: jax.Array) -> jax.Array:
    """A query weight [r, H, dn + dr] with W_UK folded in: [r, H (kr + dr)] in the layer's
    dtype, [W_q,nope W_UK^T | W_q,rope] per head (the product of the weights in fp32)."""
    w_q = w_q.astype(jnp.float32)
    nope = jnp.einsum("rhn,khn->rhk", w_q[..., :self.dn], self._w_uk(),
                      precision=jax.lax.Precision.HIGHEST)
    w = jnp.concatenate([nope, w_q[..., self.dn:]], axis=-1)
    return w.astype(self.dtype).reshape(w_q.shape[0], -1)

  def decode_weights(self) -> tuple[jax.Array, jax.Array | None] | None:
    """(W_x, W_qb) bf16 for a cached call, or None where the layer computes in another dtype.
    W_x [d, q | kv_a | g]: the products of the input x side by side (W_q_a, or without a q LoRA
    W_q with W_UK folded in; W_kv_a; W_g with the output gate); W_qb [q_lora, H (kr + dr)]: W_q_b
    with W_UK folded in (`_absorbed_weight`: the absorbed query in one product), None without a
    q LoRA."""
    if self.dtype != jnp.bfloat16:
      return None
    d = self.kv_a_proj_with_mqa["kernel"].shape[0]
    w = lambda p: p["kernel"][...].astype(self.dtype).reshape(d, -1)
    if self.q_lora_rank:
      q, w_qb = w(self.q_a_proj), self._absorbed_weight(self.q_b_proj["kernel"][...])
    else:
      q, w_qb = self._absorbed_weight(self.q_proj["kernel"][...]), None
    gate = [w(self.g_proj)] if self.use_output_gate else []
    return jnp.concatenate([q, w(self.kv_a_proj_with_mqa), *gate], axis=1), w_qb

  def prepare_decode(self) -> None:
    """Computes `decode_weights` once for the cached calls that follow in the same trace (a
    decode loop calls it before its while loop: one GEMM of x a step in place of three, and
    one for the absorbed query in place of two)."""
    self.prepared_decode_weights = self.decode_weights()

  def decode_inputs(self, x: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """A cached call's products of x [B, T, d]: (the absorbed query [B, T, H, kr + dr] as
    `_absorb` forms it, the latents [B, T, kr + dr] as `latent`, the gate's z [B, T, H, dv] or
    None). With `prepare_decode`'s weights (a bf16 layer) the three come from one
    `pallas_kernels.decode_matmul` product (W_x) and the query from one more (W_qb, with a q
    LoRA), in bf16 with fp32 sums."""
    x = x.astype(self.dtype)
    if self.prepared_decode_weights is None:
      z = self._gate(x) if self.use_output_gate else None
      return self._absorb(self._query(x)), self.latent(x), z
    w_x, w_qb = self.prepared_decode_weights
    (b, t, d), h = x.shape, self.num_heads
    proj = decode_matmul.matmul(x.reshape(b * t, d), w_x)
    nq = self.q_lora_rank or h * (self.kr + self.dr)
    q, kv_a, z = jnp.split(proj, (nq, nq + self.kr + self.dr), axis=-1)
    if self.q_lora_rank:
      q = decode_matmul.matmul(rms_norm(q, self.q_a_layernorm["scale"][...], self.eps), w_qb)
    c = rms_norm(kv_a[:, :self.kr], self.kv_a_layernorm["scale"][...], self.eps)
    lat = jnp.concatenate([c, kv_a[:, self.kr:]], axis=-1).reshape(b, t, -1)
    z = z.reshape(b, t, h, self.dv) if self.use_output_gate else None
    return q.reshape(b, t, h, self.kr + self.dr), lat, z

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """x [B, T, d] -> (y [B, T, d], per-head max logit [H]); K/V expanded per head.

    Under a mesh with a `context` axis of size > 1 (report §5.2) the latents are all-gathered
    over it and each rank attends for its own queries (`context_parallel.mla_attention`)."""
    x = x.astype(self.dtype)
    q = self._query(x)
    lat = self.latent(x)
    w_kv = self.kv_b_proj["kernel"][...].astype(self.dtype)
    del positions  # within a document positions follow the token order: causal by index
    if context_parallel.context_size() > 1:
      o, max_logit = context_parallel.mla_attention(
          q, lat, w_kv, segment_ids, expand=lambda l, w: expand_latent(l, w, self.kr, self.dn),
          scale=self.scale, impl=self.attention_impl)
    else:
      k, v = expand_latent(lat, w_kv, self.kr, self.dn)
      o, max_logit = attention_op.attention(
          q, k, v, segment_ids=segment_ids, causal=True, scale=self.scale,
          return_max_logit=True, impl=self.attention_impl)
    return self._output(x, o), max_logit

  def decode(self, x: jax.Array, cache: jax.Array, lengths: jax.Array, positions: jax.Array,
             inputs: tuple[jax.Array, jax.Array | None] | None = None) -> jax.Array:
    """Absorbed MLA over the filled latent cache (MQA with kr+dr = 576-dim keys, kr = 512-dim
    values: the first kr channels of the same rows), `pallas_kernels.decode_attention`.

    x: [B, T, d] new tokens; cache: [B, S, kr+dr] latents, the new tokens' already written;
    lengths: [B] filled positions of each row (positions >= lengths[b] are never attended);
    positions: [B, T] the new tokens' positions (each sees the positions <= its own).
    score_h = (W_UK,h^T q_nope,h) . c + q_rope,h . k_rope;  o_h = W_UV,h (sum_s p_s c_s).
    The absorbed query is cast to the cache's dtype (bf16 operands for a bf16 model).
    inputs: (absorbed query, z) of `decode_inputs`, else formed from x.
    """
    x = x.astype(self.dtype)
    q_cat, z = inputs if inputs is not None else (self._absorb(self._query(x)), None)
    # W_UV sliced from kv_b_proj [kr, H, dn+dv] before its convert, as W_UK (`_w_uk`), so that
    # each fuses into its product (one fp32 copy of both was a kernel every decode step).
    w_uv = self.kv_b_proj["kernel"][...][..., self.dn:].astype(jnp.float32)
    o_lat = decode_op.decode_attention(q_cat.astype(cache.dtype), cache, lengths, v_dim=self.kr,
                                       scale=self.scale, q_positions=positions,
                                       impl=self.decode_attention_impl)
    o = jnp.einsum("bthr,rhv->bthv", o_lat.astype(jnp.float32), w_uv)
    return self._output(x, o, z)
