r"""Where the time of the Mosaic GPU KDA forward and kernel backward goes, part by part.

Each part in its own jit on the inputs of `benchmarks.kda` (B=1, T=8192, K=V=128, bf16 q, k, v):
the L2 norm of q and k, the forward kernels, and the backward's pieces (`mosaic_gpu_bwd`):
`chunk_parts` and its VJP (XLA), the two state-walk kernels, `chunk_parts_cotangents` (XLA and
the `mosaic_gpu_bwd_cotangents` kernel),
the intra kernel's parts, their VJP as the `mosaic_gpu_bwd_intra` kernel (parts="kernel") and
as its pure-JAX form `chunked.chunk_parts_vjp`, and
the whole backward both ways, with the XLA einsums at HIGHEST (fp32) and DEFAULT (TF32)
(`--parts_precisions=highest` for the first alone).
Run: `python3 -m benchmarks.kda_parts --parts_out=$OUT/kda_parts_h200.json` (records: op
"kda_parts", part, B, T, H, median_ms, device, date).
"""
import jax
from jax import lax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import common
from benchmarks import kda as kda_bench
from pallas_kernels.kda import chunked
from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import mosaic_gpu_bwd
from pallas_kernels.kda import mosaic_gpu_bwd_cotangents
from pallas_kernels.kda import mosaic_gpu_bwd_intra
from pallas_kernels.kda.reference import l2_normalize

_OUT = flags.DEFINE_string("parts_out", "", "If set, the records are merged into this JSON list.")
_SHAPES = flags.DEFINE_list("parts_shapes", ["1x8192x32"], "BxTxH, comma separated.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Mosaic GPU interpreter (CPU smoke run).")
_PRECISIONS = flags.DEFINE_multi_enum(
    "parts_precisions", ["highest", "default"], ["highest", "default"],
    "Matmul precisions of the XLA parts; the kernels' own rows come with \"highest\".")

PRECISIONS = {"highest": lax.Precision.HIGHEST, "default": lax.Precision.DEFAULT}


