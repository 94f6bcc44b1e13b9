"""VJP of KDA's chunk-parallel part as a Pallas Mosaic GPU kernel (Hopper, kda.md §2.3).

`parts_vjp` has the contract of `chunked.chunk_parts_vjp(..., gate_bound=-5.0)`: the
cotangents of (Q_d, W, U, K_g, A_qk, e^{G_C}) (report Eqs. 2-7) and M = (I + L)^{-1} in,
(dq, dk, dv, dg, dbeta) out. One CTA of two warpgroups per (chunk of C = 64 tokens, head,
batch), bf16 tensor-core operands, fp32 accumulation. With G = chunk-local cumsum of g (in the
kernel for K = 128, by XLA for K = 64, as the forward), x_0 = scale q, x_1 = beta k:
  1. UT transform (Eqs. 6-7): dM = dW K_d^T + dU (beta V)^T, dL = -M^T dM M^T, dK_d = M^T dW,
     d(beta V) = M^T dU.
  2. A_qk = Tril(x_0 e^G (k e^-G)^T), L = StrictTril(x_1 e^G (k e^-G)^T) with dP_0 = dA_qk,
     dP_1 = dL (masked causal, one segment): dx_z = e^G dP_z (k e^-G),
     dk = e^-G sum_z dP_z^T (x_z e^G), with the forward's anchors (tokens 15 and 47 inside the
     32-token halves, 31 for the lower-left block; exponents in [-80, 80] for g >= -5). dP
     sits in SMEM split into its diagonal halves and its lower-left block, one anchor each.
  3. The elementwise terms of Q_d, K_d (first segment), K_g (last), e^{G_C} (one segment);
     dg = reverse cumsum of dG within the chunk, as products with the upper-triangular ones U:
     dg = U dG + U^T (K_g's term) - (K_g's term) + (e^{G_C}'s term), the operands split into
     bf16 hi + lo (error ~2^-17 of each term). Each pair term of step 2 enters dG twice, at
     token i from the row direction and negated at token j from the column direction, and
     the reverse cumsum relies on the two cancelling: dG takes both from the same bf16
     operands (x_z e^G and k e^-G as rounded for the tensor cores), so they cancel to fp32
     accuracy. With the exact factors on the row side, the 2^-9 mismatch left dg 7% off at
     g ~ -2.5 per token (benchmarks/kda_accuracy.py, T = 1024), where dg is small next to
     the terms that cancel.
Warpgroup 0 issues the TMA loads, forms G, dM and dL; warpgroup 1 meanwhile dA_qk's SMEM
copy, U, dv and beta's V term; steps 2-3 run per 32-channel K-slab, slabs 0, 2 on warpgroup 0
and 1, 3 on warpgroup 1, both warpgroups on one code path (the slab index traced from the
warpgroup index, per-warpgroup scratch stacked in a union with step 1's buffers). The
interpreter runs the same code with one warpgroup doing every part (`_warpgroups`); the
two-warpgroup kernel is lowered for CUDA in the CPU tests and runs in the GPU tests.
No reduction over rows (axis 0) in the slab loop: Pallas lowers a cross-warp reduction through
the kernel's one reduction scratch, shared by both warpgroups, and with both running it the
sums came out wrong on the H200 (tests/pallas_kernels/test_mosaic_gpu_patterns.py; the dg of
the two-path kernel, whose two copies of the sum shared that scratch too, was 0.29 off fla's
at T = 8192). The column sum of K_g's term that the
chunk's last row needs is U^T's product instead.
XLA runs `mosaic_gpu.prepare` (padding, bf16 q, k, v; the K = 64 cumsum), the cotangents' and
M's reshapes (dW, dU, M to bf16), and the final slicing. Interpreter against fp32
`chunk_parts_vjp`: relative L2 errors <= 5.6e-3 (dg), about half from the bf16 inputs. SMEM
~207 KiB at K = V = 128.
With normalize_qk (fla's `use_qk_l2norm_in_kernel`) q and k arrive raw: warpgroup 0 normalises
k's rows in SMEM before step 1 and the last warpgroup q's (1 / |x| kept); after step 3 each
warpgroup reads back its slabs of dq, dk (the gradients of the normalised rows y), the row
dots y . dy are summed over both warpgroups through SMEM (with dbeta's, at the same sync),
and dx = (dy - y (y . dy)) / |x| is written over them, so no XLA pass touches q, k or their
gradients.
Code size matters: with the slab loop and the norm passes unrolled in Python the kernel
overflowed the instruction cache (fwd+bwd at H=32 3.54 ms); as loops, 2.58 ms.
Passed its tests compiled on the H200 (2026-11-30: the end-to-end kernel_intra
tests and the first six of this file's; the rest ran in the interpreter). Fwd+bwd of the whole
op at B=1, T=8192 (`jax.vjp`): 2.61 ms at H=32, 7.48 ms at H=96.
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
_WIDE = 64                 # column slab of the UT part's elementwise work


def _warpgroups(cfg) -> int:
  """Warpgroups per CTA: 2 on the GPU; 1 in the interpreter, whose warpgroup threads can wait
  on each other's barriers forever under load (seen with pytest -n 3 on 2 cores)."""
  return 1 if cfg.interpret else 2


