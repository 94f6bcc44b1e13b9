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
