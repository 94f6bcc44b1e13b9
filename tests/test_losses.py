"""Blockwise LM head + cross-entropy (k3jax.losses) against the dense form: logits h @ w in fp32
and optax's integer-label softmax cross-entropy, the mean over mask > 0 (the oracle)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax import losses

B, T, D, V = 2, 37, 16, 100  # N = 74 tokens: divisible by none of the blocks below


def dense(h, w, targets, mask):
  """The dense form (model.logits + optax CE): materialises [B, T, V] fp32 logits."""
  logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(ce * mask) / n, n


def inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, T, D)), dtype)
  w = jnp.asarray(rng.normal(size=(D, V)) / 2, dtype)
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  mask = rng.integers(0, 2, (B, T)).astype(np.float32)
  mask[1, 20:] = 0.0  # padding tail
  return h, w, targets, jnp.asarray(mask)


def loss_and_grads(fn, *args):
  (loss, n), grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(*args)
  return loss, n, grads


def rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def oracle_f32():
  args = inputs(jnp.float32)
  return args, loss_and_grads(dense, *args)


@pytest.mark.parametrize("bt,bv", [(16, 32), (5, 7), (37, 50), (1000, 1000)])
def test_fp32_equals_dense(oracle_f32, bt, bv):
  """Blocks not dividing N or V (and larger than both) give the dense loss and gradients."""
  args, (loss_d, n_d, (dh_d, dw_d)) = oracle_f32
  fn = lambda h, w, t, m: losses.lm_head_cross_entropy(h, w, t, m, block_tokens=bt,
                                                       block_vocab=bv)
  loss, n, (dh, dw) = loss_and_grads(fn, *args)
  assert float(n) == float(n_d) == float(jnp.sum(args[3]))
  np.testing.assert_allclose(float(loss), float(loss_d), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dh), np.asarray(dh_d), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_d), rtol=1e-5, atol=1e-7)
  masked = np.asarray(args[3]) == 0
  assert np.all(np.asarray(dh)[masked] == 0) and np.any(np.asarray(dh)[~masked] != 0)


def test_bf16_within_stated_tolerance():
  """bf16 h and w (fp32 accumulation), dlogits cast to bf16 for the backward matmuls: loss to
  1e-5 relative, gradients to 1e-2 relative L2 of the dense bf16 form's."""
  args = inputs(jnp.bfloat16, seed=1)
  loss_d, n_d, (dh_d, dw_d) = loss_and_grads(dense, *args)
  fn = lambda h, w, t, m: losses.lm_head_cross_entropy(h, w, t, m, block_tokens=16,
                                                       block_vocab=32)
  loss, n, (dh, dw) = loss_and_grads(fn, *args)
  assert dh.dtype == dw.dtype == jnp.bfloat16 and float(n) == float(n_d)
  np.testing.assert_allclose(float(loss), float(loss_d), rtol=1e-5)
  assert rel_l2(dh, dh_d) < 1e-2 and rel_l2(dw, dw_d) < 1e-2


def test_mixed_dtypes_multiply_in_the_promoted_dtype_and_return_each_dtype():
  h, w, targets, mask = inputs(jnp.float32, seed=2)
  fn = lambda h, w: losses.lm_head_cross_entropy(h, w, targets, mask, block_vocab=32)[0]
  dh, dw = jax.grad(fn, argnums=(0, 1))(h.astype(jnp.bfloat16), w)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


def test_no_tokens_by_vocabulary_array_is_live():
  """Neither the forward nor the backward holds an [N, V] (or [B, T, V]) array."""
  args = inputs(jnp.float32)
  fn = lambda h, w: losses.lm_head_cross_entropy(h, w, *args[2:], block_tokens=16,
                                                 block_vocab=32)[0]
  text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args[:2]).as_text()
  assert f"{B * T}x{V}x" not in text and f"{B}x{T}x{V}x" not in text
  assert "16x32xf32" in text  # one block of logits
  dense_text = jax.jit(jax.grad(lambda h, w: dense(h, w, *args[2:])[0], argnums=(0, 1))).lower(
      *args[:2]).as_text()
  assert f"{B}x{T}x{V}xf32" in dense_text  # the check can fail


def test_all_masked_gives_zero_loss_and_gradients():
  h, w, targets, mask = inputs(jnp.float32)
  fn = lambda h, w: losses.lm_head_cross_entropy(h, w, targets, jnp.zeros_like(mask))
  (loss, n), (dh, dw) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(h, w)
  assert float(loss) == 0.0 and float(n) == 1.0
  assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_bad_inputs_raise_clear_errors():
  h, w, targets, mask = inputs(jnp.float32)
  with pytest.raises(ValueError, match="w must be"):
    losses.lm_head_cross_entropy(h, w.T, targets, mask)
  with pytest.raises(ValueError, match="targets and mask"):
    losses.lm_head_cross_entropy(h, w, targets[:, :-1], mask)
  with pytest.raises(ValueError, match="targets must be integer"):
    losses.lm_head_cross_entropy(h, w, targets.astype(jnp.float32), mask)
  with pytest.raises(ValueError, match="block_vocab must be a positive int"):
    losses.lm_head_cross_entropy(h, w, targets, mask, block_vocab=0)
  with pytest.raises(ValueError, match="h must be"):
    losses.lm_head_cross_entropy(h[0, 0], w, targets[0, 0], mask[0, 0])


def test_mtp_head_loss_equals_its_dense_form():
  """k3jax.mtp's blockwise MTP loss (training's) against the dense form."""
  from k3jax import mtp
  h, w, targets, mask = inputs(jnp.float32, seed=3)
  loss, n = mtp.mtp_head_loss(h, w, targets, mask)
  loss_d, n_d = dense(h, w, targets, mask)
  assert float(n) == float(n_d)
  np.testing.assert_allclose(float(loss), float(loss_d), rtol=1e-6)


def test_one_pass_logsumexp_matches_float64():
  """The one-read logsumexp of the loss's logits blocks, on rows with -inf columns, a row of
  only -inf, one dominant logit and a wide spread, against float64 numpy."""
  x = np.random.default_rng(5).normal(size=(6, 777)) * 30
  x[0, :400] = -np.inf
  x[1] = -np.inf
  x[2, 3] = 1e4
  x[3] *= 1e-6
  got = np.asarray(jax.jit(losses._logsumexp)(jnp.asarray(x, jnp.float32)))
  m = np.max(x, axis=1, keepdims=True)
  with np.errstate(invalid="ignore"):
    want = (m + np.log(np.sum(np.exp(x - m), axis=1, keepdims=True)))[:, 0]
  assert got[1] == -np.inf
  np.testing.assert_allclose(np.delete(got, 1), np.delete(want, 1), rtol=1e-6)
