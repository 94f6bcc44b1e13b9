"""Tests for k3jax.muon: Per-Head Muon ([TR] §2.5), Moonlight scaling, QK-Clip."""
import os
import subprocess
import sys
import textwrap

import k3jax  # noqa: F401  (flax config)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax import muon
from mesh_testing import cpu_env

D_MODEL, H, D, E, L, M, V = 16, 4, 8, 3, 12, 6, 20
QR, KR, DN, DR, DV, I, W = 12, 10, 4, 2, 4, 24, 4
NS = (3.4445, -4.7750, 2.0315)


def _tree():
  """Every parameter kind of the K3 model, with small shapes (all zeros)."""
  d, hd = D_MODEL, H * D
  z = lambda *s: jnp.zeros(s, jnp.float32)
  kda = {
      "q_proj": {"kernel": z(d, H, D)}, "k_proj": {"kernel": z(d, H, D)},
      "v_proj": {"kernel": z(d, H, D)},
      "q_conv1d": {"kernel": z(W, hd)}, "k_conv1d": {"kernel": z(W, hd)},
      "v_conv1d": {"kernel": z(W, hd)},
      "A_log": z(H), "dt_bias": z(hd), "f_a_proj": {"kernel": z(d, D)},
      "f_b_proj": {"kernel": z(D, H, D)}, "b_proj": {"kernel": z(d, H)},
      "g_a_proj": {"kernel": z(d, D)}, "g_b_proj": {"kernel": z(D, H, D)},
      "o_norm": {"scale": z(D)}, "o_proj": {"kernel": z(H, D, d)},
  }
  mla = {
      "q_a_proj": {"kernel": z(d, QR)}, "q_a_layernorm": {"scale": z(QR)},
      "q_b_proj": {"kernel": z(QR, H, DN + DR)},
      "kv_a_proj_with_mqa": {"kernel": z(d, KR + DR)},
      "kv_a_layernorm": {"scale": z(KR)},
      "kv_b_proj": {"kernel": z(KR, H, DN + DV)},
      "g_proj": {"kernel": z(d, H, DV)}, "o_proj": {"kernel": z(H, DV, d)},
  }
  mla_no_lora = dict(mla, q_proj={"kernel": z(d, H, DN + DR)})
  del mla_no_lora["q_a_proj"], mla_no_lora["q_a_layernorm"]
  del mla_no_lora["q_b_proj"]
  moe = {
      "gate": {"kernel": z(d, E), "e_score_correction_bias": z(E)},
      "routed_expert_down_proj": {"kernel": z(d, L)},
      "experts": {"w1": z(E, L, M), "w3": z(E, L, M), "w2": z(E, M, L)},
      "routed_expert_norm": {"scale": z(L)},
      "routed_expert_up_proj": {"kernel": z(L, d)},
      "shared_experts": {"gate_proj": {"kernel": z(d, I)},
                         "up_proj": {"kernel": z(d, I)},
                         "down_proj": {"kernel": z(I, d)}},
  }
  dense = {"gate_proj": {"kernel": z(d, I)}, "up_proj": {"kernel": z(d, I)},
           "down_proj": {"kernel": z(I, d)}}

  def layer(attn, ffn_name, ffn):
    return {"input_layernorm": {"scale": z(d)},
            "post_attention_layernorm": {"scale": z(d)},
            "self_attention_res_norm": {"scale": z(d)},
            "mlp_res_norm": {"scale": z(d)},
            "self_attention_res_proj": {"kernel": z(d)},
            "mlp_res_proj": {"kernel": z(d)},
            "self_attn": attn, ffn_name: ffn}
  return {
      "embed_tokens": {"embedding": z(V, d)}, "lm_head": {"kernel": z(d, V)},
      "norm": {"scale": z(d)}, "output_attn_res_norm": {"scale": z(d)},
      "output_attn_res_proj": {"kernel": z(d)},
      "layers": {0: layer(kda, "mlp", dense),
                 1: layer(mla, "block_sparse_moe", moe),
                 2: layer(dict(kda, g_proj={"kernel": z(d, H, D)}),
                          "block_sparse_moe", moe),
                 3: layer(mla_no_lora, "block_sparse_moe", moe)},
      "mtp": {"eh_proj": {"kernel": z(2 * d, d)}, "enorm": {"scale": z(d)},
              "hnorm": {"scale": z(d)},
              "layers": {0: layer(mla, "block_sparse_moe", moe)}},
  }


