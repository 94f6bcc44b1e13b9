"""Chunkwise KDA backward: Pallas Mosaic GPU kernels for the serial part (kda.md §2.3).

The backward of `mosaic_gpu.chunk_kda_mosaic_gpu(..., backward="kernel")` for the
bounded gate g >= -5. The forward splits into a chunk-parallel part and a serial
walk; with S_n the state entering chunk n (of C = 64 tokens):
  parts (`chunk_parts`, XLA, batched over chunks, Eqs. 2-7):
    Q_d = scale q e^G, W = (I + L)^{-1} diag(beta) K e^G, U = (I + L)^{-1} diag(beta) V,
    K_g = k e^{G_C - G}, A_qk (causal), d = e^{G_C}            (segment masks as chunked.py)
  serial (Eqs. 8-9):
    V_new = U - W S_n,  O = Q_d S_n + A_qk V_new,  S_{n+1} = Diag(d) S_n + K_g^T V_new.
The backward, fla's recompute scheme:
  1. `states_kernel`: one CTA per (value block, head, batch) walks the chunks in
     order with S [K, Vblock] in fp32 registers and writes every S_n (fla's h) and V_new
     (bf16). Skipped when the forward's state kernel wrote them (`Saved`).
  2. `dstates_kernel`: the same grid walks the chunks in REVERSE with dS =
     dL/dS_{n+1} [K, Vblock] in fp32 registers:
       dV_new = A_qk^T dO + K_g dS,
       dS_n   = Diag(d) dS + Q_d^T dO - W^T dV_new,
     writing dV_new and every dS; the last dS_0 is d initial_state.
  3. the cotangents of the parts, per chunk: dQ_d = dO S_n^T, dW = -dV_new S_n^T,
     dU = dV_new, dA_qk = dO V_new^T, dK_g = V_new dS^T, dd = rowsum(S_n * dS),
     then the VJP of the parts, one of two ways (`backward(parts=...)`):
       "xla": `chunk_parts` recomputed in fp32, the cotangents as batched XLA einsums and the
         VJP by JAX's autodiff (batched einsums, the UT triangular solve, the cumsum);
       "kernel": the parts and M = (I + L)^{-1} from the forward's intra kernel (bf16), W and
         U as M products, the cotangents in the `mosaic_gpu_bwd_cotangents` kernel and the
         VJP in the `mosaic_gpu_bwd_intra` kernel (the pure-JAX `chunk_parts_cotangents` and
         `chunk_parts_vjp` as kernels; no solve, no autodiff).
Tensor-core operands are bf16 with fp32 accumulation; the state and its
gradient stay fp32 in registers (bf16 copies in SMEM as operands). In interpret
mode the products' initial values are added after the product (see mosaic_gpu).
Extra memory: S_n and dS, fp32 [B, H, N, K, V] each (fla keeps h too); with `Saved`, S_n lives
from the forward to the backward.
Measured (interpreter, bf16 inputs, B=1, H=2, T in {64, 130}, K=V in {64, 128},
segments and initial state): relative RMS gradient errors <= 3e-3 (parts="xla") and
<= 5.1e-3 (parts="kernel") against the fp64 recurrence. Compiled on an H200, parts="xla" passes
the same tests and larger shapes (2026-11-30): at B=1, T=8192, H=32 its backward takes 10.4 ms,
of which the walk kernels 0.9 ms and the XLA parts the rest (`benchmarks/kda_parts.py`).
parts="kernel" passes them too; it took forward+backward at that shape from 13.0 to 4.05 ms.

`mosaic_gpu` imports this module and this module imports `mosaic_gpu`: use
`fwd.` names only inside functions.
"""
import functools
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.kda import chunked
from pallas_kernels.kda import mosaic_gpu as fwd
from pallas_kernels.kda import mosaic_gpu_bwd_cotangents
from pallas_kernels.kda import mosaic_gpu_bwd_intra

_F32 = jnp.float32
_BF16 = jnp.bfloat16
# Einsums of the XLA part: DEFAULT lets XLA use TF32 tensor cores for the fp32 operands on
# GPUs (10-bit mantissa, below the bf16 rounding of the kernels' own operands); HIGHEST is
# full fp32.
PRECISION = lax.Precision.DEFAULT


def chunk_parts(q, k, v, g, beta, *, scale: float, segment_ids,
                precision=PRECISION) -> tuple[jax.Array, ...]:
  """The chunk-parallel part of the forward in fp32 (`chunked.chunk_parts`, gate >= -5)."""
  return chunked.chunk_parts(q, k, v, g, beta, scale=scale, segment_ids=segment_ids,
                             gate_bound=fwd.GATE_BOUND, dt=_F32, precision=precision)


