"""Fixtures shared by the test files."""
import pytest


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory) -> str:
  """One JAX compilation cache for the `launch.train` runs of this test process (a pytest-xdist
  worker), so that runs of the same config compile their step once; never the user's
  ~/.cache/k3jax (the launch programs' default)."""
  return str(tmp_path_factory.mktemp("jax_cache"))
