"""Sweeps Mosaic GPU tile configs of the grouped matmul on the GPU; prints the best per shape.

For each K3 expert shape and each product (fwd = gmm, d_lhs = gmm with transpose_rhs,
d_rhs = tgmm) it times every config of the sweep (ours "ws" and JAX's example kernels "jax";
configs over the shared-memory limit are skipped, failures printed), then prints the sorted
results and the best config. Copy the winners into GMM_TABLE / TGMM_TABLE in
pallas_kernels/ragged_dot/mosaic_gpu.py.

  python3 -m benchmarks.autotune_ragged_dot [--quick] [--shapes=k3|k3_small|toy]
      [--products=fwd,d_lhs,d_rhs] [--max_shapes=N] [--max_configs=N] [--out=...]

--quick: a short list (5 configs per gmm product, 12 for d_rhs), on the first shape unless
--max_shapes says more. --max_configs: the first N configs of each product's list.
--shapes: the K3 expert shapes (default) or k3_small's (G 64, 16384 tokens x top-8 rows,
K = N = 512 and the fused gate/up N = 1024) or "toy" (G 2, 256 rows, K = N = 256).
--interpret: run the kernels in the Mosaic GPU interpreter (CPU; with --shapes=toy, the test
that keeps the script working).
"""
import argparse
import dataclasses
import itertools
import json
import pathlib

import jax

from benchmarks import common
from benchmarks.moe_gemm import SHAPES
from benchmarks.moe_gemm import dirichlet_sizes
from benchmarks.moe_gemm import make_inputs
from benchmarks.moe_gemm import tflops
from pallas_kernels.ragged_dot import mosaic_gpu

GmmConfig, TgmmConfig = mosaic_gpu.GmmConfig, mosaic_gpu.TgmmConfig
GRID_ORDERS = ((0, 8), (0, 16), (1, 4), (1, 1))   # (grid_minor_dim, grid_tile_width)
SHAPE_SETS = {"k3": SHAPES, "k3_small": ((64, 131072, 512, 1024), (64, 131072, 512, 512)),
              "toy": ((2, 256, 256, 256),)}


def full_sweep(product: str) -> list:
  """Every "ws" tile/stage/order combination, plus JAX's example kernel at a few tiles."""
  if product == "d_rhs":
    ws = [TgmmConfig(block_m=bm, block_n=bn, max_concurrent_steps=s, grid_minor_dim=d,
                     grid_tile_width=t, cluster_n=c)
          for bm, bn in ((128, 128), (64, 128), (128, 64), (64, 64))
          for s in (3, 4, 5, 6) for d, t in GRID_ORDERS for c in (1, 2)]
    ws += [dataclasses.replace(cfg, group_rows=True) for cfg in ws]
    ws += [dataclasses.replace(cfg, tile_pipeline=True, boundary_blocks=b, balance=b)
           for cfg in ws if cfg.cluster_n == 1 for b in (False, True)]
    ex = [TgmmConfig(block_m=bm, block_n=bn, max_concurrent_steps=s, grid_tile_width=t,
                     kernel="jax")
          for bm, bn in ((128, 128), (64, 128)) for s in (2, 4) for t in (1, 8)]
  else:
    ws = [GmmConfig(block_m=bm, block_n=bn, max_concurrent_steps=s, grid_minor_dim=d,
                    grid_tile_width=t, cluster_n=c)
          for bm, bn in ((128, 128), (128, 64), (64, 128), (64, 64))
          for s in (3, 4, 5, 6) for d, t in GRID_ORDERS for c in (1, 2)]
    ws += [GmmConfig(block_m=128, block_n=bn, max_concurrent_steps=s, grid_minor_dim=d,
                     grid_tile_width=t, tile_pipeline=True, epilogue_rows=e)
           for bn in (128, 64) for s in (2, 3, 4) for e in (None, 64, 32)
           for d, t in GRID_ORDERS]
    ex = [GmmConfig(block_m=128, block_n=bn, max_concurrent_steps=s, grid_tile_width=t,
                    kernel="jax")
          for bn in (128, 192) for s in (4, 5) for t in (1, 8)]
  return ws + ex


