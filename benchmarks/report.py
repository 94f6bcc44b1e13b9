r"""Renders BENCHMARKS.md tables from benchmarks/results/*.json.

`python -m benchmarks.report` prints the tables; BENCHMARKS.md embeds them between
`<!-- tables -->` markers, refreshed by `python -m benchmarks.report --write`.
"""
import glob
import json
import os

from absl import app, flags

_WRITE = flags.DEFINE_bool("write", False, "Rewrite the tables inside BENCHMARKS.md.")
_MARK_BEGIN, _MARK_END = "<!-- tables -->", "<!-- /tables -->"
_SKIP = ("op", "versions", "error", "configs", "device", "date")
_MAX_CHARS = 90


def _fmt(v):
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
  if isinstance(v, dict):
    return " ".join(f"{k} {x:.1e}" if isinstance(x, float) else f"{k}{x}" for k, x in v.items())
  text = str(v)
  return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS - 3] + "..."


def table(records: list[dict], columns: list[str]) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in records:
    lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
  return "\n".join(lines)


def render() -> str:
  out = []
  for path in sorted(glob.glob("benchmarks/results/*.json")):
    with open(path) as f:
      records = json.load(f)
    if not records:
      continue
    ops = sorted({r.get("op", "?") for r in records})
    for op in ops:
      recs = [r for r in records if r.get("op") == op]
      keys = []
      for r in recs:
        keys += [k for k in r if k not in keys and k not in _SKIP]
      if any("error" in r for r in recs):
        keys.append("error")
      where = sorted({f"{r.get('device')}, {r.get('date')}" for r in recs})
      out.append(f"### `{op}` ({os.path.basename(path)}; {'; '.join(where)})\n\n"
                 + table(recs, keys))
  return "\n\n".join(out)


def main(argv):
  del argv
  text = render()
  if not _WRITE.value:
    print(text)
    return
  with open("BENCHMARKS.md") as f:
    doc = f.read()
  head, _, rest = doc.partition(_MARK_BEGIN)
  _, _, tail = rest.partition(_MARK_END)
  with open("BENCHMARKS.md", "w") as f:
    f.write(f"{head}{_MARK_BEGIN}\n{text}\n{_MARK_END}{tail}")


if __name__ == "__main__":
  app.run(main)
