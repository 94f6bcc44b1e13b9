"""How many kernels the compiled train step holds, by part: what XLA's compile time scales with.

The step is compiled for the default device from abstract state (nothing allocated, so
k3_small compiles on a CPU host); each fusion, dot, convolution and custom call of the compiled
HLO is one kernel, attributed to a part by its JAX name stack (`benchmarks/step_parts.py`'s
`PARTS`, remat recomputation apart).

  python3 -m benchmarks.compile_parts --config=experiments/configs/k3_small.py \
      --config.train.global_batch_size=1 --config.train.seq_len=512
  python3 -m benchmarks.compile_parts --config=experiments/configs/k3_full.py --lower_only \
      --config.train.global_batch_size=1 --config.train.seq_len=8192
"""
import collections
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from ml_collections import config_flags

from benchmarks import common
from benchmarks import step_parts
from k3jax import config as config_lib
from k3jax import sharding
from k3jax import tpu_compile
from k3jax import train

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/k3_small.py", "Config.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/compile_parts.json", "Records (JSON list).")
_LOWER_ONLY = flags.DEFINE_bool(
    "lower_only", False, "Trace and lower the step only (no XLA compile, no kernel counts): the "
    "host-side time of a model too large to compile here, such as k3_full.")

def main(argv):
  del argv
  cfg = config_lib.validate(_CONFIG.value)
  t = cfg.train
  setup, state = tpu_compile.abstract_state(cfg)
  batch = {k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len),
                                   jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in tpu_compile.BATCH_KEYS}
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    traced = jax.jit(train.make_train_step(setup), donate_argnums=0,
                     compiler_options=train.compiler_options(cfg)).trace(state, batch)
    t_trace = time.perf_counter()
    lowered = traced.lower()
  t1 = time.perf_counter()
  if _LOWER_ONLY.value:
    lines = lowered.as_text().count("\n")
    print(f"{cfg.name}: traced in {t_trace - t0:.1f} s, lowered in {t1 - t_trace:.1f} s "
          f"({lines} lines of StableHLO)")
    rec = dict(op="lower_step", config=cfg.name, B=t.global_batch_size, T=t.seq_len,
               remat=cfg.model.remat, trace_s=round(t_trace - t0, 1),
               lower_s=round(t1 - t_trace, 1), stablehlo_lines=lines,
               device=common.device_name(), date=common.today(), commit=common.code_commit(),
               versions=common.versions())
    common.merge_records(_OUT.value, [rec], ("op", "config", "B", "T", "remat", "device"))
    return
  text = lowered.compile().as_text()
  t2 = time.perf_counter()
  counts = step_parts.kernel_counts(text)
  by_part = collections.Counter()
  for (part, _), n in counts.items():
    by_part[part] += n
  total = sum(by_part.values())
  print(f"{total} kernels; lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s")
  parts = []
  for part, n in by_part.most_common():
    phases = {ph: counts.get((part, ph), 0) for ph in ("fwd", "bwd", "remat")}
    parts.append(dict(part=part, kernels=n, share=round(n / total, 4), **phases))
    print(f"{n:6d} {n / total:6.1%}  {part}  ({phases})")
  rec = dict(op="compile_parts", config=cfg.name, B=t.global_batch_size, T=t.seq_len,
             remat=cfg.model.remat, kernels=total, lower_s=round(t1 - t0, 1),
             compile_s=round(t2 - t1, 1), parts=parts, device=common.device_name(),
             date=common.today(), commit=common.code_commit(), versions=common.versions())
  common.merge_records(_OUT.value, [rec], ("op", "config", "B", "T", "remat", "device"))


if __name__ == "__main__":
  app.run(main)
