"""MoE grouped GEMM on one GPU, same inputs, one process (issue "MoE grouped-GEMM kernels").

Implementations: ours (`pallas_kernels.ragged_dot`, Mosaic GPU "ws" kernels with the tile
table's configs; "_cluster2": the same with 2-CTA clusters sharing the lhs tile), JAX's own
example kernels (ragged_dot_mgpu + transposed_ragged_dot_mgpu, through our wrapper),
`jax.lax.ragged_dot` (XLA) and torch `_grouped_mm` (CUTLASS), forward and forward+backward
(d_lhs and d_rhs), at the K3 expert shapes; bf16 operands, fp32 accumulation, rows sorted
by group with Dirichlet(1) group sizes. Also: our backward products alone, a dense XLA matmul
of the same FLOPs, and the dense bf16 ceiling (8192^3, jnp.dot and torch.matmul).

Timing: JAX = median over up to 50 calls of time.perf_counter around
`jax.block_until_ready` after warm-up; torch = `triton.testing.do_bench` median.
TFLOP/s count 2*M*K*N per product (3 products for fwd+bwd).

  python3 -m benchmarks.moe_gemm --out=$OUT/moe_gemm.json

Records (a JSON list) are merged into --out: a new record replaces an old one with the same
op, implementation, pass, shape, dtype and device; other records are kept. A failing
implementation is printed and recorded with "error"; the others still run.
"""
import argparse
import dataclasses
import functools
import datetime
import json
import os
import pathlib
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")   # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from pallas_kernels.ragged_dot import mosaic_gpu  # noqa: E402
from pallas_kernels.ragged_dot import plan  # noqa: E402
from pallas_kernels.ragged_dot import ragged_dot  # noqa: E402

SHAPES = ((32, 32768, 3584, 3072), (32, 32768, 3072, 3584), (8, 16384, 3584, 6144))
DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "moe_h200.json"
DTYPE = "bfloat16"
JAX_EXAMPLE_GMM = mosaic_gpu.GmmConfig(block_m=128, block_n=128, block_k=64,
                                       max_concurrent_steps=4, grid_tile_width=1, kernel="jax")
JAX_EXAMPLE_TGMM = mosaic_gpu.TgmmConfig(block_m=128, block_n=128, block_k=64,
                                         max_concurrent_steps=4, grid_tile_width=1,
                                         kernel="jax")


def dirichlet_sizes(g: int, m: int, seed: int = 0, align: int = 1) -> np.ndarray:
  """Uneven group sizes summing to m (multiples of align), as top-k routing gives."""
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(m // align, rng.dirichlet(np.ones(g))) * align
  sizes[-1] += m - sizes.sum()
  return sizes.astype(np.int32)


def make_inputs(g: int, m: int, k: int, n: int, sizes: np.ndarray, seed: int = 0):
  """x [M, K], w [G, K, N], d_out [M, N] (bf16, N(0, 1)) and group sizes on the device."""
  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (g, k, n), jnp.bfloat16)
  d_out = jax.random.normal(kc, (m, n), jnp.bfloat16)
  return x, w, d_out, jnp.asarray(sizes)


def time_jax(fn, *args) -> float:
  """Median ms after warm-up: 50 calls or 3 s, whichever ends first."""
  return common.time_jax(fn, *args, reps=50, budget_s=3.0)


def tflops(flops: float, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------
# JAX implementations: name -> (fwd(x, w, gs), fwd_bwd(x, w, d_out, gs))
# ------------------------------------------------------------------------------------------

def _vjp_fn(fn):
  def fwd_bwd(x, w, d_out, gs):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, gs), x, w)
    return (out, *vjp(d_out))
  return jax.jit(fwd_bwd)


