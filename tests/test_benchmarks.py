"""The benchmark entry points run end to end on CPU at toy sizes and write well-formed records.

Device time is scarce: a script that breaks should break here, not on the H200. No timing is
asserted (speed lives in benchmarks/), only that each script finishes and what it records.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_module(module: str, *flags: str) -> None:
  run_python("-m", module, *flags)


def run_python(*args: str) -> None:
  """`python *args` from the repository root on CPU; fails with its stderr's tail."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]


def records(path: pathlib.Path) -> list[dict]:
  recs = json.loads(path.read_text())
  assert isinstance(recs, list) and recs
  return recs


def test_kda_benchmark_writes_one_record_per_impl_and_pass(tmp_path):
  out = tmp_path / "kda.json"
  run_module("benchmarks.kda", "--shapes=1x64x1", "--impls=chunked", "--reps=1",
             f"--out={out}")
  recs = records(out)
  assert sorted(r["pass"] for r in recs) == ["fwd", "fwd+bwd"]
  for r in recs:
    assert r["implementation"] == "chunked" and (r["B"], r["T"], r["H"]) == (1, 64, 1)
    assert r["median_ms"] > 0 and r["device"] and r["date"] and "jax" in r["versions"]


def test_kda_parts_benchmark_runs_every_part_in_the_interpreter(tmp_path):
  out = tmp_path / "parts.json"
  run_module("benchmarks.kda_parts", "--parts_shapes=1x64x1", "--interpret",
             "--parts_precisions=highest", f"--parts_out={out}")
  parts = {r["part"] for r in records(out)}
  assert {"forward_kernels", "backward_parts_kernel_highest", "chunk_parts_vjp_kernel",
          "cotangents_kernel", "states_kernel", "dstates_kernel"} <= parts


def test_kda_accuracy_compares_each_implementation_with_fp64(tmp_path):
  out = tmp_path / "acc.json"
  run_module("benchmarks.kda_accuracy", "--shapes=1x128x1", "--impls=chunked,mosaic_gpu",
             "--interpret", "--head_group=1", f"--accuracy_out={out}")
  recs = records(out)
  assert [r["implementation"] for r in recs] == ["chunked", "mosaic_gpu"]
  for r in recs:
    errs = r["rel_l2_vs_fp64"]
    assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert all(0 < e < 1e-2 for e in errs.values()), errs


def test_moe_layer_benchmark_times_every_part(tmp_path):
  out = tmp_path / "moe.json"
  run_module("benchmarks.moe_layer", "--config=experiments/configs/k3_tiny.py",
             "--tokens=64", "--impls=xla", f"--out={out}", f"--profile_dir={tmp_path}/trace")
  for part in ("xla", "routing"):
    assert list((tmp_path / "trace" / part).rglob("*.trace.json.gz")), part
  names = {r["implementation"] for r in records(out)}
  parts = {"elementwise_" + p for p in ("situ", "situ_sigmoid_form", "add_same_bytes")}
  assert names == {"layer_fwd_xla", "layer_fwd+bwd_xla", "grouped_gemms_xla",
                   "routing_and_permutation", "routing_and_permutation_fwd+bwd",
                   "dense_same_flops"} | parts


def test_autotune_ragged_dot_times_every_product_in_the_interpreter(tmp_path):
  out = tmp_path / "autotune.json"
  run_module("benchmarks.autotune_ragged_dot", "--quick", "--shapes=toy", "--interpret",
             "--max_configs=1", f"--out={out}")
  recs = records(out)
  assert sorted(r["product"] for r in recs) == ["d_lhs", "d_rhs", "fwd"]
  assert all(r["median_ms"] > 0 and r["shape"] == dict(G=2, M=256, K=256, N=256) for r in recs)


