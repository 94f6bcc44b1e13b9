r"""End-to-end training step of a config on one device: tokens/s and MFU.

MFU counts the model FLOPs (`flops.train_flops_per_token`: no MTP, no optimizer, no
recomputation); `matmul_fraction` counts every matmul of the step but remat's recomputation
(`flops.step_flops`: those, the MTP layer with its LM head, Muon's Newton-Schulz) against the
same peak, and `step_tflop` keeps the three.

`python3 -m benchmarks.train_step --config=experiments/configs/k3_small.py --out=$OUT/train.json`
(`--profile_dir=DIR`: an XLA trace of two more steps, for `benchmarks/trace_summary.py`, and the
table of where their device time goes by part, `benchmarks/step_parts.py`: printed as Markdown
and kept in the record as `parts`; on GPUs these steps run a second compilation of the step
without CUDA graphs, whose kernels name their HLO ops in the trace). The compile is timed by
phase (trace, lower, XLA compile, two warm-up steps that also build the Pallas kernels);
`--compile_trace_dir=DIR` runs it under the profiler and tables the longest host events;
`--jax_cache_dir=DIR` compiles through JAX's persistent cache (a second run is "warm").
Random tokens (no data pipeline in the timed region); the step is the real `k3jax.train` step.
"""
import collections
import contextlib
import gzip
import json
import os
import pathlib
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from benchmarks import common, step_parts
from k3jax import config as config_lib
from k3jax import flops, sharding, train
from pallas_kernels import mosaic_gpu_prebuild

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/k3_small.py", "Config.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/train_h200.json", "Records (JSON list).")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps (after 2 warm-up steps).")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "", "If set, an XLA profiler trace of two "
                                   "more steps (after the timed ones) is written here.")
_JAX_CACHE_DIR = flags.DEFINE_string(
    "jax_cache_dir", "", "JAX's persistent compilation cache directory (as launch programs' "
    "--jax_cache_dir); recorded as compile_cache \"cold\" (empty before the run) or \"warm\".")
_COMPILE_TRACE_DIR = flags.DEFINE_string(
    "compile_trace_dir", "", "If set, the compile and warm-up run under the profiler and the "
    "host events that took longest (XLA passes, autotuning, kernel builds) are tabled.")


def _compile_trace_options() -> jax.profiler.ProfileOptions:
  """The compiler's own events (XLA passes, autotuning, codegen), not every Python call."""
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0
  opts.host_tracer_level = 3
  return opts


def compile_events(trace_dir: str, top: int = 25) -> list[tuple[str, int, float]]:
  """(host event name, calls, exclusive seconds) of a compile trace, largest first: where the
  compile's time went (trace, lowering, XLA passes, autotuning, kernel builds)."""
  with gzip.open(common.find_trace(trace_dir)) as f:
    trace = json.load(f)
  spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
  totals = collections.defaultdict(lambda: [0, 0.0])
  for e, excl in step_parts._exclusive_times(spans):
    totals[e["name"]][0] += 1
    totals[e["name"]][1] += excl / 1e6
  rows = sorted(((n, c, round(s, 2)) for n, (c, s) in totals.items()), key=lambda r: -r[2])
  return rows[:top]


