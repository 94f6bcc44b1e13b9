r"""Decode attention over the filled latent cache (`pallas_kernels.decode_attention`): the tiers
side by side against the bytes-read floor, at the absorbed-MLA decode shapes (report §2.1).

Shapes: H = 8 (k3_small's heads) and 64, Dk = 576 (latent 512 + rope 64), v_dim = 512, B = 1
and 16, S = 4096, 32768, 131072 (`--heads`, `--batches`, `--lengths`), every row filled to S and
to S / 8; T = 1 new token (`--tokens`), bf16. Rows (implementation): each tier by name through
the op: "reference" (the masked softmax over the whole S, as `k3jax.mla.GatedMLA.decode`
computes it today), "xla", "mosaic_gpu", "mosaic_tpu"; a tier that declines is recorded with its
reason, not timed, and a tier that fails with its error. Time: device milliseconds per call from
a profiler trace (`common.device_ms_cycling`: a decode call is shorter than JAX's dispatch of
it), the caches cycling through copies so that the calls' filled bytes exceed twice the L2.
Each record has the bytes a call must read (the filled cache rows B * length * Dk * 2, plus q and
o), the floor `bytes / copy rate` with the copy rate measured in the same run
(`common.copy_tbps`, bytes read + written per second), floor_fraction = floor / time, and the
largest error against the reference relative to its largest |o|. Records are merged into
`--out` after each (B, S, H).

  python3 -m benchmarks.decode_attention --out=$OUT/decode_attention_h200.json
`--toy` runs small shapes once each on CPU with the kernel tiers in their interpreters (CI): there
is no device trace on CPU, so `median_ms` is the wall-clock ms of one call (`timing`).
"""
import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import common
from pallas_kernels import decode_attention as op
from pallas_kernels.decode_attention import mosaic_gpu

_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_attention_h200.json",
                           "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "Small shapes, one call each, the kernel tiers in their "
                         "interpreters (CPU).")
_TOKENS = flags.DEFINE_integer("tokens", 1, "New tokens per row (T).")
_IMPLS = flags.DEFINE_list("impls", list(op.IMPLS), "Tiers to run.")
_HEADS = flags.DEFINE_list("heads", ["8", "64"], "H values.")
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "B values.")
_LENGTHS = flags.DEFINE_list("lengths", ["4096", "32768", "131072"], "S values (cache slots).")
FILLS = (1, 8)                 # filled to S / fill
DK, DV = 576, 512
TOY_HEADS, TOY_BATCHES, TOY_LENGTHS, TOY_DK, TOY_DV = (2,), (1, 2), (256,), 192, 128
SCALE = 192 ** -0.5            # (qk_nope_head_dim + qk_rope_head_dim)^-1/2
L2_BYTES = 50 * 2 ** 20        # H200
MAX_COPIES = 256
KEY_FIELDS = ("op", "implementation", "shape", "device")


def caches(b: int, s: int, dk: int, least_bytes: int, toy: bool) -> list[jax.Array]:
  """Cache copies [B, S, Dk] bf16: one for toy runs, else enough (at most MAX_COPIES) that
  calls reading `least_bytes` each cycle through twice the L2."""
  copies = 1 if toy else min(MAX_COPIES, max(1, -(-2 * L2_BYTES // least_bytes)))
  return [jax.random.normal(jax.random.key(c), (b, s, dk), jnp.bfloat16) for c in range(copies)]


def tier(impl: str, q, cache, lengths, dv: int, toy: bool) -> tuple[str, str]:
  """(tier that runs, the refusals or the kernel's config) for a row."""
  p = op.plan(q, cache, lengths, v_dim=dv, impl=impl, interpret=toy)
  if p.impl != impl:
    return p.impl, "; ".join(reason for _, reason in p.declined)
  if impl == "mosaic_gpu":
    b, t, h, dk = q.shape
    return impl, str(mosaic_gpu.default_config(b, t, h, cache.shape[1], dk,
                                               mosaic_gpu.num_sms(toy), toy))
  return impl, ""


def run_shape(b: int, h: int, s: int, t: int, dk: int, dv: int, copies: list[jax.Array],
              toy: bool, copy: float | None) -> list[dict]:
  q = jax.random.normal(jax.random.key(1), (b, t, h, dk), jnp.bfloat16)
  records = []
  for fill in FILLS:
    length = s // fill
    lengths = jnp.full((b,), length, jnp.int32)
    nbytes = b * length * dk * 2 + b * t * h * (dk + dv) * 2
    shape = dict(B=b, S=s, length=length, H=h, T=t, Dk=dk, Dv=dv)
    base = dict(op="decode_attention", shape=shape, dtype="bfloat16", bytes_read=nbytes,
                device=common.device_name(), date=common.today(), commit=common.code_commit(),
                versions=common.versions(), timing="wall_once" if toy else "device",
                copy_tbps=None if copy is None else round(copy, 3), **{"pass": "fwd"})
    want = None
    for impl in _IMPLS.value:
      ran, note = tier(impl, q, copies[0], lengths, dv, toy)
      rec = dict(base, implementation=impl, tier=ran, note=note)
      records.append(rec)
      label = f"B={b:<2d} H={h:<2d} S={s:<6d} len={length:<6d} {impl:10s}"
      if ran != impl:
        print(f"{label} declined ({note})", flush=True)
        continue
      fn = jax.jit(lambda q, c, l, impl=impl: op.decode_attention(
          q, c, l, v_dim=dv, scale=SCALE, impl=impl, interpret=toy))
      try:
        o = fn(q, copies[0], lengths).astype(jnp.float32)
        if toy:
          ms = common.time_jax_once(fn, q, copies[0], lengths)
        else:
          ms = common.device_ms_cycling(fn, [(q, c, lengths) for c in copies])
      except Exception as e:  # pylint: disable=broad-exception-caught
        rec["note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        print(f"{label} {rec['note']}", flush=True)
        continue
      if impl == "reference":
        want = o
      rec.update(median_ms=round(ms, 5), tbps=round(nbytes / ms / 1e9, 3))
      if want is not None:
        rec["max_err_vs_reference"] = float(jnp.max(jnp.abs(o - want))
                                            / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
      if copy is not None:
        floor = nbytes / copy / 1e9
        rec.update(floor_ms=round(floor, 5), floor_fraction=round(floor / ms, 3))
      print(f"{label} {ms:9.4f} ms {rec['tbps']:7.3f} TB/s"
            + (f"  floor {rec['floor_ms']:.4f} ms ({rec['floor_fraction']:.0%})"
               if copy is not None else "") + f"  [{ran}] {note}", flush=True)
  return records


def main(argv):
  del argv
  toy = _TOY.value
  copy = None if toy else common.copy_tbps()
  print(f"device {common.device_name()}: copy {copy if copy is None else round(copy, 2)} TB/s",
        flush=True)
  dk, dv = (TOY_DK, TOY_DV) if toy else (DK, DV)
  t = _TOKENS.value
  ints = lambda values: tuple(int(v) for v in values)
  for b in TOY_BATCHES if toy else ints(_BATCHES.value):
    for s in TOY_LENGTHS if toy else ints(_LENGTHS.value):
      copies = caches(b, s, dk, b * (s // FILLS[-1]) * dk * 2, toy)
      for h in TOY_HEADS if toy else ints(_HEADS.value):
        common.merge_records(_OUT.value, run_shape(b, h, s, t, dk, dv, copies, toy, copy),
                             KEY_FIELDS)
      del copies


if __name__ == "__main__":
  app.run(main)
