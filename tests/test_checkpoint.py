"""Tests for k3jax.checkpoint."""
import glob
import logging
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from k3jax import checkpoint
from k3jax import data


def _iterator():
  cfg = ml_collections.ConfigDict(dict(source="default", paths=(), default_num_docs=50,
                                       num_workers=0))
  return data.make_train_iterator(cfg, seq_len=32, batch_size=2, vocab_size=300, seed=1)


def _state(scale: float):
  params = {"embed": jnp.full((6, 4), scale, jnp.bfloat16),
            "layers": {"w": jnp.arange(12.0).reshape(3, 4) * scale,
                       "moe_bias": np.linspace(-1, 1, 5).astype(np.float32) * scale}}
  opt = optax.adamw(1e-3)
  return {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(int(scale), jnp.int32)}


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _save_steps(workdir, steps):
  """Saves _state(step) at each step; returns {step: the batch that followed the save}."""
  ckpt = checkpoint.Checkpointer(str(workdir), every_n_steps=1, max_to_keep=5)
  it, after = _iterator(), {}
  for step in steps:
    ckpt.save(step, _state(step), it)
    after[step] = next(it)
  ckpt.close()
  return after


def test_round_trip_with_data_iterator(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=2, max_to_keep=2)
  it, saved = _iterator(), {}
  for step in range(7):
    saved[step] = ckpt.save(step, _state(step), it)
    want = next(it)  # the batch right after the state was saved
    if step == 6:
      want_after_6 = want
  assert saved == {0: True, 1: False, 2: True, 3: False, 4: True, 5: False, 6: True}
  assert ckpt.save(6, _state(6), it, force=True) is False  # step 6 already exists
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "6"]

  fresh = checkpoint.Checkpointer(str(tmp_path), every_n_steps=2, max_to_keep=2)
  it2 = _iterator()
  step, state = fresh.restore_latest(_abstract(_state(0)), it2)
  assert step == 6 and fresh.latest_step() == 6
  _assert_tree_equal(state, _state(6))
  got = next(it2)
  for k in want_after_6:
    np.testing.assert_array_equal(got[k], want_after_6[k])
  assert fresh.save(8, state, it2) is True
  fresh.close()


def test_no_checkpoint_gives_none(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=1)
  it = _iterator()
  assert ckpt.restore_latest(_abstract(_state(0)), it) is None
  assert it.get_state() == _iterator().get_state()
  ckpt.close()


def _truncate_arrays(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "d", "*"))
  assert files
  for f in files:
    os.truncate(f, os.path.getsize(f) // 2)


def _corruptions():
  return {
      "truncated array file": _truncate_arrays,
      "missing array metadata": lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
      "missing iterator state": lambda d: os.remove(
          glob.glob(os.path.join(d, "data", "process_*.json"))[0]),
      "empty step directory": lambda d: [os.remove(f) for f in glob.glob(
          os.path.join(d, "**"), recursive=True) if os.path.isfile(f)],
  }


@pytest.mark.parametrize("kind", list(_corruptions()))
def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog, kind):
  after = _save_steps(tmp_path, [1, 2])
  _corruptions()[kind](str(tmp_path / "checkpoints" / "2"))
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  it = _iterator()
  with caplog.at_level(logging.WARNING):
    step, state = ckpt.restore_latest(_abstract(_state(0)), it)
  assert step == 1
  _assert_tree_equal(state, _state(1))
  got = next(it)
  for k in got:
    np.testing.assert_array_equal(got[k], after[1][k])
  assert any("step 2" in r.getMessage() and "cannot be restored" in r.getMessage()
             for r in caplog.records)
  # The unreadable step is moved aside, so the run can write step 2 again.
  assert glob.glob(str(tmp_path / "checkpoints" / "2.unreadable-*"))
  assert ckpt.save(2, state, it) is True
  ckpt.close()


def test_all_checkpoints_corrupt_raises(tmp_path):
  _save_steps(tmp_path, [1, 2])
  for step in (1, 2):
    _truncate_arrays(str(tmp_path / "checkpoints" / str(step)))
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  with pytest.raises(checkpoint.CheckpointRestoreError,
                     match=r"none of the 2 checkpoints(.|\n)*step 2: (.|\n)*step 1: "):
    ckpt.restore_latest(_abstract(_state(0)), _iterator())
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]  # nothing moved
  ckpt.close()


