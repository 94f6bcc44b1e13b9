"""The K3 decoder against direct implementations of its formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import attn_res, config, kda, situ
from k3jax.latent_moe import LatentMoE
from k3jax.model import K3ForCausalLM

TINY = "experiments/configs/k3_tiny.py"


def _tiny(**overrides):
  """6 layers (KDA-dense, MLA, then 2 units of KDA + MLA scanned), AttnRes blocks of 2."""
  base = {"model.num_layers": 6, "model.full_attn_layers": (2, 4, 6),
          "model.attn_res_block_size": 2}
  base.update(overrides)
  return config.load(TINY, base)


@pytest.fixture(scope="module")
def tiny_model():
  return K3ForCausalLM(_tiny().model, rngs=nnx.Rngs(0))


def test_situ_gate_up_vjp_matches_fp64_autodiff():
  """situ_gate_up's written-out VJP against autodiff of the formula in fp64 (fp32 and bf16
  inputs); its value equals situ's on the two halves."""
  def formula(g, u, b1, b2):
    return b1 * jnp.tanh(g / b1) * jax.nn.sigmoid(g) * (b2 * jnp.tanh(u / b2))

  kg, ku, kd = jax.random.split(jax.random.key(0), 3)
  g = jax.random.normal(kg, (64, 48), jnp.float32) * 6
  u = jax.random.normal(ku, (64, 48), jnp.float32) * 40
  d = jax.random.normal(kd, (64, 48), jnp.float32)
  with jax.enable_x64():
    f64 = lambda a: np.asarray(a, np.float64)
    _, vjp = jax.vjp(lambda a, b: formula(a, b, 4.0, 25.0), f64(g), f64(u))
    want = vjp(f64(d))
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
    gu = jnp.concatenate([g, u], axis=1).astype(dtype)
    out, vjp = jax.vjp(lambda a: situ.situ_gate_up(a, 4.0, 25.0), gu)
    np.testing.assert_array_equal(out, situ.situ(gu[:, :48], gu[:, 48:], 4.0, 25.0))
    (got,) = vjp(d.astype(dtype))
    assert got.dtype == dtype and got.shape == (64, 96)
    for part, ref in zip((got[:, :48], got[:, 48:]), want):
      np.testing.assert_allclose(np.asarray(part, np.float64), ref, rtol=tol,
                                 atol=tol * np.abs(ref).max())


def test_situ_is_bounded_and_swiglu_near_zero():
  g = jnp.linspace(-1e4, 1e4, 101)
  assert float(jnp.max(jnp.abs(situ.situ(g, g, 4.0, 25.0)))) <= 100.0
  small = jnp.linspace(-1e-2, 1e-2, 11)
  swiglu = jax.nn.silu(small) * small
  np.testing.assert_allclose(situ.situ(small, small, 4.0, 25.0), swiglu, rtol=1e-4, atol=1e-9)


