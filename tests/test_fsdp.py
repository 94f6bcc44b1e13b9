"""FSDP over `data` (k3jax.sharding): 8 CPU devices against the single-device step.

One subprocess (8 host devices) trains a 4-layer k3_tiny (KDA + gated MLA, LatentMoE, AttnRes,
the layers scanned as 2 units of 2) for 3 steps of per-head Muon (Newton-Schulz in fp32, so the
oracle differs only by summation order) on one device, on {data 8} and on {data 4, expert 2},
and reports losses, gradient norms, parameters, per-device bytes, shardings and the all-gathers
of the compiled step; and the collectives of per-head Muon with heads and experts split.
"""
import json
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from k3jax import config, sharding
from mesh_testing import cpu_env

_SCRIPT = r"""
import dataclasses, json, re
import jax, numpy as np
from k3jax import config, muon, sharding, train

OVERRIDES = {"model.num_layers": 4, "model.full_attn_layers": (2, 4),
             "model.first_k_dense_replace": 0, "model.attn_res_block_size": 2,
             "model.mtp_num_layers": 0, "kernels.kda_impl": "reference",
             "train.muon_ns_dtype": "float32", "train.seq_len": 32,
             "train.global_batch_size": 8}
STEPS, B, T = 3, 8, 32
rng = np.random.default_rng(0)
batches = []
for _ in range(STEPS):
  toks = rng.integers(0, 258, (B, T + 1)).astype(np.int32)
  batches.append(dict(inputs=toks[:, :-1], targets=toks[:, 1:],
                      segment_ids=np.ones((B, T), np.int32),
                      positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                      loss_mask=np.ones((B, T), np.float32)))


def keys(path):
  return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def loop_bodies(hlo):
  # Computations reached from a while loop's body: the scans' per-unit code.
  comps, cur = {}, None
  for line in hlo.split("\n"):
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      cur = comps[m.group(1)] = []
    elif cur is not None:
      cur.append(line)
  calls = {c: set(re.findall(r"(?:body|condition|to_apply|calls)=%([\w.\-]+)", "\n".join(ls)))
           for c, ls in comps.items()}
  todo = [b for ls in comps.values()
          for b in re.findall(r"while\(.*body=%([\w.\-]+)", "\n".join(ls))]
  seen = set()
  while todo:
    c = todo.pop()
    if c not in seen:
      seen.add(c)
      todo.extend(calls.get(c, ()))
  return comps, seen


def gathered_shapes(hlo):
  # {"loop": set of shapes, "outside": set of shapes} of all-gather results.
  comps, bodies = loop_bodies(hlo)
  out = {"loop": set(), "outside": set()}
  for c, lines in comps.items():
    for line in lines:
      m = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", line)
      if m:
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        out["loop" if c in bodies else "outside"].add(shape)
  return out


def run(data, expert):
  cfg = config.load("experiments/configs/k3_tiny.py",
                    {**OVERRIDES, "mesh.data": data, "mesh.expert": expert})
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:data * expert])
  rules = cfg.mesh.logical_axis_rules
  setup, state = train.init(cfg, 0)
  sh = train.state_shardings(setup, state, mesh, rules)
  state = jax.device_put(state, sh)
  bsh = sharding.batch_sharding(mesh, rules)
  place = lambda b: {k: jax.device_put(v, bsh) for k, v in b.items()}
  with jax.set_mesh(mesh):
    step = jax.jit(train.make_train_step(setup), out_shardings=(sh, None)).lower(
        state, place(batches[0])).compile()
  losses = []
  for b in batches:
    state, m = step(state, place(b))
    losses.append((float(m["loss"]), float(m["grad_norm"])))
  return setup, state, losses, step.as_text()


out = {}
setup1, ref, out["single"], _ = run(1, 1)
# At data = 1 the FSDP rules leave the traced step as it is without them.
mesh1 = sharding.make_mesh(setup1.cfg.mesh, jax.devices()[:1])
plain = setup1.cfg.copy_and_resolve_references()
plain.mesh.logical_axis_rules = tuple(r for r in plain.mesh.logical_axis_rules
                                      if r[1] != ("data",))
with jax.set_mesh(mesh1):
  jaxprs = [str(jax.make_jaxpr(train.make_train_step(s))(ref, batches[0]))
            for s in (setup1, dataclasses.replace(setup1, cfg=plain))]
out["same_program_at_data_1"] = jaxprs[0] == jaxprs[1]
ref_leaves = {keys(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(ref["params"])}
for data, expert in ((4, 2),):   # FSDP over data together with expert parallelism
  setup, state, losses, hlo = run(data, expert)
  r = out[f"{data}x{expert}"] = {"losses": losses}
  params = {keys(p): x for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  r["param_err"] = max(float(np.max(np.abs(np.asarray(x) - ref_leaves[k]))
                             / (np.max(np.abs(ref_leaves[k])) + 1e-12)) for k, x in params.items())
  total = sum(x.nbytes for x in jax.tree.leaves((state["params"], state["opt_state"])))
  r["bytes_ratio"] = total / sharding.per_device_bytes((state["params"], state["opt_state"]))
  r["leaves"] = len(params)
  r["data_sharded_values"] = sum(x.size for x in params.values()
                                 if "data" in str(x.sharding.spec)) / sum(
                                     x.size for x in params.values())
  # Every optimizer leaf that mirrors a parameter (path suffix, shape) is sharded like it.
  like, unlike = 0, []
  for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"]):
    k = keys(p)
    owner = next((k[i:] for i in range(len(k)) if k[i:] in params
                  and params[k[i:]].shape == x.shape), None)
    if owner is not None:
      if x.sharding.is_equivalent_to(params[owner].sharding, x.ndim):
        like += 1
      else:
        unlike.append(".".join(k))
  r["opt_like"], r["opt_unlike"] = like, unlike[:5]
  # Per-unit gathers: the scanned layers' data-sharded parameters, gathered per unit inside the
  # loop, never as the whole stack [units, ...] outside it.
  mesh = sharding.make_mesh(setup.cfg.mesh, jax.devices()[:data * expert])
  layers = state["params"]["layers"]
  unit, stack = set(), set()
  for i in (0, 1):  # positions of the unit; layers i and i + 2 share them
    for p, x in jax.tree_util.tree_leaves_with_path(layers[i]):
      spec = x.sharding.spec
      if "data" in str(spec):
        kept = jax.sharding.PartitionSpec(*[None if e == "data" else e for e in spec])
        shape = jax.sharding.NamedSharding(mesh, kept).shard_shape(x.shape)
        unit.add(shape)
        stack.add((2,) + shape)
  g = gathered_shapes(hlo)
  r["unit_gathers_in_loop"] = len(unit & g["loop"])
  r["unit_shapes"] = len(unit)
  r["stack_gathers"] = sorted(stack & (g["loop"] | g["outside"]))

# Per-head Muon with the head or expert axis split (over `expert`, 4 devices): the blocks of
# several layers are iterated together, yet no collective.
mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 1, 4, 1), sharding.MESH_AXES)
put = lambda shape, spec: jax.device_put(np.ones(shape, np.float32), jax.sharding.NamedSharding(
    mesh4, jax.sharding.PartitionSpec(*spec)))
heads, exps = (None, "expert", None), ("expert", None, None)
grads = {"layers": {str(i): {
    "self_attn": {n: {"kernel": put((16, 8, 4), heads)} for n in ("q_proj", "k_proj", "v_proj")},
    "block_sparse_moe": {"experts": {"w1": put((8, 32, 96), exps), "w3": put((8, 32, 96), exps),
                                     "w2": put((8, 96, 32), exps)}}} for i in range(2)}}
tx = muon.per_head_muon(0.1)
hlo = jax.jit(tx.update).lower(grads, tx.init(grads), grads).compile().as_text()
out["muon_collectives"] = sorted(set(re.findall(
    r"all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute", hlo)))
print("RESULT" + json.dumps(out))
"""


