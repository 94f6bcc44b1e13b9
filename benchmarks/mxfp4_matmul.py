r"""MXFP4-weight matmul (`pallas_kernels.mxfp4_matmul`) against bf16 products of the same
dequantized weights, at the K3 expert shapes.

Shapes: (K, N) = (3584, 3072) (w1 / w3, [3072, 3584] in the checkpoint) and (3072, 3584) (w2) at
M = 1, 16, 64, 4096 (`mxfp4_matmul`); and 8 experts grouped with equal groups of M / 8 rows at
M = 16, 64, 4096 (2, 8 and 512 rows per expert, `mxfp4_ragged_dot`). bf16 x, bf16 output.
Rows (implementation):
- "mxfp4_mosaic_gpu": our kernel (the tier by name; a decline is recorded, not timed);
- "mxfp4_mosaic_gpu_<variant>": our kernel with the unswapped tile config changed as `VARIANTS`
  says (`--variants`; a variant whose config equals the default at a shape is not run there):
  "unswapped" as it is (the default swaps the operands where x's rows fit one tile),
  "full_x" loads block_m rows of x per K step and pads x to block_m (the path before x_rows),
  "select" dequantizes by compare and select (`mosaic_gpu.Config.dequant`; the default
  "shift" was 1.2-1.5x faster on the H200, 2026-12-02), "swap" swaps the operands (the
  dequantized tile as wgmma's register operand, x's rows as its N side; `Config.swap`, at
  M <= 64 only, where all of x fits one tile);
- "mxfp4_triton": the Triton tier (`triton.py`, a Pallas kernel on the Triton backend for few
  rows) by name, its default config (a decline is recorded, not timed);
- "mxfp4_triton_<name>": the Triton tier with the candidate config `triton.CONFIGS[name]` (or
  `DECODE_CONFIGS[name]`)
  (`--triton_configs`, block_k shrunk to divide K by `triton.fit`; a config the tier declines at
  a shape is recorded, not timed); a config with `act="mxfp8"` (x rounded to MXFP8, fp8 MMAs)
  is checked against the reference's fp32 product of MXFP8-rounded x (`reference` says so,
  `rel_l2_vs_bf16_x` gives its distance from the bf16-x reference);
- "mxfp4_reference": the reference tier, XLA dequantizing the packed weight on every call;
- "mxfp4_xla": the xla tier, the weight in XLA's float4 / E8M0 types (a dequantization XLA's
  GEMM fusion may take: run with XLA_FLAGS to try it);
- "mxfp4_unpacked": the unpacked tier, the weight unpacked to bf16 in HBM on every call, then
  cuBLAS (dense) or our bf16 grouped GEMM (grouped);
- "bf16_xla": `jnp.dot` with the dequantized bf16 weight (materialised beforehand), dense only;
- "bf16_ragged_dot": our bf16 grouped GEMM `pallas_kernels.ragged_dot.ragged_dot` (its default
  tier; `tier` says which ran), grouped only;
- "stream_packed" / "stream_bf16": no product, an XLA row reduction that reads the packed
  weight and its scales (or the bf16 weight) once as uint32 words into [G, N]
  (`common.read_words`): how long one kernel takes just to read those bytes at this size,
  beside the products that must.
Weights rotate through enough copies that every call reads them from HBM, not L2 (50 MB on the
H200). `median_ms` is device time: the summed kernel durations per call in an XLA profiler
trace of back-to-back calls cycling the weight copies (`common.device_ms_cycling`; every kernel
of the call counts: x's pad, the split-K sum, the cast; launch gaps do not), since a call
shorter than JAX's dispatch (~0.07 ms) timed by wall clock measures the dispatch; `wall_ms` is
the median wall-clock ms of back-to-back calls (`common.time_jax`'s method) beside it. Each
record has TFLOP/s (2 M K N) and its fraction of the spec peak
(`k3jax.flops.peak_flops_per_device`), the weight bytes read per call (MXFP4: 4.25 bits a
weight, packed + scales; bf16: 16) in TB/s and its fraction of the copy rate
(`common.copy_tbps`, bytes read + written), and for our kernels the speedup over bf16 XLA
(dense) or the bf16 grouped GEMM (grouped).

  python3 -m benchmarks.mxfp4_matmul --out=$OUT/mxfp4_h200.json [--variants=select]
      [--triton_configs=shift,n32]
`--toy` runs small shapes once each with our kernels in the Mosaic GPU interpreter (CPU tests):
there is no device trace on CPU, so `median_ms` is the wall-clock ms of one call (`timing`
says which).
"""
import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import common
from k3jax import flops
from k3jax import mx
from pallas_kernels import mxfp4_matmul as op
from pallas_kernels import ragged_dot as grouped_gemm
from pallas_kernels.mxfp4_matmul import mosaic_gpu
from pallas_kernels.mxfp4_matmul import triton

