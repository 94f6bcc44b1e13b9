"""Sharded training on a 4-device CPU mesh (data x expert) equals the single-device step."""
import json
import subprocess
import sys

import pytest

from k3jax import config, sharding
from mesh_testing import cpu_env

_SCRIPT = r"""
import json, sys
import jax, numpy as np
from k3jax import config, sharding, train
cfg = config.load("experiments/configs/k3_tiny.py", {
    "model.num_layers": 4, "model.full_attn_layers": (2, 4), "model.attn_res_block_size": 2,
    "mesh.data": 2, "mesh.expert": 2, "train.seq_len": 32, "train.global_batch_size": 4,
    "mesh.logical_axis_rules": (("activation_batch", ("data", "expert")), ("exp", ("expert",)),
                                ("heads", ("expert",)))})
rng = np.random.default_rng(0)
toks = rng.integers(0, 258, (4, 33)).astype(np.int32)
batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((4, 32), np.int32),
             positions=np.tile(np.arange(32, dtype=np.int32), (4, 1)),
             loss_mask=np.ones((4, 32), np.float32))
out = {}
for name in ("single", "sharded"):
  setup, state = train.init(cfg, 0)
  step = train.make_train_step(setup)
  if name == "sharded":
    mesh = sharding.make_mesh(cfg.mesh)
    rules = cfg.mesh.logical_axis_rules
    sh = train.state_shardings(setup, state, mesh, rules)
    state = jax.device_put(state, sh)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh, rules)) for k, v in batch.items()}
    fn = jax.jit(step, out_shardings=(sh, None))
    w1 = state["params"]["layers"][1]["block_sparse_moe"]["experts"]["w1"]
    out["w1_shard_rows"] = w1.addressable_shards[0].data.shape[0]
    out["w1_spec"] = str(w1.sharding.spec)
  else:
    b, fn = batch, jax.jit(step)
  losses = []
  for _ in range(3):
    state, m = fn(state, b)
    losses.append(float(m["loss"]))
  out[name] = losses
print("RESULT" + json.dumps(out))
"""


def test_data_expert_mesh_matches_single_device():
  env = cpu_env(4)
  res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       timeout=600, env=env)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.split("RESULT", 1)[1])
  assert out["w1_shard_rows"] == 8 // 2, out  # 8 experts over the expert axis of size 2
  assert out["w1_spec"] == "P('expert', None, None)", out
  for a, b in zip(out["single"], out["sharded"]):
    assert abs(a - b) < 1e-4 * abs(a), out


def test_rules_map_logical_names_and_reject_indivisible_dims():
  rules = (("exp", ("expert",)), ("activation_batch", ("data", "expert")))
  assert sharding.logical_to_mesh(("exp", "latent", "mlp_moe"), rules) == \
      sharding.PartitionSpec("expert", None, None)
  assert sharding.logical_to_mesh(("activation_batch", "activation_length"), rules) == \
      sharding.PartitionSpec(("data", "expert"), None)
  cfg = config.load("experiments/configs/k3_tiny.py")
  mesh = sharding.make_mesh(cfg.mesh)
  with pytest.raises(ValueError, match="need 3 devices, have 1"):
    cfg.mesh.data = 3
    sharding.make_mesh(cfg.mesh)
  assert mesh.shape["data"] == 1
