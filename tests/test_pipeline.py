"""The 1F1B pipeline (k3jax.pipeline) against the single-device step, and its schedule."""
import json
import subprocess
import sys

import numpy as np
import pytest

from k3jax import config, pipeline
from mesh_testing import cpu_env

TINY = "experiments/configs/k3_tiny.py"
# Layer 0 KDA + MoE (stage 0), layers 1-4 MLA + MoE scanned as 4 units of 1 (two per stage),
# layer 5 KDA + MoE and the MTP layer (last stage); AttnRes blocks of 3 layers, so the stage
# boundary at layer 3 is a block boundary. QK-Clip at tau 0.5 clips every MLA layer, so the
# parameters depend on each layer's own max logit; every layer's MoE statistics set its bias.
OVERRIDES = {
    "model.num_layers": 6, "model.full_attn_layers": (2, 3, 4, 5),
    "model.first_k_dense_replace": 0, "model.attn_res_block_size": 3,
    "train.seq_len": 16, "train.global_batch_size": 16,
    "train.grad_accum_steps": 4, "train.qk_clip_tau": 0.5, "mesh.pipeline": 2,
}
MESHES = {"pipeline2_data2_expert2": {"mesh.data": 2, "mesh.expert": 2}}
STEPS = 3

_SCRIPT = r"""
import json, sys
import jax, numpy as np
from k3jax import config, pipeline, sharding, train
out, overrides = sys.argv[1], json.loads(sys.argv[2])
cfg = config.load("experiments/configs/k3_tiny.py", overrides)
b, t = cfg.train.global_batch_size, cfg.train.seq_len
toks = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, t + 1)).astype(np.int32)
batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((b, t), np.int32),
             positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
             loss_mask=np.ones((b, t), np.float32))
setup, state = train.init(cfg, 0)
step = train.make_train_step(setup)
res = {}
if jax.device_count() == 1:
  fn = jax.jit(step)
else:
  mesh = sharding.make_mesh(cfg.mesh)
  rules = cfg.mesh.logical_axis_rules
  shardings = train.state_shardings(setup, state, mesh, rules)
  state = jax.device_put(state, shardings)
  batch = {k: jax.device_put(v, sharding.batch_sharding(mesh, rules)) for k, v in batch.items()}
  with jax.set_mesh(mesh):
    fn = jax.jit(step, out_shardings=(shardings, None)).lower(state, batch).compile()
  res["collective_permute"] = "collective-permute" in fn.as_text()
  plan = pipeline.layout(cfg.model, 2, 1).plan
  stack = [x for i, layer in state["params"]["layers"].items() if plan.scanned(i)
           for x in jax.tree.leaves(layer)]
  without_pipeline = sum(x.nbytes / np.prod([mesh.shape[a] for e in x.sharding.spec
                                             for a in ((e,) if isinstance(e, str) else e or ())
                                             if a != "pipeline"]) for x in stack)
  res["stack_bytes_ratio"] = sharding.per_device_bytes(stack) / without_pipeline
  q = state["params"]["layers"][plan.start]["self_attn"]["q_b_proj"]["kernel"]
  res["q_b_proj_spec"] = str(q.sharding.spec)
  res["describe"] = pipeline.describe(cfg)
save = lambda path, tree: np.savez(path, **{
    jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)})
metrics = []
for step in range(int(sys.argv[3])):
  state, m = fn(state, batch)
  metrics.append({k: float(v) for k, v in m.items()})
  if step == 0:
    save(out + ".step0.npz", {"opt_state": state["opt_state"], "buffers": state["buffers"]})
save(out, {"params": state["params"], "buffers": state["buffers"]})
print("RESULT" + json.dumps({**res, "metrics": metrics}))
"""