def test_short_conv_matches_direct_sum_and_restarts_at_documents():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 9, 3)).astype(np.float32)
  w = rng.normal(size=(4, 3)).astype(np.float32)
  seg = np.array([[1] * 5 + [2] * 4, [1] * 9], np.int32)
  y, tail = kda.short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg))
  ref = np.zeros_like(x)
  for b in range(2):
    for t in range(9):
      for j in range(4):  # tap j reads x[t - j] with weight w[3 - j]
        if t - j >= 0 and seg[b, t - j] == seg[b, t]:
          ref[b, t] += x[b, t - j] * w[3 - j]
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(tail, x[:, -3:], rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, 3])
def test_short_conv_tail_ends_at_each_rows_length(t):
  """With lengths, row b's new tail is the W-1 inputs ending at its token lengths[b] - 1 (the
  cached ones where lengths[b] = 0); T = 1 (decode) takes its own select form."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, t, 5)).astype(np.float32)
  cache = rng.normal(size=(3, 3, 5)).astype(np.float32)
  w = rng.normal(size=(4, 5)).astype(np.float32)
  lengths = np.array([0, t, max(t - 1, 1)], np.int32)
  y, tail = kda.short_conv(jnp.asarray(x), jnp.asarray(w), cache=jnp.asarray(cache),
                           lengths=jnp.asarray(lengths))
  xp = np.concatenate([cache, x], axis=1)
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(tail[b], xp[b, n:n + 3])
  y_all, tail_all = kda.short_conv(jnp.asarray(x), jnp.asarray(w), cache=jnp.asarray(cache))
  np.testing.assert_array_equal(y, y_all)
  np.testing.assert_array_equal(tail_all, xp[:, t:])


@pytest.mark.parametrize("kind", ["lower_bound", "softplus"])
def test_forget_gate_forms(kind):
  f = jnp.linspace(-30, 30, 64).reshape(1, 1, 2, 32)
  a_log = jnp.array([0.0, 1.0])
  dt = jnp.zeros((2, 32))
  g = kda.forget_gate(f, a_log, dt, kind, -5.0)
  a = jnp.exp(a_log)[:, None]
  if kind == "lower_bound":
    np.testing.assert_allclose(g, -5.0 * jax.nn.sigmoid(a * f), rtol=1e-6)
    assert float(g.min()) >= -5.0 and float(g.max()) <= 0.0
  else:
    np.testing.assert_allclose(g, -a * jax.nn.softplus(f), rtol=1e-6)


def test_attn_res_mix_matches_formula():
  rng = np.random.default_rng(1)
  v = [rng.normal(size=(2, 3, 8)).astype(np.float32) * s for s in (1.0, 10.0, 0.1)]
  q = rng.normal(size=8).astype(np.float32)
  gamma = rng.normal(size=8).astype(np.float32)
  out = attn_res.attn_res_mix([jnp.asarray(x) for x in v], jnp.asarray(q), jnp.asarray(gamma), 1e-5)
  for b in range(2):
    for t in range(3):
      keys = [x[b, t] / np.sqrt(np.mean(x[b, t] ** 2) + 1e-5) for x in v]
      s = np.array([np.dot(k, gamma * q) for k in keys])
      a = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
      np.testing.assert_allclose(out[b, t], sum(ai * x[b, t] for ai, x in zip(a, v)), rtol=1e-5)


def _attn_res_mix_fp64(sources, q, gamma, eps):
  """Eq. 9 written out in float64 numpy-style jnp (the oracle for the custom VJP's gradients)."""
  w = gamma * q
  s = jnp.stack([jnp.sum(v * w, -1) / jnp.sqrt(jnp.mean(v * v, -1) + eps) for v in sources])
  p = jax.nn.softmax(s, axis=0)
  return sum(p[i][..., None] * v for i, v in enumerate(sources))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attn_res_mix_gradients_match_fp64_autodiff(dtype):
  """The mix's custom VJP equals float64 autodiff of Eq. 9 for every source, the pseudo-query
  and the key-norm weight; cotangents come back in each input's dtype."""
  rng = np.random.default_rng(2)
  v = [rng.normal(size=(2, 5, 16)) * s for s in (1.0, 10.0, 0.1, 3.0)]
  q, gamma = rng.normal(size=16), rng.normal(size=16)
  cot = rng.normal(size=(2, 5, 16))
  args = ([jnp.asarray(x, dtype) for x in v], jnp.asarray(q, dtype), jnp.asarray(gamma, dtype))
  got = jax.grad(lambda s, q, g: jnp.sum(attn_res.attn_res_mix(s, q, g, 1e-5).astype(jnp.float32)
                                         * cot), argnums=(0, 1, 2))(*args)
  with jax.enable_x64(True):
    up = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in jax.tree.leaves(args)]
    want = jax.grad(lambda s, q, g: jnp.sum(_attn_res_mix_fp64(s, q, g, 1e-5) * cot),
                    argnums=(0, 1, 2))(up[:4], up[4], up[5])
    want = [np.asarray(x) for x in jax.tree.leaves(want)]
  tol = 1e-4 if dtype == jnp.float32 else 3e-2
  for g, w in zip(jax.tree.leaves(got), want):
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol,
                               atol=tol * np.abs(w).max())