def _body(cfg, q_ref, k_ref, g_ref, v_ref, beta_ref, cnt_ref, m_ref, dw_ref, du_ref,
          dqd_ref, dkg_ref, daqk_ref, ddec_ref,
          dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref,
          q_s, k_s, g_s, m_s, dw_s, dp_s, u_s, beta_s, cnt_s, dbeta_s, norm_s, dot_s, union,
          bar, syncs, *stage):
  """One chunk: (dq, dk, dv, dG reverse-summed = dg, dbeta) (see the module doc)."""
  c, kd, dv, half_w = fwd.CHUNK, cfg.key_dim, v_ref.shape[-1], fwd.HALF
  (kd_s, v_s, bv_s, du_s, dm_s), per_wg = union
  n, h, b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
  wg, wgs = lax.axis_index("wg"), _warpgroups(cfg)
  tok = pl.ds(n * c, c)
  mma = fwd._Mma(cfg, stage)
  load = fwd._load

  def both_done(i):
    """Both warpgroups have reached this point (their SMEM writes committed)."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(syncs.at[i])
    plgpu.barrier_wait(syncs.at[i])

  @pl.when(wg == 0)
  def _():
    for src, dst in ((q_ref.at[b, tok, h], q_s), (k_ref.at[b, tok, h], k_s),
                     (g_ref.at[b, tok, h], g_s), (v_ref.at[b, tok, h], v_s),
                     (beta_ref.at[b, h, tok], beta_s), (m_ref.at[b, h, tok], m_s),
                     (dw_ref.at[b, h, tok], dw_s), (du_ref.at[b, h, tok], du_s)):
      plgpu.copy_gmem_to_smem(src, dst, bar)
    if cfg.has_segments:
      plgpu.copy_gmem_to_smem(cnt_ref.at[b, tok], cnt_s, bar)
  plgpu.barrier_wait(bar)

  full = (c, c)
  row, col = fwd._iota(full, 0), fwd._iota(full, 1)
  beta_vec = load(beta_s, fwd._ROW)
  first_vec = last_vec = None
  whole = 1.0
  causal, strict = row >= col, row > col
  if cfg.has_segments:
    cnt_vec = load(cnt_s, fwd._ROW)
    cnt_last = cnt_s[c - 1]
    first_vec = jnp.where(cnt_vec == 0.0, 1.0, 0.0)
    last_vec = jnp.where(cnt_vec == cnt_last, 1.0, 0.0)
    whole = jnp.where(cnt_last == 0.0, 1.0, 0.0)
    same = fwd._rows(cnt_vec, full) == fwd._cols(load(cnt_s, fwd._COL), full)
    causal, strict = causal & same, strict & same
  lower_left = (row >= half_w) & (col < half_w)
  wide = (c, _WIDE)

  def split_dp(z, d_p):
    """dP_z into SMEM: its diagonal halves and its lower-left block."""
    dp_s.at[z][...] = jnp.where(lower_left, 0.0, d_p).astype(_BF16)
    dp_s.at[2 + z][...] = jnp.where(lower_left, d_p, 0.0).astype(_BF16)

  def normalize(z, x_s):
    """x_s's rows L2-normalised in place (bf16), 1 / |x_r| kept in norm_s[z]."""
    inv = fwd._inverse_row_norm(x_s, kd)
    norm_s.at[z][...] = inv
    inv = fwd._rows(inv, (c, half_w))

    def step(j, carry):
      cols = pl.ds(pl.multiple_of(j * half_w, half_w), half_w)
      x_s.at[:, cols][...] = (load(x_s.at[:, cols]).astype(_F32) * inv).astype(_BF16)
      return carry

    lax.fori_loop(0, kd // half_w, step, 0)

  # 1. UT transform: warpgroup 0 forms G, K_d, beta V, dM and dL (dP_1); the last warpgroup
  # dP_0 = dA_qk and d(beta V) = M^T dU (dv and beta's V term). With normalize_qk, first the
  # rows of k (warpgroup 0) and q (the last) are L2-normalised.
  @pl.when(wg == 0)
  def _():
    if cfg.normalize_qk:
      normalize(1, k_s)
    if cfg.scan:                      # G = cumsum(g)
      fwd._cumsum_rows(g_s)
    for slab in range(kd // _WIDE):
      cols = pl.ds(slab * _WIDE, _WIDE)
      k_d = load(k_s.at[:, cols]).astype(_F32) * jnp.exp(load(g_s.at[:, cols]))
      rows = beta_vec if first_vec is None else beta_vec * first_vec
      kd_s.at[:, cols][...] = (k_d * fwd._rows(rows, wide)).astype(_BF16)
    for slab in range(dv // _WIDE):
      cols = pl.ds(slab * _WIDE, _WIDE)
      bv_s.at[:, cols][...] = (load(v_s.at[:, cols]).astype(_F32)
                               * fwd._rows(beta_vec, wide)).astype(_BF16)
    plgpu.commit_smem()
    d_m = mma.product(full, [(dw_s, kd_s.T), (du_s, bv_s.T)])
    dm_s[...] = d_m.astype(_BF16)
    plgpu.commit_smem()
    mt_dm = mma.product(full, [(m_s.T, dm_s)])
    d_l = mma.product(full, [(fwd._Regs(mt_dm.astype(_BF16)), m_s.T)])     # -dL
    split_dp(1, jnp.where(strict, -d_l, 0.0))

  @pl.when(wg == wgs - 1)
  def _():
    if cfg.normalize_qk:
      normalize(0, q_s)
    split_dp(0, jnp.where(causal, load(daqk_ref.at[b, h, tok]).astype(_F32), 0.0))
    u_s[...] = jnp.where(row <= col, 1.0, 0.0).astype(_BF16)  # reverse cumsum over rows
    d_beta = None
    for slab in range(dv // _WIDE):
      cols = pl.ds(slab * _WIDE, _WIDE)
      d_bv = mma.product(wide, [(m_s.T, du_s.at[:, cols])])
      dv_ref.at[b, tok, h, cols][...] = (d_bv * fwd._rows(beta_vec, wide)).astype(dv_ref.dtype)
      part = jnp.sum(load(v_s.at[:, cols]).astype(_F32) * d_bv, axis=1)
      d_beta = part if d_beta is None else d_beta + part
    dbeta_s.at[wgs][...] = d_beta

  both_done(0)                        # G, dP written; the union's first view is free

  # 2-3. Intra-chunk matrices and elementwise terms per slab of 32 key channels, the slabs
  # shared out between the warpgroups, each with its own scratch.
  half = (c, half_w)
  rowh = fwd._iota(half, 0)
  second = rowh >= half_w
  beta = fwd._rows(beta_vec, half)
  top, bottom = pl.ds(0, half_w), pl.ds(half_w, half_w)

  def decays(cols):
    """G of the slab, G minus its half's anchor (15 or 47), and e^{|G - G_31|} (lower-left)."""
    m15, m31, m47 = (fwd._cols(load(g_s.at[r, cols], fwd._COL), half)
                     for r in (fwd.MID, fwd.SPLIT, fwd.MID + half_w))
    g = load(g_s.at[:, cols])
    return g, g - jnp.where(second, m47, m15), jnp.exp(jnp.where(second, g - m31, m31 - g))

  def rounded(ref):
    """A bf16 tensor-core operand [C, 32] of this slab, back in fp32."""
    return load(ref).astype(_F32)

  def to_chunk_start(g):
    e_g = jnp.exp(g)
    return e_g if first_vec is None else e_g * fwd._rows(first_vec, half)

  # One code path for both warpgroups (the slab index is traced from `wg`): two instruction
  # streams compete for the instruction cache (4.32 -> 3.61 ms fwd+bwd at H=32).
  kmid_s, k31_s, xup_s, x31_s, hi_s, lo_s = (x.at[wg] for x in per_wg)
  slabs = kd // half_w // wgs
  slab_cols = lambda i: pl.ds(pl.multiple_of((wg + wgs * i) * half_w, half_w), half_w)

  # Each product group's results are consumed before the next is issued, and the slab's
  # decays are recomputed from SMEM, so that fewer [C, 32] fp32 arrays are live at once. A
  # loop, not unrolled: one copy of the code for the instruction cache.
  def slab_step(i, d_beta):
    cols = slab_cols(i)
    g, d, t31 = decays(cols)
    k = load(k_s.at[:, cols]).astype(_F32)
    e_up = jnp.exp(d)
    kmid_s[...] = (k * jnp.exp(-d)).astype(_BF16)
    k31_s[...] = jnp.where(second, 0.0, k * t31).astype(_BF16)
    for z, x in enumerate((load(q_s.at[:, cols]).astype(_F32) * cfg.scale, k * beta)):
      xup_s.at[z][...] = (x * e_up).astype(_BF16)
      x31_s.at[z][...] = jnp.where(second, x * t31, 0.0).astype(_BF16)
    plgpu.commit_smem()

    diag, low = mma.products((half, [(dp_s.at[0], kmid_s)], None),
                             (half, [(dp_s.at[2, :, top], k31_s.at[top])], None))
    g, d, t31 = decays(cols)
    pre = to_chunk_start(g) * load(dqd_ref.at[b, h, tok, cols])
    dx = jnp.exp(d) * diag + jnp.where(second, t31, 0.0) * low + pre    # d(scale q)
    dq_ref.at[b, tok, h, cols][...] = (cfg.scale * dx).astype(dq_ref.dtype)
    # dG's pair terms from the same bf16 operands as the column direction's (module doc, 3.).
    d_g = (rounded(xup_s.at[0]) * diag + rounded(x31_s.at[0]) * low
           + load(q_s.at[:, cols]).astype(_F32) * cfg.scale * pre)

    diag, low, d_kd = mma.products(
        (half, [(dp_s.at[1], kmid_s)], None),
        (half, [(dp_s.at[3, :, top], k31_s.at[top])], None),
        (half, [(m_s.T, dw_s.at[:, cols])], None))
    g, d, t31 = decays(cols)
    pre = to_chunk_start(g) * d_kd
    dx = jnp.exp(d) * diag + jnp.where(second, t31, 0.0) * low + pre    # d(beta k)
    k = load(k_s.at[:, cols]).astype(_F32)
    d_beta = d_beta + jnp.sum(k * dx, axis=1)
    d_g = d_g + rounded(xup_s.at[1]) * diag + rounded(x31_s.at[1]) * low + k * beta * pre
    d_k = beta * dx

    diag, low = mma.products(
        (half, [(dp_s.at[0].T, xup_s.at[0]), (dp_s.at[1].T, xup_s.at[1])], None),
        (half, [(dp_s.at[2, bottom].T, x31_s.at[0, bottom]),
                (dp_s.at[3, bottom].T, x31_s.at[1, bottom])], None))
    g, d, t31 = decays(cols)
    k = load(k_s.at[:, cols]).astype(_F32)
    dk_intra = jnp.exp(-d) * diag + jnp.where(second, 0.0, t31) * low
    e_end = jnp.exp(fwd._cols(load(g_s.at[fwd.LAST, cols], fwd._COL), half) - g)
    if last_vec is not None:
      e_end = e_end * fwd._rows(last_vec, half)
    d_kg = e_end * load(dkg_ref.at[b, h, tok, cols])
    dk_ref.at[b, tok, h, cols][...] = (d_k + dk_intra + d_kg).astype(dk_ref.dtype)
    # dg = U (dG - kg_d + e_last (sum_j kg_d_j + chunk-decay term)) = U dG + U^T kg_d - kg_d
    # + chunk-decay term: the column sum on the tensor cores (no cross-warp reduction, see the
    # module doc). kmid_s and k31_s are free again (their products were read above).
    kg_d = k * d_kg
    d_g = d_g - rounded(kmid_s) * diag - rounded(k31_s) * low
    for x, (x_hi, x_lo) in ((d_g, (hi_s, lo_s)), (kg_d, (kmid_s, k31_s))):
      hi = x.astype(_BF16)
      x_hi[...] = hi
      x_lo[...] = (x - hi.astype(_F32)).astype(_BF16)
    plgpu.commit_smem()
    d_dec = (whole * jnp.exp(load(g_s.at[fwd.LAST, cols], fwd._COL))
             * load(ddec_ref.at[b, h, n, cols], fwd._COL))
    cum = mma.product(half, [(u_s, hi_s), (u_s, lo_s), (u_s.T, kmid_s), (u_s.T, k31_s)])
    dg_ref.at[b, tok, h, cols][...] = cum - kg_d + fwd._cols(d_dec, half)
    return d_beta

  zero = plgpu.layout_cast(jnp.zeros((c,), _F32), fwd._ROW)
  d_beta = lax.fori_loop(0, slabs, slab_step, zero)

  # 4. With normalize_qk, the L2 norm's VJP on this warpgroup's slabs of dq and dk (written
  # above as the gradients of the normalised rows y = x / |x|): dx = (dy - y (y . dy)) / |x|,
  # y . dy summed over both warpgroups' slabs (read back after the slab loop, to keep its
  # registers; each thread reads what it wrote).
  grads = ((q_s, dq_ref), (k_s, dk_ref))

  def rows(z, i):
    """Slab i's columns, y and dy of q (z = 0) or k (z = 1), in fp32."""
    cols = slab_cols(i)
    x_s, d_ref = grads[z]
    return cols, load(x_s.at[:, cols]).astype(_F32), load(d_ref.at[b, tok, h, cols]).astype(
        _F32)

  def dot_step(i, acc):
    return tuple(a + jnp.sum(y * dy, axis=1) for a, (_, y, dy) in zip(acc, (rows(0, i),
                                                                           rows(1, i))))

  dots = lax.fori_loop(0, slabs, dot_step, (zero, zero)) if cfg.normalize_qk else ()
  for w in range(wgs):          # rows of dbeta_s by static index (a traced one is unchecked)

    @pl.when(wg == w)
    def _():
      dbeta_s.at[w][...] = d_beta
      for z, dot in enumerate(dots):
        dot_s.at[z, w][...] = dot
  both_done(1)

  if cfg.normalize_qk:
    dots = [fwd._rows(sum(load(dot_s.at[z, w], fwd._ROW) for w in range(wgs)), half)
            for z in range(2)]
    invs = [fwd._rows(load(norm_s.at[z], fwd._ROW), half) for z in range(2)]

    def vjp_step(i, carry):
      for z, d_ref in enumerate((dq_ref, dk_ref)):
        cols, y, dy = rows(z, i)
        d_ref.at[b, tok, h, cols][...] = (invs[z] * (dy - y * dots[z])).astype(d_ref.dtype)
      return carry

    lax.fori_loop(0, slabs, vjp_step, 0)

  @pl.when(wg == 0)
  def _():
    dbeta_ref.at[b, h, tok][...] = sum(load(dbeta_s.at[i], fwd._ROW) for i in range(wgs + 1))


def intra_vjp_kernel(q, k, g, v, beta, counts, m, d_w, d_u, d_qd, d_kg, d_aqk, d_dec,
                     cfg: "fwd._Config", interpret, grad_dtypes=(_F32, _F32, _F32)):
  """The kernel on `mosaic_gpu.prepare`d inputs.

  q, k bf16, g fp32 (G for K = 64) [B, T, H, K]; v bf16 [B, T, H, V]; beta [B, H, T];
  counts [B, T]; m bf16 [B, H, T, C]; d_w bf16 [B, H, T, K]; d_u bf16 [B, H, T, V];
  d_qd, d_kg fp32 [B, H, T, K]; d_aqk bf16 [B, H, T, C]; d_dec fp32 [B, H, N, K].
  Returns dq, dk [B, T, H, K] and dv [B, T, H, V] in `grad_dtypes` (stored from the fp32
  values: bf16 when the caller would cast to it anyway), fp32 dg [B, T, H, K] and
  dbeta [B, H, T].
  """
  b, t, h, kd = q.shape
  dv = v.shape[-1]
  c, half_w = fwd.CHUNK, fwd.HALF
  op = fwd._operand
  wgs = _warpgroups(cfg)
  tok_k = lambda dtype: jax.ShapeDtypeStruct((b, t, h, kd), dtype)
  dq_t, dk_t, dv_t = grad_dtypes
  call = plgpu.kernel(
      functools.partial(_body, cfg),
      out_type=(tok_k(dq_t), tok_k(dk_t), jax.ShapeDtypeStruct((b, t, h, dv), dv_t), tok_k(_F32),
                jax.ShapeDtypeStruct((b, h, t), _F32)),
      scratch_types=[
          op((c, kd)), op((c, kd)), plgpu.SMEM((c, kd), _F32), op((c, c)), op((c, kd)),
          op((4, c, c)), op((c, c)), plgpu.SMEM((c,), _F32), plgpu.SMEM((c,), _F32),
          plgpu.SMEM((wgs + 1, c), _F32), plgpu.SMEM((2, c), _F32),
          plgpu.SMEM((2, wgs, c), _F32),
          plgpu.RefUnion((op((c, kd)), op((c, dv)), op((c, dv)), op((c, dv)), op((c, c))),
                         (op((wgs, c, half_w)), op((wgs, c, half_w)), op((wgs, 2, c, half_w)),
                          op((wgs, 2, c, half_w)), op((wgs, c, half_w)),
                          op((wgs, c, half_w)))),
          plgpu.Barrier(num_arrivals=9 if cfg.has_segments else 8),
          plgpu.Barrier(num_arrivals=wgs, num_barriers=2),
          *fwd._stage(cfg)],
      grid=(cfg.num_chunks, h, b), grid_names=("n", "h", "b"),
      num_threads=wgs, thread_name="wg",
      compiler_params=fwd._PARAMS, interpret=interpret, kernel_name="kda_intra_vjp_mosaic_gpu")
  return call(q, k, g, v, beta, counts, m, d_w, d_u, d_qd, d_kg, d_aqk, d_dec)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "normalize_qk"))
def parts_vjp(q, k, v, g, beta, m, cotangents, *, scale: float, segment_ids,
              interpret=False, prepared=None, normalize_qk: bool = False
              ) -> tuple[jax.Array, ...]:
  """`chunked.chunk_parts_vjp(..., gate_bound=-5.0)` on the kernel.

  Args:
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; segment_ids [B, T] or None.
    m: M = (I + L)^{-1} [B, H, N, C, C] (C = 64, N = ceil(T / C)).
    cotangents: (dQ_d, dW [B, H, N, C, K], dU [B, H, N, C, V], dK_g [B, H, N, C, K],
      dA_qk [B, H, N, C, C], d chunk decay [B, H, N, K]), `chunked.chunk_parts`' order.
    interpret: False (compile for the GPU), True or a `plgpu.InterpretGPUParams`.
    prepared: `mosaic_gpu.prepare(q, k, v, g, beta, None, segment_ids)` if the caller has it
      (the kernel backward, from the forward's intra kernel), else computed here.
    normalize_qk: q and k are raw and the parts were formed from their L2-normalised rows
      (`reference.l2_normalize`): the kernel normalises them too and returns dq, dk through
      the norm's VJP.

  Returns:
    (dq, dk, dv, dg, dbeta) in the inputs' shapes and dtypes.
  """
  cfg, interp = fwd.config(q, segment_ids, scale=scale, interpret=interpret,
                           normalize_qk=normalize_qk)
  if prepared is None:
    prepared = fwd.prepare(q, k, v, g, beta, None, segment_ids)
  qp, kp, gp, vp, beta_t, counts, _ = prepared
  d_qd, d_w, d_u, d_kg, d_aqk, d_dec = cotangents
  b, h, n, c = m.shape[:4]

  def tokens(x, dtype):
    return x.reshape(b, h, n * c, x.shape[-1]).astype(dtype)

  dq, dk, dv, dg, dbeta = intra_vjp_kernel(
      qp, kp, gp, vp, beta_t, counts, tokens(m, _BF16), tokens(d_w, _BF16),
      tokens(d_u, _BF16), tokens(d_qd, _F32), tokens(d_kg, _F32), tokens(d_aqk, _BF16),
      d_dec.astype(_F32), cfg, interp,
      tuple(jnp.promote_types(x.dtype, _BF16) for x in (q, k, v)))
  t = q.shape[1]
  return (dq[:, :t].astype(q.dtype), dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype),
          dg[:, :t].astype(g.dtype), jnp.swapaxes(dbeta, 1, 2)[:, :t].astype(beta.dtype))
