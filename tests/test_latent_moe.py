"""Tests for k3jax.latent_moe (report §2.3, Eq. 11-13) against dense / numpy oracles."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

import k3jax  # noqa: F401
from k3jax import latent_moe as lm
from k3jax import quantile_balancing as qb
from k3jax import situ as situ_lib
from pallas_kernels import moe_route
from pallas_kernels import tiers
from pallas_kernels.moe_route import api as moe_route_api
from pallas_kernels.moe_route import triton as moe_route_triton

B1, B2 = 4.0, 25.0


def routed_experts_loop_reference(z, weights, experts, w1, w3, w2, beta1, beta2):
  """Loop over experts with dense masks: every expert runs on every token (test oracle)."""
  out = jnp.zeros(z.shape, jnp.float32)
  for e in range(w1.shape[0]):
    coef = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=1)
    h = situ_lib.situ(z @ w1[e], z @ w3[e], beta1, beta2) @ w2[e]
    out = out + coef[:, None] * h
  return out.astype(z.dtype)


def np_route(x, kernel, bias, k, scale, norm):
  s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ kernel.astype(np.float64))))
  experts = np.argsort(-(s + bias), axis=1, kind="stable")[:, :k]
  w = np.take_along_axis(s, experts, axis=1)
  if norm:
    w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
  return w * scale, experts, s


def small_moe(latent_size=8, **kw):
  cfg = dict(num_experts=6, top_k=2, n_shared_experts=2, moe_intermediate_size=12,
             latent_size=latent_size, qb_num_bins=50, rngs=nnx.Rngs(0))
  cfg.update(kw)
  return lm.LatentMoE(16, **cfg)


@pytest.fixture(scope="module")
def model():
  return small_moe(routed_scaling_factor=1.7, qb_keep_scores=True)


@pytest.fixture(scope="module")
def plain_model():
  return small_moe(latent_size=16, n_shared_experts=0)


@nnx.jit
def forward(model, x):
  return model(x)


def test_route_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(20, 16)).astype(np.float32)
  kern = rng.normal(size=(16, 6)).astype(np.float32) * 0.3
  bias = rng.normal(size=6).astype(np.float32) * 0.2
  w, e, s = lm.route(jnp.asarray(x), jnp.asarray(kern), jnp.asarray(bias), 3, 2.5, True)
  w_ref, e_ref, s_ref = np_route(x, kern, bias, 3, 2.5, True)
  assert w.dtype == jnp.float32 and e.dtype == jnp.int32 and s.dtype == jnp.float32
  np.testing.assert_array_equal(e, e_ref)
  np.testing.assert_allclose(w, w_ref, rtol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-5)
  w_raw, _, _ = lm.route(jnp.asarray(x), jnp.asarray(kern), jnp.asarray(bias), 3, 1.0, False)
  np.testing.assert_allclose(w_raw, np.take_along_axis(s_ref, e_ref, axis=1), rtol=1e-5)
  *same, alpha = lm.route(jnp.asarray(x), jnp.asarray(kern), jnp.asarray(bias), 3, 2.5, True,
                         return_cutoffs=True)
  for a, b in zip(same, (w, e, s)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(alpha, np.sort(s_ref + bias, axis=1)[:, -4], rtol=1e-5)


def test_router_logits_bf16_split_matches_fp64():
  """bf16 activations: the three-way bf16 split of the fp32 kernel reproduces the fp32 matmul
  (forward and both cotangents) to fp32 rounding, far below bf16's 4e-3."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16)
  kern = jnp.asarray(rng.normal(size=(96, 12)) * 0.1, jnp.float32)
  g = jnp.asarray(rng.normal(size=(64, 12)), jnp.float32)
  out, vjp = jax.vjp(lm.router_logits, x, kern)
  dx, dk = vjp(g)
  x64, k64, g64 = (np.asarray(a, np.float64) for a in (x.astype(jnp.float32), kern, g))
  rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
  assert out.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
  assert rel(out, x64 @ k64) < 1e-6
  assert rel(dk, x64.T @ g64) < 1e-6
  assert rel(dx.astype(jnp.float32), g64 @ k64.T) < 4e-3
  # One bf16 pass (no split) is off by bf16 rounding of the kernel: the test can tell.
  one_pass = jnp.dot(x, kern.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  assert rel(one_pass, x64 @ k64) > 1e-4


def test_router_logits_bf16_kernel_one_pass_is_exact():
  """A bf16 kernel takes one bf16 matmul (no split); its products are exact, so the logits
  match the fp64 product to fp32 rounding, and the cotangents keep their dtypes."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(16, 96)), jnp.bfloat16)
  kern = jnp.asarray(rng.normal(size=(96, 12)) * 0.1, jnp.bfloat16)
  out, vjp = jax.vjp(lm.router_logits, x, kern)
  dx, dk = vjp(jnp.ones((16, 12), jnp.float32))
  x64, k64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, kern))
  assert out.dtype == jnp.float32 and dx.dtype == dk.dtype == jnp.bfloat16
  np.testing.assert_allclose(out, x64 @ k64, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dk, np.float64), x64.T @ np.ones((16, 12)), rtol=4e-3)
  text = jax.jit(lm.router_logits).lower(x, kern).as_text()
  assert "concatenate" not in text   # no split of the kernel


def test_router_logits_fp32_path_is_highest():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  kern = jnp.asarray(rng.normal(size=(32, 5)), jnp.float32)
  np.testing.assert_allclose(lm.router_logits(x, kern),
                             np.asarray(x, np.float64) @ np.asarray(kern, np.float64), rtol=1e-5)
  dx, dk = jax.grad(lambda a, b: jnp.sum(jnp.sin(lm.router_logits(a, b))), (0, 1))(x, kern)
  gr = np.cos(np.asarray(x, np.float64) @ np.asarray(kern, np.float64))
  np.testing.assert_allclose(dx, gr @ np.asarray(kern, np.float64).T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dk, np.asarray(x, np.float64).T @ gr, rtol=1e-4, atol=1e-5)


def test_expert_counts_and_take_rows():
  rng = np.random.default_rng(7)
  experts = rng.integers(0, 9, size=(50, 3)).astype(np.int32)
  np.testing.assert_array_equal(lm.expert_counts(jnp.asarray(experts), 11),
                                np.bincount(experts.ravel(), minlength=11))
  # 16-bit (expert, copy) keys (<= 256 copies), uint8 and uint16 expert keys
  for num_experts, rows in ((9, 60), (256, 64), (9, 80), (300, 60)):
    ex = rng.integers(0, num_experts, size=(rows, 4)).astype(np.int32)
    order, inverse, sizes = lm.sort_by_expert(jnp.asarray(ex), num_experts)
    np.testing.assert_array_equal(order, np.argsort(ex.ravel(), kind="stable"))
    np.testing.assert_array_equal(np.asarray(order)[inverse], np.arange(ex.size))
    np.testing.assert_array_equal(sizes, np.bincount(ex.ravel(), minlength=num_experts))
  idx = rng.integers(0, 20, size=33).astype(np.int32)
  for dtype, width in ((jnp.bfloat16, 6), (jnp.bfloat16, 5), (jnp.float32, 4)):
    x = jnp.asarray(rng.normal(size=(20, width)), dtype)
    got = lm.take_rows(x, jnp.asarray(idx))
    assert got.dtype == dtype and got.shape == (33, width)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32)[idx])


def test_bias_selects_but_never_weights():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(24, 16)).astype(np.float32))
  kern = jnp.asarray(rng.normal(size=(16, 6)).astype(np.float32) * 0.3)
  w0, e0, s0 = lm.route(x, kern, jnp.zeros(6), 2, 1.0, True)
  # A common offset keeps every top-k set, so the weights are unchanged.
  w1, e1, _ = lm.route(x, kern, jnp.full((6,), 0.37), 2, 1.0, True)
  np.testing.assert_array_equal(np.sort(e0, 1), np.sort(e1, 1))
  np.testing.assert_allclose(np.sort(w0, 1), np.sort(w1, 1), rtol=1e-6)
  # A large bias on expert 3 puts it in every top-k; weights stay renormalised unbiased scores.
  w2, e2, s2 = lm.route(x, kern, jnp.zeros(6).at[3].set(10.0), 2, 1.0, True)
  assert (np.asarray(e2) == 3).any(axis=1).all()
  assert not (np.asarray(e0) == 3).any(axis=1).all()
  sel = np.take_along_axis(np.asarray(s0), np.asarray(e2), axis=1)
  np.testing.assert_allclose(w2, sel / sel.sum(1, keepdims=True), rtol=1e-6)
  np.testing.assert_array_equal(s2, s0)


@pytest.fixture(scope="module")
def uneven_case():
  """N=10 tokens, E=5, k=2: expert 0 takes 8 copies, expert 4 none."""
  experts = np.array([[0, 1], [0, 2], [3, 0], [0, 1], [2, 0], [0, 3], [1, 0], [0, 2],
                      [1, 3], [2, 1]], np.int32)
  assert (np.bincount(experts.ravel(), minlength=5) == [8, 5, 4, 3, 0]).all()
  rng = np.random.default_rng(2)
  n_tok, lat, mid, num_e = 10, 8, 6, 5
  arrs = dict(
      z=rng.normal(size=(n_tok, lat)), weights=rng.uniform(0.1, 1.0, size=(n_tok, 2)),
      w1=rng.normal(size=(num_e, lat, mid)), w3=rng.normal(size=(num_e, lat, mid)),
      w2=rng.normal(size=(num_e, mid, lat)) * 0.3)
  arrs = {k: jnp.asarray(v, jnp.float32) for k, v in arrs.items()}
  return arrs, jnp.asarray(experts)


def all_experts_path(z, weights, experts, w1, *rest):
  """`all_experts` from the picks' weights, through `dense_weights`."""
  return lm.all_experts(z, lm.dense_weights(weights, experts, w1.shape[0]), w1, *rest)


@pytest.mark.parametrize("path", [lm.routed_experts, lm.gathered_experts, all_experts_path],
                         ids=["sorted", "gathered", "all"])
def test_routed_paths_match_loop_reference(uneven_case, path):
  """The sorted (training), gathered and all-experts (decode) paths against the loop over
  experts, values and gradients; expert 0 takes 8 of the 20 copies, expert 4 none."""
  arrs, experts = uneven_case
  names = ("z", "weights", "w1", "w3", "w2")

  def loss(fn, *args):
    kw = dict(zip(names, args))
    out = fn(kw["z"], kw["weights"], experts, kw["w1"], kw["w3"], kw["w2"], B1, B2)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

  args = [arrs[n] for n in names]
  (_, out), grads = jax.jit(jax.value_and_grad(
      lambda *a: loss(path, *a), argnums=range(5), has_aux=True))(*args)
  (_, ref), ref_grads = jax.jit(jax.value_and_grad(
      lambda *a: loss(routed_experts_loop_reference, *a), argnums=range(5), has_aux=True))(*args)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for name, g, g_ref in zip(names, grads, ref_grads):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5, err_msg=name)
  assert np.abs(np.asarray(ref_grads[2][4])).max() == 0.0  # unused expert gets zero grad
  assert np.abs(np.asarray(grads[2][0])).max() > 0.0


