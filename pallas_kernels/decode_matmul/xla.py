"""XLA tier (the reference): `jnp.dot` with fp32 accumulation."""
import jax
import jax.numpy as jnp


def supports(x, w, *, preferred_element_type=None, interpret: bool = False,
             config=None) -> None:
  """XLA takes every valid call."""
  del x, w, preferred_element_type, interpret, config


def matmul(x: jax.Array, w: jax.Array, *, preferred_element_type=None,
           interpret: bool = False, config=None) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N] in preferred_element_type or x's dtype (one dot of that
  result type: XLA sums bf16 products in fp32 and rounds once)."""
  del interpret, config
  return jnp.dot(x, w, preferred_element_type=preferred_element_type or x.dtype)
