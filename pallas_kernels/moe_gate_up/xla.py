"""XLA tier (the reference): the gather, `jax.lax.ragged_dot` on [W1 | W3] in fp32 and SiTU."""
import jax
import jax.numpy as jnp

from k3jax import situ as situ_lib


def supports(x, rows, w1, w3, group_sizes, *, interpret: bool = False, config=None) -> None:
  """XLA takes every valid call."""
  del x, rows, w1, w3, group_sizes, interpret, config


def gate_up(x: jax.Array, rows: jax.Array, w1: jax.Array, w3: jax.Array,
            group_sizes: jax.Array, *, beta1: float, beta2: float,
            return_situ_grads: bool = False, interpret: bool = False, config=None):
  """h [M, F] (and SiTU's partials [M, 2F]) in x's dtype, from fp32 products; see
  `api.gate_up`."""
  del interpret, config
  f = w1.shape[2]
  gu = jax.lax.ragged_dot(x[rows], jnp.concatenate([w1, w3], axis=2),
                          group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
  h = situ_lib.situ(gu[:, :f], gu[:, f:], beta1, beta2).astype(x.dtype)
  if return_situ_grads:
    partials = situ_lib.situ_partials(gu[:, :f], gu[:, f:], beta1, beta2)
    return h, jnp.concatenate(partials, axis=1).astype(x.dtype)
  return h
