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
import contextlib
import logging as py_logging
import os
import signal
import sys
import threading
import time
from typing import Any

from absl import logging
import grain
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

_STOP_REQUESTED = threading.Event()
_REASON_CHARS = 300
_MISMATCHES_SHOWN = 5
# Status codes of tensorstore / orbax errors -> what they mean for a checkpoint file.
_CAUSES = (("OUT_OF_RANGE", "file truncated"), ("DATA_LOSS", "file damaged"),
           ("NOT_FOUND", "file missing"), ("Invalid JSON", "file damaged"),
           ("FileNotFoundError", "file missing"), ("JSONDecodeError", "file damaged"))


def install_sigterm_handler() -> Any:
  """On SIGTERM, only set the flag that `Checkpointer.should_stop()` returns.

  The training loop polls it (`Checkpointer.stop_after`), saves a final checkpoint and exits.
  Clears the flag; returns the previous handler (for signal.signal to put back). Call from
  the main thread. With several processes (jax.distributed) SIGTERM stays with JAX's
  preemption service, which makes every process stop after the same step (`stop_after`);
  nothing is installed and None is returned.
  """
  _STOP_REQUESTED.clear()
  if jax.process_count() > 1:
    return None

  def _handler(signum, frame):
    del frame
    logging.warning("received signal %d: stopping after this step with a checkpoint", signum)
    _STOP_REQUESTED.set()

  return signal.signal(signal.SIGTERM, _handler)


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot serve this run; the message names what and why."""


class CheckpointRestoreError(CheckpointError):
  """Checkpoints exist but none of them can be restored."""


class CheckpointMismatchError(CheckpointError):
  """A readable checkpoint holds parameters of other names or shapes than this run's."""


def failure_reason(error: BaseException) -> str:
  """The innermost cause of a failed restore on one line, e.g. `file truncated: Error
  reading "params.lm_head.kernel/0.0" in OCDBT database at local file ...`."""
  seen, root = [], error
  while root is not None and root not in seen:
    seen.append(root)
    root = root.__cause__ or root.__context__ or None
  root = seen[-1]
  text = " ".join(f"{type(root).__name__}: {root}".split())
  label = next((label for code, label in _CAUSES if code in text), None)
  if label is None:
    label = type(root).__name__
  else:
    text = text.split(": ", 1)[1]
  return f"{label}: {text[:_REASON_CHARS]}"


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """A tensorstore read's completion callback that found its asyncio loop closed."""
  return (unraisable.exc_type is RuntimeError and unraisable.object is None
          and str(unraisable.exc_value) == "Event loop is closed")


def drop_closed_loop_callbacks() -> None:
  """Logs (at debug level) instead of printing the tracebacks of tensorstore reads that
  finish after orbax closed their event loop.

  When one array of a damaged step fails to read, orbax's restore ends and closes its
  asyncio loop while reads of other arrays are still in flight; each that completes later
  reports "Event loop is closed" through `sys.unraisablehook`, at a time of the race's
  choosing (during or after `restore_latest`). Harmless (the failed step is reported and set
  aside), so it is dropped; every other unraisable exception goes to the previous hook.
  Installed once per process, by `Checkpointer`.
  """
  previous = sys.unraisablehook
  if getattr(previous, "_k3jax_drops_closed_loop", False):
    return

  def hook(unraisable):
    if _is_closed_loop_callback(unraisable):
      logging.debug("dropped a tensorstore callback on a closed event loop")
    else:
      previous(unraisable)

  hook._k3jax_drops_closed_loop = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


@contextlib.contextmanager
def quiet_libraries():
  """Holds back orbax / grain / asyncio log records (tracebacks per array) unless absl's
  verbosity is INFO or more (launch programs: --verbose)."""
  if logging.level_info():
    yield
    return
  loggers = [py_logging.getLogger(name) for name in ("absl", "asyncio")]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(py_logging.CRITICAL + 1)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


_CHECKED = ("params", "buffers")


