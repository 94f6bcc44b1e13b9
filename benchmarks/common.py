"""Shared timing and record helpers for the side-by-side benchmarks (see BENCHMARKS.md)."""
import datetime
import json
import os
import statistics
import time
from typing import Any, Callable

import jax


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


def today() -> str:
  return datetime.date.today().isoformat()


def merge_records(path: str, records: list[dict[str, Any]], key_fields: tuple[str, ...]) -> None:
  """Writes `records` into the JSON list at `path`, replacing records with the same key."""
  old = []
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  key = lambda r: tuple(json.dumps(r.get(k), sort_keys=True) for k in key_fields)
  new_keys = {key(r) for r in records}
  merged = [r for r in old if key(r) not in new_keys] + records
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(merged, f, indent=1)