def _start(out: str, overrides: dict, devices: int) -> subprocess.Popen:
  env = cpu_env(devices)
  return subprocess.Popen([sys.executable, "-c", _SCRIPT, out, json.dumps(overrides), str(STEPS)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _part(npz, prefix: str) -> dict[str, np.ndarray]:
  """The arrays of an npz file under one top-level key (`['params']...`)."""
  return {k: npz[k] for k in npz.files if k.startswith(f"['{prefix}']")}


def _assert_leaves_close(got, want, rtol: float, atol: float, what: str):
  """Every array of two npz files (or dicts) within atol + rtol x the reference leaf's largest
  magnitude."""
  files = lambda a: sorted(a.files if hasattr(a, "files") else a)
  assert files(got) == files(want) and files(want), what
  for key in files(want):
    scale = float(np.max(np.abs(want[key]))) if want[key].size else 0.0
    np.testing.assert_allclose(got[key], want[key], rtol=0, atol=atol + rtol * scale,
                               err_msg=f"{what} {key}")


def test_pipeline_steps_match_single_device(tmp_path):
  """Three train steps (per-head Muon, QK-Clip, Quantile Balancing bias updates; learning rate
  0, 1e-3, 2e-3) on an 8-device mesh (pipeline 2 x data 2 x expert 2) against the single-device
  step with the same 4 micro-batches (two processes at once).

  Step 0 leaves the parameters unchanged (learning rate 0), so its optimizer moments are the
  gradients leaf by leaf (clipped alike) and its MoE biases come from the per-layer routing
  statistics: both within 1e-4 x each leaf's largest magnitude; steps 0 and 1 (same parameters)
  give every metric (losses, grad norm, per-layer expert loads, max logit) within rtol 1e-5.
  After updates, float-level gradient differences move Adam's sign-like first steps on
  near-zero gradients and Muon's bf16 Newton-Schulz, so step 2's losses are held to rtol 1e-4,
  its grad norm and max logit to 2e-3, the parameters after three steps to half the summed
  learning rate (the data x expert sharded step without a pipeline differs from one device by
  up to 9e-4 here as well) and the MoE biases to that plus one histogram bin width (a score
  moved across a bin edge: 1.5e-3 on one expert on some CPUs). The compiled step sends activations by collective-permute,
  and a device stores half of the layer stack."""
  runs = {"single": (OVERRIDES, 1), **{name: ({**OVERRIDES, **mesh}, 8)
                                        for name, mesh in MESHES.items()}}
  procs = {name: _start(str(tmp_path / f"{name}.npz"), overrides, devices)
           for name, (overrides, devices) in runs.items()}
  out = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
    out[name] = json.loads(stdout.split("RESULT", 1)[1])
  want = out["single"]["metrics"]
  assert [m["learning_rate"] for m in want] == pytest.approx([0.0, 1e-3, 2e-3])
  assert want[0]["mla/max_logit"] > OVERRIDES["train.qk_clip_tau"]  # QK-Clip acts
  for name in MESHES:
    got = out[name]
    assert got["collective_permute"], name
    assert 0.45 < got["stack_bytes_ratio"] < 0.55, (name, got["stack_bytes_ratio"])
    assert "pipeline" in got["q_b_proj_spec"], got["q_b_proj_spec"]
    assert "bubble (S-1)/(M+S-1) = 1/5" in got["describe"], got["describe"]
    for step, (m_got, m_want) in enumerate(zip(got["metrics"], want)):
      assert set(m_got) - set(m_want) <= {"moe/ep_dropped_copies"}, (name, step)
      assert m_got.get("moe/ep_dropped_copies", 0) == 0, (name, step)
      tols = ({key: 1e-5 for key in m_want} if step < 2 else
              {"loss": 1e-4, "lm_loss": 1e-4, "mtp_loss": 1e-4, "grad_norm": 2e-3,
               "mla/max_logit": 2e-3})
      for key, rtol in tols.items():
        np.testing.assert_allclose(m_got[key], m_want[key], rtol=rtol, atol=1e-7,
                                   err_msg=f"{name} step {step} {key}")
    _assert_leaves_close(np.load(tmp_path / f"{name}.npz.step0.npz"),
                         np.load(tmp_path / "single.npz.step0.npz"), 1e-4, 0.0,
                         f"{name} after step 0")
    got_final, want_final = np.load(tmp_path / f"{name}.npz"), np.load(tmp_path / "single.npz")
    drift = 0.5 * sum(m["learning_rate"] for m in want)
    _assert_leaves_close(_part(got_final, "params"), _part(want_final, "params"), 0.0, drift,
                         f"{name} params after {STEPS} steps")
    # The biases come from Quantile Balancing's score histogram: a score that float-level
    # differences move across a bin edge moves the bias by up to a bin width (scores in (0, 1)
    # over qb_num_bins bins), beside the parameters' drift.
    bin_width = 1.0 / config.load(TINY, OVERRIDES).model.moe.qb_num_bins
    _assert_leaves_close(_part(got_final, "buffers"), _part(want_final, "buffers"), 0.0,
                         drift + bin_width, f"{name} biases after {STEPS} steps")


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (3, 2), (4, 7)])
def test_schedule_runs_each_microbatch_once_in_dependency_order(stages, microbatches):
  """Replays the lockstep 1F1B schedule: every micro-batch's forward and backward once per
  stage, after their inputs (activation from stage s - 1 one tick earlier, cotangent from s + 1
  one tick earlier or, on the last stage, its own forward in the same tick); the residual slot
  of a micro-batch is not overwritten before its backward (also not by the garbage of idle
  forward slots); at most 2(S - 1 - s) + 1 micro-batches in flight on stage s."""
  cfg = config.load(TINY, {**OVERRIDES, "mesh.pipeline": stages,
                           "model.num_layers": 1 + 2 * stages,
                           "model.full_attn_layers": tuple(range(2, 2 + 2 * stages)),
                           "model.attn_res_block_size": 0})
  lay = pipeline.layout(cfg.model, stages, microbatches)
  fwd, bwd, slots = {}, {}, [{} for _ in range(stages)]
  for t in range(lay.ticks):
    for s in range(stages):
      if t < microbatches + stages - 1:
        m = lay.forward_microbatch(t, s)
        slots[s][m % lay.slots] = m
        if 0 <= m < microbatches:
          assert (s, m) not in fwd
          fwd[s, m] = t
          assert s == 0 or fwd[s - 1, m] == t - 1
      if t >= stages - 1:
        m = lay.backward_microbatch(t, s)
        if 0 <= m < microbatches:
          assert (s, m) not in bwd and slots[s][m % lay.slots] == m
          bwd[s, m] = t
          assert (bwd[s + 1, m] == t - 1) if s < stages - 1 else fwd[s, m] == t
  assert len(fwd) == len(bwd) == stages * microbatches
  for s in range(stages):
    in_flight = max(sum(fwd[s, m] <= t <= bwd[s, m] for m in range(microbatches))
                    for t in range(lay.ticks))
    assert in_flight == min(2 * (stages - 1 - s) + 1, microbatches) <= lay.slots
  assert lay.bubble == (stages - 1) / (microbatches + stages - 1)


def test_layouts_the_pipeline_cannot_split_name_the_field():
  base = {**OVERRIDES, "mesh.data": 4}
  lay = pipeline.layout(config.load(TINY, base).model, 2, 4)
  assert (lay.units_per_stage, lay.entry_layer(1), lay.sent_blocks) == (2, 3, 1)
  text = pipeline.describe(config.load(TINY, base))
  assert "stage 0: embedding; layers 0-0 (unrolled); units 0-1 = layers 1-2" in text
  assert "stage 1: units 2-3 = layers 3-4 (scanned); layers 5-5 (unrolled)" in text
  assert "MTP layer + CE" in text
  bad = {"mesh.pipeline": {"model.num_layers": 4, "model.full_attn_layers": (2, 3, 4)},
         "model.attn_res_block_size": {"model.attn_res_block_size": 2},
         "model.scan_layers": {"model.scan_layers": False}}
  for field, overrides in bad.items():
    with pytest.raises(config.ConfigError, match=field.replace(".", r"\.")):
      pipeline.layout(config.load(TINY, {**base, **overrides}).model, 2, 4)
