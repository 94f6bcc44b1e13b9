"""The training step: loss, optimizer, MoE bias update and QK-Clip, as pure functions of a pytree.

`TrainState` (a dict: step, params, buffers, opt_state) crosses `jax.jit`; the model is rebuilt
inside the step with `nnx.merge(graphdef, params, buffers)`. `buffers` holds the non-trained
variables, i.e. the MoE balancing biases, updated outside the optimizer (report §2.3.3).
"""
import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax import config as config_lib
from k3jax import latent_moe, losses, mtp, muon, pipeline, quantile_balancing, sharding
from k3jax.model import K3ForCausalLM

TrainState = dict[str, Any]


def schedule_args(train_cfg: ml_collections.ConfigDict) -> dict[str, float | int]:
  """The learning-rate schedule's numbers (`muon.cosine_schedule_args`): cosine with 1% linear
  warmup (report §3.3). `make_train_step`'s step takes them as arrays."""
  return muon.cosine_schedule_args(train_cfg.learning_rate, train_cfg.steps,
                                   train_cfg.warmup_frac, train_cfg.final_lr_frac)


def make_schedule(train_cfg: ml_collections.ConfigDict,
                  args: dict[str, Any] | None = None) -> optax.Schedule:
  """`muon.cosine_lr` of `args` (default: `schedule_args(train_cfg)`, constants)."""
  args = schedule_args(train_cfg) if args is None else args
  return lambda count: muon.cosine_lr(count, args)


def _decay_mask(params):
  """AdamW decays matrices only, never norms, gains, biases or A_log (ndim < 2)."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def muon_mode(train_cfg: ml_collections.ConfigDict) -> str | None:
  """`muon.per_head_muon`'s mode for `train.optimizer`: "per_head", "whole", or None (AdamW)."""
  return {"muon": "per_head", "muon_whole": "whole"}.get(train_cfg.optimizer)


def make_optimizer(train_cfg: ml_collections.ConfigDict, params,
                   lr: optax.Schedule | None = None) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW or per-head Muon (+ AdamW for the rest), at the learning
  rate `lr` (default: `make_schedule(train_cfg)`). The state's structure does not depend on
  `lr`."""
  lr = make_schedule(train_cfg) if lr is None else lr
  if train_cfg.optimizer == "adamw":
    opt = optax.adamw(lr, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2,
                      weight_decay=train_cfg.weight_decay, mask=_decay_mask)
  else:
    opt = muon.per_head_muon(lr, weight_decay=train_cfg.weight_decay, adam_b1=train_cfg.adam_b1,
                             adam_b2=train_cfg.adam_b2, mode=muon_mode(train_cfg),
                             params_for_dims=params,
                             ns_dtype=train_cfg.muon_ns_dtype, ns_fold=train_cfg.muon_ns_fold,
                             ns_stack=train_cfg.muon_ns_stack)
  return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), opt)


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about a run: the graph of the model and the optimizer."""
  graphdef: Any
  tx: optax.GradientTransformation
  cfg: ml_collections.ConfigDict
  logical_names: dict  # {"params": ..., "buffers": ...}: pure dicts of logical axis names


def init(cfg: ml_collections.ConfigDict, seed: int) -> tuple[Setup, TrainState]:
  """Builds the model and optimizer; returns (setup, state) with concrete arrays."""
  if cfg.model.moe.expert_format != "float":
    raise config_lib.ConfigError(
        "model.moe.expert_format", f"{cfg.model.moe.expert_format!r} holds the routed experts "
        "packed for inference; training needs \"float\" (model.moe.qat=True trains them "
        "MXFP4-aware)")
  model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(seed), kernels=cfg.kernels)
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  names = {k: jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), st,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
           for k, st in (("params", params), ("buffers", buffers))}
  names = {k: nnx.to_pure_dict(v) for k, v in names.items()}
  params, buffers = nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)
  tx = make_optimizer(cfg.train, params)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "buffers": buffers,
           "opt_state": tx.init(params)}
  return Setup(graphdef, tx, cfg, names), state


def loss_fn(params, buffers, graphdef, batch: dict[str, jax.Array]):
  """Next-token CE plus `mtp_loss_weight` x the MTP CE on t+2, both through the LM head
  blockwise (`k3jax.losses`: no [B, T, V] logits), each the mean over its mask > 0.

  Returns (loss, (aux per layer index with the MTP layer at index L, next-token CE alone)).
  """
  model = nnx.merge(graphdef, params, buffers)
  h, aux, _ = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"])
  loss, lm_loss, mtp_aux = head_loss(model, h, batch)
  if mtp_aux is not None:
    aux[model.cfg.num_layers] = mtp_aux
  return loss, (aux, lm_loss)


