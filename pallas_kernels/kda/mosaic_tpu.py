"""Chunkwise KDA forward as one Pallas Mosaic TPU kernel (Kimi Linear report Eqs. 2-9).

Same contract as `api.chunk_kda` (fla layouts, module docstring of api.py) for
the bounded gate g >= -5 (K3's `gate_lower_bound`, kda.md §2.2).

Kernel: grid (B, H, N) over batch, head and chunks of C = 64 (or 128) tokens;
B and H are "parallel", the chunk axis is "arbitrary" (sequential), and the
state S [K, V] fp32 lives in a VMEM scratch carried from chunk to chunk. Per
chunk, with g the chunk's log-decay and every decay computed from g by exact
0/1 matmuls (HIGHEST precision), never from a difference of two large cumsums:
  G = Tril g (inclusive cumsum),   G_C - G = StrictTriu g,
  D_j = G - G_{a_j}  for the anchor a_j = 16 j + 7 of 16-token tile j,
  A[r, c] = sum_j (x_r e^{D_j[r]}) . (k_c e^{-D_j[c]}),  c in tile j, r >= 16 j
for x = scale q (A_qk, causal) and x = beta k (L, strict). Inside tile j both
exponents are at most 8 * 5 = 40 nats (the FlashKDA 16-token factorisation);
for rows below tile j, D_j <= 0. Rows above tile j and keys outside it are
masked before the exp, so nothing overflows for g >= -5.
UT transform (Eq. 6), all matmuls: with Ld the 16 x 16 diagonal tiles of L,
  Dinv = (I + Ld)^{-1} = (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8),
  N = Dinv (L - Ld),  M = (I + L)^{-1} = (I - N)(I + N^2)[(I + N^4)] Dinv.
State step (Eqs. 8-9, the WY products folded into one solve):
  V_new = M (diag(beta) V - K_d S),  O = Q_d S + A_qk V_new,
  S' = Diag(e^{G_C}) S + K_g^T V_new.
Segments: a chunk-local reset count per token masks A_qk and L to one segment,
Q_d and K_d to the chunk's first segment, K_g to its last, and zeroes the
carried state when a segment starts inside the chunk (as chunked.py).

Precision: the decay matmuls and the solve run in fp32 (HIGHEST); the state
matmuls take operands in the input dtype (bf16 inputs: bf16 operands, fp32
accumulation).

Backward: `chunk_kda_mosaic_tpu` is a `jax.custom_vjp`. backward="chunked"
(default) is the VJP of the chunked JAX tier (`chunked.chunk_kda`, gate_bound
-5), which recomputes its own per-chunk states; gradients are exact (fp32).
backward="kernel" (`backward`, fla's recompute scheme, as `mosaic_gpu_bwd`), in
fp32 on 64-token chunks of `chunked.chunk_parts` (Q_d, W, U, K_g, A_qk, d = e^{G_C}):
  1. `states_kernel`, grid (B, H, N), chunks "arbitrary", S [K, V] in a VMEM
     scratch: writes S_n entering every chunk, S_{n+1} = Diag(d) S_n + K_g^T (U - W S_n).
  2. `dstates_kernel`, same grid with the chunk index reversed by the index_map,
     dS = dL/dS_{n+1} [K, V] in a VMEM scratch:
       dV_new = A_qk^T dO + K_g dS,   dS_n = Diag(d) dS + Q_d^T dO - W^T dV_new,
     writing dV_new and every dS; the last dS_0 is d initial_state.
  3. XLA, batched einsums over chunks (no scan): dQ_d = dO S_n^T,
     dW = -dV_new S_n^T, dU = dV_new, dA_qk = dO V_new^T, dK_g = V_new dS^T,
     dd = rowsum(S_n * dS), then the VJP of `chunked.chunk_parts`.
Extra memory: S_n and dS, fp32 [B, H, N, K, V] each.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels.kda import chunked
from pallas_kernels.kda import kernel_vjp
from pallas_kernels.kda import reference

GATE_BOUND = -5.0
TILE = 16
CHUNK_SIZES = (64, 128)
HEAD_DIMS = (64, 128)
BACKWARDS = ("chunked", "kernel")
_HIGHEST = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))   # a @ b^T
_TN = (((0,), (0,)), ((), ()))   # a^T @ b


def supports(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             segment_ids=None, gate_bound=None, chunk_size: int = 64) -> str | None:
  """None if the kernel handles the call, else why not (the dispatcher falls through)."""
  del scale, initial_state, output_final_state, segment_ids, k, beta
  if gate_bound is None or gate_bound < GATE_BOUND:
    return f"needs gate_bound >= {GATE_BOUND} (bounded gate), got {gate_bound}"
  if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
    return f"needs K, V in {HEAD_DIMS}, got K={q.shape[-1]}, V={v.shape[-1]}"
  dtypes = {jnp.dtype(x.dtype) for x in (q, v)}
  if not dtypes <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}:
    return f"needs float32 or bfloat16 q, k, v, got {sorted(map(str, dtypes))}"
  if jnp.dtype(g.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    return f"needs float32 or bfloat16 g, got {g.dtype}"
  if chunk_size not in CHUNK_SIZES:
    return f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}"
  return None


def _dot(a, b, dims=None, precision=_HIGHEST):
  if dims is None:
    dims = (((1,), (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, cnt_ref, h0_ref, o_ref, sfin_ref, s_ref, *,
            scale: float, chunk: int, mm_dtype, has_segments: bool):
  """One chunk of one (batch, head); refs are [C, K], [C, V], [C, 1], [K, V] blocks."""
  c = chunk
  nt = c // TILE
  n = pl.program_id(2)
  f32 = jnp.float32
  mm_precision = _HIGHEST if mm_dtype == jnp.float32 else jax.lax.Precision.DEFAULT

  def mm(a, b, dims=None):
    return _dot(a.astype(mm_dtype), b.astype(mm_dtype), dims, mm_precision)

  @pl.when(n == 0)
  def _():
    s_ref[...] = h0_ref[...]

  q = q_ref[...].astype(f32)
  k = k_ref[...].astype(f32)
  v = v_ref[...].astype(f32)
  g = g_ref[...].astype(f32)
  beta = beta_ref[...]                                     # [C, 1]
  s = s_ref[...]

  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  causal = row >= col
  strict = row > col
  eye = (row == col).astype(f32)
  same_tile = (row // TILE) == (col // TILE)
  if has_segments:
    cnt = cnt_ref[...]                                     # [C, 1] resets so far in the chunk
    # [r, c] = cnt_c (column vector to rows, exactly, through an NT matmul).
    cnt_cols = _dot((col == 0).astype(f32), jnp.where(col == 0, cnt, 0.0), _NT)
    same = cnt == cnt_cols
    causal &= same
    strict &= same
    first = cnt == 0.0
    last = cnt == cnt[c - 1:c, :]
    whole = cnt[c - 1:c, :] == 0.0                          # [1, 1]

  # Exact decays from g (0/1 matmuls): G, G_C - G and G_C broadcast to [K, V].
  g_cum = _dot(causal_ones := (row >= col).astype(f32), g)
  g_to_end = _dot((col > row).astype(f32), g)
  g_last = _dot(g, jnp.ones((c, v.shape[-1]), f32), _TN)          # [K, V], every column G_C

  # Intra-chunk products, one anchor per 16-token column tile (see module doc).
  p_qk = jnp.zeros((c, c), f32)
  p_kk = jnp.zeros((c, c), f32)
  for j in range(nt):
    anchor = TILE * j + TILE // 2 - 1
    d_j = _dot(causal_ones - (col <= anchor).astype(f32), g)   # G - G_{a_j}
    rows_in = (row[:, :1] >= TILE * j)                     # [C, 1]: rows at/after tile j
    keys_in = (row[:, :1] // TILE) == j                    # [C, 1]: keys of tile j
    e_row = jnp.exp(jnp.where(rows_in, d_j, 0.0))
    k_j = jnp.where(keys_in, k * jnp.exp(jnp.where(keys_in, -d_j, 0.0)), 0.0)
    p_qk += _dot(jnp.where(rows_in, (scale * q) * e_row, 0.0), k_j, _NT)
    p_kk += _dot(jnp.where(rows_in, (beta * k) * e_row, 0.0), k_j, _NT)
  a_qk = jnp.where(causal, p_qk, 0.0)
  lower = jnp.where(strict, p_kk, 0.0)

  # UT transform M = (I + L)^{-1} (report Eq. 6) by nilpotent products.
  l_diag = jnp.where(same_tile, lower, 0.0)
  d_inv, power = eye - l_diag, l_diag
  for _ in range(3):                                       # Ld^16 = 0
    power = _dot(power, power)
    d_inv = d_inv + _dot(d_inv, power)
  nil = _dot(d_inv, lower - l_diag)                        # N, nilpotent of index nt
  m_inv, power = eye - nil, nil
  for _ in range(nt.bit_length() - 2):                     # N^nt = 0
    power = _dot(power, power)
    m_inv = m_inv + _dot(m_inv, power)
  m_inv = _dot(m_inv, d_inv)

  # State step (Eqs. 8-9).
  e_cum = jnp.exp(g_cum)
  k_d = beta * k * e_cum
  q_d = scale * q * e_cum
  k_g = k * jnp.exp(g_to_end)
  decay = jnp.exp(g_last)
  if has_segments:
    k_d = jnp.where(first, k_d, 0.0)
    q_d = jnp.where(first, q_d, 0.0)
    k_g = jnp.where(last, k_g, 0.0)
    decay = jnp.where(whole, decay, 0.0)
  rhs = beta * v - mm(k_d, s)
  v_new = mm(m_inv, rhs)
  o = mm(q_d, s) + mm(a_qk, v_new)
  s_next = decay * s + mm(k_g, v_new, _TN)
  o_ref[...] = o.astype(o_ref.dtype)
  s_ref[...] = s_next

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    sfin_ref[...] = s_next


def _head_major(x: jax.Array, pad: int) -> jax.Array:
  """[B, T, H, ...] -> [B, H, T + pad, ...] zero-padded in time."""
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.moveaxis(jnp.pad(x, widths), 2, 1)


def segment_counts(segment_ids: jax.Array, pad: int, chunk: int) -> jax.Array:
  """[B, T + pad] fp32: segment starts so far inside each chunk (0 = the entering segment)."""
  ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
  resets = reference.segment_resets(ids).astype(jnp.int32)
  b, t = resets.shape
  counts = jnp.cumsum(resets.reshape(b, t // chunk, chunk), axis=-1)
  return counts.reshape(b, t).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret"))
def forward(q, k, v, g, beta, initial_state, segment_ids, *, scale: float, chunk_size: int = 64,
            interpret=False) -> tuple[jax.Array, jax.Array]:
  """The kernel alone: (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32)."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  c = chunk_size
  pad = -t % c
  n = (t + pad) // c
  mm_dtype = jnp.bfloat16 if jnp.bfloat16 in (q.dtype, k.dtype, v.dtype) else jnp.float32
  qh, kh, vh = (_head_major(x, pad) for x in (q, k, v))
  gh = _head_major(g.astype(jnp.float32), pad)
  bh = _head_major(beta.astype(jnp.float32), pad)[..., None]            # [B, H, Tp, 1]
  has_segments = segment_ids is not None
  if has_segments:
    cnt = segment_counts(segment_ids, pad, c)[..., None]                # [B, Tp, 1]
  else:
    cnt = jnp.zeros((b, t + pad, 1), jnp.float32)
  if initial_state is None:
    h0 = jnp.zeros((b, h, dk, dv), jnp.float32)
  else:
    h0 = initial_state.astype(jnp.float32)

  def tok(width):
    return pl.BlockSpec((None, None, c, width), lambda ib, ih, i: (ib, ih, i, 0))

  state = pl.BlockSpec((None, None, dk, dv), lambda ib, ih, i: (ib, ih, 0, 0))
  kernel = functools.partial(_kernel, scale=scale, chunk=c, mm_dtype=mm_dtype,
                             has_segments=has_segments)
  o, s = pl.pallas_call(
      kernel,
      grid=(b, h, n),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                pl.BlockSpec((None, c, 1), lambda ib, ih, i: (ib, i, 0)), state],
      out_specs=[tok(dv), state],
      out_shape=[jax.ShapeDtypeStruct((b, h, t + pad, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="kda_chunk_fwd",
  )(qh, kh, vh, gh, bh, cnt, h0)
  return jnp.moveaxis(o, 1, 2)[:, :t], s


def _states_kernel(w_ref, u_ref, kg_ref, dec_ref, h0_ref, h_ref, s_ref):
  """Forward walk, one chunk of one (batch, head): stores S_n, then steps S (Eqs. 8-9)."""
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    s_ref[...] = h0_ref[...]

  s = s_ref[...]
  h_ref[...] = s
  v_new = u_ref[...] - _dot(w_ref[...], s)
  s_ref[...] = dec_ref[...] * s + _dot(kg_ref[...], v_new, _TN)


def _dstates_kernel(qd_ref, w_ref, kg_ref, aqk_ref, dec_ref, do_ref, dsf_ref,
                    dvn_ref, ds_ref, dh0_ref, acc_ref, *, num_chunks: int):
  """Reverse walk, chunk N-1-i of one (batch, head): dV_new, dS = dL/dS_{n+1}, dS_n.

  N is a bound Python int, not `pl.num_programs`: Pallas may reuse a traced
  kernel body for another grid with the same block shapes.
  """
  i = pl.program_id(2)

  @pl.when(i == 0)
  def _():
    acc_ref[...] = dsf_ref[...]

  ds = acc_ref[...]
  ds_ref[...] = ds
  do = do_ref[...]
  dvn = _dot(aqk_ref[...], do, _TN) + _dot(kg_ref[...], ds)
  dvn_ref[...] = dvn
  ds_prev = dec_ref[...] * ds + _dot(qd_ref[...], do, _TN) - _dot(w_ref[...], dvn, _TN)
  acc_ref[...] = ds_prev

  @pl.when(i == num_chunks - 1)
  def _():
    dh0_ref[...] = ds_prev


def _walk_call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret, name):
  """A serial chunk walk: grid (B, H, N), chunks "arbitrary", one fp32 VMEM scratch."""
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(scratch, jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret, name=name)


def states_kernel(w, u, kg, dec, h0, interpret) -> jax.Array:
  """Backward kernel 1: S_n [B, H, N, K, V] fp32 entering every chunk.

  w, kg [B, H, N*C, K]; u [B, H, N*C, V]; dec [B, H, N, K, 1]; h0 [B, H, K, V]; all fp32.
  """
  b, h, n, dk, _ = dec.shape
  dv = u.shape[-1]
  c = chunked.CHUNK

  def tok(width):
    return pl.BlockSpec((None, None, c, width), lambda ib, ih, i: (ib, ih, i, 0))

  per_chunk = pl.BlockSpec((None, None, None, dk, dv), lambda ib, ih, i: (ib, ih, i, 0, 0))
  return _walk_call(
      _states_kernel, (b, h, n),
      [tok(dk), tok(dv), tok(dk),
       pl.BlockSpec((None, None, None, dk, 1), lambda ib, ih, i: (ib, ih, i, 0, 0)),
       pl.BlockSpec((None, None, dk, dv), lambda ib, ih, i: (ib, ih, 0, 0))],
      per_chunk, jax.ShapeDtypeStruct((b, h, n, dk, dv), jnp.float32), (dk, dv), interpret,
      "kda_states_tpu")(w, u, kg, dec, h0)


def dstates_kernel(qd, w, kg, aqk, dec, do, dsf, interpret):
  """Backward kernel 2: (dV_new [B, H, N*C, V], dS [B, H, N, K, V], dS_0 [B, H, K, V]).

  qd, w, kg [B, H, N*C, K]; aqk [B, H, N*C, C]; dec [B, H, N, K, 1]; do [B, H, N*C, V];
  dsf = dL/d(final state) [B, H, K, V]; all fp32. dS[n] is dL/dS_{n+1}.
  """
  b, h, n, dk, _ = dec.shape
  dv = do.shape[-1]
  c = chunked.CHUNK

  def tok(width):
    return pl.BlockSpec((None, None, c, width), lambda ib, ih, i: (ib, ih, n - 1 - i, 0))

  state = pl.BlockSpec((None, None, dk, dv), lambda ib, ih, i: (ib, ih, 0, 0))
  return _walk_call(
      functools.partial(_dstates_kernel, num_chunks=n), (b, h, n),
      [tok(dk), tok(dk), tok(dk), tok(c),
       pl.BlockSpec((None, None, None, dk, 1), lambda ib, ih, i: (ib, ih, n - 1 - i, 0, 0)),
       tok(dv), state],
      [tok(dv), pl.BlockSpec((None, None, None, dk, dv),
                             lambda ib, ih, i: (ib, ih, n - 1 - i, 0, 0)), state],
      [jax.ShapeDtypeStruct((b, h, n * c, dv), jnp.float32),
       jax.ShapeDtypeStruct((b, h, n, dk, dv), jnp.float32),
       jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
      (dk, dv), interpret, "kda_dstates_tpu")(qd, w, kg, aqk, dec, do, dsf)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def backward(q, k, v, g, beta, h0, segment_ids, d_o, d_final, *, scale: float,
             interpret=False) -> tuple[jax.Array, ...]:
  """Gradients (dq, dk, dv, dg, dbeta, dh0) of (o, final state) given their cotangents.

  Args:
    q, k, v, g, beta, segment_ids: the forward's inputs (fla layouts); h0 [B, H, K, V] fp32.
    d_o [B, T, H, V]; d_final [B, H, K, V].
    scale, interpret: as in `forward`.
  """
  f32 = jnp.float32
  parts, parts_vjp = jax.vjp(
      functools.partial(chunked.chunk_parts, scale=scale, segment_ids=segment_ids,
                        gate_bound=GATE_BOUND, dt=f32), q, k, v, g, beta)
  qd, w, u, kg, aqk, dec = parts
  b, h, n, c, _ = qd.shape

  def tokens(x):
    return x.reshape(b, h, n * c, x.shape[-1])

  dec_col = dec[..., None]
  s_in = states_kernel(tokens(w), tokens(u), tokens(kg), dec_col, h0.astype(f32), interpret)
  do_p = chunked._pad_time(d_o.astype(f32), n * c - q.shape[1])
  dvn, ds, dh0 = dstates_kernel(tokens(qd), tokens(w), tokens(kg), tokens(aqk), dec_col,
                                jnp.moveaxis(do_p, 2, 1), d_final.astype(f32), interpret)
  dvn = dvn.reshape(b, h, n, c, -1)
  doc = chunked._to_chunks(do_p)
  d_parts = chunked.chunk_parts_cotangents(w, u, s_in, ds, dvn, doc)
  return (*parts_vjp(d_parts), dh0.astype(h0.dtype))


def _kernel_backward(q, k, v, g, beta, h0, segment_ids, d_o, d_s, options, saved):
  """`backward` as a `kernel_vjp` backward; options (scale, False, chunk_size, interpret,
  name); nothing saved."""
  del saved
  return backward(q, k, v, g, beta, h0, segment_ids, d_o, d_s, scale=options[0],
                  interpret=options[3])


_kda = kernel_vjp.kernel_op(
    lambda q, k, v, g, beta, h0, segment_ids, options: forward(
        q, k, v, g, beta, h0, segment_ids, scale=options[0], chunk_size=options[2],
        interpret=options[3]),
    {"kernel": _kernel_backward}, GATE_BOUND)


def chunk_kda_mosaic_tpu(q, k, v, g, beta, *, scale: float | None = None,
                         initial_state: jax.Array | None = None, output_final_state: bool = False,
                         segment_ids: jax.Array | None = None, chunk_size: int = 64,
                         interpret=False,
                         backward: str = "chunked") -> tuple[jax.Array, jax.Array | None]:
  """`api.chunk_kda` semantics on the Mosaic TPU kernel (bounded gate g >= -5 assumed).

  Args:
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] natural-log decay in
      [-5, 0]; beta [B, T, H]; initial_state [B, H, K, V]; segment_ids [B, T].
    scale: defaults to K**-0.5.
    chunk_size: 64 or 128 tokens per grid step.
    interpret: False on a TPU; True or `pltpu.InterpretParams()` elsewhere.
    backward: "chunked" (default: VJP of the chunked JAX tier) or "kernel"
      (Mosaic TPU state walks plus batched XLA einsums, see module doc).

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).
  """
  reason = supports(q, k, v, g, beta, gate_bound=GATE_BOUND, chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"chunk_kda_mosaic_tpu: {reason}")
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  scale, h0 = reference.scale_and_state(q, v, scale, initial_state)
  o, s = _kda(q, k, v, g, beta, h0, segment_ids, (scale, False, chunk_size, interpret, backward))
  return o, (s if output_final_state else None)
