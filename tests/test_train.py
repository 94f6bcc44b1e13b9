"""End-to-end training on CPU: loss falls; kill -9 then the same command resumes exactly."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k3jax import config, loop

OVERRIDES = {"model.num_layers": 4, "model.full_attn_layers": (2, 4),
             "model.attn_res_block_size": 2, "train.seq_len": 64, "train.global_batch_size": 4,
             "train.log_every": 1, "train.checkpoint_every": 4, "train.steps": 16,
             "data.default_num_docs": 400}


def _losses(workdir):
  """Loss per step from metrics.jsonl; a re-run step must repeat its value exactly."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      assert out.setdefault(rec["step"], rec["loss"]) == rec["loss"], rec["step"]
  return out


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


def test_kill_9_then_rerun_resumes_with_identical_losses(uninterrupted, tmp_path):
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, "-m", "launch.train", "--config=experiments/configs/k3_tiny.py",
         f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
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
