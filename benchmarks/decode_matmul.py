r"""A decode step's dense products at few rows: XLA's GEMM against `pallas_kernels.decode_matmul`.

k3_small's decode loop spends ~0.27 ms a step (B 16, 128k; BENCHMARKS.md "Decode") in XLA's
GEMMs at M = 16, which read their weights at ~1.2 TB/s, ~40% of the copy rate. Rows, device
time per call from an XLA profiler trace with the weights cycled through enough copies to miss
L2 (`common.device_ms_cycling`): "xla" (`jnp.dot`, fp32 sums, bf16 out: what the model runs)
and "triton:<name>" (the kernel tier in each config of --configs), at the shapes of k3_small's
decode products (read off the model abstractly: the KDA layers' merged input product and
o_proj, the MoE's merged W_in / W_out, MLA's merged W_x (q_a | kv_a | g) and absorbed W_qb
(bf16 models) and its q_a and kv_a alone, the LM head). Floor: the weight, x
and output bytes at the copy rate measured in the same run.

  python3 -m benchmarks.decode_matmul --out=$OUT/decode_matmul_h200.json
`--toy` runs k3_tiny's shapes at M 4 once each in the interpreter (CPU, wall clock).
"""
import math
import os

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from benchmarks import common
from experiments.configs import k3_small, k3_tiny
from k3jax import config as config_lib
from k3jax.model import K3ForCausalLM
from pallas_kernels.decode_matmul import triton as dm_triton
from pallas_kernels import decode_matmul

_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_matmul_h200.json",
                           "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "k3_tiny's shapes at M 4, one call each, the kernel in "
                         "the interpreter (CPU), wall clock.")
_CONFIGS = flags.DEFINE_list("configs", list(dm_triton.CONFIGS), "Names in the kernel tier's "
                             "CONFIGS.")
_ROWS = flags.DEFINE_integer("rows", 16, "M: tokens a step (ignored with --toy: 4).")
KEY_FIELDS = ("op", "implementation", "shape", "device")
L2_BYTES = 50 * 2 ** 20          # H200


def product_shapes(cfg) -> dict[str, tuple[int, int]]:
  """name -> (K, N) of each dense product of a decode step, from the model built abstractly."""
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels)))

  def of(fn):
    return jax.eval_shape(lambda st: fn(nnx.merge(graphdef, st)), state)

  model = nnx.merge(graphdef, state)
  kda = next(i for i, l in enumerate(model.layers) if l.kind == "kda")
  mla = next(i for i, l in enumerate(model.layers) if l.kind != "kda")
  moe = next(i for i, l in enumerate(model.layers) if l.is_moe)
  a = model.layers[mla].self_attn
  o = model.layers[kda].self_attn.o_proj["kernel"].shape
  shapes = {"kda_w_in": of(lambda m: m.layers[kda].self_attn.decode_weights()[0]).shape,
            "kda_o_proj": (math.prod(o[:-1]), o[-1])}
  merged = of(lambda m: m.layers[moe].block_sparse_moe.decode_weights())
  if merged is not None:                       # bf16 models (k3_small; not k3_tiny's fp32)
    shapes.update(moe_w_in=merged[0].shape, moe_w_out=merged[1].shape)
  mla_w = of(lambda m: m.layers[mla].self_attn.decode_weights())
  if mla_w is not None:                        # MLA's merged products (bf16 models)
    shapes["mla_w_x"] = mla_w[0].shape
    if mla_w[1] is not None:
      shapes["mla_w_qb"] = mla_w[1].shape      # the absorbed query's
  shapes["mla_kv_a"] = a.kv_a_proj_with_mqa["kernel"].shape
  if hasattr(a, "q_a_proj"):
    shapes["mla_q_a"] = a.q_a_proj["kernel"].shape
  shapes["lm_head"] = model.lm_head["kernel"].shape
  return {name: tuple(int(d) for d in s) for name, s in shapes.items()}


def main(argv):
  del argv
  toy = _TOY.value
  cfg = config_lib.load((k3_tiny if toy else k3_small).__file__)
  m = 4 if toy else _ROWS.value
  copy = None if toy else common.copy_tbps()
  print(f"device {common.device_name()}: copy {copy} TB/s", flush=True)
  if unknown := set(_CONFIGS.value) - set(dm_triton.CONFIGS):
    raise app.UsageError(f"--configs: unknown {sorted(unknown)}; choose from "
                         f"{sorted(dm_triton.CONFIGS)}")
  for name, (k, n) in product_shapes(cfg).items():
    nbytes = k * n * 2 + m * (k + n) * 2
    copies = 1 if toy else max(2, -(-2 * L2_BYTES // (k * n * 2)))
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [(0.02 * jax.random.normal(jax.random.key(c + 1), (k, n), jnp.float32)
           ).astype(jnp.bfloat16) for c in range(copies)]
    base = dict(op="decode_matmul", shape=dict(name=name, M=m, K=k, N=n),
                dtype="bfloat16", floor_bytes=nbytes,
                floor_ms=None if copy is None else round(nbytes / (copy * 1e12) * 1e3, 4),
                device=common.device_name(), date=common.today(), commit=common.code_commit(),
                versions=common.versions(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                copy_tbps=None if copy is None else round(copy, 3))
    impls = {"xla": (lambda a, b: decode_matmul.matmul(a, b, impl="xla"), "xla")}
    for c in _CONFIGS.value:
      impls[f"triton:{c}"] = (lambda a, b, c=c: decode_matmul.matmul(
          a, b, impl="triton", interpret=toy, config=dm_triton.CONFIGS[c]), c)
    want = decode_matmul.matmul(x, ws[0], impl="xla", preferred_element_type=jnp.float32)
    records = []
    for impl, (fn, cname) in impls.items():
      rec = dict(base, implementation=impl)
      records.append(rec)
      if impl != "xla" and (p := decode_matmul.plan(
          x, ws[0], impl="triton", interpret=toy,
          config=dm_triton.CONFIGS[cname])).impl != "triton":
        rec.update(error=p.declined[0][1])
        print(f"{name:11s} {impl:22s} declined: {p.declined[0][1]}", flush=True)
        continue
      jitted = jax.jit(fn)
      if toy:
        ms = common.time_jax_once(jitted, x, ws[0])
        rec.update(timing="wall: one call after one warm-up (interpreter on CPU)")
      else:
        ms = common.device_ms_cycling(jitted, [(x, w) for w in ws])
        rec.update(timing=f"device: summed kernel time per call, weights cycled over {copies}")
      got = jitted(x, ws[0]).astype(jnp.float32)
      rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
      rec.update(median_ms=round(ms, 4), rel_l2_vs_xla_fp32=rel,
                 floor_fraction=None if rec["floor_ms"] is None else round(rec["floor_ms"] / ms, 3))
      print(f"{name:11s} M{m} K{k} N{n} {impl:22s} {ms * 1e3:9.2f} us  floor "
            f"{None if rec['floor_ms'] is None else round(rec['floor_ms'] * 1e3, 2)} us  "
            f"rel {rel:.1e}", flush=True)
    common.merge_records(_OUT.value, records, KEY_FIELDS)


if __name__ == "__main__":
  app.run(main)
