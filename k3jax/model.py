"""The K3 decoder (report §2, Figure 2): hybrid KDA / gated MLA, Block AttnRes, Stable LatentMoE.

Layer i (0-based) mixes tokens with gated MLA when i+1 is in `full_attn_layers` and with KDA
otherwise; its FFN is a dense SiTU-GLU for i < first_k_dense_replace (or when the config has no
experts) and a Stable LatentMoE after. With `attn_res_block_size` > 0 the layers are wired by
Block Attention Residuals; with 0, by an ordinary pre-norm residual stream (Kimi Linear).

With `scan_layers` the repeating unit of layers (`scan_plan`; K3: 3 KDA + 1 gated MLA layers)
is compiled once: the parameters stay stored per layer (`layers.{i}.*`), the states of the
scanned layers are stacked at call time and `jax.lax.scan` runs the unit over the stack; the
irregular layers before and after it run unrolled. Block AttnRes then keeps its completed
blocks in a fixed buffer [n_blocks, B, T, d] with a count (`attn_res.push_block`). Cached calls
(prefill, decode) run every layer unrolled on its own weights and cache: stacking copies each
scanned weight on every call, and a scan slices (copies) each unit's weights and caches, which
at k3_small's decode on the H200 took most of a token's time (benchmarks/decode.py).
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax import attn_res, params, sharding
from k3jax import mtp as mtp_lib
from k3jax import config as config_lib
from k3jax.kda import KDA
from k3jax.latent_moe import LatentMoE
from k3jax.mla import GatedMLA
from k3jax.norms import RMSNorm
from k3jax.situ import SiTUGLU
from pallas_kernels import ragged_dot as grouped_matmul


REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_mixer_out": jax.checkpoint_policies.save_only_these_names("mixer_out", "ffn_out"),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("mixer_out", "ffn_out"),
        offload_src="device", offload_dst="pinned_host"),
}
"""`model.remat` -> jax.checkpoint policy ("none": no rematerialisation). "full" keeps only the
layer's (or scanned unit's) inputs; "save_dots" also the matmul outputs without batch dims;
"save_mixer_out" the token mixer's and FFN's outputs (`checkpoint_name` "mixer_out", "ffn_out");
"offload" moves those two to pinned host memory instead of keeping them on the device."""


def remat(fn, name: str, static_argnums: tuple[int, ...] = ()):
  """`fn` rematerialised as `model.remat` = name says (nnx.remat, so module arguments work)."""
  if name == "none":
    return fn
  if name not in REMAT_POLICIES:
    raise ValueError(f"remat must be 'none' or one of {sorted(REMAT_POLICIES)}, got {name!r}")
  return nnx.remat(fn, policy=REMAT_POLICIES[name], static_argnums=static_argnums)


@functools.cache
def _ragged_dot(impl: str | None):
  """One partial per impl, so that layers of one kind have equal graphdefs (for the scan)."""
  return functools.partial(grouped_matmul.ragged_dot, impl=impl)


def layer_kinds(cfg: ml_collections.ConfigDict) -> tuple[tuple[str, bool], ...]:
  """(token mixer 'kda' | 'mla', MoE FFN?) of each 0-based layer."""
  moe = lambda i: bool(cfg.moe.num_experts) and i >= cfg.first_k_dense_replace
  return tuple((t, moe(i)) for i, t in enumerate(config_lib.layer_types(cfg)))


@dataclasses.dataclass(frozen=True)
class ScanPlan:
  """Layers start + u * period + j (unit u < units, position j < period) run in one scan."""
  start: int
  period: int
  units: int

  @property
  def stop(self) -> int:
    return self.start + self.period * self.units

  def layer(self, unit: int, position: int) -> int:
    return self.start + unit * self.period + position

  def scanned(self, index: int) -> bool:
    return self.start <= index < self.stop


@functools.cache
def _best_plan(kinds: tuple[tuple[str, bool], ...]) -> ScanPlan | None:
  n, best, best_key = len(kinds), None, None
  for period in range(1, n // 2 + 1):
    for start in range(n - 2 * period + 1):
      unit, units = kinds[start:start + period], 1
      while (start + (units + 1) * period <= n
             and kinds[start + units * period:start + (units + 1) * period] == unit):
        units += 1
      if units < 2:
        continue
      key = (n - units * period + period, -units * period, period, -start)
      if best_key is None or key < best_key:
        best, best_key = ScanPlan(start, period, units), key
  return best


def scan_plan(cfg: ml_collections.ConfigDict) -> ScanPlan | None:
  """The unit of layers to scan: fewest layer bodies to compile (unrolled layers + one unit).

  Ties go to more scanned layers, then the shorter unit, then the later start (the first unit
  boundary after the irregular leading layers). K3: layers 4..91 as 22 units of 3 KDA + 1 MLA,
  layers 0..3 and 92 unrolled. None when no unit of layers repeats (nothing to scan).
  """
  return _best_plan(layer_kinds(cfg))


class DecoderLayer(nnx.Module):
  """One decoder layer; attribute names follow HF `language_model.model.layers.{i}.*`.

  The layer index is not stored (layers of one kind have one graphdef, for the scan); AttnRes
  takes it as an argument.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, index: int, *, rngs: nnx.Rngs,
               kernels: ml_collections.ConfigDict | None = None):
    """cfg: the model config; kernels: the config's `kernels` section ("" = best available)."""
    kda_impl = kernels.kda_impl if kernels else ""
    gmm_impl = (kernels.ragged_dot_impl if kernels else "") or None
    gate_up_impl = (kernels.gate_up_impl if kernels else "") or None
    gate_up_train = kernels.gate_up_train if kernels else "kernel"
    attention_impl = kernels.attention_impl if kernels else ""
    decode_attention_impl = kernels.decode_attention_impl if kernels else ""
    kda_decode_impl = kernels.get("kda_decode_impl", "") if kernels else ""
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    dt, pdt = config_lib.dtype(cfg.dtype), config_lib.dtype(cfg.param_dtype)
    self.kind, self.is_moe = layer_kinds(cfg)[index]
    self.eps = eps
    self.input_layernorm = RMSNorm(d, eps, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, eps, rngs=rngs)
    if self.kind == "kda":
      k = cfg.kda
      self.self_attn = KDA(d, num_heads=k.num_heads, head_dim=k.head_dim,
                           conv_size=k.short_conv_kernel_size, gate=k.gate,
                           gate_lower_bound=k.gate_lower_bound,
                           use_full_rank_gate=k.use_full_rank_gate, eps=eps, rngs=rngs,
                           dtype=dt, param_dtype=pdt, impl=kda_impl,
                           decode_impl=kda_decode_impl)
    else:
      a = cfg.mla
      self.self_attn = GatedMLA(d, num_heads=a.num_heads, q_lora_rank=a.q_lora_rank,
                                kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                                qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                                use_output_gate=a.use_output_gate, lora_norm_eps=a.lora_norm_eps,
                                rngs=rngs, dtype=dt, param_dtype=pdt,
                                attention_impl=attention_impl,
                                decode_attention_impl=decode_attention_impl)
    if self.is_moe:
      e = cfg.moe
      self.block_sparse_moe = LatentMoE(
          d, num_experts=e.num_experts, top_k=e.num_experts_per_tok,
          n_shared_experts=e.n_shared_experts, moe_intermediate_size=e.moe_intermediate_size,
          latent_size=e.latent_size, routed_scaling_factor=e.routed_scaling_factor,
          norm_topk_prob=e.norm_topk_prob, beta1=cfg.situ_beta1, beta2=cfg.situ_beta2,
          rms_norm_eps=eps, qb_num_bins=e.qb_num_bins,
          qb_keep_scores=e.balancing == "quantile_exact", ragged_dot=_ragged_dot(gmm_impl),
          gate_up_impl=gate_up_impl, gate_up_train=gate_up_train,
          expert_parallel=e.expert_parallel, ep_capacity_factor=e.ep_capacity_factor,
          ep_all_to_all=e.ep_all_to_all, qat=e.qat, expert_format=e.expert_format,
          decode_experts=kernels.moe_decode_experts if kernels else "sorted", rngs=rngs,
          dtype=dt, param_dtype=pdt)
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
    """Norm then KDA or gated MLA. With `cache` (inference), also returns the updated cache;
    segment_ids [B, T] then marks each row's tokens (1) and its right padding (0)."""
    with jax.named_scope("norm"):
      h = self.input_layernorm(x)
    with jax.named_scope(self.kind):
      y, aux, new_cache = self._mix_tokens(h, segment_ids, positions, cache)
    return checkpoint_name(y, "mixer_out"), aux, new_cache

  def _mix_tokens(self, h, segment_ids, positions, cache):
    if cache is None:
      if self.kind == "kda":
        return self.self_attn(h, segment_ids=segment_ids)[0], {}, None
      y, max_logit = self.self_attn(h, segment_ids=segment_ids, positions=positions)
      return y, {"mla_max_logit": max_logit}, None
    lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)  # each row's own tokens
    if self.kind == "kda":
      y, new_cache = self.self_attn(h, cache=cache, lengths=lengths)
      return y, {}, new_cache
    # Row b's T latents at its positions (its padding too: later tokens overwrite it, and
    # attention reads only the filled positions < positions[b, 0] + lengths[b]).
    q, lat, z = self.self_attn.decode_inputs(h)
    latent = jax.vmap(lambda c, new, start: jax.lax.dynamic_update_slice_in_dim(
        c, new, start, axis=0))(cache["latent"], lat.astype(cache["latent"].dtype),
                                positions[:, 0])
    y = self.self_attn.decode(h, latent, positions[:, 0] + lengths, positions, inputs=(q, z))
    return y, {}, {"latent": latent}

  def init_cache(self, batch: int, max_len: int) -> dict:
    """KDA: recurrent state + conv caches; MLA: the latent cache [B, max_len, kr + dr]."""
    if self.kind == "kda":
      return self.self_attn.init_cache(batch)
    a = self.self_attn
    return {"latent": jnp.zeros((batch, max_len, a.kr + a.dr), a.dtype)}

  def ffn(self, x: jax.Array, cached: bool = False) -> tuple[jax.Array, dict[str, Any]]:
    """Norm then the dense FFN or the MoE (cached: a prefill or decode call)."""
    with jax.named_scope("norm"):
      h = self.post_attention_layernorm(x)
    if self.is_moe:
      with jax.named_scope("moe"):
        y, aux = self.block_sparse_moe(h, cached)
      return checkpoint_name(y, "ffn_out"), {"moe": aux}
    with jax.named_scope("dense_ffn"):
      y = self.mlp(h)
    return checkpoint_name(y, "ffn_out"), {}


