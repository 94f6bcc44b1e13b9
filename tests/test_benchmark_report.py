"""benchmarks/report.py: which records its tables show, their provenance from git, and how it
rewrites BENCHMARKS.md (a throwaway git repo stands in for the project's history)."""
import json
import pathlib
import subprocess

import pytest

from benchmarks import report


def git(root: pathlib.Path, *args: str) -> str:
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                        check=True, capture_output=True, text=True).stdout.strip()


def commit_records(root: pathlib.Path, records: list[dict]) -> str:
  path = root / "benchmarks" / "results" / "moe_h200.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(records, indent=1))
  git(root, "add", "-A")
  git(root, "commit", "-q", "-m", "records")
  return git(root, "rev-parse", "--short", "HEAD")


def rec(impl: str, ms: float, **extra) -> dict:
  return dict(op="top_k", implementation=impl, shape=dict(N=8, E=4, k=2), median_ms=ms,
              date="2026-12-01", **extra)


def test_tables_show_newest_records_with_the_commit_that_added_them(tmp_path):
  git(tmp_path, "init", "-q")
  first = commit_records(tmp_path, [rec("lax", 0.05), rec("triton", 0.02)])
  # A rerun of triton: the old record is kept as triton@old with a note; the new one is added.
  second = commit_records(tmp_path, [rec("lax", 0.05), rec("triton@old", 0.02, note="older"),
                                     rec("triton", 0.01), rec("ranks", None, error="boom")])
  res = report.Results(tmp_path, "moe_h200.json")
  current = {r["implementation"]: r for r in res.current("top_k")}
  assert set(current) == {"lax", "triton"} and current["triton"]["median_ms"] == 0.01
  assert res.provenance(current["lax"]) == f"2026-12-01 {first}"
  assert res.provenance(current["triton"]) == f"2026-12-01 {second}"
  table = report.top_k(tmp_path)
  assert "| N8 E4 k2 | 50.0 | 10.0 |" in table
  assert first in table and second in table


def test_uncommitted_records_say_so(tmp_path):
  path = tmp_path / "benchmarks" / "results" / "moe_h200.json"
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps([rec("lax", 0.05)]))
  res = report.Results(tmp_path, "moe_h200.json")
  assert res.provenance(res.records[0]) == "2026-12-01 not yet committed"


def test_fill_replaces_only_between_markers():
  doc = "intro\n<!-- report:a -->\nold\n<!-- /report:a -->\nprose\n"
  assert report.fill(doc, {"a": "new"}) == (
      "intro\n<!-- report:a -->\nnew\n<!-- /report:a -->\nprose\n")
  with pytest.raises(ValueError, match="table 'b'"):
    report.fill(doc, {"b": "x"})


def test_every_table_of_benchmarks_md_renders_from_the_records():
  doc = (report._ROOT / "BENCHMARKS.md").read_text()
  filled = report.fill(doc, report.render())
  assert all(f"<!-- report:{name} -->" in filled for name in report.TABLES)


def write_records(root: pathlib.Path, name: str, records: list[dict]) -> None:
  path = root / "benchmarks" / "results" / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(records, indent=1))