_OUT = flags.DEFINE_string("out", "benchmarks/results/mxfp4_h200.json", "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "Small shapes, one call each, our kernel in the Mosaic "
                         "GPU interpreter (CPU), wall-clock time.")
VARIANTS = {"unswapped": {}, "full_x": dict(x_rows=None), "select": dict(dequant="select"),
            "swap": dict(swap=True), "ptx": dict(swap=True, dequant="ptx"),
            "ptx_split2": dict(swap=True, dequant="ptx", split_k=2),
            "ptx_overlap": dict(swap=True, dequant="ptx", overlap=True)}
_IMPLEMENTATIONS = flags.DEFINE_list(
    "implementations", [], "Rows to run (default: all); mxfp4_reference always runs, the "
    "others' error is taken against it.")
_VARIANTS = flags.DEFINE_list("variants", ["full_x", "select"], f"Kernel config variants to time "
                              f"beside the default, of {list(VARIANTS)}.")
_TRITON_CONFIGS = flags.DEFINE_list(
    "triton_configs", [], f"Candidate configs of the Triton tier to time beside its default, of "
    f"triton.CONFIGS or DECODE_CONFIGS (rows mxfp4_triton_<name>, run whatever "
    f"--implementations says).")
K3_KN = ((3584, 3072), (3072, 3584))
DENSE_M = (1, 16, 64, 4096)
GROUPED_M = (16, 64, 4096)
EXPERTS = 8
TOY_KN = ((512, 128),)
_DENSE_M = flags.DEFINE_list("dense_m", [str(m) for m in DENSE_M],
                             "Rows of the dense calls (K3 shapes; not with --toy).")
_GROUPED_M = flags.DEFINE_list("grouped_m", [str(m) for m in GROUPED_M],
                               "Rows of the grouped calls (K3 shapes; not with --toy).")
TOY_DENSE_M = (16, 72)
TOY_GROUPED_M = (16,)
L2_BYTES = 50 * 2 ** 20          # H200
TRACED_CALLS = 40                # calls per device-time trace
KEY_FIELDS = ("op", "implementation", "shape", "device")


def mxfp4_bytes(g: int, n: int, k: int) -> int:
  """Packed nibbles plus one scale byte per 32 weights: 4.25 bits a weight."""
  return g * n * (k // 2 + k // 32)


def wall_rotating(fn, x, weight_sets, reps: int, calls: int) -> float:
  """Median ms per call of fn(x, *weights), the weights cycling through `weight_sets` so no
  call finds them in L2; each repetition issues `calls` back-to-back calls (as common.time_jax)."""
  for weights in weight_sets:
    jax.block_until_ready(fn(x, *weights))
  times, i = [], 0
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(x, *weight_sets[i % len(weight_sets)])
      i += 1
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / calls)
  return statistics.median(times)


