"""Helpers shared by the KDA kernel tests."""
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(x, ref) -> float:
  """Relative L2 error ||x - ref|| / ||ref|| in fp64."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def segments(t: int, b: int = 1) -> jax.Array:
  """[B, T] ids with boundaries inside chunk 0 (token 40) and on the chunk start 64; the rest
  one document (T > 64)."""
  row = np.concatenate([np.full(40, 1), np.full(24, 2), np.full(t - 64, 3)])
  return jnp.asarray(np.tile(row, (b, 1)).astype(np.int32))
