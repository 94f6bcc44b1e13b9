r"""KDA side by side on one GPU: our tiers vs fla `chunk_kda` vs jax-linear-attention.

Same inputs for every implementation, one process: bf16 q, k, v; fp32 log-decay g in [-5, 0);
beta after the sigmoid; K = V = 128; q, k L2-normalised inside the timed op
(`use_qk_l2norm_in_kernel=True` for fla and ours: in the intra kernels for the Mosaic GPU tier,
by XLA for the chunked one). fwd = forward only; fwd+bwd = the output and the gradients of
all of q, k, v, g, beta given its cotangent do (`forward_backward`; fla: forward, then
backward). With fla among the implementations, each output and each gradient is compared
with fla's (relative L2, in the printed table and the records).
Run: `python3 -m benchmarks.kda --out=$OUT/kda.json`.
"""
import os
import traceback

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from pallas_kernels import kda as kda_ops
from pallas_kernels.kda import mosaic_gpu

_OUT = flags.DEFINE_string("out", "benchmarks/results/kda_h200.json", "Records (JSON list).")
_SHAPES = flags.DEFINE_list("shapes", ["1x8192x32", "1x8192x96"], "BxTxH, comma separated.")
_IMPLS = flags.DEFINE_list("impls", ["chunked", "fla", "jla_mosaic_gpu", "jla_chunked"],
                           "chunked | mosaic_gpu (default backward='kernel_intra') | "
                           "mosaic_gpu_bwd_xla (backward='kernel': XLA parts) | "
                           "mosaic_gpu_bwd_chunked (the chunked tier's backward) | fla | "
                           "jla_mosaic_gpu | jla_chunked")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwd+bwd"], "fwd and/or fwd+bwd.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed repetitions (JAX).")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "",
                                   "If set, an XLA profiler trace of each JAX implementation's "
                                   "timed calls is written under this directory.")


_KEY = ("op", "implementation", "pass", "B", "T", "H", "K", "V", "dtype", "device")


def kda_flops(b: int, t: int, h: int, d: int = 128, c: int = 64) -> float:
  """Forward FLOPs, Kimi Linear Eq. 13: B H (6 T d^2 + 3 T C d + T C^2)."""
  return b * h * (6 * t * d * d + 3 * t * c * d + t * c * c)


def kda_bytes(b: int, t: int, h: int, d: int = 128) -> float:
  """Forward HBM bytes at minimum: q, k, v, o in bf16, g in fp32, beta in fp32."""
  return b * t * h * (4 * d * 2 + d * 4 + 4)


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def rel_l2(a, ref) -> float:
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def annotate(records: list[dict], match: dict, **fields) -> None:
  """Adds `fields` to the records whose values agree with `match`."""
  for r in records:
    if all(r.get(k) == v for k, v in match.items()):
      r.update(fields)


def make_inputs(b, t, h, d=128, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, h, d), np.float32)
  k = rng.standard_normal((b, t, h, d), np.float32)
  v = rng.standard_normal((b, t, h, d), np.float32)
  g = -5.0 * (1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h, d), np.float32))))
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h), np.float32)))
  do = rng.standard_normal((b, t, h, d), np.float32)
  return dict(q=q, k=k, v=v, g=g.astype(np.float32), beta=beta.astype(np.float32), do=do)


def jax_fns(impl: str):
  """(fwd, fwd+bwd) jitted functions of (q, k, v, g, beta, do)."""
  if impl.startswith("jla_"):
    from jla.ops import linear_attention
    jla_impl = impl[len("jla_"):]
    def op(q, k, v, g, beta):
      return linear_attention("kda", q, k, v, g=g, beta=beta, impl=jla_impl, use_qk_l2norm=True)[0]
  elif impl in ("mosaic_gpu_bwd_chunked", "mosaic_gpu_bwd_xla"):
    backward = {"mosaic_gpu_bwd_chunked": "chunked", "mosaic_gpu_bwd_xla": "kernel"}[impl]
    def op(q, k, v, g, beta):
      return mosaic_gpu.chunk_kda_mosaic_gpu(q, k, v, g, beta, backward=backward,
                                             use_qk_l2norm_in_kernel=True)[0]
  else:
    def op(q, k, v, g, beta):
      return kda_ops.chunk_kda(q, k, v, g, beta, gate_bound=-5.0, impl=impl,
                               use_qk_l2norm_in_kernel=True)[0]
  return jax.jit(op), forward_backward(op)


def forward_backward(op):
  """jit of (q, k, v, g, beta, do) -> (o, (dq, dk, dv, dg, dbeta)): the output and the
  gradients given its cotangent do through `jax.vjp`, the work of fla's `o = chunk_kda(...)`
  then `o.backward(do)` (no loss reduction; the output is kept, so XLA cannot drop the
  forward kernels)."""
  def fwd_bwd(q, k, v, g, beta, do):
    o, vjp = jax.vjp(op, q, k, v, g, beta)
    return o, vjp(do.astype(o.dtype))
  return jax.jit(fwd_bwd)


