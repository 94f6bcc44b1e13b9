"""Chunkwise KDA forward as one fused Pallas Mosaic GPU kernel for Hopper (report Eqs. 2-9).

Same contract as `api.chunk_kda` (fla layouts, see api.py) for the bounded
gate g >= -5 (K3's `gate_lower_bound`, kda.md §2.2); `supports` says when.

One CTA (one warpgroup) per (value block of 64 columns, head, batch) walks the
chunks of C = 64 tokens in order and carries the state S [K, 64] in fp32
registers (a bf16 copy in SMEM is the tensor-core operand). Per chunk:
  * TMA loads q, k [C, K] and v [C, 64] (bf16), G [C, K] (fp32 chunk-local
    cumsum of g, from XLA), its rows 15, 31, 47, 63, beta and the segment
    counts; the next chunk's loads are issued once this chunk's are read, so
    they overlap the solve and the state update.
  * Intra-chunk products on the tensor cores (bf16 operands, fp32 accumulation),
    with decays factorised inside 32-token halves through their middle token m
    (15 or 47): x_r e^{G_r - G_m} . k_c e^{G_m - G_c}; with g >= -5 every
    exponent is within [-80, 80], inside the fp32/bf16 range. The lower-left
    32 x 32 block goes through token 31: x_r e^{G_r - G_31} . k_c e^{G_31 - G_c},
    both exponents <= 0 (an underflow there is a true underflow). This gives
    A_qk (causal) and L = StrictTril(diag(beta) K_d K_i^T) (Eq. 6 inputs).
  * UT transform M = (I + L)^{-1}: the four 16 x 16 diagonal blocks inverted
    exactly in fp32 by forward substitution (Dinv), then with N = Dinv L_off
    (nilpotent, N^4 = 0), M = (I - N + N^2 - N^3) Dinv by four bf16 tensor-core
    products (fp32 accumulation).
  * V_new = M (diag(beta) V - K_d S), O = Q_d S + A_qk V_new,
    S' = Diag(e^{G_C}) S + K_g^T V_new (Eqs. 8-9, the WY products folded into
    the solve, as FlashKDA).
Segments (segment_ids) mask A_qk and L to one segment, Q_d and K_d to the
chunk's first segment, K_g to its last, and drop the carried state when a
segment starts inside the chunk (as chunked.py).

Backward: NOT a kernel. `chunk_kda_mosaic_gpu` is a `jax.custom_vjp` whose
backward is the VJP of the chunked JAX tier (`chunked.chunk_kda` with
gate_bound -5), which recomputes its own per-chunk states (fp32, exact).

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

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference

GATE_BOUND = -5.0
CHUNK = 64
HALF = 32                  # factorisation block; also the K-slab width of the passes
TILE = 16                  # diagonal blocks inverted exactly
BLOCK_V = 64               # value columns per CTA
HEAD_DIMS = (64, 128)
MARKS = (15, 31, 47, 63)   # rows of G each chunk needs as per-channel vectors

_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)       # one value per row of a WGMMA-layout array
_COL = _WG.reduce(0)       # one value per column
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def supports(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             segment_ids=None, gate_bound=None) -> str | None:
  """None if the kernel handles the call, else why not (the dispatcher falls through)."""
  del scale, initial_state, output_final_state, segment_ids, k, g, beta
  if gate_bound is None or gate_bound < GATE_BOUND:
    return f"needs gate_bound >= {GATE_BOUND} (bounded gate), got {gate_bound}"
  if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
    return f"needs K, V in {HEAD_DIMS}, got K={q.shape[-1]}, V={v.shape[-1]}"
  if jnp.dtype(q.dtype) not in (jnp.dtype(_BF16), jnp.dtype(_F32)):
    return f"needs bfloat16 or float32 inputs, got {q.dtype}"
  if q.shape[0] * q.shape[2] > 65535:
    return f"needs B * H <= 65535 (CUDA grid), got {q.shape[0] * q.shape[2]}"
  return None


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static shapes and options of one kernel call."""
  num_chunks: int
  key_dim: int
  scale: float
  has_segments: bool
  interpret: bool


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


