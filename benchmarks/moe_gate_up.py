r"""The MoE experts' first product on the device: gather + [W1 | W3] grouped matmul + SiTU.

Device time per call (`common.device_ms`), one process, same inputs, at k3_small's expert shape
(N 16384 tokens x top-8 = M 131072 rows, K = latent 512, F 512, 64 experts) and K3's
(M 32768 rows of 4096 tokens, K 3584, F 3072, 32 local experts). Rows:
- "triton" / "triton+situ_grads": `pallas_kernels.moe_gate_up`'s fused kernel, h alone
  (inference) and h with SiTU's partials [dh/d gate | dh/d up] (the training forward);
- "unfused": what the layer runs without it: the dispatch gather (`latent_moe.take_rows`), our
  default grouped matmul (`pallas_kernels.ragged_dot`) and XLA's SiTU;
- "unfused_no_gather": the same on rows gathered beforehand (the matmul and SiTU alone).
TFLOP/s count the matmul's 2 M K 2F FLOPs. `--sweep` times the triton tier's tiles instead.
`python3 -m benchmarks.moe_gate_up --out=$OUT/moe_h200.json [--sweep]`.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from k3jax import latent_moe
from k3jax import situ as situ_lib
from pallas_kernels import moe_gate_up
from pallas_kernels import ragged_dot as grouped_matmul
from pallas_kernels.moe_gate_up import triton

_OUT = flags.DEFINE_string("out", "benchmarks/results/moe_h200.json", "Records (JSON list).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Time the triton tier's tiles (printed only).")
_SHAPES = {"k3_small": (16384, 8, 512, 512, 64), "k3": (4096, 8, 3584, 3072, 32)}
B1, B2 = 4.0, 25.0
SWEEP = [triton.Config(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
         for bm, bn, bk, w, s in ((128, 64, 64, 8, 3), (128, 64, 64, 4, 3), (128, 64, 64, 8, 4),
                                  (128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 32, 8, 4),
                                  (256, 64, 64, 8, 3))]


def inputs(n, top_k, k, f, g):
  kx, k1, k3, ke = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (n, k), jnp.bfloat16)
  w1 = (jax.random.normal(k1, (g, k, f), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  w3 = (jax.random.normal(k3, (g, k, f), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  experts = jax.random.randint(ke, (n * top_k,), 0, g)
  order = jnp.argsort(experts, stable=True).astype(jnp.int32)
  return x, order // top_k, w1, w3, jnp.bincount(experts, length=g).astype(jnp.int32)


def unfused(x, rows, w1, w3, sizes, gather=True):
  xs = latent_moe.take_rows(x, rows) if gather else x
  gu = grouped_matmul.ragged_dot(xs, jnp.concatenate([w1, w3], axis=2), sizes)
  f = w1.shape[2]
  return situ_lib.situ(gu[:, :f], gu[:, f:], B1, B2)


def fused(x, rows, w1, w3, sizes, return_situ_grads=False, config=None):
  return moe_gate_up.gate_up(x, rows, w1, w3, sizes, beta1=B1, beta2=B2,
                             return_situ_grads=return_situ_grads, config=config)


def main(argv):
  del argv
  device, date = common.device_name(), common.today()
  records = []
  for name, (n, top_k, k, f, g) in _SHAPES.items():
    args = inputs(n, top_k, k, f, g)
    flops = 2 * n * top_k * k * 2 * f
    shape = dict(M=n * top_k, K=k, F=f, G=g)
    if _SWEEP.value:
      for cfg in SWEEP:
        fn = jax.jit(functools.partial(fused, config=cfg))
        ms = common.device_ms(fn, *args)
        print(f"{name} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
      continue
    pre_gathered = (latent_moe.take_rows(args[0], args[1]),) + args[1:]
    runs = {
        "triton": (jax.jit(fused), args),
        "triton+situ_grads": (jax.jit(functools.partial(fused, return_situ_grads=True)), args),
        "unfused": (jax.jit(unfused), args),
        "unfused_no_gather": (jax.jit(functools.partial(unfused, gather=False)), pre_gathered),
    }
    for impl, (fn, fn_args) in runs.items():
      ms = common.device_ms(fn, *fn_args)
      tf = flops / ms / 1e9
      records.append(dict(op="moe_gate_up", implementation=impl, shape=shape,
                          median_ms=round(ms, 4), tflops=round(tf, 1), dtype="bfloat16",
                          device=device, date=date, **{"pass": "fwd"}))
      print(f"{name} {impl:>18s} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
  if records:
    common.merge_records(_OUT.value, records, ("op", "implementation", "shape", "device"))


if __name__ == "__main__":
  app.run(main)
