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
from absl import logging
from tensorboardX import SummaryWriter

from k3jax import checkpoint, data, flops, sharding, train


def _place(batch: dict[str, np.ndarray], batch_sharding) -> dict[str, jax.Array]:
  """Host-local numpy batch -> global arrays sharded over the batch axes."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in batch.items()}


def run(cfg: ml_collections.ConfigDict, workdir: str,
        profile_window: tuple[int, int] | None = None) -> list[dict[str, float]]:
  """Trains `cfg` in `workdir`, resuming if it holds checkpoints.

  Returns the metrics logged by this invocation (every `train.log_every` steps), which are also
  appended to WORKDIR/metrics.jsonl and written as TensorBoard scalars.
  """
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(cfg.to_json(indent=2))
  t = cfg.train
  if t.global_batch_size % jax.process_count():
    raise ValueError(f"config field `train.global_batch_size`: {t.global_batch_size} is not "
                     f"divisible by the {jax.process_count()} processes")
  mesh = sharding.make_mesh(cfg.mesh)
  rules = cfg.mesh.logical_axis_rules
  batch_sharding = sharding.batch_sharding(mesh, rules)
  batch_shards = sharding.num_shards(mesh, batch_sharding.spec[0])
  if t.global_batch_size % batch_shards:
    raise ValueError(f"config field `train.global_batch_size`: {t.global_batch_size} is not "
                     f"divisible by the {batch_shards} batch shards of the mesh")

  setup, state = train.init(cfg, t.seed)
  state_shardings = train.state_shardings(setup, state, mesh, rules)
  state = jax.device_put(state, state_shardings)
  step_fn = jax.jit(train.make_train_step(setup), donate_argnums=0,
                    out_shardings=(state_shardings, None))
  say = tqdm.tqdm.write if jax.process_index() == 0 else (lambda _: None)
  counts = flops.count_params(cfg.model)
  say(f"k3jax: {cfg.name}, {counts}\noptimizer:\n"
      f"{train.optimizer_table(cfg.train, state['params'])}")

  data_iter = data.make_train_iterator(
      cfg.data, seq_len=t.seq_len, batch_size=t.global_batch_size // jax.process_count(),
      vocab_size=cfg.model.vocab_size, seed=t.seed, shard_index=jax.process_index(),
      shard_count=jax.process_count())
  ckpt = checkpoint.Checkpointer(workdir, every_n_steps=t.checkpoint_every,
                                 max_to_keep=t.keep_checkpoints)
  checkpoint.install_sigterm_handler()
  restored = ckpt.restore_latest(state, data_iter)
  start = 0
  if restored is not None:
    start, state = restored
    state = jax.device_put(state, state_shardings)
    say(f"resumed from step {start} ({ckpt.directory})")

  writer = SummaryWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 else None
  flops_per_token = flops.train_flops_per_token(cfg.model, t.seq_len, counts)
  peak, peak_source = flops.peak_flops_per_device()
  say(f"model FLOPs per token {flops_per_token:.3g}; peak {peak:.3g} FLOP/s per device "
      f"({peak_source}); mesh {dict(mesh.shape)}")
  tokens_per_step = t.global_batch_size * t.seq_len
  bar = tqdm.tqdm(total=t.steps, initial=start, dynamic_ncols=True,
                  disable=jax.process_index() != 0)
  metrics, history = {}, []
  window_t0, window_steps = time.perf_counter(), 0
  tracing = False
  for step in range(start, t.steps):
    if profile_window and step == profile_window[0]:
      jax.profiler.start_trace(os.path.join(workdir, "profile"))
      tracing = True
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      batch = _place(next(data_iter), batch_sharding)
      state, metrics = step_fn(state, batch)
    window_steps += 1
    if tracing and step + 1 == profile_window[1]:
      jax.block_until_ready(metrics)
      jax.profiler.stop_trace()
      tracing = False
    done = step + 1
    if done % t.log_every == 0 or done == t.steps:
      last = {k: float(v) for k, v in jax.device_get(metrics).items()}
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
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
          f.write(json.dumps(last) + "\n")
    bar.update(1)
    ckpt.save(done, state, data_iter, force=done == t.steps or ckpt.should_stop())
    if ckpt.should_stop():
      logging.warning("SIGTERM: saved step %d, exiting", done)
      break
  if tracing:
    jax.profiler.stop_trace()
  bar.close()
  ckpt.wait()
  ckpt.close()
  if writer is not None:
    writer.close()
  return history
