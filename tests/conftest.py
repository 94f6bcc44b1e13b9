"""Settings and fixtures shared by the test files.

The tests are bound by XLA:CPU's compile time at their small shapes, so LLVM's optimisation
level is 0 (about 20-30% less time per test on this project's 2-core hosts; every comparison
compiles both sides alike). The subprocesses the tests start inherit it through XLA_FLAGS
(`mesh_testing.cpu_env` adds virtual devices to it).

The whole run (both pytest-xdist workers and every subprocess) shares one JAX persistent
compilation cache in a temporary directory, programs of any compile time included: the
subprocesses build the same small programs (parameter initialisers, the same steps) again
and again. It is made by the first process to load this file, which removes it on exit.
"""
import atexit
import os
import shutil
import tempfile

import pytest

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="k3jax_tests_jax_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(scope="session")
def jax_cache_dir() -> str:
  """The run's shared compilation cache (above) for the `launch.train` runs' --jax_cache_dir,
  never the user's ~/.cache/k3jax (the launch programs' default): runs of the same config in
  either worker compile their step once."""
  return os.environ["JAX_COMPILATION_CACHE_DIR"]