def test_mxfp4_matmul_table(tmp_path):
  def mx(op, impl, m, ms, **extra):
    groups = 8 if op == "mxfp4_ragged_dot" else 1
    return dict(op=op, implementation=impl, shape=dict(M=m, K=64, N=32, G=groups), median_ms=ms,
                date="2026-12-02", copy_tbps=4.0, copy_source="a table", **extra)
  write_records(tmp_path, "mxfp4_h200.json", [
      mx("mxfp4_ragged_dot", "mxfp4_mosaic_gpu", 16, 0.05, weight_tbps=0.8, copy_fraction=0.2),
      mx("mxfp4_ragged_dot", "mxfp4_unpacked", 16, 0.08),
      mx("mxfp4_ragged_dot", "bf16_ragged_dot", 16, 0.04),
      mx("mxfp4_ragged_dot", "mxfp4_mosaic_gpu", 1024, 0.3),
      mx("mxfp4_ragged_dot", "mxfp4_unpacked", 1024, 0.2),
      mx("mxfp4_ragged_dot", "bf16_ragged_dot", 1024, 0.1),
      mx("mxfp4_matmul", "mxfp4_mosaic_gpu", 1, 0.03, weight_tbps=0.5, copy_fraction=0.12),
      mx("mxfp4_matmul", "mxfp4_mosaic_gpu", 1, 0.02, weight_tbps=0.5, copy_fraction=0.12),
      mx("mxfp4_matmul", "mxfp4_mosaic_gpu_select", 1, 0.025),
      mx("mxfp4_matmul", "mxfp4_triton", 1, 0.03),
      mx("mxfp4_matmul", "mxfp4_triton_n32", 1, 0.015),
      mx("mxfp4_matmul", "mxfp4_triton_n64", 1, 0.018),
      mx("mxfp4_ragged_dot", "mxfp4_triton", 16, 0.06),
      mx("mxfp4_matmul", "mxfp4_unpacked", 1, 0.012),
      mx("mxfp4_matmul", "mxfp4_reference", 1, 0.01),
      mx("mxfp4_matmul", "bf16_xla", 1, 0.008),
      mx("mxfp4_matmul", "mxfp4_unpacked", 32, 0.016),
      mx("mxfp4_matmul", "bf16_xla", 32, 0.012),
      mx("mxfp4_matmul", "mxfp4_reference", 4096, None, error="boom"),
  ])
  lines = report.mxfp4_matmul(tmp_path).splitlines()
  # The newest record of each row, dense before grouped; the tier Hopper's dispatch picks at
  # each shape (triton at one dense row, unpacked above 16; grouped triton up to 8 rows per
  # expert, the kernel below 128, else unpacked) against bf16; variants of our kernel left out;
  # the Triton kernel's fastest config.
  assert lines[2:] == [
      "| `mxfp4_matmul` M1 K64 N32 G1 | 20.0 | 15.0 (n32) | 12.0 | 10.0 | 8.0 | triton: 0.27x "
      "| 0.50 (12%) |",
      "| `mxfp4_matmul` M32 K64 N32 G1 |  |  | 16.0 |  | 12.0 | unpacked: 0.75x |  |",
      "| `mxfp4_ragged_dot` M16 K64 N32 G8 | 50.0 | 60.0 (default) | 80.0 |  | 40.0 | "
      "triton: 0.67x | 0.80 (20%) |",
      "| `mxfp4_ragged_dot` M1024 K64 N32 G8 | 300.0 |  | 200.0 |  | 100.0 | unpacked: 0.50x "
      "|  |",
      "",
      "Copy rate 4.0 TB/s: a table. Recorded (benchmarks/results/mxfp4_h200.json; date measured, "
      "commit that added it): 2026-12-02 not yet committed."]


def test_decode_attention_table(tmp_path):
  def dec(impl, b, h, length, ms, **extra):
    return dict(op="decode_attention", implementation=impl, date="2026-12-02",
                shape=dict(B=b, S=64, length=length, H=h, T=1, Dk=8, Dv=4), median_ms=ms,
                copy_tbps=4.2, **extra)
  write_records(tmp_path, "decode_attention_h200.json", [
      dec("reference", 2, 8, 64, 0.5), dec("xla", 2, 8, 64, 0.25),
      dec("mosaic_gpu", 2, 8, 64, 0.125, floor_fraction=0.8, tbps=3.36),
      dec("mosaic_tpu", 2, 8, 64, None, note="not a TPU"),
      dec("reference", 2, 8, 8, 0.5), dec("mosaic_gpu", 2, 8, 8, 0.0625, note="older"),
      dec("mosaic_gpu", 2, 8, 8, 0.03, floor_fraction=0.25, tbps=1.05),
      dec("xla", 1, 64, 64, 0.1)])
  lines = report.decode_attention(tmp_path).splitlines()
  # Rows by B, H, S, then the fuller row first; a declined tier shows no cell.
  assert lines[2:6] == [
      "| B 1, H 64, S 64, filled 64 |  | 0.100 |  |  |",
      "| B 2, H 8, S 64, filled 64 | 0.500 | 0.250 | 0.125 | 80% (3.36 TB/s) |",
      "| B 2, H 8, S 64, filled 8 | 0.500 |  | 0.030 | 25% (1.05 TB/s) |",
      ""]
  assert lines[6].startswith("Floor: the bytes a call must read at the copy rate, 4.2 TB/s: "
                             "measured in the run. Recorded")


def test_decode_table_keeps_packed_expert_runs_in_rows_of_their_own(tmp_path):
  """A run with `--expert_format=mxfp4` does not replace the bf16 run of the same (variant, B,
  context): both show, the packed one labelled."""
  def decode(variant: str, tpot: float, expert_format=None) -> dict:
    return dict(op="decode", variant=variant, shape=dict(B=16, context=4096), tpot_ms=tpot,
                floor_ms=0.5, decode_tokens_per_s=16e3 / tpot, cache_bytes_per_seq=2 ** 20,
                copy_tbps=4.3, moe_kernels=None, expert_format=expert_format, date="2026-12-03")
  path = tmp_path / "benchmarks" / "results" / "decode_h200.json"
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps([decode("hybrid", 3.0), decode("all_mla", 6.0),
                              decode("hybrid", 2.0, "mxfp4"), decode("all_mla", 5.0, "mxfp4")]))
  table = report.decode(tmp_path)
  assert "| B 16, context 4096 | 3.00 (0.50) | 6.00 (0.50) |  | 2.00 |" in table
  assert "| B 16, context 4096, MXFP4 experts | 2.00 (0.50) | 5.00 (0.50) |  | 2.50 |" in table
