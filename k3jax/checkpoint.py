"""Checkpoints of the train state and the grain data-iterator position (orbax 0.12.4).

Layout: WORKDIR/checkpoints/<step>/{state, data}. `state` is any pytree of
jax/numpy arrays (params, optimizer state, step, MoE biases; orbax
StandardCheckpointHandler, OCDBT); `data` is the grain iterator state as JSON
(grain.checkpoint.CheckpointHandler, one file per process), taken when `save`
is called.

Crash safety: on a local/POSIX file system orbax writes every step into
`<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only when all items
are written, so a process killed at any moment (kill -9) leaves either a
finished step or a tmp directory; tmp directories are never listed as steps and
are removed when the next Checkpointer opens the directory. That makes async
saving (arrays are copied off the device before `save` returns, files are
written in a background thread) safe; `wait()`/`close()` block until the last
save is committed.
"""
import os
import signal
import threading
import time
from typing import Any

from absl import logging
import grain
import orbax.checkpoint as ocp

_STOP_REQUESTED = threading.Event()
_REASON_CHARS = 400


def install_sigterm_handler() -> Any:
  """On SIGTERM, only set the flag that `Checkpointer.should_stop()` returns.

  The training loop polls it, saves a final checkpoint and exits. Clears the
  flag; returns the previous handler (for signal.signal to put back). Call from
  the main thread.
  """
  _STOP_REQUESTED.clear()

  def _handler(signum, frame):
    del frame
    logging.warning("received signal %d: stopping after this step with a checkpoint", signum)
    _STOP_REQUESTED.set()

  return signal.signal(signal.SIGTERM, _handler)


class CheckpointRestoreError(RuntimeError):
  """Checkpoints exist but none of them can be restored."""


class Checkpointer:
  """orbax CheckpointManager over WORKDIR/checkpoints with items `state` and `data`."""

  def __init__(self, workdir: str, *, every_n_steps: int, max_to_keep: int,
               async_save: bool = True):
    if every_n_steps <= 0:
      raise ValueError(f"every_n_steps must be positive, got {every_n_steps}")
    if max_to_keep <= 0:
      raise ValueError(f"max_to_keep must be positive, got {max_to_keep}")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_names=("state", "data"),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=every_n_steps, max_to_keep=max_to_keep, create=True,
            cleanup_tmp_directories=True, enable_async_checkpointing=async_save))

  def save(self, step: int, state: Any, data_iter: grain.DatasetIterator,
           force: bool = False) -> bool:
    """Saves if `step` is a multiple of every_n_steps (or `force`); True if it saved.

    A step that already has a checkpoint is not saved again (returns False).
    Only the newest `max_to_keep` checkpoints are kept.
    """
    if step in self._manager.all_steps():
      return False
    return self._manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter)))

  def restore_latest(self, abstract_state: Any,
                     data_iter: grain.DatasetIterator) -> tuple[int, Any] | None:
    """Restores the newest readable checkpoint: (step, state), or None if there is none.

    `abstract_state` gives the tree structure, shapes, dtypes (and shardings) to
    restore into: jax.ShapeDtypeStruct leaves or arrays. `data_iter` is moved to
    the saved position. A step that cannot be read (missing or truncated file,
    empty directory) is reported with logging.warning and the one before is
    tried; unreadable steps newer than the restored one are renamed to
    `<step>.unreadable-<unix time>` so the run can write those steps again.
    Raises CheckpointRestoreError if checkpoints exist but none can be restored.
    """
    self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    failures: list[tuple[int, str]] = []
    for step in steps:
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iter)))
      except Exception as e:  # pylint: disable=broad-exception-caught
        # orbax, tensorstore and json report a damaged step with many exception types.
        reason = f"{type(e).__name__}: {e}"[:_REASON_CHARS]
        logging.warning("checkpoint step %d in %s cannot be restored (%s); falling back to "
                        "the checkpoint before it", step, self.directory, reason)
        failures.append((step, reason))
        continue
      if failures:
        self._set_aside([s for s, _ in failures])
      logging.info("restored checkpoint step %d from %s", step, self.directory)
      return step, restored.state
    details = "\n".join(f"  step {s}: {r}" for s, r in failures)
    raise CheckpointRestoreError(
        f"none of the {len(steps)} checkpoints in {self.directory} can be restored; refusing "
        f"to start from step 0. Fix or move them away (a changed model/optimizer structure "
        f"also causes this):\n{details}")

  def _set_aside(self, steps: list[int]) -> None:
    """Renames unreadable step directories out of orbax's view (primary process only)."""
    if ocp.multihost.process_index() == 0:
      stamp = int(time.time())
      for step in steps:
        path = os.path.join(self.directory, str(step))
        if os.path.isdir(path):
          os.rename(path, f"{path}.unreadable-{stamp}")
          logging.warning("moved unreadable checkpoint %s to %s.unreadable-%d", path, path, stamp)
    ocp.multihost.sync_global_processes("k3jax_checkpoint_set_aside")
    self._manager.reload()

  def latest_step(self) -> int | None:
    """Newest step with a finished checkpoint directory (not checked for readability)."""
    return self._manager.latest_step()

  @staticmethod
  def should_stop() -> bool:
    """True once SIGTERM arrived (after `install_sigterm_handler`)."""
    return _STOP_REQUESTED.is_set()

  def wait(self) -> None:
    """Blocks until the last (async) save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()