def test_merge_records_replaces_by_key_and_keeps_runs_of_one_commit(tmp_path):
  """Same key: replaced; with runs_of, the runs of one commit and device accumulate, another
  commit starts over; a record that cannot be written leaves the file as it was."""
  from benchmarks import common
  path = str(tmp_path / "r.json")
  rec = lambda ms, commit, v="a": dict(op="x", variant=v, tpot_ms=ms, commit=commit, device="d")
  common.merge_records(path, [rec(2.0, "c1"), rec(5.0, "c1", "b")], ("op", "variant"),
                       runs_of="tpot_ms")
  common.merge_records(path, [rec(3.0, "c1")], ("op", "variant"), runs_of="tpot_ms")
  got = {r["variant"]: r for r in json.load(open(path))}
  assert got["a"]["tpot_ms"] == 3.0 and got["a"]["runs"] == [2.0, 3.0]
  assert got["b"]["runs"] == [5.0]
  common.merge_records(path, [rec(4.0, "c2")], ("op", "variant"), runs_of="tpot_ms")
  assert {r["variant"]: r for r in json.load(open(path))}["a"]["runs"] == [4.0]
  common.merge_records(path, [rec(1.0, "c2", "b")], ("op", "variant"))
  assert "runs" not in {r["variant"]: r for r in json.load(open(path))}["b"]
  before = open(path).read()
  with pytest.raises(TypeError):
    common.merge_records(path, [dict(op="x", variant="c", bad=object())], ("op", "variant"))
  assert open(path).read() == before and sorted(os.listdir(tmp_path)) == ["r.json"]


def test_read_words_reads_every_word():
  """`common.read_words` (the MXFP4 benchmark's `stream_*` rows) xors every uint32 word of each
  array (numpy's view of the same bytes as the oracle), so its time is that of reading all the
  bytes."""
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import common
  rng = np.random.default_rng(3)
  packed = rng.integers(0, 256, (2, 6, 16), dtype=np.uint8)
  scale = rng.integers(0, 256, (2, 6, 8), dtype=np.uint8)
  w = rng.standard_normal((2, 6, 10)).astype(jnp.bfloat16)
  want = (np.bitwise_xor.reduce(packed.view(np.uint32), axis=-1)
          ^ np.bitwise_xor.reduce(scale.view(np.uint32), axis=-1))
  np.testing.assert_array_equal(
      np.asarray(common.read_words(jnp.asarray(packed), jnp.asarray(scale))), want)
  np.testing.assert_array_equal(np.asarray(common.read_words(jnp.asarray(w))),
                                np.bitwise_xor.reduce(w.view(np.uint32), axis=-1))


def test_mxfp4_matmul_benchmark_times_every_row_in_the_interpreter(tmp_path):
  out = tmp_path / "mxfp4.json"
  run_module("benchmarks.mxfp4_matmul", "--toy", f"--out={out}",
             "--variants=unswapped,full_x", "--triton_configs=swap64,n32_fp8")
  recs = records(out)
  rows = {(r["op"], r["shape"]["M"], r["implementation"]) for r in recs}
  ours = ("mxfp4_mosaic_gpu", "mxfp4_mosaic_gpu_full_x")
  unswapped = "mxfp4_mosaic_gpu_unswapped"   # the default swaps at M <= 16 only
  fp8 = "mxfp4_triton_n32_fp8"       # x rounded to MXFP8: checked against its own oracle
  tritons = ("mxfp4_triton", "mxfp4_triton_swap64", fp8)
  mxfp4 = ours + tritons + ("mxfp4_reference", "mxfp4_xla", "mxfp4_unpacked")
  streams = ("stream_packed", "stream_bf16")
  assert rows == {("mxfp4_matmul", m, impl) for m in (16, 72)
                  for impl in mxfp4 + streams + ("bf16_xla",)} | {
                      ("mxfp4_ragged_dot", 16, impl)
                      for impl in mxfp4 + streams + ("bf16_ragged_dot",)} | {
                          ("mxfp4_matmul", 16, unswapped), ("mxfp4_ragged_dot", 16, unswapped)}
  for r in recs:
    assert r["median_ms"] > 0 and r["commit"] and r["date"] and "jax" in r["versions"]
    assert r["timing"].startswith("wall")
    g, k, n = r["shape"]["G"], r["shape"]["K"], r["shape"]["N"]
    bits = 16 if r["implementation"].endswith("bf16") or r["implementation"].startswith(
        "bf16") else 4.25
    assert r["weight_bytes"] == g * n * k * bits / 8
  for r in recs:
    impl, m = r["implementation"], r["shape"]["M"]
    if impl in ours + (unswapped,):
      assert r["tier"] == "mosaic_gpu" and "Config(" in r["note"], r
      assert r["speedup_vs_bf16"] > 0 and r["rel_l2_vs_reference"] < 1e-2
    if impl == "mxfp4_mosaic_gpu":
      assert f"swap={m <= 16}" in r["note"], r
      assert "x_rows=" in r["note"] and "x_rows=None" not in r["note"], r
    if impl in (unswapped, "mxfp4_mosaic_gpu_full_x"):
      assert "swap=False" in r["note"], r
    if impl == "mxfp4_mosaic_gpu_full_x":
      assert "x_rows=None" in r["note"], r
    if impl in ("mxfp4_xla", "mxfp4_unpacked"):
      assert r["tier"] == impl.removeprefix("mxfp4_") and r["rel_l2_vs_reference"] < 1e-2, r
    if impl in tritons:
      assert r["tier"] == "triton" and "Config(" in r["note"], r
      assert r["speedup_vs_bf16"] > 0 and r["rel_l2_vs_reference"] < 1e-2, r
      assert ("swap=True" in r["note"]) == (impl == "mxfp4_triton_swap64"), r
      assert ("act='mxfp8'" in r["note"]) == (impl == fp8) == ("reference" in r), r
    if impl == fp8:       # bf16 output of the MXFP8 product; x's E4M3 rounding is ~3e-2
      assert r["rel_l2_vs_reference"] < 5e-3 and r["rel_l2_vs_bf16_x"] > 1e-2, r

