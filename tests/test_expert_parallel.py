"""Expert parallelism (k3jax.expert_parallel) on 8 virtual CPU devices against one device.

Oracles: the single-device LatentMoE (outputs, gradients, Quantile Balancing statistics and bias
updates), a loop over experts with the copies past the receive buffer dropped by a host-side
replay of the buffer order, `jax.lax.ragged_all_to_all`'s documented example, and
`latent_moe.sort_by_expert`.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config, expert_parallel
from k3jax import latent_moe as lm
from mesh_testing import run_on_devices

_LAYER_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import k3jax
from k3jax import expert_parallel as ep
from k3jax import latent_moe as lm
from k3jax import situ

AXES = ("pipeline", "data", "expert", "context")
out = {}

# 1. The padded all-to-all on the example of jax.lax.ragged_all_to_all's docstring.
mesh2 = Mesh(np.array(jax.devices()[:2]), ("x",))
def example(op, res, io, ss, oo, rs):
  return ep.padded_ragged_all_to_all(op[0], res[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]
args = [jnp.array(a) for a in ([[1., 2, 2], [3, 4, 0]], [[0.] * 4] * 2, [[0, 1], [0, 1]],
                               [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
out["example"] = np.asarray(jax.jit(jax.shard_map(
    example, mesh=mesh2, in_specs=P("x"), out_specs=P("x")))(*args)).tolist()

# 2. exchange_experts with skewed routing past the receive buffer: data 2 x expert 4.
D, R, E, K, NL, L, M = 2, 4, 8, 2, 8, 12, 16
mesh = Mesh(np.array(jax.devices()).reshape(D, R), ("data", "expert"))
rng = np.random.default_rng(0)
n = D * R * NL
p = np.array([8., 8, 1, 1, 1, 1, 1, 1]); p /= p.sum()
experts = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(n)]).astype(np.int32)
z = rng.normal(size=(n, L)).astype(np.float32)
w = rng.uniform(0.2, 1.0, size=(n, K)).astype(np.float32)
w1, w3 = (0.3 * rng.normal(size=(E, L, M)).astype(np.float32) for _ in range(2))
w2 = 0.3 * rng.normal(size=(E, M, L)).astype(np.float32)
ct = rng.normal(size=(n, L)).astype(np.float32)
capacity = ep.receive_rows(NL, K, R, E // R, 1.0)

def sharded(z, w, w1, w3, w2):
  def local(z, w, e, w1, w3, w2):
    u, dropped = ep.exchange_experts(z, w, e, w1, w3, w2, num_experts=E, capacity=capacity,
                                     all_to_all="padded", axes=("data", "expert"), beta1=4.0,
                                     beta2=25.0)
    return u, jax.lax.psum(dropped, ("data", "expert"))
  tok = P(("data", "expert"))
  u, dropped = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok) + (P("expert"),) * 3,
                             out_specs=(tok, P()))(z, w, experts, w1, w3, w2)
  return jnp.sum(u * ct), (u, dropped)

kept = np.zeros((n, K), bool)  # replay: receivers fill source after source, expert order
for row in range(D):
  for r in range(R):
    pos = 0
    for s in range(R):
      toks = np.arange(NL) + (row * R + s) * NL
      copies = [(experts[t, j], t * K + j) for t in toks for j in range(K)
                if experts[t, j] // (E // R) == r]
      for _, c in sorted(copies):
        kept[c // K, c % K] = pos < capacity
        pos += 1

def reference(z, w, w1, w3, w2):
  u = jnp.zeros(z.shape)
  for e in range(E):
    coef = jnp.sum(jnp.where((experts == e) & kept, w, 0.0), axis=1)
    u = u + coef[:, None] * (situ.situ(z @ w1[e], z @ w3[e], 4.0, 25.0) @ w2[e])
  return jnp.sum(u * ct), u

(_, (u, dropped)), g = jax.jit(jax.value_and_grad(sharded, argnums=range(5), has_aux=True))(
    z, w, w1, w3, w2)
(_, u_ref), g_ref = jax.jit(jax.value_and_grad(reference, argnums=range(5), has_aux=True))(
    z, w, w1, w3, w2)
out["overflow"] = dict(
    dropped=int(dropped), dropped_ref=int((~kept).sum()), capacity=capacity,
    u_err=float(jnp.max(jnp.abs(u - u_ref))), u_max=float(jnp.max(jnp.abs(u_ref))),
    g_err=[float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(g, g_ref)])

# 3. LatentMoE on meshes data 4 x expert 2 and data 2 x expert 4 against one device.
B, T, DIM = 8, 8, 16
model = nnx.eval_shape(lambda: lm.LatentMoE(
    DIM, num_experts=E, top_k=K, n_shared_experts=1, moe_intermediate_size=24, latent_size=L,
    qb_num_bins=50, qb_keep_scores=True, rngs=nnx.Rngs(0)))
gd, params, bufs = nnx.split(model, nnx.Param, ...)
draw = lambda v: jnp.asarray(rng.normal(size=v.shape) / np.sqrt(v.shape[-2]) if v.ndim > 1
                             else 1 + 0.1 * rng.normal(size=v.shape), jnp.float32)
params = jax.tree.map(draw, params)
bufs = jax.tree.map(lambda v: jnp.asarray(0.05 * rng.normal(size=v.shape), jnp.float32), bufs)
bias = nnx.merge(gd, params, bufs).gate["e_score_correction_bias"][...]
x = jnp.asarray(rng.normal(size=(B, T, DIM)), jnp.float32)
cty = jnp.asarray(rng.normal(size=(B, T, DIM)), jnp.float32)

def layer(params, x):
  y, aux = nnx.merge(gd, params, bufs)(x)
  return jnp.sum(y * cty), (y, aux)

step = jax.jit(jax.value_and_grad(layer, argnums=(0, 1), has_aux=True))
(_, (y1, a1)), g1 = step(params, x)
@jax.jit
def bias_update_fn(aux):
  return [lm.update_bias(bias, aux, method=m, top_k=K) for m in ("quantile", "quantile_exact")]
bias_updates = lambda aux: np.asarray(bias_update_fn(jax.device_get(aux))).tolist()

for d, r in ((4, 2), (2, 4)):
  mesh = Mesh(np.array(jax.devices()).reshape(1, d, r, 1), AXES)
  place = lambda path, v: jax.device_put(v, NamedSharding(
      mesh, P("expert") if "'experts'" in jax.tree_util.keystr(path) else P()))
  ps = jax.tree_util.tree_map_with_path(place, params)
  xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  with jax.set_mesh(mesh):
    compiled = step.lower(ps, xs).compile()
  (_, (y2, a2)), g2 = compiled(ps, xs)
  hlo = compiled.as_text()
  collectives = [line for line in hlo.splitlines()
                 if any(f" {c}(" in line for c in ("all-gather", "all-reduce", "all-to-all"))]
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  out[f"{d}x{r}"] = dict(
      y=rel(y2, y1), grads=[rel(b, a) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))],
      stats={k: float(np.max(np.abs(np.asarray(a1[k], np.float64) - np.asarray(a2[k]))))
             for k in a1},
      ep_dropped=int(a2["ep_dropped"]), bias_update=bias_updates(a2),
      all_to_all=sum(" all-to-all(" in c for c in collectives),
      all_gather=sum(" all-gather(" in c for c in collectives),
      token_sized=[c[:160] for c in collectives if f"[{B * T}," in c or f"[{B * T * K}," in c])
out["bias_update_single"] = bias_updates(a1)

# 4. The ragged collective (GPU/TPU) lowers, forward and backward.
with jax.set_mesh(Mesh(np.array(jax.devices()).reshape(1, 4, 2, 1), AXES)):
  model = nnx.merge(gd, params, bufs)
  model.ep_all_to_all = "ragged"
  gd, params, bufs = nnx.split(model, nnx.Param, ...)
  out["ragged_ops"] = jax.jit(jax.grad(lambda p, x: layer(p, x)[0], argnums=(0, 1))).lower(
      params, x).as_text().count("ragged_all_to_all")
print("RESULT" + json.dumps(out))
"""

