r"""Where the device time goes in an XLA profiler trace: total time per kernel / XLA op.

Reads the `*.trace.json.gz` that `jax.profiler.trace` writes (e.g. `benchmarks/kda.py
--profile_dir=DIR`) and prints, for the device timelines (`/device:...`), each op's summed
duration, call count and share of the device time, largest first.

  python3 -m benchmarks.trace_summary --trace=DIR_OR_FILE [--top=30] [--launch_gaps=MODULE]
"""
import gzip
import json

from absl import app, flags

from benchmarks.common import device_op_times, find_trace, launch_gaps

_TRACE = flags.DEFINE_string("trace", None, "A .trace.json.gz file, or a directory to search.")
_TOP = flags.DEFINE_integer("top", 30, "Rows to print.")
_NAME_CHARS = 140   # printed; rows are grouped by the whole name (long CUDA template names)
_BY_HLO_OP = flags.DEFINE_bool("by_hlo_op", False,
                               "Group by (kernel, HLO module, HLO op): which op of which jit "
                               "each kernel ran for.")
_LAUNCH_GAPS = flags.DEFINE_string(
    "launch_gaps", None, "Also print whether the device waited on the host's kernel launches "
    "(`common.launch_gaps`) over this HLO module's kernels (\"all\": every kernel).")


def main(argv):
  del argv
  path = find_trace(_TRACE.value)
  with gzip.open(path) as f:
    trace = json.load(f)
  rows = device_op_times(trace, _BY_HLO_OP.value)
  total = sum(us for _, _, us in rows)
  print(f"{path}\ndevice time {total / 1e3:.3f} ms in {sum(n for _, n, _ in rows)} ops")
  for name, n, us in rows[:_TOP.value]:
    shown = name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS - 3] + "..."
    print(f"{us / 1e3:9.3f} ms {100 * us / total:5.1f}% {n:5d}x  {shown}")
  if _LAUNCH_GAPS.value:
    g = launch_gaps(trace, None if _LAUNCH_GAPS.value == "all" else _LAUNCH_GAPS.value)
    print(f"launch gaps: {g['kernels']} kernels, device busy {g['busy_us'] / 1e3:.3f} of "
          f"{g['span_us'] / 1e3:.3f} ms; idle waiting on launches {g['host_wait_us'] / 1e3:.3f} "
          f"ms, other idle {g['other_idle_us'] / 1e3:.3f} ms; launch call {g['launch_us']:.1f} "
          f"us, one launch every {g['launch_interval_us']:.1f} us (medians)")


if __name__ == "__main__":
  flags.mark_flag_as_required("trace")
  app.run(main)