def test_decode_matmul_benchmark_times_xla_and_the_kernel_at_the_models_shapes(tmp_path):
  out = tmp_path / "decode_matmul.json"
  run_module("benchmarks.decode_matmul", "--toy", f"--out={out}", "--configs=n32_k64")
  recs = records(out)
  names = {r["shape"]["name"] for r in recs}
  assert {"kda_w_in", "kda_o_proj", "mla_kv_a", "lm_head"} <= names, names
  for r in recs:
    assert r["implementation"] in ("xla", "triton:n32_k64"), r
    assert ("error" in r) == (r["implementation"] != "xla" and r["shape"]["K"] % 64 > 0), r
    if "error" not in r:
      assert r["median_ms"] > 0 and r["rel_l2_vs_xla_fp32"] < 1e-2, r


def test_moe_decode_gemm_benchmark_times_every_kernel_in_the_interpreter(tmp_path):
  out = tmp_path / "moe_decode.json"
  run_module("benchmarks.moe_decode_gemm", "--toy", f"--out={out}",
             "--grouped_configs=swap64_k256")
  recs = {r["implementation"]: r for r in records(out) if r["op"] == "moe_decode_gemm"}
  assert set(recs) == {"ws", "swapped", "xla", "mxfp4", "mxfp4_swap64_k256"}
  swap = recs["mxfp4_swap64_k256"]    # a decode candidate of the Triton tier, its K fitted
  assert "swap=True" in swap["config"] and "block_k=128" in swap["config"]
  assert swap["rel_l2_vs_reference"] < 1e-2 and swap["floor_bytes"] == recs["mxfp4"]["floor_bytes"]
  gate_up = {r["implementation"]: r for r in records(out) if r["op"] == "moe_decode_gate_up"}
  assert set(gate_up) == {"unfused", "fused", "fused_n32_k256_ptx"}
  for r in gate_up.values():    # from the 2 token rows; against the reference tier's gate/up
    assert r["median_ms"] > 0 and r["rel_l2_vs_reference"] < 1e-2, r
    assert r["shape"]["tokens"] == 2 and r["shape"]["N"] == 128, r
  ffn = {r["implementation"]: r for r in records(out) if r["op"] == "moe_decode_ffn"}
  assert set(ffn) == {"unfused", "expert_ffn"}
  for r in ffn.values():        # the experts whole, against the reference tier's expert_ffn
    assert r["median_ms"] > 0 and r["rel_l2_vs_reference"] < 1e-2, r
    assert r["floor_bytes"] == gate_up["fused"]["floor_bytes"] * 3 // 2, r
  for r in recs.values():
    assert r["median_ms"] > 0 and r["commit"] and r["date"] and r["timing"].startswith("wall")
    assert r["shape"]["M"] == r["shape"]["B"] * r["shape"]["top_k"] == 8
    assert 0 < r["touched_experts"] <= 8
  assert recs["ws"]["tier"] == "xla" and "below" in recs["ws"]["note"]   # 8 rows: declined
  assert "kernel='swapped'" in recs["swapped"]["config"]
  assert recs["swapped"]["rel_l2_vs_xla"] < 1e-2
  mxfp4 = recs["mxfp4"]          # the packed experts, --toy: the Triton tier interpreted
  assert mxfp4["tier"] == "triton" and mxfp4["rel_l2_vs_reference"] < 1e-2
  shape, touched = mxfp4["shape"], mxfp4["touched_experts"]
  io = shape["M"] * (shape["K"] + shape["N"]) * 2
  assert mxfp4["floor_bytes"] == touched * shape["N"] * shape["K"] * 17 // 32 + io
  assert recs["xla"]["floor_bytes"] == touched * shape["N"] * shape["K"] * 2 + io