def residual_layer(layer: DecoderLayer, x, segment_ids, positions, cache=None):
  """Pre-norm residual stream: x + attn(norm x), then + ffn(norm x)."""
  y, aux_a, cache = layer.token_mixer(x, segment_ids, positions, cache)
  x = x + y.astype(x.dtype)
  y, aux_f = layer.ffn(x, cache is not None)
  return x + y.astype(x.dtype), {**aux_a, **aux_f}, cache


def attn_res_layer(layer: DecoderLayer, blocks: list, partial, segment_ids, positions,
                   new_block: bool, cache=None):
  """One layer of Block AttnRes (k3_techniques.md §3, exact K3 wiring), blocks as a list.

  new_block: the layer's index is a multiple of the block size (partial becomes a block).
  """
  with jax.named_scope("attn_res"):
    h = attn_res.mix(blocks + [partial], layer.self_attention_res_norm,
                     layer.self_attention_res_proj, layer.eps) if blocks else partial
  if new_block:
    blocks = blocks + [partial]
    partial = jnp.zeros_like(partial)
  y, aux_a, cache = layer.token_mixer(h, segment_ids, positions, cache)
  partial = partial + y.astype(partial.dtype)
  with jax.named_scope("attn_res"):
    h = attn_res.mix(blocks + [partial], layer.mlp_res_norm, layer.mlp_res_proj, layer.eps)
  y, aux_f = layer.ffn(h, cache is not None)
  return blocks, partial + y.astype(partial.dtype), {**aux_a, **aux_f}, cache