def test_attn_res_mix_masked_gradients():
  """Gradients through the buffered mix equal the list form's; unused slots get zeros."""
  rng = np.random.default_rng(3)
  blocks = jnp.asarray(rng.normal(size=(4, 2, 3, 8)), jnp.float32)
  partial = jnp.asarray(rng.normal(size=(2, 3, 8)) * 5, jnp.float32)
  q, g = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(2))
  cot = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  count = 2
  got = jax.grad(lambda b, p, q, g: jnp.sum(attn_res.attn_res_mix_masked(
      b, jnp.int32(count), p, q, g, 1e-5) * cot), argnums=(0, 1, 2, 3))(blocks, partial, q, g)
  want = jax.grad(lambda b, p, q, g: jnp.sum(attn_res.attn_res_mix(
      list(b[:count]) + [p], q, g, 1e-5) * cot), argnums=(0, 1, 2, 3))(blocks, partial, q, g)
  np.testing.assert_array_equal(got[0][count:], 0.0)
  np.testing.assert_allclose(got[0][:count], want[0][:count], rtol=1e-6, atol=1e-6)
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_block_attn_res_wiring_matches_eq10(tiny_model):
  """Logits equal an independent implementation of Eq. 10 with explicit block sums."""
  model = tiny_model
  # Non-zero pseudo-queries so that the mixes are not uniform averages.
  for i, layer in enumerate(model.layers):
    for proj in (layer.self_attention_res_proj, layer.mlp_res_proj):
      proj["kernel"][...] = jax.random.normal(jax.random.key(i), proj["kernel"].shape)
  tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, 258)
  logits, _ = model(tokens)

  seg = jnp.ones((2, 12), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  s = model.block_size
  emb = model.embed(tokens)
  outputs = []  # f_j of every sublayer, in order, tagged with its block
  for index, layer in enumerate(model.layers):
    n = index // s
    done = [emb] + [sum(o for b, o in outputs if b == m) for m in range(n)]
    if index == 0:
      h = emb
    else:
      prev_n = (index - 1) // s
      prev_done = [emb] + [sum(o for b, o in outputs if b == m) for m in range(prev_n)]
      prev_partial = sum(o for b, o in outputs if b == prev_n)
      h = attn_res.mix(prev_done + [prev_partial], layer.self_attention_res_norm,
                       layer.self_attention_res_proj, layer.eps)
    y, _, _ = layer.token_mixer(h, seg, pos)
    outputs.append((n, y))
    partial = sum(o for b, o in outputs if b == n)
    h = attn_res.mix(done + [partial], layer.mlp_res_norm, layer.mlp_res_proj, layer.eps)
    y, _ = layer.ffn(h)
    outputs.append((n, y))
  last = (len(model.layers) - 1) // s
  done = [emb] + [sum(o for b, o in outputs if b == m) for m in range(last)]
  final = attn_res.mix(done + [sum(o for b, o in outputs if b == last)],
                       model.output_attn_res_norm, model.output_attn_res_proj, 1e-5)
  ref = model.logits(model.norm(final))
  np.testing.assert_allclose(logits, ref, rtol=2e-5, atol=5e-5)  # fp32 sum orders differ


@pytest.mark.parametrize("block", [2, 0])
def test_packed_documents_do_not_leak(block):
  model = K3ForCausalLM(_tiny(**{"model.attn_res_block_size": block}).model, rngs=nnx.Rngs(1))
  toks = jax.random.randint(jax.random.key(3), (1, 30), 0, 258)
  seg = jnp.array([[1] * 13 + [2] * 17], jnp.int32)
  pos = jnp.array([list(range(13)) + list(range(17))], jnp.int32)
  packed, _ = model(toks, seg, pos)
  first, _ = model(toks[:, :13])
  second, _ = model(toks[:, 13:])
  np.testing.assert_allclose(packed[:, :13], first, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(packed[:, 13:], second, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [2, 0])
def test_prefill_then_decode_equals_full_forward(block):
  """Dual cache: KDA state + conv tails, MLA latents with absorbed decoding. Tol 1e-4 (fp32)."""
  model = K3ForCausalLM(_tiny(**{"model.attn_res_block_size": block}).model, rngs=nnx.Rngs(2))
  toks = jax.random.randint(jax.random.key(4), (2, 20), 0, 258)
  full, _ = model(toks)
  cache = model.init_cache(2, 24)
  extend = nnx.jit(lambda m, tokens, cache: m.extend(tokens, cache))  # one compile per T
  outs = []
  logits, cache = extend(model, toks[:, :11], cache)
  outs.append(logits)
  for t in range(11, 20):
    logits, cache = extend(model, toks[:, t:t + 1], cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(cache["index"], [20, 20])
  # Cached calls run the layers unrolled: one cache per layer, scanned or not.
  assert len(cache["layers"]) == len(model.layers)
  assert [c["latent"].shape for c in cache["layers"] if "latent" in c] == [(2, 24, 16 + 8)] * 3
  # KDA: the state and one buffer of the q, k and v conv tails [B, W-1, 3, H K].
  kda_caches = [c for c in cache["layers"] if "state" in c]
  assert kda_caches and all(sorted(c) == ["conv", "state"] and c["conv"].shape == (2, 3, 3, 32)
                            for c in kda_caches)


def test_decode_with_gathered_or_all_experts_equals_sorted():
  """kernels.moe_decode_experts: the gathered and all-experts paths give the sorted path's
  logits (a prefill of 5 tokens x 4 rows, then decode steps of 4 tokens: "gathered" takes the
  steps, N*k <= E; "all", with k3_tiny's top-k raised to 4 of 8, the prefill and the steps,
  N*k >= 2E)."""
  toks = jax.random.randint(jax.random.key(9), (4, 8), 0, 258)
  extend = nnx.jit(lambda m, tokens, cache: m.extend(tokens, cache))
  for choice, top_k in (("gathered", 2), ("all", 4)):
    outs = []
    for decode in ("sorted", choice):
      cfg = _tiny(**{"kernels.moe_decode_experts": decode, "model.moe.num_experts_per_tok": top_k})
      model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(3), kernels=cfg.kernels)
      assert model.layers[1].block_sparse_moe.decode_experts == decode
      cache = model.init_cache(4, 8)
      logits, cache = extend(model, toks[:, :5], cache)
      steps = [logits]
      for t in range(5, 8):
        logits, cache = extend(model, toks[:, t:t + 1], cache)
        steps.append(logits)
      outs.append(jnp.concatenate(steps, 1))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5, err_msg=choice)


def test_prepare_decode_outside_a_trace_keeps_the_logits(monkeypatch):
  """`prepare_decode` called eagerly on a bf16 k3_tiny (its KDA layers' input projections
  concatenated, its MoE layers' five dense products merged into two, its MLA layers' three
  products of x into one and W_UK folded into the query's, which run) gives a cached decode
  step the unprepared model's logits to bf16 rounding (within two bf16 spacings, 2 x 2^-7, of
  the largest logit) and the same argmax."""
  merged = []
  real = LatentMoE._decode_inputs
  monkeypatch.setattr(LatentMoE, "_decode_inputs",
                      lambda *a: merged.append(1) or real(*a))
  cfg = _tiny(**{"model.dtype": "bfloat16", "model.param_dtype": "bfloat16"})
  toks = jax.random.randint(jax.random.key(4), (2, 6), 0, 258)
  extend = nnx.jit(lambda m, tokens, cache: m.extend(tokens, cache))
  outs = []
  for prepare in (False, True):
    model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(5), kernels=cfg.kernels)
    _, cache = extend(model, toks[:, :5], model.init_cache(2, 8))
    if prepare:
      model.prepare_decode()
      moe = model.layers[1].block_sparse_moe
      assert moe.prepared_decode_weights is not None
      assert all(layer.self_attn.prepared_decode_weights is not None
                 for layer in model.layers)
    outs.append(np.asarray(extend(model, toks[:, 5:6], cache)[0], np.float32))
    assert bool(merged) == prepare
  assert np.abs(outs[1] - outs[0]).max() <= 2 * 2 ** -7 * np.abs(outs[0]).max()
  np.testing.assert_array_equal(outs[1].argmax(-1), outs[0].argmax(-1))