def test_gathered_path_with_qat_equals_sorted_path():
  """MXFP8 inputs before W1/W3 and W2 on both paths (the weights are the caller's); blocks of
  32 along l = 32 and m = 64, 3 tokens x 2 of 6 experts, expert 1 picked twice."""
  rng = np.random.default_rng(8)
  n_tok, lat, mid, num_e = 3, 32, 64, 6
  experts = jnp.asarray([[1, 4], [0, 1], [5, 2]], jnp.int32)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  args = (f(n_tok, lat), jnp.abs(f(n_tok, 2)), experts, f(num_e, lat, mid), f(num_e, lat, mid),
          0.1 * f(num_e, mid, lat), B1, B2)
  np.testing.assert_allclose(lm.gathered_experts(*args, qat=True),
                             lm.routed_experts(*args, qat=True), rtol=1e-5, atol=1e-5)
  assert not np.allclose(lm.gathered_experts(*args, qat=True), lm.gathered_experts(*args),
                         rtol=1e-5, atol=1e-5)


def test_module_takes_the_gathered_path_for_few_cached_tokens(monkeypatch):
  """decode_experts="gathered": cached calls with N*k <= E tokens only; same output."""
  sorted_model = small_moe()
  gathered_model = small_moe(decode_experts="gathered")
  calls = []
  real = lm.gathered_experts
  monkeypatch.setattr(lm, "gathered_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
  for shape, cached, taken in (((1, 3, 16), True, True), ((2, 1, 16), True, True),
                               ((1, 4, 16), True, False), ((1, 3, 16), False, False)):
    x = jax.random.normal(jax.random.key(7), shape)
    calls.clear()
    y, _ = gathered_model(x, cached)
    assert bool(calls) == taken, (shape, cached)
    np.testing.assert_allclose(y, sorted_model(x, cached)[0], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="decode_experts"):
    small_moe(decode_experts="dense")


def test_module_takes_the_all_experts_path_for_cached_batches(monkeypatch):
  """decode_experts="all": cached calls with N*k >= 2E and N <= ALL_EXPERTS_MAX_TOKENS only;
  the sorted path's output (6 experts, k 2: from 6 tokens)."""
  sorted_model = small_moe()
  every_model = small_moe(decode_experts="all")
  calls = []
  real = lm.all_experts
  monkeypatch.setattr(lm, "all_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
  monkeypatch.setattr(lm, "ALL_EXPERTS_MAX_TOKENS", 8)
  for shape, cached, taken in (((1, 6, 16), True, True), ((2, 4, 16), True, True),
                               ((1, 5, 16), True, False), ((3, 3, 16), True, False),
                               ((1, 6, 16), False, False)):
    x = jax.random.normal(jax.random.key(7), shape)
    calls.clear()
    y, aux = every_model(x, cached)
    assert bool(calls) == taken, (shape, cached)
    y_sorted, aux_sorted = sorted_model(x, cached)
    np.testing.assert_allclose(y, y_sorted, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(aux["loads"], aux_sorted["loads"])


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_prepared_decode_weights_give_the_unmerged_products(param_dtype, monkeypatch):
  """`prepare_decode`: a cached call on bf16 inputs runs two dense products (W_in, W_out) in
  place of five; the router's logits are those of `router_logits` (bf16 kernel: one part; fp32:
  its three bf16 parts), so the routing is the same, and the output is the unmerged one's to
  bf16 rounding (one rounding of the summed output products instead of two and an add: within
  2^-7 of the largest output, a bf16 spacing of its binade). Uncached calls, and fp32 layers
  (no merged weights), keep the unmerged path."""
  merged = []
  real = lm.LatentMoE._decode_inputs
  monkeypatch.setattr(lm.LatentMoE, "_decode_inputs", lambda *a: merged.append(1) or real(*a))
  layer = small_moe(dtype=jnp.bfloat16, param_dtype=param_dtype)
  x = jax.random.normal(jax.random.key(3), (2, 3, 16)).astype(jnp.bfloat16)
  y, aux = layer(x, True)
  w_in, w_out = layer.decode_weights()
  parts = 1 if param_dtype == jnp.bfloat16 else 3
  assert w_in.shape == (16, 8 + parts * 6 + 2 * 24) and w_out.shape == (8 + 24, 16)
  assert w_in.dtype == w_out.dtype == jnp.bfloat16
  xf = x.reshape(6, 16)
  _, logits, _ = layer._decode_inputs(xf, w_in)
  np.testing.assert_array_equal(logits, lm.router_logits(xf, layer.gate["kernel"][...]))
  layer.prepare_decode()
  merged.clear()
  y_prepared, aux_prepared = layer(x, True)
  assert merged == [1]                           # the merged products ran
  np.testing.assert_array_equal(aux_prepared["loads"], aux["loads"])
  y, y_prepared = (np.asarray(a, np.float32) for a in (y, y_prepared))
  assert np.abs(y_prepared - y).max() <= 2 ** -7 * np.abs(y).max()
  np.testing.assert_array_equal(layer(x, False)[0], small_moe(
      dtype=jnp.bfloat16, param_dtype=param_dtype)(x, False)[0])
  assert merged == [1]                           # uncached: the unmerged path
  assert small_moe().decode_weights() is None    # fp32 compute: nothing to merge


def test_cached_calls_route_and_sort_in_one_kernel_where_it_plans(monkeypatch):
  """Where `moe_route` plans its triton tier (as on a GPU with TRITON_IS_DEFAULT; here the
  interpreter), cached calls route and sort through it, and give the default path's output;
  uncached calls keep `route` and the sort."""
  model = small_moe(routed_scaling_factor=1.7)
  x = jax.random.normal(jax.random.key(3), (2, 3, 16))
  want = {cached: model(x, cached)[0] for cached in (True, False)}
  calls = []
  real = moe_route_triton.route_and_sort
  monkeypatch.setattr(moe_route_triton, "route_and_sort",
                      lambda *a, **k: calls.append(k["interpret"]) or real(*a, **k))
  plan = lambda logits, top_k, impl=None, interpret=False: tiers.Plan("triton", (), True)
  monkeypatch.setattr(moe_route, "plan", plan)
  monkeypatch.setattr(moe_route_api, "plan", plan)
  np.testing.assert_allclose(model(x, True)[0], want[True], rtol=1e-6, atol=1e-6)
  assert calls == [True]
  np.testing.assert_array_equal(model(x, False)[0], want[False])
  assert calls == [True]


def test_pluggable_ragged_dot_is_used(uneven_case):
  arrs, experts = uneven_case
  calls = []

  def counting_ragged_dot(lhs, rhs, group_sizes):
    calls.append(np.asarray(group_sizes))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)

  lm.routed_experts(arrs["z"], arrs["weights"], experts, arrs["w1"], arrs["w3"], arrs["w2"],
                    B1, B2, ragged_dot=counting_ragged_dot)
  assert len(calls) == 2 and all((c == [8, 5, 4, 3, 0]).all() for c in calls)  # [W1|W3], W2


def fused_case(dtype=jnp.bfloat16):
  """N=24 tokens, E=5, k=3, latent 32, width 16 (the kernel's smallest tiles); expert 4 idle."""
  rng = np.random.default_rng(4)
  n_tok, lat, mid, num_e = 24, 32, 16, 5
  experts = np.stack([rng.permutation(4)[:3] for _ in range(n_tok)]).astype(np.int32)
  arrs = dict(
      z=rng.normal(size=(n_tok, lat)), weights=rng.uniform(0.1, 1.0, size=(n_tok, 3)),
      w1=rng.normal(size=(num_e, lat, mid)) / 4, w3=rng.normal(size=(num_e, lat, mid)),
      w2=rng.normal(size=(num_e, mid, lat)) * 0.3)
  return {k: jnp.asarray(v, dtype) for k, v in arrs.items()}, jnp.asarray(experts)


def test_fused_gate_up_matches_unfused_path():
  """routed_experts with the fused kernel (interpreted) against dispatch + expert_ffn, bf16:
  the forward alone runs the kernel (ragged_dot is called once, for W2) and matches within 1%
  (relative L2); under differentiation with gate_up_train="unfused" (also under
  jax.checkpoint) the forward is the unfused path's, so the output and every gradient through
  the custom VJP equal the unfused path's."""
  arrs, experts = fused_case()
  names = ("z", "weights", "w1", "w3", "w2")
  calls = []

  def counting_ragged_dot(lhs, rhs, group_sizes):
    calls.append(rhs.shape)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)

  def run(impl, *args):
    kw = dict(zip(names, args))
    return lm.routed_experts(kw["z"], kw["weights"], experts, kw["w1"], kw["w3"], kw["w2"], B1,
                             B2, counting_ragged_dot, gate_up_impl=impl,
                             gate_up_train="unfused", interpret=True)

  def loss(impl, *args):
    out = run(impl, *args)
    cos = jnp.cos(jnp.arange(out.size).reshape(out.shape))
    return jnp.sum(out.astype(jnp.float32) * cos), out

  args = [arrs[n] for n in names]
  fused_out = run("triton", *args)
  assert calls == [(5, 16, 32)]
  unfused_out = run("xla", *args)
  err = np.linalg.norm(np.asarray(fused_out, np.float64) - np.asarray(unfused_out, np.float64))
  assert err < 1e-2 * np.linalg.norm(np.asarray(unfused_out, np.float64))
  grad = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=range(5),
                                                 has_aux=True))(*args)
  (_, out), grads = grad("triton")
  (_, out_ref), grads_ref = grad("xla")
  np.testing.assert_array_equal(out, out_ref)
  for name, g, g_ref in zip(names, grads, grads_ref):
    np.testing.assert_array_equal(g, g_ref, err_msg=name)
  assert not np.asarray(grads[2][4]).any()      # the idle expert gets no gradient
  remat = jax.jit(jax.grad(jax.checkpoint(lambda *a: loss("triton", *a)[0]),
                           argnums=range(5)))(*args)       # model.remat = "full"
  for name, g, g_ref in zip(names, remat, grads_ref):
    np.testing.assert_array_equal(g, g_ref, err_msg=name)