def attn_res_buffered_layer(layer: DecoderLayer, index: jax.Array, state: tuple, segment_ids,
                            positions, block_size: int):
  """`attn_res_layer` with the blocks in a fixed buffer and a traced layer index (uncached).

  state: (blocks [N, B, T, d], count int32 scalar, partial [B, T, d]); returns (state, aux).
  """
  blocks, count, partial = state
  with jax.named_scope("attn_res"):
    h = attn_res.mix_masked(blocks, count, partial, layer.self_attention_res_norm,
                            layer.self_attention_res_proj, layer.eps)
    blocks, count, partial = attn_res.push_block(blocks, count, partial,
                                                 index % block_size == 0)
  y, aux_a, _ = layer.token_mixer(h, segment_ids, positions)
  partial = partial + y.astype(partial.dtype)
  with jax.named_scope("attn_res"):
    h = attn_res.mix_masked(blocks, count, partial, layer.mlp_res_norm, layer.mlp_res_proj,
                            layer.eps)
  y, aux_f = layer.ffn(h)
  return (blocks, count, partial + y.astype(partial.dtype)), {**aux_a, **aux_f}


def _layer_step(layer: DecoderLayer, index: jax.Array, carry, segment_ids, positions,
                block_size: int):
  """One layer of the scanned model: carry is x (residual) or the AttnRes buffer state."""
  if block_size:
    return attn_res_buffered_layer(layer, index, carry, segment_ids, positions, block_size)
  return residual_layer(layer, carry, segment_ids, positions)[:2]


