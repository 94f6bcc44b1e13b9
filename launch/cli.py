"""What the entry points share: config overrides checked before absl parses them, short errors.

A handled failure (a config field, a data file, a checkpoint, a missing file) prints
`error: ...` and a hint on stderr and exits with EXIT_ERROR; `--verbose` shows the traceback
and the libraries' logs instead. `launch.train` exits with EXIT_PREEMPTED after SIGTERM, once
its checkpoint is saved, so that a scheduler can tell "requeue me" from "done" (0).
"""
import logging as py_logging
import os
import sys
from collections.abc import Callable, Sequence

from absl import app, flags, logging

from k3jax import checkpoint, data, train
from k3jax import config as config_lib

EXIT_ERROR = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped early, run the same command to resume


class FlagError(ValueError):
  """A flag value that cannot serve; the message starts with the flag's name."""


HANDLED = (config_lib.ConfigError, data.DataError, checkpoint.CheckpointError, FileNotFoundError,
           FlagError)

_VERBOSE = flags.DEFINE_bool("verbose", False, "Show tracebacks and library logs (INFO) instead "
                             "of short error messages.")
_JAX_CACHE_DIR = flags.DEFINE_string(
    "jax_cache_dir", "~/.cache/k3jax/jax", "JAX's persistent compilation cache (with XLA's "
    "per-fusion autotune results on GPU): a program compiled once is loaded by the next run "
    "instead of compiled again. Empty: off. A given directory that cannot be created is an "
    "error; the default one only a warning.")


def _enable_compilation_cache(path: str) -> None:
  """--jax_cache_dir: a directory given that cannot be created is an error; the default one
  (under HOME) only a warning, and the run compiles without the cache."""
  try:
    train.enable_compilation_cache(path)
  except OSError as e:
    where = f"{os.path.expanduser(path)} ({e.strerror})"
    if flags.FLAGS["jax_cache_dir"].present:
      raise FlagError(f"--jax_cache_dir: cannot create {where}") from None
    logging.warning("no compilation cache: cannot create %s; --jax_cache_dir sets another", where)


def handled_error(error: BaseException) -> BaseException | None:
  """The first HANDLED exception in `error`'s chain (grain and orbax wrap causes), or None."""
  seen = []
  while error is not None and error not in seen:
    if isinstance(error, HANDLED):
      return error
    seen.append(error)
    error = error.__cause__ or error.__context__
  return None


def check_overrides(argv: Sequence[str], flag: str = "config") -> None:
  """Raises ConfigError for a `--config.a.b=...` that names no field of the schema.

  ml_collections would otherwise end in a bare AttributeError while parsing flags.
  """
  for arg in argv[1:]:
    if arg == "--":
      break
    if arg.startswith(f"--{flag}."):
      config_lib.check_field(arg[len(flag) + 3:].split("=", 1)[0])


def _fail(error: BaseException, hint: str = "\n(--verbose shows the traceback)") -> None:
  message = str(error) if not isinstance(error, FileNotFoundError) or not error.filename else (
      f"{error.strerror}: {error.filename}")
  print(f"error: {message}{hint}", file=sys.stderr)
  sys.exit(EXIT_ERROR)


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` with the override check, logging defaults and short errors."""
  try:
    check_overrides(sys.argv)
  except config_lib.ConfigError as e:
    _fail(e, hint="")

  def wrapped(argv):
    if _VERBOSE.value:
      logging.set_verbosity(logging.INFO)
    else:
      if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
      py_logging.getLogger("asyncio").setLevel(py_logging.CRITICAL)
    try:
      _enable_compilation_cache(_JAX_CACHE_DIR.value)
      main(argv)
    except Exception as e:  # pylint: disable=broad-exception-caught
      error = handled_error(e)
      if error is None or _VERBOSE.value:
        raise
      _fail(error)

  app.run(wrapped)
