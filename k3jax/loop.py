"""The host-side training loop: mesh, data, checkpoints, metrics, profiling.

Everything numerical lives in `k3jax.train`; this file moves data in and metrics out.
"""
import json
import os
import time

import jax
import ml_collections
import numpy as np
import tqdm
from tensorboardX import SummaryWriter

from k3jax import checkpoint, data, expert_parallel, flops, pipeline, sharding, train
from k3jax import config as config_lib
from pallas_kernels import mosaic_gpu_prebuild


def _place(batch: dict[str, np.ndarray], batch_sharding,
           global_batch: int) -> dict[str, jax.Array]:
  """This process's rows (`_process_rows`) -> global [global_batch, T] arrays."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, v, (global_batch, *v.shape[1:]))
          for k, v in batch.items()}


def _process_rows(batch_sharding, global_batch: int, seq_len: int) -> range:
  """The rows of the global batch that this process's devices hold.

  One contiguous block; processes whose devices hold the same block (replicas over `pipeline`
  or `context`) read the same documents, the others disjoint ones.
  """
  blocks = {index[0].indices(global_batch)[:2] for index in
            batch_sharding.addressable_devices_indices_map((global_batch, seq_len)).values()}
  start, stop = min(a for a, _ in blocks), max(b for _, b in blocks)
  size = stop - start
  if sum(b - a for a, b in blocks) != size or start % size or global_batch % size:
    raise ValueError(f"this process's devices hold batch rows {sorted(blocks)}: not one block "
                     f"of an even split of the {global_batch} rows; order the mesh devices by "
                     f"process")
  return range(start, stop)


def _write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file, so a reader sees old or new, never half."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _saved_config(workdir: str) -> ml_collections.ConfigDict | None:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return config_lib.from_json(f.read())


def _drop_metrics_after(path: str, step: int) -> int:
  """Removes the rows of steps after `step` (replayed after a resume); returns how many."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    rows = [line for line in f if line.strip()]
  kept = [line for line in rows if json.loads(line)["step"] <= step]
  if len(kept) != len(rows):
    _write_atomic(path, "".join(kept))
  return len(rows) - len(kept)