def _explicit(gmm_config, tgmm_config):
  """(fwd, fwd_bwd) running the three products with the given config functions."""
  def fwd(x, w, gs):
    return mosaic_gpu.gmm(x, w, gs, config=gmm_config(x.shape[0], x.shape[1], w.shape[2]))

  def fwd_bwd(x, w, d_out, gs):
    m, k, n = x.shape[0], x.shape[1], w.shape[2]
    out = mosaic_gpu.gmm(x, w, gs, config=gmm_config(m, k, n))
    d_x = mosaic_gpu.gmm(d_out, w, gs, transpose_rhs=True, config=gmm_config(m, n, k))
    d_w = mosaic_gpu.tgmm(x, d_out, gs, config=tgmm_config(m, k, n))
    return out, d_x, d_w
  return jax.jit(fwd), jax.jit(fwd_bwd)


def _table(fn, **changes):
  """The heuristic config of our table with `changes` applied."""
  bf16 = jnp.bfloat16
  return lambda m, k, n: dataclasses.replace(fn(m, k, n, bf16, bf16), **changes)


JAX_IMPLS = {
    "k3jax_mosaic_gpu": (jax.jit(lambda x, w, gs: ragged_dot(x, w, gs, impl="mosaic_gpu")),
                         _vjp_fn(lambda a, b, gs: ragged_dot(a, b, gs, impl="mosaic_gpu"))),
    "k3jax_mosaic_gpu_cluster2": _explicit(_table(mosaic_gpu.gmm_config, cluster_n=2),
                                           _table(mosaic_gpu.tgmm_config, cluster_n=2)),
    "jax_example_mgpu": _explicit(lambda m, k, n: JAX_EXAMPLE_GMM,
                                  lambda m, k, n: JAX_EXAMPLE_TGMM),
    "xla_ragged_dot": (jax.jit(jax.lax.ragged_dot), _vjp_fn(jax.lax.ragged_dot)),
}


def table_configs(m: int, k: int, n: int) -> dict:
  """Our heuristic configs for the three products (recorded with our measurements)."""
  bf16 = jnp.bfloat16
  return dict(fwd=str(mosaic_gpu.gmm_config(m, k, n, bf16, bf16)),
              d_lhs=str(mosaic_gpu.gmm_config(m, n, k, bf16, bf16)),
              d_rhs=str(mosaic_gpu.tgmm_config(m, k, n, bf16, bf16)))


# ------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------

def torch_from_jax(x):
  import torch
  try:
    return torch.from_dlpack(x)
  except (TypeError, RuntimeError, BufferError):
    return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)


def torch_grouped_mm_fns(x, w, d_out, sizes):
  """(fwd, fwd_bwd, note) closures over torch views of the same inputs."""
  import torch
  a, b, dy = (torch_from_jax(t) for t in (x, w, d_out))
  offs = torch.as_tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")

  def fwd():
    return torch._grouped_mm(a, b, offs=offs)

  ag = a.detach().clone().requires_grad_(True)
  bg = b.detach().clone().requires_grad_(True)

  def fwd_bwd_autograd():
    out = torch._grouped_mm(ag, bg, offs=offs)
    return (out, *torch.autograd.grad(out, (ag, bg), dy))

  def fwd_bwd_explicit():
    out = torch._grouped_mm(a, b, offs=offs)
    d_a = torch._grouped_mm(dy, b.transpose(-2, -1), offs=offs)
    d_b = torch._grouped_mm(a.t(), dy, offs=offs)
    return out, d_a, d_b

  try:
    fwd_bwd_autograd()
    return fwd, fwd_bwd_autograd, "fwd+bwd through autograd"
  except RuntimeError as e:
    print(f"torch._grouped_mm autograd failed ({e}); timing the backward products explicitly")
    return fwd, fwd_bwd_explicit, "fwd+bwd as 3 explicit _grouped_mm calls"