def _states_body(cfg, wn_ref, u_ref, kg_ref, dec_ref, h0_ref, h_ref, vn_ref,
                 wn_s, u_s, kg_s, dec_s, s_s, x_s, bars):
  """Forward walk for one (value block, head, batch): writes S_n entering each chunk and
  V_new."""
  c, kd, bv = fwd.CHUNK, cfg.key_dim, cfg.block_v
  vt, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
  vcols = pl.ds(vt * bv, bv)
  mma = fwd._Mma(cfg, ())

  tok = lambda n: pl.ds(n * c, c)
  copies = [(lambda n: wn_ref.at[b, h, tok(n)], wn_s),
            (lambda n: u_ref.at[b, h, tok(n), vcols], u_s),
            (lambda n: kg_ref.at[b, h, tok(n)], kg_s), (lambda n: dec_ref.at[b, h, n], dec_s)]

  s0 = fwd._load(h0_ref.at[b, h, :, vcols])
  s_s[...] = s0.astype(_BF16)

  def step(n, slot, s):
    h_ref.at[b, h, n, :, vcols][...] = s
    x = mma.product((c, bv), [(wn_s.at[slot], s_s)], fwd._load(u_s.at[slot]))   # V_new
    x = x.astype(_BF16)
    x_s[...] = x
    plgpu.commit_smem()
    vn_ref.at[b, h, tok(n), vcols][...] = x
    decay = fwd._rows(fwd._load(dec_s.at[slot], fwd._ROW), (kd, bv))
    s = mma.product((kd, bv), [(kg_s.at[slot].T, x_s)], decay * s)
    s_s[...] = s.astype(_BF16)
    return s

  fwd._walk(cfg.num_chunks, copies, bars, step, s0)


def _dstates_body(cfg, qd_ref, wn_ref, kg_ref, aqk_ref, dec_ref, do_ref, dsf_ref,
                  dvn_ref, ds_ref, dh0_ref,
                  qd_s, wn_s, kg_s, aqk_s, dec_s, do_s, ds_s, dvn_s, bars):
  """Reverse walk for one (value block, head, batch): dV_new and dS per chunk, dS_0."""
  c, kd, bv, nc = fwd.CHUNK, cfg.key_dim, cfg.block_v, cfg.num_chunks
  vt, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
  vcols = pl.ds(vt * bv, bv)
  mma = fwd._Mma(cfg, ())

  tok = lambda n: pl.ds(n * c, c)
  copies = [(lambda n: qd_ref.at[b, h, tok(n)], qd_s), (lambda n: wn_ref.at[b, h, tok(n)], wn_s),
            (lambda n: kg_ref.at[b, h, tok(n)], kg_s),
            (lambda n: aqk_ref.at[b, h, tok(n)], aqk_s), (lambda n: dec_ref.at[b, h, n], dec_s),
            (lambda n: do_ref.at[b, tok(n), h, vcols], do_s)]

  ds0 = fwd._load(dsf_ref.at[b, h, :, vcols])
  ds_s[...] = ds0.astype(_BF16)

  def step(n, slot, ds):
    ds_ref.at[b, h, n, :, vcols][...] = ds
    decay = fwd._rows(fwd._load(dec_s.at[slot], fwd._ROW), (kd, bv))
    do = do_s.at[slot]
    dvn, part = mma.products(
        ((c, bv), [(aqk_s.at[slot].T, do), (kg_s.at[slot], ds_s)], None),
        ((kd, bv), [(qd_s.at[slot].T, do)], decay * ds))
    dvn_ref.at[b, h, pl.ds(n * c, c), vcols][...] = dvn.astype(dvn_ref.dtype)
    dvn_s[...] = dvn.astype(_BF16)
    plgpu.commit_smem()
    ds = mma.product((kd, bv), [(wn_s.at[slot].T, dvn_s)], part)
    ds_s[...] = ds.astype(_BF16)
    return ds

  ds = fwd._walk(nc, copies, bars, step, ds0, reverse=True)
  dh0_ref.at[b, h, :, vcols][...] = ds


