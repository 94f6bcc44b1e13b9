"""End-to-end training on CPU: loss falls; kill -9 then the same command resumes exactly."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator

from k3jax import config, loop, train

OVERRIDES = {"model.num_layers": 4, "model.full_attn_layers": (2, 4),
             "model.attn_res_block_size": 2, "train.seq_len": 64, "train.global_batch_size": 4,
             "train.log_every": 1, "train.checkpoint_every": 4, "train.steps": 16,
             "data.default_num_docs": 400}


def _losses(workdir):
  """Loss per step from metrics.jsonl, which holds one row per step (also after a resume)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      assert rec["step"] not in out, f"step {rec['step']} logged twice"
      out[rec["step"]] = rec["loss"]
  return out


def _tensorboard_losses(workdir):
  """Loss per step as TensorBoard shows it (replayed steps purged after a resume)."""
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  acc.Reload()
  events = acc.Scalars("loss")
  steps = [e.step for e in events]
  assert len(steps) == len(set(steps)), steps
  return {e.step: e.value for e in events}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  history = loop.run(config.load("experiments/configs/k3_tiny.py", OVERRIDES), workdir,
                     profile_window=(2, 4))
  return workdir, history


def test_loss_falls_and_outputs_are_written(uninterrupted):
  workdir, history = uninterrupted
  losses = [h["loss"] for h in history]
  assert len(losses) == 16
  assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
  assert all(h["tokens_per_sec"] > 0 and h["mfu"] > 0 for h in history)
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert "16" in os.listdir(os.path.join(workdir, "checkpoints"))
  traces = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  assert config.from_json(open(os.path.join(workdir, "config.json")).read()).train.steps == 16


def test_kill_9_then_rerun_resumes_with_identical_losses(uninterrupted, tmp_path, jax_cache_dir):
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, "-m", "launch.train", "--config=experiments/configs/k3_tiny.py",
         f"--workdir={workdir}", f"--jax_cache_dir={jax_cache_dir}"] + [
             f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 400
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpt_dir) and "8" in os.listdir(ckpt_dir):
      break
    time.sleep(0.2)
  assert proc.poll() is None, proc.communicate()[0][-3000:]
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  steps_before = max(_losses(workdir))
  assert steps_before < 16
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert "resumed from step" in again.stdout + again.stderr
  expected = _losses(uninterrupted[0])
  assert _losses(workdir) == expected
  assert _tensorboard_losses(workdir) == pytest.approx(expected)


def _step(overrides: dict, batch: dict):
  cfg = config.load("experiments/configs/k3_tiny.py", overrides)
  setup, state = train.init(cfg, 0)
  return jax.jit(train.make_train_step(setup))(state, batch)


def _batch(b: int, t: int) -> dict:
  toks = np.random.default_rng(0).integers(0, 258, (b, t + 1)).astype(np.int32)
  return dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((b, t), np.int32),
              positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
              loss_mask=np.ones((b, t), np.float32))


SMALL = {k: v for k, v in OVERRIDES.items() if k.startswith("model.")}
SMALL.update({"train.seq_len": 64, "train.global_batch_size": 4, "train.optimizer": "adamw"})


def test_grad_accumulation_equals_the_whole_batch():
  """Two micro-batches give the whole batch's loss, update and balancing bias (App. D)."""
  batch = _batch(4, 64)
  s1, m1 = _step({**SMALL, "train.grad_accum_steps": 1}, batch)
  s2, m2 = _step({**SMALL, "train.grad_accum_steps": 2}, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-4, atol=2e-5)


def test_schedule_as_arrays_serves_any_run_length_with_one_program():
  """With the schedule's numbers as arrays (as `launch.train` passes them) the step's program
  does not depend on train.steps or the learning rate, and its learning rate is optax's
  warmup-cosine schedule at the state's step."""
  runs = [{**SMALL, "train.steps": 6}, {**SMALL, "train.steps": 40, "train.learning_rate": 0.02}]
  cfgs = [config.load("experiments/configs/k3_tiny.py", o) for o in runs]
  batch = _batch(4, 64)
  texts = []
  for cfg in cfgs:
    setup, state = train.init(cfg, 0)
    args = {k: np.float32(v) for k, v in train.schedule_args(cfg.train).items()}
    texts.append(jax.jit(train.make_train_step(setup)).lower(state, batch, args).as_text())
  assert texts[0] == texts[1]
  state["step"] = state["step"] + 7
  new, metrics = jax.jit(train.make_train_step(setup))(state, batch, args)
  t = cfgs[1].train
  want = optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, 1, t.steps,
                                            t.final_lr_frac * t.learning_rate)(7)
  np.testing.assert_allclose(metrics["learning_rate"], want, rtol=1e-6)
  assert jax.tree.structure(new["opt_state"]) == jax.tree.structure(state["opt_state"])


def test_exact_quantile_balancing_trains_and_refuses_accumulation():
  state, _ = _step({**SMALL, "model.moe.balancing": "quantile_exact"}, _batch(4, 64))
  bias = state["buffers"]["layers"][1]["block_sparse_moe"]["gate"]["e_score_correction_bias"]
  assert float(np.abs(np.asarray(bias)).sum()) > 0
  with pytest.raises(config.ConfigError, match="model.moe.balancing"):
    config.load("experiments/configs/k3_tiny.py",
                {**SMALL, "model.moe.balancing": "quantile_exact", "train.grad_accum_steps": 2})