def _leaves(tree):
  return {muon.path_str(p): x
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _get(tree, path):
  for k in path.split("."):
    tree = tree[int(k) if k.isdigit() else k]
  return tree


def _single(path, x):
  """A nested dict holding one leaf at dotted `path`."""
  out = x
  for k in reversed(path.split(".")):
    out = {int(k) if k.isdigit() else k: out}
  return out


def _merge(a, b):
  """Nested dicts a and b merged (b's leaves added)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
  return out


def _ns5_oracle(g):
  """fp64 NumPy Newton-Schulz (Jordan's recipe) of a 2-D matrix."""
  x = np.asarray(g, np.float64)
  t = x.shape[0] > x.shape[1]
  x = x.T if t else x
  x = x / (np.linalg.norm(x) + 1e-8)
  a, b, c = NS
  for _ in range(5):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if t else x


def _first_update(path, g, mode="per_head"):
  """Step-1 update of one leaf with lr 1 and no decay (so U = scale * NS(G))."""
  tx = muon.per_head_muon(1.0, weight_decay=0.0, mode=mode)
  p = _single(path, jnp.zeros_like(g))
  u, _ = jax.jit(tx.update)(_single(path, g), tx.init(p), p)
  return np.asarray(_get(u, path))


def _rms(x):
  return float(np.sqrt(np.mean(np.square(x))))


def test_table_treatments_both_modes():
  params = _tree()
  leaves = _leaves(params)
  expect = {
      "layers.0.self_attn.q_proj.kernel": (muon.MUON_PER_HEAD, (0, 2)),
      "layers.1.self_attn.q_b_proj.kernel": (muon.MUON_PER_HEAD, (0, 2)),
      "layers.1.self_attn.kv_b_proj.kernel": (muon.MUON_PER_HEAD, (0, 2)),
      "layers.3.self_attn.q_proj.kernel": (muon.MUON_PER_HEAD, (0, 2)),
      "layers.1.block_sparse_moe.experts.w2": (muon.MUON_PER_EXPERT, (1, 2)),
      "layers.2.self_attn.g_proj.kernel": (muon.MUON_WHOLE, (0, (1, 2))),
      "layers.0.self_attn.f_b_proj.kernel": (muon.MUON_WHOLE, (0, (1, 2))),
      "layers.0.self_attn.o_proj.kernel": (muon.MUON_WHOLE, ((0, 1), 2)),
      "layers.1.block_sparse_moe.gate.kernel": (muon.MUON_WHOLE, (0, 1)),
      "layers.0.self_attn.b_proj.kernel": (muon.MUON_WHOLE, (0, 1)),
      "mtp.eh_proj.kernel": (muon.MUON_WHOLE, (0, 1)),
      "layers.0.mlp.down_proj.kernel": (muon.MUON_WHOLE, (0, 1)),
      "embed_tokens.embedding": (muon.ADAMW, None),
      "lm_head.kernel": (muon.ADAMW, None),
      "layers.0.self_attn.q_conv1d.kernel": (muon.ADAMW, None),
      "layers.0.self_attn.A_log": (muon.ADAMW_NO_DECAY, None),
      "layers.0.self_attn.dt_bias": (muon.ADAMW_NO_DECAY, None),
      "layers.0.self_attn.o_norm.scale": (muon.ADAMW_NO_DECAY, None),
      "layers.1.mlp_res_proj.kernel": (muon.ADAMW_NO_DECAY, None),
      "output_attn_res_proj.kernel": (muon.ADAMW_NO_DECAY, None),
      "layers.1.block_sparse_moe.gate.e_score_correction_bias":
          (muon.FROZEN, None),
  }
  for path, (treatment, dims) in expect.items():
    t = muon.resolve(path, leaves[path].shape)
    assert t.treatment == treatment, path
    assert (None if t.dims is None else tuple(t.dims)) == dims, path
  dims_tree = {muon.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(
      muon.muon_dimension_numbers(params, mode="whole"),
      is_leaf=lambda x: isinstance(x, muon.DimNums))}
  assert tuple(dims_tree["layers.0.self_attn.q_proj.kernel"]) == (0, (1, 2))
  assert tuple(dims_tree["layers.1.block_sparse_moe.experts.w1"]) == (1, 2)
  assert "embed_tokens.embedding" not in dims_tree  # None leaf: AdamW
  assert muon.resolve("vision.blocks.0.attn.qkv.kernel", (8, 24)).dims == (
      muon.DimNums(0, 1))
  assert muon.path_str((jax.tree_util.DictKey("norm"),
                        jax.tree_util.DictKey("scale"),
                        jax.tree_util.GetAttrKey("value"))) == "norm.scale"


def test_format_table_lists_every_param_once():
  params = _tree()
  rows = muon.table_rows(params)
  listed = [p for r in rows for p in r.paths]
  assert sorted(listed) == sorted(_leaves(params))
  assert len(set(listed)) == len(listed)
  for r in rows:
    assert all(tuple(_leaves(params)[p].shape) == r.shape for p in r.paths)
  text = muon.format_table(params)
  lines = text.splitlines()
  assert len(lines) == len(rows) + 1
  assert f"{len(listed)} params" in lines[0]
  assert "layers.*.self_attn.q_b_proj.kernel [1]" in text
  q_line = [ln for ln in lines if "layers.*.self_attn.q_proj.kernel [0,2]" in ln]
  assert len(q_line) == 1 and "4x[16,8] *0.8 " in q_line[0], q_line
  assert "mtp.layers.*.block_sparse_moe.experts.w1 [0]" in text


def test_per_head_blocks_are_orthogonalised_and_scaled_per_block():
  g = jax.random.normal(jax.random.key(0), (D_MODEL, H, D))
  u = _first_update("layers.0.self_attn.q_proj.kernel", g)
  scale = 0.2 * np.sqrt(max(D_MODEL, D))  # per block A x B = d x D, not d x HD
  for h in range(H):
    sv = np.linalg.svd(-u[:, h, :] / scale, compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
    assert sv.max() / sv.min() < 1.7, sv
    np.testing.assert_allclose(-u[:, h, :], scale * _ns5_oracle(g[:, h, :]),
                               rtol=2e-4, atol=2e-5)
  ge = jax.random.normal(jax.random.key(1), (E, L, M))
  ue = _first_update("layers.1.block_sparse_moe.experts.w1", ge)
  for e in range(E):
    np.testing.assert_allclose(
        -ue[e], 0.2 * np.sqrt(max(L, M)) * _ns5_oracle(ge[e]),
        rtol=2e-4, atol=2e-5)
  go = jax.random.normal(jax.random.key(2), (H, D, D_MODEL))
  uo = _first_update("layers.0.self_attn.o_proj.kernel", go)
  want = 0.2 * np.sqrt(H * D) * _ns5_oracle(go.reshape(H * D, D_MODEL))
  np.testing.assert_allclose(-uo.reshape(H * D, D_MODEL), want, rtol=2e-4,
                             atol=2e-5)


# bf16: the rounding of five iterations (6% relative on these blocks).
@pytest.mark.parametrize("ns_dtype,fold,stack,tol", [
    ("float32", False, True, 2e-4), ("bfloat16", False, True, 0.1),
    ("float32", True, True, 2e-4), ("bfloat16", True, True, 0.1),
    ("float32", False, False, 2e-4)])
def test_grouped_blocks_match_the_per_matrix_oracle(ns_dtype, fold, stack, tol):
  """Equal blocks of several leaves (two whole matrices, one of them transposed, per-head
  Q/K/V and experts) are iterated as one batch, plain or folded (`ns_fold`), or each leaf's
  blocks alone (`ns_stack=False`); each block still equals NS5 of itself."""
  rng = np.random.default_rng(7)
  shapes = {"layers.0.mlp.gate_proj.kernel": (D_MODEL, 2 * D_MODEL),
            "layers.0.mlp.down_proj.kernel": (2 * D_MODEL, D_MODEL),
            "layers.0.self_attn.q_proj.kernel": (D_MODEL, H, D),
            "layers.0.self_attn.k_proj.kernel": (D_MODEL, H, D),
            "layers.1.block_sparse_moe.experts.w1": (E, L, M)}
  grads = {}
  for path, shape in shapes.items():
    grads = _merge(grads, _single(path, jnp.asarray(rng.standard_normal(shape), jnp.float32)))
  params = jax.tree.map(jnp.zeros_like, grads)
  tx = muon.per_head_muon(1.0, weight_decay=0.0, ns_dtype=ns_dtype, ns_fold=fold,
                          ns_stack=stack)
  updates, _ = tx.update(grads, tx.init(params), params)
  for path, shape in shapes.items():
    g, u = np.asarray(_get(grads, path)), -np.asarray(_get(updates, path))
    if len(shape) == 2:
      pairs = [(g, u)]
    elif "experts" in path:
      pairs = [(g[e], u[e]) for e in range(shape[0])]
    else:
      pairs = [(g[:, h], u[:, h]) for h in range(shape[1])]
    for gb, ub in pairs:
      want = 0.2 * np.sqrt(max(gb.shape)) * _ns5_oracle(gb)
      err = np.linalg.norm(ub - want) / np.linalg.norm(want)
      assert err < tol, (path, err)


def test_leaves_iterated_alone_equal_the_grouped_iteration():
  """`orthogonalize(stack=False)` (each leaf's blocks a batch of their own) gives each block the
  grouped iteration's result: the blocks are independent, only the batching differs."""
  rng = np.random.default_rng(11)
  shapes = {"layers.0.block_sparse_moe.experts.w1": (E, L, M),
            "layers.1.block_sparse_moe.experts.w1": (E, L, M),
            "layers.0.self_attn.q_proj.kernel": (D_MODEL, H, D)}
  tree = {}
  for path, shape in shapes.items():
    tree = _merge(tree, _single(path, jnp.asarray(rng.standard_normal(shape), jnp.float32)))
  treatments = jax.tree_util.tree_map_with_path(muon._resolver("per_head", None), tree)
  run = lambda stack: muon.orthogonalize(tree, treatments, coeffs=(3.4445, -4.7750, 2.0315),
                                         steps=5, stack=stack)
  grouped, alone = run(True), run(False)
  jaxpr = lambda stack: str(jax.make_jaxpr(lambda: run(stack))())
  assert " stack[" in jaxpr(True) and " stack[" not in jaxpr(False)
  for path in shapes:
    np.testing.assert_allclose(_get(alone, path), _get(grouped, path), rtol=1e-5, atol=1e-6)
  assert not np.allclose(_get(grouped, "layers.0.block_sparse_moe.experts.w1"),
                         _get(tree, "layers.0.block_sparse_moe.experts.w1"))


def test_unknown_ns_dtype_is_named():
  with pytest.raises(ValueError, match="ns_dtype"):
    muon.per_head_muon(1.0, ns_dtype="float16")


def test_small_gradient_head_per_head_vs_whole():
  g = jax.random.normal(jax.random.key(3), (D_MODEL, H, D))
  g = g.at[:, 1, :].multiply(0.01)
  path = "layers.0.self_attn.k_proj.kernel"
  per_head = _first_update(path, g, "per_head")
  whole = _first_update(path, g, "whole")
  rms_ph = [_rms(per_head[:, h]) for h in range(H)]
  rms_wh = [_rms(whole[:, h]) for h in range(H)]
  others = [h for h in range(H) if h != 1]
  assert rms_ph[1] > 0.9 * min(rms_ph[h] for h in others), rms_ph
  assert rms_wh[1] < 0.1 * min(rms_wh[h] for h in others), rms_wh


def test_one_head_matches_optax_muon_2d():
  path = "layers.1.self_attn.kv_b_proj.kernel"
  w0 = jax.random.normal(jax.random.key(4), (KR, 1, DN + DV))
  tx = muon.per_head_muon(0.02)
  ref = optax.contrib.muon(0.02, weight_decay=0.1, consistent_rms=0.2)
  p, q = _single(path, w0), {"w": w0[:, 0, :]}
  sp, sq = tx.init(p), ref.init(q)
  tx_update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  for i in range(3):
    g = jax.random.normal(jax.random.key(10 + i), w0.shape)
    up, sp = tx_update(_single(path, g), sp, p)
    uq, sq = ref_update({"w": g[:, 0, :]}, sq, q)
    np.testing.assert_allclose(_get(up, path)[:, 0, :], uq["w"], rtol=1e-6,
                               atol=1e-7)
    p, q = optax.apply_updates(p, up), optax.apply_updates(q, uq)


@pytest.mark.parametrize("path,shape,decay", [
    ("embed_tokens.embedding", (V, D_MODEL), 0.1),
    ("layers.0.self_attn.q_conv1d.kernel", (W, H * D), 0.1),
    ("norm.scale", (D_MODEL,), 0.0),
    ("layers.0.self_attn.A_log", (H,), 0.0),
    ("layers.0.mlp_res_proj.kernel", (D_MODEL,), 0.0),
])
def test_adamw_leaves_match_optax_adamw(path, shape, decay):
  sched = muon.cosine_schedule(3e-3, 10)
  w0 = 1.0 + jax.random.normal(jax.random.key(5), shape)
  tx = muon.per_head_muon(sched)
  ref = optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=decay)
  p, q = _single(path, w0), w0
  sp, sq = tx.init(p), ref.init(q)
  for i in range(3):
    g = jax.random.normal(jax.random.key(20 + i), shape)
    up, sp = tx.update(_single(path, g), sp, p)
    uq, sq = ref.update(g, sq, q)
    np.testing.assert_array_equal(_get(up, path), uq)
    p, q = optax.apply_updates(p, up), optax.apply_updates(q, uq)


def test_full_tree_traces_under_jit():
  """Tracing the whole K3 tree under jit (no host sync); compiling is slow."""
  params = _tree()
  tx = muon.per_head_muon(muon.cosine_schedule(1e-2, 100),
                          params_for_dims=params)
  state = tx.init(params)
  updates, new_state = jax.eval_shape(jax.jit(tx.update), params, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.shape == p.shape and u.dtype == p.dtype
  bad = dict(params, lm_head={"kernel": jnp.zeros((D_MODEL, V + 1))})
  with pytest.raises(ValueError, match="shape"):
    jax.eval_shape(tx.update, bad, state, bad)


def test_frozen_router_bias_gets_no_update():
  moe = {"gate": {"kernel": jnp.ones((D_MODEL, E)),
                  "e_score_correction_bias": jnp.ones(E)},
         "routed_expert_norm": {"scale": jnp.ones(L)}}
  params = {"layers": {1: {"block_sparse_moe": moe}}}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  tx = muon.per_head_muon(1e-2)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  u = updates["layers"][1]["block_sparse_moe"]
  np.testing.assert_array_equal(u["gate"]["e_score_correction_bias"], 0.0)
  assert np.all(u["gate"]["kernel"] != 0)
  assert np.all(u["routed_expert_norm"]["scale"] != 0)


def test_nnx_state_paths():
  """An nnx.State (leaves under `.value`) resolves like the pure dict."""
  from flax import nnx

  class Attn(nnx.Module):
    def __init__(self):
      self.q_proj = nnx.Dict(kernel=nnx.Param(jnp.ones((D_MODEL, H, D))))
      self.o_norm = nnx.Dict(scale=nnx.Param(jnp.ones(D)))

  _, state = nnx.split(Attn(), nnx.Param)
  g = jax.tree.map(lambda x: x * jnp.arange(x.size).reshape(x.shape), state)
  tx = muon.per_head_muon(1.0, weight_decay=0.0)
  u, _ = jax.jit(tx.update)(g, tx.init(state), state)
  gq = g["q_proj"]["kernel"][...]
  want = _first_update("q_proj.kernel", gq)
  np.testing.assert_allclose(u["q_proj"]["kernel"][...], want, rtol=1e-6)
  assert [r.treatment for r in muon.table_rows(state)] == [
      muon.ADAMW_NO_DECAY, muon.MUON_PER_HEAD]


@jax.jit
def _mla_logits(q_b, kv_b, c_q, c_kv, k_rope):
  """Per-head max logit of gated-NoPE MLA; c_q [T, qr], c_kv [T, kr], k_rope [T, dr]."""
  q = jnp.einsum("tr,rhx->thx", c_q, q_b)
  kv = jnp.einsum("tr,rhx->thx", c_kv, kv_b)
  k = jnp.concatenate(
      [kv[..., :DN], jnp.broadcast_to(k_rope[:, None], (k_rope.shape[0], H, DR))],
      axis=-1)
  s = jnp.einsum("thx,shx->hts", q, k) * (DN + DR) ** -0.5
  return s.max(axis=(1, 2)), kv[..., DN:]


def test_qk_clip_bounds_the_logits():
  tau = 5.0
  ks = jax.random.split(jax.random.key(6), 6)
  c_q = jax.random.normal(ks[0], (7, QR))
  c_kv = jax.random.normal(ks[1], (7, KR))
  k_rope = jax.random.normal(ks[2], (7, DR))
  q_b = 0.2 * jax.random.normal(ks[3], (QR, H, DN + DR))
  kv_b = 0.2 * jax.random.normal(ks[4], (KR, H, DN + DV))
  s0, _ = _mla_logits(q_b, kv_b, c_q, c_kv, k_rope)
  assert float(s0.max()) < tau
  q_b = q_b.at[:, 2].multiply(jnp.sqrt(10 * tau / s0[2]))  # head 2: 10 tau
  kv_b = kv_b.at[:, 2, :DN].multiply(jnp.sqrt(10 * tau / s0[2]))
  q_b = q_b.at[:, 2, DN:].multiply(jnp.sqrt(10 * tau / s0[2]))
  s1, v1 = _mla_logits(q_b, kv_b, c_q, c_kv, k_rope)
  np.testing.assert_allclose(s1[2], 10 * tau, rtol=1e-5)
  kv_a = jax.random.normal(ks[5], (D_MODEL, KR + DR))
  params = {"layers": {1: {"self_attn": {
      "q_b_proj": {"kernel": q_b}, "kv_b_proj": {"kernel": kv_b},
      "kv_a_proj_with_mqa": {"kernel": kv_a}}}}}
  clip = jax.jit(lambda p, m: muon.qk_clip(
      p, m, tau=tau, qk_nope_head_dim=DN, qk_rope_head_dim=DR))
  out = clip(params, {"layers.1.self_attn": s1})
  attn = out["layers"][1]["self_attn"]
  s2, v2 = _mla_logits(attn["q_b_proj"]["kernel"], attn["kv_b_proj"]["kernel"],
                       c_q, c_kv, k_rope)
  assert float(s2[2]) <= tau * (1 + 1e-4)
  np.testing.assert_allclose(s2[2], tau, rtol=1e-4)
  others = [h for h in range(H) if h != 2]
  np.testing.assert_array_equal(s2[jnp.array(others)], s1[jnp.array(others)])
  np.testing.assert_array_equal(v2, v1)
  np.testing.assert_array_equal(attn["kv_a_proj_with_mqa"]["kernel"], kv_a)
  np.testing.assert_array_equal(attn["q_b_proj"]["kernel"][:, others],
                                q_b[:, others])


@pytest.mark.parametrize("peak,steps,warmup_frac,final_frac", [
    (1.0, 1000, 0.01, 0.1), (3e-3, 2, 0.01, 0.1), (0.5, 17, 0.3, 0.0), (0.0, 10, 0.01, 0.1)])
def test_cosine_schedule_is_optax_warmup_cosine(peak, steps, warmup_frac, final_frac):
  """`cosine_lr` against optax's schedule (the oracle), with constant and with traced
  arguments, past the last step too."""
  args = muon.cosine_schedule_args(peak, steps, warmup_frac, final_frac)
  want = optax.warmup_cosine_decay_schedule(0.0, peak, args["warmup_steps"], steps,
                                            final_frac * peak)
  counts = np.arange(steps + 3)
  expected = np.array([want(c) for c in counts])
  s = muon.cosine_schedule(peak, steps, warmup_frac, final_frac)
  np.testing.assert_allclose([s(c) for c in counts], expected, rtol=1e-6, atol=1e-12)
  traced = jax.jit(jax.vmap(muon.cosine_lr, (0, None)))(
      counts, {k: np.float32(v) for k, v in args.items()})
  np.testing.assert_allclose(traced, expected, rtol=1e-6, atol=1e-12)
  assert float(s(0)) == 0.0


def test_bad_inputs():
  with pytest.raises(ValueError, match="mode"):
    muon.per_head_muon(1e-3, mode="heads")
  with pytest.raises(ValueError, match="mode"):
    muon.muon_dimension_numbers(_tree(), mode="x")
  with pytest.raises(ValueError, match="warmup_frac"):
    muon.cosine_schedule(1.0, 100, warmup_frac=1.0)
  with pytest.raises(ValueError, match="exceed the 1 warmup"):
    muon.cosine_schedule(1.0, 1)
  params = {"a": {"q_b_proj": {"kernel": jnp.ones((QR, H, DN + DR))},
                  "kv_b_proj": {"kernel": jnp.ones((KR, H, DN + DV))}}}
  kw = dict(qk_nope_head_dim=DN, qk_rope_head_dim=DR)
  with pytest.raises(ValueError, match="tau"):
    muon.qk_clip(params, {"a": jnp.ones(H)}, tau=0.0, **kw)
  with pytest.raises(ValueError, match="lack"):
    muon.qk_clip(params, {"b": jnp.ones(H)}, tau=1.0, **kw)
  with pytest.raises(ValueError, match="shape"):
    muon.qk_clip(params, {"a": jnp.ones(H + 1)}, tau=1.0, **kw)
  with pytest.raises(ValueError, match="qk_rope_head_dim"):
    muon.qk_clip(params, {"a": jnp.ones(H)}, tau=1.0, qk_nope_head_dim=DN,
                 qk_rope_head_dim=DR + 1)


_SHARDED = textwrap.dedent("""
  import re
  import k3jax, jax, jax.numpy as jnp, numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from k3jax import muon
  mesh = Mesh(np.array(jax.devices()), ("heads",))
  def step(spec, mode):
    sh = NamedSharding(mesh, spec)
    g = jax.random.normal(jax.random.key(0), (16, 8, 4))
    p = {"attn": {"q_proj": {"kernel": jax.device_put(jnp.ones_like(g), sh)}}}
    gs = {"attn": {"q_proj": {"kernel": jax.device_put(g, sh)}}}
    tx = muon.per_head_muon(0.1, mode=mode)
    st = tx.init(p)
    f = jax.jit(tx.update)
    hlo = f.lower(gs, st, p).compile().as_text()
    colls = set(re.findall(r"all-gather|all-reduce|all-to-all|reduce-scatter"
                           r"|collective-permute", hlo))
    u, st2 = f(gs, st, p)
    host = {"attn": {"q_proj": {"kernel": jnp.ones_like(g)}}}
    uh, _ = tx.update({"attn": {"q_proj": {"kernel": g}}}, tx.init(host), host)
    np.testing.assert_allclose(u["attn"]["q_proj"]["kernel"],
                               uh["attn"]["q_proj"]["kernel"], rtol=1e-5,
                               atol=1e-6)
    specs = {x.sharding.spec for x in jax.tree.leaves((u, st, st2))
             if x.ndim == 3}
    return sorted(colls), specs
  colls, specs = step(P(None, "heads", None), "per_head")
  assert colls == [] and specs == {P(None, "heads", None)}, (colls, specs)
  colls, specs = step(P(None, "heads", None), "whole")
  assert colls and specs == {P(None, "heads", None)}, (colls, specs)
  colls, _ = step(P("heads", None, None), "per_head")
  assert colls, colls
  print("OK")
""")


def test_sharded_heads_need_no_collectives():
  """4 host devices: heads sharded -> per-head NS has no collectives."""
  env = cpu_env(4)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  r = subprocess.run([sys.executable, "-c", _SHARDED], env=env, cwd=root,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 0.1)])
def test_folded_newton_schulz_matches_the_oracle(dtype, tol):
  """`newton_schulz(fold=True)` (the scalars in the products' scales, X = s Y) iterates the
  same map: each block equals the fp64 NS5 oracle (bf16: five iterations' rounding), wide and
  square blocks."""
  rng = np.random.default_rng(3)
  for shape in ((6, 24, 40), (4, 32, 32)):
    g = rng.standard_normal(shape)
    got = np.asarray(muon.newton_schulz(jnp.asarray(g, jnp.float32), NS, 5, dtype=dtype,
                                        fold=True))
    for gb, ub in zip(g, got):
      want = _ns5_oracle(gb)
      assert np.linalg.norm(ub - want) / np.linalg.norm(want) < tol, shape


_SPREAD = textwrap.dedent("""
  import json, re
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from k3jax import muon, sharding
  mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 2, 1), sharding.MESH_AXES)
  rng = np.random.default_rng(0)
  specs = {"w1": P("expert", "data", None), "w2": P("expert", None, "data"),
           "q": P("data", None, None)}
  shapes = {"w1": (8, 32, 96), "w2": (8, 96, 32), "q": (32, 4, 8)}
  def tree(make):
    return {"layers": {str(i): {
        "block_sparse_moe": {"experts": {n: make(n) for n in ("w1", "w2")}},
        "self_attn": {"q_proj": {"kernel": make("q")}}} for i in range(3)}}
  host = tree(lambda n: jnp.asarray(rng.standard_normal(shapes[n]), jnp.float32))
  put = lambda t: jax.tree.map_with_path(lambda p, x: jax.device_put(
      x, NamedSharding(mesh, specs["q" if "q_proj" in jax.tree_util.keystr(p) else
                                  jax.tree_util.keystr(p)[-4:-2]])), t)
  tx = muon.per_head_muon(0.1, ns_dtype="float32")
  want, _ = jax.jit(tx.update)(host, tx.init(host), host)
  errs = []
  for chunk_bytes in (12288, muon.SPREAD_CHUNK_BYTES):  # experts: 3 chunks of 1 block; 1
    muon.SPREAD_CHUNK_BYTES = chunk_bytes
    with jax.set_mesh(mesh):
      dev = put(host)
      f = jax.jit(tx.update)
      hlo = f.lower(dev, tx.init(dev), dev).compile().as_text()
      got, _ = f(dev, tx.init(dev), dev)
    errs.append(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got),
                                                                   jax.tree.leaves(want))))
  err = max(errs)
  gathers = [int(np.prod([int(d) for d in s.split(",") if d])) for s in re.findall(
      r"= f32\\[([0-9,]*)\\]\\{[^}]*\\} all-gather\\(", hlo)]
  print("RESULT" + json.dumps(dict(err=err, all_to_all="all-to-all" in hlo,
                                   largest_gather=max(gathers, default=0))))
""")


def test_fsdp_split_blocks_are_spread_over_the_devices():
  """8 host devices, data 4 x expert 2, expert and Q blocks split over `data` (FSDP): the
  update equals the one-device update, iterated at once and in chunks, and the group's blocks
  reach the devices whole by an all-to-all (no device gathers a whole stacked group: 3 layers x
  8 experts x 32 x 96)."""
  from mesh_testing import run_on_devices
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = run_on_devices(f"import sys; sys.path.insert(0, {root!r})\n" + _SPREAD, devices=8)
  assert out["err"] < 1e-5, out
  assert out["all_to_all"], out
  assert out["largest_gather"] < 3 * 8 * 32 * 96 // 4, out
