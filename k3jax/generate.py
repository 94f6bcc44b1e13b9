"""Autoregressive sampling over the dual cache (report §5.4), and loading a trained model.

`generate` serves a batch of prompts of different lengths with two compiled programs. The
prefill (`_prefill`) runs the prompts, right-padded to one length, through one
`K3ForCausalLM.hidden_states` call with each row's length: padding enters no KDA state (its
log-decay and beta are 0, the conv tails end at the row's last token) and no attended latent;
each row's first new token is drawn at its last prompt token. The decode loop (`_decode`) draws
one token a step in a `jax.lax.while_loop` whose step count is a traced value: each step feeds
the last tokens through `extend` (absorbed MLA over each row's filled latents through
`pallas_kernels.decode_attention`, the KDA recurrence from its state). Draws are those of
`sample_logits` (greedy, temperature, top-p nucleus).

Shapes come from `Buckets` (prompt length rounded up to a power of two, cache slots from a
list), so that a server's steady state never compiles: one prefill program per (batch, prompt
bucket, cache bucket) and one decode program per (batch, cache bucket) serve every prompt
length, max_new_tokens, temperature, top_p, seed and eos_id that fit them. Under a mesh
(`mesh=`), the programs are traced under `jax.set_mesh` with the parameters gathered layer by
layer (`sharding.fsdp_gather`) as training does; place the parameters by the same rules
(`load_model(..., mesh=)`, `k3jax.hf.load_checkpoint(..., mesh=)`).
"""
import contextlib
import dataclasses
import functools
import math
import os
import time
from typing import Any, Sequence

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
from k3jax import sharding
from k3jax.model import K3ForCausalLM


def _check_sampling(temperature: float, top_p: float) -> None:
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
      math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
  if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
    raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def _sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array
            ) -> jax.Array:
  """`sample_logits` with traced scalar settings (one compiled program serves them all); the
  sort over the vocabulary runs only when sampling (temperature > 0)."""

  def sampled(logits):
    scaled = logits.astype(jnp.float32) / temperature
    order = jnp.argsort(-scaled, axis=-1)  # most probable first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1)  # needed while the mass before it is short
    pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

  greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(temperature > 0, sampled, greedy, logits)


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


def _is_count(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Buckets:
  """The static shapes of the generation programs.

  min_prompt: the shortest prompt bucket; a batch's prompts are right-padded to
  max(min_prompt, the smallest power of two >= its longest prompt). cache_sizes: latent-cache
  slots, increasing; a batch takes the smallest that holds its prompt bucket and its longest
  prompt + max_new_tokens - 1 (the last new token is never fed back), else the smallest power
  of two that does.
  """
  min_prompt: int = 16
  cache_sizes: tuple[int, ...] = (256, 1024, 4096, 16384, 65536, 131072)

  def __post_init__(self):
    if not _is_count(self.min_prompt) or self.min_prompt < 1:
      raise ValueError(f"min_prompt must be an integer >= 1, got {self.min_prompt!r}")
    sizes = tuple(self.cache_sizes)
    if (not sizes or any(not _is_count(c) or c < 1 for c in sizes)
        or list(sizes) != sorted(set(sizes))):
      raise ValueError(f"cache_sizes must be strictly increasing integers >= 1, got "
                       f"{self.cache_sizes!r}")
    object.__setattr__(self, "cache_sizes", sizes)

  def prompt_len(self, longest: int) -> int:
    """The padded prompt length of a batch whose longest prompt has `longest` tokens."""
    return max(self.min_prompt, 1 << (int(longest) - 1).bit_length())

  def cache_len(self, need: int) -> int:
    """The cache slots of a batch that needs `need` of them."""
    for size in self.cache_sizes:
      if size >= need:
        return size
    return 1 << (int(need) - 1).bit_length()

  def shape(self, batch: int, longest: int, max_new_tokens: int) -> tuple[int, int, int]:
    """(batch, padded prompt length, cache slots) of the programs that serve a batch."""
    p = self.prompt_len(longest)
    return batch, p, self.cache_len(max(p, longest + max_new_tokens - 1))


@dataclasses.dataclass(frozen=True)
class Generation:
  """A batch's tokens (per row: its prompt, then its new tokens, int32) and what it cost.

  prompt_tokens: the prompts' tokens (padding not counted); new_tokens: tokens drawn per row
  (the first by the prefill, the rest by new_tokens - 1 decode steps of the whole batch);
  prefill_s, decode_s: wall seconds of each program, compilation included when it compiled;
  shape: (batch, padded prompt length, cache slots).
  """
  tokens: list[np.ndarray]
  prompt_tokens: int
  new_tokens: int
  prefill_s: float
  decode_s: float
  shape: tuple[int, int, int]


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len"))
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, lengths: jax.Array,
             key: jax.Array, temperature: jax.Array, top_p: jax.Array, *, cache_len: int
             ) -> tuple[jax.Array, dict]:
  """Prompts tokens [B, P] (row b's first lengths[b] tokens, then padding) into a fresh cache
  of cache_len slots; returns (the first new tokens [B], drawn at each row's last prompt
  token, the cache). The model as `nnx.split(model)` gives it: jax.jit's dispatch of
  a hashable graphdef and a state pytree takes milliseconds where nnx.jit's walk of the module
  graph took most of a second per call for k3_small."""
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(tokens.shape[0], cache_len)
  h, _, cache = model.hidden_states(tokens, cache=cache, lengths=lengths)
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)  # [B, 1, d]
  logits = model.logits(last)[:, 0]
  return _sample(logits, jax.random.fold_in(key, 0), temperature, top_p), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"),
                   donate_argnames=("cache",))
