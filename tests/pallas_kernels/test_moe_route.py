"""The router's selection and the copies' sort in one call: every tier against numpy.

Oracle: sigmoid in float64 numpy, a stable argsort of -(s + b) (equal values to the lower
column, as lax.top_k), the weights renormalised and scaled, numpy's stable argsort of the copies.
The triton tier runs in Pallas's interpreter on CPU, is lowered for an H200 on CPU, and on a GPU
is compiled and run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_route
from pallas_kernels.moe_route import api
from pallas_kernels.moe_route import triton

ON_GPU = jax.devices()[0].platform == "gpu"


def case(seed, n, e, ties=False):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, e)).astype(np.float32)
  bias = (0.1 * rng.normal(size=e)).astype(np.float32)
  if ties:   # equal s + b within rows: columns 1, 2 and 5 equal in every row
    bias[:] = 0.0
    logits[:, 2] = logits[:, 5] = logits[:, 1]
  return jnp.asarray(logits), jnp.asarray(bias)


def oracle(logits, bias, k, scale, normalize):
  logits, bias = np.asarray(logits, np.float64), np.asarray(bias, np.float64)
  s = 1 / (1 + np.exp(-logits))
  sel = (s.astype(np.float32) + bias.astype(np.float32)).astype(np.float64)
  experts = np.argsort(-sel, axis=1, kind="stable")[:, :k]
  w = np.take_along_axis(s, experts, axis=1)
  if normalize:
    w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
  flat = experts.ravel()
  order = np.argsort(flat, kind="stable")
  return (w * scale, experts, order, np.argsort(order),
          np.bincount(flat, minlength=logits.shape[1]))


def check(got, want):
  w, experts, order, inverse, sizes = (np.asarray(a) for a in got)
  assert w.dtype == np.float32 and experts.dtype == order.dtype == sizes.dtype == np.int32
  np.testing.assert_allclose(w, want[0], rtol=2e-6, atol=1e-7)
  for name, g, ref in zip(("experts", "order", "inverse", "sizes"),
                          (experts, order, inverse, sizes), want[1:]):
    np.testing.assert_array_equal(g, ref, err_msg=name)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("n,e,k,normalize,ties", [
    (16, 64, 8, True, False), (1, 64, 8, True, False), (5, 12, 3, False, False),
    (3, 9, 4, True, True), (2, 4, 4, True, False)])
def test_tiers_match_numpy(impl, n, e, k, normalize, ties):
  logits, bias = case(n * 10 + e, n, e, ties)
  assert moe_route.plan(logits, k, impl=impl, interpret=True).impl == impl
  got = moe_route.route_and_sort(logits, bias, k, scale=1.7, normalize=normalize, impl=impl,
                                 interpret=True)
  check(got, oracle(logits, bias, k, 1.7, normalize))


def test_route_weights_experts_scores_and_cutoffs():
  """`route` (the training path): the same selection and weights, the scores, and QB's
  cutoff: the (k+1)-th largest s + b; differentiable in the logits."""
  logits, bias = case(3, 6, 10)
  w, experts, scores, cut = moe_route.route(logits, bias, 3, scale=2.0, cutoffs=True)
  want = oracle(logits, bias, 3, 2.0, True)
  np.testing.assert_allclose(w, want[0], rtol=2e-6)
  np.testing.assert_array_equal(experts, want[1])
  np.testing.assert_allclose(scores, jax.nn.sigmoid(logits), rtol=1e-6)
  sel = np.asarray(scores) + np.asarray(bias)
  np.testing.assert_array_equal(cut, -np.sort(-sel, axis=1)[:, 3])
  grad = jax.grad(lambda x: jnp.sum(moe_route.route(x, bias, 3)[0] ** 2))(logits)
  assert np.abs(np.asarray(grad)).sum() > 0


@pytest.mark.parametrize("n,e,k,normalize,ties", [
    (16, 64, 8, True, False), (5, 12, 3, False, False), (3, 9, 4, True, True),
    (2, 4, 4, True, False)])
def test_route_dense_matches_numpy(n, e, k, normalize, ties):
  """`route_dense`: the oracle's picks exactly (ties to the lower column: columns 1, 2 and 5
  equal with k 4 splits them), their weights in place, 0 elsewhere."""
  logits, bias = case(n * 7 + e, n, e, ties)
  got = np.asarray(jax.jit(lambda a, b: moe_route.route_dense(
      a, b, k, scale=1.7, normalize=normalize))(logits, bias))
  w, experts = oracle(logits, bias, k, 1.7, normalize)[:2]
  want = np.zeros((n, e))
  np.put_along_axis(want, experts, w, axis=1)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got != 0, want != 0)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_route_dense_negative_keys_and_gradient():
  """Selection values below zero (a bias of -2: negative floats' total-order keys run
  backwards) pick what `lax.top_k` picks; the gradient in the logits is `route`'s,
  scattered."""
  logits, bias = case(4, 6, 10)
  bias = bias - 2.0
  got = np.asarray(moe_route.route_dense(logits, bias, 3, normalize=False))
  want = np.asarray(jax.lax.top_k(jax.nn.sigmoid(logits) + bias, 3)[1])
  for row, picks in zip(got, want):
    assert set(np.flatnonzero(row)) == set(picks)
  logits, bias = case(5, 6, 10)
  probe = jnp.cos(jnp.arange(60.0)).reshape(6, 10)

  def scattered(x):
    w, experts, _ = moe_route.route(x, bias, 3, scale=1.3)
    return jnp.sum(jnp.where(experts[:, :, None] == jnp.arange(10), w[:, :, None], 0.0), axis=1)

  g_dense = jax.grad(lambda x: jnp.sum(moe_route.route_dense(x, bias, 3, scale=1.3) * probe))
  g_route = jax.grad(lambda x: jnp.sum(scattered(x) * probe))
  np.testing.assert_allclose(g_dense(logits), g_route(logits), rtol=1e-5, atol=1e-7)


def test_default_and_declines(monkeypatch):
  logits, _ = case(0, 4, 8)
  assert moe_route.plan(logits, 2).impl == "xla"
  monkeypatch.setattr(api, "TRITON_IS_DEFAULT", True)
  assert moe_route.plan(logits, 2).impl == ("triton" if ON_GPU else "xla")
  big = jax.ShapeDtypeStruct((64, 64), jnp.float32)       # 512 copies
  p = moe_route.plan(big, 8, impl="triton", interpret=True)
  assert p.impl == "xla" and "512 copies' one-hot" in p.declined[0][1]
  wide = jax.ShapeDtypeStruct((32, 896), jnp.float32)     # K3's router at B 32
  p = moe_route.plan(wide, 1, impl="triton", interpret=True)
  assert p.impl == "xla" and "logits [32, 896]" in p.declined[0][1]


@pytest.mark.parametrize("args,kw,match", [
    ((jnp.zeros((4,)), jnp.zeros((4,)), 2), {}, r"logits must be a floating \[N, E\]"),
    ((jnp.zeros((2, 4)), jnp.zeros((5,)), 2), {}, r"bias must have shape \(4,\)"),
    ((jnp.zeros((2, 4)), jnp.zeros((4,)), 5), {}, r"top_k must be an int in \[1, E=4\]"),
    ((jnp.zeros((2, 4)), jnp.zeros((4,)), 2), dict(impl="mosaic"), "impl must be"),
])
def test_bad_arguments(args, kw, match):
  with pytest.raises(ValueError, match=match):
    moe_route.route_and_sort(*args, **kw)
  with pytest.raises(ValueError, match="top_k must be < E=4 with cutoffs"):
    moe_route.route(jnp.zeros((2, 4)), jnp.zeros((4,)), 4, cutoffs=True)


def test_lowers_for_h200():
  """One Triton kernel at k3_small's decode routing (16 tokens, top-8 of 64 experts)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda a, b: triton.route_and_sort(a, b, 8, scale=1.0, normalize=True)
                      ).trace(jax.ShapeDtypeStruct((16, 64), jnp.float32),
                              jax.ShapeDtypeStruct((64,), jnp.float32)
                              ).lower(lowering_platforms=("cuda",))
  calls = [line for line in lowered.as_text().splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 1 and "moe_route" in calls[0]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,e,k", [(16, 64, 8), (1, 64, 8), (5, 12, 3)])
def test_compiled_on_gpu(n, e, k):
  logits, bias = case(n + e, n, e)
  got = jax.jit(lambda a, b: moe_route.route_and_sort(a, b, k, scale=1.3, impl="triton"))(
      logits, bias)
  check(got, oracle(logits, bias, k, 1.3, True))
