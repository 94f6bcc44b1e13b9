"""Context parallelism (report §5.2): KDA and MLA split over the `context` mesh axis equal the
single-device layers; the slice transitions and their combine equal the fp64 recurrence."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import context_parallel
from mesh_testing import run_on_devices
from pallas_kernels import attention as attention_op
from pallas_kernels.attention import reference as attention_reference
from pallas_kernels.attention import xla_blockwise
from pallas_kernels.kda import reference

# Documents straddling the rank boundaries of T = 32 over 4 ranks (slices of 8 tokens): row 0
# has a 2-token document (6, 7) that ends on a boundary and one (8..20) over ranks 1 and 2; row 1
# has a document over all four ranks and padding (id 0) at the end.
_SEGMENTS = """
seg = np.ones((2, 32), np.int32)
seg[0, 6:] = 2; seg[0, 8:] = 3; seg[0, 21:] = 4
seg[1, 26:] = 2; seg[1, 30:] = 0
"""

_LAYERS = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
import k3jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from k3jax.kda import KDA
from k3jax.mla import GatedMLA
""" + _SEGMENTS + r"""
seg = jnp.asarray(seg)
x = jax.random.normal(jax.random.key(1), (2, 32, 16))
layers = dict(
    kda=KDA(16, num_heads=2, head_dim=8, conv_size=4, gate="lower_bound", gate_lower_bound=-5.0,
            use_full_rank_gate=True, eps=1e-5, rngs=nnx.Rngs(0)),
    mla=GatedMLA(16, num_heads=2, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, use_output_gate=True, lora_norm_eps=1e-6,
                 rngs=nnx.Rngs(0)))
cot = jnp.cos(jnp.arange(2 * 32 * 16, dtype=jnp.float32)).reshape(2, 32, 16)
devices = np.array(jax.devices())
meshes = {"context4": Mesh(devices[:4], ("context",)),
          "data2_context4": Mesh(devices.reshape(2, 4), ("data", "context"))}
out = {}
for name, layer in layers.items():
  graph, params = nnx.split(layer)
  for ids in ((seg, None) if name == "kda" else (seg,)):
    def loss(params, x):
      kw = dict(positions=jnp.zeros_like(seg)) if name == "mla" else {}
      y, aux = nnx.merge(graph, params)(x, segment_ids=ids, **kw)
      return jnp.sum(y * cot), (y, aux if name == "mla" else jnp.zeros(()))
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, ref), ref_grads = fn(params, x)
    case = name + ("" if ids is not None else "_no_segment_ids")
    for mesh_name in (meshes if ids is not None else ["context4"]):
      mesh = meshes[mesh_name]
      spec = P("data", "context") if "data" in mesh.axis_names else P(None, "context")
      xs = jax.device_put(x, NamedSharding(mesh, spec))
      with jax.set_mesh(mesh):
        compiled = fn.lower(params, xs).compile()
      (_, got), grads = compiled(params, xs)
      errs = {"y": float(jnp.max(jnp.abs(got[0] - ref[0])) / jnp.max(jnp.abs(ref[0]))),
              "aux": float(jnp.max(jnp.abs(got[1] - ref[1])))}
      for (path, g_ref), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                                  jax.tree.leaves(grads)):
        errs["d" + jax.tree_util.keystr(path)] = float(
            jnp.max(jnp.abs(g - g_ref)) / jnp.max(jnp.abs(g_ref)))
      hlo = compiled.as_text()
      out[f"{case}/{mesh_name}"] = dict(
          errs=errs, all_to_all=hlo.count("all-to-all("),
          all_gathers=sorted(set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo))))
print("RESULT" + json.dumps(out))
"""