def costs_records(module: str, tmp_path) -> list[dict]:
  """The records of a *_costs diagnostic run at its toy shape in the interpreter."""
  out = tmp_path / "costs.json"
  run_module(module, "--shapes=toy", "--interpret", f"--out={out}")
  return records(out)


def test_tgmm_costs_times_every_variant_in_the_interpreter(tmp_path):
  recs = costs_records("benchmarks.tgmm_costs", tmp_path)
  assert [r["variant"] for r in recs] == ["table", "masks", "no_masks", "aligned",
                                          "aligned_no_masks", "uniform", "no_group_rows",
                                          "no_tile_pipeline", "neither", "balance"]
  assert all(r["median_ms"] > 0 and r["shape"] == dict(G=2, M=256, K=256, N=256) for r in recs)


def test_gmm_costs_times_every_variant_in_the_interpreter(tmp_path):
  recs = costs_records("benchmarks.gmm_costs", tmp_path)
  assert [r["variant"] for r in recs] == ["table", "aligned", "uniform", "no_tma_store",
                                          "per_tile_pipelines", "order_0_8", "lhs_rows_8",
                                          "rhs_rows_8", "no_store_wait"]
  assert all(r["median_ms"] > 0 and r["rounds"] >= 1 for r in recs)


def test_gmm_costs_fit_recovers_step_and_tile_times():
  from benchmarks.gmm_costs import fit_step_and_tile
  points = [(r * (steps * 0.8 + 2.5), r, steps) for r, steps in ((25, 56), (29, 48), (32, 8))]
  s, x = fit_step_and_tile(points)
  assert abs(s - 0.8) < 1e-9 and abs(x - 2.5) < 1e-9


def test_train_step_benchmark_reports_throughput(tmp_path):
  out = tmp_path / "train.json"
  run_module("benchmarks.train_step", "--config=experiments/configs/k3_tiny.py", "--steps=1",
             "--config.model.num_layers=2", "--config.model.full_attn_layers=(2,)",
             "--config.train.global_batch_size=2", "--config.train.seq_len=64", f"--out={out}",
             f"--profile_dir={tmp_path}/trace",
             f"--compile_trace_dir={tmp_path}/compile", f"--jax_cache_dir={tmp_path}/cache")
  assert list((tmp_path / "trace").rglob("*.trace.json.gz"))
  (rec,) = records(out)
  assert rec["config"] == "k3_tiny" and rec["tokens_per_s"] > 0 and rec["loss"] > 0
  assert rec["compile_cache"] == "cold" and os.listdir(tmp_path / "cache")
  phases = [rec[k] for k in ("trace_s", "lower_s", "xla_compile_s", "warmup_s")]
  assert min(phases) >= 0 and sum(phases) <= rec["compile_and_warmup_s"] + 0.2
  names = [p["name"] for p in rec["compile_parts"]]
  assert any("Compile" in n for n in names), names  # the XLA compiler's own events
  assert rec["mfu"] > 0 and rec["total_params"] >= rec["active_params"] > 0
  work = rec["step_tflop"]
  assert work["mtp"] > 0 and work["newton_schulz"] > 0
  ratio = sum(work.values()) / work["model"]  # mfu and matmul_fraction: 4 decimals each
  assert math.isclose(rec["matmul_fraction"], rec["mfu"] * ratio, rel_tol=0.01,
                      abs_tol=1e-4 * (ratio + 1))


