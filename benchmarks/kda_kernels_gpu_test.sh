#!/usr/bin/env bash
# Mosaic GPU KDA kernels (pallas_kernels/kda/mosaic_gpu.py) compiled and checked on a Hopper GPU.
#
#   bash benchmarks/kda_kernels_gpu_test.sh               # forward, backward and decode kernel tests, compiled
#   bash benchmarks/kda_kernels_gpu_test.sh --bench       # the tests, then the forward timed against fla
#   bash benchmarks/kda_kernels_gpu_test.sh --bench-only  # only the timing
#
# KDA_TEST_ARGS: extra pytest arguments, e.g. "-n 4" (pytest-xdist; with
# XLA_PYTHON_CLIENT_PREALLOCATE=false so the workers share the GPU).
#
# Timing: B=1, T=8192, K=V=128, bf16 q/k/v (unit-norm q, k), fp32 g = -5 sigmoid(x), beta in (0, 1);
# forward only. fla-core's chunk_kda (pure Triton, FLA_DISABLE_BACKEND_DISPATCH=1) runs on the same
# inputs when `fla` imports (carry its wheel); the table also gives the relative L2 difference of
# the two outputs. JAX times are per call over back-to-back calls (median of 5 blocks of 10 calls).
# KDA_BENCH_HEADS (default "32 96") and KDA_BENCH_FLA (fla variants: any of "fla fla_safe_gate
# fla_l2norm"; default "fla"), KDA_BENCH_BV (state-kernel value blocks, default "64 32") and
# KDA_BENCH_PARTS (1: also time preparation and each kernel alone) select what runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export K3JAX_KDA_TEST_ON_DEVICE=1
mode="${1:-}"

if [[ "$mode" != "--bench-only" ]]; then
  python3 -m pytest -q -p no:cacheprovider ${KDA_TEST_ARGS:-} tests/pallas_kernels/test_kda_mosaic_gpu.py \
    tests/pallas_kernels/test_kda_mosaic_gpu_bwd.py tests/pallas_kernels/test_kda_mosaic_gpu_bwd_intra.py \
    tests/pallas_kernels/test_kda_mosaic_gpu_bwd_cotangents.py \
    tests/pallas_kernels/test_kda_recurrent_decode.py \
    tests/pallas_kernels/test_mosaic_gpu_patterns.py
fi
if [[ "$mode" != "--bench" && "$mode" != "--bench-only" ]]; then
  exit 0
fi

KDA_BENCH_HEADS="${KDA_BENCH_HEADS:-32 96}" python3 - <<'EOF'
import os
import statistics
import time

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import mosaic_gpu

B, T, K, V = 1, 8192, 128, 128


def jax_ms(fn, *args, reps=10, blocks=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(blocks):
    start = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / reps * 1e3)
  return statistics.median(times)


def where_the_time_goes(q, k, v, g, beta):
  """XLA preparation, kernel 1 (chunk-parallel) and kernel 2 (serial), each in its own jit."""
  cfg, _ = mosaic_gpu.config(q, None, scale=K ** -0.5)
  prep = jax.jit(lambda q, k, v, g, beta: mosaic_gpu.prepare(q, k, v, g, beta, None, None))
  qp, kp, gp, vp, beta_t, counts, h0 = prep(q, k, v, g, beta)
  intra = jax.jit(lambda *a: mosaic_gpu.intra_kernel(*a, cfg, None))
  parts = intra(qp, kp, gp, beta_t, counts)
  state = jax.jit(lambda *a: mosaic_gpu.state_kernel(*a, cfg, None))
  return dict(prep_ms=jax_ms(prep, q, k, v, g, beta),
              intra_ms=jax_ms(intra, qp, kp, gp, beta_t, counts),
              state_ms=jax_ms(state, *parts, vp, beta_t, h0))


try:
  import torch
  import triton
  from fla.ops.kda import chunk_kda as fla_chunk_kda
except ImportError as err:
  fla_chunk_kda = None
  print(f"fla not importable ({err}); timing the JAX kernel only")

rows = []
for h in map(int, os.environ["KDA_BENCH_HEADS"].split()):
  rng = np.random.default_rng(h)
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  q = jnp.asarray(unit(rng.standard_normal((B, T, h, K), np.float32)), jnp.bfloat16)
  k = jnp.asarray(unit(rng.standard_normal((B, T, h, K), np.float32)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, T, h, V), np.float32), jnp.bfloat16)
  g = jnp.asarray(-5.0 / (1.0 + np.exp(-rng.standard_normal((B, T, h, K), np.float32))))
  beta = jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, h), np.float32))),
                     jnp.bfloat16).astype(jnp.float32)
  row = dict(H=h)
  for bv in map(int, os.environ.get("KDA_BENCH_BV", "64 32").split()):
    fwd = jax.jit(lambda q, k, v, g, beta, bv=bv: mosaic_gpu.forward(
        q, k, v, g, beta, None, None, scale=K ** -0.5, block_v=bv))
    row[f"jax_bv{bv}_ms"] = jax_ms(fwd, q, k, v, g, beta)
  o_jax = np.asarray(fwd(q, k, v, g, beta)[0], np.float32)
  flops = B * h * (6 * T * K * V + 3 * T * 64 * K + T * 64 * 64)
  row["tflops"] = flops / row[f"jax_bv{bv}_ms"] / 1e9
  if os.environ.get("KDA_BENCH_PARTS", "1") == "1":
    row.update(where_the_time_goes(q, k, v, g, beta))
  if fla_chunk_kda is not None:
    tt = lambda a, dt=None: torch.from_numpy(np.asarray(a, np.float32)).cuda().to(dt or torch.bfloat16)
    args = dict(q=tt(q), k=tt(k), v=tt(v), g=tt(g, torch.float32), beta=tt(beta))
    variants = {"fla": {}, "fla_safe_gate": dict(safe_gate=True, lower_bound=-5.0),
                "fla_l2norm": dict(use_qk_l2norm_in_kernel=True)}
    variants = {n: variants[n] for n in os.environ.get("KDA_BENCH_FLA", "fla").split()}
    with torch.no_grad():
      for name, kw in variants.items():
        try:
          run = lambda: fla_chunk_kda(**args, scale=K ** -0.5, **kw)
          row[name + "_ms"] = triton.testing.do_bench(run, warmup=25, rep=100,
                                                       return_mode="median")
          if name == "fla":
            o_fla = run()[0].float().cpu().numpy()
            row["rel_diff_vs_fla"] = float(np.linalg.norm(o_jax - o_fla) / np.linalg.norm(o_fla))
        except Exception as err:  # a variant fla-core 0.6.0 rejects is reported, not fatal
          row[name + "_ms"] = f"error: {type(err).__name__}: {str(err)[:80]}"
  rows.append(row)
  print(row, flush=True)

print("\nB=1 T=8192 K=V=128 bf16, forward (ms)")
for row in rows:
  print("  ".join(f"{key}={val:.3f}" if isinstance(val, float) else f"{key}={val}"
                  for key, val in row.items()))
EOF
