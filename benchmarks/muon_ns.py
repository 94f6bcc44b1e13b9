r"""Where per-head Muon's time goes (report §2.5): Newton-Schulz on k3_small's Muon blocks.

Rows, device time per call from a profiler trace (`common.device_ms`):
- "orthogonalize": `k3jax.muon.orthogonalize` of every Muon leaf of the model (random fp32
  momenta shaped like the parameters), blocks of equal shape batched across leaves, as the
  train step runs it (`train.muon_ns_dtype`, bf16 by default);
- "orthogonalize_per_leaf": the same with `stack=False` (each leaf's blocks iterated alone, no
  copy of the leaves into their group);
- "ns_<b>x<m>x<n>": `k3jax.muon.newton_schulz` alone on one group of b stacked blocks, already
  [b, m, n] in fp32 (the group's matmuls and its elementwise passes, no stacking);
- "ns_folded_<b>x<m>x<n>": the same with `fold=True` (each step's scalars in its products'
  scales: every elementwise term a GEMM's alpha A B + C).
Each row's model FLOPs are the NS products' (per step 2 m^2 n for X X^T, 2 m^3 for A A and
2 m^2 n for B X) and its TFLOP/s is against the H200's 989. The gap between "orthogonalize" and
the sum of its groups is the stacking, transposing and casting around them.

  python3 -m benchmarks.muon_ns --out=$OUT/muon_h200.json
`--toy` runs k3_tiny once on any platform (wall clock).
"""
import math

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from benchmarks import common
from k3jax import config as config_lib
from k3jax import flops
from k3jax import muon
from k3jax.model import K3ForCausalLM

_OUT = flags.DEFINE_string("out", "benchmarks/results/muon_h200.json", "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "k3_tiny, one call each, wall clock (any platform).")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/k3_small.py", "Model config.")
COEFFS = (3.4445, -4.7750, 2.0315)
STEPS = flops.NS_STEPS
PEAK_TFLOPS = 989.0
KEY_FIELDS = ("op", "implementation", "config", "ns_dtype", "device")


def muon_leaves(config: str):
  """(params tree of the Muon leaves as ShapeDtypeStructs, their treatments, groups
  {(treatment, m, n): blocks})."""
  cfg = config_lib.load(config, {})
  model = nnx.eval_shape(lambda: K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  res = muon._resolver("per_head", None)
  treatments = jax.tree_util.tree_map_with_path(res, params)
  return params, treatments, muon.block_groups(params)


def main(argv):
  del argv
  toy = _TOY.value
  config = "experiments/configs/k3_tiny.py" if toy else _CONFIG.value
  params, treatments, groups = muon_leaves(config)
  dtype = jnp.bfloat16
  key = iter(jax.random.split(jax.random.key(0), 4096))
  tree = jax.tree.map(lambda s: 0.01 * jax.random.normal(next(key), s.shape, jnp.float32),
                      params)
  timer = common.time_jax_once if toy else common.device_ms
  base = dict(op="muon_ns", config=config.rsplit("/", 1)[-1].removesuffix(".py"),
              ns_dtype=jnp.dtype(dtype).name, steps=STEPS, device=common.device_name(),
              date=common.today(), commit=common.code_commit(), versions=common.versions())
  whole = jax.jit(lambda t: muon.orthogonalize(t, treatments, coeffs=COEFFS, steps=STEPS,
                                               dtype=dtype))
  total_flops = sum(flops.ns_flops(b, m, n) for (_, m, n), b in groups.items())
  records = []

  def record(name: str, ms: float, flops: float, **extra):
    tflops = flops / ms / 1e9
    records.append(dict(base, implementation=name, median_ms=round(ms, 4),
                        tflop=round(flops / 1e12, 3), tflops=round(tflops, 1),
                        peak_fraction=round(tflops / PEAK_TFLOPS, 3), **extra))
    print(f"{name:28s} {ms:9.3f} ms  {flops / 1e12:7.3f} TFLOP  {tflops:7.1f} TFLOP/s", flush=True)

  record("orthogonalize", timer(whole, tree), total_flops)
  per_leaf = jax.jit(lambda t: muon.orthogonalize(t, treatments, coeffs=COEFFS, steps=STEPS,
                                                  dtype=dtype, stack=False))
  record("orthogonalize_per_leaf", timer(per_leaf, tree), total_flops)
  by_cost = sorted(groups.items(), key=lambda kv: -flops.ns_flops(kv[1], *kv[0][1:]))
  for (treatment, m, n), b in by_cost:
    if flops.ns_flops(b, m, n) < 0.01 * total_flops:
      continue
    blocks = 0.01 * jax.random.normal(next(key), (b, m, n), jnp.float32)
    for fold in (False, True):
      ns = jax.jit(lambda x, fold=fold: muon.newton_schulz(x, COEFFS, STEPS, dtype=dtype,
                                                           fold=fold))
      record(f"ns_{'folded_' if fold else ''}{b}x{m}x{n}", timer(ns, blocks),
             flops.ns_flops(b, m, n), treatment=treatment, blocks=b, m=m, n=n, fold=fold)
  common.merge_records(_OUT.value, records, KEY_FIELDS + ("m", "n"))
  plain = [r for r in records if r["implementation"].startswith("ns_") and not r["fold"]]
  print(f"NS FLOPs in all {total_flops / 1e12:.2f} TFLOP; "
        f"{math.fsum(r['median_ms'] for r in plain):.3f} ms in the groups timed alone")


if __name__ == "__main__":
  app.run(main)