def test_fused_gate_up_trains_through_the_kernel():
  """gate_up_train="kernel": the forward under differentiation is the kernel's (h and SiTU's
  partials), the backward one multiply + a regather + the grouped matmul's VJP. Its bf16
  gradients are within 2% (relative L2) of the unfused path's in fp32, as are the bf16
  unfused path's; the idle expert gets none; jax.checkpoint gives the same gradients."""
  arrs, experts = fused_case()
  names = ("z", "weights", "w1", "w3", "w2")

  def loss(impl, train, *args):
    kw = dict(zip(names, args))
    out = lm.routed_experts(kw["z"], kw["weights"], experts, kw["w1"], kw["w3"], kw["w2"], B1,
                            B2, gate_up_impl=impl, gate_up_train=train, interpret=True)
    cos = jnp.cos(jnp.arange(out.size).reshape(out.shape))
    return jnp.sum(out.astype(jnp.float32) * cos), out

  def grad(impl, train, args):
    return jax.jit(jax.value_and_grad(lambda *a: loss(impl, train, *a), argnums=range(5),
                                      has_aux=True))(*args)

  args = [arrs[n] for n in names]
  (_, out), grads = grad("triton", "kernel", args)
  forward = lm.routed_experts(*args[:2], experts, *args[2:], B1, B2, gate_up_impl="triton",
                              interpret=True)
  np.testing.assert_array_equal(out, forward)
  _, grads_bf16 = grad("xla", "unfused", args)
  _, grads_f32 = grad("xla", "unfused", [a.astype(jnp.float32) for a in args])
  for name, g, g_bf16, g_ref in zip(names, grads, grads_bf16, grads_f32):
    ref = np.asarray(g_ref, np.float64)
    for got in (g, g_bf16):
      err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
      assert err < 2e-2, (name, err)
  assert not np.asarray(grads[2][4]).any() and not np.asarray(grads[3][4]).any()
  remat = jax.jit(jax.grad(jax.checkpoint(lambda *a: loss("triton", "kernel", *a)[0]),
                           argnums=range(5)))(*args)
  for name, g, g_ref in zip(names, remat, grads):
    np.testing.assert_array_equal(g, g_ref, err_msg=name)
  with pytest.raises(ValueError, match="gate_up_train must be one of"):
    loss("triton", "fused", *args)


