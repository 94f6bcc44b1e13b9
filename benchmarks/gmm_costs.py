"""Where the forward kernel's time goes (gmm, `pallas_kernels.ragged_dot.mosaic_gpu`): a
diagnostic of the K3 expert shapes on the GPU, not a kernel choice (`tgmm_costs` does the same
for d_rhs).

At the G32 shapes gmm runs at ~590-610 TFLOP/s while XLA's dense matmul of the same FLOPs runs
at ~660. Each row tile aligned to its group's start wastes the rest of a group's last tile
(about 6% of the rows at G32, 4% at G8), and every tile pays an epilogue (the accumulator
through SMEM, then TMA stores). Each variant removes one of these, in one process on the same
shapes:
- "table": the heuristic config, Dirichlet group sizes (as `benchmarks.moe_gemm`);
- "aligned": group sizes multiples of block_m (no partial tiles, no wasted rows);
- "uniform": equal group sizes (multiples of block_m at these shapes: compare with "aligned");
- "no_tma_store": the table config with the TMA stores of the epilogue replaced by nothing
  (WRONG results; timing only: the accumulator still goes through SMEM);
- "no_store_wait": the stores kept, the wait for the previous store to have read the epilogue
  buffer before it is rewritten dropped (timing only: results may be wrong; last in the list,
  as a store still reading SMEM when the kernel ends is undefined behaviour);
- "per_tile_pipelines": without tile_pipeline (one pipeline per tile, the table before
  152bb8e);
- "order_0_8": tiles ordered M-minor, 8 wide, instead of the table's N-minor 4 wide;
- "lhs_rows_8", "rhs_rows_8": each step loads only the first 8 rows of its lhs block
  (1 of 16 KiB) or of its rhs block (4 of 32 KiB) (WRONG results; timing only): if the main
  loop is bound by the L2 -> SMEM loads, it speeds up by about the bytes saved; if by the
  tensor cores, not at all.

A fit of time = rounds x (steps x s + X) over the shapes of the "aligned" variant (rounds: the
row tiles x N tiles over the SMs, rounded up; steps: K / block_k) gives the time per
block_m x 2*block_n x block_k step s (the main loop's rate) and the per-tile cost X
(epilogue, fill, scalar reads); the k3_small shape (K 512: 8 steps per tile) weighs X most.

  python3 -m benchmarks.gmm_costs [--out=$OUT/gmm_costs.json] [--variants=table ...]
--shapes=toy --interpret runs G 2, M = K = N = 256 in the Mosaic GPU interpreter (CPU; the
test that keeps the script working).
"""
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from benchmarks.moe_gemm import SHAPES
from benchmarks.moe_gemm import dirichlet_sizes
from benchmarks.moe_gemm import make_inputs
from benchmarks.moe_gemm import tflops
from pallas_kernels.ragged_dot import mosaic_gpu

_OUT = flags.DEFINE_string("out", "", "If set, the records (JSON list) go there.")
_SHAPES = flags.DEFINE_enum("shapes", "k3", ["k3", "toy"],
                            "The K3 expert shapes and k3_small's first, or a toy.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Mosaic GPU interpreter (CPU).")
VARIANTS = ("table", "aligned", "uniform", "no_tma_store", "per_tile_pipelines", "order_0_8",
            "lhs_rows_8", "rhs_rows_8", "no_store_wait")
_VARIANTS = flags.DEFINE_multi_enum("variants", list(VARIANTS), VARIANTS,
                                    "The variants to time (repeat the flag for several).")
K3_SMALL = (64, 131072, 512, 1024)