def _stack(trees: list) -> Any:
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def run_units(graphdefs: list, states: list, first: jax.Array, carry, segment_ids, positions,
              block_size: int, remat_name: str):
  """`lax.scan` of the unit body over a run of U' units, rematerialised as `model.remat` says.

  graphdefs[j], states[j]: position j's graphdef and its states stacked over the units [U', ...]
  (a tuple, merged by `nnx.merge(graphdefs[j], *states[j])`); first [U'] int32: each unit's
  first layer. Returns (carry, aux per position stacked [U', ...]).
  """
  def unit(carry, xs):
    states, first = xs
    auxs = []
    for j, (graphdef, state) in enumerate(zip(graphdefs, states)):
      carry, aux = _layer_step(nnx.merge(graphdef, *sharding.fsdp_gather(state)), first + j,
                               carry, segment_ids, positions, block_size)
      auxs.append(aux)
    return carry, auxs

  if remat_name != "none":
    unit = jax.checkpoint(unit, policy=REMAT_POLICIES[remat_name], prevent_cse=False)
  return jax.lax.scan(unit, carry, (states, first))


class K3ForCausalLM(nnx.Module):
  """The K3 language model; attribute names follow HF `language_model.model.*`."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs,
               kernels: ml_collections.ConfigDict | None = None):
    d = cfg.hidden_size
    # Frozen: hashable, so that the model's graphdef can be a static jit argument
    # (`k3jax.generate`; nnx.jit's per-call walk of a k3_small cost ~1 s on a CPU host).
    self.cfg = ml_collections.FrozenConfigDict(cfg)
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
    self.remat = cfg.remat
    self.plan = scan_plan(cfg) if cfg.scan_layers else None
    if cfg.mtp_num_layers:
      self.mtp = mtp_lib.MTP(cfg, rngs=rngs, kernels=kernels)

  def embed(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed_tokens["embedding"][...], tokens, axis=0).astype(self.dtype)

  def logits(self, h: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", h, self.lm_head["kernel"][...].astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                    positions: jax.Array | None = None, cache: dict | None = None,
                    lengths: jax.Array | None = None
                    ) -> tuple[jax.Array, dict[str, Any], dict | None]:
    """tokens [B, T] -> (final normed hidden [B, T, d], aux per layer index, new cache).

    With `cache` (from `init_cache`), row b's tokens continue its cached sequence at position
    `cache["index"][b]` (prefill or decode) and the updated cache is returned; else None.
    lengths [B] int (with a cache; default T): row b's first lengths[b] tokens are its own, the
    rest right padding that enters no KDA state and no attended latent; its index advances by
    lengths[b]. The latent cache needs index[b] + T <= S slots. A cached call (inference,
    never differentiated) is not rematerialised.
    """
    b, t = tokens.shape
    if lengths is not None and cache is None:
      raise ValueError("lengths applies to a cached call only (pass cache=)")
    if cache is not None:
      steps = jnp.arange(t, dtype=jnp.int32)[None, :]
      positions = cache["index"][:, None] + steps
      lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
      segment_ids = (steps < lengths[:, None]).astype(jnp.int32)
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = self.embed(tokens)
    if self.plan is None or cache is not None:
      x, aux, layers = self._unrolled(x, segment_ids, positions, cache)
    else:
      (x, aux), layers = self._scanned(x, segment_ids, positions), None
    new_cache = None if cache is None else {"index": cache["index"] + lengths, "layers": layers}
    return self.norm(x), aux, new_cache

  def _unrolled(self, x, segment_ids, positions, cache):
    """Every layer in a Python loop; Block AttnRes keeps its blocks in a list."""
    layer_caches = [None] * len(self.layers) if cache is None else cache["layers"]
    policy = self.remat if cache is None else "none"
    aux, new_caches = {}, []
    if self.block_size:
      fn = remat(attn_res_layer, policy, static_argnums=(5,))
      blocks, partial = [], x
      for i, (layer, lc) in enumerate(zip(self.layers, layer_caches)):
        blocks, partial, aux[i], lc = fn(layer, blocks, partial, segment_ids, positions,
                                         i % self.block_size == 0, lc)
        new_caches.append(lc)
      with jax.named_scope("attn_res"):
        x = attn_res.mix(blocks + [partial], self.output_attn_res_norm,
                         self.output_attn_res_proj, self.cfg.rms_norm_eps)
    else:
      fn = remat(residual_layer, policy)
      for i, (layer, lc) in enumerate(zip(self.layers, layer_caches)):
        x, aux[i], lc = fn(layer, x, segment_ids, positions, lc)
        new_caches.append(lc)
    return x, aux, new_caches

  def _scanned(self, x, segment_ids, positions):
    """The irregular layers unrolled around one `lax.scan` over the units of `self.plan`."""
    plan, n_layers = self.plan, len(self.layers)
    carry, aux = self.run_layers(range(plan.start), self.initial_carry(x), segment_ids,
                                 positions)
    carry, unit_aux = self._scan_units(carry, segment_ids, positions)
    carry, tail_aux = self.run_layers(range(plan.stop, n_layers), carry, segment_ids, positions)
    aux = dict(sorted({**aux, **unit_aux, **tail_aux}.items()))
    return self.output_hidden(carry), aux

  def initial_carry(self, x: jax.Array):
    """The scanned decoder's carry at the embedding x [B, T, d]: x, or Block AttnRes's
    (empty block buffer [n_blocks, B, T, d], count 0, partial sum x)."""
    if not self.block_size:
      return x
    n_blocks = (len(self.layers) - 1) // self.block_size + 1
    return jnp.zeros((n_blocks,) + x.shape, x.dtype), jnp.zeros((), jnp.int32), x

  def output_hidden(self, carry) -> jax.Array:
    """The decoder's output [B, T, d] before the final norm: x, or the output AttnRes mix."""
    if not self.block_size:
      return carry
    with jax.named_scope("attn_res"):
      return attn_res.mix_masked(*carry, self.output_attn_res_norm, self.output_attn_res_proj,
                                 self.cfg.rms_norm_eps)

  def run_layers(self, indices, carry, segment_ids, positions):
    """Layers `indices` (outside the scan) one after another on the carry, rematerialised as
    `model.remat` says. Returns (carry, aux per layer index)."""
    step = remat(_layer_step, self.remat, static_argnums=(5,))
    aux = {}
    for i in indices:
      carry, aux[i] = step(self.layers[i], jnp.int32(i), carry, segment_ids, positions,
                           self.block_size)
    return carry, aux

  def unit_states(self, *filters) -> tuple[list, list]:
    """(graphdef, states stacked over units [U, ...]) of each position j of the unit: one state
    per `nnx.split` filter (the whole state without filters), as a tuple."""
    plan, graphdefs, states = self.plan, [], []
    for j in range(plan.period):
      splits = [nnx.split(self.layers[plan.layer(u, j)], *filters) for u in range(plan.units)]
      for u, (graphdef, *_) in enumerate(splits):
        if graphdef != splits[0][0]:
          raise ValueError(f"layers {plan.layer(0, j)} and {plan.layer(u, j)} share a position "
                           "in the scanned unit but differ in structure")
      graphdefs.append(splits[0][0])
      states.append(tuple(_stack([split[k] for split in splits])
                          for k in range(1, len(splits[0]))))
    return graphdefs, states

  def _scan_units(self, carry, segment_ids, positions):
    """`lax.scan` of the unit body over the stacked layer states, rematerialised as
    `model.remat` says. Returns (carry, aux per layer index)."""
    plan = self.plan
    graphdefs, states = self.unit_states()
    first = plan.start + plan.period * jnp.arange(plan.units, dtype=jnp.int32)
    carry, auxs = run_units(graphdefs, states, first, carry, segment_ids, positions,
                            self.block_size, self.remat)
    aux = {plan.layer(u, j): jax.tree.map(lambda a, u=u: a[u], auxs[j])
           for u in range(plan.units) for j in range(plan.period)}
    return carry, aux

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [B, T] -> (logits [B, T, V] fp32, aux)."""
    h, aux, _ = self.hidden_states(tokens, segment_ids, positions)
    return self.logits(h), aux

  def init_cache(self, batch: int, max_len: int) -> dict:
    """The dual cache (report §5.4): KDA states and conv tails, MLA latents of 576 a token.

    "index": [B] int32, each row's filled length (its next position); "layers": each layer's
    cache in layer order (cached calls run the layers unrolled). max_len: latent slots.
    """
    return {"index": jnp.zeros((batch,), jnp.int32),
            "layers": [layer.init_cache(batch, max_len) for layer in self.layers]}

  def prepare_decode(self) -> None:
    """Each token mixer's and MoE's `prepare_decode`: call once before a decode loop, in its
    trace."""
    for layer in self.layers:
      layer.self_attn.prepare_decode()
      if layer.is_moe:
        layer.block_sparse_moe.prepare_decode()

  def extend(self, tokens: jax.Array, cache: dict, lengths: jax.Array | None = None
             ) -> tuple[jax.Array, dict]:
    """Prefill or decode: logits [B, T, V] of `tokens` continuing `cache`, and the new cache
    (lengths [B]: each row's own tokens, the rest right padding; see `hidden_states`)."""
    h, _, cache = self.hidden_states(tokens, cache=cache, lengths=lengths)
    return self.logits(h), cache