def quick_sweep(product: str) -> list:
  """A short list around the heuristic table's choice: for gmm with and without tile_pipeline
  (and 4 stages beside 64-row epilogue slices), for tgmm the table of bdbbe83
  (one pipeline per tile), group_rows + tile_pipeline, with boundary_blocks (the table) and
  with balance too."""
  if product == "d_rhs":
    return [TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, grid_minor_dim=d,
                       grid_tile_width=t, group_rows=p, tile_pipeline=p, boundary_blocks=b,
                       balance=c)
            for d, t in ((1, 1), (1, 8), (0, 8))
            for p, b, c in ((False, False, False), (True, False, False), (True, True, False),
                            (True, True, True))]
  return [GmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, grid_minor_dim=d,
                    grid_tile_width=t, tile_pipeline=p)
          for d, t in ((1, 4), (0, 8)) for p in (False, True)
          ] + [GmmConfig(block_m=128, block_n=128, max_concurrent_steps=4, grid_minor_dim=1,
                         grid_tile_width=4, tile_pipeline=True, epilogue_rows=64)]


def product_fn(product: str, cfg, interpret: bool):
  kw = dict(config=cfg, interpret=interpret)
  if product == "fwd":
    return jax.jit(lambda x, w, dy, gs: mosaic_gpu.gmm(x, w, gs, **kw))
  if product == "d_lhs":
    return jax.jit(lambda x, w, dy, gs: mosaic_gpu.gmm(dy, w, gs, transpose_rhs=True, **kw))
  return jax.jit(lambda x, w, dy, gs: mosaic_gpu.tgmm(x, dy, gs, **kw))


def sweep(shape, product: str, configs, interpret: bool = False) -> list[dict]:
  g, m, k, n = shape
  x, w, dy, gs = make_inputs(g, m, k, n, dirichlet_sizes(g, m, seed=g + k))
  args = {"fwd": (x, w, gs), "d_lhs": (dy, w, gs), "d_rhs": (x, dy, gs)}[product]
  check = {"fwd": mosaic_gpu.supports_gmm, "d_lhs": mosaic_gpu.supports_gmm,
           "d_rhs": mosaic_gpu.supports_tgmm}[product]
  kwargs = {"transpose_rhs": True} if product == "d_lhs" else {}
  kwargs["interpret"] = interpret
  results = []
  for cfg in configs:
    if reason := check(*args, config=cfg, **kwargs):
      print(f"  skip {cfg}: {reason}")
      continue
    try:
      fn = product_fn(product, cfg, interpret)
      ms = (common.time_jax_once(fn, x, w, dy, gs) if interpret
            else common.time_jax(fn, x, w, dy, gs, reps=20, budget_s=1.0))
    except Exception as e:  # noqa: BLE001  (one config failing must not stop the sweep)
      print(f"  FAIL {cfg}: {type(e).__name__}: {str(e)[:300]}")
      continue
    rec = dict(shape=dict(G=g, M=m, K=k, N=n), product=product, config=dataclasses.asdict(cfg),
               median_ms=round(ms, 4), tflops=round(tflops(2 * m * k * n, ms), 1))
    print(f"  {ms:8.3f} ms {rec['tflops']:6.1f} TFLOP/s  {cfg}", flush=True)
    results.append(rec)
  return sorted(results, key=lambda r: r["median_ms"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="k3")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--interpret", action="store_true")
  parser.add_argument("--products", default="fwd,d_lhs,d_rhs")
  parser.add_argument("--max_shapes", type=int, default=None)
  parser.add_argument("--max_configs", type=int, default=None)
  args = parser.parse_args()
  shapes = SHAPE_SETS[args.shapes]
  shapes = shapes[:args.max_shapes or (1 if args.quick else len(shapes))]
  products = args.products.split(",")
  if args.max_configs is not None and args.max_configs < 1:
    parser.error(f"--max_configs: must be at least 1, got {args.max_configs}")
  if unknown := set(products) - {"fwd", "d_lhs", "d_rhs"}:
    parser.error(f"--products: unknown {sorted(unknown)}; allowed fwd, d_lhs, d_rhs")
  best, everything = [], []
  for shape, product in itertools.product(shapes, products):
    print(f"== {shape} {product}", flush=True)
    configs = quick_sweep(product) if args.quick else full_sweep(product)
    configs = configs[:args.max_configs]
    results = sweep(shape, product, configs, args.interpret)
    everything += results
    if results:
      best.append(results[0])
  print("\nbest per shape and product")
  for r in best:
    print(f"{r['shape']} {r['product']:6s} {r['median_ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s "
          f"{r['config']}")
  if args.out:
    args.out.write_text(json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
  main()