def run(cfg: ml_collections.ConfigDict, workdir: str,
        profile_window: tuple[int, int] | None = None) -> list[dict[str, float]]:
  """Trains `cfg` in `workdir`, resuming if it holds checkpoints.

  Returns the metrics logged by this invocation (every `train.log_every` steps), which are also
  written to WORKDIR/metrics.jsonl (one row per logged step: rows of steps replayed after a
  resume replace the lost ones) and as TensorBoard scalars. Nothing is written into the workdir
  before the data is checked and any checkpoint is restored into this config's train state; a
  checkpoint of another model config raises CheckpointMismatchError naming the parameters and
  the config fields that differ. After SIGTERM the loop stops with a checkpoint
  (`checkpoint.Checkpointer.should_stop()` tells the caller).
  """
  t = cfg.train
  mesh = sharding.make_mesh(cfg.mesh)
  rules = cfg.mesh.logical_axis_rules
  batch_sharding = sharding.batch_sharding(mesh, rules)
  batch_shards = sharding.num_shards(mesh, batch_sharding.spec[0])
  if t.global_batch_size % batch_shards:
    raise config_lib.ConfigError(
        "train.global_batch_size", f"{t.global_batch_size} is not divisible by the "
        f"{batch_shards} batch shards of the mesh")
  rows = _process_rows(batch_sharding, t.global_batch_size, t.seq_len)
  data_iter = data.make_train_iterator(
      cfg.data, seq_len=t.seq_len, batch_size=len(rows), vocab_size=cfg.model.vocab_size,
      seed=t.seed, shard_index=rows.start // len(rows),
      shard_count=t.global_batch_size // len(rows))

  setup, state = train.init(cfg, t.seed)
  state_shardings = train.state_shardings(setup, state, mesh, rules)
  state = jax.device_put(state, state_shardings)
  say = tqdm.tqdm.write if jax.process_index() == 0 else (lambda _: None)
  counts = flops.count_params(cfg.model)
  say(f"k3jax: {cfg.name}, {counts}\noptimizer:\n"
      f"{train.optimizer_table(cfg.train, state['params'])}")
  if cfg.mesh.pipeline > 1:
    say(pipeline.describe(cfg))

  saved_cfg = _saved_config(workdir)
  changed = config_lib.differences(saved_cfg, cfg) if saved_cfg is not None else []
  ckpt = checkpoint.Checkpointer(workdir, every_n_steps=t.checkpoint_every,
                                 max_to_keep=t.keep_checkpoints)
  try:
    restored = ckpt.restore_latest(state, data_iter)
  except checkpoint.CheckpointMismatchError as e:
    ckpt.close()
    fields = "".join(f"\n  {c}" for c in changed)
    raise checkpoint.CheckpointMismatchError(
        f"{e}\nthis run's config differs from {workdir}/config.json in:{fields or ' nothing'}"
        f"\nuse another --workdir, or the saved config's values") from None
  start = 0
  if restored is not None:
    start, state = restored
    state = jax.device_put(state, state_shardings)
    say(f"resumed from step {start} ({ckpt.directory})")
    if changed:
      say("config changed since the checkpoint: " + "; ".join(changed))
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    _write_atomic(os.path.join(workdir, "config.json"), cfg.to_json(indent=2))
    dropped = _drop_metrics_after(metrics_path, start)
    if dropped:
      say(f"metrics.jsonl: dropped {dropped} rows after step {start} (they are trained again)")
  if start >= t.steps:
    say(f"the checkpoint holds step {start} >= train.steps={t.steps}: nothing to train (raise "
        f"--config.train.steps to continue)")

  writer = None
  if jax.process_index() == 0:
    # purge_step: TensorBoard drops this directory's events at or after it from an
    # interrupted run, so a replayed step shows once.
    writer = SummaryWriter(os.path.join(workdir, "tensorboard"),
                           purge_step=start + 1 if start else None)
  jitted = jax.jit(train.make_train_step(setup), donate_argnums=0,
                   out_shardings=(state_shardings, None),
                   compiler_options=train.compiler_options(cfg))
  # The schedule as arrays: runs of any length or learning rate share the compiled step.
  schedule = jax.device_put({k: np.asarray(v, np.float32)
                             for k, v in train.schedule_args(t).items()},
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  compiled = None

  def step_fn(state, batch):
    nonlocal compiled
    with jax.set_mesh(mesh):  # traced with the mesh: FSDP gathers, model code's shard_maps
      if compiled is None:  # compiled ahead, its Mosaic GPU kernels built in parallel meanwhile
        compiled, report = mosaic_gpu_prebuild.compile(
            jitted.trace(state, batch, schedule).lower(),
            prebuild=cfg.kernels.prebuild_mosaic_gpu)
        if report:
          say(str(report))
      return compiled(state, batch, schedule)

  checkpoint.install_sigterm_handler()
  flops_per_token = flops.train_flops_per_token(cfg.model, t.seq_len, counts)
  peak, peak_source = flops.peak_flops_per_device()
  say(f"model FLOPs per token {flops_per_token:.3g}; peak {peak:.3g} FLOP/s per device "
      f"({peak_source}); mesh {dict(mesh.shape)}; train state per device "
      f"{sharding.per_device_bytes(state) / 2**20:.1f} of "
      f"{sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20:.1f} MiB")
  tokens_per_step = t.global_batch_size * t.seq_len
  bar = tqdm.tqdm(total=t.steps, initial=min(start, t.steps), dynamic_ncols=True,
                  disable=jax.process_index() != 0)
  metrics, history = {}, []
  window_t0, window_steps = time.perf_counter(), 0
  tracing = False
  try:
    for step in range(start, t.steps):
      if profile_window and step == profile_window[0]:
        jax.profiler.start_trace(os.path.join(workdir, "profile"))
        tracing = True
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        batch = _place(next(data_iter), batch_sharding, t.global_batch_size)
        state, metrics = step_fn(state, batch)
      window_steps += 1
      if tracing and step + 1 == profile_window[1]:
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        tracing = False
      done = step + 1
      if done % t.log_every == 0 or done == t.steps:
        last = {k: float(v) for k, v in jax.device_get(metrics).items()}
        expert_parallel.check_dropped(last)
        dt = time.perf_counter() - window_t0
        last["tokens_per_sec"] = window_steps * tokens_per_step / dt
        last["mfu"] = last["tokens_per_sec"] * flops_per_token / (peak * jax.device_count())
        window_t0, window_steps = time.perf_counter(), 0
        bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}",
                        mfu=f"{100 * last['mfu']:.2f}%")
        last["step"] = done
        history.append(last)
        if writer is not None:
          for k, v in last.items():
            writer.add_scalar(k, v, done)
          writer.flush()
          with open(metrics_path, "a") as f:
            f.write(json.dumps(last) + "\n")
      bar.update(1)
      stop = ckpt.stop_after(done)
      ckpt.save(done, state, data_iter, force=done == t.steps or stop)
      if stop:
        say(f"SIGTERM: saved step {done}; run the same command to resume")
        break
  finally:
    if tracing:
      jax.profiler.stop_trace()
    bar.close()
    ckpt.close()  # waits for the last async save: no partial checkpoint is left
    if writer is not None:
      writer.close()
  say(f"checkpoints: {ckpt.directory}\nmetrics: {metrics_path}\n"
      f"TensorBoard: tensorboard --logdir {os.path.join(workdir, 'tensorboard')}"
      + (f"\nprofile: {os.path.join(workdir, 'profile')}" if profile_window else ""))
  return history
