"""XLA tier (the reference): `jax.lax.top_k`, a stable sort of each row on the GPU.

Same entry points as the kernel tier (`top_k`, `supports`), so the API can fall back to it.
"""
import jax
import jax.numpy as jnp


def supports(x, k: int, *, interpret: bool = False) -> None:
  """XLA takes every valid call."""
  del x, k, interpret


def top_k(x: jax.Array, k: int, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """x [N, E] -> (values [N, k] x.dtype, indices [N, k] int32); differentiated by JAX."""
  del interpret
  values, indices = jax.lax.top_k(x, k)
  return values, indices.astype(jnp.int32)
