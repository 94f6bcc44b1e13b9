r"""KDA output and gradients at the benchmark's full size against an fp64 recurrence.

The unit tests check every tier against fp64 up to T ~ 4k on small heads; this checks the shape
that benchmarks/kda.py times (same `make_inputs`, bf16 q, k, v, L2 norm inside the op): relative
L2 error of o, dq, dk, dv, dg, dbeta for each implementation against `reference.recurrent_kda`
run in float64 (`jax.enable_x64`, heads in groups) on the bf16-rounded inputs.

  python3 -m benchmarks.kda_accuracy --shapes=1x8192x32 --impls=mosaic_gpu,fla

--shapes and --impls are benchmarks/kda.py's flags; --accuracy_out gets one record per shape and
implementation.
"""
import json
import os
import pathlib

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

from absl import app, flags
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks import common
from benchmarks import kda as kda_bench
from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import reference

_ACCURACY_OUT = flags.DEFINE_string("accuracy_out", "benchmarks/results/kda_accuracy_h200.json",
                                    "Records (JSON list).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Run mosaic_gpu in the Mosaic GPU interpreter "
                                "(CPU; one warpgroup per CTA).")
_HEAD_GROUP = flags.DEFINE_integer("head_group", 8, "Heads per fp64 reference call.")

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def rounded_inputs(b: int, t: int, h: int) -> dict:
  """benchmarks.kda's inputs with q, k, v, do rounded to bf16 (what every implementation sees)."""
  x = kda_bench.make_inputs(b, t, h)
  for n in ("q", "k", "v", "do"):
    x[n] = x[n].astype(ml_dtypes.bfloat16).astype(np.float32)
  return x


def fp64_reference(x: dict, head_group: int) -> dict:
  """o and the five gradients of sum(o * do) by the fp64 token recurrence."""
  def loss(q, k, v, g, beta, do):
    q, k = (a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + reference.L2_EPS) for a in (q, k))
    o, _ = reference.recurrent_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                   initial_state=None, segment_ids=None)
    return jnp.sum(o * do), o

  outs = {n: [] for n in NAMES}
  with jax.enable_x64(True):
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    for h0 in range(0, x["q"].shape[2], head_group):
      part = [jnp.asarray(x[n][:, :, h0:h0 + head_group], jnp.float64)
              for n in ("q", "k", "v", "g", "beta", "do")]
      (_, o), grads = fn(*part)
      for n, a in zip(NAMES, (o, *grads)):
        outs[n].append(np.asarray(a))
  return {n: np.concatenate(a, axis=2) for n, a in outs.items()}


def implementation(impl: str, x: dict) -> dict:
  """o and the five gradients from one implementation, as float32 numpy arrays."""
  if impl == "fla":
    import torch
    from fla.ops.kda import chunk_kda
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", dt)
    leaves = [t(x[n], torch.bfloat16).requires_grad_(True) for n in ("q", "k", "v")]
    leaves += [t(x[n], torch.float32).requires_grad_(True) for n in ("g", "beta")]
    o = chunk_kda(*leaves, use_qk_l2norm_in_kernel=True)[0]
    o.backward(t(x["do"], torch.bfloat16))
    arrays = [o.detach()] + [a.grad for a in leaves]
    return {n: a.float().cpu().numpy() for n, a in zip(NAMES, arrays)}
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
  if impl == "mosaic_gpu" and _INTERPRET.value:
    def op(q, k, v, g, beta):
      return mosaic_gpu.chunk_kda_mosaic_gpu(q, k, v, g, beta, interpret=True,
                                             use_qk_l2norm_in_kernel=True)[0]
    fwd, fwd_bwd = jax.jit(op), kda_bench.forward_backward(op)
  else:
    fwd, fwd_bwd = kda_bench.jax_fns(impl)
  arrays = [fwd(*args), *fwd_bwd(*args, bf(x["do"]))[1]]
  return {n: np.asarray(jax.device_get(a).astype(np.float32)) for n, a in zip(NAMES, arrays)}


def main(argv):
  del argv
  records = []
  for shape in kda_bench._SHAPES.value:
    b, t, h = (int(s) for s in shape.split("x"))
    x = rounded_inputs(b, t, h)
    ref = fp64_reference(x, _HEAD_GROUP.value)
    for impl in kda_bench._IMPLS.value:
      got = implementation(impl, x)
      errs = {n: kda_bench.rel_l2(got[n], ref[n]) for n in NAMES}
      print(f"{shape:>12s} {impl:>16s} rel L2 vs fp64 "
            + " ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)
      records.append(dict(op="chunk_kda_accuracy", implementation=impl, B=b, T=t, H=h, K=128,
                          V=128, dtype="bfloat16", rel_l2_vs_fp64=errs,
                          device=common.device_name(), date=common.today()))
  pathlib.Path(_ACCURACY_OUT.value).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
