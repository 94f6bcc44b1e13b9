r"""The routed experts' grouped products at decoding shapes: B tokens x top-k copies over G
experts, a few rows per expert (`pallas_kernels.ragged_dot`, bf16).

Shapes (G, K, N; B, top-k): k3_small's gate/up (64, 512, 1024) and down (64, 512, 512) at
B 1 and 16 with top-8, and with top-64 (the all-experts decode path's B rows on every expert:
shapes "..._all"); K3's gate/up (3584 -> 2 x 3072) and down (3072 -> 3584) with top-16 at
B 1 and 16, G = the experts the copies can touch (B x 16, not all 896: the bf16 weights of 896
would not fit beside their copies). Group sizes from random routing: each token takes top-k
distinct experts uniformly (seeded).
Rows (implementation):
- "ws": the mosaic_gpu tier's default config (`gmm_config`; below 64 rows it declines and the
  row records the refusal);
- "swapped": the "swapped" kernel (`mosaic_gpu.swapped_config`: weights on wgmma's 64-row side);
- "xla": `jax.lax.ragged_dot`;
- "mxfp4": the same experts packed as MXFP4 (the checkpoint's layout, `k3jax.mx.pack_k3` of
  each W_g^T) through `mxfp4_ragged_dot` at the platform's default tier (`tier` records which),
  gate/up as two calls on W1 and W3 (N / 2 each), as the model runs packed experts;
  its floor counts the packed bytes (4.25 bits a weight), its error is against the MXFP4
  reference tier (`rel_l2_vs_reference`), not bf16 XLA.
Gate/up shapes also run the packed experts' first product as the MoE does, from the B token
rows (op "moe_decode_gate_up"): "unfused" (the copies gathered as the MoE's dispatch does,
`latent_moe.take_rows`, the two calls above, SiTU by XLA) against
`mxfp4_matmul.triton.gate_up` (gather, W1, W3 and SiTU in one launch) in its default config
and in each of --gate_up_configs; errors against the reference tier's gate/up.
Where F == K (k3_small), op "moe_decode_ffn" runs the packed experts whole from the B token
rows: "unfused" (the fused gate/up, W2 as a grouped call, the combine) against
`mxfp4_matmul.triton.expert_ffn` (one launch, then the combine's fusion); errors against
the reference tier's `expert_ffn`.
`--grouped_configs` adds rows "mxfp4_<name>": the packed grouped products on the Triton tier in
`mxfp4_matmul.triton.DECODE_CONFIGS`' candidates (gate/up as two calls).
`median_ms` is device time from a profiler trace of back-to-back calls cycling weight copies
that together exceed twice the L2 (`common.device_ms_cycling`); the floor is the bytes of the
touched experts' weights (plus x and out) at the copy rate. `--toy` runs small shapes once in
the Mosaic GPU and Pallas interpreters (CPU tests; "mxfp4" on the Triton tier), wall clock.

  python3 -m benchmarks.moe_decode_gemm --out=$OUT/moe_decode_h200.json
  python3 -m benchmarks.moe_decode_gemm --shapes=k3_small_gate_up,k3_gate_up   # gate/up only
"""
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from k3jax import latent_moe
from k3jax import mx
from k3jax import situ
from pallas_kernels.mxfp4_matmul import mxfp4_matmul
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan_ragged_dot as mxfp4_plan
from pallas_kernels.mxfp4_matmul import reference as mxfp4_reference
from pallas_kernels.mxfp4_matmul import triton as mxfp4_triton
from pallas_kernels.ragged_dot import mosaic_gpu
from pallas_kernels.ragged_dot import plan
from pallas_kernels.ragged_dot import ragged_dot

_OUT = flags.DEFINE_string("out", "benchmarks/results/moe_decode_h200.json",
                           "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "Small shapes, one call each, the kernels in the Mosaic "
                         "GPU interpreter (CPU), wall-clock time.")
_SHAPES = flags.DEFINE_list("shapes", None, "Names of SHAPES to run (default: all).")
# name -> (G, K, N, top_k)
# The "_all" shapes are k3_small's all-experts decode path (`latent_moe.all_experts`): every
# token's copy on every expert (top-k = G), B rows a group.
SHAPES = {"k3_small_gate_up": (64, 512, 1024, 8), "k3_small_down": (64, 512, 512, 8),
          "k3_small_gate_up_all": (64, 512, 1024, 64), "k3_small_down_all": (64, 512, 512, 64),
          "k3_gate_up": (None, 3584, 6144, 16), "k3_down": (None, 3072, 3584, 16)}
