"""XLA tier (the reference): `jnp.dot` with fp32 accumulation."""
import jax
import jax.numpy as jnp


def supports(x, w, *, preferred_element_type=None, interpret: bool = False,
             config=None) -> None:
  """XLA takes every valid call."""
  del x, w, preferred_element_type, interpret, config


def matmul(x: jax.Array, w: jax.Array, *, preferred_element_type=None,
           interpret: bool = False, config=None) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N], fp32 sums, in preferred_element_type or x's dtype."""
  del interpret, config
  out = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return out.astype(preferred_element_type or x.dtype)
