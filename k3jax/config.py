"""Validation of experiment configs, run before anything is built.

Every error names the offending field (`model.kda.num_heads`) and what is allowed.
"""
import difflib
import importlib.util
import json
import os
from typing import Any

import jax.numpy as jnp
import ml_collections

from experiments.configs import base
from k3jax import muon

_CHOICES = {
    "model.kda.gate": ("lower_bound", "softplus"),
    "model.moe.balancing": ("quantile", "quantile_exact", "sign", "none"),
    "model.moe.expert_parallel": ("auto", "off"),
    "model.moe.ep_all_to_all": ("auto", "ragged", "padded"),
    "model.moe.expert_format": ("float", "mxfp4"),
    "kernels.moe_decode_experts": ("sorted", "gathered", "all"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "save_dots", "save_mixer_out", "offload"),
    "train.optimizer": ("adamw", "muon", "muon_whole"),
    "train.muon_ns_dtype": ("bfloat16", "float32"),
    "data.source": ("default", "memmap", "array_record"),
    "kernels.kda_impl": ("", "reference", "chunked", "mosaic_gpu", "mosaic_tpu"),
    "kernels.ragged_dot_impl": ("", "xla", "mosaic_gpu", "mosaic_tpu"),
    "kernels.gate_up_impl": ("", "xla", "triton"),
    "kernels.gate_up_train": ("unfused", "kernel"),
    "kernels.attention_impl": ("", "reference", "xla_blockwise", "cudnn", "mosaic_gpu", "splash"),
    "kernels.decode_attention_impl": ("", "reference", "xla", "mosaic_gpu", "mosaic_tpu"),
    "kernels.kda_decode_impl": ("", "xla", "triton", "mosaic_tpu"),
}


class ConfigError(ValueError):
  """A config field holds a value that is not allowed."""

  def __init__(self, field: str, message: str):
    super().__init__(f"config field `{field}`: {message}")
    self.field = field


def unknown_field(field: str, allowed) -> ConfigError:
  """The error for a field the schema lacks: the allowed names there and a close match."""
  key = field.rpartition(".")[2]
  allowed = sorted(allowed)
  close = difflib.get_close_matches(key, allowed, n=1)
  hint = f"; did you mean `{field[:len(field) - len(key)]}{close[0]}`?" if close else ""
  return ConfigError(field, f"unknown field; allowed names here: {allowed}{hint}")


def check_field(field: str) -> None:
  """Raises ConfigError unless the dotted `field` names a field of the schema."""
  node, prefix = base.get_base_config(), ""
  for part in field.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(prefix.rstrip("."), f"is a value, not a section; cannot set `{field}`")
    if part not in node:
      raise unknown_field(prefix + part, node.keys())
    node, prefix = node[part], f"{prefix}{part}."


def _check_keys(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict,
                prefix: str) -> None:
  for key in cfg.keys():
    field = f"{prefix}{key}"
    if key not in schema:
      raise unknown_field(field, schema.keys())
    if isinstance(schema[key], ml_collections.ConfigDict):
      if not isinstance(cfg[key], ml_collections.ConfigDict):
        raise ConfigError(field, "must be a section (ConfigDict)")
      _check_keys(cfg[key], schema[key], field + ".")
  for key in schema.keys():
    if key not in cfg:
      raise ConfigError(f"{prefix}{key}", "missing")


def get(cfg: ml_collections.ConfigDict, field: str) -> Any:
  node = cfg
  for part in field.split("."):
    node = node[part]
  return node


def _positive(cfg, *fields):
  for f in fields:
    v = get(cfg, f)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise ConfigError(f, f"must be a positive integer, got {v!r}")


def _non_negative(cfg, *fields):
  for f in fields:
    v = get(cfg, f)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise ConfigError(f, f"must be a non-negative integer, got {v!r}")


def _bool(cfg, *fields):
  for f in fields:
    v = get(cfg, f)
    if not isinstance(v, bool):
      raise ConfigError(f, f"must be True or False, got {v!r}")