def parts_of(b, t, h):
  """{part name: milliseconds} for one shape."""
  x = kda_bench.make_inputs(b, t, h)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k = l2_normalize(bf(x["q"])), l2_normalize(bf(x["k"]))
  v, g, beta, d_o = bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]), bf(x["do"])
  scale = 128 ** -0.5
  h0 = jnp.zeros((b, h, 128, 128), jnp.float32)
  block_v = mosaic_gpu.pick_block_v(b, h, 128)
  interpret = _INTERPRET.value
  # The interpreter smoke run calls each part once (it checks that the parts run, not speed).
  timed = common.time_jax_once if interpret else common.time_jax
  cfg, interp = mosaic_gpu.config(q, None, scale=scale, block_v=block_v, interpret=interpret)
  ms = {}
  ms["l2norm_qk"] = timed(jax.jit(lambda a, c: (l2_normalize(a), l2_normalize(c))),
                          bf(x["q"]), bf(x["k"]))
  ms["forward_kernels_l2norm_in_kernel"] = timed(
      jax.jit(lambda *a: mosaic_gpu.forward(*a, None, None, scale=scale, block_v=block_v,
                                            interpret=interpret, normalize_qk=True)),
      bf(x["q"]), bf(x["k"]), v, g, beta)
  ms["forward_kernels"] = timed(
      jax.jit(lambda *a: mosaic_gpu.forward(*a, None, None, scale=scale, block_v=block_v,
                                      interpret=interpret)),
      q, k, v, g, beta)
  for name in _PRECISIONS.value:
    prec = PRECISIONS[name]
    parts_fn = lambda q, k, v, g, beta, prec=prec: mosaic_gpu_bwd.chunk_parts(
        q, k, v, g, beta, scale=scale, segment_ids=None, precision=prec)
    ms[f"chunk_parts_{name}"] = timed(jax.jit(parts_fn), q, k, v, g, beta)
    parts = jax.jit(parts_fn)(q, k, v, g, beta)
    cot = tuple(jnp.ones_like(p) for p in parts)
    vjp_fn = jax.jit(lambda q, k, v, g, beta, cot, f=parts_fn: jax.vjp(f, q, k, v, g, beta)[1](cot))
    ms[f"chunk_parts_fwd_and_vjp_{name}"] = timed(vjp_fn, q, k, v, g, beta, cot)
    qd, w, u, kg, aqk, dec = parts
    nb, nh, n, c, _ = qd.shape
    tokens = lambda a, dt: a.reshape(nb, nh, n * c, a.shape[-1]).astype(dt)
    wn, kg_b = tokens(-w, jnp.bfloat16), tokens(kg, jnp.bfloat16)
    s_in, _ = mosaic_gpu_bwd.states_kernel(wn, tokens(u, jnp.float32), kg_b, dec, h0, cfg,
                                           interp)
    dvn, ds, _ = mosaic_gpu_bwd.dstates_kernel(tokens(qd, jnp.bfloat16), wn, kg_b,
                                               tokens(aqk, jnp.bfloat16), dec, d_o, h0, cfg,
                                               interp)
    if name == "highest":
      ms["states_kernel"] = timed(
          jax.jit(lambda *a: mosaic_gpu_bwd.states_kernel(*a, cfg, interp)),
          wn, tokens(u, jnp.float32), kg_b, dec, h0)
      ms["dstates_kernel"] = timed(
          jax.jit(lambda *a: mosaic_gpu_bwd.dstates_kernel(*a, cfg, interp)),
          tokens(qd, jnp.bfloat16), wn, kg_b, tokens(aqk, jnp.bfloat16), dec, d_o, h0)
    doc = chunked._to_chunks(d_o.astype(jnp.float32))
    dvn = dvn.reshape(nb, nh, n, c, -1)
    if name == "highest":
      ms["cotangents_kernel"] = timed(
          jax.jit(lambda *a: mosaic_gpu_bwd_cotangents.cotangents(*a, interpret=interpret)),
          w, u, s_in, ds, dvn, doc)
    ms[f"cotangents_{name}"] = timed(
        jax.jit(lambda *a, prec=prec: chunked.chunk_parts_cotangents(*a, prec)),
        w, u, s_in, ds, dvn, doc)
    for parts in ("xla", "kernel"):
      ms[f"backward_parts_{parts}_{name}"] = timed(
          jax.jit(lambda *a, prec=prec, parts=parts: mosaic_gpu_bwd.backward(
              *a, scale=scale, interpret=interpret, block_v=block_v, precision=prec,
              parts=parts)),
          q, k, v, g, beta, h0, None, d_o, h0)
    parts_k, m, _ = jax.jit(lambda *a, prec=prec: mosaic_gpu_bwd._parts_from_kernel(
        *a, None, cfg, interp, prec))(q, k, v, g, beta)
    ms[f"parts_from_kernel_{name}"] = timed(
        jax.jit(lambda *a, prec=prec: mosaic_gpu_bwd._parts_from_kernel(
            *a, None, cfg, interp, prec)), q, k, v, g, beta)
    if name == "highest":
      ms["chunk_parts_vjp_kernel"] = timed(
          jax.jit(lambda *a: mosaic_gpu_bwd_intra.parts_vjp(
              *a[:6], a[6], scale=scale, segment_ids=None, interpret=interpret)),
          q, k, v, g, beta, m, tuple(jnp.ones_like(p) for p in parts_k))
    ms[f"chunk_parts_vjp_{name}"] = timed(
        jax.jit(lambda *a, prec=prec: chunked.chunk_parts_vjp(
            *a[:6], a[6], scale=scale, segment_ids=None, gate_bound=-5.0, precision=prec)),
        q, k, v, g, beta, m, tuple(jnp.ones_like(p) for p in parts_k))
  return ms


def main(argv):
  del argv
  device, date = common.device_name(), common.today()
  for shape in _SHAPES.value:
    b, t, h = (int(s) for s in shape.split("x"))
    records = []
    for part, ms in parts_of(b, t, h).items():
      print(f"{shape:>12s} {part:>36s} {ms:9.3f} ms", flush=True)
      records.append(dict(op="kda_parts", part=part, B=b, T=t, H=h, median_ms=round(ms, 4),
                          device=device, date=date))
    if _OUT.value:
      common.merge_records(_OUT.value, records, ("op", "part", "B", "T", "H", "device"))


if __name__ == "__main__":
  app.run(main)