def head_loss(model: K3ForCausalLM, h: jax.Array, batch: dict[str, jax.Array]):
  """`loss_fn` from the final normed hidden h [B, T, d] on: (loss, next-token CE, the MTP
  layer's aux with its "mtp_loss", or None without MTP)."""
  head = model.lm_head["kernel"][...].astype(model.dtype)
  with jax.named_scope("lm_loss"):
    lm_loss, _ = losses.lm_head_cross_entropy(h, head, batch["targets"], batch["loss_mask"])
  cfg = model.cfg
  if not cfg.mtp_num_layers:
    return lm_loss, lm_loss, None
  h2, mtp_aux = model.mtp(h, model.embed(batch["targets"]), batch["segment_ids"],
                          batch["positions"])
  targets2, mask2 = mtp.shift_targets(batch["targets"], batch["segment_ids"], batch["loss_mask"])
  mtp_aux["mtp_loss"], _ = mtp.mtp_head_loss(h2, head, targets2, mask2)
  return lm_loss + cfg.mtp_loss_weight * mtp_aux["mtp_loss"], lm_loss, mtp_aux


def _moe_layers(aux: dict[int, dict]) -> dict[int, dict]:
  return {i: a["moe"] for i, a in aux.items() if "moe" in a}


def update_moe_biases(buffers, aux, model_cfg: ml_collections.ConfigDict):
  """Every MoE layer's balancing bias for the next step (used from the next step on)."""
  e = model_cfg.moe
  buffers = jax.tree.map(lambda x: x, buffers)  # fresh containers, same arrays
  for i, moe_aux in _moe_layers(aux).items():
    owner = buffers["mtp"]["layer"] if i == model_cfg.num_layers else buffers["layers"][i]
    gate = owner["block_sparse_moe"]["gate"]
    gate["e_score_correction_bias"] = latent_moe.update_bias(
        gate["e_score_correction_bias"], moe_aux, method=e.balancing,
        top_k=e.num_experts_per_tok, rate=e.bias_update_rate)
  return buffers


def moe_metrics(aux) -> dict[str, jax.Array]:
  """Expert-load statistics per MoE layer (max/mean, min/mean, coefficient of variation), and
  under expert parallelism the token copies dropped past the receive buffers (all layers)."""
  out = {}
  for i, moe_aux in _moe_layers(aux).items():
    for name, value in quantile_balancing.load_stats(moe_aux["loads"]).items():
      out[f"moe/layer{i}/{name}"] = value
  dropped = [a["ep_dropped"] for a in _moe_layers(aux).values() if "ep_dropped" in a]
  if dropped:
    out["moe/ep_dropped_copies"] = sum(dropped)
  if out:
    for name in ("max_over_mean", "min_over_mean", "cv"):
      vals = [v for k, v in out.items() if k.endswith("/" + name)]
      out[f"moe/mean_{name}"] = jnp.mean(jnp.stack(vals))
  return out


def _merge_layer_aux(a: dict, b: dict) -> dict:
  """Combines one layer's aux of two micro-batches: MoE counts add, logit maxima take the max."""
  out = {}
  for key, value in a.items():
    if key == "moe":
      out[key] = latent_moe.merge_aux(value, b[key])
    elif key == "mla_max_logit":
      out[key] = jnp.maximum(value, b[key])
    else:
      out[key] = value + b[key]
  return out


def accumulated_grads(params, buffers, graphdef, batch: dict[str, jax.Array], steps: int):
  """Loss, aux and gradients averaged over `steps` equal micro-batches of `batch`.

  Returns ((loss, (aux, lm_loss)), grads) like `jax.value_and_grad(loss_fn, has_aux=True)`.
  The MoE statistics of all micro-batches are merged before the bias update (the histogram
  counts add, report App. D), so the update equals the one of the whole batch. Traced under a
  mesh whose `pipeline` axis is > 1 (`jax.set_mesh`), the micro-batches run through the 1F1B
  pipeline over the stages (`k3jax.pipeline`).
  """
  if pipeline.num_stages() > 1:
    return pipeline.accumulated_grads(params, buffers, graphdef, batch, steps,
                                      head_loss=head_loss, merge_layer_aux=_merge_layer_aux)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if steps == 1:
    return grad_fn(params, buffers, graphdef, batch)
  micro = jax.tree.map(lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)
  first = grad_fn(params, buffers, graphdef, jax.tree.map(lambda x: x[0], micro))

  def body(carry, mb):
    (loss, (aux, lm_loss)), grads = carry
    (l2, (a2, lm2)), g2 = grad_fn(params, buffers, graphdef, mb)
    aux = {i: _merge_layer_aux(aux[i], a2[i]) for i in aux}
    return ((loss + l2, (aux, lm_loss + lm2)), jax.tree.map(jnp.add, grads, g2)), None

  ((loss, (aux, lm_loss)), grads), _ = jax.lax.scan(
      body, first, jax.tree.map(lambda x: x[1:], micro))
  aux = {i: {k: (v / steps if k == "mtp_loss" else v) for k, v in a.items()}
         for i, a in aux.items()}
  return (loss / steps, (aux, lm_loss / steps)), jax.tree.map(lambda g: g / steps, grads)