def main(argv):
  del argv
  cfg = config_lib.validate(_CONFIG.value)
  t = cfg.train
  compile_cache = None
  if _JAX_CACHE_DIR.value:
    cache = os.path.expanduser(_JAX_CACHE_DIR.value)
    compile_cache = "warm" if os.path.isdir(cache) and os.listdir(cache) else "cold"
    train.enable_compilation_cache(cache)
  setup, state = train.init(cfg, 0)
  # The step is traced under a mesh of this one device, as in training (k3jax.loop); at data = 1
  # the FSDP rules change nothing.
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  rng = np.random.default_rng(0)
  b, s = t.global_batch_size, t.seq_len
  def batch():
    toks = rng.integers(0, cfg.model.vocab_size, (b, s + 1)).astype(np.int32)
    return dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((b, s), np.int32),
                positions=np.tile(np.arange(s, dtype=np.int32), (b, 1)),
                loss_mask=np.ones((b, s), np.float32))
  with (jax.profiler.trace(_COMPILE_TRACE_DIR.value, profiler_options=_compile_trace_options())
        if _COMPILE_TRACE_DIR.value else contextlib.nullcontext()):
    phases, t0 = {}, time.perf_counter()
    with jax.set_mesh(mesh):
      traced = jax.jit(train.make_train_step(setup), donate_argnums=0,
                       compiler_options=train.compiler_options(cfg)).trace(state, batch())
    phases["trace_s"], t = time.perf_counter() - t0, time.perf_counter()
    lowered = traced.lower()
    phases["lower_s"], t = time.perf_counter() - t, time.perf_counter()
    step, prebuild = mosaic_gpu_prebuild.compile(
        lowered, prebuild=cfg.kernels.prebuild_mosaic_gpu)
    phases["xla_compile_s"], t = time.perf_counter() - t, time.perf_counter()
    for _ in range(2):
      state, m = step(state, batch())
    jax.block_until_ready(m)
    phases["warmup_s"] = time.perf_counter() - t
    compile_s = time.perf_counter() - t0
  phases = {k: round(v, 1) for k, v in phases.items()}
  print("compile phases (s):", phases)
  if prebuild:
    print(prebuild)
  compile_parts = []
  if _COMPILE_TRACE_DIR.value:
    compile_parts = compile_events(_COMPILE_TRACE_DIR.value)
    for name, calls, sec in compile_parts:
      print(f"{sec:9.2f} s {calls:6d}x  {name}")
  batches = [batch() for _ in range(_STEPS.value)]
  t0 = time.perf_counter()
  for bt in batches:
    state, m = step(state, bt)
  jax.block_until_ready(m)
  dt = (time.perf_counter() - t0) / _STEPS.value
  parts = []
  if _PROFILE_DIR.value:
    if jax.devices()[0].platform == "gpu":  # kernels of CUDA graphs do not name their HLO op
      with jax.set_mesh(mesh):
        lowered = jax.jit(train.make_train_step(setup), donate_argnums=0).lower(state, batch())
      step, _ = mosaic_gpu_prebuild.compile(
          lowered, prebuild=cfg.kernels.prebuild_mosaic_gpu,
          compiler_options={**train.compiler_options(cfg), "xla_gpu_enable_command_buffer": ""})
      state, m = step(state, batches[0])
      jax.block_until_ready(m)
    with jax.profiler.trace(_PROFILE_DIR.value):
      for bt in batches[:2]:
        state, m = step(state, bt)
      jax.block_until_ready(m)
    (pathlib.Path(_PROFILE_DIR.value) / step_parts.HLO_FILE).write_text(step.as_text())
    trace, hlo = step_parts.load_dir(_PROFILE_DIR.value)
    parts = step_parts.part_records(trace, hlo, 2)
    print(step_parts.markdown(parts))
    lines = step_parts.timelines(trace, 2)
    for line in lines:
      print(line)
  tok_s = b * s / dt
  peak, source = flops.peak_flops_per_device()
  counts = flops.count_params(cfg.model)
  fpt = flops.train_flops_per_token(cfg.model, s, counts)
  work = flops.step_flops(cfg.model, s, b * s, counts, muon_mode=train.muon_mode(cfg.train))
  rec = dict(op="train_step", config=cfg.name, B=b, T=s, step_ms=round(dt * 1e3, 2),
             tokens_per_s=round(tok_s, 1), model_tflops=round(tok_s * fpt / 1e12, 2),
             mfu=round(tok_s * fpt / peak, 4), peak_source=source, total_params=counts.total,
             step_tflop={k: float(f"{getattr(work, k) / 1e12:.6g}")
                         for k in ("model", "mtp", "newton_schulz")},
             matmul_fraction=round(work.total / dt / peak, 4),
             active_params=counts.active, kda_impl=cfg.kernels.kda_impl or "auto",
             ragged_dot_impl=cfg.kernels.ragged_dot_impl or "auto",
             gate_up_impl=cfg.kernels.gate_up_impl or "auto",
             gate_up_train=cfg.kernels.gate_up_train, remat=cfg.model.remat,
             scan_layers=None if cfg.model.scan_layers else False,
             attention_impl=cfg.kernels.attention_impl or "auto",
             muon_ns_dtype=cfg.train.muon_ns_dtype, muon_ns_fold=cfg.train.muon_ns_fold or None,
             muon_ns_stack=None if cfg.train.muon_ns_stack else False,
             xla_flags=os.environ.get("XLA_FLAGS", ""),
             xla_triton_gemm=cfg.kernels.xla_triton_gemm,
             loss=float(m["loss"]), compile_and_warmup_s=round(compile_s, 1), **phases,
             compile_cache=compile_cache,
             device=common.device_name(), date=common.today(), commit=common.code_commit(),
             versions=common.versions())
  if prebuild and prebuild.built:
    rec["prebuild_mosaic_gpu"] = prebuild.built
  rec["profiled"] = bool(parts)
  if parts:
    rec["parts"] = parts
    rec["timelines"] = lines
  if compile_parts:
    rec["compile_parts"] = [dict(name=n, calls=c, s=sec) for n, c, sec in compile_parts]
  common.merge_records(_OUT.value, [rec],
                       ("op", "config", "B", "T", "kda_impl", "gate_up_train", "remat",
                        "xla_flags", "xla_triton_gemm", "profiled", "compile_cache",
                        "prebuild_mosaic_gpu", "muon_ns_fold", "muon_ns_stack", "scan_layers",
                        "device"))
  print(rec)


if __name__ == "__main__":
  app.run(main)