def test_compile_parts_counts_the_kernels_of_each_part(tmp_path):
  out = tmp_path / "compile.json"
  run_module("benchmarks.compile_parts", "--config=experiments/configs/k3_tiny.py",
             "--config.train.global_batch_size=1", "--config.train.seq_len=32",
             "--config.model.num_layers=2", "--config.model.full_attn_layers=(2,)", f"--out={out}")
  (rec,) = records(out)
  parts = {p["part"]: p for p in rec["parts"]}
  assert rec["kernels"] == sum(p["kernels"] for p in parts.values()) > 0
  for part in ("KDA layers", "MLA attention", "optimizer: Muon (Newton-Schulz, momentum)"):
    assert parts[part]["kernels"] > 0, part
  assert parts["KDA layers"]["bwd"] > 0  # the backward is attributed too


def test_compile_parts_lower_only_records_trace_and_lowering(tmp_path):
  out = tmp_path / "lower.json"
  run_module("benchmarks.compile_parts", "--config=experiments/configs/k3_tiny.py", "--lower_only",
             "--config.train.global_batch_size=1", "--config.train.seq_len=32",
             "--config.model.num_layers=2", "--config.model.full_attn_layers=(2,)", f"--out={out}")
  (rec,) = records(out)
  assert rec["op"] == "lower_step" and rec["config"] == "k3_tiny" and "kernels" not in rec
  assert rec["trace_s"] > 0 and rec["lower_s"] > 0 and rec["stablehlo_lines"] > 100


def test_kernel_counts_attributes_fusions_by_name_stack():
  text = """HloModule jit_step

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%f1, metadata={op_name="jit(step)/kda/mul"}
  %fusion.2 = f32[4]{0} fusion(f32[4]{0} %fusion.1), kind=kLoop, calls=%f2, metadata={op_name="jit(step)/transpose(jvp(kda))/mul"}
  ROOT %add.3 = f32[4]{0} add(f32[4]{0} %fusion.2, f32[4]{0} %p), metadata={op_name="jit(step)/kda/add"}
}
"""
  from benchmarks import step_parts
  assert step_parts.kernel_counts(text) == {("KDA layers", "fwd"): 1, ("KDA layers", "bwd"): 1}


def test_trace_parsing_sums_device_ops_only(tmp_path):
  from benchmarks import common
  meta = lambda pid, name: dict(ph="M", name="process_name", pid=pid, args=dict(name=name))
  op = lambda pid, name, dur: dict(ph="X", pid=pid, tid=1, name=name, ts=0, dur=dur)
  trace = dict(traceEvents=[
      meta(1, "/device:GPU:0"), meta(2, "/host:CPU"),
      op(1, "kda_intra_vjp", 2400.0), op(1, "fusion", 30.0), op(1, "fusion", 20.0),
      op(1, "kda_state", 200.0), op(2, "PjitFunction(loss)", 9000.0)])
  assert common.device_op_times(trace) == [
      ("kda_intra_vjp", 1, 2400.0), ("kda_state", 1, 200.0), ("fusion", 2, 50.0)]
  trace["traceEvents"][2]["args"] = dict(hlo_module="jit_bwd", hlo_op="mpmd_map.1")
  assert common.device_op_times(trace, by_hlo_op=True)[0] == (
      "[jit_bwd: mpmd_map.1] kda_intra_vjp", 1, 2400.0)
  nested = tmp_path / "plugins" / "profile" / "run"
  nested.mkdir(parents=True)
  (nested / "vm.trace.json.gz").write_bytes(b"")
  assert common.find_trace(str(tmp_path)) == nested / "vm.trace.json.gz"


