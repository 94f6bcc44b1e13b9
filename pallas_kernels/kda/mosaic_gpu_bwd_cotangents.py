"""Cotangents of KDA's chunk parts from the state walks, as a Pallas Mosaic GPU kernel (Hopper).

`cotangents` is `chunked.chunk_parts_cotangents` (kda.md §2.3) on one kernel that reads each
input once. Per chunk n of C = 64 tokens, with S_n [K, V] the state entering it and dS_n the
gradient of the state leaving it (report Eqs. 8-9, V_new = U - W S_n):
  dQ_d = dO S_n^T,  dW = -dV_new S_n^T,  dU = dV_new,  dK_g = V_new dS_n^T,
  dA_qk = dO V_new^T,  d(e^{G_C}) = rowsum(S_n * dS_n)  (sum over V, [K]).
One CTA = one warpgroup per (chunk, head, batch). V_new (bf16, from the forward's state walk or
the backward's) and dO arrive by TMA; S_n, dS_n (fp32) and dV_new (bf16) are read straight into
registers, in 32-column slabs for the states; d(e^{G_C}) is summed from the fp32 values, and
bf16 copies of S_n, dS_n are the tensor-core operands (fp32 accumulation). dV_new is the left
operand of dW from registers. SMEM (K = V = 128): V_new 16 KiB, dO 16 KiB, S_n 32 KiB,
dS_n 32 KiB = 96 KiB, 98 KiB with Mosaic's own (two CTAs per SM fit).
dW and dA_qk are written in bf16 (the intra-VJP kernel uses them only as bf16 tensor-core
operands). Interpreter against fp32 `chunk_parts_cotangents`: relative L2 errors <= 3.4e-3
(dK_g, dA_qk, through bf16 V_new) before the bf16 outputs. Passed its tests compiled on the
H200 (2026-11-30).
"""
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.kda import mosaic_gpu as fwd

_F32 = jnp.float32
_BF16 = jnp.bfloat16


