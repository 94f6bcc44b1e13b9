"""What a user meets on the command line: short errors, nothing lost, documented exit codes.

Each case runs the entry point in a subprocess with bad input and asserts the message and
what is left on disk.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax import config, data, loop
from launch import cli
from tools import make_token_file

SMALL = {"model.num_layers": 4, "model.full_attn_layers": (2, 4), "model.attn_res_block_size": 2,
         "train.seq_len": 64, "train.global_batch_size": 4, "train.log_every": 1,
         "train.checkpoint_every": 2, "train.steps": 6, "data.default_num_docs": 400}


_CACHE = {"dir": ""}


@pytest.fixture(scope="module", autouse=True)
def _shared_cache(jax_cache_dir):
  """The runs of this file share a compilation cache (each compiles the same small step)."""
  _CACHE["dir"] = jax_cache_dir


def _train_cmd(workdir, overrides=None, *extra):
  """The run's command; a --jax_cache_dir in `extra` replaces the shared cache."""
  args = {**SMALL, **(overrides or {})}
  cache = [] if any(a.startswith("--jax_cache_dir") for a in extra) else [
      f"--jax_cache_dir={_CACHE['dir']}"]
  return ([sys.executable, "-m", "launch.train", "--config=experiments/configs/k3_tiny.py",
           f"--workdir={workdir}"] + cache
          + [f"--config.{k}={v}" for k, v in args.items()] + list(extra))


def _run(cmd, timeout=600):
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _files(workdir):
  return sorted(os.path.relpath(os.path.join(d, f), workdir)
                for d, _, fs in os.walk(workdir) for f in fs)


def _short_error(proc, *needles):
  """rc 2, a few stderr lines naming every needle, no traceback."""
  assert proc.returncode == cli.EXIT_ERROR, proc.stdout[-2000:] + proc.stderr[-3000:]
  err = proc.stderr
  assert "Traceback" not in err, err[-3000:]
  assert len(err.strip().splitlines()) <= 12, err[-3000:]
  for needle in needles:
    assert needle in err, (needle, err)
  return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run stopped by SIGTERM after step 2's checkpoint, then resumed to step 6."""
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  proc = subprocess.Popen(_train_cmd(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.time() + 500
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(os.path.join(workdir, "checkpoints", "2")):
      break
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  resumed = _run(_train_cmd(workdir))
  return workdir, (proc.returncode, out, err), resumed


def test_sigterm_exits_75_with_a_checkpoint_then_resumes_to_the_end(trained):
  workdir, (rc, out, err), resumed = trained
  assert rc == cli.EXIT_PREEMPTED == 75, out[-2000:] + err[-3000:]
  assert "SIGTERM: saved step" in out + err
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout + resumed.stderr
  for line in ("checkpoints: ", "metrics: ", "TensorBoard: tensorboard --logdir "):
    assert line in resumed.stdout, resumed.stdout[-2000:]
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == list(range(1, 7))


@pytest.mark.parametrize("flag,needles", [
    ("--config.model.nonexistent=1", ["`model.nonexistent`: unknown field", "'hidden_size'"]),
    ("--config.model.hiden_size=3", ["did you mean `model.hidden_size`?"]),
    ("--config.model.kda.gate=relu", ["`model.kda.gate`: got 'relu'", "'softplus'"]),
    ("--config.data.paths=a.bin", ["`data.paths`", "data.source='default'"]),
])
def test_config_errors_are_short_and_write_nothing(tmp_path, flag, needles):
  workdir = tmp_path / "w"
  _short_error(_run(_train_cmd(workdir, {}, flag), timeout=120), *needles)
  assert not workdir.exists()


def test_compilation_cache_serves_the_next_run(tmp_path):
  """A second run of the same config loads the train step from --jax_cache_dir (JAX logs the hit
  with JAX_LOG_COMPILES); an uncreatable cache directory is a short error naming the flag."""
  cache = tmp_path / "cache"
  # Two layers: the cache's mechanics, not the model, are under test (it compiles cold here).
  short = {"train.steps": 2, "train.checkpoint_every": 2, "model.num_layers": 2,
           "model.full_attn_layers": (2,), "model.attn_res_block_size": 1}
  first = _run(_train_cmd(tmp_path / "a", short, f"--jax_cache_dir={cache}"))
  assert first.returncode == 0, first.stderr[-3000:]
  stored = sorted(os.listdir(cache))
  assert stored
  env = dict(os.environ, JAX_LOG_COMPILES="1")
  second = subprocess.run(_train_cmd(tmp_path / "b", short, f"--jax_cache_dir={cache}"),
                          capture_output=True, text=True, timeout=600, env=env)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Persistent compilation cache hit for 'jit_step'" in second.stderr, (
      second.stderr[-3000:])
  blocked = tmp_path / "file"
  blocked.write_text("")
  _short_error(_run(_train_cmd(tmp_path / "c", short, f"--jax_cache_dir={blocked}/jax"),
                    timeout=120), "--jax_cache_dir: cannot create")
  # The default directory under a HOME that cannot hold it: a warning, then the run goes on (to
  # the config error here, which stops it before the model is built).
  cmd = [a for a in _train_cmd(tmp_path / "d", {"model.kda.gate": "relu"})
         if not a.startswith("--jax_cache_dir")]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, HOME=str(blocked)))
  err = _short_error(proc, "`model.kda.gate`")
  assert "no compilation cache: cannot create" in err


