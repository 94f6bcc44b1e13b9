"""cudnn and mosaic_gpu attention tiers against the reference on a GPU (skipped elsewhere).

Forward, dq / dk / dv and the per-head max logit, bf16 (cudnn) and f16 (mosaic_gpu), at K3's
head dims (q/k 192, v 128): causal, non-causal, a length that is no multiple of 64. The plan
must pick the tier, so a silent fall-through fails the test. Packed documents (padding id 0)
go to cuDNN's packed layout, or by a runtime branch to xla_blockwise where the layout cannot
express them (more than `PACKED_MAX_SEGMENTS` runs, ids not increasing); both branches are
checked, and padding tokens must get zero outputs and gradients. The kernel tiers' max logit comes from the Pallas Triton kernel
(`max_logit_triton`) where T is a multiple of its 128-row block, else from xla_blockwise; the
kernel is also checked alone at 2048 tokens.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention
from pallas_kernels.attention import plan
from pallas_kernels.attention import reference

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
SCALE = 192 ** -0.5


def packed_ids(b, t, docs):
  """`docs` documents per row (lengths 1 .. ), ids increasing, 5 padding tokens at the end."""
  cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, t - 5), docs - 1, replace=False))
  row = np.zeros(t, np.int32)
  for n, (a, e) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, t - 5])):
    row[a:e] = n + 1
  return jnp.asarray(np.stack([row] * b))


def check(impl, b, t, h, dk, dv, dtype, ids, causal):
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (b, t, h, dk), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, t, h, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, h, dv), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (b, t, h, dv), jnp.float32)
  assert plan(q, k, v, segment_ids=ids, causal=causal, impl=impl).impl == impl

  def run(fn):
    def loss(q, k, v):
      o, mx = fn(q, k, v)
      return jnp.sum(o.astype(jnp.float32) * w), (o, mx)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, (o, mx)), grads = run(lambda q, k, v: attention(
      q, k, v, segment_ids=ids, causal=causal, scale=SCALE, return_max_logit=True, impl=impl))
  up = lambda x: x.astype(jnp.float32)
  (_, (want_o, want_mx)), want_grads = run(lambda q, k, v: reference.attention(
      up(q), up(k), up(v), ids, ids, causal=causal, scale=SCALE))
  assert o.dtype == dtype
  np.testing.assert_allclose(np.asarray(mx), np.asarray(want_mx), rtol=1e-5)
  for label, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (want_o, *want_grads)):
    err = float(jnp.abs(up(got) - up(want)).max())
    assert err <= 2e-2 * max(float(jnp.abs(up(want)).max()), 1.0), (label, err)
  if ids is not None:
    pad = ids == 0
    for label, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
      assert float(jnp.abs(up(x)[pad]).max()) == 0.0, label


@pytest.mark.parametrize("b,t,h,causal", [
    (2, 256, 2, True),
    (1, 200, 2, True),
    (1, 256, 2, False),
])
def test_cudnn(b, t, h, causal):
  check("cudnn", b, t, h, 192, 128, jnp.bfloat16, None, causal)


@pytest.mark.parametrize("b,t,docs,causal", [(2, 256, 5, True), (1, 200, 3, True),
                                             (1, 256, 4, False)])
def test_cudnn_packed(b, t, docs, causal):
  check("cudnn", b, t, 2, 192, 128, jnp.bfloat16, packed_ids(b, t, docs), causal)


@pytest.mark.parametrize("order", ["too_many", "decreasing"])
def test_cudnn_packed_falls_back_to_xla_blockwise(order):
  """Rows the packed layout cannot express take xla_blockwise's branch at run time."""
  from pallas_kernels.attention import cudnn
  ids = packed_ids(2, 256, cudnn.PACKED_MAX_SEGMENTS + 4 if order == "too_many" else 4)
  if order == "decreasing":
    ids = jnp.where(ids != 0, 10 - ids, 0)
  assert not bool(cudnn.segments_of(ids)[0])
  check("cudnn", 2, 256, 2, 192, 128, jnp.bfloat16, ids, True)


def test_packed_and_unpacked_calls_take_cudnn_by_default():
  ids = packed_ids(2, 512, 5)
  q = jax.ShapeDtypeStruct((2, 512, 4, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 512, 4, 128), jnp.bfloat16)
  assert plan(q, q, v, segment_ids=ids).impl == "cudnn"
  assert plan(q, q, v).impl == "cudnn"


def test_mosaic_gpu():
  check("mosaic_gpu", 1, 256, 2, 192, 128, jnp.float16, None, False)


@pytest.mark.parametrize("causal", [True, False])
def test_max_logit_triton_matches_reference(causal):
  """The Pallas Triton max-logit kernel (the kernel tiers' QK-Clip statistic) against the
  reference at K3's q/k head dim, packed documents with padding, 2048 tokens."""
  from pallas_kernels.attention import max_logit_triton
  b, t, h, d = 2, 2048, 4, 192
  ks = jax.random.split(jax.random.key(3), 2)
  q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  ids = packed_ids(b, t, 5)
  assert max_logit_triton.supports(q, k, causal=causal) is None
  got = max_logit_triton.max_logit(q, k, ids, ids, causal=causal, scale=SCALE)
  up = lambda x: x.astype(jnp.float32)
  want = jax.jit(lambda q, k: reference.attention(up(q), up(k), up(k[..., :8]), ids, ids,
                                                  causal=causal, scale=SCALE)[1])(q, k)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