def test_launch_gaps_splits_idle_by_cause():
  """Kernel b starts 10 us after a ends and was launched after a ended: host wait. Kernel c
  starts 5 us after b, launched long before: other idle. d belongs to another module."""
  from benchmarks import common
  meta = lambda pid, name: dict(ph="M", name="process_name", pid=pid, args=dict(name=name))
  kern = lambda name, ts, dur, cid, mod="jit_step": dict(
      ph="X", pid=1, tid=1, name=name, ts=ts, dur=dur,
      args=dict(correlation_id=cid, hlo_module=mod))
  launch = lambda ts, dur, cid: dict(ph="X", pid=2, tid=7, name="launch", ts=ts, dur=dur,
                                     args=dict(correlation_id=cid))
  trace = dict(traceEvents=[
      meta(1, "/device:GPU:0"), meta(2, "/host:CPU"),
      launch(0, 2, "1"), kern("a", 5, 20, "1"),
      launch(22, 8, "2"), kern("b", 35, 10, "2"),
      launch(24, 3, "3"), kern("c", 50, 10, "3"),
      launch(26, 3, "4"), kern("d", 100, 10, "4", mod="jit_other")])
  g = common.launch_gaps(trace, "jit_step")
  assert (g["kernels"], g["busy_us"], g["span_us"]) == (3, 40, 55)
  assert (g["host_wait_us"], g["other_idle_us"]) == (10, 5)
  assert (g["launch_us"], g["launch_interval_us"]) == (3, 12)
  assert common.launch_gaps(trace)["kernels"] == 4


def test_device_ms_refuses_a_run_without_device_timeline():
  import jax
  import jax.numpy as jnp
  import pytest
  from benchmarks import common
  if jax.devices()[0].platform != "cpu":
    pytest.skip("the refusal is for CPU runs")
  with pytest.raises(RuntimeError, match="no device timeline"):
    common.device_ms(jax.jit(lambda a: a + 1), jnp.ones(3), reps=2)


def test_decode_attention_benchmark_times_every_tier_in_the_interpreters(tmp_path):
  out = tmp_path / "decode.json"
  run_module("benchmarks.decode_attention", "--toy", f"--out={out}")
  recs = records(out)
  impls = ("reference", "xla", "mosaic_gpu", "mosaic_tpu")
  assert {(r["shape"]["B"], r["shape"]["length"], r["implementation"]) for r in recs} == {
      (b, n, impl) for b in (1, 2) for n in (256, 32) for impl in impls}
  for r in recs:
    shape = r["shape"]
    assert r["tier"] == r["implementation"] and r["median_ms"] > 0, r
    assert r["timing"] == "wall_once" and r["commit"] and "jax" in r["versions"]
    assert r["bytes_read"] == shape["B"] * (shape["length"] * shape["Dk"] * 2 + shape["T"]
                                            * shape["H"] * (shape["Dk"] + shape["Dv"]) * 2)
    if r["implementation"] != "reference":
      assert r["max_err_vs_reference"] < 1e-2, r


