"""Kimi K3 checkpoints in Hugging Face form (k3_hf_names.md): loaded into and saved from k3jax.

A checkpoint directory holds `config.json` (model_type "kimi_k3", the text model under
`text_config`) and `model.safetensors`, or shards listed in `model.safetensors.index.json`.
Tensors are read one at a time (`safetensors.safe_open`) and written shard by shard: the whole
checkpoint is never in host memory at once.

Parameter paths follow the HF names (WORKSPACE.md, Conventions), so the mapping is one table
(its rows by scope: `_MODEL_ROWS`, `_LAYER_ROWS`, `_MTP_ROWS`): k3jax path <-> HF name and the
transform between them:
  "copy"      the same array (norm `weight` -> `scale`, dt_bias, the router bias, embeddings)
  "linear"    W [out, in] -> kernel [in, *out]: W^T, the output axis split into heads
  "linear_in" W [out, in] -> kernel [*in, out]: W^T, the input axis split into heads (o_proj)
  "row"       W [1, d] -> kernel [d] (AttnRes pseudo-queries)
  "conv"      W [C, 1, K] -> kernel [K, C] (KDA short convs)
  "a_log"     A_log [ceil(H/128)*128] (zero padded) -> [H]
  "experts"   experts.{e}.w*.weight [out, in], or its MXFP4 `weight_packed` uint8 [out, in/2] and
              `weight_scale` uint8 [out, in/32] (`k3jax.mx.unpack_k3`) -> [E, in, out], each
              expert transposed, stacked
  "packed"    experts.{e}.w*.weight_packed -> experts.w*_packed [E, out, in/2], stacked, the bytes
              as they are (a bfloat16 `weight` is packed by `k3jax.mx.pack_k3`): the model holds
              these instead of "experts" with `model.moe.expert_format` "mxfp4"
  "scale"     the same for weight_scale -> experts.w*_scale [E, out, in/32]
The release stores A_log, dt_bias, the conv weights, o_norm and the routers'
e_score_correction_bias in float32, every other tensor in bfloat16, the routed experts in MXFP4.

MTP: the release has none (`num_nextn_predict_layers` 0). A k3jax MTP layer is written as
DeepSeek-V3 checkpoints write theirs: the MTP depth is decoder layer L = num_hidden_layers
(`layers.{L}.enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, its decoder block under the
usual layer names), with copies of the embedding (`layers.{L}.embed_tokens`) and of the LM head
(`layers.{L}.shared_head.head`), which k3jax shares with the main model.
"""
import dataclasses
import json
import math
import os
import shutil
import tempfile
from contextlib import ExitStack
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from experiments.configs import base as base_config
from k3jax import checkpoint, mx, sharding
from k3jax import config as config_lib
from k3jax import mtp as mtp_lib
from k3jax.model import K3ForCausalLM

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TEXT = "language_model."
MODEL = TEXT + "model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # not part of the text model
EXPERT_FORMATS = ("mxfp4", "bf16")
A_LOG_PAD = 128
LORA_NORM_EPS = 1e-6  # the HF model's q_a / kv_a layernorm eps (not in config.json)


class HFCheckpointError(checkpoint.CheckpointError):
  """A Hugging Face checkpoint k3jax cannot read or write; the message names the tensor, file
  or config field."""