def torch_probe_alignment() -> int:
  """1 if torch._grouped_mm takes group sizes off 16-row multiples, else 16."""
  import torch
  a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(3, 128, 128, device="cuda", dtype=torch.bfloat16)
  try:
    torch._grouped_mm(a, b, offs=torch.tensor([5, 38, 64], device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    return 1
  except RuntimeError as e:
    print(f"torch._grouped_mm refused unaligned group sizes ({e}); using 16-row multiples")
    return 16


# ------------------------------------------------------------------------------------------
# records
# ------------------------------------------------------------------------------------------

KEY_FIELDS = ("op", "implementation", "pass", "shape", "dtype", "device")


class Recorder:
  """Runs one measurement, prints it, keeps a record (with "error" when it raised)."""

  def __init__(self, device: str):
    self.device = device
    self.date = datetime.date.today().isoformat()
    self.records: list[dict] = []

  def measure(self, op, impl, pass_, shape, flops, timer, **extra):
    rec = dict(op=op, implementation=impl, **{"pass": pass_}, shape=shape, dtype=DTYPE,
               median_ms=None, tflops=None, device=self.device, date=self.date, **extra)
    try:
      ms = timer()
      rec.update(median_ms=round(ms, 4), tflops=round(tflops(flops, ms), 1))
      print(f"{op:24s} {impl:18s} {pass_:8s} {_shape_str(shape):24s} {ms:9.3f} ms "
            f"{rec['tflops']:7.1f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001  (fail soft per implementation)
      self._fail(rec, e)
    self.records.append(rec)
    return rec

  def fail(self, op, impl, pass_, shape, error: Exception, **extra) -> None:
    """Records a measurement that could not be set up."""
    rec = dict(op=op, implementation=impl, **{"pass": pass_}, shape=shape, dtype=DTYPE,
               median_ms=None, tflops=None, device=self.device, date=self.date, **extra)
    self._fail(rec, error)
    self.records.append(rec)

  @staticmethod
  def _fail(rec: dict, error: Exception) -> None:
    rec["error"] = f"{type(error).__name__}: {error}"[:2000]
    print(f"{rec['op']:24s} {rec['implementation']:18s} {rec['pass']:8s} "
          f"{_shape_str(rec['shape']):24s} ERROR {rec['error']}", flush=True)
    traceback.print_exception(error)


def _shape_str(shape: dict) -> str:
  return " ".join(f"{k}{v}" for k, v in shape.items())


def run(out: pathlib.Path, shapes=SHAPES) -> list[dict]:
  device = jax.devices()[0].device_kind
  rec = Recorder(device)
  print(f"device: {device}, jax {jax.__version__}")
  try:
    import torch
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    align = torch_probe_alignment()
  except Exception as e:  # noqa: BLE001
    print(f"torch unavailable: {e}")
    align = 1

  for size in (8192,):
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    shape = dict(M=size, K=size, N=size)
    rec.measure("dense_matmul", "xla", "fwd", shape, 2 * size ** 3,
                functools.partial(time_jax, dot, a, b))

    def torch_dense(a, b):
      ta, tb = torch_from_jax(a), torch_from_jax(b)
      return common.time_torch(lambda: ta @ tb)
    rec.measure("dense_matmul", "torch", "fwd", shape, 2 * size ** 3,
                functools.partial(torch_dense, a, b))
    del a, b

  for g, m, k, n in shapes:
    shape = dict(G=g, M=m, K=k, N=n)
    flops = 2 * m * k * n
    sizes = dirichlet_sizes(g, m, seed=g + k, align=align)
    x, w, d_out, gs = make_inputs(g, m, k, n, sizes)
    extra = dict(group_sizes="dirichlet(1)", group_align=align)
    print(f"\n== G{g} M{m} K{k} N{n}: sizes min {sizes.min()} max {sizes.max()}; "
          f"plan {plan(x, w, gs)}")

    configs = table_configs(m, k, n)
    for name, (fwd, fwd_bwd) in JAX_IMPLS.items():
      cfg = {}
      if name.startswith("k3jax"):
        cfg = dict(configs=configs if name == "k3jax_mosaic_gpu" else "cluster_n=2")
      rec.measure("moe_gmm", name, "fwd", shape, flops, functools.partial(time_jax, fwd, x, w, gs),
                  **extra, **cfg)
      rec.measure("moe_gmm", name, "fwd+bwd", shape, 3 * flops,
                  functools.partial(time_jax, fwd_bwd, x, w, d_out, gs), **extra, **cfg)

    d_lhs = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True))
    d_rhs = jax.jit(mosaic_gpu.tgmm)
    rec.measure("moe_gmm_d_lhs", "k3jax_mosaic_gpu", "fwd", shape, flops,
                functools.partial(time_jax, d_lhs, d_out, w, gs), config=configs["d_lhs"], **extra)
    rec.measure("moe_gmm_d_rhs", "k3jax_mosaic_gpu", "fwd", shape, flops,
                functools.partial(time_jax, d_rhs, x, d_out, gs), config=configs["d_rhs"], **extra)
    dense = jax.jit(lambda a, b: jnp.dot(a, b[0]))
    rec.measure("dense_matmul_same_flops", "xla", "fwd", shape, flops,
                functools.partial(time_jax, dense, x, w), **extra)

    try:
      t_fwd, t_fwd_bwd, note = torch_grouped_mm_fns(x, w, d_out, sizes)
      ours = np.asarray(JAX_IMPLS["k3jax_mosaic_gpu"][0](x, w, gs).astype(jnp.float32))
      err = rel_err(ours, t_fwd().float().cpu().numpy())
      print(f"ours vs torch forward: relative L2 difference {err:.2e}")
      rec.measure("moe_gmm", "torch_grouped_mm", "fwd", shape, flops,
                  lambda: common.time_torch(t_fwd), rel_l2_vs_ours=err, **extra)
      rec.measure("moe_gmm", "torch_grouped_mm", "fwd+bwd", shape, 3 * flops,
                  lambda: common.time_torch(t_fwd_bwd), note=note, **extra)
    except Exception as e:  # noqa: BLE001
      for pass_ in ("fwd", "fwd+bwd"):
        rec.fail("moe_gmm", "torch_grouped_mm", pass_, shape, e, **extra)
    del x, w, d_out
    common.merge_records(str(out), rec.records, KEY_FIELDS)

  print_table(rec.records)
  return rec.records


def print_table(records: list[dict]) -> None:
  """TFLOP/s per (shape, implementation, pass) and our ratio to torch."""
  moe = [r for r in records if r["op"] == "moe_gmm"]
  shapes = sorted({json.dumps(r["shape"]) for r in moe})
  impls = sorted({r["implementation"] for r in moe})
  print("\nmoe_gmm TFLOP/s (ms)")
  print(f"{'shape':26s} " + " ".join(f"{i + ' ' + p:>30s}" for i in impls
                                     for p in ("fwd", "fwd+bwd")))
  for s in shapes:
    cells = []
    for i in impls:
      for p in ("fwd", "fwd+bwd"):
        r = next((r for r in moe if json.dumps(r["shape"]) == s and r["implementation"] == i
                  and r["pass"] == p), None)
        cells.append("-" if r is None or r["tflops"] is None
                     else f"{r['tflops']:.0f} ({r['median_ms']:.2f})")
    print(f"{_shape_str(json.loads(s)):26s} " + " ".join(f"{c:>30s}" for c in cells))
  for s in shapes:
    for p in ("fwd", "fwd+bwd"):
      get = lambda i: next((r["tflops"] for r in moe if json.dumps(r["shape"]) == s
                            and r["implementation"] == i and r["pass"] == p), None)
      ours, torch_ = get("k3jax_mosaic_gpu"), get("torch_grouped_mm")
      if ours and torch_:
        print(f"ours / torch {p:8s} {_shape_str(json.loads(s)):26s} {ours / torch_:.2f}x")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args()
  run(args.out)


if __name__ == "__main__":
  main()