_TRAIN = r"""
import json, re
import jax, numpy as np
from k3jax import config, sharding, train
cfg = config.load("experiments/configs/k3_tiny.py", {
    "model.num_layers": 2, "model.full_attn_layers": (2,), "model.attn_res_block_size": 1,
    "mesh.data": 2, "mesh.context": 4, "train.seq_len": 32, "train.global_batch_size": 2})
""" + _SEGMENTS + r"""
toks = np.random.default_rng(0).integers(0, 258, (2, 33)).astype(np.int32)
pos = np.zeros_like(seg)
for t in range(1, 32):
  pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=seg, positions=pos,
             loss_mask=(seg > 0).astype(np.float32))
out = {}
for name in ("single", "data2_context4"):
  setup, state = train.init(cfg, 0)
  fn = jax.jit(train.make_train_step(setup))
  b = batch
  if name != "single":
    mesh = sharding.make_mesh(cfg.mesh)
    rules = cfg.mesh.logical_axis_rules
    sh = train.state_shardings(setup, state, mesh, rules)
    state = jax.device_put(state, sh)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh, rules)) for k, v in batch.items()}
    with jax.set_mesh(mesh):
      fn = jax.jit(train.make_train_step(setup), out_shardings=(sh, None)).lower(state, b).compile()
    ops = re.findall(r"(all-to-all|all-gather)\(.*op_name=\"([^\"]+)\"", fn.as_text())
    out["mixer_all_to_all"] = sum(op == "all-to-all" and "shard_map" in name for op, name in ops)
    out["mixer_all_gather"] = sum(op == "all-gather" and "shard_map" in name for op, name in ops)
  losses = []
  for _ in range(2):
    state, m = fn(state, b)
    losses.append(float(m["loss"]))
  out[name] = losses
print("RESULT" + json.dumps(out))
"""


def _run(script: str) -> dict:
  return run_on_devices(script)


def test_layers_on_context_meshes_match_single_device():
  """KDA and MLA on {context 4} and {data 2, context 4}: outputs, MLA's max logit and every
  parameter gradient equal the single-device layer. The ranks gather only KDA's slice maps
  [A | B] and MLA's latents, with the batch still split over `data`; nothing goes all-to-all."""
  out = _run(_LAYERS)
  assert len(out) == 5, out
  for case, r in out.items():
    bad = {k: e for k, e in r["errs"].items() if not e < 2e-5}
    assert not bad, (case, bad)
    assert r["all_to_all"] == 0, (case, r)
  # [R, B / data, H, K, K + V] maps of the KDA slices; [B / data, T, kr + dr] MLA latents.
  assert out["kda/context4"]["all_gathers"] == ["f32[4,2,2,8,16]"], out["kda/context4"]
  assert out["kda/data2_context4"]["all_gathers"] == ["f32[4,1,2,8,16]"], out
  assert "f32[1,32,12]" in out["mla/data2_context4"]["all_gathers"], out


def test_train_step_on_data_context_mesh_matches_single_device():
  """A reduced k3_tiny step (MTP included) on {data 2, context 4} gives the single-device
  losses; inside the token mixers' shard_maps the ranks all-gather and never go all-to-all."""
  out = _run(_TRAIN)
  assert out["mixer_all_to_all"] == 0 and out["mixer_all_gather"] > 0, out
  for a, b in zip(out["single"], out["data2_context4"], strict=True):
    assert abs(a - b) < 1e-4 * abs(a), out


def _transition_fp64(k, g, beta):
  """prod_t (I - beta_t k_t k_t^T) Diag(exp g_t) [B, H, K, K], in fp64 numpy (kda.md §1)."""
  b, t, h, dk = k.shape
  a = np.broadcast_to(np.eye(dk), (b, h, dk, dk)).copy()
  for i in range(t):
    kt = k[:, i]
    m = np.eye(dk) - beta[:, i, :, None, None] * kt[..., :, None] * kt[..., None, :]
    a = m @ (np.exp(g[:, i])[..., :, None] * a)
  return a


