"""QAT of the routed experts (k3_techniques.md §7): MXFP4 weights and MXFP8 expert inputs,
fake-quantized with straight-through gradients, against numpy loop-over-experts oracles whose
quantizer is `mx_testing`'s; packed MXFP4 experts (`expert_format="mxfp4"`) against the QAT
forward."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import config as config_lib
from k3jax import latent_moe as lm
from k3jax import mx
from k3jax import train
from k3jax.model import K3ForCausalLM
from mx_testing import np_fake_quantize
from pallas_kernels.mxfp4_matmul import api as mx_api
from pallas_kernels.mxfp4_matmul import triton as mx_triton

B1, B2 = 4.0, 25.0
DIM, LAT, MID, NUM_E, TOP_K = 64, 32, 64, 6, 2
TINY = "experiments/configs/k3_tiny.py"


def np_situ(g, u):
  return B1 * np.tanh(g / B1) / (1 + np.exp(-g)) * (B2 * np.tanh(u / B2))


def np_situ_partials(g, u):
  """(dh/dg, dh/du) of h = np_situ(g, u), written out."""
  s, tg, tu = 1 / (1 + np.exp(-g)), np.tanh(g / B1), np.tanh(u / B2)
  a = B1 * tg * s
  return B2 * tu * ((1 - tg * tg) * s + a * (1 - s)), a * (1 - tu * tu)


def np_route(x, kernel, bias):
  s = 1 / (1 + np.exp(-(x @ kernel)))
  experts = np.argsort(-(s + bias), axis=1, kind="stable")[:, :TOP_K]
  w = np.take_along_axis(s, experts, axis=1)
  return w / (w.sum(axis=1, keepdims=True) + 1e-20), experts


def np_experts(z, w, experts, p, qat):
  """Loop over experts, fp64: (u [N, l], per expert (coef, zq, gate, up, hq, W1q, W3q, W2q)).
  With qat, every expert weight [in, out] is dequantized MXFP4 along `in` and every expert
  input (z, h) dequantized MXFP8 along its row."""
  fq = np_fake_quantize if qat else (lambda a, fmt, axis=-1: a)
  zq = fq(z, "mxfp8")
  u, parts = np.zeros(z.shape), []
  for e in range(p["w1"].shape[0]):
    coef = np.where(experts == e, w, 0.0).sum(axis=1)
    w1q, w3q, w2q = (fq(p[n][e], "mxfp4", axis=0) for n in ("w1", "w3", "w2"))
    gate, up = zq @ w1q, zq @ w3q
    hq = fq(np_situ(gate, up), "mxfp8")
    u += coef[:, None] * (hq @ w2q)
    parts.append((coef, zq, gate, up, hq, w1q, w3q, w2q))
  return u, parts


def as_np(state):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))


def np_layer(p, bias, x, qat):
  """The LatentMoE formula (module docstring) in fp64: only the routed experts quantize."""
  w, experts = np_route(x, p["gate"]["kernel"], bias)
  u, _ = np_experts(x @ p["routed_expert_down_proj"]["kernel"], w, experts, p["experts"], qat)
  normed = u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + 1e-5)
  normed = normed * p["routed_expert_norm"]["scale"]
  s = p["shared_experts"]
  shared = np_situ(x @ s["gate_proj"]["kernel"], x @ s["up_proj"]["kernel"]) @ s[
      "down_proj"]["kernel"]
  return shared + normed @ p["routed_expert_up_proj"]["kernel"]


def moe(qat, **kw):
  cfg = dict(num_experts=NUM_E, top_k=TOP_K, n_shared_experts=1, moe_intermediate_size=MID,
             latent_size=LAT, qb_num_bins=50, qb_keep_scores=True, qat=qat, rngs=nnx.Rngs(0))
  cfg.update(kw)
  layer = lm.LatentMoE(DIM, **cfg)
  bias = np.random.default_rng(1).normal(size=NUM_E) * 0.1
  layer.gate["e_score_correction_bias"][...] = jnp.asarray(bias, jnp.float32)
  return layer


@nnx.jit
def forward(layer, x):
  return layer(x)


def inputs(shape=(2, 7, DIM), seed=2):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_qat_forward_matches_loop_oracle():
  """The QAT layer (fp32) equals the fp64 oracle with numpy-dequantized expert weights and
  inputs; the router, shared experts and latent projections see unquantized values (the
  oracle quantizes nothing else). Without qat it equals the unquantized oracle, which is
  far from the QAT one: the test can tell."""
  x = inputs()
  xf = np.asarray(x, np.float64).reshape(-1, DIM)
  for qat in (True, False):
    layer = moe(qat)
    p = as_np(nnx.state(layer, nnx.Param))
    bias = np.asarray(layer.gate["e_score_correction_bias"][...], np.float64)
    y, _ = forward(layer, x)
    want = np_layer(p, bias, xf, qat)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, DIM), want, rtol=1e-4, atol=1e-5)
  other = np_layer(p, bias, xf, True)
  assert np.linalg.norm(other - want) > 1e-2 * np.linalg.norm(want)


def test_routing_and_statistics_unchanged_by_qat():
  x = inputs(seed=3)
  (_, aux_q), (_, aux) = forward(moe(True), x), forward(moe(False), x)
  assert set(aux_q) == set(aux)
  for key in aux:
    np.testing.assert_array_equal(aux_q[key], aux[key], err_msg=key)


def test_straight_through_gradients():
  """With STE every quantizer's Jacobian is the identity, so the gradient w.r.t. the fp32
  master weights W is the unquantized layer's gradient formula evaluated at the quantized
  point: with the weights W-hat = DQ(Q_MXFP4(W)) and every expert input replaced by its
  MXFP8 value (z-hat, h-hat), for L = sum(y * G) and each copy of weight p routed to e:
    dW2_e = sum p h-hat^T G,  dh = p G W2-hat_e^T (passed straight to h = SiTU(g, u)),
    dW1_e = sum z-hat^T (dh * dSiTU/dg),  dW3_e = sum z-hat^T (dh * dSiTU/du),
  with g = z-hat W1-hat_e, u = z-hat W3-hat_e. Plain MoE (latent_size 0, no shared experts),
  so that y = u. The parameters and gradients stay fp32."""
  layer = moe(True, latent_size=0, n_shared_experts=0)
  x = inputs(shape=(2, 6, DIM), seed=4)
  cot = jnp.asarray(np.random.default_rng(5).normal(size=x.shape), jnp.float32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y * cot)

  grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))["experts"]
  p = as_np(params)
  xf = np.asarray(x, np.float64).reshape(-1, DIM)
  w, experts = np_route(xf, p["gate"]["kernel"], np.asarray(
      layer.gate["e_score_correction_bias"][...], np.float64))
  _, parts = np_experts(xf, w, experts, p["experts"], True)
  g_out = np.asarray(cot, np.float64).reshape(-1, DIM)
  for e, (coef, zq, gate, up, hq, _, _, w2q) in enumerate(parts):
    d_hq = coef[:, None] * (g_out @ w2q.T)
    p_gate, p_up = np_situ_partials(gate, up)
    want = {"w1": zq.T @ (d_hq * p_gate), "w3": zq.T @ (d_hq * p_up),
            "w2": hq.T @ (coef[:, None] * g_out)}
    for name, g in want.items():
      assert grads[name].dtype == jnp.float32
      np.testing.assert_allclose(grads[name][e], g, rtol=1e-4, atol=1e-5,
                                 err_msg=f"{name}[{e}]")
  for name in lm.EXPERT_WEIGHTS:
    stored = layer.experts[name][...]
    assert stored.dtype == jnp.float32
    assert not np.array_equal(stored, mx.fake_quantize(stored, "mxfp4", axis=-2))


def test_fused_path_quantizes_before_the_gather_and_before_w2(monkeypatch):
  """The fused gate/up kernel (Triton tier, interpreted) receives z fake-quantized to MXFP8
  per token row, and W2's grouped matmul receives its output fake-quantized (bit-exact); the
  fused and unfused QAT paths agree to bf16 rounding."""
  rng = np.random.default_rng(6)
  n_tok = 12
  z = jnp.asarray(rng.normal(size=(n_tok, LAT)), jnp.bfloat16)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n_tok, TOP_K)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.permutation(4)[:TOP_K] for _ in range(n_tok)]),
                        jnp.int32)
  w1, w3 = (jnp.asarray(rng.normal(size=(4, LAT, 32)) / 4, jnp.bfloat16) for _ in range(2))
  w2 = jnp.asarray(rng.normal(size=(4, 32, LAT)) * 0.3, jnp.bfloat16)
  seen = {}
  kernel = lm.moe_gate_up.gate_up

  def spy_gate_up(x, *args, **kw):
    seen["kernel_x"] = x
    seen["h"] = kernel(x, *args, **kw)
    return seen["h"]

  def spy_ragged_dot(lhs, rhs, group_sizes):
    seen["w2_lhs"] = lhs
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)

  monkeypatch.setattr(lm.moe_gate_up, "gate_up", spy_gate_up)
  fused = lm.routed_experts(z, weights, experts, w1, w3, w2, B1, B2, spy_ragged_dot,
                            gate_up_impl="triton", interpret=True, qat=True)
  np.testing.assert_array_equal(seen["kernel_x"], mx.fake_quantize(z, "mxfp8"))
  np.testing.assert_array_equal(seen["w2_lhs"], mx.fake_quantize(seen["h"], "mxfp8"))
  unfused = lm.routed_experts(z, weights, experts, w1, w3, w2, B1, B2, qat=True)
  ref = np.asarray(unfused, np.float64)
  assert np.linalg.norm(np.asarray(fused, np.float64) - ref) < 2e-2 * np.linalg.norm(ref)


def packed_case(seed: int, n_tok: int, lat: int = 128, mid: int = 64, num_e: int = 4):
  """Tokens z [n_tok, lat] bf16, routing weights and distinct top-k experts, MXFP4-packed
  experts (`lm.PackedWeight`s of w1, w3 [E, lat, mid] and w2 [E, mid, lat]) and their values
  [E, in, out] fp64."""
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.normal(size=(n_tok, lat)), jnp.bfloat16)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n_tok, TOP_K)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.permutation(num_e)[:TOP_K] for _ in range(n_tok)]),
                        jnp.int32)
  shapes = {"w1": (num_e, lat, mid), "w3": (num_e, lat, mid), "w2": (num_e, mid, lat)}
  packed = {n: lm.PackedWeight(*mx.pack_k3(jnp.swapaxes(jnp.asarray(
      rng.normal(size=shape) * 0.2, jnp.float32), 1, 2))) for n, shape in shapes.items()}
  grid = {n: np.swapaxes(np.asarray(mx.unpack_k3(*w), np.float64), 1, 2)
          for n, w in packed.items()}
  return z, weights, experts, packed, grid


def test_packed_experts_fused_gate_up_matches_loop_oracle(monkeypatch):
  """Packed experts with gate_up_impl="triton", or None on Hopper: the fused MXFP4 kernel
  (interpreted: the gather, W1 / W3 and SiTU in one call; it ran, not the reference) then W2
  equal the fp64 loop over experts on the same MXFP4 weights to bf16 rounding, as does the
  unfused packed path (gate_up_impl None elsewhere)."""
  z, weights, experts, packed, grid = packed_case(9, 10)
  ran = []
  kernel = mx_triton.gate_up
  monkeypatch.setattr(mx_triton, "gate_up",
                      lambda *a, **kw: ran.append(1) or kernel(*a, **kw))
  fused = lm.routed_experts(z, weights, experts, packed["w1"], packed["w3"], packed["w2"], B1,
                            B2, gate_up_impl="triton", interpret=True)
  assert ran and fused.dtype == jnp.bfloat16
  args = (z, weights, experts, packed["w1"], packed["w3"], packed["w2"], B1, B2)
  unfused = lm.routed_experts(*args, gate_up_impl=None, interpret=True)
  assert len(ran) == 1
  monkeypatch.setattr(mx_api, "gate_up_default_impls", lambda: ("triton", "reference"))
  default = lm.routed_experts(*args, gate_up_impl=None, interpret=True)
  assert len(ran) == 2
  want, _ = np_experts(np.asarray(z, np.float64), np.asarray(weights, np.float64),
                       np.asarray(experts), grid, qat=False)
  for got in (fused, unfused, default):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)


def test_packed_experts_whole_ffn_kernel_matches_loop_oracle(monkeypatch):
  """Packed experts where `mxfp4_expert_ffn`'s default is the kernel (as on Hopper with
  EXPERT_FFN_IS_DEFAULT; interpreted: gather, W1 / W3, SiTU and W2 in one call, then the
  combine; it ran) equal the fp64 loop over experts to bf16 rounding; gate_up_impl="xla" and
  qat keep the other paths."""
  z, weights, experts, packed, grid = packed_case(11, 12)
  ran = []
  kernel = mx_triton.expert_ffn
  monkeypatch.setattr(mx_triton, "expert_ffn",
                      lambda *a, **kw: ran.append(1) or kernel(*a, **kw))
  monkeypatch.setattr(mx_api, "expert_ffn_default_impls", lambda: ("triton", "reference"))
  args = (z, weights, experts, packed["w1"], packed["w3"], packed["w2"], B1, B2)
  fused = lm.routed_experts(*args, gate_up_impl=None, interpret=True)
  assert ran == [1] and fused.dtype == jnp.bfloat16
  unfused = lm.routed_experts(*args, gate_up_impl="xla", interpret=True)
  assert ran == [1]
  want, _ = np_experts(np.asarray(z, np.float64), np.asarray(weights, np.float64),
                       np.asarray(experts), grid, qat=False)
  for got in (fused, unfused):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)


def test_packed_all_experts_path_matches_loop_oracle(monkeypatch):
  """`all_experts` on packed experts (every expert on each of 6 tokens, weighted by 0 where
  unselected) through the fused MXFP4 gate/up kernel (interpreted; it ran) and the unfused
  packed path equals the fp64 loop over experts to bf16 rounding."""
  z, weights, experts, packed, grid = packed_case(13, 6)
  ran = []
  kernel = mx_triton.gate_up
  monkeypatch.setattr(mx_triton, "gate_up",
                      lambda *a, **kw: ran.append(1) or kernel(*a, **kw))
  dense = lm.dense_weights(weights, experts, lm.expert_shape(packed["w1"])[0])
  args = (z, dense, packed["w1"], packed["w3"], packed["w2"], B1, B2)
  fused = lm.all_experts(*args, gate_up_impl="triton", interpret=True)
  assert ran == [1] and fused.dtype == jnp.bfloat16
  unfused = lm.all_experts(*args, gate_up_impl="xla")
  want, _ = np_experts(np.asarray(z, np.float64), np.asarray(weights, np.float64),
                       np.asarray(experts), grid, qat=False)
  for got in (fused, unfused):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)


def test_config_fields():
  cfg = config_lib.load(TINY, {"model.moe.qat": True, "model.moe.expert_format": "mxfp4"})
  assert cfg.model.moe.qat is True
  for field, value in (("model.moe.qat", None), ("model.moe.expert_format", "fp4")):
    with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
      config_lib.load(TINY, {field: value})
  with pytest.raises(config_lib.ConfigError, match="moe_intermediate_size.*multiple of 32"):
    config_lib.load(TINY, {"model.moe.qat": True, "model.moe.moe_intermediate_size": 80})
  with pytest.raises(ValueError, match="qat must be a bool"):
    moe(1)
  with pytest.raises(ValueError, match="expert_format must be one of"):
    moe(True, expert_format="fp4")


def test_packed_layer_equals_qat_layer():
  """expert_format="mxfp4" with the state of `mx.pack_experts` gives the QAT layer's output:
  both multiply the same fp32 values (unpacked MXFP4 = fake-quantized weights, bit for bit)."""
  x = inputs(seed=7)
  layer = moe(True)
  graphdef, params, buffers = nnx.split(layer, nnx.Param, ...)
  params, buffers = mx.pack_experts(nnx.to_pure_dict(params), nnx.to_pure_dict(buffers))
  assert "experts" not in params
  assert buffers["experts"]["w2_packed"].shape == (NUM_E, LAT, MID // 2)
  assert buffers["experts"]["w2_scale"].shape == (NUM_E, LAT, MID // 32)
  packed_graphdef, _, _ = nnx.split(moe(True, expert_format="mxfp4"), nnx.Param, ...)
  packed = nnx.merge(packed_graphdef, params, buffers)
  for name in lm.EXPERT_WEIGHTS:
    np.testing.assert_array_equal(
        mx.unpack_k3(packed.experts[f"{name}_packed"][...], packed.experts[f"{name}_scale"][...]),
        jnp.swapaxes(layer.expert_weight(name), 1, 2))
  (y, aux), (y_packed, aux_packed) = forward(layer, x), forward(packed, x)
  np.testing.assert_allclose(y_packed, y, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(aux_packed["loads"], aux["loads"])


def test_packed_k3_tiny_equals_qat_forward():
  """k3_tiny (fp32) with expert_format="mxfp4", its state packed from a QAT model's
  (`mx.pack_experts`), gives the QAT model's logits: the routed experts multiply the same
  fp32 values (unpacked MXFP4 = fake-quantized weights) and everything else is shared. The
  tolerance, 1e-5 relative, is fp32 rounding of a different product order; it is far below
  the gap to the unquantized model's logits (checked)."""
  cfg = config_lib.load(TINY, {"model.moe.qat": True})
  model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  _, params, buffers = nnx.split(model, nnx.Param, ...)
  params, buffers = mx.pack_experts(nnx.to_pure_dict(params), nnx.to_pure_dict(buffers))
  cfg_packed = config_lib.load(TINY, {"model.moe.qat": True, "model.moe.expert_format": "mxfp4"})
  abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg_packed.model, rngs=nnx.Rngs(0)))
  packed = nnx.merge(nnx.split(abstract, nnx.Param, ...)[0], params, buffers)
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, 258, size=(2, 24)), jnp.int32)
  run = nnx.jit(lambda m, t: m(t)[0])
  logits, logits_packed = run(model, tokens), run(packed, tokens)
  np.testing.assert_allclose(logits_packed, logits, rtol=1e-5, atol=1e-5)
  unquantized = K3ForCausalLM(config_lib.load(TINY).model, rngs=nnx.Rngs(0))
  assert np.abs(np.asarray(run(unquantized, tokens)) - np.asarray(logits)).max() > 1e-3


def test_training_refuses_packed_experts():
  cfg = config_lib.load(TINY, {"model.moe.expert_format": "mxfp4"})
  with pytest.raises(config_lib.ConfigError, match="model.moe.expert_format"):
    train.init(cfg, 0)