BATCHES = (1, 16)
_BATCHES = flags.DEFINE_list("batches", [str(b) for b in BATCHES],
                             "Token batches to run at each shape (default: 1 and 16).")
TOY_SHAPES = {"toy_gate_up": (16, 128, 256, 4)}   # W1 | W3: two packed calls
TOY_BATCHES = (2,)
MXFP4_TOY_IMPL = "triton"        # --toy: the Triton tier in its interpreter (CPU's default is
                                 # the reference the row is checked against)
L2_BYTES = 50 * 2 ** 20          # H200
_GROUPED_CONFIGS = flags.DEFINE_list(
    "grouped_configs", [],
    f"triton.DECODE_CONFIGS for the packed grouped rows: {sorted(mxfp4_triton.DECODE_CONFIGS)}")
_GATE_UP_CONFIGS = flags.DEFINE_list(
    "gate_up_configs", ["n32_k256_ptx"], "triton.DECODE_CONFIGS for the fused gate/up rows.")
BETAS = (4.0, 2.0)               # SiTU's beta1, beta2 (any: the timing does not depend on them)
TRACED_CALLS = 40
KEY_FIELDS = ("op", "implementation", "shape", "device")


def routed_picks(batch: int, top_k: int, groups: int, seed: int = 0) -> np.ndarray:
  """[batch * top_k] experts: each of `batch` tokens routed to top_k distinct ones of
  `groups`."""
  rng = np.random.default_rng(seed)
  return np.concatenate([rng.choice(groups, top_k, replace=False) for _ in range(batch)])


def routed_sizes(batch: int, top_k: int, groups: int, seed: int = 0) -> np.ndarray:
  """Group sizes of `routed_picks`."""
  return np.bincount(routed_picks(batch, top_k, groups, seed), minlength=groups).astype(np.int32)


def implementations(m: int, k: int, n: int, g: int, toy: bool) -> dict:
  """name -> (fn(x, w, sizes), config, or the reason a config cannot run, or None)."""
  bf16 = jnp.bfloat16
  swapped = mosaic_gpu.swapped_config(m, k, n, g, bf16, bf16)
  impls = {
      "ws": (lambda x, w, gs: ragged_dot(x, w, gs, impl="mosaic_gpu", interpret=toy), None),
      "swapped": (lambda x, w, gs: mosaic_gpu.gmm(x, w, gs, interpret=toy, config=swapped),
                  swapped),
      "xla": (lambda x, w, gs: jax.lax.ragged_dot(x, w, gs), None),
      "mxfp4": (lambda x, parts, gs: jnp.concatenate(
          [mxfp4_ragged_dot(x, *w, gs, impl=MXFP4_TOY_IMPL if toy else None, interpret=toy)
           for w in parts], axis=1), None),
  }
  for name in _GROUPED_CONFIGS.value:
    cfg = mxfp4_triton.fit(mxfp4_triton.DECODE_CONFIGS[name], k)
    impls[f"mxfp4_{name}"] = (lambda x, parts, gs, cfg=cfg: jnp.concatenate(
        [mxfp4_triton.ragged_dot(x, *w, gs, interpret=toy, config=cfg) for w in parts],
        axis=1), cfg)
  return impls


