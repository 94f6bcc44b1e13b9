"""benchmarks/scale_out.py: run specs, the trace's collective and idle shares, the derived
efficiency and loss comparison, and one expert-parallel toy run end to end on 2 CPU devices."""
import json
import os
import pathlib
import subprocess
import sys

from absl import flags
import pytest

from benchmarks import scale_out

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_importing_defines_no_flags():
  """The tests import the module beside other benchmark modules with flags of the same names
  (--out, --config, --steps): only the program defines its flags."""
  assert "run_one" not in flags.FLAGS and "runs" not in flags.FLAGS


def test_run_specs_fill_batch_and_micro_batches():
  assert scale_out.parse_spec("data=2,expert=2", 2) == dict(
      data=2, expert=2, pipeline=1, context=1, batch=8, accum=1, devices=4)
  assert scale_out.parse_spec("pipeline=2,data=2,accum=8", 2) == dict(
      data=2, expert=1, pipeline=2, context=1, batch=4, accum=8, devices=4)
  assert scale_out.parse_spec("pipeline=4", 1)["accum"] == 8
  assert scale_out.parse_spec("data=1,batch=6", 2)["batch"] == 6
  for bad in ("data=0", "dat=2", "data", "data=x", "expert=2,,accum=-1"):
    with pytest.raises(ValueError, match="bad item"):
      scale_out.parse_spec(bad, 2)


def _trace(kernels):
  """A trace of two devices: (device, name, start us, duration us) kernels."""
  events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": f"/device:GPU:{p}"}}
            for p in (0, 1)]
  events.append({"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}})
  events += [{"ph": "X", "pid": p, "tid": 1, "name": n, "ts": t, "dur": d}
             for p, n, t, d in kernels]
  return {"traceEvents": events}


def test_trace_shares_split_collectives_exposure_and_idle():
  """Device 0: compute 0-40 and 60-100, an all-to-all 30-50 (10 us exposed), a send-recv
  90-100 (hidden by compute); device 1: compute 0-50, all-reduce 70-100 (exposed), idle 50-70.
  Two steps: per-step values are half the totals. Host events do not count."""
  trace = _trace([(0, "fusion.1", 0, 40), (0, "fusion.2", 60, 40),
                  (0, "ncclDevKernel_AllToAll", 30, 20), (0, "ncclKernel_SendRecv", 90, 10),
                  (1, "gemm", 0, 50), (1, "ncclDevKernel_AllReduce_Sum_f32", 70, 30),
                  (9, "host thing", 0, 1000)])
  got = scale_out.trace_shares(trace, steps=2)
  d0, d1 = got["per_device"]["/device:GPU:0"], got["per_device"]["/device:GPU:1"]
  assert d0["span_ms"] == 0.05 and d0["idle_ms"] == 0.005      # 50-60 idle
  assert d0["all_to_all_ms"] == 0.01 and d0["all_to_all_exposed_ms"] == 0.005
  assert d0["permute_ms"] == 0.005 and d0["permute_exposed_ms"] == 0
  assert d1["other_ms"] == 0.015 and d1["other_exposed_ms"] == 0.015 and d1["idle_ms"] == 0.01
  assert got["shares"]["idle_share"] == pytest.approx((0.1 + 0.2) / 2, abs=1e-4)
  assert got["shares"]["all_to_all_share"] == pytest.approx(0.2 / 2, abs=1e-4)


def test_collective_kinds():
  kinds = {"ncclDevKernel_AllToAll_RING": "all_to_all", "ragged-all-to-all.3": "all_to_all",
           "collective-permute-start": "permute", "ncclDevKernel_SendRecv": "permute",
           "all-gather-start.2": "other", "reduce-scatter": "other", "fusion.12": None,
           "nvjet_tst_128x256": None}
  assert {n: scale_out.collective_kind(n) for n in kinds} == kinds


def test_derive_efficiency_and_loss_against_the_right_single_device_run():
  rec = lambda run, devices, pdb, batch, tok, losses: dict(
      run=run, devices=devices, per_device_batch=pdb, global_batch=batch, seq_len=32,
      tokens_per_s_per_device=tok, losses=losses)
  records = [rec("data=1", 1, 2.0, 2, 100.0, [4.0, 3.0]),
             rec("data=1,batch=4", 1, 4.0, 4, 150.0, [4.0, 2.0]),
             rec("data=2", 2, 2.0, 4, 95.0, [4.0, 2.002])]
  scale_out.derive(records)
  assert records[2]["scaling_efficiency"] == 0.95             # against data=1 (same per device)
  assert records[2]["max_loss_rel_diff"] == pytest.approx(1e-3)   # against batch=4 (same math)
  assert records[0]["scaling_efficiency"] == 1.0 and records[1]["max_loss_rel_diff"] == 0.0


def test_expert_parallel_toy_run_records_throughput_memory_and_losses(tmp_path):
  out = tmp_path / "scale.json"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "benchmarks.scale_out", "--toy", "--steps=5",
                         "--runs=expert=2", f"--out={out}"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (r,) = json.loads(out.read_text())
  assert r["mesh"] == dict(data=1, expert=2, pipeline=1, context=1) and r["devices"] == 2
  assert r["global_batch"] == 4 and r["per_device_batch"] == 2
  assert len(r["losses"]) == 5 and all(0 < loss < 20 for loss in r["losses"])
  assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and len(r["peak_memory_bytes"]) == 2
  assert r["trace"] is None                  # a CPU trace has no device timeline
  assert r["scaling_efficiency"] is None     # no one-device run in this invocation
  assert r["commit"] and r["date"]
