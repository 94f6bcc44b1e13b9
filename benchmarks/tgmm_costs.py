"""Where the d_rhs kernel's time goes (tgmm, `pallas_kernels.ragged_dot.mosaic_gpu`): a
diagnostic of the K3 expert shapes on the GPU, not a kernel choice.

At the same FLOPs, d_rhs runs slower at G32 (16 row blocks of 64 per group and output tile)
than at G8 (32 blocks). Per group and output tile the kernel pays an epilogue, a partial last
block, the first and last blocks' row masks (an SMEM read-modify-write of the block in the
kernel, or with boundary_blocks a gather of both blocks by XLA), and without tile_pipeline a
pipeline fill. Each variant adds or removes one of these, in one process on the same shapes:
- "table": the heuristic config (group_rows, tile_pipeline, boundary_blocks), Dirichlet group
  sizes (as `benchmarks.moe_gemm`);
- "masks": the row masks in the kernel instead of boundary blocks;
- "no_masks": the masks replaced by nothing (WRONG results; timing only);
- "aligned": group sizes multiples of 64 (no partial blocks);
- "aligned_no_masks": both (WRONG results; timing only);
- "uniform": equal group sizes (no long and short groups; multiples of 64 at these shapes,
  so compare with "aligned");
- "no_group_rows": row blocks start at multiples of block_k (a first block with up to 63
  rows of the previous group; half a block more per group and tile);
- "no_tile_pipeline": one pipeline per output tile (a pipeline fill per tile; masks);
- "neither": without group_rows and tile_pipeline (the table config before 6454e31);
- "balance": the table config with `TgmmConfig.balance` (groups in order of falling steps,
  tiles dealt serpentine instead of round robin; with Dirichlet sizes, by the tile counts
  over five seeds, the most loaded CTA holds 3.6% / 5.8% more than the mean at G32 / G8
  round robin and 1.1% / 3.8% dealt so).

  python3 -m benchmarks.tgmm_costs [--out=$OUT/tgmm_costs.json]
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
_SHAPES = flags.DEFINE_enum("shapes", "k3", ["k3", "toy"], "The K3 expert shapes or a toy.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Mosaic GPU interpreter (CPU).")
VARIANTS = ("table", "masks", "no_masks", "aligned", "aligned_no_masks", "uniform",
            "no_group_rows", "no_tile_pipeline", "neither", "balance")


def sizes_of(variant: str, g: int, m: int, block_k: int) -> np.ndarray:
  if variant == "uniform":
    return np.full(g, m // g)
  align = block_k if variant.startswith("aligned") else 1
  return dirichlet_sizes(g, m, seed=g, align=align)


def time_variant(variant: str, shape, interpret: bool) -> float:
  g, m, k, n = shape
  cfg = mosaic_gpu.tgmm_config(m, k, n, jnp.bfloat16, jnp.bfloat16)
  if variant in ("no_group_rows", "neither"):
    cfg = dataclasses.replace(cfg, group_rows=False)
  if variant in ("masks", "no_tile_pipeline", "neither") or variant.endswith("no_masks"):
    cfg = dataclasses.replace(cfg, boundary_blocks=False)
  if variant in ("no_tile_pipeline", "neither"):
    cfg = dataclasses.replace(cfg, tile_pipeline=False)
  if variant == "balance":
    cfg = dataclasses.replace(cfg, tile_pipeline=True, balance=True)
  x, _, d_out, gs = make_inputs(g, m, k, n, sizes_of(variant, g, m, cfg.block_k))
  mask_rows = mosaic_gpu._mask_rows
  if variant.endswith("no_masks"):
    mosaic_gpu._mask_rows = lambda a_smem, keep: None
  mosaic_gpu._tgmm_ws.clear_cache()     # the kernel's jit cache would keep another variant
  try:
    fn = jax.jit(lambda a, b, c: mosaic_gpu.tgmm(a, b, c, config=cfg, interpret=interpret))
    jax.block_until_ready(fn(x, d_out, gs))     # traced (and compiled) with the patch
    if interpret:
      return common.time_jax_once(fn, x, d_out, gs)
    return common.time_jax(fn, x, d_out, gs, reps=50, budget_s=3.0)
  finally:
    mosaic_gpu._mask_rows = mask_rows
    mosaic_gpu._tgmm_ws.clear_cache()


def main(argv):
  del argv
  records = []
  for shape in SHAPES if _SHAPES.value == "k3" else ((2, 256, 256, 256),):
    g, m, k, n = shape
    for variant in VARIANTS:
      ms = time_variant(variant, shape, _INTERPRET.value)
      tf = tflops(2 * m * k * n, ms)
      print(f"G{g} M{m} K{k} N{n} {variant:>17s} {ms:7.3f} ms {tf:6.1f} TFLOP/s", flush=True)
      records.append(dict(op="tgmm_costs", variant=variant, shape=dict(G=g, M=m, K=k, N=n),
                          median_ms=round(ms, 4), tflops=round(tf, 1),
                          device=common.device_name(), date=common.today()))
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