def _kernel_body(cfg: _Config, q_ref, k_ref, v_ref, g_ref, marks_ref, beta_ref, cnt_ref, h0_ref,
                 o_ref, final_ref, q_s, k_s, v_s, g_s, marks_s, beta_s, cnt_s, kmid_s, k31_s,
                 kg_s, aqk_s, m_s, s_s, x_s, o_s, tri_s, asm_s, nb_s, db_s, bar_in, *stage):
  c, kd, bv = CHUNK, cfg.key_dim, BLOCK_V
  slabs = kd // HALF
  vt, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
  vcols = pl.ds(vt * bv, bv)
  half = (c, HALF)

  def wgmma(acc, a, b_ref):
    """acc += a @ b_ref; a is an SMEM ref or `_Regs` (staged through SMEM when interpreting)."""
    if isinstance(a, _Regs):
      if cfg.interpret:
        buf = stage[0] if a.value.shape[1] == HALF else stage[1]
        buf[...] = a.value
        plgpu.commit_smem()
        a = buf
      else:
        a = a.value
    plgpu.wgmma(acc, a, b_ref)

  def product(shape, pairs, init=None) -> jax.Array:
    """init + sum(a @ b for a, b in pairs), fp32."""
    if init is None or cfg.interpret:
      def scoped(acc):
        for a, b_ref in pairs:
          wgmma(acc, a, b_ref)
        return acc[...]
      out = pl.run_scoped(scoped, plgpu.ACC(shape, _F32))
      out = out if init is None else out + init
    else:
      def body(acc):
        for a, b_ref in pairs:
          wgmma(acc, a, b_ref)
      out = pl.run_state(body)(plgpu.ACC.init(init))
    # Reading an accumulator waits for the wgmma without a data dependency;
    # the barrier keeps arithmetic on the result after that wait.
    return lax.optimization_barrier(out)

  def fetch(n):
    tok = pl.ds(n * c, c)
    plgpu.copy_gmem_to_smem(q_ref.at[b, tok, h], q_s, bar_in)
    plgpu.copy_gmem_to_smem(k_ref.at[b, tok, h], k_s, bar_in)
    plgpu.copy_gmem_to_smem(v_ref.at[b, tok, h, vcols], v_s, bar_in)
    plgpu.copy_gmem_to_smem(g_ref.at[b, tok, h], g_s, bar_in)
    plgpu.copy_gmem_to_smem(marks_ref.at[b, pl.ds(n * len(MARKS), len(MARKS)), h], marks_s,
                            bar_in)
    plgpu.copy_gmem_to_smem(beta_ref.at[b, h, tok], beta_s, bar_in)
    if cfg.has_segments:
      plgpu.copy_gmem_to_smem(cnt_ref.at[b, tok], cnt_s, bar_in)

  row = _iota(half, 0)
  col = _iota(half, 1)
  second = row >= HALF                     # rows of the chunk's second half
  row_tile = row // TILE

  def intra_pass(beta, first, last):
    """Pass 1 over 32-channel slabs: the decayed products of the chunk (fp32 [C, 32] each).

    Returns (A_qk, L) as left/right column halves, masked; writes the B
    operands kmid_s, k31_s and K_g (kg_s).
    """
    def scoped(*accs):
      for slab in range(slabs):
        cols = pl.ds(slab * HALF, HALF)
        m15, m31, m47, m63 = (_cols(_load(marks_s.at[i, cols], _COL), half) for i in range(4))
        g = _load(g_s.at[:, cols])
        d = g - jnp.where(second, m47, m15)
        k = _load(k_s.at[:, cols]).astype(_F32)
        q = _load(q_s.at[:, cols]).astype(_F32) * cfg.scale
        kmid_s.at[:, cols][...] = (k * jnp.exp(-d)).astype(_BF16)
        t31 = jnp.exp(jnp.where(second, g - m31, m31 - g))
        k31_s.at[:, cols][...] = jnp.where(second, 0.0, k * t31).astype(_BF16)
        kg = k * jnp.exp(m63 - g)
        kg_s.at[:, cols][...] = (kg if last is None else kg * last).astype(_BF16)
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
          wgmma(accs[3 * fam], ops[fam], left)
          wgmma(accs[3 * fam + 1], ops[fam], right)
          wgmma(accs[3 * fam + 2], ops[2 + fam], low)
        plgpu.wgmma_wait(0)
      return [acc[...] for acc in accs]

    parts = pl.run_scoped(scoped, *[plgpu.ACC(half, _F32) for _ in range(6)])
    parts = lax.optimization_barrier(parts)
    col_r = col + HALF
    same_l = same_r = None
    if cfg.has_segments:
      cnt_row = _rows(_load(cnt_s, _ROW), half)
      same_l = cnt_row == _cols(_load(cnt_s.at[pl.ds(0, HALF)], _COL), half)
      same_r = cnt_row == _cols(_load(cnt_s.at[pl.ds(HALF, HALF)], _COL), half)
    out = []
    for fam in range(2):
      p_left, p_right, p_low = parts[3 * fam:3 * fam + 3]
      keep_l = second | ((row >= col) if fam == 0 else (row > col))
      keep_r = second & ((row >= col_r) if fam == 0 else (row > col_r))
      if cfg.has_segments:
        keep_l &= same_l
        keep_r &= same_r
      left = jnp.where(keep_l, jnp.where(second, p_low, p_left), 0.0)
      right = jnp.where(keep_r, p_right, 0.0)
      out.append((left, right))
    return out

  def state_pass(beta, first, bv_init):
    """Pass 2 over slabs: (Q_d S, diag(beta) V - K_d S) with the entering state in s_s."""
    def scoped(acc_o, acc_x):
      for slab in range(slabs):
        cols = pl.ds(slab * HALF, HALF)
        eg = jnp.exp(_load(g_s.at[:, cols]))
        if first is not None:
          eg = eg * first
        q = _load(q_s.at[:, cols]).astype(_F32) * cfg.scale
        k = _load(k_s.at[:, cols]).astype(_F32)
        s_rows = s_s.at[cols]
        wgmma(acc_o, _Regs((q * eg).astype(_BF16)), s_rows)
        wgmma(acc_x, _Regs((-(k * beta) * eg).astype(_BF16)), s_rows)
        plgpu.wgmma_wait(0)
      return acc_o[...], acc_x[...]

    o_part, x = pl.run_scoped(scoped, plgpu.ACC((c, bv), _F32), plgpu.ACC((c, bv), _F32))
    o_part, x = lax.optimization_barrier((o_part, x))
    return o_part, x + bv_init

  def solve(lower):
    """M = (I + L)^{-1} (Eq. 6) into m_s, from L as fp32 [C, 32] column halves."""
    l_left, l_right = lower
    tcol = _iota((c, TILE), 1)
    trow = _iota((c, TILE), 0)
    tblock = trow // TILE
    offset = trow % TILE
    asm_s.at[:, pl.ds(0, HALF)][...] = l_left
    asm_s.at[:, pl.ds(HALF, HALF)][...] = l_right
    # N's right operand: L with its diagonal 16 x 16 blocks removed (bf16).
    nb_s.at[:, pl.ds(0, HALF)][...] = jnp.where(row_tile == col // TILE, 0.0, l_left).astype(_BF16)
    nb_s.at[:, pl.ds(HALF, HALF)][...] = jnp.where(row_tile == col // TILE + 2, 0.0,
                                                   l_right).astype(_BF16)
    plgpu.commit_smem()
    # Diagonal blocks stacked [C, 16]: a[r, j] = L[r, 16 * block(r) + j].
    a_diag = None
    for blk in range(c // TILE):
      part = _load(asm_s.at[:, pl.ds(TILE * blk, TILE)])
      a_diag = part if a_diag is None else jnp.where(tblock == blk, part, a_diag)
    # Forward substitution: after step j, row j of every block's inverse is final.
    inv = jnp.where(tcol == offset, 1.0, 0.0)
    tri_s[...] = inv
    plgpu.commit_smem()
    for j in range(TILE - 1):
      pivot = None
      for blk in range(c // TILE):
        part = _cols(_load(tri_s.at[TILE * blk + j], _COL), (c, TILE))
        pivot = part if pivot is None else jnp.where(tblock == blk, part, pivot)
      coef = _rows(jnp.sum(jnp.where(tcol == j, a_diag, 0.0), axis=1), (c, TILE))
      inv = jnp.where(offset > j, inv - coef * pivot, inv)
      tri_s[...] = inv
      plgpu.commit_smem()
    # Block-diagonal Dinv [C, C]: fp32 assembly, then bf16 operands.
    for blk in range(c // TILE):
      asm_s.at[:, pl.ds(TILE * blk, TILE)][...] = jnp.where(tblock == blk, inv, 0.0)
    plgpu.commit_smem()
    d_inv = _load(asm_s).astype(_BF16)
    db_s[...] = d_inv
    plgpu.commit_smem()
    full = (c, c)
    nil = product(full, [(_Regs(d_inv), nb_s)])                  # N = Dinv L_off
    nil_b = nil.astype(_BF16)
    nb_s[...] = nil_b
    plgpu.commit_smem()
    nil2 = product(full, [(_Regs(nil_b), nb_s)])                 # N^2
    nb_s[...] = nil2.astype(_BF16)
    plgpu.commit_smem()
    nil3 = product(full, [(_Regs(nil_b), nb_s)])                 # N^3
    eye = jnp.where(_iota(full, 0) == _iota(full, 1), 1.0, 0.0)
    poly = (eye - nil + nil2 - nil3).astype(_BF16)
    m_s[...] = product(full, [(_Regs(poly), db_s)]).astype(_BF16)

  s0 = _load(h0_ref.at[b, h, :, vcols])
  s_s[...] = s0.astype(_BF16)
  fetch(0)

  def step(n, s):
    plgpu.barrier_wait(bar_in)
    beta_vec = _load(beta_s, _ROW)
    beta = _rows(beta_vec, half)
    if cfg.has_segments:
      cnt_vec = _load(cnt_s, _ROW)
      cnt_last = cnt_s[c - 1]
      first = _rows(jnp.where(cnt_vec == 0.0, 1.0, 0.0), half)
      last = _rows(jnp.where(cnt_vec == cnt_last, 1.0, 0.0), half)
      carry = jnp.where(cnt_last == 0.0, 1.0, 0.0)
    else:
      first = last = None
      carry = 1.0
    decay = _rows(jnp.exp(_load(marks_s.at[len(MARKS) - 1], _ROW)) * carry, (kd, bv))
    bv_init = _load(v_s).astype(_F32) * _rows(beta_vec, (c, bv))
    (aqk_l, aqk_r), lower = intra_pass(beta, first, last)
    aqk_s.at[:, pl.ds(0, HALF)][...] = aqk_l.astype(_BF16)
    aqk_s.at[:, pl.ds(HALF, HALF)][...] = aqk_r.astype(_BF16)
    o_part, x = state_pass(beta, first, bv_init)
    plgpu.commit_smem()                    # every read of this chunk's inputs is done

    @pl.when(n + 1 < cfg.num_chunks)
    def _():
      fetch(n + 1)

    x_s[...] = x.astype(_BF16)
    solve(lower)
    plgpu.commit_smem()
    v_new = product((c, bv), [(m_s, x_s)])
    x_s[...] = v_new.astype(_BF16)
    plgpu.commit_smem()
    o = product((c, bv), [(aqk_s, x_s)], init=o_part)
    s = product((kd, bv), [(kg_s.T, x_s)], init=decay * s)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # the previous output left o_s
    o_s[...] = o.astype(o_s.dtype)
    s_s[...] = s.astype(_BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(n * c, c), h, vcols])
    return s

  s = lax.fori_loop(0, cfg.num_chunks, step, s0)
  final_ref.at[b, h, :, vcols][...] = s
  plgpu.wait_smem_to_gmem(0)


def _forward_padded(q, k, v, g_cum, marks, beta, counts, h0, cfg: _Config, interpret):
  """The kernel on padded, prepared inputs (see `forward`)."""
  b, t, h, kd = q.shape
  dv = v.shape[-1]
  c = CHUNK
  scratch = [
      _operand((c, kd)), _operand((c, kd)), _operand((c, BLOCK_V)),
      plgpu.SMEM((c, kd), _F32, transforms=(plgpu.TilingTransform((8, 32)),
                                            plgpu.SwizzleTransform(128))),
      plgpu.SMEM((len(MARKS), kd), _F32), plgpu.SMEM((c,), _F32), plgpu.SMEM((c,), _F32),
      _operand((c, kd)), _operand((c, kd)), _operand((c, kd)),       # kmid, k31, kg
      _operand((c, c)), _operand((c, c)),                             # A_qk, M
      _operand((kd, BLOCK_V)), _operand((c, BLOCK_V)), _operand((c, BLOCK_V)),  # S, X/V_new, O
      plgpu.SMEM((c, TILE), _F32), plgpu.SMEM((c, c), _F32),          # pivots, assembly
      _operand((c, c)), _operand((c, c)),                             # N operand, Dinv
      plgpu.Barrier(num_arrivals=7 if cfg.has_segments else 6),
  ]
  if cfg.interpret:
    scratch += [_operand((c, HALF)), _operand((c, c))]
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, cfg),
      out_type=(jax.ShapeDtypeStruct((b, t, h, dv), _BF16),
                jax.ShapeDtypeStruct((b, h, kd, dv), _F32)),
      scratch_types=scratch,
      grid=(dv // BLOCK_V, h, b),
      grid_names=("v", "h", "b"),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                           approx_math=True),
      interpret=interpret,
      kernel_name="kda_fwd_mosaic_gpu",
  )
  return kernel(q, k, v, g_cum, marks, beta, counts, h0)


def segment_counts(segment_ids: jax.Array, pad: int) -> jax.Array:
  """[B, T + pad] fp32: segment starts so far inside each 64-token chunk."""
  ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
  resets = reference.segment_resets(ids).astype(jnp.int32)
  b, t = resets.shape
  counts = jnp.cumsum(resets.reshape(b, t // CHUNK, CHUNK), axis=-1)
  return counts.reshape(b, t).astype(_F32)


def prepare(q, k, v, g, beta, initial_state, segment_ids) -> tuple[jax.Array, ...]:
  """XLA side of `forward`: the kernel's inputs from the API's.

  Zero-pads T to a multiple of 64 (g = beta = 0 leaves the state unchanged);
  returns bf16 q, k, v; the fp32 chunk-local cumsum G of g [B, T, H, K] and its
  rows `MARKS` [B, 4 N, H, K]; beta [B, H, T]; segment counts [B, T]; h0.
  """
  b, t, h, kd = q.shape
  dv = v.shape[-1]
  pad = -t % CHUNK
  n = (t + pad) // CHUNK

  def padded(x, dtype):
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x.astype(dtype), widths)

  qp, kp, vp = (padded(x, _BF16) for x in (q, k, v))
  g_cum = jnp.cumsum(padded(g, _F32).reshape(b, n, CHUNK, h, kd), axis=2)
  marks = g_cum[:, :, MARKS].reshape(b, n * len(MARKS), h, kd)
  g_cum = g_cum.reshape(b, n * CHUNK, h, kd)
  beta_t = jnp.swapaxes(padded(beta, _F32), 1, 2)
  if segment_ids is None:
    counts = jnp.zeros((b, n * CHUNK), _F32)
  else:
    counts = segment_counts(segment_ids, pad)
  if initial_state is None:
    h0 = jnp.zeros((b, h, kd, dv), _F32)
  else:
    h0 = initial_state.astype(_F32)
  return qp, kp, vp, g_cum, marks, beta_t, counts, h0


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def forward(q, k, v, g, beta, initial_state, segment_ids, *, scale: float,
            interpret=False) -> tuple[jax.Array, jax.Array]:
  """`prepare` and the kernel: (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32).

  `interpret`: False (compile for the GPU), True or a `plgpu.InterpretGPUParams`.
  """
  t = q.shape[1]
  args = prepare(q, k, v, g, beta, initial_state, segment_ids)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  cfg = _Config(num_chunks=args[0].shape[1] // CHUNK, key_dim=q.shape[-1], scale=scale,
                has_segments=segment_ids is not None, interpret=bool(interpret))
  o, s = _forward_padded(*args, cfg, interpret or None)
  return o[:, :t].astype(q.dtype), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kda(q, k, v, g, beta, h0, segment_ids, scale, interpret):
  return forward(q, k, v, g, beta, h0, segment_ids, scale=scale, interpret=interpret)


def _kda_fwd(q, k, v, g, beta, h0, segment_ids, scale, interpret):
  out = forward(q, k, v, g, beta, h0, segment_ids, scale=scale, interpret=interpret)
  return out, (q, k, v, g, beta, h0, segment_ids)


def _kda_bwd(scale, interpret, res, cot):
  """VJP of the chunked JAX tier (recomputes its states; see module doc)."""
  del interpret
  q, k, v, g, beta, h0, segment_ids = res

  def f(q, k, v, g, beta, h0):
    o, s = chunked.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                             segment_ids=segment_ids, gate_bound=GATE_BOUND)
    return o, s.astype(_F32)

  _, vjp = jax.vjp(f, q, k, v, g, beta, h0)
  return (*vjp(cot), None)


_kda.defvjp(_kda_fwd, _kda_bwd)


def chunk_kda_mosaic_gpu(q, k, v, g, beta, *, scale: float | None = None,
                         initial_state: jax.Array | None = None, output_final_state: bool = False,
                         segment_ids: jax.Array | None = None,
                         interpret=False) -> tuple[jax.Array, jax.Array | None]:
  """`api.chunk_kda` semantics on the fused Hopper kernel (bounded gate g >= -5 assumed).

  Args:
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] natural-log decay in
      [-5, 0]; beta [B, T, H]; initial_state [B, H, K, V]; segment_ids [B, T].
    scale: defaults to K**-0.5.
    interpret: False on a Hopper GPU; True or a `plgpu.InterpretGPUParams` to run
      the kernel in the Mosaic GPU interpreter (CPU tests).

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).
  """
  reason = supports(q, k, v, g, beta, gate_bound=GATE_BOUND)
  if reason is not None:
    raise ValueError(f"chunk_kda_mosaic_gpu: {reason}")
  if scale is None:
    scale = q.shape[-1] ** -0.5
  h0 = initial_state
  if h0 is None:
    h0 = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), _F32)
  o, s = _kda(q, k, v, g, beta, h0.astype(_F32), segment_ids, float(scale), interpret)
  return o, (s if output_final_state else None)
