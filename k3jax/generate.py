"""Autoregressive sampling over the dual cache (report §5.4), and loading a trained model.

`generate` prefills the prompt with one `K3ForCausalLM.extend` call (KDA states and conv
tails, MLA latents), then decodes one token a step in a `jax.lax.while_loop`, all in one
`nnx.jit`-compiled program: each step feeds the last token through `extend` (absorbed MLA
over the latent cache, the KDA recurrence from its state) and draws the next token as
`sample_logits` does (greedy, temperature, top-p nucleus).
"""
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

import k3jax  # noqa: F401  (turns off eager sharding before parameters are created)
from k3jax import checkpoint
from k3jax import config as config_lib
from k3jax import mx
from k3jax.model import K3ForCausalLM


def _check_sampling(temperature: float, top_p: float) -> None:
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
      math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
  if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
    raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def _sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array
            ) -> jax.Array:
  """`sample_logits` with traced scalar settings (one compiled program serves them all)."""
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
  order = jnp.argsort(-scaled, axis=-1)  # most probable first
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p) | (top_p >= 1)  # needed while the mass before it is short
  pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float,
                  top_p: float = 1.0) -> jax.Array:
  """Next tokens [B] int32 from logits [B, V].

  temperature 0: argmax (greedy; `key` unused). Otherwise a draw from
  softmax(logits / temperature) restricted to the nucleus (top-p): the smallest set of
  most probable tokens whose probability mass is >= top_p (at least the most probable
  token), renormalised; top_p = 1 keeps every token.
  """
  _check_sampling(temperature, top_p)
  if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be a floating [B, V] array, got shape {logits.shape} "
                     f"dtype {logits.dtype}")
  return _sample(logits, key, jnp.float32(temperature), jnp.float32(top_p))


@functools.partial(nnx.jit, static_argnames=("max_new_tokens",))
def _generate(model: K3ForCausalLM, prompt: jax.Array, key: jax.Array, temperature: jax.Array,
              top_p: jax.Array, eos_id: jax.Array, *, max_new_tokens: int
              ) -> tuple[jax.Array, jax.Array]:
  """Prefill + decode loop; returns (tokens [B, T0 + max_new_tokens], new tokens emitted).

  eos_id < 0: no end-of-sequence token.
  """
  b, t0 = prompt.shape
  total = t0 + max_new_tokens
  out = jnp.zeros((b, total), jnp.int32).at[:, :t0].set(prompt)

  def emit(logits, i, done, out):
    """Samples new token i from logits [B, V]; a finished row emits eos_id instead."""
    tok = _sample(logits, jax.random.fold_in(key, i), temperature, top_p)
    tok = jnp.where(done, eos_id, tok)
    done = done | (tok == eos_id)
    return tok, done, out.at[:, t0 + i].set(tok)

  logits, cache = model.extend(prompt, model.init_cache(b, total))
  tok, done, out = emit(logits[:, -1], 0, jnp.zeros((b,), bool), out)

  def cond(carry):
    i, _, done, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, tok, done, out, cache = carry
    logits, cache = model.extend(tok[:, None], cache)
    tok, done, out = emit(logits[:, 0], i, done, out)
    return i + 1, tok, done, out, cache

  n, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, done, out, cache))
  return out, n


def generate(model: K3ForCausalLM, prompt_tokens: jax.Array | np.ndarray, *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None) -> np.ndarray:
  """Continues every row of prompt_tokens [B, T0] int32; returns tokens [B, T0 + n].

  n <= max_new_tokens: decoding stops early once every row has emitted `eos_id`; a row
  that finished keeps emitting `eos_id` until then. All rows share one cache position,
  so prompts in a batch have the same length (no padding). One compiled program per
  (model, B, T0, max_new_tokens) serves every temperature, top_p, seed and eos_id;
  the draws are a function of `seed`.
  """
  prompt = np.asarray(prompt_tokens)
  vocab = model.cfg.vocab_size
  if prompt.ndim != 2 or prompt.shape[1] == 0 or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"prompt_tokens must be an integer [B, T0] array with T0 >= 1, got shape "
                     f"{prompt.shape} dtype {prompt.dtype}")
  if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab):
    raise ValueError(f"prompt_tokens must lie in [0, vocab_size={vocab}), got ids in "
                     f"[{prompt.min()}, {prompt.max()}]")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
  _check_sampling(temperature, top_p)
  if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                             or not 0 <= eos_id < vocab):
    raise ValueError(f"eos_id must be None or an integer in [0, vocab_size={vocab}), "
                     f"got {eos_id!r}")
  if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  if max_new_tokens == 0:
    return prompt.astype(np.int32)
  out, n = _generate(model, jnp.asarray(prompt, jnp.int32), jax.random.key(seed),
                     jnp.float32(temperature), jnp.float32(top_p),
                     jnp.int32(-1 if eos_id is None else eos_id), max_new_tokens=max_new_tokens)
  return np.asarray(out)[:, :prompt.shape[1] + int(n)]