def test_verbose_shows_the_traceback(tmp_path):
  proc = _run(_train_cmd(tmp_path / "w", {"model.kda.gate": "relu"}, "--verbose"), timeout=120)
  assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_another_model_config_is_refused_before_writing(trained, tmp_path):
  workdir = str(tmp_path / "copy")
  shutil.copytree(trained[0], workdir)
  before = {f: open(os.path.join(workdir, f), "rb").read() for f in _files(workdir)}
  err = _short_error(_run(_train_cmd(workdir, {"model.hidden_size": 96})),
                     "trained with another model config", "checkpoint [64", "this run [96",
                     "model.hidden_size: 64 -> 96")
  assert "config.json" in err
  assert {f: open(os.path.join(workdir, f), "rb").read() for f in _files(workdir)} == before


def test_truncated_newest_checkpoint_falls_back_in_a_few_lines(trained, tmp_path):
  workdir = str(tmp_path / "copy")
  shutil.copytree(trained[0], workdir)
  saved = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
  newest, fallback = saved[-1], saved[-2]
  arrays = glob.glob(os.path.join(workdir, "checkpoints", str(newest), "state", "**", "d", "*"),
                     recursive=True)
  assert arrays
  for f in arrays:
    os.truncate(f, os.path.getsize(f) // 2)
  proc = _run(_train_cmd(workdir, {"train.steps": 4}))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  warnings = [line for line in proc.stderr.splitlines() if "checkpoint" in line]
  assert len(warnings) <= 4, proc.stderr[-3000:]
  assert any(f"step {newest}" in w and "file truncated" in w for w in warnings), warnings
  assert f"falling back to checkpoint step {fallback}" in proc.stderr
  # Asked for fewer steps than the checkpoint holds: said so; the replayed rows are dropped.
  assert (f"the checkpoint holds step {fallback} >= train.steps=4: nothing to train"
          in proc.stdout)
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == list(range(1, fallback + 1))
  assert glob.glob(os.path.join(workdir, "checkpoints", f"{newest}.unreadable-*"))


def _token_file(tmp_path, docs, max_id=True):
  path = make_token_file.write_memmap([np.asarray(d) for d in docs], str(tmp_path / "corpus"))
  if not max_id:
    meta = json.load(open(str(tmp_path / "corpus.json")))
    del meta["max_token_id"]
    json.dump(meta, open(str(tmp_path / "corpus.json"), "w"))
  return path


def test_out_of_vocab_file_is_refused_before_the_model_is_built(tmp_path):
  docs = [np.arange(1, 50) % 250 for _ in range(20)] + [np.array([256, 300, 257])]
  path = _token_file(tmp_path, docs)
  assert json.load(open(str(tmp_path / "corpus.json")))["max_token_id"] == 300
  workdir = tmp_path / "w"
  _short_error(_run(_train_cmd(workdir, {"data.source": "memmap", "data.paths": path}),
                    timeout=120),
               "corpus.bin", "largest token id is 300", "vocab_size=258")
  assert not workdir.exists()


def test_bad_data_mid_run_stops_without_a_partial_checkpoint(tmp_path):
  """A file without max_token_id is checked batch by batch; the stop leaves whole steps only."""
  docs = [np.arange(1, 48) % 250 for _ in range(40)] + [np.array([256, 300, 257])]
  path = _token_file(tmp_path, docs, max_id=False)
  overrides = {**SMALL, "train.checkpoint_every": 1, "train.steps": 40, "data.source": "memmap",
               "data.paths": (path,)}
  for seed in range(20):  # a seed whose bad batch comes after a few saved steps
    cfg = config.load("experiments/configs/k3_tiny.py", {**overrides, "train.seed": seed})
    it = data.make_train_iterator(cfg.data, seq_len=64, batch_size=4, vocab_size=258, seed=seed)
    good = 0
    with pytest.raises(data.DataError):
      while True:
        next(it)
        good += 1
    if 2 <= good <= 6:
      break
  workdir = str(tmp_path / "w")
  with pytest.raises(data.DataError, match=r"corpus\.bin.*token id 300 at document 40"):
    loop.run(cfg, workdir)
  names = sorted(os.listdir(os.path.join(workdir, "checkpoints")), key=int)
  assert names == [str(s) for s in range(max(1, good - 2), good + 1)], (good, names)
  for step in names:
    assert os.path.exists(os.path.join(workdir, "checkpoints", step, "_CHECKPOINT_METADATA"))


def test_make_token_file_names_empty_inputs_and_leaves_nothing(tmp_path):
  empty, good = tmp_path / "empty.txt", tmp_path / "good.txt"
  empty.write_text("")
  good.write_text("hello world")
  cmd = [sys.executable, "-m", "tools.make_token_file", f"--output={tmp_path / 'out'}"]
  proc = _run(cmd + [f"--input={empty}"], timeout=120)
  _short_error(proc, "no documents to write", str(empty))
  assert sorted(os.listdir(tmp_path)) == ["empty.txt", "good.txt"]
  proc = _run(cmd + [f"--input={empty},{good}"], timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert f"skipped '{empty}'" in proc.stderr and "empty file" in proc.stderr
  meta = json.load(open(tmp_path / "out.json"))
  assert meta == {"dtype": "uint16", "num_tokens": 13, "max_token_id": data.EOS}