def test_structure_mismatch_is_not_a_silent_restart(tmp_path):
  _save_steps(tmp_path, [3])
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  wrong = {"params": {"other": jax.ShapeDtypeStruct((2,), jnp.float32)}}
  with pytest.raises(checkpoint.CheckpointMismatchError, match="step 3") as e:
    ckpt.restore_latest(wrong, _iterator())
  assert "params.other: only in this run" in str(e.value)
  assert "params.layers.w: only in the checkpoint" in str(e.value)
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]  # nothing moved


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
  _save_steps(tmp_path, [1, 2])
  state = _abstract(_state(0))
  state["params"]["embed"] = jax.ShapeDtypeStruct((6, 8), jnp.bfloat16)
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  with pytest.raises(checkpoint.CheckpointMismatchError) as e:
    ckpt.restore_latest(state, _iterator())
  assert str(e.value).splitlines()[1:] == ["  params.embed: checkpoint [6, 4], this run [6, 8]"]
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]


def test_empty_buffers_restore(tmp_path):
  """A state whose `buffers` is empty (a model without MoE layers) restores: the shape check
  names the leaves of `params` only."""
  state = {**_state(2), "buffers": {}}
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=1)
  ckpt.save(2, state, _iterator())
  ckpt.close()
  fresh = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=1)
  step, restored = fresh.restore_latest(_abstract(state), _iterator())
  fresh.close()
  assert step == 2
  _assert_tree_equal(restored, state)


def test_truncated_file_reason_names_the_cause_in_a_few_lines(tmp_path, caplog):
  _save_steps(tmp_path, [1, 2])
  _truncate_arrays(str(tmp_path / "checkpoints" / "2"))
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  with caplog.at_level(logging.WARNING):
    ckpt.restore_latest(_abstract(_state(0)), _iterator())
  ckpt.close()
  assert {r.filename for r in caplog.records} == {"checkpoint.py"}  # no library records
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert len(text.splitlines()) <= 3, text
  assert "step 2" in text and "file truncated: " in text and "Traceback" not in text
  assert "falling back to checkpoint step 1" in text


def test_leftover_tmp_directory_is_ignored(tmp_path):
  _save_steps(tmp_path, [1, 2])
  tmp = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "_METADATA").write_text("{trunc")
  ckpt = checkpoint.Checkpointer(str(tmp_path), every_n_steps=1, max_to_keep=5)
  step, state = ckpt.restore_latest(_abstract(_state(0)), _iterator())
  assert step == 2
  _assert_tree_equal(state, _state(2))
  assert ckpt.save(3, state, _iterator()) is True
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3"]


def test_sigterm_sets_the_stop_flag():
  previous = checkpoint.install_sigterm_handler()
  try:
    assert not checkpoint.Checkpointer.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert checkpoint.Checkpointer.should_stop()
    checkpoint.install_sigterm_handler()
    assert not checkpoint.Checkpointer.should_stop()
  finally:
    signal.signal(signal.SIGTERM, previous)


_LATE_CALLBACK = """
import asyncio, sys
import tensorstore as ts
from k3jax import checkpoint
if sys.argv[1] == "installed":
  checkpoint.Checkpointer(sys.argv[2], every_n_steps=1, max_to_keep=1)
promise, future = ts.Promise.new()
async def main():
  asyncio.ensure_future(future)
  await asyncio.sleep(0.01)
loop = asyncio.new_event_loop()
loop.run_until_complete(main())
loop.close()
promise.set_result(0)  # its asyncio callback finds the loop closed, as orbax's late reads do

class Other:
  def __del__(self):
    raise ValueError("another unraisable")
Other()
"""


@pytest.mark.parametrize("hook", ["installed", "absent"])
def test_late_read_on_a_closed_loop_prints_no_traceback(tmp_path, hook):
  proc = subprocess.run([sys.executable, "-c", _LATE_CALLBACK, hook, str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "another unraisable" in proc.stderr  # other unraisables still reach the old hook
  assert ("Event loop is closed" in proc.stderr) == (hook == "absent"), proc.stderr[-2000:]