def test_routed_path_uses_situ_bound():
  n_tok, lat, num_e = 6, 4, 3
  rng = np.random.default_rng(3)
  z = jnp.asarray(rng.normal(size=(n_tok, lat)) * 1e4, jnp.float32)
  w1 = jnp.asarray(rng.normal(size=(num_e, lat, lat)), jnp.float32)
  w3 = jnp.asarray(rng.normal(size=(num_e, lat, lat)), jnp.float32)
  w2 = jnp.broadcast_to(jnp.eye(lat), (num_e, lat, lat))
  experts = jnp.asarray(rng.integers(0, num_e, size=(n_tok, 1)), jnp.int32)
  out = lm.routed_experts(z, jnp.ones((n_tok, 1)), experts, w1, w3, w2, B1, B2)
  assert np.abs(np.asarray(out)).max() <= B1 * B2
  assert np.abs(np.asarray(out)).max() > 0.5 * B1 * B2


def test_module_param_paths_and_axes(model, plain_model):
  flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  expected = {
      "gate/kernel": ((16, 6), ("embed", "exp_router")),
      "routed_expert_down_proj/kernel": ((16, 8), ("embed", "latent")),
      "experts/w1": ((6, 8, 12), ("exp", "latent", "mlp_moe")),
      "experts/w3": ((6, 8, 12), ("exp", "latent", "mlp_moe")),
      "experts/w2": ((6, 12, 8), ("exp", "mlp_moe", "latent")),
      "routed_expert_norm/scale": ((8,), ("latent",)),
      "routed_expert_up_proj/kernel": ((8, 16), ("latent", "embed")),
      "shared_experts/gate_proj/kernel": ((16, 24), ("embed", "mlp")),
      "shared_experts/up_proj/kernel": ((16, 24), ("embed", "mlp")),
      "shared_experts/down_proj/kernel": ((24, 16), ("mlp", "embed")),
  }
  assert set(flat) == set(expected)
  for path, (shape, axes) in expected.items():
    assert flat[path][...].shape == shape, path
    assert tuple(flat[path].get_metadata()["out_sharding"]) == axes, path
  bias = model.gate["e_score_correction_bias"]
  assert isinstance(bias, lm.MoEBias) and not isinstance(bias, nnx.Param)
  assert bias[...].shape == (6,) and bias[...].dtype == jnp.float32
  plain_paths = {"/".join(map(str, p))
                 for p, _ in nnx.to_flat_state(nnx.state(plain_model, nnx.Param))}
  assert plain_paths == {"gate/kernel", "experts/w1", "experts/w3", "experts/w2"}
  assert plain_model.experts["w1"][...].shape == (6, 16, 12)
  assert not small_moe(latent_size=0, n_shared_experts=0).use_latent


