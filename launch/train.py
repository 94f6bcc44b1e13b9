r"""Train a K3 model: `python -m launch.train --config=experiments/configs/k3_tiny.py --workdir=DIR`.

Re-running the same command resumes from the newest valid checkpoint in DIR. Overrides:
`--config.train.steps=100`, `--config.model.moe.balancing=sign`, ... `--profile_steps=5,8`
writes an XLA profiler trace of steps [5, 8) into DIR/profile.

Multi-host: `--distributed` calls `jax.distributed.initialize` first, one process per host
(or per GPU); SLURM and Cloud TPU set its arguments themselves, elsewhere pass
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the environment variable
JAX_COORDINATOR_ADDRESS for the first). Each process reads its own rows of the global batch;
every process writes the same checkpoint directory (a shared file system), process 0 the logs.

Exit status: 0 when train.steps are done; 75 (EX_TEMPFAIL) after SIGTERM, once the checkpoint
is saved (preempted: run the same command again); 2 on a config, data or checkpoint error,
with a short message (`--verbose`: the traceback).
"""
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from k3jax import checkpoint
from k3jax import config as config_lib
from k3jax import loop
from launch import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard events and traces.")
_PROFILE = flags.DEFINE_string("profile_steps", "", "START,STOP: trace steps [START, STOP).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Call jax.distributed.initialize() first (multi-host).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "With --distributed: HOST:PORT "
                                   "of process 0 (default: from SLURM / Cloud TPU).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --distributed: how many "
                                      "processes (default: from SLURM / Cloud TPU).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --distributed: this process's "
                                   "index (default: from SLURM / Cloud TPU).")
flags.mark_flags_as_required(["config", "workdir"])


def _profile_window(text: str) -> tuple[int, int] | None:
  if not text:
    return None
  try:
    start, stop = (int(x) for x in text.split(","))
  except ValueError as e:
    raise app.UsageError(f"--profile_steps must be START,STOP (two integers), got {text!r}") from e
  if not 0 <= start < stop:
    raise app.UsageError(f"--profile_steps needs 0 <= START < STOP, got {text!r}")
  return start, stop


def _initialize_distributed() -> None:
  """`jax.distributed.initialize` with the flags given; the flags alone are a usage error."""
  given = [f.name for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID) if f.value is not None]
  if not _DISTRIBUTED.value:
    if given:
      raise cli.FlagError(f"--{given[0]} needs --distributed")
    return
  n, i = _NUM_PROCESSES.value, _PROCESS_ID.value
  if n is not None and n < 1:
    raise cli.FlagError(f"--num_processes must be >= 1, got {n}")
  if i is not None and (i < 0 or (n is not None and i >= n)):
    raise cli.FlagError(f"--process_id must lie in [0, --num_processes), got {i} of {n}")
  jax.distributed.initialize(coordinator_address=_COORDINATOR.value, num_processes=n,
                             process_id=i)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = config_lib.validate(_CONFIG.value)
  window = _profile_window(_PROFILE.value)
  _initialize_distributed()
  loop.run(cfg, _WORKDIR.value, profile_window=window)
  if checkpoint.Checkpointer.should_stop():
    sys.exit(cli.EXIT_PREEMPTED)


if __name__ == "__main__":
  cli.run(main)
