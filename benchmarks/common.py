"""Shared timing and record helpers for the side-by-side benchmarks (see BENCHMARKS.md)."""
import collections
import datetime
import gzip
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def time_jax(fn: Callable, *args, warmup: int = 3, reps: int = 30,
             budget_s: float | None = None, calls: int = 10) -> float:
  """Median milliseconds per call of `fn(*args)` (jitted): each repetition issues `calls`
  back-to-back calls and waits for the last, so dispatch overlaps the device work, as in a
  training loop and in `triton.testing.do_bench`'s back-to-back launches.

  With `budget_s`, stops repeating once that much time was spent (after at least 5 reps).
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3 / calls)
    if budget_s is not None and calls * sum(times) > 1e3 * budget_s and len(times) >= 5:
      break
  return statistics.median(times)


def time_jax_once(fn: Callable, *args) -> float:
  """Milliseconds of one call after one warm-up: smoke runs in the interpreter (CI) check that
  a benchmark runs, not its speed."""
  return time_jax(fn, *args, warmup=1, reps=1, calls=1)


def copy_tbps() -> float:
  """Bytes read + written per device second (TB/s) of an elementwise pass over 1 GiB of fp32:
  the HBM ceiling of memory-bound kernels. (A uint8 pass reached only 1.7 TB/s on the H200,
  2026-12-02: XLA's byte-wide loads, not the memory; torch's copy gives 4.2.)"""
  a = jnp.zeros(2 ** 28, jnp.float32)
  ms = device_ms(jax.jit(lambda v: v + 1), a, reps=10)
  return 2 * 2 ** 30 / ms / 1e9


def read_words(*arrays: jax.Array) -> jax.Array:
  """Each array [..., L] (1- or 2-byte elements, L * itemsize a multiple of 4) read once as
  uint32 words, xor-reduced over its last axis, the results xor-ed: [...] uint32. A kernel
  that only reads its operands: the read time of memory-bound rows (`mxfp4_matmul`'s
  `stream_*`)."""
  out = None
  for a in arrays:
    words = jax.lax.bitcast_convert_type(
        a.reshape(*a.shape[:-1], -1, 4 // a.dtype.itemsize), jnp.uint32)
    r = jax.lax.reduce(words, jnp.uint32(0), jax.lax.bitwise_xor, (a.ndim - 1,))
    out = r if out is None else out ^ r
  return out


def device_ms(fn: Callable, *args, reps: int = 20) -> float:
  """Device milliseconds per call of `fn(*args)`: the summed kernel durations of `reps` calls in
  an XLA profiler trace. For ops shorter than JAX's dispatch of a call (~0.07 ms), which
  wall-clock timing (`time_jax`) would measure instead."""
  return device_ms_cycling(fn, [args], reps=reps)


def device_ms_cycling(fn: Callable, arg_sets: list[tuple], reps: int = 20) -> float:
  """`device_ms` with call i taking `arg_sets[i % len(arg_sets)]` (every set run once before
  the trace): copies of the inputs cycled so that no call finds them in L2."""
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for i in range(reps):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    with gzip.open(find_trace(d)) as f:
      rows = device_op_times(json.load(f))
  if not rows:
    raise RuntimeError("the trace has no device timeline (a CPU run has none): device_ms needs "
                       "a GPU or TPU")
  return sum(us for _, _, us in rows) / reps / 1e3


def time_torch(fn: Callable, warmup_ms: int = 25, rep_ms: int = 200) -> float:
  """Median milliseconds with triton.testing.do_bench (CUDA events)."""
  import triton
  return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def device_name() -> str:
  return jax.devices()[0].device_kind


def versions() -> dict[str, str]:
  out = {"jax": jax.__version__}
  for name in ("torch", "triton", "fla", "jla"):
    try:
      module = __import__(name)
      out[name] = getattr(module, "__version__", "?")
    except Exception:  # pylint: disable=broad-exception-caught
      continue
  return out


def code_commit() -> str:
  """The measured code's commit: $K3JAX_COMMIT (set where the tree travels without .git), else
  git's HEAD, else "unknown"."""
  if os.environ.get("K3JAX_COMMIT"):
    return os.environ["K3JAX_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         timeout=10, check=True)
    return out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def today() -> str:
  return datetime.date.today().isoformat()


def merge_records(path: str, records: list[dict[str, Any]], key_fields: tuple[str, ...],
                  runs_of: str | None = None) -> None:
  """Writes `records` into the JSON list at `path`, replacing records with the same key (the
  file replaced whole: a failed write leaves the old one). `runs_of`: a field whose values
  accumulate in `runs` (a list) over records of one key measured at the same commit on the
  same device, where each run would otherwise replace the last."""
  old = []
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  key = lambda r: tuple(json.dumps(r.get(k), sort_keys=True) for k in key_fields)
  records = [dict(r) for r in records]
  if runs_of:
    same = {(key(r), r.get("commit"), r.get("device")): r for r in old}
    for r in records:
      prev = same.get((key(r), r.get("commit"), r.get("device")))
      earlier = [] if prev is None else prev.get("runs", [prev.get(runs_of)])
      r["runs"] = earlier + [r.get(runs_of)]
  new_keys = {key(r) for r in records}
  merged = [r for r in old if key(r) not in new_keys] + records
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w") as f:
      json.dump(merged, f, indent=1)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def find_trace(path: str) -> pathlib.Path:
  """The newest *.trace.json.gz at or under `path`."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  found = sorted(p.rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {path}")
  return found[-1]


def _device_pids(trace: dict) -> set:
  """The trace's process ids of device timelines (process names "/device:...")."""
  return {e["pid"] for e in trace["traceEvents"]
          if e.get("ph") == "M" and e.get("name") == "process_name"
          and e["args"]["name"].startswith("/device:")}


def device_op_times(trace: dict, by_hlo_op: bool = False) -> list[tuple[str, int, float]]:
  """(op name, calls, total microseconds) on the device timelines, largest total first; with
  `by_hlo_op` the name is prefixed by the HLO module and op the kernel ran for."""
  events = trace["traceEvents"]
  devices = _device_pids(trace)
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


def launch_gaps(trace: dict, hlo_module: str | None = None) -> dict[str, float]:
  """Whether a run waits on its host: the device timeline's idle time split by cause.

  Kernels are matched to their host launch calls by CUPTI correlation id. A gap before a
  kernel counts as waiting on the host when the kernel's launch call ended after the previous
  kernel had ended (the device ran dry); other gaps are "other_idle_us". With `hlo_module`
  only that module's kernels (and device copies) count. Returns kernels, busy_us, span_us,
  host_wait_us, other_idle_us and the medians of the host's launch calls and of the
  intervals between them (launch_us, launch_interval_us).
  """
  events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
  devices = _device_pids(trace)
  on_device = lambda e: e["pid"] in devices
  launches = {e["args"]["correlation_id"]: e for e in events
              if not on_device(e) and "correlation_id" in e.get("args", {})}
  kernels = sorted((e for e in events if on_device(e) and (
      hlo_module is None or e.get("args", {}).get("hlo_module") == hlo_module
      or e["name"].startswith("Memcpy"))), key=lambda e: e["ts"])
  if not kernels:
    raise ValueError(f"no device events{f' of {hlo_module}' * bool(hlo_module)} in the trace")
  host_wait = other = 0.0
  end = kernels[0]["ts"]
  used = []
  for e in kernels:
    launch = launches.get(e.get("args", {}).get("correlation_id"))
    gap = e["ts"] - end
    if gap > 0:
      if launch is not None and launch["ts"] + launch["dur"] > end:
        host_wait += gap
      else:
        other += gap
    if launch is not None:
      used.append(launch)
    end = max(end, e["ts"] + e["dur"])
  starts = sorted(h["ts"] for h in used)
  return dict(kernels=len(kernels), busy_us=sum(e["dur"] for e in kernels),
              span_us=end - kernels[0]["ts"], host_wait_us=host_wait, other_idle_us=other,
              launch_us=statistics.median(h["dur"] for h in used) if used else float("nan"),
              launch_interval_us=statistics.median(b - a for a, b in zip(starts, starts[1:]))
              if len(starts) > 1 else float("nan"))