def test_decode_benchmark_records_every_variant_and_context(tmp_path):
  out = tmp_path / "decode.json"
  run_module("benchmarks.decode", "--toy", f"--out={out}", f"--profile_dir={tmp_path}/prof")
  for variant in ("hybrid", "all_mla", "kda_only"):
    parts = json.loads((tmp_path / "prof" / f"{variant}_B2" / "parts.json").read_text())
    assert {"MoE expert GEMMs", "norms"} <= {p["part"] for p in parts}, parts
    assert ("MLA attention" in {p["part"] for p in parts}) == (variant != "kda_only")
  recs = records(out)
  # (MLA layers, KDA layers) of the 2-layer k3_tiny and its twins.
  layers = {"hybrid": (1, 1), "all_mla": (2, 0), "kda_only": (0, 2)}
  assert {(r["variant"], r["shape"]["B"], r["shape"]["context"]) for r in recs} == {
      (v, 2, n) for v in layers for n in (32, 64)}
  # Per sequence: a bf16 latent of kr 16 + dr 8 per token and MLA layer; per KDA layer an fp32
  # state of 2 heads x 16 x 16 and three bf16 conv tails of 3 taps x 32 channels.
  latent, kda = (16 + 8) * 2, 2 * 16 * 16 * 4 + 3 * 3 * 32 * 2
  for r in recs:
    mla, linear = layers[r["variant"]]
    n = r["shape"]["context"]
    assert r["cache_bytes_per_seq"] == mla * latent * n + linear * kda, r
    assert r["cache_bytes_per_step"] == 2 * (mla * latent * n + 2 * linear * kda), r
    assert r["decode_attention_tier"] == ("xla" if mla else "")
    # tpot is a difference of two wall times: its sign on a busy CPU is noise.
    assert math.isfinite(r["tpot_ms"]) and math.isfinite(r["call_overhead_ms"])
    assert r["prefill_tokens_per_s"] > 0 and r["moe_decode_experts"] == "all"
    assert r["moe_kernels"] is None
    assert 0 < r["floor_ms"] and r["weight_bytes_per_step"] > 0 and r["timing"] == "wall_once"
    assert r["commit"] and "jax" in r["versions"]


def test_decode_benchmark_counts_packed_experts_in_its_floor():
  """With --expert_format=mxfp4 the floor's weight bytes are the float model's less the routed
  experts' selected share of (bf16 bytes - packed bytes), and the packed experts are random.
  In a subprocess: benchmarks.decode's absl flags would collide with other benchmark modules
  a test worker has imported."""
  check = """
import math
import jax
import numpy as np
from flax import nnx
from benchmarks import decode
from k3jax import latent_moe
from k3jax.model import K3ForCausalLM
models = {}
for fmt in ("float", "mxfp4"):
  cfg = decode.variant_config("hybrid", True, expert_format=fmt)
  models[fmt] = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels)
decode.randomize_packed_experts(models["mxfp4"], jax.random.key(1))
moe = models["float"].cfg.moe
batch = 3
share = 1 - (1 - moe.num_experts_per_tok / moe.num_experts) ** batch
packed = nnx.to_flat_state(nnx.state(models["mxfp4"], latent_moe.PackedExperts))
params = nnx.to_flat_state(nnx.state(models["float"], nnx.Param))
float_experts = [v.get_value() for p, v in params
                 if "experts" in map(str, p) and str(p[-1]) in latent_moe.EXPERT_WEIGHTS]
assert packed and len(float_experts) * 2 == len(packed)
float_bytes = sum(x.size * 2 for x in float_experts)  # bf16 parameters
packed_bytes = sum(v.get_value().size for _, v in packed)
assert packed_bytes == float_bytes // 4 + float_bytes // 64  # 4 bits a weight, a byte a block
want = decode.weight_bytes_per_step(models["float"], batch) - share * (float_bytes - packed_bytes)
assert math.isclose(decode.weight_bytes_per_step(models["mxfp4"], batch), want, rel_tol=1e-9)
for path, var in packed:
  x = np.asarray(var.get_value())
  if str(path[-1]).endswith("_scale"):
    assert x.min() >= 120 and x.max() <= 127, path
  else:
    assert len(np.unique(x)) > 200, path
"""
  run_python("-c", check)


