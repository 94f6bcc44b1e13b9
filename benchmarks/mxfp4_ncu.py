r"""One MXFP4 tier's kernel at one shape, called a few times, for Nsight Compute to read its
hardware counters (where its time goes: issue slots, stalls, memory throughput, occupancy).

Random packed weights in the checkpoint's layout (uniform code and scale bytes in [117, 127]),
x ~ N(0, 1) in bf16; `--groups` > 1 calls `mxfp4_ragged_dot` with equal groups, else
`mxfp4_matmul`. Run it under ncu, which profiles the launches its filter names:

  ncu --clock-control none -k regex:mxfp4 -s 2 -c 1 --section WarpStateStats \
      python3 -m benchmarks.mxfp4_ncu --impl=triton --m=16 --groups=8

(`bash benchmarks/h200_baseline.sh mxfp4_ncu` runs each kernel at the grouped decoding shape.)
"""
from absl import app, flags
import jax
import jax.numpy as jnp

from pallas_kernels import mxfp4_matmul as op

_IMPL = flags.DEFINE_string("impl", "triton", "Tier (`impl` of the op).")
_M = flags.DEFINE_integer("m", 16, "Rows of x.")
_K = flags.DEFINE_integer("k", 3584, "K.")
_N = flags.DEFINE_integer("n", 3072, "N.")
_GROUPS = flags.DEFINE_integer("groups", 8, "Experts (equal groups of M / groups rows); 1: dense.")
_CALLS = flags.DEFINE_integer("calls", 4, "Calls (the profiler's filter picks among them).")


def main(argv):
  del argv
  m, k, n, g = _M.value, _K.value, _N.value, _GROUPS.value
  keys = jax.random.split(jax.random.key(0), 3)
  packed = jax.random.randint(keys[0], (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
  scale = jax.random.randint(keys[1], (g, n, k // 32), 117, 128, jnp.int32).astype(jnp.uint8)
  x = jax.random.normal(keys[2], (m, k), jnp.float32).astype(jnp.bfloat16)
  if g > 1:
    sizes = jnp.full((g,), m // g, jnp.int32).at[-1].add(m % g)
    fn = jax.jit(lambda x, p, s: op.mxfp4_ragged_dot(x, p, s, sizes, impl=_IMPL.value))
  else:
    fn = jax.jit(lambda x, p, s: op.mxfp4_matmul(x, p[0], s[0], impl=_IMPL.value))
  for _ in range(_CALLS.value):
    out = fn(x, packed, scale)
  print(f"{_IMPL.value}: M {m} K {k} N {n} G {g} -> {out.shape}, |out| max "
        f"{float(jnp.max(jnp.abs(out.astype(jnp.float32)))):.3g}")


if __name__ == "__main__":
  app.run(main)
