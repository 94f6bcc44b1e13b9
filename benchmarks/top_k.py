r"""The router's top-k on the device: `pallas_kernels.top_k` tiers and the rank form.

Device time per call from an XLA profiler trace (`common.device_ms`; these ops are shorter than
JAX's dispatch of a call). Rows: "lax" = `jax.lax.top_k` (the xla tier, a sort on the GPU);
"triton" = our Pallas kernel (`pallas_kernels/top_k/triton.py`); "ranks" = the same result
from ranks (rank_i = #{j : x_j > x_i, or x_j == x_i and j < i}, a compare-and-count over
[N, E, E], then a compare-and-sum over [N, k, E] picks rank r), which XLA runs as one slow
reduction (2026-12-01: 532 against 48 us at 16384 x 64), kept as the measured reason it is not
used.
`python3 -m benchmarks.top_k --out=$OUT/top_k.json`; `--sweep` times the triton tier's row block
and warp count instead (the source of `triton.default_block_rows` / `default_num_warps`).
"""
import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import common
from pallas_kernels.top_k import triton as top_k_triton
from pallas_kernels import top_k as top_k_op

_OUT = flags.DEFINE_string("out", "benchmarks/results/moe_h200.json", "Records (JSON list).")
_SHAPES = ((16384, 64, 8), (16384, 64, 9), (16384, 896, 16))
_SWEEP = flags.DEFINE_bool("sweep", False, "Instead: the triton tier's row block and warp "
                           "count at [16384, 64] k 9 and [16384, 896] k 16 (printed only).")


def rank_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  idx = jnp.arange(x.shape[1], dtype=jnp.int32)
  ahead = (x[:, None, :] > x[:, :, None]) | (
      (x[:, None, :] == x[:, :, None]) & (idx[None, None, :] < idx[None, :, None]))
  rank = jnp.sum(ahead, axis=2, dtype=jnp.int32)
  pick = rank[:, None, :] == jnp.arange(k)[None, :, None]
  return (jnp.sum(jnp.where(pick, x[:, None, :], 0), axis=2),
          jnp.sum(jnp.where(pick, idx, 0), axis=2, dtype=jnp.int32))


def sweep():
  for n, e, k in ((16384, 64, 9), (16384, 896, 16)):
    x = jax.random.uniform(jax.random.key(e + k), (n, e), jnp.float32)
    default = top_k_triton.default_block_rows(e)
    for rows in sorted({max(1, default // 4), max(1, default // 2), default, 2 * default,
                        4 * default}):
      for warps in (2, 4, 8):
        fn = jax.jit(lambda a, r=rows, w=warps, k=k: top_k_triton.top_k(
            a, k, block_rows=r, num_warps=w))
        print(f"N={n} E={e} k={k} rows={rows} warps={warps} "
              f"{1e3 * common.device_ms(fn, x):8.1f} us")


def main(argv):
  del argv
  if _SWEEP.value:
    sweep()
    return
  records = []
  for n, e, k in _SHAPES:
    x = jax.random.uniform(jax.random.key(e + k), (n, e), jnp.float32)
    impls = {"lax": lambda a, k=k: jax.lax.top_k(a, k),
             "triton": lambda a, k=k: top_k_op.top_k(a, k, impl="triton")}
    if e <= 128:
      impls["ranks"] = lambda a, k=k: rank_top_k(a, k)
    for name, fn in impls.items():
      ms = common.device_ms(jax.jit(fn), x)
      print(f"N={n} E={e} k={k} {name:>12s} {1e3 * ms:8.1f} us")
      records.append(dict(op="top_k", implementation=name, shape=dict(N=n, E=e, k=k),
                          dtype="float32", median_ms=round(ms, 4), device=common.device_name(),
                          date=common.today(), **{"pass": "fwd"}))
  common.merge_records(_OUT.value, records, ("op", "implementation", "shape", "device"))


if __name__ == "__main__":
  app.run(main)