@jax.jit
def packed(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bf16 experts w [G, K, N] -> MXFP4 (weight_packed [G, N, K/2], weight_scale [G, N, K/32])
  of each W_g = w[g]^T, one expert at a time (bounded temporaries at K3's sizes)."""
  return jax.lax.map(lambda e: mx.pack_k3(e.T.astype(jnp.float32)), w)


@jax.jit
def reference_output(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array,
                     sizes: jax.Array) -> jax.Array:
  """The MXFP4 reference of the grouped product, fp32 [M, N], one expert at a time: each
  expert's dense reference product of all M rows, kept on its group's rows (the grouped
  reference unpacks all G experts at once: 22.5 GB in fp32 at K3's gate/up, B 16)."""
  group = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=x.shape[0])

  def one(g, out):
    y = mxfp4_matmul(x, w_packed[g], w_scale[g], impl="reference",
                     preferred_element_type=jnp.float32)
    return jnp.where((group == g)[:, None], y, out)

  return jax.lax.fori_loop(0, sizes.shape[0], one,
                           jnp.zeros((x.shape[0], w_packed.shape[1]), jnp.float32))


def timed(jitted: Callable, rec: dict, x: jax.Array, weight_sets: list, sizes: jax.Array,
          toy: bool) -> float:
  """ms per call of jitted(x, w, sizes): one call's wall time with --toy, else device time
  over calls cycling the weight copies; rec["timing"] says which."""
  if toy:
    rec.update(timing="wall: one call after one warm-up (interpreter on CPU)")
    return common.time_jax_once(jitted, x, weight_sets[0], sizes)
  calls = max(TRACED_CALLS, len(weight_sets))
  rec.update(timing=f"device: summed kernel time per call, trace of {calls} calls")
  return common.device_ms_cycling(jitted, [(x, w, sizes) for w in weight_sets], reps=calls)


def run_shape(name: str, g: int, k: int, n: int, batch: int, top_k: int, toy: bool,
              copy: float | None) -> list[dict]:
  m = batch * top_k
  sizes = jnp.asarray(routed_sizes(batch, top_k, g))
  touched = int(jnp.sum(sizes > 0))
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
  weight_bytes = g * k * n * 2
  copies = 1 if toy else max(2, -(-2 * L2_BYTES // weight_bytes))
  weights = [(0.02 * jax.random.normal(jax.random.key(c), (g, k, n), jnp.float32)
              ).astype(jnp.bfloat16) for c in range(copies)]
  halves = 2 if "gate_up" in name else 1          # packed W1 and W3 apart
  weight_sets = {"bf16": weights,
                 "mxfp4": [tuple(packed(h) for h in jnp.split(w, halves, axis=2))
                           for w in weights]}
  io_bytes = m * (k + n) * 2
  floors = {"bf16": touched * k * n * 2 + io_bytes,
            "mxfp4": touched * n * (k // 2 + k // mx.BLOCK) + io_bytes}
  floor_ms = lambda nbytes: None if copy is None else round(nbytes / (copy * 1e12) * 1e3, 4)
  shape = dict(name=name, G=g, M=m, K=k, N=n, B=batch, top_k=top_k)
  base = dict(op="moe_decode_gemm", shape=shape, dtype="bfloat16", touched_experts=touched,
              floor_bytes=floors["bf16"], floor_ms=floor_ms(floors["bf16"]),
              device=common.device_name(), date=common.today(), commit=common.code_commit(),
              versions=common.versions(), xla_flags=os.environ.get("XLA_FLAGS", ""))
  records, outputs = [], {}
  for impl, (fn, cfg) in implementations(m, k, n, g, toy).items():
    kind = "mxfp4" if impl.startswith("mxfp4") else "bf16"
    ws = weight_sets[kind]
    rec = dict(base, implementation=impl, config=None if cfg is None else str(cfg))
    records.append(rec)
    if impl == "ws":
      p = plan(x, weights[0], sizes, impl="mosaic_gpu", interpret=toy)
      rec.update(tier=p.forward, note="; ".join(r for _, _, r in p.declined))
    if impl == "mxfp4":
      p = mxfp4_plan(x, *ws[0][0], sizes, impl=MXFP4_TOY_IMPL if toy else None, interpret=toy)
      rec.update(tier=p.impl, note="; ".join(f"{t}: {r}" for t, r in p.declined))
    elif kind == "mxfp4":
      rec.update(tier="triton")
      cfg = mxfp4_triton.supports_ragged_dot(x, *ws[0][0], sizes, interpret=toy,
                                             config=cfg) or cfg
    if kind == "mxfp4":
      rec.update(floor_bytes=floors[kind], floor_ms=floor_ms(floors[kind]))
    if isinstance(cfg, str):
      rec.update(error=cfg)
      print(f"{name} B{batch} {impl}: declined ({cfg})", flush=True)
      continue
    jitted = jax.jit(fn)
    ms = timed(jitted, rec, x, ws, sizes, toy)
    outputs[impl] = jitted(x, ws[0], sizes).astype(jnp.float32)
    rec.update(median_ms=round(ms, 4),
               floor_fraction=None if rec["floor_ms"] is None else round(rec["floor_ms"] / ms, 3))
    print(f"{name:18s} B{batch:<3d} G{g} M{m} K{k} N{n} {impl:8s} {ms:9.4f} ms  floor "
          f"{rec['floor_ms']} ms", flush=True)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  del weights, weight_sets["bf16"]     # K3's gate/up at B 16: 22.5 GB, unused from here
  if halves == 2:
    records += run_gate_up(base, batch, top_k, g, k, weight_sets["mxfp4"], floors["mxfp4"],
                           floor_ms, toy, rel)
  for rec in records:
    impl = rec["implementation"]
    if impl.startswith("mxfp4") and impl in outputs:
      want = jnp.concatenate([reference_output(x, *w, sizes)
                              for w in weight_sets["mxfp4"][0]], axis=1)
      rec["rel_l2_vs_reference"] = rel(outputs[impl], want)
    elif impl in outputs and impl != "xla":
      rec["rel_l2_vs_xla"] = rel(outputs[impl], outputs["xla"])
  return records


def run_gate_up(base: dict, batch: int, top_k: int, g: int, k: int, weight_sets: list,
                floor_bytes: int, floor_ms: Callable, toy: bool, rel: Callable) -> list[dict]:
  """The packed experts' gate/up from the B token rows: "unfused" against the fused kernel in
  its default config and --gate_up_configs (op "moe_decode_gate_up"; module docstring)."""
  picks = routed_picks(batch, top_k, g)
  rows = jnp.asarray(np.argsort(picks, kind="stable") // top_k, jnp.int32)
  sizes = jnp.asarray(np.bincount(picks, minlength=g), jnp.int32)
  x = jax.random.normal(jax.random.key(batch), (batch, k), jnp.float32).astype(jnp.bfloat16)

  def unfused(x, parts, gs):
    xs = latent_moe.take_rows(x, rows)
    gate, up = (mxfp4_ragged_dot(xs, *w, gs, impl=MXFP4_TOY_IMPL if toy else None,
                                 interpret=toy, preferred_element_type=jnp.float32)
                for w in parts)
    return situ.situ(gate, up, *BETAS).astype(x.dtype)

  def fused(config):
    return lambda x, parts, gs: mxfp4_triton.gate_up(
        x, rows, *parts[0], *parts[1], gs, beta1=BETAS[0], beta2=BETAS[1], interpret=toy,
        config=config)

  impls = {"unfused": (unfused, None), "fused": (fused(None), None)}
  for name in _GATE_UP_CONFIGS.value:
    cfg = mxfp4_triton.fit(mxfp4_triton.DECODE_CONFIGS[name], k)
    impls[f"fused_{name}"] = (fused(cfg), cfg)
  (w1, w3), = weight_sets[:1]
  xs = latent_moe.take_rows(x, rows)
  want = situ.situ(reference_output(xs, *w1, sizes), reference_output(xs, *w3, sizes),
                   *BETAS).astype(x.dtype)       # the reference tier's, one expert at a time
  records = []
  for impl, (fn, cfg) in impls.items():
    rec = dict(base, op="moe_decode_gate_up", implementation=impl, floor_bytes=floor_bytes,
               floor_ms=floor_ms(floor_bytes), config=None if cfg is None else str(cfg))
    rec["shape"] = dict(base["shape"], M=batch * top_k, N=w1[0].shape[1], tokens=batch)
    if impl.startswith("fused") and (reason := mxfp4_triton.supports_gate_up(
        x, rows, *w1, *w3, sizes, interpret=toy, config=cfg)):
      rec.update(error=reason)
      records.append(rec)
      continue
    jitted = jax.jit(fn)
    ms = timed(jitted, rec, x, weight_sets, sizes, toy)
    got = jitted(x, weight_sets[0], sizes).astype(jnp.float32)
    rec.update(median_ms=round(ms, 4), rel_l2_vs_reference=rel(got, want.astype(jnp.float32)),
               floor_fraction=None if rec["floor_ms"] is None else round(rec["floor_ms"] / ms, 3))
    records.append(rec)
    print(f"{base['shape']['name']:18s} B{batch:<3d} gate/up {impl:22s} {ms:9.4f} ms  rel "
          f"{rec['rel_l2_vs_reference']:.1e}", flush=True)
  if w1[0].shape[1] == k:       # F == K (k3_small): W1's packed shape serves as W2 [G, K, F/2]
    records += run_ffn(base, picks, x, weight_sets, sizes, floor_bytes, floor_ms, toy, rel)
  return records


def run_ffn(base: dict, picks: np.ndarray, x: jax.Array, weight_sets: list, sizes: jax.Array,
            floor_bytes: int, floor_ms: Callable, toy: bool, rel: Callable) -> list[dict]:
  """The packed experts whole from the B token rows (op "moe_decode_ffn"): "unfused" (the
  fused gate/up, W2 as a grouped call, `latent_moe.combine`) against `mxfp4_triton.expert_ffn`
  (one launch and the combine's fusion); W1's packed copy serves as W2 (F == K)."""
  batch, top_k = x.shape[0], len(picks) // x.shape[0]
  order = np.argsort(picks, kind="stable")
  order, inverse = (jnp.asarray(a, jnp.int32) for a in (order, np.argsort(order)))
  weights = jax.random.uniform(jax.random.key(1), (batch, top_k), jnp.float32, 0.1, 1.0)
  impl_kw = dict(impl=MXFP4_TOY_IMPL if toy else None, interpret=toy)

  def unfused(x, parts, gs):
    h = mxfp4_triton.gate_up(x, order // top_k, *parts[0], *parts[1], gs, beta1=BETAS[0],
                             beta2=BETAS[1], interpret=toy)
    out = mxfp4_ragged_dot(h, *parts[0], gs, **impl_kw)
    return latent_moe.combine(out, weights, order, inverse)

  def fused(x, parts, gs):
    return mxfp4_triton.expert_ffn(x, weights, order, inverse, *parts[0], *parts[1],
                                   *parts[0], gs, beta1=BETAS[0], beta2=BETAS[1],
                                   interpret=toy)

  (w1, w3), = weight_sets[:1]
  want = mxfp4_reference.expert_ffn(x, weights, order, inverse, *w1, *w3, *w1, sizes,
                                    beta1=BETAS[0], beta2=BETAS[1])
  records = []
  for impl, fn in (("unfused", unfused), ("expert_ffn", fused)):
    nbytes = floor_bytes * 3 // 2             # W2's bytes: half the gate/up's
    rec = dict(base, op="moe_decode_ffn", implementation=impl, floor_bytes=nbytes,
               floor_ms=floor_ms(nbytes), config=None)
    rec["shape"] = dict(base["shape"], M=batch * top_k, N=w1[0].shape[1], tokens=batch)
    jitted = jax.jit(fn)
    ms = timed(jitted, rec, x, weight_sets, sizes, toy)
    got = jitted(x, weight_sets[0], sizes).astype(jnp.float32)
    rec.update(median_ms=round(ms, 4), rel_l2_vs_reference=rel(got, want),
               floor_fraction=None if rec["floor_ms"] is None else round(rec["floor_ms"] / ms, 3))
    records.append(rec)
    print(f"{base['shape']['name']:18s} B{batch:<3d} ffn {impl:26s} {ms:9.4f} ms  rel "
          f"{rec['rel_l2_vs_reference']:.1e}", flush=True)
  return records


def main(argv):
  del argv
  toy = _TOY.value
  copy = None if toy else common.copy_tbps()
  print(f"device {common.device_name()}: copy {copy} TB/s", flush=True)
  shapes = TOY_SHAPES if toy else SHAPES
  if unknown := set(_SHAPES.value or ()) - set(shapes):
    raise app.UsageError(f"--shapes: unknown {sorted(unknown)}; choose from {sorted(shapes)}")
  for flag in (_GROUPED_CONFIGS, _GATE_UP_CONFIGS):
    if unknown := set(flag.value) - set(mxfp4_triton.DECODE_CONFIGS):
      raise app.UsageError(f"--{flag.name}: unknown {sorted(unknown)}; choose from "
                           f"{sorted(mxfp4_triton.DECODE_CONFIGS)}")
  for name, (g, k, n, top_k) in shapes.items():
    if _SHAPES.value and name not in _SHAPES.value:
      continue
    for batch in TOY_BATCHES if toy else [int(b) for b in _BATCHES.value]:
      records = run_shape(name, g or batch * top_k, k, n, batch, top_k, toy, copy)
      for r in records:
        r.update(copy_tbps=None if copy is None else round(copy, 3))
      common.merge_records(_OUT.value, records, KEY_FIELDS)   # a run cut short keeps its rows


if __name__ == "__main__":
  app.run(main)
