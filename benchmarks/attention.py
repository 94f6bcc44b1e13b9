r"""MLA training attention (`pallas_kernels.attention`) against cuDNN's own time and the
written-out reference, forward and forward+backward (`jax.value_and_grad` of sum(o)).

Shapes: k3_small (B 2, T 8192, H 8) and K3 (B 1, T 8192, H 32 and 96), q/k head dim 192,
v 128, bf16, causal, 4 packed documents per row. Rows: each tier by name through the op (a
tier that declines is reported with its reason, not timed), and "cudnn_own":
`jax.nn.dot_product_attention(implementation="cudnn")`, causal without documents, v
zero-padded to 192 (JAX's wrapper requires equal head dims), and "cudnn_unpacked": our cudnn
tier on the same call without documents (its like-for-like against cudnn_own). Median wall ms
of back-to-back calls (`common.time_jax`). The kernel tiers' max logit for QK-Clip alone (op
"mla_max_logit", pass "max_logit"): the Pallas Triton kernel ("max_logit_triton", GPU) against
xla_blockwise's pass ("max_logit_xla_blockwise") on the same packed inputs.
`python3 -m benchmarks.attention --out=$OUT/attention.json`; `--smoke` runs toy shapes once on
any platform (CI).
"""
import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import common
from pallas_kernels import attention as attention_op
from pallas_kernels.attention import max_logit_triton
from pallas_kernels.attention import xla_blockwise

_OUT = flags.DEFINE_string("out", "benchmarks/results/train_h200.json", "Records (JSON list).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Toy shapes, one call each (CI; give --out).")
_SHAPES = flags.DEFINE_list("shapes", [], "BxTxH shapes (default: SHAPES).")
_IMPLS = flags.DEFINE_list("impls", [], "Rows to run (default: every tier, and cudnn_own on GPU).")
SHAPES = ((2, 8192, 8), (1, 8192, 32), (1, 8192, 96))
SMOKE_SHAPES = ((1, 128, 2),)   # T: a multiple of the max-logit kernel's block_q
DK, DV, DOCS = 192, 128, 4


def inputs(b, t, h, dtype):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, h, DK), dtype)
  k = jax.random.normal(ks[1], (b, t, h, DK), dtype)
  v = jax.random.normal(ks[2], (b, t, h, DV), dtype)
  ids = jnp.broadcast_to(1 + jnp.arange(t, dtype=jnp.int32) * DOCS // t, (b, t))
  return q, k, v, ids


def cudnn_own(q, k, v, ids):
  del ids
  v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, DK - DV)))
  o = jax.nn.dot_product_attention(q, k, v, scale=DK ** -0.5, is_causal=True,
                                   implementation="cudnn")
  return o[..., :DV]


def ours(impl):
  return lambda q, k, v, ids: attention_op.attention(q, k, v, segment_ids=ids, scale=DK ** -0.5,
                                                     impl=impl)


def max_logit_rows(smoke: bool) -> dict:
  """name -> max logit of (q, k, v, ids): the Triton kernel (interpreted with --smoke) and
  xla_blockwise's pass."""
  kw = dict(causal=True, scale=DK ** -0.5)
  return {
      "max_logit_triton": lambda q, k, v, ids: max_logit_triton.max_logit(
          q, k, ids, ids, interpret=smoke, **kw),
      "max_logit_xla_blockwise": lambda q, k, v, ids: xla_blockwise.max_logit(
          q, k, ids, ids, **kw),
  }


def passes(fn):
  """{"fwd": jitted o, "fwd_bwd": jitted value_and_grad of sum(o) in q, k, v}."""
  loss = lambda q, k, v, ids: jnp.sum(fn(q, k, v, ids).astype(jnp.float32))
  return {"fwd": jax.jit(fn), "fwd_bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))}


def main(argv):
  del argv
  smoke = _SMOKE.value
  on_gpu = jax.devices()[0].platform == "gpu"
  records = []
  shapes = [tuple(int(x) for x in s.split("x")) for s in _SHAPES.value] or SHAPES
  for b, t, h in SMOKE_SHAPES if smoke else shapes:
    q, k, v, ids = inputs(b, t, h, jnp.bfloat16)
    rows = {name: ours(name) for name in attention_op.IMPLS}
    if on_gpu:
      rows["cudnn_own"] = cudnn_own
      rows["cudnn_unpacked"] = lambda q, k, v, ids: ours("cudnn")(q, k, v, None)
    if _IMPLS.value:
      rows = {name: fn for name, fn in rows.items() if name in _IMPLS.value}
    for name, fn in rows.items():
      if name in attention_op.IMPLS and name != "reference":
        p = attention_op.plan(q, k, v, segment_ids=ids, impl=name)
        if p.impl != name:
          print(f"B={b} T={t} H={h} {name:>14s} declined: {p.declined[0][1]}")
          continue
      for kind, jitted in passes(fn).items():
        try:
          ms = (common.time_jax_once if smoke else common.time_jax)(jitted, q, k, v, ids)
        except Exception as e:  # pylint: disable=broad-exception-caught
          print(f"B={b} T={t} H={h} {name:>14s} {kind:>8s} failed: {type(e).__name__}: "
                f"{str(e)[:200]}")
          continue
        print(f"B={b} T={t} H={h} {name:>14s} {kind:>8s} {ms:9.3f} ms")
        records.append(dict(op="mla_attention", implementation=name,
                            shape=dict(B=b, T=t, H=h, Dk=DK, Dv=DV, docs=DOCS),
                            dtype="bfloat16", median_ms=round(ms, 4),
                            device=common.device_name(), date=common.today(),
                            **{"pass": kind}))
    for name, fn in max_logit_rows(smoke).items():
      if _IMPLS.value and name not in _IMPLS.value:
        continue
      reason = (max_logit_triton.supports(q, k, causal=True, interpret=smoke)
                if name == "max_logit_triton" else None)
      if reason:
        print(f"B={b} T={t} H={h} {name:>24s} declined: {reason}")
        continue
      jitted = jax.jit(fn)
      ms = (common.time_jax_once if smoke else common.time_jax)(jitted, q, k, v, ids)
      print(f"B={b} T={t} H={h} {name:>24s} {ms:9.3f} ms")
      records.append(dict(op="mla_max_logit", implementation=name,
                          shape=dict(B=b, T=t, H=h, Dk=DK, docs=DOCS), dtype="bfloat16",
                          median_ms=round(ms, 4), device=common.device_name(),
                          date=common.today(), commit=common.code_commit(),
                          **{"pass": "max_logit"}))
  common.merge_records(_OUT.value, records, ("op", "implementation", "shape", "pass", "device"))


if __name__ == "__main__":
  app.run(main)
