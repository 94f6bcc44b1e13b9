r"""Where the device time goes in an XLA profiler trace: total time per kernel / XLA op.

Reads the `*.trace.json.gz` that `jax.profiler.trace` writes (e.g. `benchmarks/kda.py
--profile_dir=DIR`) and prints, for the device timelines (`/device:...`), each op's summed
duration, call count and share of the device time, largest first.

  python3 -m benchmarks.trace_summary --trace=DIR_OR_FILE [--top=30]
"""
import collections
import gzip
import json
import pathlib

from absl import app, flags

_TRACE = flags.DEFINE_string("trace", None, "A .trace.json.gz file, or a directory to search.")
_TOP = flags.DEFINE_integer("top", 30, "Rows to print.")
_NAME_CHARS = 140   # printed; rows are grouped by the whole name (long CUDA template names)
_BY_HLO_OP = flags.DEFINE_bool("by_hlo_op", False,
                               "Group by (kernel, HLO module, HLO op): which op of which jit "
                               "each kernel ran for.")


def find_trace(path: str) -> pathlib.Path:
  """The newest *.trace.json.gz at or under `path`."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  found = sorted(p.rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {path}")
  return found[-1]


def device_op_times(trace: dict, by_hlo_op: bool = False) -> list[tuple[str, int, float]]:
  """(op name, calls, total microseconds) on the device timelines, largest total first; with
  `by_hlo_op` the name is prefixed by the HLO module and op the kernel ran for."""
  events = trace["traceEvents"]
  devices = {e["pid"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"
             and e["args"]["name"].startswith("/device:")}
  totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    if e.get("ph") == "X" and e["pid"] in devices:
      name = e["name"]
      if by_hlo_op:
        args = e.get("args", {})
        name = f"[{args.get('hlo_module', '?')}: {args.get('hlo_op', '?')}] {name}"
      totals[name][0] += 1
      totals[name][1] += float(e["dur"])
  return sorted(((name, n, us) for name, (n, us) in totals.items()), key=lambda r: -r[2])


def main(argv):
  del argv
  path = find_trace(_TRACE.value)
  with gzip.open(path) as f:
    rows = device_op_times(json.load(f), _BY_HLO_OP.value)
  total = sum(us for _, _, us in rows)
  print(f"{path}\ndevice time {total / 1e3:.3f} ms in {sum(n for _, n, _ in rows)} ops")
  for name, n, us in rows[:_TOP.value]:
    shown = name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS - 3] + "..."
    print(f"{us / 1e3:9.3f} ms {100 * us / total:5.1f}% {n:5d}x  {shown}")


if __name__ == "__main__":
  flags.mark_flag_as_required("trace")
  app.run(main)
