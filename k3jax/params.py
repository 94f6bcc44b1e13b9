"""Parameter creation with logical axis names (the MaxText convention)."""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int],
          axes: Sequence[str | None], dtype=jnp.float32) -> nnx.Param:
  """An `nnx.Param` of `shape`, annotated with one logical axis name per dim."""
  if len(axes) != len(shape):
    raise ValueError(f"axes {axes} do not match shape {shape}")
  return nnx.Param(init(rngs.params(), tuple(shape), dtype),
                   sharding_names=tuple(axes))


def fan_in_init(fan_in_axes: Sequence[int]) -> Callable:
  """Normal init with std 1/sqrt(fan_in), fan_in the product of `fan_in_axes`."""
  def init(key, shape, dtype):
    fan_in = 1
    for a in fan_in_axes:
      fan_in *= shape[a]
    return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)
  return init


def ones_init(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


def zeros_init(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)
