"""Chunkwise-parallel KDA in plain JAX (Kimi Linear report Eqs. 2-9 and §6.2).

Per chunk of C = 64 tokens (split into 16-token tiles), with G the chunk-local
inclusive cumsum of g, S the state entering the chunk and q pre-scaled:
  A_kk[r, j] = beta_r sum_c k_rc k_jc e^{G_rc - G_jc}   (j < r)      L = A_kk
  A_qk[r, j] =        sum_c q_rc k_jc e^{G_rc - G_jc}   (j <= r)
  W = (I + L)^{-1} diag(beta) (K * e^G),   U = (I + L)^{-1} diag(beta) V    (Eq. 7)
  V_new = U - W S,   O = (Q * e^G) S + A_qk V_new,
  S' = e^{G_C} * S + (K * e^{G_C - G})^T V_new                               (Eqs. 8-9)
Only `S' <- ...` is sequential (`lax.scan` over chunks).

Decay factors e^{G_r - G_j} of the intra-chunk matrices:
  * off-diagonal tile pairs (row tile i > column tile): anchored at the first row
    n of tile i, (q_r e^{G_r - G_n}) . (k_j e^{G_n - G_j}); both exponents are
    <= 0, so this is exact for any g <= 0 (an underflowed factor means the
    true product underflows too).
  * diagonal 16 x 16 tiles, `gate_bound` given (g >= gate_bound >= -5, the K3
    gate): factorised around the tile's middle row m, (q_r e^{G_r - G_m}) .
    (k_j e^{G_m - G_j}); each exponent is at most 8 * 5 = 40 nats and every
    product (the masked acausal ones included) at most 15 * 5 = 75 nats, inside
    fp32's range (88.7). All tile work is matmuls.
  * diagonal tiles, `gate_bound=None` (any g <= 0, e.g. Kimi Linear's softplus
    gate with g = -1000): pairwise e^{G_r - G_j} per channel, a [16, 16, K]
    tensor per tile; exponents are <= 0 so nothing overflows.
All inter-chunk factors (e^G, e^{G_C - G}, e^{G_C}) are <= 1. The exponents
come from one fp32 cumsum, so a decay's relative error is about |G| * 2^-24.
To keep |G| small after outliers (g = -1000), the safe path raises g to
LOG_DECAY_FLOOR = -30 first: a surviving factor e^-30 ~ 1e-13 is below fp32
resolution relative to the state, and the gradient of such a g is ~e^g ~ 0.

(I + L)^{-1} (the UT transform, Eq. 6) is applied to [diag(beta) K e^G | diag(beta) V]
without forming it: the 16 x 16 diagonal tiles of I + L are inverted by a
batched unit-triangular solve, and the tiles are combined by block forward
substitution X_i = (I + L_ii)^{-1} (B_i - sum_{m<i} L_im X_m), written as three
full-chunk sweeps (`_ut_solve`).

Segments: a token that starts a segment resets the state, which makes the
intra-chunk matrices block-diagonal by segment; the entering state reaches only
the chunk's first segment and the carried-out state holds only its last segment
(masks `same`, `first`, `last` below; exact, no -inf gates).

T not a multiple of 64 is padded with k = q = v = 0, g = 0, beta = 0 (the state
passes through unchanged) and the output sliced.

Backward: plain JAX autodiff through this function. It is exact (the derivative
of the same algebra; the tests match fp64 gradients to ~1e-6) and finite
wherever the forward is: every `exp` argument is either made <= 0 by a
`jnp.where` before the `exp` or, on the bounded path, at most 40, so no inf
appears in either pass. A hand-written VJP (fla's recompute scheme, kda.md
§2.3) would save memory, not accuracy; it belongs to the Pallas tiers. Autodiff
keeps the per-chunk states [N, B, H, K, V] of the scan as residuals, like fla's h.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference

CHUNK = 64
TILE = 16
MIN_GATE_BOUND = -5.0
LOG_DECAY_FLOOR = -30.0
_HIGHEST = jax.lax.Precision.HIGHEST


def _pad_time(x: jax.Array, pad: int, mode: str = "constant") -> jax.Array:
  """Pads axis 1 (time) at the end by `pad`."""
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, mode=mode)


def _to_chunks(x: jax.Array) -> jax.Array:
  """[B, T, H, ...] -> [B, H, N, C, ...]."""
  b, t, h = x.shape[:3]
  x = x.reshape(b, t // CHUNK, CHUNK, h, *x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def _segment_masks(segment_ids: jax.Array, n: int):
  """Masks from [B, T_padded] ids: same [B,1,N,C,C], first/last [B,1,N,C], whole [B,1,N]."""
  resets = reference.segment_resets(segment_ids).reshape(-1, 1, n, CHUNK)
  count = jnp.cumsum(resets.astype(jnp.int32), axis=-1)
  same = count[..., :, None] == count[..., None, :]
  first = count == 0
  last = count == count[..., -1:]
  whole = count[..., -1] == 0
  return same, first, last, whole


def _intra_chunk(rows: jax.Array, k: jax.Array, G: jax.Array,
                 gate_bound: float | None, dt: jnp.dtype, precision=_HIGHEST) -> jax.Array:
  """sum_c rows_rc k_jc e^{G_rc - G_jc} for all (r, j) of a chunk, exact where j <= r.

  Args:
    rows: [R, B, H, N, C, K] (R row operands sharing k and G); k, G: [B, H, N, C, K].
    gate_bound: None (pairwise diagonal tiles) or a bound >= -5 (factorised).
    dt: accumulation dtype.
    precision: of the einsums (HIGHEST: full fp32).

  Returns:
    [R, B, H, N, C, C]; entries with j > r are unspecified (the caller masks).
  """
  nt = CHUNK // TILE
  kdim = k.shape[-1]
  rows_t = rows.reshape(*rows.shape[:-2], nt, TILE, kdim)
  k_t = k.reshape(*k.shape[:-2], nt, TILE, kdim)
  g_t = G.reshape(*G.shape[:-2], nt, TILE, kdim)
  pos = jnp.arange(CHUNK)

  # Off-diagonal tile pairs: anchor at the first row n_i of row tile i.
  g_anchor = g_t[..., :, :1, :]                                      # [..., nt, 1, K]
  rows_off = rows_t * jnp.exp(g_t - g_anchor)
  before = pos[None, :] < (TILE * jnp.arange(nt))[:, None]           # [nt, C]: j < n_i
  expo = jnp.where(before[:, :, None], g_anchor - G[..., None, :, :], 0)
  k_off = k[..., None, :, :] * jnp.exp(expo)                          # [..., nt, C, K]
  a_off = jnp.einsum("...itk,...ijk->...itj", rows_off, k_off,
                     precision=precision, preferred_element_type=dt)

  # Diagonal tiles.
  if gate_bound is None:
    causal = jnp.tril(jnp.ones((TILE, TILE), bool))
    diff = jnp.where(causal[:, :, None], g_t[..., :, None, :] - g_t[..., None, :, :], 0)
    a_diag = jnp.einsum("...irk,...isk,...irsk->...irs", rows_t, k_t, jnp.exp(diff),
                        precision=precision, preferred_element_type=dt)
  else:
    g_mid = g_t[..., TILE // 2:TILE // 2 + 1, :]
    a_diag = jnp.einsum("...irk,...isk->...irs", rows_t * jnp.exp(g_t - g_mid),
                        k_t * jnp.exp(g_mid - g_t),
                        precision=precision, preferred_element_type=dt)

  a_diag = jnp.einsum("ij,...irs->...irjs", jnp.eye(nt, dtype=dt), a_diag)
  a_diag = a_diag.reshape(*a_diag.shape[:-4], CHUNK, CHUNK)
  a_off = a_off.reshape(*a_off.shape[:-3], CHUNK, CHUNK)
  same_tile = (pos[:, None] // TILE) == (pos[None, :] // TILE)
  return jnp.where(same_tile, a_diag, a_off)


def _ut_solve(lower: jax.Array, rhs: jax.Array, precision=_HIGHEST) -> jax.Array:
  """(I + lower)^{-1} rhs for strictly lower-triangular lower [..., C, C] (Eq. 6).

  With D the block diagonal of I + lower (16 x 16 tiles, inverted by a batched
  unit-triangular solve) and N = D^{-1} (off-diagonal tiles of lower), the
  solution of x = D^{-1} rhs - N x is reached by C/16 - 1 sweeps of that
  update: block forward substitution, written as full-chunk matmuls.
  """
  nt = CHUNK // TILE
  eye = jnp.eye(TILE, dtype=lower.dtype)
  rows = lower.reshape(*lower.shape[:-2], nt, TILE, CHUNK)            # [..., nt, 16, C]
  diag = jnp.moveaxis(jnp.diagonal(rows.reshape(*rows.shape[:-1], nt, TILE),
                                   axis1=-4, axis2=-2), -1, -3)      # [..., nt, 16, 16]
  inv = jax.lax.linalg.triangular_solve(
      eye + diag, jnp.broadcast_to(eye, diag.shape), left_side=True, lower=True,
      unit_diagonal=True)
  off_diag = (jnp.arange(nt)[:, None] != jnp.arange(CHUNK)[None, :] // TILE)[:, None, :]
  n_mat = jnp.einsum("...irs,...isj->...irj", inv, jnp.where(off_diag, rows, 0),
                     precision=precision).reshape(lower.shape)
  y = jnp.einsum("...irs,...isx->...irx", inv,
                 rhs.reshape(*rhs.shape[:-2], nt, TILE, rhs.shape[-1]),
                 precision=precision).reshape(rhs.shape)
  x = y
  for _ in range(nt - 1):
    x = y - jnp.einsum("...rj,...jx->...rx", n_mat, x, precision=precision)
  return x


def chunk_parts(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                scale: float, segment_ids: jax.Array | None, gate_bound: float | None,
                dt, precision=_HIGHEST) -> tuple[jax.Array, ...]:
  """The chunk-parallel half of chunkwise KDA (report Eqs. 2-7), no scan, in `dt`.

  `precision` of the einsums: HIGHEST (full fp32, the chunked tier) or DEFAULT (TF32 tensor
  cores on GPUs for fp32 operands; the kernel backwards).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; segment_ids [B, T] or None.

  Returns:
    Q_d, W [B, H, N, C, K]; U [B, H, N, C, V]; K_g [B, H, N, C, K]; A_qk [B, H, N, C, C];
    chunk decay [B, H, N, K]; T zero-padded to N * C. Segment masks are already applied.
  """
  t, dk = q.shape[1], q.shape[-1]
  pad = -t % CHUNK
  n = (t + pad) // CHUNK
  qc, kc, vc, gc, bc = (_to_chunks(_pad_time(x.astype(dt), pad)) for x in (q, k, v, g, beta))
  if gate_bound is None:
    gc = jnp.maximum(gc, LOG_DECAY_FLOOR)
  G = jnp.cumsum(gc, axis=-2)                                          # [B, H, N, C, K]
  g_last = G[..., -1, :]                                               # [B, H, N, K]

  pos = jnp.arange(CHUNK)
  rows = jnp.stack([qc * scale, bc[..., None] * kc])
  a_qk, a_kk = _intra_chunk(rows, kc, G, gate_bound, dt, precision)
  a_qk = jnp.where(pos[:, None] >= pos[None, :], a_qk, 0)
  a_kk = jnp.where(pos[:, None] > pos[None, :], a_kk, 0)
  k_decayed = bc[..., None] * kc * jnp.exp(G)
  q_decayed = qc * scale * jnp.exp(G)
  k_to_end = kc * jnp.exp(g_last[..., None, :] - G)
  chunk_decay = jnp.exp(g_last)
  if segment_ids is not None:
    same, first, last, whole = _segment_masks(_pad_time(segment_ids, pad, "edge"), n)
    a_qk = jnp.where(same, a_qk, 0)
    a_kk = jnp.where(same, a_kk, 0)
    k_decayed = jnp.where(first[..., None], k_decayed, 0)
    q_decayed = jnp.where(first[..., None], q_decayed, 0)
    k_to_end = jnp.where(last[..., None], k_to_end, 0)
    chunk_decay = jnp.where(whole[..., None], chunk_decay, 0)
  wu = _ut_solve(a_kk, jnp.concatenate([k_decayed, bc[..., None] * vc], axis=-1), precision)
  return q_decayed, wu[..., :dk], wu[..., dk:], k_to_end, a_qk, chunk_decay


def _intra_chunk_vjp(rows: jax.Array, k: jax.Array, G: jax.Array, d_a: jax.Array,
                     gate_bound: float | None, precision) -> tuple[jax.Array, ...]:
  """VJP of `_intra_chunk` for causally masked cotangents, with its decay anchoring.

  For P_rj = sum_c x_rc k_jc e^{G_rc - G_jc} and dP = d_a (zero where j > r):
  dx_rc = sum_j dP_rj k_jc e^{G_rc - G_jc}, dk_jc = sum_r dP_rj x_rc e^{G_rc - G_jc}, evaluated
  with the forward's anchors, and dG = sum_R x * dx - k * dk.

  Args:
    rows: [R, B, H, N, C, K]; k, G: [B, H, N, C, K]; d_a: [R, B, H, N, C, C].

  Returns:
    (d_rows [R, B, H, N, C, K], d_k [B, H, N, C, K], d_G [B, H, N, C, K]).
  """
  nt = CHUNK // TILE
  shape_t = lambda x: x.reshape(*x.shape[:-2], nt, TILE, x.shape[-1])
  rows_t, k_t, g_t = shape_t(rows), shape_t(k), shape_t(G)
  pos = jnp.arange(CHUNK)
  same_tile = (pos[:, None] // TILE) == (pos[None, :] // TILE)
  d_off = shape_t(jnp.where(same_tile, 0, d_a))                       # [R, ..., nt, 16, C]
  d_diag = jnp.diagonal(shape_t(d_a).reshape(*d_a.shape[:-2], nt, TILE, nt, TILE),
                        axis1=-4, axis2=-2)                          # [R, ..., 16, 16, nt]
  d_diag = jnp.moveaxis(d_diag, -1, -3)                               # [R, ..., nt, 16, 16]

  g_anchor = g_t[..., :, :1, :]
  before = pos[None, :] < (TILE * jnp.arange(nt))[:, None]
  decay_off = jnp.exp(jnp.where(before[:, :, None], g_anchor - G[..., None, :, :], 0))
  rows_off = rows_t * jnp.exp(g_t - g_anchor)
  d_rows = jnp.exp(g_t - g_anchor) * jnp.einsum(
      "...itj,...ijk->...itk", d_off, k[..., None, :, :] * decay_off, precision=precision)
  d_k = jnp.sum(decay_off * jnp.einsum("z...itj,z...itk->...ijk", d_off, rows_off,
                                       precision=precision), axis=-3)

  if gate_bound is None:
    causal = jnp.tril(jnp.ones((TILE, TILE), bool))
    pair = jnp.exp(jnp.where(causal[:, :, None], g_t[..., :, None, :] - g_t[..., None, :, :], 0))
    d_rows_diag = jnp.einsum("...irs,...isk,...irsk->...irk", d_diag, k_t, pair,
                             precision=precision)
    d_k_diag = jnp.einsum("z...irs,z...irk,...irsk->...isk", d_diag, rows_t, pair,
                          precision=precision)
  else:
    g_mid = g_t[..., TILE // 2:TILE // 2 + 1, :]
    up, down = jnp.exp(g_t - g_mid), jnp.exp(g_mid - g_t)
    d_rows_diag = up * jnp.einsum("...irs,...isk->...irk", d_diag, k_t * down,
                                  precision=precision)
    d_k_diag = down * jnp.einsum("z...irs,z...irk->...isk", d_diag, rows_t * up,
                                 precision=precision)
  d_rows = (d_rows + d_rows_diag).reshape(rows.shape)
  d_k = d_k.reshape(k.shape) + d_k_diag.reshape(k.shape)
  d_g = jnp.sum(rows * d_rows, axis=0) - k * d_k
  return d_rows, d_k, d_g


def chunk_parts_vjp(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    m: jax.Array, cotangents: tuple[jax.Array, ...], *, scale: float,
                    segment_ids: jax.Array | None, gate_bound: float | None,
                    precision=_HIGHEST) -> tuple[jax.Array, ...]:
  """Hand-written VJP of `chunk_parts` (>= fp32), given M = (I + L)^{-1} [B, H, N, C, C].

  With the UT transform's inverse given (from the forward kernel, or `_ut_solve(L, I)`), no
  triangular solve runs: dM = dW K_d^T + dU (beta V)^T, dL = -M^T dM M^T, dK_d = M^T dW,
  d(beta V) = M^T dU; the intra-chunk matrices go through `_intra_chunk_vjp`; the decays' G
  gradients are summed and turned into dg by a reverse cumsum within the chunk (G = cumsum g).

  Returns:
    (dq, dk, dv, dg, dbeta) in the inputs' shapes and dtypes.
  """
  f32 = jnp.promote_types(q.dtype, jnp.float32)
  d_qd, d_w, d_u, d_kg, d_aqk, d_dec = (x.astype(f32) for x in cotangents)
  t = q.shape[1]
  pad = -t % CHUNK
  n = (t + pad) // CHUNK
  qc, kc, vc, gc, bc = (_to_chunks(_pad_time(x.astype(f32), pad)) for x in (q, k, v, g, beta))
  floor_grad = None
  if gate_bound is None:
    floor_grad = gc > LOG_DECAY_FLOOR
    gc = jnp.maximum(gc, LOG_DECAY_FLOOR)
  G = jnp.cumsum(gc, axis=-2)
  g_last = G[..., -1:, :]
  pos = jnp.arange(CHUNK)
  causal = pos[:, None] >= pos[None, :]
  strict = pos[:, None] > pos[None, :]
  ones = jnp.ones(qc.shape[:-1], bool)
  same, first, last, whole = causal, ones, ones, ones[..., 0]
  if segment_ids is not None:
    same, first, last, whole = _segment_masks(_pad_time(segment_ids, pad, "edge"), n)
    same = jnp.logical_and(same, causal)
  first, last = first[..., None], last[..., None]
  m = m.astype(f32)
  e_g = jnp.exp(G)
  k_decayed = jnp.where(first, bc[..., None] * kc * e_g, 0)
  beta_v = bc[..., None] * vc
  e_to_end = jnp.exp(g_last - G)

  mt = jnp.swapaxes(m, -1, -2)
  mm = lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b, precision=precision)
  d_m = (jnp.einsum("...ck,...jk->...cj", d_w, k_decayed, precision=precision)
         + jnp.einsum("...cv,...jv->...cj", d_u, beta_v, precision=precision))
  d_kd = mm(mt, d_w)
  d_beta_v = mm(mt, d_u)
  d_l = -mm(mm(mt, d_m), mt)
  d_a = jnp.stack([jnp.where(same, d_aqk, 0),                       # same is causal already
                   jnp.where(jnp.logical_and(same, strict), d_l, 0)])
  rows = jnp.stack([qc * scale, bc[..., None] * kc])
  d_rows, d_kc, d_G = _intra_chunk_vjp(rows, kc, G, d_a, gate_bound, precision)

  d_qc = scale * d_rows[0] + jnp.where(first, scale * e_g * d_qd, 0)
  d_kc = (d_kc + bc[..., None] * d_rows[1] + jnp.where(first, bc[..., None] * e_g * d_kd, 0)
          + jnp.where(last, e_to_end * d_kg, 0))
  d_bc = (jnp.sum(kc * d_rows[1], axis=-1) + jnp.sum(jnp.where(first, kc * e_g * d_kd, 0), -1)
          + jnp.sum(vc * d_beta_v, axis=-1))
  d_vc = bc[..., None] * d_beta_v
  k_to_end = jnp.where(last, kc * e_to_end, 0)
  d_G = (d_G + jnp.where(first, qc * scale * e_g * d_qd + k_decayed * d_kd, 0)
         - k_to_end * d_kg)
  d_g_last = (jnp.sum(k_to_end * d_kg, axis=-2)
              + jnp.where(whole[..., None], jnp.exp(g_last[..., 0, :]) * d_dec, 0))
  d_G = d_G.at[..., -1, :].add(d_g_last)
  d_gc = jnp.flip(jnp.cumsum(jnp.flip(d_G, -2), axis=-2), -2)
  if floor_grad is not None:
    d_gc = jnp.where(floor_grad, d_gc, 0)

  def unchunk(x, like):
    b, h = x.shape[:2]
    x = jnp.moveaxis(x, 1, 3).reshape(b, n * CHUNK, h, *x.shape[4:])
    return x[:, :t].astype(like.dtype)
  return (unchunk(d_qc, q), unchunk(d_kc, k), unchunk(d_vc, v), unchunk(d_gc, g),
          unchunk(d_bc, beta))


def chunk_parts_cotangents(w, u, s_in, d_s, d_v_new, d_o,
                           precision=_HIGHEST) -> tuple[jax.Array, ...]:
  """Cotangents of `chunk_parts`' outputs from the state walks of a kernel backward.

  With V_new = U - W S, O = Q_d S + A_qk V_new and S' = e^{G_C} S + K_g^T V_new per chunk:
  s_in [B, H, N, K, V] the state entering each chunk, d_s the gradient of the state leaving
  it, d_v_new [B, H, N, C, V] (A_qk^T dO + K_g dS', from the reverse walk), d_o [B, H, N, C, V].
  Returns (dQ_d, dW, dU, dK_g, dA_qk, d chunk decay), in `chunk_parts`' order.
  """
  v_new = u - jnp.einsum("bhnck,bhnkv->bhncv", w, s_in, precision=precision)
  return (jnp.einsum("bhncv,bhnkv->bhnck", d_o, s_in, precision=precision),
          -jnp.einsum("bhncv,bhnkv->bhnck", d_v_new, s_in, precision=precision),
          d_v_new,
          jnp.einsum("bhncv,bhnkv->bhnck", v_new, d_s, precision=precision),
          jnp.einsum("bhncv,bhnjv->bhncj", d_o, v_new, precision=precision),
          jnp.sum(s_in * d_s, axis=-1))


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    segment_ids: jax.Array | None,
    gate_bound: float | None,
) -> tuple[jax.Array, jax.Array]:
  """Chunkwise KDA; same contract as `reference.recurrent_kda`.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] (<= 0); beta: [B, T, H].
    scale: multiplies q. initial_state: [B, H, K, V] or None.
    segment_ids: [B, T] int or None.
    gate_bound: None for any g <= 0; a float in [-5, 0] promises g >= gate_bound
      and selects the factorised (matmul-only) diagonal tiles.

  Returns:
    o [B, T, H, V] in q's dtype and the final state [B, H, K, V] in the
    compute dtype (>= fp32).
  """
  dt = reference.compute_dtype(q, k, v, g, beta, initial_state)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = -(-t // CHUNK)
  q_decayed, w, u, k_to_end, a_qk, chunk_decay = chunk_parts(
      q, k, v, g, beta, scale=scale, segment_ids=segment_ids, gate_bound=gate_bound, dt=dt)

  if initial_state is None:
    s0 = jnp.zeros((b, h, dk, dv), dt)
  else:
    s0 = initial_state.astype(dt)

  def step(s, x):
    w_n, u_n, kg_n, decay_n = x
    v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s, precision=_HIGHEST)
    s_next = decay_n[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", kg_n, v_new,
                                                 precision=_HIGHEST)
    return s_next, (s, v_new)

  s_final, (s_in, v_new) = jax.lax.scan(
      step, s0, tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, k_to_end, chunk_decay)))
  s_in, v_new = jnp.moveaxis(s_in, 0, 2), jnp.moveaxis(v_new, 0, 2)
  o = (jnp.einsum("bhnck,bhnkv->bhncv", q_decayed, s_in, precision=_HIGHEST)
       + jnp.einsum("bhncj,bhnjv->bhncv", a_qk, v_new, precision=_HIGHEST))
  o = jnp.moveaxis(o, 1, 3).reshape(b, n * CHUNK, h, dv)[:, :t]
  return o.astype(q.dtype), s_final
