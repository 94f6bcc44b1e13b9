"""Smoke test of benchmarks/attention.py at toy size on CPU: the CPU tiers run forward and
forward+backward, the GPU/TPU tiers are reported as declined; the max-logit rows (the Triton
kernel interpreted) run."""
from test_benchmarks import records, run_module


def test_attention_benchmark_smoke(tmp_path):
  out = tmp_path / "attention.json"
  run_module("benchmarks.attention", "--smoke", f"--out={out}")
  recs = records(out)
  got = {(r["implementation"], r["pass"]) for r in recs}
  assert got == {(name, kind) for name in ("reference", "xla_blockwise")
                 for kind in ("fwd", "fwd_bwd")} | {
                     ("max_logit_triton", "max_logit"), ("max_logit_xla_blockwise", "max_logit")}
  assert all(r["median_ms"] > 0 and r["shape"]["T"] == 128 for r in recs)