_TRAIN_SCRIPT = r"""
import json
import jax, numpy as np
from k3jax import config, sharding, train
cfg = config.load("experiments/configs/k3_tiny.py", {
    "model.num_layers": 2, "model.full_attn_layers": (2,), "model.attn_res_block_size": 2,
    "model.mtp_num_layers": 0, "train.optimizer": "adamw", "mesh.data": 2, "mesh.expert": 4,
    "train.seq_len": 16, "train.global_batch_size": 8,
    "mesh.logical_axis_rules": (("activation_batch", ("data", "expert")), ("exp", ("expert",)))})
rng = np.random.default_rng(0)
toks = rng.integers(0, 258, (8, 17)).astype(np.int32)
batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((8, 16), np.int32),
             positions=np.tile(np.arange(16, dtype=np.int32), (8, 1)),
             loss_mask=np.ones((8, 16), np.float32))
out = {}
setup, init_state = train.init(cfg, 0)
for name in ("single", "sharded"):
  state, fn, b = init_state, jax.jit(train.make_train_step(setup)), batch
  mesh = sharding.make_mesh(cfg.mesh) if name == "sharded" else None
  if mesh is not None:
    rules = cfg.mesh.logical_axis_rules
    sh = train.state_shardings(setup, state, mesh, rules)
    state = jax.device_put(state, sh)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh, rules)) for k, v in batch.items()}
    fn = jax.jit(train.make_train_step(setup), out_shardings=(sh, None))
  losses, biases, dropped = [], [], []
  for _ in range(3):
    if mesh is None:
      state, m = fn(state, b)
    else:
      with jax.set_mesh(mesh):
        state, m = fn(state, b)
    losses.append(float(m["loss"]))
    dropped.append(float(m.get("moe/ep_dropped_copies", -1)))
    biases.append([np.asarray(x).tolist() for x in jax.tree.leaves(state["buffers"])])
  out[name] = dict(losses=losses, biases=biases, dropped=dropped)
print("RESULT" + json.dumps(out))
"""


