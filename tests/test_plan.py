"""The memory/parameter plan (k3jax.plan, launch.plan) against the report's numbers and direct sums."""
import math
import re
import subprocess
import sys

import jax
import pytest
from flax import nnx

from k3jax import config, flops, muon
from k3jax import plan as plan_lib

CONFIGS = "experiments/configs"


def _load(name: str, **overrides):
  return config.load(f"{CONFIGS}/{name}.py", {k.replace("__", "."): v for k, v in overrides.items()})


def _ints(text: str) -> dict[str, int]:
  return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+): (\d+)$", text, re.M)}


def _mtp_params(m) -> int:
  """One MTP depth from the config: eh_proj, 3 + 2 norms, a gated MLA and a LatentMoE FFN."""
  d, a, e = m.hidden_size, m.mla, m.moe
  h, ql, kr = a.num_heads, a.q_lora_rank, a.kv_lora_rank
  mla = (d * ql + ql + ql * h * (a.qk_nope_head_dim + a.qk_rope_head_dim)
         + d * (kr + a.qk_rope_head_dim) + kr + kr * h * (a.qk_nope_head_dim + a.v_head_dim)
         + 2 * d * h * a.v_head_dim)
  lat, mi = e.latent_size, e.moe_intermediate_size
  moe = d * e.num_experts + 2 * d * lat + lat + 3 * e.num_experts * lat * mi
  moe += 3 * d * e.n_shared_experts * mi
  return 2 * d * d + 5 * d + mla + moe


@pytest.fixture(scope="module")
def k3_full():
  cfg = _load("k3_full", mesh__data=8, mesh__expert=64, mesh__pipeline=16, mesh__context=1,
              train__optimizer="adamw")
  plan = plan_lib.make_plan(cfg)
  return cfg, plan, plan_lib.format_plan(plan)


def test_k3_full_counts_match_the_report(k3_full):
  cfg, plan, text = k3_full
  lines = text.splitlines()
  assert re.fullmatch(r"total_params: \d+", lines[0]) and re.fullmatch(r"active_params: \d+", lines[1])
  v = _ints(text)
  assert abs(v["total_params"] / 2.779e12 - 1) < 0.005
  assert abs(v["active_params"] / 104.2e9 - 1) < 0.005
  assert (v["total_params"], v["active_params"]) == (plan.counts.total, plan.counts.active)
  assert v["mtp_params"] == _mtp_params(cfg.model)
  assert "layers: 93 = 69 KDA + 24 gated MLA" in text


def test_k3_full_bytes_per_device(k3_full):
  cfg, plan, text = k3_full
  v = _ints(text)
  e = cfg.model.moe
  # `exp` over expert (64), and FSDP: `latent` over data (8).
  routed = 92 * e.num_experts * 3 * e.latent_size * e.moe_intermediate_size * 4 // (64 * 8)
  assert plan.groups["routed_experts"].params == routed
  assert plan.groups["routed_experts"].optimizer == 2 * routed  # AdamW: mu and nu, fp32
  m = cfg.model
  assert plan.groups["embedding"].params == 2 * m.vocab_size * m.hidden_size * 4 // 8
  # The base rules' FSDP names split a parameter over data; the rest (norm gains, A_log,
  # dt_bias, conv filters, AttnRes queries) are whole on each device.
  params, names = plan_lib.abstract_params(cfg.model)
  leaves = list(zip(jax.tree.leaves(params),
                    jax.tree.leaves(names, is_leaf=lambda n: isinstance(n, tuple))))
  fsdp = {"embed", "latent", "q_lora", "kv_lora", "kv"}
  want = sum(4 * math.prod(x.shape) // (8 if fsdp & set(n) else 1) // (64 if "exp" in n else 1)
             for x, n in leaves)
  assert v["param_bytes_per_device"] == want
  assert sum(math.prod(x.shape) for x, n in leaves if not fsdp & set(n)) < 1e-3 * v["total_params"]
  assert 0 <= v["optimizer_bytes_per_device"] - 2 * v["param_bytes_per_device"] < 64  # + counters
  staged = v["staged_param_bytes_per_device"]
  assert v["param_bytes_per_device"] / 16 < staged < v["param_bytes_per_device"] / 5
  assert plan.stages.layers_per_stage == 6 and plan.stages.num_stages == 16


def test_kimi_linear_48b():
  plan = plan_lib.make_plan(_load("kimi_linear_48b", mesh__data=1, mesh__expert=8))
  v = _ints(plan_lib.format_plan(plan))
  assert 48e9 <= v["total_params"] <= 49.5e9
  assert 2.8e9 <= v["active_params"] <= 3.3e9
  assert v["mtp_params"] == 0 and plan.stages is None
  assert plan.layer_summary.startswith("27 = 20 KDA + 7 MLA")