@functools.lru_cache(maxsize=1)     # the M loop reuses one shape's copies
def weight_copies(g: int, n: int, k: int, toy: bool):
  """[(packed, scale, bf16 weight [G, N, K])]: one for toy runs, else enough copies that the
  packed ones alone fill twice the L2."""
  copies = 1 if toy else max(2, -(-2 * L2_BYTES // mxfp4_bytes(g, n, k)))
  out = []
  for c in range(copies):
    w = 0.02 * jax.random.normal(jax.random.key(c), (g, n, k), jnp.float32)
    packed, scale = mx.pack_k3(w)
    out.append((packed, scale, mx.unpack_k3(packed, scale).astype(jnp.bfloat16)))
  return out


def sizes(x) -> jax.Array:
  return jnp.full((EXPERTS,), x.shape[0] // EXPERTS, jnp.int32)


def variant_configs(m: int, k: int, n: int, grouped: bool, toy: bool,
                    variants: list[str]) -> dict:
  """Row name -> our kernel's Config for each variant that differs from the default at this
  shape (none where the default config is a refusal)."""
  args = (m, k, n, EXPERTS if grouped else 1, jnp.bfloat16, mosaic_gpu.num_sms(toy))
  default, cfg = mosaic_gpu.config(*args), mosaic_gpu.config(*args, swap=False)
  if isinstance(cfg, str):
    return {}
  out = {}
  for v in variants:
    changed = dataclasses.replace(cfg, **VARIANTS[v])
    if changed.swap:
      if m > mosaic_gpu.SMALL_M or cfg.block_n != 64:
        continue
      changed = dataclasses.replace(changed, x_rows=cfg.x_rows or -(-m // 8) * 8)
    if changed != default:
      out[f"mxfp4_mosaic_gpu_{v}"] = changed
  return out


def triton_configs(k: int, names: list[str]) -> dict:
  """Row name -> the Triton tier's candidate Config for each name of `--triton_configs`, block_k
  fitted to K (a name of `triton.CONFIGS` or `triton.DECODE_CONFIGS`)."""
  return {f"mxfp4_triton_{name}": triton.fit(triton.ALL_CONFIGS[name], k)
          for name in names}


def rounds_x_to_mxfp8(name: str, m: int, k: int, n: int, grouped: bool, tconfigs: dict) -> bool:
  """Whether a row's kernel rounds x to MXFP8 (the Triton tier with act "mxfp8")."""
  if name in tconfigs:
    return tconfigs[name].act == "mxfp8"
  return name == "mxfp4_triton" and triton.default_config(m, k, n, grouped).act == "mxfp8"


def mxfp8_reference(x, packed, scale, grouped: bool) -> jax.Array:
  """The oracle of rows that round x to MXFP8: the reference tier's product of x quantized by
  `mx.quantize(x, "mxfp8")` and dequantized (fp32 operands, HIGHEST precision), fp32."""
  xq = mx.dequantize(*mx.quantize(x, "mxfp8", axis=-1))
  if grouped:
    return op.mxfp4_ragged_dot(xq, packed, scale, sizes(x), impl="reference",
                               preferred_element_type=jnp.float32)
  return op.mxfp4_matmul(xq, packed, scale, impl="reference", preferred_element_type=jnp.float32)


STREAM_ROWS = {"stream_packed": (lambda x, p, s: common.read_words(p, s), "mxfp4"),
               "stream_bf16": (lambda x, w: common.read_words(w), "bf16")}


def implementations(grouped: bool, toy: bool, configs: dict, tconfigs: dict) -> dict:
  """name -> (fn(x, *weights), which weights: "mxfp4" (packed, scale) or "bf16"); configs:
  `variant_configs`, tconfigs: `triton_configs`, run through the tier modules directly."""
  if grouped:
    return {
        "mxfp4_mosaic_gpu": (lambda x, p, s: op.mxfp4_ragged_dot(
            x, p, s, sizes(x), impl="mosaic_gpu", interpret=toy), "mxfp4"),
        **{name: (functools.partial(
            lambda x, p, s, cfg: mosaic_gpu.ragged_dot(x, p, s, sizes(x), interpret=toy,
                                                       config=cfg), cfg=cfg), "mxfp4")
           for name, cfg in configs.items()},
        "mxfp4_triton": (lambda x, p, s: op.mxfp4_ragged_dot(
            x, p, s, sizes(x), impl="triton", interpret=toy), "mxfp4"),
        **{name: (functools.partial(
            lambda x, p, s, cfg: triton.ragged_dot(x, p, s, sizes(x), interpret=toy,
                                                   config=cfg), cfg=cfg), "mxfp4")
           for name, cfg in tconfigs.items()},
        "mxfp4_reference": (lambda x, p, s: op.mxfp4_ragged_dot(
            x, p, s, sizes(x), impl="reference"), "mxfp4"),
        "mxfp4_xla": (lambda x, p, s: op.mxfp4_ragged_dot(x, p, s, sizes(x), impl="xla"),
                      "mxfp4"),
        "mxfp4_unpacked": (lambda x, p, s: op.mxfp4_ragged_dot(x, p, s, sizes(x),
                                                               impl="unpacked"), "mxfp4"),
        "bf16_ragged_dot": (lambda x, w_t: grouped_gemm.ragged_dot(x, w_t, sizes(x)), "bf16"),
        **STREAM_ROWS,
    }
  return {
      "mxfp4_mosaic_gpu": (lambda x, p, s: op.mxfp4_matmul(x, p, s, impl="mosaic_gpu",
                                                           interpret=toy), "mxfp4"),
      **{name: (functools.partial(
          lambda x, p, s, cfg: mosaic_gpu.matmul(x, p, s, interpret=toy, config=cfg),
          cfg=cfg), "mxfp4") for name, cfg in configs.items()},
      "mxfp4_triton": (lambda x, p, s: op.mxfp4_matmul(x, p, s, impl="triton",
                                                       interpret=toy), "mxfp4"),
      **{name: (functools.partial(
          lambda x, p, s, cfg: triton.matmul(x, p, s, interpret=toy, config=cfg),
          cfg=cfg), "mxfp4") for name, cfg in tconfigs.items()},
      "mxfp4_reference": (lambda x, p, s: op.mxfp4_matmul(x, p, s, impl="reference"), "mxfp4"),
      "mxfp4_xla": (lambda x, p, s: op.mxfp4_matmul(x, p, s, impl="xla"), "mxfp4"),
      "mxfp4_unpacked": (lambda x, p, s: op.mxfp4_matmul(x, p, s, impl="unpacked"), "mxfp4"),
      "bf16_xla": (lambda x, w: jnp.dot(x, w.T), "bf16"),
      **STREAM_ROWS,
  }


def tier(name: str, x, packed, scale, grouped: bool, toy: bool,
         configs: dict, tconfigs: dict) -> tuple[str, str]:
  """(tier that runs, its config or refusals) for a row; a Triton candidate config the tier
  declines gives ("declined", the reason)."""
  if name in configs:
    return "mosaic_gpu", str(configs[name])
  if name in tconfigs:
    gs = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
    reason = (triton.supports_ragged_dot(x, packed, scale, gs, interpret=toy,
                                         config=tconfigs[name]) if grouped else
              triton.supports_matmul(x, packed, scale, interpret=toy, config=tconfigs[name]))
    return ("declined", reason) if reason else ("triton", str(tconfigs[name]))
  if name == "bf16_ragged_dot":
    w_t = jax.ShapeDtypeStruct((EXPERTS, x.shape[1], packed.shape[1]), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
    return grouped_gemm.plan(x, w_t, gs).forward, ""
  if not name.startswith("mxfp4"):
    return "xla", ""
  impl = name.removeprefix("mxfp4_")
  if grouped:
    gs = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
    p = op.plan_ragged_dot(x, packed, scale, gs, impl=impl, interpret=toy)
  else:
    p = op.plan(x, packed, scale, impl=impl, interpret=toy)
  if p.impl != impl:
    return p.impl, "; ".join(reason for _, reason in p.declined)
  (m, k), n = x.shape, packed.shape[-2]
  if impl == "triton":
    return p.impl, str(triton.default_config(m, k, n, grouped))
  if impl != "mosaic_gpu":
    return p.impl, ""
  return p.impl, str(mosaic_gpu.config(m, k, n, EXPERTS if grouped else 1, jnp.bfloat16,
                                       mosaic_gpu.num_sms(toy)))


def run_shape(m: int, k: int, n: int, grouped: bool, toy: bool, peak: float,
              copy: float | None, variants: list[str], tnames: list[str]) -> list[dict]:
  g = EXPERTS if grouped else 1
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
  copies = weight_copies(g, n, k, toy)
  sets = {"mxfp4": [(p, s) if grouped else (p[0], s[0]) for p, s, _ in copies],
          "bf16": [(jnp.swapaxes(w, 1, 2),) if grouped else (w[0],) for _, _, w in copies]}
  shape = dict(M=m, K=k, N=n, G=g)
  base = dict(op="mxfp4_ragged_dot" if grouped else "mxfp4_matmul", shape=shape,
              dtype="bfloat16", device=common.device_name(), date=common.today(),
              commit=common.code_commit(), versions=common.versions(),
              group_sizes=f"equal, M/{EXPERTS} rows" if grouped else "one group",
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              **{"pass": "fwd"})
  configs = variant_configs(m, k, n, grouped, toy, variants)
  tconfigs = triton_configs(k, tnames)
  outputs, records = {}, []
  for name, (fn, kind) in implementations(grouped, toy, configs, tconfigs).items():
    if _IMPLEMENTATIONS.value and name not in {*_IMPLEMENTATIONS.value, *tconfigs,
                                               "mxfp4_reference"}:
      continue
    ran, note = tier(name, x, *sets["mxfp4"][0], grouped, toy, configs, tconfigs)
    rec = dict(base, implementation=name, tier=ran, note=note)
    records.append(rec)
    if ((name == "mxfp4_mosaic_gpu" and ran != "mosaic_gpu")
        or (name.startswith("mxfp4_triton") and ran != "triton")):
      print(f"{base['op']} {shape} {name}: declined ({note})", flush=True)
      continue
    jitted = jax.jit(fn)
    if toy:
      ms = common.time_jax_once(jitted, x, *sets[kind][0])
      rec.update(timing="wall: one call after one warm-up (interpreter on CPU)")
    else:
      calls = max(TRACED_CALLS, len(sets[kind]))
      ms = common.device_ms_cycling(jitted, [(x, *w) for w in sets[kind]], reps=calls)
      rec.update(timing=f"device: summed kernel time per call, trace of {calls} calls",
                 wall_ms=round(wall_rotating(jitted, x, sets[kind], reps=10, calls=10), 4))
    outputs[name] = jitted(x, *sets[kind][0]).astype(jnp.float32)
    weight_bytes = mxfp4_bytes(g, n, k) if kind == "mxfp4" else g * n * k * 2
    tf = 0.0 if name in STREAM_ROWS else 2 * m * k * n / (ms * 1e-3) / 1e12
    tbps = weight_bytes / (ms * 1e-3) / 1e12
    rec.update(median_ms=round(ms, 4), tflops=round(tf, 2) if tf else None,
               peak_fraction=round(tf * 1e12 / peak, 4) if tf else None,
               weight_bytes=weight_bytes,
               weight_tbps=round(tbps, 3),
               copy_fraction=None if copy is None else round(tbps / copy, 3))
    print(f"{base['op']:16s} M{m:<5d} K{k} N{n} {name:18s} {ms:9.4f} ms {tf:8.2f} TFLOP/s "
          f"{tbps:6.3f} TB/s weights  [{ran}] {note}", flush=True)
  peer = next((r for r in records if r["implementation"] in ("bf16_xla", "bf16_ragged_dot")
               and r.get("median_ms")), None)
  ref, ref8 = outputs["mxfp4_reference"], None
  rel_l2 = lambda out, want: float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
  for ours in records:
    name = ours["implementation"]
    if not (name.startswith("mxfp4_") and name != "mxfp4_reference" and ours.get("median_ms")
            and peer):
      continue
    ours["speedup_vs_bf16"] = peer["median_ms"] / ours["median_ms"]
    want, which = ref, "the reference"
    if rounds_x_to_mxfp8(name, m, k, n, grouped, tconfigs):
      if ref8 is None:
        ref8 = mxfp8_reference(x, *sets["mxfp4"][0], grouped)
      want, which = ref8, "the reference of MXFP8 x"
      ours.update(reference="mxfp4_reference of MXFP8-rounded x, fp32",
                  rel_l2_vs_bf16_x=rel_l2(outputs[name], ref))
    ours["rel_l2_vs_reference"] = rel_l2(outputs[name], want)
    print(f"  {name} / {peer['implementation']}: {ours['speedup_vs_bf16']:.2f}x, relative L2 "
          f"vs {which} {ours['rel_l2_vs_reference']:.1e}", flush=True)
  return records


def main(argv):
  del argv
  toy = _TOY.value
  if unknown := set(_VARIANTS.value) - set(VARIANTS):
    raise app.UsageError(f"--variants: unknown {sorted(unknown)}, choose from {list(VARIANTS)}")
  if unknown := set(_TRITON_CONFIGS.value) - set(triton.ALL_CONFIGS):
    raise app.UsageError(f"--triton_configs: unknown {sorted(unknown)}, choose from "
                         f"{list(triton.ALL_CONFIGS)}")
  peak, peak_source = flops.peak_flops_per_device()
  copy = None if toy else common.copy_tbps()
  print(f"device {common.device_name()}: peak {peak / 1e12:.0f} TFLOP/s ({peak_source}), copy "
        f"{copy if copy is None else round(copy, 2)} TB/s", flush=True)
  for k, n in TOY_KN if toy else K3_KN:
    dense = TOY_DENSE_M if toy else [int(m) for m in _DENSE_M.value]
    grouped_m = TOY_GROUPED_M if toy else [int(m) for m in _GROUPED_M.value]
    points = [(m, False) for m in dense] + [(m, True) for m in grouped_m]
    for m, grouped in points:
      records = run_shape(m, k, n, grouped, toy, peak, copy, _VARIANTS.value,
                          _TRITON_CONFIGS.value)
      for r in records:
        r.update(peak_tflops=round(peak / 1e12, 1), peak_source=peak_source,
                 copy_tbps=None if copy is None else round(copy, 3))
      common.merge_records(_OUT.value, records, KEY_FIELDS)   # a run cut short keeps its rows


if __name__ == "__main__":
  app.run(main)