def _run(script: str) -> dict:
  return run_on_devices(script)


@pytest.fixture(scope="module")
def layer_results():
  return _run(_LAYER_SCRIPT)


def test_padded_all_to_all_matches_the_ragged_collectives_documented_example(layer_results):
  assert layer_results["example"] == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_copies_past_the_receive_buffer_are_dropped_and_counted(layer_results):
  r = layer_results["overflow"]
  assert r["dropped"] == r["dropped_ref"] > 0, r
  assert r["u_err"] < 1e-5 * r["u_max"], r
  assert max(r["g_err"]) < 1e-5, r


@pytest.mark.parametrize("mesh", ["4x2", "2x4"])
def test_layer_matches_single_device(layer_results, mesh):
  r = layer_results[mesh]
  assert r["y"] < 1e-5, r
  assert max(r["grads"]) < 1e-5, r
  assert max(r["stats"].values()) == 0, r  # loads, histogram counts, range, scores: exact
  assert r["ep_dropped"] == 0, r
  single = np.asarray(layer_results["bias_update_single"])
  np.testing.assert_allclose(np.asarray(r["bias_update"]), single, atol=1e-6)


@pytest.mark.parametrize("mesh", ["4x2", "2x4"])
def test_compiled_layer_exchanges_copies_by_all_to_all(layer_results, mesh):
  r = layer_results[mesh]
  assert r["all_to_all"] > 0, r
  assert r["all_gather"] == 0, r
  assert r["token_sized"] == [], r  # no collective on [N, .] tokens or [N*k, .] copies


def test_ragged_collective_lowers_forward_and_backward(layer_results):
  assert layer_results["ragged_ops"] == 4  # dispatch, return, and their transposes


def test_train_step_matches_single_device():
  out = _run(_TRAIN_SCRIPT)
  for a, b in zip(out["single"]["losses"], out["sharded"]["losses"]):
    assert abs(a - b) < 1e-4 * abs(a), out
  np.testing.assert_allclose(np.asarray(out["sharded"]["biases"][0]),
                             np.asarray(out["single"]["biases"][0]), atol=1e-6)
  assert out["sharded"]["dropped"] == [0, 0, 0], out
  assert out["single"]["dropped"] == [-1, -1, -1], out  # one device: no expert parallelism


def test_local_order_sorts_the_receive_buffer_by_expert():
  recv_counts = jnp.array([[2, 0, 3], [1, 4, 0]], jnp.int32)  # [R sources, E_local]
  starts = np.cumsum([0] + list(np.asarray(recv_counts).reshape(-1)))
  for capacity in (16, 7):  # room to spare; and a bound inside source 1's slice
    ids = np.full(capacity, 3)  # rows past the received ones: no expert
    for seg, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
      ids[a:min(b, capacity)] = seg % 3
    order, inverse, sizes = expert_parallel.local_order(recv_counts, capacity)
    ref_order, ref_inverse, ref_sizes = lm.sort_by_expert(jnp.asarray(ids)[:, None], 4)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(inverse, ref_inverse)
    np.testing.assert_array_equal(sizes, ref_sizes[:3])