def _abstract_model(cfg: ml_collections.ConfigDict) -> tuple[Any, dict, dict]:
  """(graphdef, params, buffers) of the model with jax.ShapeDtypeStruct leaves on one device."""
  abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0),
                                                  kernels=cfg.kernels))
  graphdef, params, buffers = nnx.split(abstract, nnx.Param, ...)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
  return (graphdef, jax.tree.map(on_device, nnx.to_pure_dict(params)),
          jax.tree.map(on_device, nnx.to_pure_dict(buffers)))


def load_model(workdir: str, step: int | None = None, overrides: dict[str, Any] | None = None
               ) -> tuple[K3ForCausalLM, ml_collections.ConfigDict, int]:
  """The model trained in `workdir` (`launch.train`): (model, config, checkpoint step).

  Reads WORKDIR/config.json and restores only `params` and `buffers` of the saved train
  state (orbax partial restore; no optimizer state, no data iterator) onto the first
  device. step None: the newest checkpoint that can be read (an unreadable one is
  skipped with a warning; nothing in the workdir is changed). overrides: dotted config
  fields set for inference (a field that changes parameter shapes fails the restore);
  `{"model.moe.expert_format": "mxfp4"}` on a float checkpoint packs the routed experts at
  load (`k3jax.mx.pack_experts`). The config returned has the overrides.
  """
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{config_path} not found; is {workdir!r} a training workdir "
                            "(python -m launch.train --workdir=...)?")
  with open(config_path) as f:
    saved = config_lib.from_json(f.read())
  cfg = config_lib.override(config_lib.from_json(saved.to_json()), overrides)
  saved_format = saved.model.moe.expert_format
  pack = cfg.model.moe.expert_format != saved_format
  if pack and saved_format != "float":
    raise config_lib.ConfigError("model.moe.expert_format",
                                 f"the checkpoint's experts are {saved_format!r}; only float "
                                 "experts can be packed at load")
  # The checkpoint's variables: cfg's model with the experts as saved.
  restore_cfg = config_lib.override(config_lib.from_json(cfg.to_json()),
                                    {"model.moe.expert_format": saved_format})
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints in {workdir!r}: {directory} does not exist")
  with checkpoint.quiet_libraries():  # orbax warns that a read-only directory is read only
    manager = ocp.CheckpointManager(
        directory, item_names=("state",),
        item_handlers={"state": ocp.PyTreeCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0,
                                             create=False))
  try:
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoints in {directory} (no finished step directory)")
    if step is not None:
      if step not in steps:
        raise checkpoint.CheckpointError(f"step {step} has no checkpoint in {directory}; "
                                         f"available steps: {sorted(steps)}")
      steps = [step]
    _, params, buffers = _abstract_model(restore_cfg)
    target = {"params": params, "buffers": buffers}
    failures = []
    for s in steps:
      try:
        with checkpoint.quiet_libraries():
          restored = manager.restore(s, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True)))
      except Exception as e:  # pylint: disable=broad-exception-caught
        # orbax, tensorstore and json report a damaged step with many exception types.
        reason = checkpoint.failure_reason(e)
        logging.warning("checkpoint step %d in %s cannot be restored (%s)", s, directory, reason)
        failures.append((s, reason))
        continue
      params, buffers = restored.state["params"], restored.state["buffers"]
      if pack:
        params, buffers = mx.pack_experts(params, buffers)
      return nnx.merge(_abstract_model(cfg)[0], params, buffers), cfg, s
  finally:
    manager.close()
  details = "\n".join(f"  step {s}: {r}" for s, r in failures)
  raise checkpoint.CheckpointRestoreError(
      f"none of the checkpoints {[s for s, _ in failures]} in {directory} can be restored "
      f"into the model of {config_path}:\n{details}")