def layer_types(model_cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """'kda' or 'mla' for each 0-based layer, from the 1-based `full_attn_layers`."""
  full = set(model_cfg.full_attn_layers)
  return tuple("mla" if i + 1 in full else "kda" for i in range(model_cfg.num_layers))


def _check_schedule(t: ml_collections.ConfigDict) -> None:
  """`muon.cosine_schedule_args`' checks, naming the train.* field."""
  fields = {"total_steps": "train.steps", "warmup_frac": "train.warmup_frac",
            "final_frac": "train.final_lr_frac"}
  try:
    muon.cosine_schedule_args(t.learning_rate, t.steps, t.warmup_frac, t.final_lr_frac)
  except ValueError as e:   # each message starts with the argument's name
    arg = next(k for k in fields if str(e).startswith(k))
    raise ConfigError(fields[arg], str(e)[len(arg) + 1:]) from None


def validate(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks `cfg` against the schema and its internal consistency; returns it."""
  _check_keys(cfg, base.get_base_config(), "")
  for field, allowed in _CHOICES.items():
    if get(cfg, field) not in allowed:
      raise ConfigError(field, f"got {get(cfg, field)!r}; allowed values: {list(allowed)}")
  m = cfg.model
  _positive(cfg, "model.vocab_size", "model.hidden_size", "model.num_layers",
            "model.dense_intermediate_size", "model.kda.num_heads", "model.kda.head_dim",
            "model.kda.short_conv_kernel_size", "model.mla.num_heads",
            "model.mla.kv_lora_rank", "model.mla.qk_nope_head_dim", "model.mla.v_head_dim",
            "train.steps", "train.global_batch_size", "train.seq_len", "train.log_every",
            "train.grad_accum_steps",
            "train.checkpoint_every", "train.keep_checkpoints", "model.moe.qb_num_bins")
  _non_negative(cfg, "model.first_k_dense_replace", "model.attn_res_block_size",
                "model.mtp_num_layers", "model.mla.q_lora_rank", "model.mla.qk_rope_head_dim",
                "model.moe.num_experts", "model.moe.latent_size", "model.moe.n_shared_experts",
                "data.default_num_docs", "data.num_workers")
  _check_schedule(cfg.train)
  _bool(cfg, "model.moe.qat")
  _bool(cfg, "train.muon_ns_fold")
  _bool(cfg, "train.muon_ns_stack")
  n = m.num_layers
  for name in ("full_attn_layers", "kda_layers"):
    field = f"model.{name}"
    idx = tuple(get(cfg, field))
    if any(not isinstance(i, int) or i < 1 or i > n for i in idx):
      raise ConfigError(field, f"1-based layer indices must lie in [1, num_layers={n}], got {idx}")
    if list(idx) != sorted(set(idx)):
      raise ConfigError(field, f"indices must be strictly increasing, got {idx}")
  full, kda = set(m.full_attn_layers), set(m.kda_layers)
  if kda and (kda & full or len(kda | full) != n):
    raise ConfigError("model.kda_layers",
                      f"must be exactly the layers 1..{n} not in model.full_attn_layers "
                      f"(or empty to derive it); got {tuple(sorted(kda))}")
  if m.first_k_dense_replace > n:
    raise ConfigError("model.first_k_dense_replace", f"exceeds model.num_layers={n}")
  if m.moe.num_experts:
    _positive(cfg, "model.moe.num_experts_per_tok", "model.moe.moe_intermediate_size")
    if m.moe.num_experts_per_tok > m.moe.num_experts:
      raise ConfigError("model.moe.num_experts_per_tok",
                        f"top-k {m.moe.num_experts_per_tok} exceeds num_experts "
                        f"{m.moe.num_experts}")
    factor = m.moe.ep_capacity_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
      raise ConfigError("model.moe.ep_capacity_factor", f"must be a number > 0, got {factor!r}")
    if m.moe.qat or m.moe.expert_format == "mxfp4":
      sizes = (("model.moe.latent_size", m.moe.latent_size or m.hidden_size),
               ("model.moe.moe_intermediate_size", m.moe.moe_intermediate_size))
      for field, size in sizes:
        if size % 32:
          raise ConfigError(field, f"{size} is not a multiple of 32, the MX block along the "
                            "experts' input dims (model.moe.qat, expert_format='mxfp4')")
  if cfg.train.global_batch_size % cfg.train.grad_accum_steps:
    raise ConfigError("train.grad_accum_steps",
                      f"{cfg.train.grad_accum_steps} does not divide train.global_batch_size="
                      f"{cfg.train.global_batch_size}")
  if m.moe.balancing == "quantile_exact" and cfg.train.grad_accum_steps > 1:
    raise ConfigError("model.moe.balancing",
                      "quantile_exact keeps every score of the step and cannot be accumulated "
                      "over micro-batches; use quantile (the histogram estimator) or "
                      "train.grad_accum_steps=1")
  if cfg.data.paths and cfg.data.source == "default":
    raise ConfigError("data.paths", f"{cfg.data.paths!r} given, but data.source='default' "
                      "(the generated corpus) ignores paths; set data.source to 'memmap' or "
                      "'array_record', or drop data.paths")
  if m.kda.gate == "lower_bound" and not m.kda.gate_lower_bound < 0:
    raise ConfigError("model.kda.gate_lower_bound", "must be negative")
  for axis in ("pipeline", "expert", "context"):
    _positive(cfg, f"mesh.{axis}")
  if not (cfg.mesh.data == -1 or (isinstance(cfg.mesh.data, int) and cfg.mesh.data > 0)):
    raise ConfigError("mesh.data", f"must be -1 (auto) or a positive integer, got {cfg.mesh.data}")
  if m.moe.num_experts and m.moe.num_experts % cfg.mesh.expert:
    raise ConfigError("mesh.expert", f"{cfg.mesh.expert} does not divide "
                      f"model.moe.num_experts={m.moe.num_experts}")
  sizes = {"pipeline": cfg.mesh.pipeline, "expert": cfg.mesh.expert, "context": cfg.mesh.context,
           "data": max(cfg.mesh.data, 1)}
  head_counts = {"model.kda.num_heads": m.kda.num_heads, "model.mla.num_heads": m.mla.num_heads}
  for rule in cfg.mesh.logical_axis_rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ConfigError("mesh.logical_axis_rules",
                        f"each rule is (logical_name, mesh_axes), got {rule!r}")
    for ax in rule[1] or ():
      if ax not in ("data", "pipeline", "expert", "context"):
        raise ConfigError("mesh.logical_axis_rules", f"rule {rule!r} names mesh axis {ax!r}; "
                          "allowed: data, pipeline, expert, context")
    if rule[0] == "heads":
      shards = 1
      for ax in rule[1] or ():
        shards *= sizes[ax]
      for field, heads in head_counts.items():
        if heads % shards:
          raise ConfigError(field, f"{heads} heads do not divide over mesh axes {rule[1]} "
                                   f"of total size {shards}")
  return cfg


def differences(old: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> list[str]:
  """`field: old -> new` for every leaf field whose value differs, in schema order."""
  def leaves(node, prefix=""):
    for key, value in node.items():
      if isinstance(value, ml_collections.ConfigDict):
        yield from leaves(value, f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}", value
  before = dict(leaves(old))
  return [f"{field}: {before.get(field)!r} -> {value!r}" for field, value in leaves(new)
          if before.get(field) != value]


def dtype(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def from_json(text: str) -> ml_collections.ConfigDict:
  """A config saved by training (`WORKDIR/config.json`), lists turned back into tuples.

  Fields added to the schema after the config was saved take their defaults; unknown fields
  are still rejected.
  """
  def tuples(x):
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    if isinstance(x, list):
      return tuple(tuples(v) for v in x)
    return x

  def merge(node: ml_collections.ConfigDict, values: dict, prefix: str) -> None:
    for key, value in values.items():
      if key not in node:
        raise unknown_field(f"{prefix}{key}", node.keys())
      if isinstance(node[key], ml_collections.ConfigDict):
        merge(node[key], value, f"{prefix}{key}.")
      else:
        node[key] = value

  cfg = base.get_base_config()
  merge(cfg, tuples(json.loads(text)), "")
  return validate(cfg)


def load(path: str, overrides: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Loads `get_config()` from a config file, applies dotted overrides, validates."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location("k3jax_user_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return override(module.get_config(), overrides)


def override(cfg: ml_collections.ConfigDict,
             overrides: dict[str, Any] | None) -> ml_collections.ConfigDict:
  """Sets the dotted fields of `overrides` in `cfg` (in place), validates; returns it."""
  for field, value in (overrides or {}).items():
    parent, _, leaf = field.rpartition(".")
    node = get(cfg, parent) if parent else cfg
    if leaf not in node:
      raise unknown_field(field, node.keys())
    node[leaf] = value
  return validate(cfg)