def _decode(graphdef: nnx.GraphDef, state: nnx.State, cache: dict, tok: jax.Array,
            key: jax.Array, temperature: jax.Array, top_p: jax.Array, eos_id: jax.Array,
            max_new: jax.Array, *, capacity: int) -> tuple[jax.Array, jax.Array, dict]:
  """New tokens 1 .. max_new - 1 after the first ones tok [B] (max_new traced, <= capacity).

  Returns (new tokens [B, capacity], the first n valid; n; the cache). Decoding stops early
  once every row has emitted eos_id (< 0: none); a finished row emits eos_id from then on.
  The model as `nnx.split(model)` gives it (see `_prefill`).
  """
  model = nnx.merge(graphdef, state)
  model.prepare_decode()   # weight concatenations made once, outside the while loop
  b = tok.shape[0]
  done = tok == eos_id
  out = jnp.zeros((b, capacity), jnp.int32).at[:, 0].set(tok)
  steps = jnp.minimum(max_new, capacity)

  def cond(carry):
    i, _, done, _, _ = carry
    return (i < steps) & ~jnp.all(done)

  def body(carry):
    i, tok, done, out, cache = carry
    logits, cache = model.extend(tok[:, None], cache)
    tok = _sample(logits[:, 0], jax.random.fold_in(key, i), temperature, top_p)
    tok = jnp.where(done, eos_id, tok)
    return i + 1, tok, done | (tok == eos_id), out.at[:, i].set(tok), cache

  n, _, _, out, cache = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, done, out, cache))
  return out, n, cache


def _prompt_rows(prompt_tokens: Any, vocab: int) -> list[np.ndarray]:
  """The prompts as a list of 1-D int32 arrays, checked."""
  if isinstance(prompt_tokens, (list, tuple)):
    if not prompt_tokens:
      raise ValueError("prompt_tokens must hold at least one prompt, got an empty list")
    rows = [np.asarray(p) for p in prompt_tokens]
    for i, row in enumerate(rows):
      if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
        raise ValueError(f"prompt_tokens[{i}] must be a non-empty 1-D integer sequence, got "
                         f"shape {row.shape} dtype {row.dtype}")
  else:
    prompt = np.asarray(prompt_tokens)
    if (prompt.ndim != 2 or prompt.shape[0] == 0 or prompt.shape[1] == 0
        or not np.issubdtype(prompt.dtype, np.integer)):
      raise ValueError(f"prompt_tokens must be an integer [B, T0] array with B, T0 >= 1 or a "
                       f"list of B prompts, got shape {prompt.shape} dtype {prompt.dtype}")
    rows = list(prompt)
  low, high = min(int(r.min()) for r in rows), max(int(r.max()) for r in rows)
  if low < 0 or high >= vocab:
    raise ValueError(f"prompt_tokens must lie in [0, vocab_size={vocab}), got ids in "
                     f"[{low}, {high}]")
  return [r.astype(np.int32) for r in rows]