def states_kernel(wn, u, kg, dec, h0, cfg, interpret) -> tuple[jax.Array, jax.Array]:
  """Kernel 1 of the backward: (S_n [B, H, N, K, V] fp32 entering every chunk, V_new bf16
  [B, H, T, V]); the forward's `state_kernel(..., save=True)` writes the same.

  wn = -W, kg bf16 [B, H, T, K]; u fp32 [B, H, T, V]; dec [B, H, N, K]; h0 [B, H, K, V].
  """
  b, h, _, dv = u.shape
  kd, c, bv = cfg.key_dim, fwd.CHUNK, cfg.block_v
  call = plgpu.kernel(
      functools.partial(_states_body, cfg),
      out_type=(jax.ShapeDtypeStruct((b, h, cfg.num_chunks, kd, dv), _F32),
                jax.ShapeDtypeStruct((b, h, cfg.num_chunks * c, dv), _BF16)),
      scratch_types=[
          fwd._operand((2, c, kd)), plgpu.SMEM((2, c, bv), _F32), fwd._operand((2, c, kd)),
          plgpu.SMEM((2, kd), _F32), fwd._operand((kd, bv)), fwd._operand((c, bv)),
          plgpu.Barrier(num_arrivals=4, num_barriers=2)],
      grid=(dv // bv, h, b), grid_names=("v", "h", "b"),
      compiler_params=fwd._PARAMS, interpret=interpret, kernel_name="kda_states_mosaic_gpu")
  return call(wn, u, kg, dec, h0)


def dstates_kernel(qd, wn, kg, aqk, dec, do, dsf, cfg, interpret, dvn_dtype=_F32):
  """Kernel 2 of the backward: (dV_new [B, H, T, V] in dvn_dtype, dS [B, H, N, K, V] fp32,
  dS_0 [B, H, K, V] fp32).

  qd, wn = -W, kg bf16 [B, H, T, K]; aqk bf16 [B, H, T, C]; dec [B, H, N, K];
  do bf16 [B, T, H, V]; dsf = dL/d(final state) fp32 [B, H, K, V]. dS[n] is dL/dS_{n+1}.
  dvn_dtype: bf16 when dV_new is only ever a tensor-core operand (parts="kernel").
  """
  b, t, h, dv = do.shape
  kd, c, bv = cfg.key_dim, fwd.CHUNK, cfg.block_v
  call = plgpu.kernel(
      functools.partial(_dstates_body, cfg),
      out_type=(jax.ShapeDtypeStruct((b, h, t, dv), dvn_dtype),
                jax.ShapeDtypeStruct((b, h, cfg.num_chunks, kd, dv), _F32),
                jax.ShapeDtypeStruct((b, h, kd, dv), _F32)),
      scratch_types=[
          fwd._operand((2, c, kd)), fwd._operand((2, c, kd)), fwd._operand((2, c, kd)),
          fwd._operand((2, c, c)), plgpu.SMEM((2, kd), _F32), fwd._operand((2, c, bv)),
          fwd._operand((kd, bv)), fwd._operand((c, bv)),
          plgpu.Barrier(num_arrivals=6, num_barriers=2)],
      grid=(dv // bv, h, b), grid_names=("v", "h", "b"),
      compiler_params=fwd._PARAMS, interpret=interpret, kernel_name="kda_dstates_mosaic_gpu")
  return call(qd, wn, kg, aqk, dec, do, dsf)


class Saved(NamedTuple):
  """What the forward keeps for backward="kernel_intra" (`mosaic_gpu.forward(...,
  return_saved=True)`): the intra kernel's outputs (Q_d, -K_d, K_g, A_qk, M, e^{G_C}; bf16
  [B, H, T, *], ~0.8x the inputs' bytes), S_n entering every chunk (fp32 [B, H, N, K, V]) and
  V_new (bf16 [B, H, T, V]). They spare the backward the intra kernel's and the forward
  state walk's reruns (0.28 + 0.19 ms at B=1, T=8192, H=32); S_n is the largest part, K / 16
  fp32 values per token and head (fla keeps its h, the same states, in the backward)."""
  parts: tuple
  states: jax.Array
  v_new: jax.Array


def _parts_from_kernel(q, k, v, g, beta, segment_ids, cfg, interp, precision, intra=None):
  """`chunk_parts`' outputs, M = (I + L)^{-1} (bf16) and the `prepare`d inputs, from the
  forward's intra kernel: its outputs `intra` if the forward kept them, else run again.

  W = M K_d and U = M diag(beta) V are formed by XLA (bf16 operands, fp32 accumulation).
  """
  prepared = fwd.prepare(q, k, v, g, beta, None, segment_ids)
  qp, kp, gp, vp, beta_t, counts, _ = prepared
  if intra is None:
    intra = fwd.intra_kernel(qp, kp, gp, beta_t, counts, cfg, interp)
  qd, kdn, kg, aqk, m, dec = intra
  b, h, t, c = m.shape
  chunks = lambda x: x.reshape(b, h, t // c, c, x.shape[-1])
  beta_v = (chunked._to_chunks(vp.astype(_F32))
            * beta_t.reshape(b, h, t // c, c)[..., None]).astype(_BF16)
  mix = lambda x: jnp.einsum("bhncj,bhnjx->bhncx", chunks(m), x, precision=precision,
                             preferred_element_type=_F32)
  w = -mix(chunks(kdn))
  return (chunks(qd), w, mix(beta_v), chunks(kg), chunks(aqk), dec), chunks(m), prepared


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_v", "precision",
                                             "parts", "normalize_qk"))
def backward(q, k, v, g, beta, h0, segment_ids, d_o, d_final, *, scale: float, interpret,
             block_v: int, precision=PRECISION, parts: str = "xla",
             saved: Saved | None = None, normalize_qk: bool = False
             ) -> tuple[jax.Array, ...]:
  """Gradients (dq, dk, dv, dg, dbeta, dh0) of (o, final state) given their cotangents.

  Args:
    q, k, v, g, beta, segment_ids: the forward's inputs (fla layouts); h0 [B, H, K, V] fp32.
    d_o [B, T, H, V]; d_final [B, H, K, V].
    scale, interpret, block_v: as in `mosaic_gpu.forward`.
    precision: of the XLA einsums (`PRECISION`).
    parts: "xla" (`chunk_parts` recomputed in fp32, its cotangents by XLA einsums, and its VJP
      by JAX's autodiff) or "kernel" (its outputs and M from the forward's intra kernel, the
      cotangents by the `mosaic_gpu_bwd_cotangents` kernel and the VJP by the
      `mosaic_gpu_bwd_intra` kernel, whose pure-JAX forms are `chunked.chunk_parts_cotangents`
      and `chunked.chunk_parts_vjp`).
    saved: with parts="kernel", the forward's `Saved` outputs, which spare running the intra
      kernel and the state walk again; None runs them.
    normalize_qk: with parts="kernel", q and k are raw: the intra kernels L2-normalise their
      rows and the intra-VJP kernel applies the norm's VJP to dq, dk (no XLA passes for it).
  """
  if normalize_qk and parts != "kernel":
    raise ValueError(f"normalize_qk needs parts='kernel', got {parts!r}")
  cfg, interp = fwd.config(q, segment_ids, scale=scale, interpret=interpret, block_v=block_v,
                           normalize_qk=normalize_qk)
  if parts == "kernel":
    parts_out, m, prepared = _parts_from_kernel(q, k, v, g, beta, segment_ids, cfg, interp,
                                                precision, None if saved is None else saved.parts)
    parts_vjp = lambda d: mosaic_gpu_bwd_intra.parts_vjp(
        q, k, v, g, beta, m, d, scale=scale, segment_ids=segment_ids, interpret=interpret,
        prepared=prepared, normalize_qk=normalize_qk)
  elif parts == "xla":
    parts_out, parts_vjp = jax.vjp(
        functools.partial(chunk_parts, scale=scale, segment_ids=segment_ids,
                          precision=precision), q, k, v, g, beta)
  else:
    raise ValueError(f"parts must be 'xla' or 'kernel', got {parts!r}")
  qd, w, u, kg, aqk, dec = parts_out
  b, h, n, c, _ = qd.shape

  def tokens(x, dtype):
    return x.reshape(b, h, n * c, x.shape[-1]).astype(dtype)

  wn = tokens(-w, _BF16)
  kg_b = tokens(kg, _BF16)
  if saved is None:
    s_in, v_new = states_kernel(wn, tokens(u, _F32), kg_b, dec, h0, cfg, interp)
  else:
    s_in, v_new = saved.states, saved.v_new
  do_p = chunked._pad_time(d_o.astype(_BF16), n * c - q.shape[1])
  dvn, ds, dh0 = dstates_kernel(tokens(qd, _BF16), wn, kg_b, tokens(aqk, _BF16), dec, do_p,
                                d_final.astype(_F32), cfg, interp,
                                _BF16 if parts == "kernel" else _F32)
  chunks = lambda x: x.reshape(b, h, n, c, x.shape[-1])
  if parts == "kernel":
    d_qd, d_w, d_kg, d_aqk, d_dec = mosaic_gpu_bwd_cotangents.cotangents_kernel(
        v_new, s_in, ds, dvn, do_p, cfg, interp)
    d_parts = (chunks(d_qd), chunks(d_w), chunks(dvn), chunks(d_kg), chunks(d_aqk), d_dec)
  else:
    doc = chunked._to_chunks(do_p.astype(_F32))
    d_parts = chunked.chunk_parts_cotangents(w.astype(_F32), u, s_in, ds, chunks(dvn), doc,
                                             precision)
  return (*parts_vjp(d_parts), dh0.astype(h0.dtype))