def sizes_of(variant: str, g: int, m: int, block_m: int) -> np.ndarray:
  if variant == "uniform":
    return np.full(g, m // g)
  return dirichlet_sizes(g, m, seed=g, align=block_m if variant == "aligned" else 1)


def config_of(variant: str, m: int, k: int, n: int) -> mosaic_gpu.GmmConfig:
  cfg = mosaic_gpu.gmm_config(m, k, n, jnp.bfloat16, jnp.bfloat16)
  if variant == "per_tile_pipelines":
    return dataclasses.replace(cfg, tile_pipeline=False)
  if variant == "order_0_8":
    return dataclasses.replace(cfg, grid_minor_dim=0, grid_tile_width=8)
  return cfg


def rounds(sizes: np.ndarray, n: int, cfg: mosaic_gpu.GmmConfig, num_sms: int) -> int:
  """Tiles per SM of the busiest SM: row tiles from each group's start rounded down to 8."""
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  row_tiles = sum(-(-(int(s % 8) + int(z)) // cfg.block_m) for s, z in zip(starts, sizes) if z)
  return -(-row_tiles * (n // (2 * cfg.block_n)) // num_sms)


def time_variant(variant: str, shape, interpret: bool) -> tuple[float, int]:
  """(median ms, rounds) of the variant's forward at `shape`."""
  g, m, k, n = shape
  cfg = config_of(variant, m, k, n)
  sizes = sizes_of(variant, g, m, cfg.block_m)
  x, w, _, gs = make_inputs(g, m, k, n, sizes)
  store_rows, await_buffer = mosaic_gpu._store_rows, mosaic_gpu._await_epilogue_buffer
  load_block = mosaic_gpu._load_block
  if variant == "no_tma_store":
    mosaic_gpu._store_rows = lambda *args: None
  if variant == "no_store_wait":
    mosaic_gpu._await_epilogue_buffer = lambda: None
  if variant in ("lhs_rows_8", "rhs_rows_8"):
    def first_rows(src, dst, barrier):
      is_lhs = tuple(src.shape) == (cfg.block_m, cfg.block_k)
      if is_lhs == (variant == "lhs_rows_8"):
        src, dst = src.at[:8], dst.at[:8]
      load_block(src, dst, barrier)
    mosaic_gpu._load_block = first_rows
  mosaic_gpu._gmm_ws.clear_cache()     # the kernel's jit cache would keep another variant
  try:
    fn = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, config=cfg, interpret=interpret))
    jax.block_until_ready(fn(x, w, gs))     # traced (and compiled) with the patch
    if interpret:
      ms = common.time_jax_once(fn, x, w, gs)
    else:
      ms = common.time_jax(fn, x, w, gs, reps=50, budget_s=3.0)
  finally:
    mosaic_gpu._store_rows, mosaic_gpu._await_epilogue_buffer = store_rows, await_buffer
    mosaic_gpu._load_block = load_block
    mosaic_gpu._gmm_ws.clear_cache()
  return ms, rounds(sizes, n, cfg, mosaic_gpu._num_sms(interpret))


def fit_step_and_tile(points) -> tuple[float, float]:
  """Least squares of us = rounds x (steps x s + X) over (us, rounds, steps): (s, X) in us."""
  a = np.array([[r * steps, r] for _, r, steps in points], np.float64)
  b = np.array([us for us, _, _ in points], np.float64)
  (s, x), *_ = np.linalg.lstsq(a, b, rcond=None)
  return float(s), float(x)


def main(argv):
  del argv
  records, aligned = [], []
  shapes = (*SHAPES, K3_SMALL) if _SHAPES.value == "k3" else ((2, 256, 256, 256),)
  for shape in shapes:
    g, m, k, n = shape
    for variant in _VARIANTS.value:
      ms, r = time_variant(variant, shape, _INTERPRET.value)
      tf = tflops(2 * m * k * n, ms)
      print(f"G{g} M{m} K{k} N{n} {variant:>18s} {ms:7.3f} ms {tf:6.1f} TFLOP/s "
            f"{r} rounds", flush=True)
      records.append(dict(op="gmm_costs", variant=variant, shape=dict(G=g, M=m, K=k, N=n),
                          median_ms=round(ms, 4), tflops=round(tf, 1), rounds=r,
                          device=common.device_name(), date=common.today()))
      if variant == "aligned":
        aligned.append((ms * 1e3, r, k // config_of(variant, m, k, n).block_k))
  if len(aligned) > 1:
    s, x = fit_step_and_tile(aligned)
    cfg = config_of("aligned", *shapes[0][1:])
    step_flops = 2 * cfg.block_m * 2 * cfg.block_n * cfg.block_k
    print(f"fit over the aligned variant: s = {s:.3f} us per step "
          f"({step_flops * mosaic_gpu._num_sms(_INTERPRET.value) / s / 1e6:.0f} TFLOP/s), "
          f"X = {x:.2f} us per tile")
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