def _body(cfg, vn_ref, s_ref, ds_ref, dvn_ref, do_ref,
          dqd_ref, dw_ref, dkg_ref, daqk_ref, ddec_ref,
          vn_s, do_s, s_s, ds_s, bar, *stage):
  """One chunk: dQ_d, dW, dK_g, dA_qk and d(e^{G_C}) (see the module doc)."""
  c, kd, dv, half_w = fwd.CHUNK, cfg.key_dim, vn_ref.shape[-1], fwd.HALF
  n, h, b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
  tok = pl.ds(n * c, c)
  mma = fwd._Mma(cfg, stage)
  load = fwd._load

  plgpu.copy_gmem_to_smem(vn_ref.at[b, h, tok], vn_s, bar)
  plgpu.copy_gmem_to_smem(do_ref.at[b, tok, h], do_s, bar)
  d_dec = None
  for slab in range(dv // half_w):
    cols = pl.ds(slab * half_w, half_w)
    s = load(s_ref.at[b, h, n, :, cols])
    d_s = load(ds_ref.at[b, h, n, :, cols])
    part = jnp.sum(s * d_s, axis=1)
    d_dec = part if d_dec is None else d_dec + part
    s_s.at[:, cols][...] = s.astype(_BF16)
    ds_s.at[:, cols][...] = d_s.astype(_BF16)
  ddec_ref.at[b, h, n][...] = d_dec
  plgpu.commit_smem()
  plgpu.barrier_wait(bar)

  dqd_ref.at[b, h, tok][...] = mma.product((c, kd), [(do_s, s_s.T)])

  wide = min(dv, fwd.CHUNK)           # the interpreter stages register operands as [C, 64]
  dvn = [(fwd._Regs((-load(dvn_ref.at[b, h, tok, pl.ds(j, wide)])).astype(_BF16)),
          s_s.at[:, pl.ds(j, wide)].T) for j in range(0, dv, wide)]
  d_w, d_kg = mma.products(((c, kd), dvn, None), ((c, kd), [(vn_s, ds_s.T)], None))
  dw_ref.at[b, h, tok][...] = d_w.astype(dw_ref.dtype)
  dkg_ref.at[b, h, tok][...] = d_kg
  daqk_ref.at[b, h, tok][...] = mma.product((c, c), [(do_s, vn_s.T)]).astype(daqk_ref.dtype)


def cotangents_kernel(v_new, s_in, ds, dvn, do, cfg: "fwd._Config", interpret):
  """The kernel on the backward's token layouts.

  v_new bf16 [B, H, T, V]; s_in, ds fp32 [B, H, N, K, V] (S_n entering
  chunk n, dS_n = dL/dS_{n+1}); dvn [B, H, T, V] fp32 or bf16; do bf16 [B, T, H, V]; T = N * 64.
  Returns (dQ_d fp32, dW bf16, dK_g fp32 [B, H, T, K], dA_qk bf16 [B, H, T, C],
  d(e^{G_C}) fp32 [B, H, N, K]): dW and dA_qk are only ever tensor-core operands of the
  intra-VJP kernel, so they leave in bf16.
  """
  b, h, t, dv = v_new.shape
  kd, c, op = cfg.key_dim, fwd.CHUNK, fwd._operand
  tok_k = lambda dtype: jax.ShapeDtypeStruct((b, h, t, kd), dtype)
  call = plgpu.kernel(
      functools.partial(_body, cfg),
      out_type=(tok_k(_F32), tok_k(_BF16), tok_k(_F32), jax.ShapeDtypeStruct((b, h, t, c), _BF16),
                jax.ShapeDtypeStruct((b, h, cfg.num_chunks, kd), _F32)),
      scratch_types=[
          op((c, dv)), op((c, dv)), op((kd, dv)), op((kd, dv)),
          plgpu.Barrier(num_arrivals=2),
          *fwd._stage(cfg)],
      grid=(cfg.num_chunks, h, b), grid_names=("n", "h", "b"),
      compiler_params=fwd._PARAMS, interpret=interpret, kernel_name="kda_cotangents_mosaic_gpu")
  return call(v_new, s_in, ds, dvn, do)


@functools.partial(jax.jit, static_argnames=("interpret",))
def cotangents(w, u, s_in, ds, dvn, do, *, interpret=False) -> tuple[jax.Array, ...]:
  """`chunked.chunk_parts_cotangents(w, u, s_in, ds, dvn, do)` on the kernel.

  Args:
    w [B, H, N, C, K]; u, dvn, do [B, H, N, C, V]; s_in, ds [B, H, N, K, V] (C = 64).
    interpret: False (compile for the GPU), True or a `plgpu.InterpretGPUParams`.

  Returns:
    (dQ_d, dW, dU, dK_g [B, H, N, C, *], dA_qk [B, H, N, C, C], d chunk decay [B, H, N, K]),
    fp32, `chunked.chunk_parts`' order; dU is dvn.
  """
  b, h, n, c, kd = w.shape
  dv = u.shape[-1]
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  cfg = fwd._Config(num_chunks=n, key_dim=kd, scale=1.0, has_segments=False,
                    interpret=bool(interpret))

  def tokens(x, dtype):
    return x.reshape(b, h, n * c, x.shape[-1]).astype(dtype)

  do_t = jnp.moveaxis(do, 1, 3).reshape(b, n * c, h, dv).astype(_BF16)
  # V_new = U - W S_n as the backward's state walk forms it: bf16 products, fp32 sums, bf16.
  v_new = u - jnp.einsum("bhnck,bhnkv->bhncv", w.astype(_BF16), s_in.astype(_BF16),
                         preferred_element_type=_F32)
  d_qd, d_w, d_kg, d_aqk, d_dec = cotangents_kernel(
      tokens(v_new, _BF16), s_in.astype(_F32), ds.astype(_F32), tokens(dvn, _F32), do_t, cfg,
      interpret or None)
  chunks = lambda x: x.reshape(b, h, n, c, x.shape[-1])
  return (chunks(d_qd), chunks(d_w).astype(_F32), dvn.astype(_F32), chunks(d_kg),
          chunks(d_aqk).astype(_F32), d_dec)