def run_jax(impl, x, passes, reps):
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
  fwd, fwd_bwd = jax_fns(impl)
  out = {}
  if _PROFILE_DIR.value:
    jax.block_until_ready((fwd(*args), fwd_bwd(*args, bf(x["do"]))))
    with jax.profiler.trace(os.path.join(_PROFILE_DIR.value, impl)):
      jax.block_until_ready((fwd(*args), fwd_bwd(*args, bf(x["do"]))))
  if "fwd" in passes:
    out["fwd"] = common.time_jax(fwd, *args, reps=reps)
    out["_o"] = np.asarray(fwd(*args).astype(jnp.float32))
  if "fwd+bwd" in passes:
    out["fwd+bwd"] = common.time_jax(fwd_bwd, *args, bf(x["do"]), reps=max(reps // 2, 5))
    grads = fwd_bwd(*args, bf(x["do"]))[1]
    out["_grads"] = [np.asarray(a.astype(jnp.float32)) for a in grads]
  return out


def run_fla(x, passes):
  import torch
  from fla.ops.kda import chunk_kda
  dev = "cuda"
  t = lambda a, dt=torch.bfloat16: torch.from_numpy(a).to(dev, dt)
  q, k, v = t(x["q"]), t(x["k"]), t(x["v"])
  g, beta = t(x["g"], torch.float32), t(x["beta"], torch.float32)
  out = {}
  if "fwd" in passes:
    with torch.no_grad():
      f = lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
      out["fwd"] = common.time_torch(f)
      out["_o"] = f()[0].float().cpu().numpy()
  if "fwd+bwd" in passes:
    leaves = [a.clone().requires_grad_(True) for a in (q, k, v, g, beta)]
    do = t(x["do"])
    def fb():
      for a in leaves:
        a.grad = None
      chunk_kda(*leaves, use_qk_l2norm_in_kernel=True)[0].backward(do)
    out["fwd+bwd"] = common.time_torch(fb)
    fb()
    out["_grads"] = [a.grad.float().cpu().numpy() for a in leaves]
  return out


def main(argv):
  del argv
  device, date, vers = common.device_name(), common.today(), common.versions()
  records, rows = [], []
  for shape in _SHAPES.value:
    b, t, h = (int(s) for s in shape.split("x"))
    x = make_inputs(b, t, h)
    outputs, grads = {}, {}
    for impl in _IMPLS.value:
      try:
        res = run_fla(x, _PASSES.value) if impl == "fla" else run_jax(impl, x, _PASSES.value,
                                                                       _REPS.value)
      except Exception as e:  # pylint: disable=broad-exception-caught
        traceback.print_exc()
        records.append(dict(op="chunk_kda", implementation=impl, B=b, T=t, H=h, K=128, V=128,
                            dtype="bfloat16", error=f"{type(e).__name__}: {e}"[:500],
                            device=device, date=date))
        continue
      if "_o" in res:
        outputs[impl] = res.pop("_o")
      if "_grads" in res:
        grads[impl] = res.pop("_grads")
      for p, ms in res.items():
        flops = kda_flops(b, t, h) * (1 if p == "fwd" else 3)
        rec = dict(op="chunk_kda", implementation=impl, **{"pass": p}, B=b, T=t, H=h, K=128,
                   V=128, dtype="bfloat16", median_ms=round(ms, 4),
                   tflops=round(flops / ms / 1e9, 2),
                   gbytes_per_s=round(kda_bytes(b, t, h) / ms / 1e6, 1) if p == "fwd" else None,
                   device=device, date=date, versions=vers)
        records.append(rec)
        row = f"{shape:>12s} {impl:>16s} {p:>8s} {ms:9.3f} ms {rec['tflops']:8.2f} TFLOP/s"
        rows.append(row)
        print(row, flush=True)
      common.merge_records(_OUT.value, records, _KEY)
    if "fla" in outputs:
      ref = outputs["fla"]
      for impl, o in outputs.items():
        err = rel_l2(o, ref)
        rows.append(f"{shape:>12s} {impl:>16s} rel L2 vs fla {err:.2e}")
        annotate(records, dict(implementation=impl, B=b, T=t, H=h, **{"pass": "fwd"}),
                 rel_err_vs_fla=err)
    if "fla" in grads:
      for impl, gs in grads.items():
        errs = {n: rel_l2(a, w) for n, a, w in zip(GRAD_NAMES, gs, grads["fla"])}
        rows.append(f"{shape:>12s} {impl:>16s} grad rel L2 vs fla "
                    + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        annotate(records, dict(implementation=impl, B=b, T=t, H=h, **{"pass": "fwd+bwd"}),
                 grad_rel_err_vs_fla=errs)
  common.merge_records(_OUT.value, records, _KEY)
  print("\n".join(rows))


if __name__ == "__main__":
  app.run(main)
