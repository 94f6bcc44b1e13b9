"""Chunkwise KDA forward as Pallas Mosaic GPU kernels for Hopper (report Eqs. 2-9).

Same contract as `api.chunk_kda` (fla layouts, see api.py) for the bounded
gate g >= -5 (K3's `gate_lower_bound`, kda.md §2.2); `supports` says when.

Two kernels, one warpgroup per CTA, bf16 tensor-core operands with fp32
accumulation:
  1. `intra`, one CTA per (chunk of C = 64 tokens, head, batch), all chunks in
     parallel. TMA loads q, k, g (and beta, segment counts); G = chunk-local
     cumsum of g in fp32 (a per-channel scan in SMEM for K = 128; XLA's cumsum
     for K = 64). Decays are factorised inside 32-token halves through their
     middle token m (15 or 47): x_r e^{G_r - G_m} . k_c e^{G_m - G_c}, every
     exponent in [-80, 80] for g >= -5 (inside the fp32/bf16 range); the
     lower-left 32 x 32 block goes through token 31, x_r e^{G_r - G_31} .
     k_c e^{G_31 - G_c}, both exponents <= 0 (an underflow there is a true
     underflow). This gives A_qk (causal) and L = StrictTril(diag(beta) K_d
     K_i^T) (Eq. 6). The UT transform M = (I + L)^{-1}: the four 16 x 16
     diagonal blocks inverted exactly in fp32 by forward substitution (Dinv),
     then with N = Dinv L_off (N^4 = 0), M = (I - N + N^2 - N^3) Dinv by four
     tensor-core products. Writes (bf16, [B, H, T, .]) Q_d = scale q e^G,
     -K_d = -beta k e^G, K_g = k e^{G_C - G}, A_qk, M, and the chunk decay
     e^{G_C} (fp32).
  2. `state`, one CTA per (value block of 64 columns, head, batch), walking the
     chunks in order with the state S [K, 64] in fp32 registers (bf16 copy in
     SMEM as the tensor-core operand); the next chunk's tiles are loaded by TMA
     (double-buffered) while this one computes
       V_new = M (diag(beta) V - K_d S),  O = Q_d S + A_qk V_new,
       S' = Diag(e^{G_C}) S + K_g^T V_new      (Eqs. 8-9, WY folded into M).
Measured on an H200 (B=1, T=8192, K=V=128, bf16, forward with the XLA part):
0.56 ms at H=32 (fla-core 0.6.0 chunk_kda 1.00 ms in the same run) and
1.44 ms at H=96 (fla 2.94 ms in anchors_h200.md). A single fused kernel per
(value block, head, batch) doing both (the first version) ran at 2.2 ms for
H=32: its 64 CTAs of one warpgroup each left the chunk-parallel work
latency-bound.
With normalize_qk (`use_qk_l2norm_in_kernel`), kernel 1 scales the rows of q and k by
1 / sqrt(sum x^2 + 1e-6) (fp32 row sums over the K-slabs) before anything else.
Segments (segment_ids) mask A_qk and L to one segment, Q_d and K_d to the
chunk's first segment, K_g to its last, and zero the carried state when a
segment starts inside the chunk (as chunked.py).

Backward: `chunk_kda_mosaic_gpu` is a `jax.custom_vjp` (`kernel_vjp.kernel_op`).
backward="kernel_intra" (default) is `mosaic_gpu_bwd.backward(parts="kernel")` on what the
forward saved (`mosaic_gpu_bwd.Saved`: kernel 1's outputs, and S_n and V_new that kernel 2
writes with `save=True`): the reverse walk for the states' gradients, the parts' cotangents and
their VJP (with the L2 norm's VJP under normalize_qk), all Mosaic GPU kernels; "kernel" does
the chunk-parallel gradients as batched XLA einsums instead (2.6x slower fwd+bwd); "chunked" is
the VJP of the chunked JAX tier (`chunked.chunk_kda` with gate_bound -5). All three passed
their GPU tests on the H200.

Interpret mode (`interpret=True` uses `plgpu.InterpretGPUParams()`): the CPU
interpreter's wgmma reads both operands from SMEM and cannot start from an
initialised accumulator, so register operands are staged through SMEM and
initial values are added after the product; the arithmetic is the same.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.kda import kernel_vjp
from pallas_kernels.kda import mosaic_gpu_bwd
from pallas_kernels.kda import reference

GATE_BOUND = -5.0
CHUNK = 64
HALF = 32                  # factorisation block; also the K-slab width of the passes
TILE = 16                  # diagonal blocks inverted exactly
BLOCK_V = 64               # value columns per CTA of the state kernel (or 32, see `pick_block_v`)
NUM_SMS = 132              # H100 / H200 SXM
HEAD_DIMS = (64, 128)
SCAN_DIM = 128             # K for which the intra kernel scans g itself (one thread per channel)
MAX_GRID = 65535           # CUDA's limit on the grid's y and z extents
MID, SPLIT, LAST = 15, 31, 63   # rows of G used as per-channel anchors
BACKWARDS = ("chunked", "kernel", "kernel_intra")

_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)       # one value per row of a WGMMA-layout array
_COL = _WG.reduce(0)       # one value per column
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def supports(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             segment_ids=None, gate_bound=None) -> str | None:
  """None if the kernels handle the call, else why not (the dispatcher falls through)."""
  del scale, initial_state, output_final_state, segment_ids, k, g, beta
  if gate_bound is None or gate_bound < GATE_BOUND:
    return f"needs gate_bound >= {GATE_BOUND} (bounded gate), got {gate_bound}"
  if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
    return f"needs K, V in {HEAD_DIMS}, got K={q.shape[-1]}, V={v.shape[-1]}"
  if jnp.dtype(q.dtype) not in (jnp.dtype(_BF16), jnp.dtype(_F32)):
    return f"needs bfloat16 or float32 inputs, got {q.dtype}"
  b, t, h = q.shape[:3]
  if max(h, b, -(-t // CHUNK)) > MAX_GRID:
    return f"needs B, H and T / {CHUNK} <= {MAX_GRID} (CUDA grid), got {(b, h, t)}"
  return None


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static shapes and options of one kernel call."""
  num_chunks: int
  key_dim: int
  scale: float
  has_segments: bool
  interpret: bool
  block_v: int = BLOCK_V
  normalize_qk: bool = False      # L2-normalise q and k rows in the intra kernel

  @property
  def scan(self) -> bool:
    return self.key_dim == SCAN_DIM