def _place(mesh: jax.sharding.Mesh | None, rules, x: np.ndarray) -> jax.Array:
  """x on the first device, or on the mesh: split over the batch axes where they divide its
  first dim, else replicated."""
  if mesh is None:
    return jax.device_put(x)
  spec = sharding.logical_to_mesh(("activation_batch",), rules)
  if x.ndim == 0 or x.shape[0] % sharding.num_shards(mesh, spec[0]):
    spec = jax.sharding.PartitionSpec()
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def generate_timed(model: K3ForCausalLM, prompt_tokens: Any, *, max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                   eos_id: int | None = None, buckets: Buckets = Buckets(),
                   cache_len: int | None = None, mesh: jax.sharding.Mesh | None = None,
                   rules: Sequence = ()) -> Generation:
  """`generate`, returning every row as a list and the time each program took."""
  vocab = model.cfg.vocab_size
  rows = _prompt_rows(prompt_tokens, vocab)
  if not _is_count(max_new_tokens) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
  _check_sampling(temperature, top_p)
  if eos_id is not None and (not _is_count(eos_id) or not 0 <= eos_id < vocab):
    raise ValueError(f"eos_id must be None or an integer in [0, vocab_size={vocab}), "
                     f"got {eos_id!r}")
  if not _is_count(seed) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  if not isinstance(buckets, Buckets):
    raise ValueError(f"buckets must be a generate.Buckets, got {buckets!r}")
  lengths = np.array([r.size for r in rows], np.int32)
  b, p, slots = buckets.shape(len(rows), int(lengths.max()), max_new_tokens)
  need = max(p, int(lengths.max()) + max_new_tokens - 1)
  if cache_len is not None and (not _is_count(cache_len) or cache_len < need):
    raise ValueError(f"cache_len must be an integer >= {need} (the prompt bucket {p}, and the "
                     f"longest prompt {int(lengths.max())} + max_new_tokens {max_new_tokens} - 1)"
                     f", got {cache_len!r}")
  shape = (b, p, slots if cache_len is None else int(cache_len))
  if max_new_tokens == 0:
    return Generation(rows, int(lengths.sum()), 0, 0.0, 0.0, shape)
  padded = np.zeros((b, p), np.int32)
  for i, row in enumerate(rows):
    padded[i, :row.size] = row
  put = functools.partial(_place, mesh, rules)
  key = jax.random.key(seed)
  temperature, top_p = np.float32(temperature), np.float32(top_p)
  scope = contextlib.ExitStack()
  if mesh is not None:
    scope.enter_context(jax.set_mesh(mesh))
    scope.enter_context(sharding.logical_axis_rules(rules))
  graphdef, state = nnx.split(model)
  with scope:
    start = time.perf_counter()
    tok, cache = _prefill(graphdef, state, put(padded), put(lengths), key, put(temperature),
                          put(top_p), cache_len=shape[2])
    jax.block_until_ready(tok)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out, n, _ = _decode(graphdef, state, cache, tok, key, put(temperature), put(top_p),
                        put(np.int32(-1 if eos_id is None else eos_id)),
                        put(np.int32(max_new_tokens)), capacity=shape[2])
    out, n = np.asarray(out), int(n)
    decode_s = time.perf_counter() - start
  tokens = [np.concatenate([row, out[i, :n]]) for i, row in enumerate(rows)]
  return Generation(tokens, int(lengths.sum()), n, prefill_s, decode_s, shape)