def test_module_forward_matches_formula(model, plain_model):
  model.gate["e_score_correction_bias"][...] = jnp.linspace(-0.3, 0.3, 6)
  x = jax.random.normal(jax.random.key(4), (2, 6, 16))
  y, aux = forward(model, x)
  xf = x.reshape(12, 16)
  w, e, s = lm.route(xf, model.gate["kernel"][...], model.gate["e_score_correction_bias"][...],
                     2, 1.7, True)
  z = xf @ model.routed_expert_down_proj["kernel"][...]
  u = routed_experts_loop_reference(z, w, e, model.experts["w1"][...], model.experts["w3"][...],
                                    model.experts["w2"][...], B1, B2)
  y_ref = model.shared_experts(xf) + model.routed_expert_norm(u) @ (
      model.routed_expert_up_proj["kernel"][...])
  np.testing.assert_allclose(y, y_ref.reshape(2, 6, 16), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["loads"], np.bincount(np.asarray(e).ravel(), minlength=6))
  assert int(aux["num_tokens"]) == 12 and aux["qb_counts"].shape == (6, 50)
  assert (np.asarray(aux["qb_counts"]).sum(1) == 12).all()
  yp, _ = forward(plain_model, x)
  wp, ep, _ = lm.route(xf, plain_model.gate["kernel"][...], jnp.zeros(6), 2, 1.0, True)
  up = routed_experts_loop_reference(xf, wp, ep, plain_model.experts["w1"][...],
                                     plain_model.experts["w3"][...],
                                     plain_model.experts["w2"][...], B1, B2)
  np.testing.assert_allclose(yp, up.reshape(2, 6, 16), rtol=1e-5, atol=1e-5)