@pytest.mark.parametrize("gate,gate_bound", [("bounded", -5.0), ("unbounded", None)])
def test_slice_transitions_and_combine_match_fp64_recurrence(gate, gate_bound):
  """Slices of 16 tokens computed apart (fp32), combined by `prefix_state`, give the fp64
  recurrence's outputs and final state over the whole sequence, documents included."""
  r, n = 4, 16
  x = reference.example_inputs(jax.random.key(3), 2, r * n, 2, 8, 8, gate=gate,
                               with_initial_state=False)
  ids = np.ones((2, r * n), np.int32)
  ids[0, 10:] = 2; ids[0, 16:] = 3; ids[0, 50:] = 4; ids[1, 40:] = 2
  ids = jnp.asarray(ids)
  with jax.enable_x64(True):
    x64 = {name: np.asarray(v, np.float64) for name, v in x.items() if v is not None}
    o_ref, s_ref = reference.recurrent_kda(*(jnp.asarray(x64[a]) for a in "q k v g beta".split()),
                                           scale=8 ** -0.5, initial_state=None, segment_ids=ids)
  local_pass = jax.jit(functools.partial(context_parallel.local_pass, gate_bound=gate_bound,
                                         impl="chunked", use_qk_l2norm_in_kernel=False))
  parts = [local_pass(*(x[a][:, j * n:(j + 1) * n] for a in ("q", "k", "v", "g", "beta")),
                      ids[:, j * n:(j + 1) * n]) for j in range(r)]
  # Slice 3 of row 1 has no document start: its A is the plain product of the transitions.
  a_ref = _transition_fp64(*(x64[a][:, 3 * n:] for a in ("k", "g", "beta")))
  np.testing.assert_allclose(parts[3][2][1], a_ref[1], atol=1e-5)
  assert not np.any(parts[3][2][0])  # row 0 starts a document at token 50: A = 0 exactly
  # keep[j]: slice j continues slice j - 1's document (no reset at its first token).
  keep = jnp.stack([jnp.ones((2,))] + [(ids[:, j * n] == ids[:, j * n - 1]).astype(jnp.float32)
                                       for j in range(1, r)])[:, :, None, None, None]
  ab = jnp.stack([jnp.concatenate([p[2] * c, p[3]], -1) for p, c in zip(parts, keep)])
  s_in = [keep[j] * context_parallel.prefix_state(ab, jnp.int32(j)) for j in range(r)]
  outs = [context_parallel.with_entry_state(p[0], p[1], s_in[j]) for j, p in enumerate(parts)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), o_ref, atol=2e-5)
  s_final = jnp.einsum("bhkl,bhlv->bhkv", parts[-1][2], s_in[-1]) + parts[-1][3]
  np.testing.assert_allclose(s_final, s_ref, atol=2e-5)


def test_attention_query_offset_matches_full_causal_rows():
  """Queries [off, off + n) at causal positions off + i (a traced q_offset) against all keys
  equal those rows of the full causal attention: reference and blockwise tiers (blocks of 4,
  so causal block skipping is exercised), outputs, gradients and max logit."""
  key = jax.random.split(jax.random.key(0), 3)
  q, k = (jax.random.normal(kk, (2, 32, 2, 8)) for kk in key[:2])
  v = jax.random.normal(key[2], (2, 32, 2, 6))
  ids = jnp.asarray(np.repeat([[1, 1, 2, 2, 2, 3, 3, 0]], 2, 0).repeat(4, 1).astype(np.int32))
  off, n, scale = 12, 8, 0.3
  cot = jnp.cos(jnp.arange(2 * n * 2 * 6, dtype=jnp.float32)).reshape(2, n, 2, 6)

  def full(q, k, v):
    o, _ = attention_reference.attention(q, k, v, ids, ids, causal=True, scale=scale)
    return jnp.sum(o[:, off:off + n] * cot)

  logits = jnp.einsum("bthd,bshd->bhts", q, k) * scale
  visible = attention_reference.mask(32, 32, ids, ids, True)
  m_ref = jnp.max(jnp.where(visible, logits, -jnp.inf)[:, :, off:off + n], axis=(0, 2, 3))
  l_ref, g_ref = jax.jit(jax.value_and_grad(full, (0, 1, 2)))(q, k, v)
  tiers = {"reference": attention_reference.attention,
           "xla_blockwise": functools.partial(xla_blockwise.attention, block_q=4, block_k=4)}
  for name, tier in tiers.items():
    def rows(q, k, v, offset):
      o, m = tier(q[:, off:off + n], k, v, ids[:, off:off + n], ids, causal=True, scale=scale,
                  q_offset=offset)
      return jnp.sum(o * cot), m

    (l, m), g = jax.jit(jax.value_and_grad(rows, (0, 1, 2), has_aux=True))(q, k, v,
                                                                           jnp.int32(off))
    np.testing.assert_allclose(l, l_ref, rtol=1e-5, err_msg=name)
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(m, m_ref, rtol=1e-6, err_msg=name)
  declined = attention_op.plan(q, k, v, segment_ids=ids, q_offset=0, impl="cudnn").declined
  assert declined[0][0] == "cudnn" and declined[0][1].startswith("q_offset"), declined