def test_receive_rows_and_the_worst_case_bound():
  assert expert_parallel.receive_rows(64, 2, 4, 2, 1.0) == 128
  assert expert_parallel.receive_rows(10, 3, 4, 2, 1.0) == 32  # 30 rounded up to 8
  assert expert_parallel.receive_rows(8, 2, 4, 2, 100.0) == 8 * 2 * 4  # worst case
  with pytest.raises(ValueError, match="model.moe.ep_capacity_factor"):
    expert_parallel.receive_rows(8, 2, 4, 2, 0.0)


def test_dropped_copies_stop_the_run_with_the_field_named():
  expert_parallel.check_dropped({"loss": 1.0, "moe/ep_dropped_copies": 0.0})
  with pytest.raises(config.ConfigError, match=r"model\.moe\.ep_capacity_factor.*dropped 3"):
    expert_parallel.check_dropped({"moe/ep_dropped_copies": 3.0})


def test_bad_settings_name_the_config_field():
  with pytest.raises(config.ConfigError, match="model.moe.ep_capacity_factor"):
    config.load("experiments/configs/k3_tiny.py", {"model.moe.ep_capacity_factor": 0.0})
  with pytest.raises(config.ConfigError, match="model.moe.ep_all_to_all"):
    config.load("experiments/configs/k3_tiny.py", {"model.moe.ep_all_to_all": "nccl"})
  with pytest.raises(ValueError, match="model.moe.expert_parallel"):
    expert_parallel.enabled("on", None)


def test_micro_batches_add_their_dropped_copies():
  aux = dict(loads=jnp.array([1, 2]), qb_counts=jnp.ones((2, 3), jnp.int32), qb_lo=-1.0,
             qb_hi=1.0, num_tokens=jnp.asarray(3), ep_dropped=jnp.asarray(2))
  merged = lm.merge_aux(aux, dict(aux, ep_dropped=jnp.asarray(5)))
  assert int(merged["ep_dropped"]) == 7
  plain = {k: v for k, v in aux.items() if k != "ep_dropped"}
  assert "ep_dropped" not in lm.merge_aux(plain, plain)


_MX_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from k3jax import latent_moe as lm, mx

rng = np.random.default_rng(0)
B, T, DIM, E = 4, 8, 64, 4
def build(**kw):
  return lm.LatentMoE(DIM, num_experts=E, top_k=2, n_shared_experts=1, moe_intermediate_size=64,
                      latent_size=32, qb_num_bins=50, rngs=nnx.Rngs(0), **kw)
x = jnp.asarray(rng.normal(size=(B, T, DIM)), jnp.float32)
cty = jnp.asarray(rng.normal(size=(B, T, DIM)), jnp.float32)
mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2, 1), ("pipeline", "data", "expert", "context"))
out = {}
for name, kw in (("qat", dict(qat=True)), ("packed", dict(qat=True, expert_format="mxfp4"))):
  _, params, bufs = nnx.split(build(qat=True), nnx.Param, ...)
  params, bufs = nnx.to_pure_dict(params), nnx.to_pure_dict(bufs)
  if name == "packed":
    params, bufs = mx.pack_experts(params, bufs)
  gd = nnx.split(build(**kw), nnx.Param, ...)[0]
  def loss(params, bufs, x):
    y, _ = nnx.merge(gd, params, bufs)(x)
    return jnp.sum(y * cty), y
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, y1), g1 = step(params, bufs, x)
  place = lambda path, v: jax.device_put(v, NamedSharding(
      mesh, P("expert") if "'experts'" in jax.tree_util.keystr(path) else P()))
  ps, bs = (jax.tree_util.tree_map_with_path(place, t) for t in (params, bufs))
  xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  with jax.set_mesh(mesh):
    compiled = step.lower(ps, bs, xs).compile()
  (_, y2), g2 = compiled(ps, bs, xs)
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  out[name] = dict(all_to_all="all-to-all" in compiled.as_text(), y=rel(y2, y1),
                   grads=max(rel(b, a) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))))
print("RESULT", json.dumps(out))
"""


def test_qat_and_packed_experts_under_expert_parallelism_match_one_device():
  """QAT (fake-quantized weights and inputs) and packed MXFP4 experts through the all-to-all
  path (data 2 x expert 2) against one device: outputs and gradients."""
  out = run_on_devices(_MX_SCRIPT, devices=4)
  for name in ("qat", "packed"):
    r = out[name]
    assert r["all_to_all"], r
    assert r["y"] < 1e-5 and r["grads"] < 1e-5, (name, r)
