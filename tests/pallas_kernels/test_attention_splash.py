"""The splash attention tier (TPU) in its interpreter on CPU against the reference: forward,
dq / dk / dv and the max logit with packed documents (padding id 0), q/k head dim 160 and v 16
(padded to 256 and 128 lanes), a length that is no multiple of splash's 128-row blocks."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import attention
from pallas_kernels.attention import plan
from pallas_kernels.attention import reference


def test_splash_interpret_matches_reference():
  b, t, h, dk, dv = 1, 150, 2, 160, 16
  ks = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(key, (b, t, h, dk)) for key in ks[:2])
  v = jax.random.normal(ks[2], (b, t, h, dv))
  w = jax.random.normal(ks[3], (b, t, h, dv))
  ids = jnp.array([[1] * 50 + [2] * 90 + [0] * 10], jnp.int32)
  assert plan(q, k, v, segment_ids=ids, impl="splash", interpret=True).impl == "splash"

  def run(fn):
    loss = lambda q, k, v: (jnp.sum(fn(q, k, v)[0] * w), fn(q, k, v))
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, (o, mx)), grads = run(lambda q, k, v: attention(
      q, k, v, segment_ids=ids, scale=0.1, return_max_logit=True, impl="splash", interpret=True))
  (_, (want_o, want_mx)), want_grads = run(
      lambda q, k, v: reference.attention(q, k, v, ids, ids, causal=True, scale=0.1))
  np.testing.assert_allclose(np.asarray(mx), np.asarray(want_mx), rtol=1e-6)
  for got, want in zip((o, *grads), (want_o, *want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  assert float(jnp.abs(o[0, 140:]).max()) == 0.0
