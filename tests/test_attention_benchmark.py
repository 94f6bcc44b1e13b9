"""Smoke test of benchmarks/attention.py at toy size on CPU: the CPU tiers run forward and
forward+backward, the GPU/TPU tiers are reported as declined."""
from absl import flags

from benchmarks import attention as bench


def test_attention_benchmark_smoke():
  flags.FLAGS(["attention", "--smoke"])
  records = bench.main([])
  got = {(r["implementation"], r["pass"]) for r in records}
  assert got == {(name, kind) for name in ("reference", "xla_blockwise")
                 for kind in ("fwd", "fwd_bwd")}
  assert all(r["median_ms"] > 0 and r["shape"]["T"] == 64 for r in records)