def _named_shapes(state: Any) -> dict[str, tuple[int, ...]]:
  """{orbax name: shape} of the `params` and `buffers` of a train state (a dict).

  Names are the dotted key paths, as orbax writes them; an empty subtree (`buffers` of a model
  without MoE layers) has no leaves and no name (orbax's `get_param_names` gives it one).
  """
  tree = {k: state[k] for k in _CHECKED if isinstance(state, dict) and k in state}
  return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


class Checkpointer:
  """orbax CheckpointManager over WORKDIR/checkpoints with items `state` and `data`."""

  def __init__(self, workdir: str, *, every_n_steps: int, max_to_keep: int,
               async_save: bool = True):
    if every_n_steps <= 0:
      raise ValueError(f"every_n_steps must be positive, got {every_n_steps}")
    if max_to_keep <= 0:
      raise ValueError(f"max_to_keep must be positive, got {max_to_keep}")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    drop_closed_loop_callbacks()
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
    Raises CheckpointMismatchError, before restoring anything, if a readable step holds
    parameters (or buffers) of other names or shapes than `abstract_state`: a changed model
    config, not damage. Raises CheckpointRestoreError if checkpoints exist but none can be
    restored. Library logs of the failed attempts are held back (`quiet_libraries`).
    """
    self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    failures: list[tuple[int, str]] = []
    restored = None
    with quiet_libraries():
      for step in steps:
        self._check_shapes(step, abstract_state)
        try:
          restored = self._manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state),
              data=grain.checkpoint.CheckpointRestore(data_iter)))
          break
        except Exception as e:  # pylint: disable=broad-exception-caught
          # orbax, tensorstore and json report a damaged step with many exception types.
          failures.append((step, failure_reason(e)))
    for bad, reason in failures:
      logging.warning("checkpoint step %d in %s cannot be restored (%s)", bad, self.directory,
                      reason)
    if restored is None:
      details = "\n".join(f"  step {s}: {r}" for s, r in failures)
      raise CheckpointRestoreError(
          f"none of the {len(steps)} checkpoints in {self.directory} can be restored; refusing "
          f"to start from step 0. Fix or move them away (a changed optimizer also causes "
          f"this):\n{details}")
    if failures:
      logging.warning("falling back to checkpoint step %d", step)
      self._set_aside([s for s, _ in failures])
    logging.info("restored checkpoint step %d from %s", step, self.directory)
    return step, restored.state

  def _check_shapes(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError if `step`'s params/buffers differ from the run's.

    A step whose metadata cannot be read, or lists no parameters, is left to the restore
    (damage, not mismatch).
    """
    try:
      meta = self._manager.item_metadata(step)["state"]
      saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(meta)
               if m.name.split(".")[0] in _CHECKED}
    except Exception:  # pylint: disable=broad-exception-caught
      return
    if not saved:
      return
    want = _named_shapes(abstract_state)
    lines = [f"  {n}: checkpoint {list(saved[n])}, this run {list(want[n])}"
             for n in sorted(want) if n in saved and saved[n] != want[n]]
    lines += [f"  {n}: only in this run" for n in sorted(set(want) - set(saved))]
    lines += [f"  {n}: only in the checkpoint" for n in sorted(set(saved) - set(want))]
    if lines:
      more = len(lines) - _MISMATCHES_SHOWN
      shown = lines[:_MISMATCHES_SHOWN] + ([f"  ... and {more} more"] if more > 0 else [])
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory} was trained with another model config; "
          f"{len(lines)} parameters differ:\n" + "\n".join(shown))

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

  @staticmethod
  def stop_after(step: int) -> bool:
    """Whether to save and stop after `step` (call it after every step).

    One process: once SIGTERM arrived. Several: at the step that JAX's preemption service
    agrees on once any process got SIGTERM (`multihost_utils.reached_preemption_sync_point`;
    the processes may be steps apart when it arrives); `should_stop()` is then True too.
    """
    if jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(step):
      logging.warning("preemption: every process stops after step %d with a checkpoint", step)
      _STOP_REQUESTED.set()
    return _STOP_REQUESTED.is_set()

  def wait(self) -> None:
    """Blocks until the last (async) save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()
