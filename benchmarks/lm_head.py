r"""LM head + cross-entropy, forward and backward (report §4.1.4), at k3_small's training shape.

Rows, device time per call of `jax.value_and_grad` w.r.t. h and w (`common.device_ms`):
- "dense": h @ w in fp32 logits [N, V], then optax's integer-label softmax cross-entropy (the
  oracle of tests/test_losses.py), masked mean;
- "blockwise_bt<bt>": `k3jax.losses.lm_head_cross_entropy` with `block_tokens=bt` (the model's
  default is `losses.BLOCK_TOKENS`).
Model FLOPs 6 N d V (the logits matmul and its two gradients), TFLOP/s against the H200's 989.
With `--ops`, the largest device ops of each row (HLO module and op) are printed too.

  python3 -m benchmarks.lm_head --out=$OUT/lm_head_h200.json
`--toy` runs small shapes once on any platform (wall clock) and still writes the records.
"""
import gzip
import json
import tempfile

import jax
import jax.numpy as jnp
import optax
from absl import app, flags

from benchmarks import common
from k3jax import losses

_OUT = flags.DEFINE_string("out", "benchmarks/results/lm_head_h200.json",
                            "Records (JSON list; benchmarks/results/lm_head_<gpu>.json).")
_TOY = flags.DEFINE_bool("toy", False, "Small shapes, one call each, wall clock (any platform).")
_BLOCKS = flags.DEFINE_list("block_tokens", ["1024", "2048", "4096", "8192"],
                            "block_tokens of the blockwise rows.")
_OPS = flags.DEFINE_bool("ops", False, "Print each row's largest device ops.")
PEAK_TFLOPS = 989.0
KEY_FIELDS = ("op", "implementation", "N", "d", "V", "dtype", "device")


def dense_loss(h, w, targets, mask):
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def print_ops(fn, args, top: int = 8):
  """The `top` largest device ops of one call (after a warm-up call)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      jax.block_until_ready(fn(*args))
    with gzip.open(common.find_trace(d)) as f:
      rows = common.device_op_times(json.load(f), by_hlo_op=True)
  for name, calls, us in rows[:top]:
    print(f"    {us / 1e3:8.3f} ms  {calls:4d} x  {name[:150]}", flush=True)


def main(argv):
  del argv
  toy = _TOY.value
  n, d, v = (256, 64, 1000) if toy else (16384, 1024, 163840)
  dtype = jnp.bfloat16
  ks = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(ks[0], (n, d), jnp.float32).astype(dtype)
  w = (d ** -0.5 * jax.random.normal(ks[1], (d, v), jnp.float32)).astype(dtype)
  targets = jax.random.randint(ks[2], (n,), 0, v, jnp.int32)
  mask = (jax.random.uniform(ks[3], (n,)) > 0.05).astype(jnp.float32)
  args = (h, w, targets, mask)
  flops = 6.0 * n * d * v
  timer = common.time_jax_once if toy else common.device_ms
  base = dict(op="lm_head_ce", N=n, d=d, V=v, dtype=jnp.dtype(dtype).name,
              device=common.device_name(), date=common.today(), commit=common.code_commit(),
              versions=common.versions(), model_tflop=round(flops / 1e12, 3),
              floor_ms=round(flops / PEAK_TFLOPS / 1e9, 3))
  rows = [("dense", dense_loss)] + [
      (f"blockwise_bt{bt}", lambda h, w, t, m, bt=int(bt): losses.lm_head_cross_entropy(
          h, w, t, m, block_tokens=bt)[0]) for bt in _BLOCKS.value]
  records, ref = [], None
  for name, loss in rows:
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    value, _ = fn(*args)
    ref = float(value) if ref is None else ref
    ms = timer(fn, *args)
    tflops = flops / ms / 1e9
    records.append(dict(base, implementation=name, median_ms=round(ms, 4),
                        tflops=round(tflops, 1), peak_fraction=round(tflops / PEAK_TFLOPS, 3),
                        loss_minus_dense=float(value) - ref))
    print(f"{name:20s} {ms:9.3f} ms  {tflops:7.1f} TFLOP/s  loss {float(value):.6f}", flush=True)
    if _OPS.value and not toy:
      print_ops(fn, args)
  common.merge_records(_OUT.value, records, KEY_FIELDS)


if __name__ == "__main__":
  app.run(main)
