"""`launch.train --distributed` as two processes on localhost (CPU devices, gloo collectives).

Each process has 2 CPU devices; the mesh (data = 4) spans both. SIGTERM to one process (a
preemption) stops both after the same step with a checkpoint (exit 75); the run resumed from it
ends with the losses of an uninterrupted run, step by step. The first step's loss equals one
computed in this process from the two processes' data shards (each process fed its own rows of
the global batch).
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax import config, data, train
from launch import cli
from mesh_testing import cpu_env

STEPS = 8
# One MLA layer and AdamW: the step compiles in seconds (the mechanics are under test here).
OVERRIDES = {"model.num_layers": 1, "model.full_attn_layers": (1,), "model.attn_res_block_size": 1,
             "model.mtp_num_layers": 0, "train.optimizer": "adamw", "train.seq_len": 32,
             "train.global_batch_size": 8, "train.log_every": 1, "train.checkpoint_every": 2,
             "train.steps": STEPS, "data.default_num_docs": 200}


def _port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture
def start(tmp_path):
  """start(workdir) -> the two processes of one run (a fresh coordinator port per run); any
  still running at the end of the test are killed."""
  env = cpu_env(2, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  started = []

  def start_run(workdir) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "launch.train", "--config=experiments/configs/k3_tiny.py",
           f"--workdir={workdir}", "--distributed", f"--coordinator_address=localhost:{_port()}",
           "--num_processes=2"] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    procs = [subprocess.Popen(cmd + [f"--process_id={i}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    started.extend(procs)
    return procs

  yield start_run
  for p in started:
    if p.poll() is None:
      p.kill()
      p.wait()


def _finish(procs, returncode=0, timeout=300) -> list[str]:
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == returncode, out[-3000:]
  return outs


def _losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  return {r["step"]: r["loss"] for r in rows}


def test_preempted_run_resumes_with_the_uninterrupted_losses(tmp_path, start):
  """One test, not several: the runs are the cost (pytest-xdist would repeat a shared fixture)."""
  whole, resumed = tmp_path / "whole", tmp_path / "resumed"
  _finish(start(whole))
  procs = start(resumed)
  deadline = time.time() + 300
  while not (resumed / "checkpoints" / "2").is_dir():
    assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint 2"
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)
  preempted = _finish(procs, returncode=cli.EXIT_PREEMPTED)
  stops = [re.findall(r"every process stops after step (\d+)", out) for out in preempted]
  assert stops[0] and stops[0] == stops[1] and int(stops[0][0]) < STEPS, preempted[0][-2000:]
  _finish(start(resumed))
  want = _losses(whole)
  np.testing.assert_allclose([_losses(resumed)[s] for s in want], list(want.values()), rtol=1e-6)
  assert want[1] == pytest.approx(_first_loss_of_both_shards(), rel=1e-5)


def _first_loss_of_both_shards() -> float:
  """Step 1's loss on the global batch of shard 0 (rows 0-3) and shard 1 (rows 4-7)."""
  cfg = config.load("experiments/configs/k3_tiny.py", OVERRIDES)
  t = cfg.train
  shards = [next(data.make_train_iterator(cfg.data, seq_len=t.seq_len, batch_size=4,
                                          vocab_size=cfg.model.vocab_size, seed=t.seed,
                                          shard_index=i, shard_count=2)) for i in range(2)]
  assert not np.array_equal(shards[0]["inputs"], shards[1]["inputs"])
  batch = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
  setup, state = train.init(cfg, t.seed)
  loss = jax.jit(lambda s, b: train.loss_fn(s["params"], s["buffers"], setup.graphdef, b)[0])(
      state, batch)
  return float(loss)


def _fake_tools(tmp_path, statuses: dict[str, int]) -> dict[str, str]:
  """An environment whose PATH has stand-ins for cluster tools: each appends its arguments (and
  the JAX_LOCAL_DEVICE_IDS it sees) to tmp_path/<name>.log and exits with its status."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, status in statuses.items():
    tool = bin_dir / name
    tool.write_text(f'#!/usr/bin/env bash\necho "ids=${{JAX_LOCAL_DEVICE_IDS:-}} $*" '
                    f'>> {tmp_path / name}.log\nexit {status}\n')
    tool.chmod(0o755)
  return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_slurm_script_requeues_after_preemption(tmp_path):
  env = dict(_fake_tools(tmp_path, {"srun": cli.EXIT_PREEMPTED, "scontrol": 0}),
             SLURM_JOB_ID="7", PROCS="node")
  proc = subprocess.run(["bash", "launch/slurm_gpu.sbatch", "--config=c.py", "--workdir=/w"],
                        env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == cli.EXIT_PREEMPTED, proc.stderr
  srun = (tmp_path / "srun.log").read_text()
  assert srun.startswith("ids=0,1,2,3,4,5,6,7 --ntasks-per-node=1 ")
  assert "-m launch.train --distributed --config=c.py --workdir=/w" in srun
  assert (tmp_path / "scontrol.log").read_text().strip() == "ids=0,1,2,3,4,5,6,7 requeue 7"
  bad = subprocess.run(["bash", "launch/slurm_gpu.sbatch"], env=dict(env, PROCS="socket"),
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "PROCS must be gpu or node" in bad.stderr


def test_tpu_script_runs_train_on_every_worker(tmp_path):
  env = dict(_fake_tools(tmp_path, {"gcloud": 0}), TPU_NAME="k3", ZONE="us-east5-a")
  proc = subprocess.run(["bash", "launch/tpu_pod.sh", "train", "--config=c.py",
                         "--config.model.full_attn_layers=(1,)"], env=env, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  call = (tmp_path / "gcloud.log").read_text()
  assert call.startswith("ids= compute tpus tpu-vm ssh k3 --zone=us-east5-a --worker=all ")
  assert ("--command=cd k3jax && .venv/bin/python -m launch.train --distributed --config=c.py "
          "--config.model.full_attn_layers=\\(1\\,\\)") in call
  missing = subprocess.run(["bash", "launch/tpu_pod.sh", "train"], env=env, capture_output=True,
                           text=True, timeout=60)
  assert missing.returncode == 2 and "train needs launch.train flags" in missing.stderr


@pytest.mark.parametrize("args, needle", [
    (("--num_processes=2",), "--num_processes needs --distributed"),
    (("--distributed", "--num_processes=2", "--process_id=2"), "--process_id must lie in"),
])
def test_distributed_flag_errors(tmp_path, args, needle):
  proc = subprocess.run([sys.executable, "-m", "launch.train",
                         "--config=experiments/configs/k3_tiny.py", f"--workdir={tmp_path}", *args],
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == cli.EXIT_ERROR and needle in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and not os.listdir(tmp_path)