def test_triton_sass_reads_the_kernels_triton_module_and_its_k_loop():
  """benchmarks.triton_sass without the `triton` package: the MXFP4 triton tier's module read
  from the call lowered for an H200 (16 rows' default config: n32 with the inline-PTX
  dequantization, 96 programs at N 3072), and the K loop found in a cuobjdump listing by its
  backward branch."""
  from benchmarks import triton_sass
  [(name, params, text)] = triton_sass.triton_modules(triton_sass.lower(None, 16, 3584, 3072, 1))
  assert name == "mxfp4_matmul_triton"
  assert params == dict(num_warps=4, num_stages=4, grid_x=96, grid_y=1, grid_z=1)
  assert "tt.func" in text and "tt.dot" in text and "mul.rn.bf16x2" in text
  assert "loc(" not in text
  # The fused gate/up of 16 tokens on each of 64 experts in n64_k64 (a DECODE_CONFIGS entry).
  cfg = triton_sass.mx_triton.DECODE_CONFIGS["n64_k64"]
  [(name, params, text)] = triton_sass.triton_modules(
      triton_sass.lower(cfg, 16, 512, 512, 64, op="gate_up"))
  assert name == "mxfp4_gate_up_triton" and (params["grid_x"], params["grid_y"]) == (8, 65)
  assert "tt.dot" in text
  # An outer loop (0x10-0x60) around the K loop (0x20-0x50), then a shorter loop (0x80-0x90):
  # the largest innermost one counts.
  listing = "\n".join(f"        /*{a:04x}*/  {op} ;  /* 0x0 */" for a, op in [
      (0x00, "MOV R1, c[0x0][0x28]"), (0x10, "IADD3 R9, R9, 0x1"), (0x20, "LDS R2, [R0]"),
      (0x30, "LOP3.LUT R3, R2"), (0x40, "HMUL2 R4, R3, R5"), (0x50, "@P0 BRA 0x20"),
      (0x60, "@P1 BRA 0x10"), (0x70, "MOV R2, RZ"), (0x80, "STG.E [R6], R2"),
      (0x90, "@P2 BRA 0x80"), (0xa0, "EXIT")])
  assert triton_sass.sass_counts(listing) == dict(
      sass_instructions=11, loop_instructions=4, loop_opcodes={"LDS": 1, "LOP3": 1, "HMUL2": 1,
                                                               "BRA": 1})


def test_mxfp4_ncu_calls_the_grouped_and_the_dense_product():
  """benchmarks.mxfp4_ncu (the program Nsight Compute profiles) on the reference tier, small
  shapes, grouped and dense; in a subprocess (its flags' names are triton_sass's)."""
  for groups in ("8", "1"):
    run_module("benchmarks.mxfp4_ncu", "--impl=reference", "--k=512", "--n=256", "--calls=2",
               f"--groups={groups}")


def test_muon_ns_benchmark_times_orthogonalize_and_its_groups(tmp_path):
  out = tmp_path / "muon.json"
  run_module("benchmarks.muon_ns", "--toy", f"--out={out}")
  recs = {r["implementation"]: r for r in records(out)}
  whole = recs.pop("orthogonalize")
  assert recs and whole["median_ms"] > 0 and whole["ns_dtype"] == "bfloat16"
  alone = recs.pop("orthogonalize_per_leaf")
  assert alone["median_ms"] > 0 and alone["tflop"] == whole["tflop"]
  for name, r in recs.items():
    b, m, n = (int(v) for v in name.removeprefix("ns_").removeprefix("folded_").split("x"))
    assert (r["blocks"], r["m"], r["n"]) == (b, m, n) and m <= n
    assert r["fold"] == name.startswith("ns_folded_")
    assert r["tflop"] == round(b * 5 * (4 * m * m * n + 2 * m ** 3) / 1e12, 3)
  plain = [r for r in recs.values() if not r["fold"]]
  assert len(plain) * 2 == len(recs)
  assert sum(r["tflop"] for r in plain) <= whole["tflop"] + 1e-3


def test_lm_head_benchmark_times_dense_and_every_block_size(tmp_path):
  out = tmp_path / "lm_head.json"
  run_module("benchmarks.lm_head", "--toy", "--block_tokens=64,128", f"--out={out}")
  recs = {r["implementation"]: r for r in records(out)}
  assert set(recs) == {"dense", "blockwise_bt64", "blockwise_bt128"}
  for r in recs.values():
    assert (r["N"], r["d"], r["V"]) == (256, 64, 1000) and r["median_ms"] > 0
    assert r["model_tflop"] == round(6 * 256 * 64 * 1000 / 1e12, 3)
    assert abs(r["loss_minus_dense"]) < 1e-3
