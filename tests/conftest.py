"""Settings and fixtures shared by the test files.

The tests are bound by XLA:CPU's compile time at their small shapes, so LLVM's optimisation
level is 0 (about 20-30% less time per test on this project's 2-core hosts; every comparison
compiles both sides alike). The subprocesses the tests start inherit it through XLA_FLAGS
(`mesh_testing.cpu_env` adds virtual devices to it).
"""
import os

import pytest

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory) -> str:
  """One JAX compilation cache for the `launch.train` runs of this test process (a pytest-xdist
  worker), so that runs of the same config compile their step once; never the user's
  ~/.cache/k3jax (the launch programs' default)."""
  return str(tmp_path_factory.mktemp("jax_cache"))