# The name table: (k3jax path, HF name, transform, stored in float32 by the release). Model
# rows are relative to `language_model.`; layer rows to `layers.{i}.` on both sides
# (`language_model.model.layers.{i}.` in HF); MTP rows to `mtp.` and HF layer L.
_MODEL_ROWS = (
    ("embed_tokens.embedding", "model.embed_tokens.weight", "copy", False),
    ("norm.scale", "model.norm.weight", "copy", False),
    ("output_attn_res_norm.scale", "model.output_attn_res_norm.weight", "copy", False),
    ("output_attn_res_proj.kernel", "model.output_attn_res_proj.weight", "row", False),
    ("lm_head.kernel", "lm_head.weight", "linear", False),
)
_LAYER_ROWS = (
    ("input_layernorm.scale", "input_layernorm.weight", "copy", False),
    ("post_attention_layernorm.scale", "post_attention_layernorm.weight", "copy", False),
    ("self_attention_res_norm.scale", "self_attention_res_norm.weight", "copy", False),
    ("self_attention_res_proj.kernel", "self_attention_res_proj.weight", "row", False),
    ("mlp_res_norm.scale", "mlp_res_norm.weight", "copy", False),
    ("mlp_res_proj.kernel", "mlp_res_proj.weight", "row", False),
    # KDA
    ("self_attn.q_proj.kernel", "self_attn.q_proj.weight", "linear", False),
    ("self_attn.k_proj.kernel", "self_attn.k_proj.weight", "linear", False),
    ("self_attn.v_proj.kernel", "self_attn.v_proj.weight", "linear", False),
    ("self_attn.q_conv1d.kernel", "self_attn.q_conv1d.weight", "conv", True),
    ("self_attn.k_conv1d.kernel", "self_attn.k_conv1d.weight", "conv", True),
    ("self_attn.v_conv1d.kernel", "self_attn.v_conv1d.weight", "conv", True),
    ("self_attn.A_log", "self_attn.A_log", "a_log", True),
    ("self_attn.dt_bias", "self_attn.dt_bias", "copy", True),
    ("self_attn.f_a_proj.kernel", "self_attn.f_a_proj.weight", "linear", False),
    ("self_attn.f_b_proj.kernel", "self_attn.f_b_proj.weight", "linear", False),
    ("self_attn.b_proj.kernel", "self_attn.b_proj.weight", "linear", False),
    ("self_attn.g_a_proj.kernel", "self_attn.g_a_proj.weight", "linear", False),
    ("self_attn.g_b_proj.kernel", "self_attn.g_b_proj.weight", "linear", False),
    ("self_attn.o_norm.scale", "self_attn.o_norm.weight", "copy", True),
    # gated MLA (g_proj and o_proj: the KDA rows above and below serve both)
    ("self_attn.q_a_proj.kernel", "self_attn.q_a_proj.weight", "linear", False),
    ("self_attn.q_a_layernorm.scale", "self_attn.q_a_layernorm.weight", "copy", False),
    ("self_attn.q_b_proj.kernel", "self_attn.q_b_proj.weight", "linear", False),
    ("self_attn.kv_a_proj_with_mqa.kernel", "self_attn.kv_a_proj_with_mqa.weight", "linear",
     False),
    ("self_attn.kv_a_layernorm.scale", "self_attn.kv_a_layernorm.weight", "copy", False),
    ("self_attn.kv_b_proj.kernel", "self_attn.kv_b_proj.weight", "linear", False),
    ("self_attn.g_proj.kernel", "self_attn.g_proj.weight", "linear", False),
    ("self_attn.o_proj.kernel", "self_attn.o_proj.weight", "linear_in", False),
    # dense SiTU-GLU (layers < first_k_dense_replace)
    ("mlp.gate_proj.kernel", "mlp.gate_proj.weight", "linear", False),
    ("mlp.up_proj.kernel", "mlp.up_proj.weight", "linear", False),
    ("mlp.down_proj.kernel", "mlp.down_proj.weight", "linear", False),
    # Stable LatentMoE
    ("block_sparse_moe.gate.kernel", "block_sparse_moe.gate.weight", "linear", False),
    ("block_sparse_moe.gate.e_score_correction_bias",
     "block_sparse_moe.gate.e_score_correction_bias", "copy", True),
    ("block_sparse_moe.routed_expert_down_proj.kernel",
     "block_sparse_moe.routed_expert_down_proj.weight", "linear", False),
    ("block_sparse_moe.experts.w1", "block_sparse_moe.experts.{e}.w1", "experts", False),
    ("block_sparse_moe.experts.w2", "block_sparse_moe.experts.{e}.w2", "experts", False),
    ("block_sparse_moe.experts.w3", "block_sparse_moe.experts.{e}.w3", "experts", False),
    # the same, held packed (model.moe.expert_format "mxfp4")
    ("block_sparse_moe.experts.w1_packed", "block_sparse_moe.experts.{e}.w1", "packed", False),
    ("block_sparse_moe.experts.w1_scale", "block_sparse_moe.experts.{e}.w1", "scale", False),
    ("block_sparse_moe.experts.w2_packed", "block_sparse_moe.experts.{e}.w2", "packed", False),
    ("block_sparse_moe.experts.w2_scale", "block_sparse_moe.experts.{e}.w2", "scale", False),
    ("block_sparse_moe.experts.w3_packed", "block_sparse_moe.experts.{e}.w3", "packed", False),
    ("block_sparse_moe.experts.w3_scale", "block_sparse_moe.experts.{e}.w3", "scale", False),
    ("block_sparse_moe.routed_expert_norm.scale", "block_sparse_moe.routed_expert_norm.weight",
     "copy", False),
    ("block_sparse_moe.routed_expert_up_proj.kernel",
     "block_sparse_moe.routed_expert_up_proj.weight", "linear", False),
    ("block_sparse_moe.shared_experts.gate_proj.kernel",
     "block_sparse_moe.shared_experts.gate_proj.weight", "linear", False),
    ("block_sparse_moe.shared_experts.up_proj.kernel",
     "block_sparse_moe.shared_experts.up_proj.weight", "linear", False),
    ("block_sparse_moe.shared_experts.down_proj.kernel",
     "block_sparse_moe.shared_experts.down_proj.weight", "linear", False),
)
_MTP_ROWS = (  # DeepSeek-V3's MTP names; the block (`mtp.layer.`) takes _LAYER_ROWS
    ("enorm.scale", "enorm.weight", "copy", False),
    ("hnorm.scale", "hnorm.weight", "copy", False),
    ("eh_proj.kernel", "eh_proj.weight", "linear", False),
    ("norm.scale", "shared_head.norm.weight", "copy", False),
)
_MTP_COPIES = (  # HF copies in layer L of tensors that k3jax's MTP shares with the main model
    ("embed_tokens.embedding", "embed_tokens.weight", "copy", False),
    ("lm_head.kernel", "shared_head.head.weight", "linear", False),
)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One row of the name table instantiated for a model.

  path: the k3jax parameter path; hf: the HF tensor name (routed experts: `...experts.{e}.w1`,
  one tensor, or one MXFP4 pair, per expert e); kind: the transform (module docstring); shape: the
  k3jax shape; fp32: the release stores it in float32; copy: an HF copy of a tensor k3jax shares
  (MTP layer L's embed_tokens / shared_head.head).
  """
  path: str
  hf: str
  kind: str
  shape: tuple[int, ...]
  fp32: bool
  copy: bool = False

  def expert_names(self, e: int) -> tuple[str, str, str]:
    """(`.weight`, `.weight_packed`, `.weight_scale`) names of expert e."""
    name = self.hf.format(e=e)
    return f"{name}.weight", f"{name}.weight_packed", f"{name}.weight_scale"


def _path_str(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def name_table(shapes: dict[str, tuple[int, ...]], num_layers: int) -> list[Entry]:
  """The table's rows for a model whose parameters (and buffers) are `shapes` {path: shape}:
  one Entry per parameter, plus MTP's copies when the model has an MTP layer."""
  by_path = {scope: {row[0]: row[1:] for row in rows}
             for scope, rows in (("model", _MODEL_ROWS), ("layer", _LAYER_ROWS),
                                 ("mtp", _MTP_ROWS))}
  mtp_prefix = f"{MODEL}layers.{num_layers}."
  entries = []
  for path, shape in shapes.items():
    parts = path.split(".")
    if parts[0] == "layers":
      rest, scope, prefix = ".".join(parts[2:]), "layer", f"{MODEL}layers.{parts[1]}."
    elif parts[:2] == ["mtp", "layer"]:
      rest, scope, prefix = ".".join(parts[2:]), "layer", mtp_prefix
    elif parts[0] == "mtp":
      rest, scope, prefix = ".".join(parts[1:]), "mtp", mtp_prefix
    else:
      rest, scope, prefix = path, "model", TEXT
    if rest not in by_path[scope]:
      raise ValueError(f"parameter {path} has no row in the HF name table (k3jax.hf)")
    hf, kind, fp32 = by_path[scope][rest]
    entries.append(Entry(path, prefix + hf, kind, tuple(shape), fp32))
  if any(path.startswith("mtp.") for path in shapes):
    entries += [Entry(path, mtp_prefix + hf, kind, tuple(shapes[path]), fp32, copy=True)
                for path, hf, kind, fp32 in _MTP_COPIES]
  return entries


EXPERT_KINDS = ("experts", "packed", "scale")


def hf_shape(entry: Entry) -> tuple[int, ...]:
  """The HF tensor's shape (routed experts: one expert's float [out, in])."""
  s = entry.shape
  if entry.kind == "linear":
    return (math.prod(s[1:]), s[0])
  if entry.kind == "linear_in":
    return (s[-1], math.prod(s[:-1]))
  if entry.kind == "row":
    return (1, s[0])
  if entry.kind == "conv":
    return (s[1], 1, s[0])
  if entry.kind == "a_log":
    return (-(-s[0] // A_LOG_PAD) * A_LOG_PAD,)
  if entry.kind == "experts":
    return (s[2], s[1])
  if entry.kind == "packed":
    return (s[1], 2 * s[2])
  if entry.kind == "scale":
    return (s[1], mx.BLOCK * s[2])
  return s


def to_k3jax(entry: Entry, a: np.ndarray) -> np.ndarray:
  """HF tensor -> the k3jax parameter (experts: one expert [out, in] -> [in, out])."""
  if entry.kind in ("linear", "linear_in"):
    return a.T.reshape(entry.shape)
  if entry.kind == "row":
    return a[0]
  if entry.kind == "conv":
    return a[:, 0, :].T
  if entry.kind == "a_log":
    if np.any(a[entry.shape[0]:]):
      logging.warning("%s: nonzero padding entries past the %d heads are dropped", entry.hf,
                      entry.shape[0])
    return a[:entry.shape[0]]
  if entry.kind == "experts":
    return a.T
  return a


def to_hf(entry: Entry, x: np.ndarray) -> np.ndarray:
  """The k3jax parameter -> HF tensor (experts: one expert [in, out] -> [out, in])."""
  if entry.kind in ("linear", "linear_in"):
    out, inp = hf_shape(entry)
    return x.reshape(inp, out).T
  if entry.kind == "row":
    return x[None]
  if entry.kind == "conv":
    return x.T[:, None, :]
  if entry.kind == "a_log":
    return np.concatenate([x, np.zeros(hf_shape(entry)[0] - x.shape[0], x.dtype)])
  if entry.kind == "experts":
    return x.T
  return x


# config.json's text_config <-> the k3jax config. Each mapped field: (text_config field, k3jax
# field, type, the k3jax value a JSON null stands for, or _NO_NULL). A mapped field must be
# present unless listed in _OPTIONAL.
_NO_NULL = object()
_TEXT_FIELDS = (
    ("vocab_size", "model.vocab_size", int, _NO_NULL),
    ("hidden_size", "model.hidden_size", int, _NO_NULL),
    ("num_hidden_layers", "model.num_layers", int, _NO_NULL),
    ("intermediate_size", "model.dense_intermediate_size", int, _NO_NULL),
    ("rms_norm_eps", "model.rms_norm_eps", float, _NO_NULL),
    ("first_k_dense_replace", "model.first_k_dense_replace", int, _NO_NULL),
    ("attn_res_block_size", "model.attn_res_block_size", int, 0),
    ("activation_situ_beta", "model.situ_beta1", float, 1.0),
    ("activation_situ_linear_beta", "model.situ_beta2", float, _NO_NULL),
    ("num_nextn_predict_layers", "model.mtp_num_layers", int, _NO_NULL),
    ("num_attention_heads", "model.mla.num_heads", int, _NO_NULL),
    ("q_lora_rank", "model.mla.q_lora_rank", int, 0),
    ("kv_lora_rank", "model.mla.kv_lora_rank", int, _NO_NULL),
    ("qk_nope_head_dim", "model.mla.qk_nope_head_dim", int, _NO_NULL),
    ("qk_rope_head_dim", "model.mla.qk_rope_head_dim", int, _NO_NULL),
    ("v_head_dim", "model.mla.v_head_dim", int, _NO_NULL),
    ("mla_use_output_gate", "model.mla.use_output_gate", bool, _NO_NULL),
    ("num_experts", "model.moe.num_experts", int, 0),
    ("num_experts_per_token", "model.moe.num_experts_per_tok", int, _NO_NULL),
    ("num_shared_experts", "model.moe.n_shared_experts", int, 0),
    ("moe_intermediate_size", "model.moe.moe_intermediate_size", int, _NO_NULL),
    ("routed_expert_hidden_size", "model.moe.latent_size", int, 0),
    ("routed_scaling_factor", "model.moe.routed_scaling_factor", float, _NO_NULL),
    ("moe_renormalize", "model.moe.norm_topk_prob", bool, _NO_NULL),
)
_LINEAR_ATTN_FIELDS = (  # text_config.linear_attn_config
    ("num_heads", "model.kda.num_heads", int, _NO_NULL),
    ("head_dim", "model.kda.head_dim", int, _NO_NULL),
    ("short_conv_kernel_size", "model.kda.short_conv_kernel_size", int, _NO_NULL),
    ("use_full_rank_gate", "model.kda.use_full_rank_gate", bool, _NO_NULL),
    ("full_attn_layers", "model.full_attn_layers", tuple, _NO_NULL),
)
# Absent: the HF model's meaning of absence (the release writes every field).
_OPTIONAL = {"num_nextn_predict_layers": 0, "linear_attn_config.use_full_rank_gate": False,
             "linear_attn_config.gate_lower_bound": None}
# Checked: the only value k3jax expresses (absent: the HF default, which is that value).
_TEXT_REQUIRED = {
    "model_type": "kimi_linear",
    "hidden_act": "situ",               # SiTU-GLU FFNs
    "tie_word_embeddings": False,       # separate embedding and LM head
    "mla_use_nope": True,               # the MLA "rope" dims are never rotated
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",          # bias for selection only
    "num_expert_group": 1,              # no group-limited routing
    "moe_layer_freq": 1,                # every layer past first_k_dense_replace is MoE
    "latent_moe_use_norm": True,        # RMSNorm before W_up
    "attention_dropout": 0.0,
}
# Ignored: they do not change the function k3jax computes.
TEXT_IGNORED = frozenset({
    "head_dim",  # unused: MLA and KDA take their own head dims
    "rope_theta", "rope_scaling", "max_position_embeddings",  # NoPE: no positions
    "initializer_range",  # initialisation only
    "use_grouped_topk", "topk_group",  # no effect with num_expert_group 1
    "quantization_config",  # the tensors say which experts are MXFP4
    "kda_mode", "kda_unpad_inputs", "kda_use_fused_gate", "kda_chunk_impl",
    "kda_use_qk_l2norm_in_kernel", "kda_disable_recompute", "kda_conv_backend",
    "kda_transpose_state_layout", "situ_backend", "attn_res_triton",  # kernel choices
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",  # inference / tokenizer
    "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "auto_map", "output_attentions", "output_hidden_states", "return_dict",
})
_SPECIAL = {"linear_attn_config", "num_key_value_heads"}
_LINEAR_ATTN_SPECIAL = {"kda_layers", "gate_lower_bound"}
_TOP_LEVEL = "kimi_k3"  # config.json's model_type; only its text_config describes the model


def _error(field: str, message: str) -> HFCheckpointError:
  return HFCheckpointError(f"config.json: text_config.{field} {message}")


def _typed(field: str, value: Any, kind: type, null: Any) -> Any:
  """A JSON value of a mapped field as the k3jax config holds it."""
  if value is None:
    if null is _NO_NULL:
      raise _error(field, "is null; k3jax needs a value")
    return null
  if kind is tuple:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
      raise _error(field, f"must be a list of 1-based layer indices, got {value!r}")
    return tuple(value)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise _error(field, f"must be {kind.__name__}, got {value!r}")
  return value


def _set(cfg: ml_collections.ConfigDict, field: str, value: Any) -> None:
  parent, _, leaf = field.rpartition(".")
  config_lib.get(cfg, parent)[leaf] = value


def config_from_hf(hf_config: dict, base: ml_collections.ConfigDict | None = None
                   ) -> ml_collections.ConfigDict:
  """The k3jax config of a Kimi K3 `config.json`: its text_config's fields set on a copy of
  `base` (default: the schema's defaults, `experiments/configs/base.py`), validated.

  Every text_config field is mapped, checked against the one value k3jax expresses, or listed
  in TEXT_IGNORED; anything else raises HFCheckpointError naming the field.
  """
  if hf_config.get("model_type") != _TOP_LEVEL:
    raise HFCheckpointError(f"config.json: model_type is {hf_config.get('model_type')!r}; "
                            f"expected {_TOP_LEVEL!r} (the text model under text_config)")
  text = hf_config.get("text_config")
  if not isinstance(text, dict):
    raise HFCheckpointError("config.json: text_config is missing or not an object")
  mapped = {row[0] for row in _TEXT_FIELDS}
  for key in text:
    if key not in mapped | set(_TEXT_REQUIRED) | TEXT_IGNORED | _SPECIAL:
      raise _error(key, f"= {text[key]!r} is a field k3jax does not know; it cannot tell "
                   "whether the model it describes is the one k3jax builds")
  for key, want in _TEXT_REQUIRED.items():
    if key in text and text[key] != want:
      raise _error(key, f"= {text[key]!r}: k3jax only expresses {want!r}")
  cfg = (base or base_config.get_base_config()).copy_and_resolve_references()
  for key, field, kind, null in _TEXT_FIELDS:
    if key not in text and key not in _OPTIONAL:
      raise _error(key, "is missing")
    _set(cfg, field, _typed(key, text.get(key, _OPTIONAL.get(key)), kind, null))
  heads = text.get("num_key_value_heads")
  if heads is not None and heads != text["num_attention_heads"]:
    raise _error("num_key_value_heads", f"= {heads!r}: k3jax's MLA has as many key/value "
                 f"heads as query heads ({text['num_attention_heads']})")
  if cfg.model.mtp_num_layers > 1:
    raise _error("num_nextn_predict_layers", f"= {cfg.model.mtp_num_layers}: k3jax has one MTP "
                 "depth")
  _linear_attn_from_hf(text.get("linear_attn_config"), cfg)
  cfg.model.mla.lora_norm_eps = LORA_NORM_EPS
  return config_lib.validate(cfg)


def _linear_attn_from_hf(lin: Any, cfg: ml_collections.ConfigDict) -> None:
  if not isinstance(lin, dict):
    raise _error("linear_attn_config", "is missing or not an object")
  known = {row[0] for row in _LINEAR_ATTN_FIELDS} | _LINEAR_ATTN_SPECIAL
  for key in lin:
    if key not in known:
      raise _error(f"linear_attn_config.{key}", f"= {lin[key]!r} is a field k3jax does not know")
  for key, field, kind, null in _LINEAR_ATTN_FIELDS:
    name = f"linear_attn_config.{key}"
    if key not in lin and name not in _OPTIONAL:
      raise _error(name, "is missing")
    _set(cfg, field, _typed(name, lin.get(key, _OPTIONAL.get(name)), kind, null))
  bound = lin.get("gate_lower_bound")
  if bound is None:
    cfg.model.kda.gate = "softplus"
  else:
    cfg.model.kda.gate = "lower_bound"
    cfg.model.kda.gate_lower_bound = _typed("linear_attn_config.gate_lower_bound", bound, float,
                                            _NO_NULL)
  n, full = cfg.model.num_layers, set(cfg.model.full_attn_layers)
  kda = _typed("linear_attn_config.kda_layers", lin.get("kda_layers"), tuple, _NO_NULL)
  if set(kda) != set(range(1, n + 1)) - full or len(kda) != len(set(kda)):
    raise _error("linear_attn_config.kda_layers", f"= {list(kda)}: must be the layers 1..{n} "
                 "not in full_attn_layers")
  cfg.model.kda_layers = ()


def config_to_hf(model_cfg: ml_collections.ConfigDict, *, mtp: bool, experts: str,
                 hf_config: dict | None = None) -> dict:
  """The `config.json` of a k3jax model: `hf_config`'s fields that k3jax does not hold kept
  (token ids, vision_config, ...; quantization_config only with experts "mxfp4"), the rest
  written from `model_cfg`. mtp: the model has an MTP layer (num_nextn_predict_layers 1)."""
  cfg = ml_collections.ConfigDict({"model": model_cfg})
  if cfg.model.mla.lora_norm_eps != LORA_NORM_EPS:
    raise HFCheckpointError(f"config field `model.mla.lora_norm_eps` = "
                            f"{cfg.model.mla.lora_norm_eps}: the HF model fixes {LORA_NORM_EPS}")
  out = json.loads(json.dumps(hf_config)) if hf_config else {
      "architectures": ["KimiK3ForConditionalGeneration"], "model_type": _TOP_LEVEL}
  text = out.get("text_config") or {}
  if experts != "mxfp4":
    out.pop("quantization_config", None)
    text.pop("quantization_config", None)
  text.update(_TEXT_REQUIRED)
  for key, field, kind, null in _TEXT_FIELDS:
    value = config_lib.get(cfg, field)
    text[key] = None if null is not _NO_NULL and value == null else kind(value)
  text["num_nextn_predict_layers"] = int(mtp)
  text["num_key_value_heads"] = cfg.model.mla.num_heads
  lin = {key: (list if kind is tuple else kind)(config_lib.get(cfg, field))
         for key, field, kind, _ in _LINEAR_ATTN_FIELDS}
  full = set(cfg.model.full_attn_layers)
  lin["kda_layers"] = [i for i in range(1, cfg.model.num_layers + 1) if i not in full]
  kda = cfg.model.kda
  lin["gate_lower_bound"] = float(kda.gate_lower_bound) if kda.gate == "lower_bound" else None
  text["linear_attn_config"] = lin
  out["model_type"], out["text_config"] = _TOP_LEVEL, text
  return out


def read_config(path: str) -> dict:
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found; is {path!r} a Hugging Face checkpoint "
                            "directory?")
  with open(config_path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise HFCheckpointError(f"{config_path} is not valid JSON: {e}") from None


class _Tensors:
  """The tensors of a checkpoint directory: headers read up front, data one tensor at a time."""

  def __init__(self, path: str, stack: ExitStack):
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
      with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict):
        raise HFCheckpointError(f"{index_path} has no weight_map")
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")
    self.handles, self.where, self.shapes, self.dtypes = {}, {}, {}, {}
    for name in files:
      file_path = os.path.join(path, name)
      if not os.path.isfile(file_path):
        raise FileNotFoundError(f"{file_path} (listed in {INDEX_FILE}) not found")
      handle = stack.enter_context(safe_open(file_path, framework="np"))
      self.handles[name] = handle
      for key in handle.keys():
        if key in self.where:
          raise HFCheckpointError(f"tensor {key} is in both {self.where[key]} and {name}")
        view = handle.get_slice(key)
        self.where[key], self.shapes[key], self.dtypes[key] = name, tuple(view.get_shape()), \
            view.get_dtype()
    for key, name in (weight_map or {}).items():
      if self.where.get(key) != name:
        raise HFCheckpointError(f"{INDEX_FILE} lists tensor {key} in {name}, which does not "
                                "hold it")
    unlisted = sorted(set(self.where) - set(weight_map)) if weight_map is not None else []
    if unlisted:
      raise HFCheckpointError(f"tensor {unlisted[0]} in {self.where[unlisted[0]]} is not listed "
                              f"in {INDEX_FILE}")

  def read(self, name: str) -> np.ndarray:
    return self.handles[self.where[name]].get_tensor(name)


_FLOAT_DTYPES = ("F32", "BF16", "F16")


def _expert_form(tensors: _Tensors, entry: Entry, e: int) -> str:
  """Which form expert e of `entry` takes in the checkpoint: "float" or "mxfp4"."""
  plain, packed, scale = entry.expert_names(e)
  if plain in tensors.where:
    return "float"
  if packed in tensors.where or scale in tensors.where:
    for name in (packed, scale):
      if name not in tensors.where:
        raise HFCheckpointError(f"missing tensor {name}: its MXFP4 pair is in "
                                f"{tensors.where[packed if name == scale else scale]}")
    return "mxfp4"
  raise HFCheckpointError(f"missing tensor {plain} (or its MXFP4 pair {packed} / "
                          f"{scale.rpartition('.')[2]})")


def _check_tensors(tensors: _Tensors, entries: list[Entry], path: str) -> None:
  """Every tensor of the table present with its shape and a usable dtype, and no other text
  tensor; raises HFCheckpointError naming the first problem."""
  expected = {}
  for entry in entries:
    if entry.kind not in EXPERT_KINDS:
      expected[entry.hf] = (hf_shape(entry), _FLOAT_DTYPES)
      continue
    out, inp = hf_shape(entry)
    for e in range(entry.shape[0]):
      plain, packed, scale = entry.expert_names(e)
      if _expert_form(tensors, entry, e) == "float":
        expected[plain] = ((out, inp), _FLOAT_DTYPES)
      else:
        expected[packed] = ((out, inp // 2), ("U8",))
        expected[scale] = ((out, inp // mx.BLOCK), ("U8",))
  unknown = sorted(n for n in tensors.where if n not in expected
                   and not n.startswith(VISION_PREFIXES))
  if unknown:
    more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
    raise HFCheckpointError(f"unknown tensor {unknown[0]} in {tensors.where[unknown[0]]}{more}: "
                            "not a tensor of the model that config.json describes")
  missing = [n for n in expected if n not in tensors.where]
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise HFCheckpointError(f"missing tensor {missing[0]}{more} in {path}")
  for name, (shape, dtypes) in expected.items():
    where = tensors.where[name]
    if tensors.shapes[name] != shape:
      raise HFCheckpointError(f"tensor {name} in {where} has shape {list(tensors.shapes[name])}, "
                              f"expected {list(shape)}")
    if tensors.dtypes[name] not in dtypes:
      raise HFCheckpointError(f"tensor {name} in {where} has dtype {tensors.dtypes[name]}, "
                              f"expected one of {list(dtypes)}")
  vision = sum(n.startswith(VISION_PREFIXES) for n in tensors.where)
  if vision:
    logging.warning("%d vision tensors (%s) not loaded: k3jax holds the text model", vision,
                    ", ".join(VISION_PREFIXES))


def _reader(tensors: _Tensors, entry: Entry) -> Callable[[int, int], np.ndarray]:
  """rows(start, stop) -> the k3jax parameter's rows [start:stop] (first axis) as numpy."""
  if entry.kind in EXPERT_KINDS:
    def expert(e):
      plain, packed, scale = entry.expert_names(e)
      part = int(entry.kind == "scale")
      if entry.kind != "experts":
        if plain in tensors.where:
          return np.asarray(jax.jit(mx.pack_k3)(tensors.read(plain).astype(np.float32))[part])
        return tensors.read((packed, scale)[part])
      if plain in tensors.where:
        w = tensors.read(plain).astype(np.float32)
      else:
        w = np.asarray(jax.jit(mx.unpack_k3)(tensors.read(packed), tensors.read(scale)))
      return to_k3jax(entry, w)
    return lambda start, stop: np.stack([expert(e) for e in range(start, stop)])
  full = []

  def rows(start, stop):
    if not full:
      full.append(to_k3jax(entry, tensors.read(entry.hf)))
    return full[0][start:stop]
  return rows


def _place(rows: Callable[[int, int], np.ndarray], shape: tuple[int, ...], dtype,
           placement: jax.sharding.Sharding) -> jax.Array:
  """The parameter as a jax.Array placed by `placement`, each shard cut from `rows`."""
  cache = {}

  def shard(index):
    start, stop, _ = index[0].indices(shape[0])
    if (start, stop) not in cache:
      cache[start, stop] = np.asarray(rows(start, stop)).astype(dtype)
    return cache[start, stop][(slice(None),) + tuple(index[1:])]
  return jax.make_array_from_callback(shape, placement, shard)


def _abstract(cfg: ml_collections.ConfigDict) -> tuple[Any, nnx.State]:
  abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0),
                                                  kernels=cfg.kernels))
  return nnx.split(abstract)


def load_checkpoint(path: str, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
                    config: ml_collections.ConfigDict | None = None, init_mtp: bool = False,
                    seed: int = 0) -> tuple[ml_collections.ConfigDict, K3ForCausalLM]:
  """A Kimi K3 checkpoint directory -> (k3jax config, K3ForCausalLM with its weights).

  The config is `config_from_hf` of config.json on `config` (default: the schema's defaults);
  dtype ("float32" | "bfloat16") sets `model.param_dtype` (norms, gains and biases stay float32,
  as the model builds them). Every tensor's name, shape and dtype is checked before any is read
  (HFCheckpointError names the first problem); the model is built abstractly (nnx.eval_shape)
  and filled tensor by tensor, each parameter placed by the mesh's rules
  (`mesh.logical_axis_rules`, `sharding.param_spec`) when `mesh` is given, else on the first
  device. Routed experts are unpacked (`k3jax.mx.unpack_k3`), or kept packed as they are when
  `config` has `model.moe.expert_format` "mxfp4". A checkpoint without MTP weights gives a model
  without MTP, or with a freshly initialised MTP layer (`seed`) when init_mtp; either is logged as
  a warning.
  """
  hf_config = read_config(path)
  cfg = config_from_hf(hf_config, config)
  if dtype is not None:
    cfg.model.param_dtype = dtype
  fresh_mtp = init_mtp and not cfg.model.mtp_num_layers
  if fresh_mtp:
    cfg.model.mtp_num_layers = 1
  cfg = config_lib.validate(cfg)
  if not cfg.model.mtp_num_layers:
    logging.warning("%s has no MTP weights (num_nextn_predict_layers 0): the model has no MTP "
                    "layer (init_mtp=True adds a freshly initialised one)", path)
  elif fresh_mtp:
    logging.warning("%s has no MTP weights (num_nextn_predict_layers 0): the MTP layer is freshly "
                    "initialised (seed %d)", path, seed)
  graphdef, state = _abstract(cfg)
  flat = {_path_str(p): v for p, v in nnx.to_flat_state(state)}
  loaded = {p: v for p, v in flat.items() if not (fresh_mtp and p.startswith("mtp."))}
  entries = name_table({p: v.shape for p, v in loaded.items()}, cfg.model.num_layers)
  rules = cfg.mesh.logical_axis_rules

  def placement(var):
    if mesh is None:
      return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.sharding.NamedSharding(mesh, sharding.param_spec(
        var.get_metadata().get("out_sharding"), var.shape, mesh, rules))

  values = {}
  with ExitStack() as stack:
    tensors = _Tensors(path, stack)
    _check_tensors(tensors, entries, path)
    for entry in entries:
      var = flat[entry.path]
      if entry.copy:
        _check_copy(tensors, entry, values[entry.path])
        continue
      values[entry.path] = _place(_reader(tensors, entry), var.shape, var.dtype, placement(var))
  if fresh_mtp:
    mtp_state = nnx.state(mtp_lib.MTP(cfg.model, rngs=nnx.Rngs(seed), kernels=cfg.kernels))
    for p, v in nnx.to_flat_state(mtp_state):
      key = "mtp." + _path_str(p)
      values[key] = jax.device_put(v.get_value(), placement(flat[key]))
  pure = nnx.to_pure_dict(state)
  pure = jax.tree_util.tree_map_with_path(lambda p, _: values[_path_str(p)], pure)
  nnx.replace_by_pure_dict(state, pure)
  return cfg, nnx.merge(graphdef, state)


def _check_copy(tensors: _Tensors, entry: Entry, value: jax.Array) -> None:
  """MTP layer L's copy of the embedding / LM head must equal the main tensor (k3jax shares it)."""
  copy = to_k3jax(entry, tensors.read(entry.hf)).astype(value.dtype)
  if not np.array_equal(copy, np.asarray(value)):
    raise HFCheckpointError(f"tensor {entry.hf} in {tensors.where[entry.hf]} differs from the "
                            f"main model's {entry.path}: k3jax's MTP layer shares it")


def _np_dtype(entry: Entry):
  return np.dtype(np.float32 if entry.fp32 else jnp.bfloat16)


def _hf_tensors(entries: list[Entry], values: dict[str, jax.Array], experts: str
                ) -> list[tuple[str, int, Callable[[], np.ndarray]]]:
  """(HF name, bytes, make) of every tensor to write, in table order; make() builds it."""
  out = []
  for entry in entries:
    x = values[entry.path]
    if entry.kind in ("packed", "scale"):
      out += _packed_tensors(entry, values, experts)
      continue
    if entry.kind != "experts":
      dt = _np_dtype(entry)
      make = lambda entry=entry, x=x, dt=dt: to_hf(entry, np.asarray(x)).astype(dt)
      out.append((entry.hf, math.prod(hf_shape(entry)) * dt.itemsize, make))
      continue
    o, i = hf_shape(entry)
    for e in range(entry.shape[0]):
      plain, packed, scale = entry.expert_names(e)
      expert = lambda entry=entry, x=x, e=e: to_hf(entry, np.asarray(x[e], np.float32))
      if experts == "bf16":
        out.append((plain, o * i * 2, lambda expert=expert: expert().astype(jnp.bfloat16)))
        continue
      pair = {}

      def part(k, expert=expert, pair=pair):
        """Half k of the expert's (weight_packed, weight_scale), packed once for both."""
        if not pair:
          pair.update(enumerate(np.asarray(a) for a in jax.jit(mx.pack_k3)(expert())))
        return pair.pop(k)
      out.append((packed, o * i // 2, lambda part=part: part(0)))
      out.append((scale, o * i // mx.BLOCK, lambda part=part: part(1)))
  return out


def _packed_tensors(entry: Entry, values: dict[str, jax.Array], experts: str
                    ) -> list[tuple[str, int, Callable[[], np.ndarray]]]:
  """`_hf_tensors` of a model holding its experts packed: the stored bytes as they are, or with
  experts "bf16" each expert unpacked (on the `_packed` entry; its `_scale` entry gives none)."""
  x, (o, i) = values[entry.path], hf_shape(entry)
  if experts == "bf16":
    if entry.kind == "scale":
      return []
    scale = values[entry.path.removesuffix("_packed") + "_scale"]
    return [(entry.expert_names(e)[0], o * i * 2,
             lambda e=e: np.asarray(jax.jit(mx.unpack_k3)(x[e], scale[e])).astype(jnp.bfloat16))
            for e in range(entry.shape[0])]
  part = 1 if entry.kind == "packed" else 2
  return [(entry.expert_names(e)[part], math.prod(entry.shape[1:]), lambda e=e: np.asarray(x[e]))
          for e in range(entry.shape[0])]


def save_checkpoint(cfg: ml_collections.ConfigDict, model: K3ForCausalLM, path: str, *,
                    experts: str = "mxfp4", max_shard_bytes: int = 5 * 10**9,
                    hf_config: dict | None = None) -> None:
  """Writes `model` as a Kimi K3 checkpoint directory `path` (which must not exist).

  config.json from `cfg.model` (`config_to_hf`; `hf_config`, the original config.json, keeps
  the fields k3jax does not hold), shards `model-0000k-of-0000n.safetensors` of at most
  `max_shard_bytes` each (a larger tensor gets a shard of its own) and the index; dtypes as
  the release (float32 for the rows marked so, bfloat16 otherwise), routed experts MXFP4
  (`k3jax.mx.pack_k3`) or bfloat16 (experts "bf16"). Written into a temporary directory beside
  `path` and renamed at the end: a failure leaves no directory.
  """
  if experts not in EXPERT_FORMATS:
    raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
  if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or \
      max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; save_checkpoint writes a new directory")
  values = {_path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
  entries = name_table({p: v.shape for p, v in values.items()}, cfg.model.num_layers)
  mtp = any(p.startswith("mtp.") for p in values)
  if experts == "mxfp4":
    bad = [e.path for e in entries if e.kind == "experts" and e.shape[1] % mx.BLOCK]
    if bad:
      raise HFCheckpointError(f"{bad[0]}: its input dim {values[bad[0]].shape[1]} is not a "
                              f"multiple of {mx.BLOCK}, so MXFP4 cannot hold it; use "
                              "experts='bf16'")
  hf_cfg = config_to_hf(cfg.model, mtp=mtp, experts=experts, hf_config=hf_config)
  tensors = _hf_tensors(entries, values, experts)
  shards, size = [[]], 0
  for item in tensors:
    if shards[-1] and size + item[1] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += item[1]
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    weight_map = {}
    for k, shard in enumerate(shards):
      name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      arrays = {}
      for hf_name, _, make in shard:
        arrays[hf_name] = np.ascontiguousarray(make())
        weight_map[hf_name] = name
      save_file(arrays, os.path.join(tmp, name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(item[1] for item in tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    for name, content in ((INDEX_FILE, index), (CONFIG_FILE, hf_cfg)):
      with open(os.path.join(tmp, name), "w") as f:
        json.dump(content, f, indent=2)
    os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