def test_fsdp_matches_single_device_and_shards_state():
  """On a data 4 x expert 2 mesh: losses, gradient norms and parameters equal the 1-device
  run's; state is split ~1/data per device, optimizer leaves like their parameters; the
  scanned layers are gathered per unit; per-head Muon needs no collective with heads or
  experts split."""
  env = cpu_env(8)
  res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       timeout=900, env=env)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.split("RESULT", 1)[1])
  assert out["same_program_at_data_1"], "FSDP rules changed the single-device step"
  assert out["muon_collectives"] == [], out["muon_collectives"]
  for mesh, data in (("4x2", 4),):
    r = out[mesh]
    for (loss, gnorm), (loss1, gnorm1) in zip(r["losses"], out["single"]):
      assert abs(loss - loss1) < 1e-5 * loss1 and abs(gnorm - gnorm1) < 1e-4 * gnorm1, (mesh, r)
    assert r["param_err"] < 1e-4, (mesh, r)  # max |p - p1| / max |p1| per leaf, after 3 steps
    # params + optimizer state: ~1/data per device (norms, gains, conv filters stay whole;
    # routed experts are also split over `expert`).
    assert data / 1.3 < r["bytes_ratio"] < 2 * data, (mesh, r)
    assert r["data_sharded_values"] > 0.99, (mesh, r)
    assert r["opt_like"] >= r["leaves"] and not r["opt_unlike"], (mesh, r)
    assert r["unit_shapes"] > 10 and r["unit_gathers_in_loop"] == r["unit_shapes"], (mesh, r)
    assert r["stack_gathers"] == [], (mesh, r)


def test_param_spec_drops_data_where_it_does_not_divide():
  """FSDP's fallback rule: a dim `data` does not divide stays whole; other axes must divide."""
  mesh = AbstractMesh((1, 8, 2, 1), sharding.MESH_AXES)
  rules = config.load("experiments/configs/k3_tiny.py").mesh.logical_axis_rules
  assert sharding.param_spec(("embed", "heads", "kv"), (64, 2, 16), mesh, rules) == \
      PartitionSpec("data", None, None)
  assert sharding.param_spec(("embed", "heads", "kv"), (60, 2, 16), mesh, rules) == \
      PartitionSpec(None, None, None)  # `kv` does not take `data` over: it went to `embed`
  assert sharding.param_spec(("exp", "latent", "mlp_moe"), (8, 32, 96), mesh, rules) == \
      PartitionSpec("expert", "data", None)
  assert sharding.param_spec(("exp", "latent", "mlp_moe"), (8, 12, 96), mesh, rules) == \
      PartitionSpec("expert", None, None)
  params = {"layers": [{"experts": {"w1": jax.ShapeDtypeStruct((7, 32, 96), "float32")}}]}
  names = {"layers": [{"experts": {"w1": ("exp", "latent", "mlp_moe")}}]}
  with pytest.raises(ValueError, match=r"layers\.0\.experts\.w1: .* 7 is not divisible by 2"):
    sharding.tree_shardings(params, names, mesh, rules)