class _Regs(NamedTuple):
  """A bf16 WGMMA-layout register array used as a left matmul operand."""
  value: jax.Array


def _operand(shape) -> plgpu.SMEM:
  """bf16 tensor-core operand: 32-element (64-byte) swizzled rows, tiles (8, 32)."""
  return plgpu.SMEM(shape, _BF16, transforms=(plgpu.TilingTransform((8, 32)),
                                              plgpu.SwizzleTransform(64)))


def _load(ref, layout=_WG) -> jax.Array:
  return plgpu.load(ref, layout=layout, optimized=False)


def _iota(shape, dim) -> jax.Array:
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_WG)


def _rows(x, shape) -> jax.Array:
  """Per-row vector (_ROW layout) broadcast along the columns."""
  return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape) -> jax.Array:
  """Per-column vector (_COL layout) broadcast along the rows."""
  return lax.broadcast_in_dim(x, shape, [1])


class _Mma:
  """Tensor-core products of one warpgroup; `stage` holds SMEM copies of register
  operands when interpreting ([C, 32] and [C, 64] bf16 buffers)."""

  def __init__(self, cfg: _Config, stage):
    self.cfg, self.stage = cfg, stage

  def wgmma(self, acc, a, b_ref) -> None:
    """acc += a @ b_ref; a is an SMEM ref or `_Regs`."""
    if isinstance(a, _Regs):
      if self.cfg.interpret:
        buf = self.stage[0] if a.value.shape[1] == HALF else self.stage[1]
        buf[...] = a.value
        plgpu.commit_smem()
        a = buf
      else:
        a = a.value
    plgpu.wgmma(acc, a, b_ref)

  def products(self, *specs) -> list[jax.Array]:
    """For each (shape, pairs, init): init + sum(a @ b for a, b in pairs), fp32, issued together."""
    if self.cfg.interpret or all(init is None for _, _, init in specs):
      def scoped(*accs):
        for acc, (_, pairs, _) in zip(accs, specs):
          for a, b_ref in pairs:
            self.wgmma(acc, a, b_ref)
        return [acc[...] for acc in accs]
      outs = pl.run_scoped(scoped, *[plgpu.ACC(shape, _F32) for shape, _, _ in specs])
      outs = [o if init is None else o + init for o, (_, _, init) in zip(outs, specs)]
    else:
      def body(accs):
        for acc, (_, pairs, _) in zip(accs, specs):
          for a, b_ref in pairs:
            self.wgmma(acc, a, b_ref)
      inits = tuple(plgpu.ACC.init(plgpu.layout_cast(jnp.zeros(shape, _F32), _WG)
                                   if init is None else init) for shape, _, init in specs)
      outs = list(pl.run_state(body)(inits))
    # Reading an accumulator waits for the wgmma without a data dependency;
    # the barrier keeps arithmetic on the results after that wait.
    return list(lax.optimization_barrier(outs))

  def product(self, shape, pairs, init=None) -> jax.Array:
    return self.products((shape, pairs, init))[0]


