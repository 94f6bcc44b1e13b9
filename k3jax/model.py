"""The K3 decoder (report §2, Figure 2): hybrid KDA / gated MLA, Block AttnRes, Stable LatentMoE.

Layer i (0-based) mixes tokens with gated MLA when i+1 is in `full_attn_layers` and with KDA
otherwise; its FFN is a dense SiTU-GLU for i < first_k_dense_replace (or when the config has no
experts) and a Stable LatentMoE after. With `attn_res_block_size` > 0 the layers are wired by
Block Attention Residuals; with 0, by an ordinary pre-norm residual stream (Kimi Linear).
"""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3jax import attn_res, params
from k3jax import mtp as mtp_lib
from k3jax import config as config_lib
from k3jax.kda import KDA
from k3jax.latent_moe import LatentMoE
from k3jax.mla import GatedMLA
from k3jax.norms import RMSNorm
from k3jax.situ import SiTUGLU
from pallas_kernels import ragged_dot as grouped_matmul


class DecoderLayer(nnx.Module):
  """One decoder layer; attribute names follow HF `language_model.model.layers.{i}.*`."""

  def __init__(self, cfg: ml_collections.ConfigDict, index: int, *, rngs: nnx.Rngs,
               kernels: ml_collections.ConfigDict | None = None):
    """cfg: the model config; kernels: the config's `kernels` section ("" = best available)."""
    kda_impl = kernels.kda_impl if kernels else ""
    gmm_impl = (kernels.ragged_dot_impl if kernels else "") or None
    gate_up_impl = (kernels.gate_up_impl if kernels else "") or None
    gate_up_train = kernels.gate_up_train if kernels else "kernel"
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    dt, pdt = config_lib.dtype(cfg.dtype), config_lib.dtype(cfg.param_dtype)
    self.index, self.kind = index, config_lib.layer_types(cfg)[index]
    self.eps = eps
    self.input_layernorm = RMSNorm(d, eps, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, eps, rngs=rngs)
    if self.kind == "kda":
      k = cfg.kda
      self.self_attn = KDA(d, num_heads=k.num_heads, head_dim=k.head_dim,
                           conv_size=k.short_conv_kernel_size, gate=k.gate,
                           gate_lower_bound=k.gate_lower_bound,
                           use_full_rank_gate=k.use_full_rank_gate, eps=eps, rngs=rngs,
                           dtype=dt, param_dtype=pdt, impl=kda_impl)
    else:
      a = cfg.mla
      self.self_attn = GatedMLA(d, num_heads=a.num_heads, q_lora_rank=a.q_lora_rank,
                                kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                                qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                                use_output_gate=a.use_output_gate, lora_norm_eps=a.lora_norm_eps,
                                rngs=rngs, dtype=dt, param_dtype=pdt)
    self.is_moe = bool(cfg.moe.num_experts) and index >= cfg.first_k_dense_replace
    if self.is_moe:
      e = cfg.moe
      self.block_sparse_moe = LatentMoE(
          d, num_experts=e.num_experts, top_k=e.num_experts_per_tok,
          n_shared_experts=e.n_shared_experts, moe_intermediate_size=e.moe_intermediate_size,
          latent_size=e.latent_size, routed_scaling_factor=e.routed_scaling_factor,
          norm_topk_prob=e.norm_topk_prob, beta1=cfg.situ_beta1, beta2=cfg.situ_beta2,
          rms_norm_eps=eps, qb_num_bins=e.qb_num_bins,
          qb_keep_scores=e.balancing == "quantile_exact",
          ragged_dot=functools.partial(grouped_matmul.ragged_dot, impl=gmm_impl),
          gate_up_impl=gate_up_impl, gate_up_train=gate_up_train, rngs=rngs, dtype=dt,
          param_dtype=pdt)
    else:
      self.mlp = SiTUGLU(d, cfg.dense_intermediate_size, beta1=cfg.situ_beta1,
                         beta2=cfg.situ_beta2, rngs=rngs, dtype=dt, param_dtype=pdt)
    self.attn_res = cfg.attn_res_block_size > 0
    if self.attn_res:
      self.self_attention_res_norm, self.self_attention_res_proj = attn_res.pseudo_query(
          d, rngs=rngs)
      self.mlp_res_norm, self.mlp_res_proj = attn_res.pseudo_query(d, rngs=rngs)

  def token_mixer(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                  cache: dict | None = None) -> tuple[jax.Array, dict[str, Any], dict | None]:
    """Norm then KDA or gated MLA. With `cache` (inference), also returns the updated cache."""
    h = self.input_layernorm(x)
    if self.kind == "kda":
      y, new_cache = self.self_attn(h, segment_ids=None if cache else segment_ids, cache=cache)
      return y, {}, new_cache
    if cache is None:
      y, max_logit = self.self_attn(h, segment_ids=segment_ids, positions=positions)
      return y, {"mla_max_logit": max_logit}, None
    latent = jax.lax.dynamic_update_slice_in_dim(
        cache["latent"], self.self_attn.latent(h).astype(cache["latent"].dtype),
        positions[0, 0], axis=1)
    slots = jnp.arange(latent.shape[1], dtype=jnp.int32)
    mask = (slots[None, None, None, :] <= positions[:, None, :, None])
    return self.self_attn.decode(h, latent, mask), {}, {"latent": latent}

  def init_cache(self, batch: int, max_len: int) -> dict:
    """KDA: recurrent state + conv caches; MLA: the latent cache [B, max_len, kr + dr]."""
    if self.kind == "kda":
      return self.self_attn.init_cache(batch)
    a = self.self_attn
    return {"latent": jnp.zeros((batch, max_len, a.kr + a.dr), a.dtype)}

  def ffn(self, x: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    h = self.post_attention_layernorm(x)
    if self.is_moe:
      y, aux = self.block_sparse_moe(h)
      return y, {"moe": aux}
    return self.mlp(h), {}


def residual_layer(layer: DecoderLayer, x, segment_ids, positions, cache=None):
  """Pre-norm residual stream: x + attn(norm x), then + ffn(norm x)."""
  y, aux_a, cache = layer.token_mixer(x, segment_ids, positions, cache)
  x = x + y.astype(x.dtype)
  y, aux_f = layer.ffn(x)
  return x + y.astype(x.dtype), {**aux_a, **aux_f}, cache


def attn_res_layer(layer: DecoderLayer, blocks: list, partial, segment_ids, positions,
                    block_size: int, cache=None):
  """One layer of Block AttnRes (k3_techniques.md §3, exact K3 wiring)."""
  h = attn_res.mix(blocks + [partial], layer.self_attention_res_norm,
                   layer.self_attention_res_proj, layer.eps) if blocks else partial
  if layer.index % block_size == 0:
    blocks = blocks + [partial]
    partial = jnp.zeros_like(partial)
  y, aux_a, cache = layer.token_mixer(h, segment_ids, positions, cache)
  partial = partial + y.astype(partial.dtype)
  h = attn_res.mix(blocks + [partial], layer.mlp_res_norm, layer.mlp_res_proj, layer.eps)
  y, aux_f = layer.ffn(h)
  return blocks, partial + y.astype(partial.dtype), {**aux_a, **aux_f}, cache


class K3ForCausalLM(nnx.Module):
  """The K3 language model; attribute names follow HF `language_model.model.*`."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs,
               kernels: ml_collections.ConfigDict | None = None):
    d = cfg.hidden_size
    self.cfg = cfg
    self.dtype = config_lib.dtype(cfg.dtype)
    pdt = config_lib.dtype(cfg.param_dtype)
    normal = lambda key, shape, dt: jax.random.normal(key, shape, jnp.float32).astype(dt)
    self.embed_tokens = nnx.Dict(embedding=params.param(
        rngs, normal, (cfg.vocab_size, d), ("vocab", "embed"), pdt))
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, kernels=kernels)
                            for i in range(cfg.num_layers)])
    self.block_size = cfg.attn_res_block_size
    if self.block_size:
      self.output_attn_res_norm, self.output_attn_res_proj = attn_res.pseudo_query(d, rngs=rngs)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs)
    self.lm_head = nnx.Dict(kernel=params.param(
        rngs, params.fan_in_init((0,)), (d, cfg.vocab_size), ("embed", "vocab"), pdt))
    self.remat = cfg.remat == "full"
    if cfg.mtp_num_layers:
      self.mtp = mtp_lib.MTP(cfg, rngs=rngs, kernels=kernels)

  def embed(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed_tokens["embedding"][...], tokens, axis=0).astype(self.dtype)

  def logits(self, h: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", h, self.lm_head["kernel"][...].astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                    positions: jax.Array | None = None, cache: dict | None = None
                    ) -> tuple[jax.Array, dict[str, Any], dict | None]:
    """tokens [B, T] -> (final normed hidden [B, T, d], aux per layer index, new cache).

    With `cache` (from `init_cache`), the T tokens continue the cached sequence at
    `cache["index"]` (prefill or decode) and the updated cache is returned; else None.
    """
    b, t = tokens.shape
    if cache is not None:
      positions = cache["index"] + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    layer_caches = [None] * len(self.layers) if cache is None else cache["layers"]
    new_caches = []
    x = self.embed(tokens)
    aux = {}
    if self.block_size:
      fn = nnx.remat(attn_res_layer, static_argnums=(5,)) if self.remat else attn_res_layer
      blocks, partial = [], x
      for layer, lc in zip(self.layers, layer_caches):
        blocks, partial, aux[layer.index], lc = fn(layer, blocks, partial, segment_ids,
                                                   positions, self.block_size, lc)
        new_caches.append(lc)
      x = attn_res.mix(blocks + [partial], self.output_attn_res_norm, self.output_attn_res_proj,
                       self.cfg.rms_norm_eps)
    else:
      fn = nnx.remat(residual_layer) if self.remat else residual_layer
      for layer, lc in zip(self.layers, layer_caches):
        x, aux[layer.index], lc = fn(layer, x, segment_ids, positions, lc)
        new_caches.append(lc)
    new_cache = None if cache is None else {"index": cache["index"] + t, "layers": new_caches}
    return self.norm(x), aux, new_cache

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [B, T] -> (logits [B, T, V] fp32, aux)."""
    h, aux, _ = self.hidden_states(tokens, segment_ids, positions)
    return self.logits(h), aux

  def init_cache(self, batch: int, max_len: int) -> dict:
    """The dual cache (report §5.4): KDA states and conv tails, MLA latents of 576 a token."""
    return {"index": jnp.zeros((), jnp.int32),
            "layers": [layer.init_cache(batch, max_len) for layer in self.layers]}

  def extend(self, tokens: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Prefill or decode: logits [B, T, V] of `tokens` continuing `cache`, and the new cache."""
    h, _, cache = self.hidden_states(tokens, cache=cache)
    return self.logits(h), cache