def generate(model: K3ForCausalLM, prompt_tokens: Any, *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None, buckets: Buckets = Buckets(),
             cache_len: int | None = None, mesh: jax.sharding.Mesh | None = None,
             rules: Sequence = ()) -> np.ndarray | list[np.ndarray]:
  """Continues every prompt; returns its tokens followed by n new ones.

  prompt_tokens: an integer [B, T0] array (returns tokens [B, T0 + n] int32) or a list of B
  non-empty integer sequences of any lengths (returns a list of B int32 arrays). n <=
  max_new_tokens: decoding stops early once every row has emitted `eos_id`; a row that
  finished keeps emitting `eos_id` until then. A greedy row's tokens are those of its prompt
  run alone (the other rows and the padding change them only by rounding); sampled draws are a
  function of `seed` and of the batch's size and order.
  buckets: the programs' static shapes (`Buckets`); cache_len: cache slots instead of the
  bucket's. mesh: run under `jax.set_mesh(mesh)` with `rules` (the config's
  `mesh.logical_axis_rules`) resolving the per-layer parameter gathers; the batch is split over
  the mesh axes of `activation_batch` where they divide it.
  """
  result = generate_timed(model, prompt_tokens, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, eos_id=eos_id,
                          buckets=buckets, cache_len=cache_len, mesh=mesh, rules=rules)
  if isinstance(prompt_tokens, (list, tuple)):
    return result.tokens
  return np.stack(result.tokens)


def _abstract_model(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None
                    ) -> tuple[Any, dict, dict]:
  """(graphdef, params, buffers) of the model with jax.ShapeDtypeStruct leaves on the first
  device, or on `mesh` as the config's `mesh.logical_axis_rules` place them
  (`sharding.param_spec`)."""
  abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0),
                                                  kernels=cfg.kernels))
  graphdef, params, buffers = nnx.split(abstract, nnx.Param, ...)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  rules = cfg.mesh.logical_axis_rules

  def struct(var):
    place = device if mesh is None else jax.sharding.NamedSharding(mesh, sharding.param_spec(
        var.get_metadata().get("out_sharding"), var.shape, mesh, rules))
    return jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=place)

  def structs(state):
    flat = {path: struct(var) for path, var in nnx.to_flat_state(state)}
    return nnx.to_pure_dict(nnx.from_flat_state(flat))

  return graphdef, structs(params), structs(buffers)


def load_model(workdir: str, step: int | None = None, overrides: dict[str, Any] | None = None,
               mesh: jax.sharding.Mesh | None = None
               ) -> tuple[K3ForCausalLM, ml_collections.ConfigDict, int]:
  """The model trained in `workdir` (`launch.train`): (model, config, checkpoint step).

  Reads WORKDIR/config.json and restores only `params` and `buffers` of the saved train
  state (orbax partial restore; no optimizer state, no data iterator) onto the first
  device, or with `mesh` each parameter split over it as the config's
  `mesh.logical_axis_rules` say (`sharding.param_spec`; generate under that mesh with
  `generate(..., mesh=mesh, rules=cfg.mesh.logical_axis_rules)`). step None: the newest
  checkpoint that can be read (an unreadable one is skipped with a warning; nothing in the
  workdir is changed). overrides: dotted config
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
    _, params, buffers = _abstract_model(restore_cfg, mesh)
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
        graphdef, *placed = _abstract_model(cfg, mesh)
        params, buffers = jax.tree.map(lambda x, want: jax.device_put(x, want.sharding),
                                       mx.pack_experts(params, buffers), tuple(placed))
        return nnx.merge(graphdef, params, buffers), cfg, s
      return nnx.merge(_abstract_model(cfg)[0], params, buffers), cfg, s
  finally:
    manager.close()
  details = "\n".join(f"  step {s}: {r}" for s, r in failures)
  raise checkpoint.CheckpointRestoreError(
      f"none of the checkpoints {[s for s, _ in failures]} in {directory} can be restored "
      f"into the model of {config_path}:\n{details}")