def _cumsum_rows(g_s) -> None:
  """G = cumsum of g [C, K] fp32 in SMEM over rows, in place; one thread per key channel."""
  rows, kd = g_s.shape
  line = plgpu.Layout.WG_STRIDED((kd,), vec_size=1)

  def scan_step(r, acc):
    acc = acc + _load(g_s.at[r], line)
    g_s.at[r][...] = acc
    return acc

  lax.fori_loop(0, rows, scan_step, plgpu.layout_cast(jnp.zeros((kd,), _F32), line))
  plgpu.commit_smem()


def _inverse_row_norm(x_s, kd: int) -> jax.Array:
  """1 / sqrt(sum x^2 + eps) per row of x [C, K] in SMEM, in fp32 (`reference.l2_normalize`)."""
  sq = None
  for slab in range(kd // HALF):
    x = _load(x_s.at[:, pl.ds(slab * HALF, HALF)]).astype(_F32)
    part = jnp.sum(x * x, axis=1)
    sq = part if sq is None else sq + part
  return lax.rsqrt(sq + reference.L2_EPS)


def _walk(num_chunks: int, copies, bars, body, init, reverse: bool = False):
  """Walks the chunks in order (or in reverse) with their inputs double-buffered by TMA.

  copies: (gmem_of, smem) pairs; chunk n's inputs gmem_of(n) go to smem.at[slot], arriving on
  bars[slot]. body(n, slot, carry) -> carry runs once they have landed, while chunk n + 1's
  copies fly.
  """
  chunk = (lambda i: num_chunks - 1 - i) if reverse else (lambda i: i)

  def fetch(n, slot):
    for gmem_of, smem in copies:
      plgpu.copy_gmem_to_smem(gmem_of(n), smem.at[slot], bars.at[slot])

  fetch(chunk(0), 0)

  def step(i, carry):
    slot = lax.rem(i, 2)
    plgpu.commit_smem()               # this thread's reads of the other slot are done

    @pl.when(i + 1 < num_chunks)
    def _():
      fetch(chunk(i + 1), 1 - slot)

    plgpu.barrier_wait(bars.at[slot])
    return body(chunk(i), slot, carry)

  return lax.fori_loop(0, num_chunks, step, init)


def _intra_body(cfg: _Config, q_ref, k_ref, g_ref, beta_ref, cnt_ref,
                qd_ref, kd_ref, kg_ref, aqk_ref, m_ref, dec_ref,
                q_s, k_s, g_union, k_union, k31_s, a_s, beta_s, cnt_s, bar, *stage):
  """One chunk: Q_d, -K_d, K_g, A_qk, M and e^{G_C} (see the module doc)."""
  c, kd = CHUNK, cfg.key_dim
  g_s, (asm_s, tri_s) = g_union       # G; later the solve's fp32 scratch
  kmid_s, (nb_s, db_s) = k_union      # keys decayed to the anchors; later the solve's operands
  n, h, b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
  tok = pl.ds(n * c, c)
  mma = _Mma(cfg, stage)
  half = (c, HALF)
  row, col = _iota(half, 0), _iota(half, 1)
  second = row >= HALF                # rows of the chunk's second half

  plgpu.copy_gmem_to_smem(q_ref.at[b, tok, h], q_s, bar)
  plgpu.copy_gmem_to_smem(k_ref.at[b, tok, h], k_s, bar)
  plgpu.copy_gmem_to_smem(g_ref.at[b, tok, h], g_s, bar)
  plgpu.copy_gmem_to_smem(beta_ref.at[b, h, tok], beta_s, bar)
  if cfg.has_segments:
    plgpu.copy_gmem_to_smem(cnt_ref.at[b, tok], cnt_s, bar)
  plgpu.barrier_wait(bar)
  if cfg.scan:
    _cumsum_rows(g_s)

  beta = _rows(_load(beta_s, _ROW), half)
  q_norm = k_norm = 1.0
  if cfg.normalize_qk:
    q_norm, k_norm = (_rows(_inverse_row_norm(x_s, kd), half) for x_s in (q_s, k_s))
  first = last = None
  carry = 1.0
  if cfg.has_segments:
    cnt_vec = _load(cnt_s, _ROW)
    cnt_last = cnt_s[c - 1]
    first = _rows(jnp.where(cnt_vec == 0.0, 1.0, 0.0), half)
    last = _rows(jnp.where(cnt_vec == cnt_last, 1.0, 0.0), half)
    carry = jnp.where(cnt_last == 0.0, 1.0, 0.0)
  dec_ref.at[b, h, n][...] = jnp.exp(_load(g_s.at[LAST], _COL)) * carry

  def slab_pass(*accs):
    for slab in range(kd // HALF):
      cols = pl.ds(slab * HALF, HALF)
      m15, m31, m47, m63 = (_cols(_load(g_s.at[r, cols], _COL), half)
                            for r in (MID, SPLIT, MID + HALF, LAST))
      g = _load(g_s.at[:, cols])
      d = g - jnp.where(second, m47, m15)
      k = _load(k_s.at[:, cols]).astype(_F32) * k_norm
      q = _load(q_s.at[:, cols]).astype(_F32) * (q_norm * cfg.scale)
      kmid_s.at[:, cols][...] = (k * jnp.exp(-d)).astype(_BF16)
      t31 = jnp.exp(jnp.where(second, g - m31, m31 - g))
      k31_s.at[:, cols][...] = jnp.where(second, 0.0, k * t31).astype(_BF16)
      e_mid = jnp.exp(d)
      kb = k * beta
      ops = (_Regs((q * e_mid).astype(_BF16)), _Regs((kb * e_mid).astype(_BF16)),
             _Regs(jnp.where(second, q * t31, 0.0).astype(_BF16)),
             _Regs(jnp.where(second, kb * t31, 0.0).astype(_BF16)))
      plgpu.commit_smem()
      left = kmid_s.at[pl.ds(0, HALF), cols].T
      right = kmid_s.at[pl.ds(HALF, HALF), cols].T
      low = k31_s.at[pl.ds(0, HALF), cols].T
      for fam in range(2):
        mma.wgmma(accs[3 * fam], ops[fam], left)
        mma.wgmma(accs[3 * fam + 1], ops[fam], right)
        mma.wgmma(accs[3 * fam + 2], ops[2 + fam], low)
      eg = jnp.exp(g)
      kg = k * jnp.exp(m63 - g)
      if first is not None:
        eg, kg = eg * first, kg * last
      q_s.at[:, cols][...] = (q * eg).astype(_BF16)           # Q_d
      k_s.at[:, cols][...] = (-(kb * eg)).astype(_BF16)       # -K_d
      plgpu.wgmma_wait(0)                                     # k31's slab is read
      k31_s.at[:, cols][...] = kg.astype(_BF16)               # K_g
    return [acc[...] for acc in accs]

  parts = pl.run_scoped(slab_pass, *[plgpu.ACC(half, _F32) for _ in range(6)])
  parts = lax.optimization_barrier(parts)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_s, qd_ref.at[b, h, tok])
  plgpu.copy_smem_to_gmem(k_s, kd_ref.at[b, h, tok])
  plgpu.copy_smem_to_gmem(k31_s, kg_ref.at[b, h, tok])

  col_r = col + HALF
  masked = []
  for fam in range(2):                # (A_qk, L) as [C, 32] column halves
    p_left, p_right, p_low = parts[3 * fam:3 * fam + 3]
    keep_l = second | ((row >= col) if fam == 0 else (row > col))
    keep_r = second & ((row >= col_r) if fam == 0 else (row > col_r))
    if cfg.has_segments:
      cnt_row = _rows(cnt_vec, half)
      keep_l &= cnt_row == _cols(_load(cnt_s.at[pl.ds(0, HALF)], _COL), half)
      keep_r &= cnt_row == _cols(_load(cnt_s.at[pl.ds(HALF, HALF)], _COL), half)
    masked.append((jnp.where(keep_l, jnp.where(second, p_low, p_left), 0.0),
                   jnp.where(keep_r, p_right, 0.0)))
  a_s.at[:, pl.ds(0, HALF)][...] = masked[0][0].astype(_BF16)
  a_s.at[:, pl.ds(HALF, HALF)][...] = masked[0][1].astype(_BF16)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(a_s, aqk_ref.at[b, h, tok])

  # UT transform M = (I + L)^{-1} (Eq. 6).
  l_left, l_right = masked[1]
  row_tile = row // TILE
  tcol, trow = _iota((c, TILE), 1), _iota((c, TILE), 0)
  tblock, offset = trow // TILE, trow % TILE
  asm_s.at[:, pl.ds(0, HALF)][...] = l_left
  asm_s.at[:, pl.ds(HALF, HALF)][...] = l_right
  nb_s.at[:, pl.ds(0, HALF)][...] = jnp.where(row_tile == col // TILE, 0.0, l_left).astype(_BF16)
  nb_s.at[:, pl.ds(HALF, HALF)][...] = jnp.where(row_tile == col // TILE + 2, 0.0,
                                                 l_right).astype(_BF16)
  plgpu.commit_smem()
  a_diag = None                       # diagonal blocks stacked [C, 16]
  for blk in range(c // TILE):
    part = _load(asm_s.at[:, pl.ds(TILE * blk, TILE)])
    a_diag = part if a_diag is None else jnp.where(tblock == blk, part, a_diag)
  inv = jnp.where(tcol == offset, 1.0, 0.0)
  tri_s[...] = inv
  plgpu.commit_smem()
  for j in range(TILE - 1):           # after step j, row j + 1 of every block is final
    pivot = None
    for blk in range(c // TILE):
      part = _cols(_load(tri_s.at[TILE * blk + j], _COL), (c, TILE))
      pivot = part if pivot is None else jnp.where(tblock == blk, part, pivot)
    coef = _rows(jnp.sum(jnp.where(tcol == j, a_diag, 0.0), axis=1), (c, TILE))
    inv = jnp.where(offset > j, inv - coef * pivot, inv)
    tri_s[...] = inv
    plgpu.commit_smem()
  for blk in range(c // TILE):        # block-diagonal Dinv [C, C]
    asm_s.at[:, pl.ds(TILE * blk, TILE)][...] = jnp.where(tblock == blk, inv, 0.0)
  plgpu.commit_smem()
  d_inv = _load(asm_s).astype(_BF16)
  db_s[...] = d_inv
  plgpu.commit_smem()
  full = (c, c)
  nil = mma.product(full, [(_Regs(d_inv), nb_s)])            # N = Dinv L_off
  nil_b = nil.astype(_BF16)
  nb_s[...] = nil_b
  plgpu.commit_smem()
  nil2 = mma.product(full, [(_Regs(nil_b), nb_s)])           # N^2
  nb_s[...] = nil2.astype(_BF16)
  plgpu.commit_smem()
  nil3 = mma.product(full, [(_Regs(nil_b), nb_s)])           # N^3
  eye = jnp.where(_iota(full, 0) == _iota(full, 1), 1.0, 0.0)
  poly = (eye - nil + nil2 - nil3).astype(_BF16)
  m_val = mma.product(full, [(_Regs(poly), db_s)])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)           # A_qk has left a_s
  a_s[...] = m_val.astype(_BF16)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(a_s, m_ref.at[b, h, tok])
  plgpu.wait_smem_to_gmem(0)


def _state_body(cfg: _Config, save: bool, qd_ref, kd_ref, kg_ref, aqk_ref, m_ref, dec_ref, v_ref,
                beta_ref, h0_ref, o_ref, final_ref, *rest):
  """The serial pass over chunks for one (value block, head, batch) (Eqs. 8-9); with `save`
  it also writes S_n entering every chunk and V_new (for the backward)."""
  h_ref, vn_ref = rest[:2] if save else (None, None)
  qd_s, kd_s, kg_s, aqk_s, m_s, v_s, dec_s, beta_s, s_s, x_s, o_s, bars, *stage = rest[
      2 if save else 0:]
  c, kd, bv = CHUNK, cfg.key_dim, cfg.block_v
  vt, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
  vcols = pl.ds(vt * bv, bv)
  mma = _Mma(cfg, stage)

  tok = lambda n: pl.ds(n * c, c)
  copies = [(lambda n: qd_ref.at[b, h, tok(n)], qd_s), (lambda n: kd_ref.at[b, h, tok(n)], kd_s),
            (lambda n: kg_ref.at[b, h, tok(n)], kg_s),
            (lambda n: aqk_ref.at[b, h, tok(n)], aqk_s), (lambda n: m_ref.at[b, h, tok(n)], m_s),
            (lambda n: v_ref.at[b, tok(n), h, vcols], v_s), (lambda n: dec_ref.at[b, h, n], dec_s),
            (lambda n: beta_ref.at[b, h, tok(n)], beta_s)]

  s0 = _load(h0_ref.at[b, h, :, vcols])
  s_s[...] = s0.astype(_BF16)

  def step(n, slot, s):
    if save:
      h_ref.at[b, h, n, :, vcols][...] = s
    bv_init = _load(v_s.at[slot]).astype(_F32) * _rows(_load(beta_s.at[slot], _ROW), (c, bv))
    decay = _rows(_load(dec_s.at[slot], _ROW), (kd, bv))
    x, o_part = mma.products(((c, bv), [(kd_s.at[slot], s_s)], bv_init),
                             ((c, bv), [(qd_s.at[slot], s_s)], None))
    x_s[...] = x.astype(_BF16)
    plgpu.commit_smem()
    v_new = mma.product((c, bv), [(m_s.at[slot], x_s)]).astype(_BF16)
    x_s[...] = v_new
    plgpu.commit_smem()
    if save:
      vn_ref.at[b, h, tok(n), vcols][...] = v_new
    o, s = mma.products(((c, bv), [(aqk_s.at[slot], x_s)], o_part),
                        ((kd, bv), [(kg_s.at[slot].T, x_s)], decay * s))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # the previous output left o_s
    o_s[...] = o.astype(_BF16)
    s_s[...] = s.astype(_BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(n * c, c), h, vcols])
    return s

  s = _walk(cfg.num_chunks, copies, bars, step, s0)
  final_ref.at[b, h, :, vcols][...] = s
  plgpu.wait_smem_to_gmem(0)


_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                               approx_math=True)


def _stage(cfg: _Config) -> list[plgpu.SMEM]:
  return [_operand((CHUNK, HALF)), _operand((CHUNK, CHUNK))] if cfg.interpret else []


def intra_kernel(q, k, g, beta, counts, cfg: _Config, interpret):
  """Kernel 1 on `prepare`d inputs: (Q_d, -K_d, K_g, A_qk, M, e^{G_C})."""
  b, t, h, kd = q.shape
  c = CHUNK
  tok_k = jax.ShapeDtypeStruct((b, h, t, kd), _BF16)
  tok_c = jax.ShapeDtypeStruct((b, h, t, c), _BF16)
  intra = plgpu.kernel(
      functools.partial(_intra_body, cfg),
      out_type=(tok_k, tok_k, tok_k, tok_c, tok_c,
                jax.ShapeDtypeStruct((b, h, cfg.num_chunks, kd), _F32)),
      scratch_types=[
          _operand((c, kd)), _operand((c, kd)),
          plgpu.RefUnion(plgpu.SMEM((c, kd), _F32),
                         (plgpu.SMEM((c, c), _F32), plgpu.SMEM((c, TILE), _F32))),
          plgpu.RefUnion(_operand((c, kd)), (_operand((c, c)), _operand((c, c)))),
          _operand((c, kd)), _operand((c, c)),
          plgpu.SMEM((c,), _F32), plgpu.SMEM((c,), _F32),
          plgpu.Barrier(num_arrivals=5 if cfg.has_segments else 4),
          *_stage(cfg)],
      grid=(cfg.num_chunks, h, b), grid_names=("n", "h", "b"),
      compiler_params=_PARAMS, interpret=interpret, kernel_name="kda_intra_mosaic_gpu")
  return intra(q, k, g, beta, counts)


def state_kernel(qd, kdn, kg, aqk, m, dec, v, beta, h0, cfg: _Config, interpret,
                 save: bool = False):
  """Kernel 2: (o [B, T, H, V] bf16, final state [B, H, K, V] fp32), and with `save` the
  backward's walk outputs: S_n entering every chunk fp32 [B, H, N, K, V] and V_new bf16
  [B, H, T, V] (`mosaic_gpu_bwd.states_kernel`'s, spared in the backward)."""
  b, t, h, dv = v.shape
  kd, c, bv = cfg.key_dim, CHUNK, cfg.block_v
  saved = [jax.ShapeDtypeStruct((b, h, cfg.num_chunks, kd, dv), _F32),
           jax.ShapeDtypeStruct((b, h, t, dv), _BF16)] if save else []
  state = plgpu.kernel(
      functools.partial(_state_body, cfg, save),
      out_type=(jax.ShapeDtypeStruct((b, t, h, dv), _BF16),
                jax.ShapeDtypeStruct((b, h, kd, dv), _F32), *saved),
      scratch_types=[
          _operand((2, c, kd)), _operand((2, c, kd)), _operand((2, c, kd)),
          _operand((2, c, c)), _operand((2, c, c)), _operand((2, c, bv)),
          plgpu.SMEM((2, kd), _F32), plgpu.SMEM((2, c), _F32),
          _operand((kd, bv)), _operand((c, bv)), _operand((c, bv)),
          plgpu.Barrier(num_arrivals=8, num_barriers=2),
          *_stage(cfg)],
      grid=(dv // bv, h, b), grid_names=("v", "h", "b"),
      compiler_params=_PARAMS, interpret=interpret, kernel_name="kda_state_mosaic_gpu")
  return state(qd, kdn, kg, aqk, m, dec, v, beta, h0)


def segment_counts(segment_ids: jax.Array, pad: int) -> jax.Array:
  """[B, T + pad] fp32: segment starts so far inside each 64-token chunk."""
  ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
  resets = reference.segment_resets(ids).astype(jnp.int32)
  b, t = resets.shape
  counts = jnp.cumsum(resets.reshape(b, t // CHUNK, CHUNK), axis=-1)
  return counts.reshape(b, t).astype(_F32)


def prepare(q, k, v, g, beta, initial_state, segment_ids) -> tuple[jax.Array, ...]:
  """XLA side of `forward`: the kernels' inputs from the API's.

  Zero-pads T to a multiple of 64 (g = beta = 0 leaves the state unchanged);
  returns bf16 q, k; g in fp32 (its chunk-local cumsum G unless K = 128, where
  the intra kernel scans it); bf16 v; beta [B, H, T]; segment counts [B, T]; h0.
  """
  b, t, h, kd = q.shape
  dv = v.shape[-1]
  pad = -t % CHUNK
  n = (t + pad) // CHUNK

  def padded(x, dtype):
    if pad == 0:
      return x.astype(dtype)
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x.astype(dtype), widths)

  gp = padded(g, _F32)
  if kd != SCAN_DIM:
    gp = jnp.cumsum(gp.reshape(b, n, CHUNK, h, kd), axis=2).reshape(gp.shape)
  if segment_ids is None:
    counts = jnp.zeros((b, n * CHUNK), _F32)
  else:
    counts = segment_counts(segment_ids, pad)
  if initial_state is None:
    h0 = jnp.zeros((b, h, kd, dv), _F32)
  else:
    h0 = initial_state.astype(_F32)
  return (padded(q, _BF16), padded(k, _BF16), gp, padded(v, _BF16),
          jnp.swapaxes(padded(beta, _F32), 1, 2), counts, h0)


def pick_block_v(b: int, h: int, dv: int) -> int:
  """32 value columns per state-kernel CTA when 64 would leave SMs idle (B=1, T=8192, H=32:
  0.56 ms against 0.62 ms), else 64 (less repeated reading of the shared key-side tiles)."""
  return 32 if b * h * (dv // BLOCK_V) < NUM_SMS else BLOCK_V


def config(q, segment_ids, *, scale: float, interpret=False, block_v: int = BLOCK_V,
           normalize_qk: bool = False):
  """(static kernel config, interpret argument) for inputs like q [B, T, H, K]."""
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  cfg = _Config(num_chunks=-(-q.shape[1] // CHUNK), key_dim=q.shape[-1], scale=scale,
                has_segments=segment_ids is not None, interpret=bool(interpret),
                block_v=block_v, normalize_qk=normalize_qk)
  return cfg, interpret or None


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_v", "normalize_qk",
                                             "return_saved"))
def forward(q, k, v, g, beta, initial_state, segment_ids, *, scale: float, interpret=False,
            block_v: int = BLOCK_V, normalize_qk: bool = False, return_saved: bool = False):
  """`prepare` and the kernels: (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32).

  `interpret`: False (compile for the GPU), True or a `plgpu.InterpretGPUParams`.
  `block_v`: value columns per CTA of the state kernel (32 or 64).
  `normalize_qk`: L2-normalise q and k inside the intra kernel (`reference.l2_normalize`).
  `return_saved`: also return what the kernel backward reuses instead of recomputing it
  (`mosaic_gpu_bwd.Saved`): the intra kernel's outputs, S_n and V_new.
  """
  cfg, interp = config(q, segment_ids, scale=scale, interpret=interpret, block_v=block_v,
                       normalize_qk=normalize_qk)
  qp, kp, gp, vp, beta_t, counts, h0 = prepare(q, k, v, g, beta, initial_state, segment_ids)
  parts = intra_kernel(qp, kp, gp, beta_t, counts, cfg, interp)
  o, s, *walk = state_kernel(*parts, vp, beta_t, h0, cfg, interp, save=return_saved)
  o = o[:, :q.shape[1]].astype(q.dtype)
  return (o, s, mosaic_gpu_bwd.Saved(parts, *walk)) if return_saved else (o, s)


def _kernel_backward(parts: str):
  """`mosaic_gpu_bwd.backward` as a `kernel_vjp` backward; options (scale, normalize_qk,
  interpret, block_v, name); `saved`: the forward's `mosaic_gpu_bwd.Saved` or None."""
  def bwd(q, k, v, g, beta, h0, segment_ids, d_o, d_s, options, saved):
    scale, normalize_qk, interpret, block_v, _ = options
    return mosaic_gpu_bwd.backward(q, k, v, g, beta, h0, segment_ids, d_o, d_s, scale=scale,
                                   interpret=interpret, block_v=block_v, parts=parts,
                                   saved=saved, normalize_qk=normalize_qk)
  return bwd


def _forward(q, k, v, g, beta, h0, segment_ids, options, return_saved=False):
  return forward(q, k, v, g, beta, h0, segment_ids, scale=options[0], normalize_qk=options[1],
                 interpret=options[2], block_v=options[3], return_saved=return_saved)


def _forward_saving(q, k, v, g, beta, h0, segment_ids, options):
  """The forward, keeping the intra kernel's outputs, S_n and V_new for
  backward="kernel_intra"."""
  if options[-1] != "kernel_intra":
    return _forward(q, k, v, g, beta, h0, segment_ids, options), None
  o, s, saved = _forward(q, k, v, g, beta, h0, segment_ids, options, return_saved=True)
  return (o, s), saved


_kda = kernel_vjp.kernel_op(
    _forward, {"kernel": _kernel_backward("xla"), "kernel_intra": _kernel_backward("kernel")},
    GATE_BOUND, forward_saving=_forward_saving, normalizing=("kernel_intra",))


def chunk_kda_mosaic_gpu(q, k, v, g, beta, *, scale: float | None = None,
                         initial_state: jax.Array | None = None, output_final_state: bool = False,
                         segment_ids: jax.Array | None = None, interpret=False,
                         block_v: int | None = None, backward: str = "kernel_intra",
                         use_qk_l2norm_in_kernel: bool = False
                         ) -> tuple[jax.Array, jax.Array | None]:
  """`api.chunk_kda` semantics on the Hopper kernels (bounded gate g >= -5 assumed).

  Args:
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] natural-log decay in
      [-5, 0]; beta [B, T, H]; initial_state [B, H, K, V]; segment_ids [B, T].
    scale: defaults to K**-0.5.
    interpret: False on a Hopper GPU; True or a `plgpu.InterpretGPUParams` to run
      the kernel in the Mosaic GPU interpreter (CPU tests).
    block_v: value columns per CTA of the serial kernel, 64 or 32 (more CTAs
      for small B * H); None picks with `pick_block_v`.
    backward: "kernel_intra" (default: `mosaic_gpu_bwd.backward(parts="kernel")`, Mosaic GPU
      state walks, the chunk-parallel part and its VJP all in kernels), "kernel" (the same walks
      with the chunk-parallel part and its VJP as batched XLA einsums) or "chunked" (VJP of the
      chunked JAX tier, fp32 HIGHEST).
    use_qk_l2norm_in_kernel: q and k are raw; the intra kernel L2-normalises their rows
      (`reference.l2_normalize`, fla's flag of the same name).

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).
  """
  reason = supports(q, k, v, g, beta, gate_bound=GATE_BOUND)
  if reason is not None:
    raise ValueError(f"chunk_kda_mosaic_gpu: {reason}")
  if block_v is None:
    block_v = pick_block_v(q.shape[0], q.shape[2], v.shape[-1])
  if block_v not in (32, 64):
    raise ValueError(f"block_v must be None, 32 or 64, got {block_v!r}")
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  scale, h0 = reference.scale_and_state(q, v, scale, initial_state)
  o, s = _kda(q, k, v, g, beta, h0, segment_ids,
              (scale, bool(use_qk_l2norm_in_kernel), interpret, block_v, backward))
  return o, (s if output_final_state else None)