def test_expert_axis_halves_expert_bytes_and_muon_state_matches_formula():
  plans = {n: plan_lib.make_plan(_load("k3_tiny", mesh__data=1, mesh__expert=n,
                                       train__optimizer="muon")) for n in (2, 4)}
  two, four = plans[2].groups, plans[4].groups
  assert two["routed_experts"].params == 2 * four["routed_experts"].params > 0
  assert two["routed_experts"].optimizer == 2 * four["routed_experts"].optimizer > 0
  assert two["attention"] == four["attention"] and two["embedding"] == four["embedding"]

  cfg = _load("k3_tiny", train__optimizer="muon")
  params, _ = plan_lib.abstract_params(cfg.model)
  dims = jax.tree.leaves(muon.muon_dimension_numbers(params, mode="per_head"),
                         is_leaf=lambda d: d is None or isinstance(d, muon.DimNums))
  want_p = want_o = 0
  for (path, x), d in zip(jax.tree_util.tree_leaves_with_path(params), dims):
    split = 4 if "experts" in muon.path_str(path).split(".") else 1  # `exp` -> expert (size 4)
    n = math.prod(x.shape) // split
    want_p += 4 * n
    want_o += 4 * n * (1 if d is not None else 2)
  assert plans[4].per_device.params == want_p
  assert 0 <= plans[4].per_device.optimizer - want_o < 64  # + step counters, replicated
  assert plans[4].mtp_params == sum(math.prod(x.shape) for x in jax.tree.leaves(params["mtp"]))


def test_mtp_in_model_state_is_not_counted_twice():
  cfg = _load("k3_tiny")
  params, names = plan_lib.abstract_params(cfg.model)
  model = flops.abstract_model(cfg.model)
  backbone = sum(math.prod(v.shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                 if p[0] != "mtp")
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert total == backbone + _mtp_params(cfg.model)
  assert names["mtp"]["eh_proj"]["kernel"] == ("mtp_concat", "embed")


def test_step_flops_count_the_mtp_head_and_newton_schulz():
  """`flops.step_flops` of k3_tiny: the MTP depth from the written-out parameter formula, one
  MLA layer's causal attention and the shared LM head; Newton-Schulz summed leaf by leaf, each
  block [m, n] (m <= n) costing 5 steps of 4 m^2 n + 2 m^3."""
  cfg = _load("k3_tiny")
  m, tokens, t = cfg.model, 64, 32
  got = flops.step_flops(m, t, tokens)
  e, a = m.moe, m.mla
  routed = 3 * e.num_experts * e.latent_size * e.moe_intermediate_size
  active = _mtp_params(m) - routed + routed * e.num_experts_per_tok // e.num_experts
  attention = 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * t / 2
  want_mtp = tokens * m.mtp_num_layers * (6 * active + 3 * attention
                                          + 6 * m.hidden_size * m.vocab_size)
  assert got.mtp == want_mtp
  params = nnx.to_pure_dict(nnx.state(flops.abstract_model(m), nnx.Param))
  want_ns = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    dims = muon.resolve(muon.path_str(path), tuple(x.shape)).dims
    if dims is None:
      continue
    axes = lambda d: {d % x.ndim} if isinstance(d, int) else {i % x.ndim for i in d}
    red, out = axes(dims.reduction_axis), axes(dims.output_axis)
    r, o = (math.prod(x.shape[i] for i in s) for s in (red, out))
    blocks = math.prod(x.shape) // (r * o)
    lo, hi = min(r, o), max(r, o)
    want_ns += blocks * 5 * (4 * lo * lo * hi + 2 * lo ** 3)
  assert want_ns > 0 and got.newton_schulz == want_ns
  assert got.model == tokens * flops.train_flops_per_token(m, t)
  assert got.total == got.model + got.mtp + got.newton_schulz


def test_bad_mesh_and_config_errors():
  with pytest.raises(ValueError, match="mesh.data"):
    plan_lib.make_plan(_load("k3_tiny"))
  with pytest.raises(ValueError, match="mtp_num_layers"):
    plan_lib.make_plan(_load("k3_tiny", mesh__data=1, model__mtp_num_layers=2))
  rules = (("vocab", ("expert",)), ("exp", ("expert",)))
  with pytest.raises(ValueError, match="not divisible"):  # vocab 258 over 4 devices
    plan_lib.make_plan(_load("k3_tiny", mesh__data=1, mesh__expert=4,
                             mesh__logical_axis_rules=rules))


def test_command_line():
  out = subprocess.run(
      [sys.executable, "-m", "launch.plan", f"--config={CONFIGS}/k3_tiny.py", "--data=2",
       "--expert=2", "--pipeline=2", "--config.train.optimizer=muon_whole"],
      capture_output=True, text=True, check=True).stdout
  lines = out.splitlines()
  counts = flops.count_params(_load("k3_tiny").model)
  assert lines[:2] == [f"total_params: {counts.total}", f"active_params: {counts.active}"]
  assert "mesh: pipeline=2 data=2 expert=2 context=1 (8 devices)" in out
  assert "staged_state_bytes_per_device" in out and "muon_whole (whole)" in out


def test_devices_flag_sets_the_data_axis():
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "launch.plan", f"--config={CONFIGS}/k3_tiny.py", *args],
      capture_output=True, text=True)
  out = run("--devices=8", "--expert=2")
  assert out.returncode == 0, out.stderr
  assert "mesh: pipeline=1 data=4 expert=2 context=1 (8 devices)" in out.stdout
  bad = run("--devices=8", "--expert=3")
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  assert "--devices=8: the mesh --data=-1 (all devices) --expert=3" in bad.stderr