def test_parameter_paths_follow_hf_names(tiny_model):
  flat = {".".join(str(k) for k in path) for path, _ in nnx.to_flat_state(nnx.state(tiny_model))}
  for name in ["embed_tokens.embedding", "lm_head.kernel", "norm.scale",
               "output_attn_res_proj.kernel", "layers.0.mlp.gate_proj.kernel",
               "layers.0.self_attn.q_conv1d.kernel", "layers.0.self_attn.A_log",
               "layers.0.self_attn.dt_bias", "layers.0.self_attn.f_b_proj.kernel",
               "layers.1.self_attn.q_b_proj.kernel", "layers.1.self_attn.kv_a_proj_with_mqa.kernel",
               "layers.1.block_sparse_moe.gate.e_score_correction_bias",
               "layers.1.block_sparse_moe.experts.w1", "layers.1.mlp_res_proj.kernel"]:
    assert name in flat, name


def test_decode_products_run_through_decode_matmul(monkeypatch):
  """A decode step's KDA input product and o_proj, a bf16 MoE's merged W_in / W_out and a bf16
  MLA layer's merged W_x and absorbed W_qb go through `pallas_kernels.decode_matmul` (whose
  tier a GPU run may switch)."""
  from pallas_kernels import decode_matmul
  calls = []
  real = decode_matmul.matmul
  monkeypatch.setattr(decode_matmul, "matmul",
                      lambda x, w, **kw: calls.append(w.shape) or real(x, w, **kw))
  cfg = _tiny(**{"model.dtype": "bfloat16"})
  model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  model.prepare_decode()
  cache = model.init_cache(2, 8)
  model.extend(jnp.ones((2, 1), jnp.int32), cache)
  m = cfg.model
  kda_layers = sum(layer.kind == "kda" for layer in model.layers)
  moe_layers = sum(layer.is_moe for layer in model.layers)
  mla = [layer.self_attn for layer in model.layers if layer.kind != "kda"]
  hk = m.kda.num_heads * m.kda.head_dim
  assert sum(s == (hk, m.hidden_size) for s in calls) == kda_layers        # o_proj
  assert sum(s[1] == m.hidden_size and s[0] != hk for s in calls) == moe_layers   # W_out
  w_x, w_qb = mla[0].decode_weights()
  for w in (w_x, w_qb):                                 # W_x and the absorbed query's W_qb
    assert mla and sum(s == w.shape for s in calls) == len(mla), calls
  assert len(calls) == 2 * kda_layers + 2 * moe_layers + 2 * len(mla), calls