def make_train_step(setup: Setup) -> Callable[..., tuple[TrainState, dict]]:
  """The jittable step(state, batch, schedule=None): forward, backward, optimizer, QK-Clip,
  MoE bias update.

  `schedule`: `schedule_args(cfg.train)` as arrays (`launch.train` passes them), so that runs of
  any length or learning rate share one compiled step; None bakes cfg.train's into the program.
  Jit it under `jax.set_mesh(mesh)` for a mesh with `data` > 1: the scanned layers' parameters
  are then gathered per unit (FSDP, `k3jax.sharding.fsdp_gather`)."""
  cfg = setup.cfg
  clip = cfg.train.optimizer != "adamw" and cfg.train.qk_clip_tau > 0

  def step(state: TrainState, batch: dict[str, jax.Array], schedule: dict | None = None):
    lr = make_schedule(cfg.train, schedule)
    tx = setup.tx if schedule is None else make_optimizer(cfg.train, state["params"], lr)
    with sharding.logical_axis_rules(cfg.mesh.logical_axis_rules):  # for sharding.fsdp_gather
      (loss, (aux, lm_loss)), grads = accumulated_grads(
          state["params"], state["buffers"], setup.graphdef, batch, cfg.train.grad_accum_steps)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
    max_logits = {("mtp.layer" if i == cfg.model.num_layers else f"layers.{i}") + ".self_attn":
                  a["mla_max_logit"] for i, a in aux.items() if "mla_max_logit" in a}
    if clip and max_logits:
      with jax.named_scope("qk_clip"):
        params = muon.qk_clip(params, max_logits, tau=cfg.train.qk_clip_tau,
                              qk_nope_head_dim=cfg.model.mla.qk_nope_head_dim,
                              qk_rope_head_dim=cfg.model.mla.qk_rope_head_dim)
    with jax.named_scope("bias_update"):
      buffers = update_moe_biases(state["buffers"], aux, cfg.model)
    with jax.named_scope("metrics"):
      metrics = {"loss": loss, "lm_loss": lm_loss, "grad_norm": optax.global_norm(grads),
                 "learning_rate": lr(state["step"]), **moe_metrics(aux)}
    if cfg.model.mtp_num_layers:
      metrics["mtp_loss"] = aux[cfg.model.num_layers]["mtp_loss"]
    if max_logits:
      metrics["mla/max_logit"] = jnp.max(jnp.stack(list(max_logits.values())))
    new_state = {"step": state["step"] + 1, "params": params, "buffers": buffers,
                 "opt_state": opt_state}
    return new_state, metrics

  return step


def compiler_options(cfg: ml_collections.ConfigDict) -> dict[str, bool]:
  """XLA options of the train step's compile (`jax.jit(compiler_options=...)`).

  `kernels.xla_triton_gemm=False` leaves the GEMMs XLA emits itself to cuBLAS: on the H200
  (k3_small, 2026-12-02) its Triton GEMM fusions made the step 3% slower and the compile 20 s
  longer (their autotuning and codegen). Other backends ignore the option.
  """
  return {"xla_gpu_enable_triton_gemm": bool(cfg.kernels.xla_triton_gemm)}


def enable_compilation_cache(path: str) -> None:
  """Points JAX's persistent compilation cache (with XLA's per-fusion autotune results on GPU)
  at `path`, created if missing ("" leaves it off); OSError if it cannot be created.

  Programs that compile for over a second (`jax_persistent_cache_min_compile_time_secs`) are
  stored, keyed by their HLO, compile options, backend and JAX version, so a changed model or
  kernel compiles afresh; `JAX_LOG_COMPILES=1` logs each hit.
  """
  if not path:
    return
  path = os.path.expanduser(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)


def state_shardings(setup: Setup, state: TrainState, mesh, rules) -> TrainState:
  """NamedShardings for the whole train state from the parameters' logical axis names."""
  p_sh = sharding.tree_shardings(state["params"], setup.logical_names["params"], mesh, rules)
  p_sh = pipeline.param_shardings(p_sh, state["params"], setup.cfg.model, mesh)
  b_sh = sharding.tree_shardings(state["buffers"], setup.logical_names["buffers"], mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  return {"step": replicated, "params": p_sh, "buffers": b_sh,
          "opt_state": sharding.tree_shardings_like(state["opt_state"], state["params"], p_sh,
                                                    mesh)}


def optimizer_table(train_cfg: ml_collections.ConfigDict, params) -> str:
  """The parameter -> optimizer treatment table printed when training starts."""
  if train_cfg.optimizer == "adamw":
    n_decay = sum(x.size for x in jax.tree.leaves(params) if x.ndim >= 2)
    n_all = sum(x.size for x in jax.tree.leaves(params))
    return (f"AdamW on all parameters ({n_all} values); weight decay {train_cfg.weight_decay} "
            f"on matrices ({n_decay} values), none on norms, gains, biases, A_log")
  return muon.format_table(params, mode="per_head" if train_cfg.optimizer == "muon" else "whole")