def test_token_permutation_is_restored(model):
  x = jax.random.normal(jax.random.key(5), (2, 6, 16))
  perm = np.random.default_rng(5).permutation(6)
  y, aux = forward(model, x)
  yp, auxp = forward(model, x[:, perm])
  np.testing.assert_allclose(yp, y[:, perm], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(aux["loads"], auxp["loads"])
  np.testing.assert_array_equal(aux["qb_counts"], auxp["qb_counts"])


def test_jit_forward_grad_and_bias_update(model):
  x = jax.random.normal(jax.random.key(6), (2, 6, 16))

  @nnx.jit
  def step(model, x):
    def loss_fn(model):
      y, aux = model(x)
      return jnp.mean(y ** 2), aux
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, aux, grads

  loss, aux, grads = step(model, x)
  flat = dict(nnx.to_flat_state(grads))
  assert ("gate", "e_score_correction_bias") not in flat
  assert all(np.isfinite(np.asarray(v[...])).all() for v in flat.values())
  assert np.abs(np.asarray(grads["experts"]["w1"][...])).max() > 0
  assert np.abs(np.asarray(grads["gate"]["kernel"][...])).max() > 0

  bias = model.gate["e_score_correction_bias"][...]
  upd = jax.jit(lm.update_bias, static_argnames=("method", "top_k", "rate"))
  new_q = upd(bias, aux, method="quantile", top_k=2)
  np.testing.assert_allclose(new_q, qb.histogram_update(aux["qb_counts"], aux["qb_lo"],
                                                        aux["qb_hi"], 12, 2), atol=1e-6)
  assert abs(float(new_q.mean())) < 1e-6 and new_q.dtype == jnp.float32
  new_e = upd(bias, aux, method="quantile_exact", top_k=2)
  np.testing.assert_allclose(new_e, qb.exact_update(aux["scores"], bias, 2), atol=1e-6)
  new_s = upd(bias, aux, method="sign", top_k=2, rate=0.01)
  np.testing.assert_allclose(new_s, qb.sign_update(aux["loads"], bias, 0.01), atol=1e-7)
  np.testing.assert_array_equal(upd(bias, aux, method="none", top_k=2), bias)


def test_merge_aux_equals_full_batch(model):
  model.gate["e_score_correction_bias"][...] = jnp.linspace(0.2, -0.2, 6)
  x = jax.random.normal(jax.random.key(7), (4, 6, 16))
  _, full = forward(model, x)
  _, a = forward(model, x[:2])
  _, b = forward(model, x[2:])
  merged = lm.merge_aux(a, b)
  for key in full:
    np.testing.assert_array_equal(merged[key], full[key], err_msg=key)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="top_k"):
    small_moe(top_k=6)
  with pytest.raises(ValueError, match="latent_size"):
    small_moe(latent_size=-1)
  with pytest.raises(ValueError, match="method"):
    lm.update_bias(jnp.zeros(6), {}, method="adam", top_k=2)
  with pytest.raises(ValueError, match="qb_keep_scores"):
    lm.update_bias(jnp.zeros(6), {}, method="quantile_exact", top_k=2)
  with pytest.raises(ValueError, match="bias"):
    lm.route(jnp.zeros((4, 16)), jnp.zeros((16, 6)), jnp.zeros(5), 2, 1.0, True)
  with pytest.raises(ValueError, match="return_cutoffs"):
    lm.route(jnp.zeros((4, 16)), jnp.zeros((16, 6)), jnp.zeros(6), 6, 1.0, True,
             return_cutoffs=True)
  with pytest.raises(ValueError, match="w1"):
    lm.routed_experts(jnp.zeros((4, 8)), jnp.ones((4, 2)), jnp.zeros((4, 2), jnp.int32),
                      jnp.zeros((3, 7, 5)), jnp.zeros((3, 7, 5)), jnp.zeros((3, 5, 7)), B1, B2)
