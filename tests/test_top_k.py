"""k3jax.top_k against jax.lax.top_k: the same values, indices, tie order and gradient."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax import top_k as top_k_lib


@pytest.mark.parametrize("width, k", [(64, 8), (64, 9), (6, 1), (5, 5), (200, 16)])
def test_matches_lax_top_k(width, k):
  rng = np.random.default_rng(width + k)
  x = rng.normal(size=(40, width)).astype(np.float32)
  # Ties (a repeated value) and -inf must keep lax.top_k's order: the lower index first.
  x[3, :4] = 0.5
  x[7, 1] = x[7, 2] = x[7].max()
  x[9, 0] = -np.inf
  x = jnp.asarray(x)
  values, indices = top_k_lib.top_k(x, k)
  want_values, want_indices = jax.lax.top_k(x, k)
  assert indices.dtype == jnp.int32 and values.dtype == x.dtype
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(values, want_values)


def test_ranks_count_ties_in_index_order():
  x = jnp.asarray([[1.0, 3.0, 3.0, -2.0, 3.0]])
  np.testing.assert_array_equal(top_k_lib.ranks(x), [[3, 0, 1, 4, 2]])


def test_gradient_reaches_the_selected_entries():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)
  cot = jnp.asarray(np.random.default_rng(1).normal(size=(8, 3)), jnp.float32)
  grad = jax.grad(lambda a: jnp.sum(top_k_lib.top_k(a, 3)[0] * cot))(x)
  want = jax.grad(lambda a: jnp.sum(jax.lax.top_k(a, 3)[0] * cot))(x)
  np.testing.assert_array_equal(grad, want)


def test_bad_arguments():
  with pytest.raises(ValueError, match="1 <= k <= E"):
    top_k_lib.top_k(jnp.zeros((4, 6)), 7)
  with pytest.raises(ValueError, match=r"\[N, E\]"):
    top_k_lib.top_k(jnp.zeros((6,)), 2)
