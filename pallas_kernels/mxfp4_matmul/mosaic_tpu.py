"""Mosaic TPU tier of the MXFP4-weight matmul (k3_techniques.md §7; layout k3_hf_names.md).

A weight W [N, K] (out, in) comes as the K3 checkpoint stores it: `w_packed` uint8 [N, K/2]
(element 2j in the low nibble, 2j+1 in the high one; a nibble is an E2M1 bit code) and
`w_scale` uint8 [N, K/32] (E8M0 bits, 2^(s - 127) per block of 32 along K).
  matmul(x [M, K], w_packed, w_scale)            -> [M, N] = x @ W^T
  ragged_dot(lhs [M, K], w_packed [G, N, K/2], w_scale [G, N, K/32], group_sizes [G])
                                                 -> [M, N], `jax.lax.ragged_dot`'s semantics with
                                                    expert g's weight W_g^T (rows past
                                                    sum(group_sizes) give zeros)

Nibble order without an on-chip interleave (Mosaic has no lane-strided load, and interleaving
the two nibble planes along lanes would cost a lane shuffle per weight element): the wrapper
permutes x's columns to x_p = [x[:, 0::2] | x[:, 1::2]] (XLA; a copy of x, which at M = 4096
costs about 2.5 x's bytes of temporaries on v5p, the two strided halves and their
concatenation), and the kernel dequantizes a weight tile into W_p = [W_lo | W_hi] (low
nibbles, then high nibbles, both [tn, K/2]), so x @ W^T = x_p @ W_p^T is one MXU product over K.

Kernel: grid (N / tn, row tiles); the N axis is "parallel" (megacore), the row axis "arbitrary".
The packed tile [tn, K/2] and its scales [tn, K/32] stay in VMEM while the row tiles go by
(their block index does not change), and the tile is dequantized once into a VMEM scratch
[tn, K] in x's dtype, then reused by every row tile: the first row tile of a weight tile (matmul),
or every visit that starts a new group (ragged_dot). Dequantization runs 32 packed rows (one
uint8 (32, 128) tile) at a time under `lax.fori_loop`, 128 packed columns at a time unrolled:
  code = packed & 15 (low) or packed >> 4 (high)             (int32 on the VPU)
  value = table[code]      a lane gather from a vreg whose lane l holds E2M1[l % 16]
  scale = s[8c + lane // 16]  a lane gather from the block scales of chunk c (16 packed
                           columns = one block of 32 elements), s = bits (b << 23) as float32
  W = value * scale        exact: a 2-bit-mantissa value times a power of two
then one `lax.dot_general` x_p @ W_p^T with fp32 accumulation (bf16 operands for bf16 x;
fp32 at HIGHEST precision for fp32 x), cast to the output dtype. Scale byte 255 (E8M0 NaN)
makes its block NaN (and with it every output of that weight row); scale byte 0 (2^-127, a
subnormal) reads as 0, as float32 subnormals do on the TPU (`mx.unpack_k3` gives at most
6 * 2^-127 there).

Grouped form (megablox's idea, our metadata): row tiles of tm rows; group g (g < G) covers rows
[offsets[g], offsets[g+1]) and a tail "group" G covers [sum(group_sizes), M_pad). Each
non-empty group visits every row tile it touches, in row order, so an output tile is visited
by consecutive grid steps and stays in VMEM between them. The second grid axis has one step per
visit (a traced length, at most M_pad / tm + G; empty groups take none and their weights are
never read). The scalar-prefetched visit tables (group, row tile, weight group) drive the
BlockSpec index maps; a visit writes only its group's rows of the tile and the tail writes
zeros, so no masking pass over the output follows (megablox leaves those rows unwritten).

Tiles: tn in (512, 256, 128) dividing N (or N itself, N <= 512 and a multiple of 32), tm up to
512 rows; K must be a multiple of 256 (both halves of x_p lane-aligned). `supports_*` declines
shapes that do not tile or whose buffers exceed VMEM_BUDGET. `interpret=True` (or a
`pltpu.InterpretParams`) runs the kernels in Pallas's interpreters (any backend). Status: tested
in the interpreters and compiled for v5e, v5p and v6e (tests/tpu/test_mxfp4_tpu_compile.py);
not yet run or timed on a TPU.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels.mxfp4_matmul import reference

BLOCK = 32                           # elements per E8M0 scale along K
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
OUTPUT_DTYPES = INPUT_DTYPES
N_TILES = (512, 256, 128)
ROW_TILES = (512, 256, 128)
K_MULTIPLE = 256                     # K / 2 a multiple of the 128 lanes
CHUNK_ROWS = 32                      # packed rows per dequantization step: one uint8 tile
VMEM_BUDGET = 32 * 2 ** 20           # buffers of one kernel (estimate; v5p has 64 MiB a core)
VMEM_LIMIT = 48 * 2 ** 20            # Mosaic's scoped VMEM limit for these kernels
_NT = (((1,), (1,)), ((), ()))       # a @ b^T


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _round_up(x: int, multiple: int) -> int:
  return _cdiv(x, multiple) * multiple


def _vmem_bytes(tm: int, tn: int, k: int, x_bytes: int, out_bytes: int) -> int:
  """Mosaic's scoped VMEM for one kernel, an upper estimate: double-buffered x, packed, scale
  and output tiles, the dequantized scratch, the product's copy of the x tile (fp32 at HIGHEST:
  its bf16 splits, 16 bytes an element), the fp32 product and the row mask. At K3's expert
  shapes on v5p it is 1-10% above the count the compiler reports for the kernel
  (`used_scoped_memory_configs`; `pytest -s tests/tpu/test_mxfp4_tpu_compile.py`)."""
  operand = tm * k * (16 if x_bytes == 4 else x_bytes)
  return (2 * tm * k * x_bytes + 2 * tn * k // 2 + 2 * tn * _round_up(k // BLOCK, 128)
          + tn * k * x_bytes + operand + 2 * tm * tn * out_bytes + 2 * tm * tn * 4)


def tiles(m: int, k: int, n: int, x_dtype, out_dtype,
          groups: int = 0) -> tuple[int, int] | str:
  """(tm, tn) for x [m, k] and a weight [n, k] (`groups` experts for ragged_dot), or why no
  tile fits. Large m takes tn = 512 (x is read once per weight tile), small m tn = 256 (more
  steps to pipeline the weight's DMA). Row tiles: up to 512 rows split evenly (matmul); for
  ragged_dot at most half the mean group (128 to 512 rows), since a tile that straddles groups
  is computed once per group."""
  if m == 0:
    return "M=0: no rows"
  if k % K_MULTIPLE:
    return f"K={k} is not a multiple of {K_MULTIPLE}"
  if n % 128 == 0:
    want = 512 if m >= 1024 else 256
    tn_options = [t for t in N_TILES if t <= want and n % t == 0]
  elif n <= N_TILES[0] and n % CHUNK_ROWS == 0:
    tn_options = [n]
  else:
    return f"N={n} is neither a multiple of 128 nor <= {N_TILES[0]} and a multiple of {CHUNK_ROWS}"
  if groups:
    cap = next((t for t in ROW_TILES if 2 * groups * t <= m), ROW_TILES[-1])
    tm = min(cap, _round_up(m, 16))
  else:
    tm = _round_up(_cdiv(m, _cdiv(m, ROW_TILES[0])), 16)
  x_bytes, out_bytes = jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  for tn in tn_options:
    for tm_try in (tm, *(t for t in ROW_TILES if t < tm)):
      if _vmem_bytes(tm_try, tn, k, x_bytes, out_bytes) <= VMEM_BUDGET:
        return tm_try, tn
  return (f"K={k} needs more than {VMEM_BUDGET >> 20} MiB of VMEM for the smallest tiles "
          f"({_vmem_bytes(min(tm, 128), tn_options[-1], k, x_bytes, out_bytes) >> 20} MiB)")


def _check_weight(name: str, x, w_packed, w_scale, grouped: bool) -> None:
  """ValueError unless w_packed [(G,) N, K/2] and w_scale [(G,) N, K/32] are uint8 and fit
  x [M, K]."""
  if x.ndim != 2:
    raise ValueError(f"{name} must be [M, K], got shape {x.shape}")
  k = x.shape[1]
  if w_packed.ndim != 2 + grouped or w_packed.shape[-1] * 2 != k:
    raise ValueError(f"w_packed must be [{'G, ' * grouped}N, K/2] with K={k} from {name}, got "
                     f"shape {w_packed.shape}")
  if k % BLOCK or w_scale.shape != w_packed.shape[:-1] + (k // BLOCK,):
    raise ValueError(f"w_scale must have shape {w_packed.shape[:-1] + (k // BLOCK,)} "
                     f"(blocks of {BLOCK} along K={k}), got {w_scale.shape}")
  for arg, a in (("w_packed", w_packed), ("w_scale", w_scale)):
    if jnp.dtype(a.dtype) != jnp.dtype(jnp.uint8):
      raise ValueError(f"{arg} must be uint8, got {a.dtype}")


def _check_group_sizes(group_sizes, num_groups: int) -> None:
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"group_sizes must have shape ({num_groups},) (one per expert of "
                     f"w_packed), got {group_sizes.shape}")
  if jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
    raise ValueError(f"group_sizes must be int32, got {group_sizes.dtype}")


def _decline(name: str, x, n: int, out_dtype, interpret, groups: int) -> str | None:
  if not interpret and jax.devices()[0].platform != "tpu":
    return f"not a TPU ({jax.devices()[0].device_kind}) and interpret=False"
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    return f"{name} must be bfloat16 or float32, got {x.dtype}"
  if out_dtype not in OUTPUT_DTYPES:
    return f"the output must be bfloat16 or float32, got {out_dtype}"
  t = tiles(x.shape[0], x.shape[1], n, x.dtype, out_dtype, groups)
  return t if isinstance(t, str) else None


def supports_matmul(x, w_packed, w_scale, *, preferred_element_type=None,
                    interpret=False) -> str | None:
  """None if `matmul` takes this call, else the reason it does not."""
  try:
    _check_weight("x", x, w_packed, w_scale, grouped=False)
  except ValueError as e:
    return str(e)
  return _decline("x", x, w_packed.shape[0], reference.out_dtype(x, preferred_element_type),
                  interpret, 0)


def supports_ragged_dot(lhs, w_packed, w_scale, group_sizes, *, preferred_element_type=None,
                        interpret=False) -> str | None:
  """None if `ragged_dot` takes this call, else the reason it does not."""
  try:
    _check_weight("lhs", lhs, w_packed, w_scale, grouped=True)
    _check_group_sizes(group_sizes, w_packed.shape[0])
  except ValueError as e:
    return str(e)
  return _decline("lhs", lhs, w_packed.shape[1], reference.out_dtype(lhs, preferred_element_type),
                  interpret, w_packed.shape[0])


def _permute_columns(x: jax.Array, rows: int) -> jax.Array:
  """x [M, K] -> [rows, K] = [x[:, 0::2] | x[:, 1::2]] with zero rows appended."""
  x_p = jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)
  return jnp.pad(x_p, ((0, rows - x.shape[0]), (0, 0)))


def _e2m1_table() -> jax.Array:
  """[CHUNK_ROWS, 128] float32 with lane l holding the E2M1 value of code l % 16."""
  code = jax.lax.broadcasted_iota(jnp.int32, (CHUNK_ROWS, 128), 1) & 15
  exponent = (code >> 1) & 3
  half_mantissa = (code & 1).astype(jnp.float32) * 0.5
  power = (1 << jnp.maximum(exponent - 1, 0)).astype(jnp.float32)
  magnitude = jnp.where(exponent == 0, half_mantissa, (1.0 + half_mantissa) * power)
  return jnp.where(code >= 8, -magnitude, magnitude)


def _dequantize(w_ref, s_ref, out_ref) -> None:
  """out_ref [tn, K] = [W_lo | W_hi] of the packed tile w_ref [tn, K/2] with scales s_ref
  [tn, K/32], in out_ref's dtype (module docstring)."""
  tn, half = w_ref.shape
  blocks = s_ref.shape[1]
  lanes = _round_up(blocks, 128)
  table = _e2m1_table()
  lane = jax.lax.broadcasted_iota(jnp.int32, (CHUNK_ROWS, 128), 1)
  gather = functools.partial(jnp.take_along_axis, axis=1, mode="promise_in_bounds")

  def rows_step(r, carry):
    rows = pl.ds(pl.multiple_of(r * CHUNK_ROWS, CHUNK_ROWS), CHUNK_ROWS)
    s = s_ref[rows, :].astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    scale = jnp.where(s == 255, jnp.nan, scale)
    if lanes > blocks:
      scale = jnp.concatenate(
          [scale, jnp.zeros((CHUNK_ROWS, lanes - blocks), jnp.float32)], axis=1)
    for c in range(half // 128):
      cols = slice(128 * c, 128 * (c + 1))
      base = 128 * (c // 16)
      scale_c = gather(scale[:, base:base + 128], 8 * (c % 16) + lane // 16)
      code = w_ref[rows, cols].astype(jnp.int32)
      out_ref[rows, cols] = (gather(table, code & 15) * scale_c).astype(out_ref.dtype)
      out_ref[rows, half + 128 * c:half + 128 * (c + 1)] = (
          gather(table, code >> 4) * scale_c).astype(out_ref.dtype)
    return carry

  jax.lax.fori_loop(0, tn // CHUNK_ROWS, rows_step, 0)


def _product(x_ref, w_ref) -> jax.Array:
  """x_p [tm, K] @ W_p^T [K, tn] with fp32 accumulation."""
  precision = (jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  return jax.lax.dot_general(x_ref[...], w_ref[...], _NT, precision=precision,
                             preferred_element_type=jnp.float32)


def _matmul_kernel(x_ref, w_ref, s_ref, o_ref, w_scratch):
  @pl.when(pl.program_id(1) == 0)
  def _():
    _dequantize(w_ref, s_ref, w_scratch)

  o_ref[...] = _product(x_ref, w_scratch).astype(o_ref.dtype)


def _compiler_params(semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT)


def _cost(m: int, k: int, n: int, weight_reads: int, x_reads: int, x_bytes: int,
          out_bytes: int) -> pl.CostEstimate:
  weight = n * k // 2 + n * k // BLOCK
  return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                         bytes_accessed=weight * weight_reads + m * k * x_bytes * x_reads
                         + m * n * out_bytes)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret=False) -> jax.Array:
  """x [M, K] @ W^T -> [M, N] for W [N, K] given as (w_packed [N, K/2], w_scale [N, K/32])
  uint8 (module docstring); the output in x's dtype unless preferred_element_type. Call
  `supports_matmul` first."""
  _check_weight("x", x, w_packed, w_scale, grouped=False)
  out_dtype = reference.out_dtype(x, preferred_element_type)
  (m, k), n = x.shape, w_packed.shape[0]
  tm, tn = tiles(m, k, n, x.dtype, out_dtype)
  rows = _round_up(m, tm)
  out = pl.pallas_call(
      _matmul_kernel,
      out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype),
      grid=(n // tn, rows // tm),
      in_specs=[pl.BlockSpec((tm, k), lambda j, i: (i, 0)),
                pl.BlockSpec((tn, k // 2), lambda j, i: (j, 0)),
                pl.BlockSpec((tn, k // BLOCK), lambda j, i: (j, 0))],
      out_specs=pl.BlockSpec((tm, tn), lambda j, i: (i, j)),
      scratch_shapes=[pltpu.VMEM((tn, k), x.dtype)],
      compiler_params=_compiler_params(("parallel", "arbitrary")),
      cost_estimate=_cost(m, k, n, 1, n // tn, x.dtype.itemsize, out_dtype.itemsize),
      interpret=interpret,
      name="mxfp4_matmul",
  )(_permute_columns(x, rows), w_packed, w_scale)
  return out[:m]


def visits(group_sizes: jax.Array, m: int, rows: int, tm: int):
  """The grouped kernel's visit tables for group_sizes [G] over `rows` (M padded to tm).

  Returns (group, tile, weight_group, offsets, count): group, tile and weight_group [rows / tm
  + G] give each visit's group (G: the tail past sum(group_sizes)), row tile and the expert
  whose weight tile it loads (the tail keeps the previous visit's, so it loads nothing new);
  offsets [G + 2] the first row of each group and of the tail, then `rows`; count the number
  of visits. Sizes are clipped so that no group reaches past row m."""
  num_groups = group_sizes.shape[0]
  ends = jnp.minimum(jnp.cumsum(group_sizes), m).astype(jnp.int32)
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, jnp.full(1, rows, jnp.int32)])
  lo, hi = offsets[:-1], offsets[1:]
  first = lo // tm
  counts = jnp.where(hi > lo, (hi - 1) // tm - first + 1, 0)
  length = rows // tm + num_groups
  group = jnp.repeat(jnp.arange(num_groups + 1, dtype=jnp.int32), counts,
                     total_repeat_length=length)
  step = jnp.arange(length, dtype=jnp.int32)
  tile = first[group] + step - (jnp.cumsum(counts) - counts)[group]
  tile = jnp.clip(tile, 0, rows // tm - 1).astype(jnp.int32)
  last_expert = jnp.max(jnp.where(counts[:-1] > 0, jnp.arange(num_groups), 0))
  weight_group = jnp.where(group < num_groups, group, last_expert).astype(jnp.int32)
  return group, tile, weight_group, offsets, jnp.sum(counts).astype(jnp.int32)


def _ragged_kernel(group_ref, tile_ref, weight_group_ref, offsets_ref, x_ref, w_ref, s_ref,
                   o_ref, w_scratch, *, num_groups: int):
  i = pl.program_id(1)
  g = group_ref[i]
  tm = o_ref.shape[0]
  row = tile_ref[i] * tm + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
  inside = (row >= offsets_ref[g]) & (row < offsets_ref[g + 1])
  new_expert = (i == 0) | (weight_group_ref[i] != weight_group_ref[jnp.maximum(i - 1, 0)])

  @pl.when((g < num_groups) & new_expert)
  def _():
    _dequantize(w_ref, s_ref, w_scratch)

  @pl.when(g < num_groups)
  def _():
    o_ref[...] = jnp.where(inside, _product(x_ref, w_scratch).astype(o_ref.dtype), o_ref[...])

  @pl.when(g == num_groups)
  def _():
    o_ref[...] = jnp.where(inside, jnp.zeros((), o_ref.dtype), o_ref[...])


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret=False) -> jax.Array:
  """out [M, N]: row r of group g is lhs[r] @ W_g^T for W_g given as (w_packed [G, N, K/2],
  w_scale [G, N, K/32]) uint8; rows past sum(group_sizes) are zero (`jax.lax.ragged_dot`
  semantics). The output in lhs's dtype unless preferred_element_type. Call
  `supports_ragged_dot` first."""
  _check_weight("lhs", lhs, w_packed, w_scale, grouped=True)
  num_groups = w_packed.shape[0]
  _check_group_sizes(group_sizes, num_groups)
  out_dtype = reference.out_dtype(lhs, preferred_element_type)
  (m, k), n = lhs.shape, w_packed.shape[1]
  tm, tn = tiles(m, k, n, lhs.dtype, out_dtype, num_groups)
  rows = _round_up(m, tm)
  group, tile, weight_group, offsets, count = visits(group_sizes, m, rows, tm)
  out = pl.pallas_call(
      functools.partial(_ragged_kernel, num_groups=num_groups),
      out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(n // tn, count),
          in_specs=[
              pl.BlockSpec((tm, k), lambda j, i, grp, t, wg, off: (t[i], 0)),
              pl.BlockSpec((None, tn, k // 2), lambda j, i, grp, t, wg, off: (wg[i], j, 0)),
              pl.BlockSpec((None, tn, k // BLOCK),
                           lambda j, i, grp, t, wg, off: (wg[i], j, 0))],
          out_specs=pl.BlockSpec((tm, tn), lambda j, i, grp, t, wg, off: (t[i], j)),
          scratch_shapes=[pltpu.VMEM((tn, k), lhs.dtype)]),
      compiler_params=_compiler_params(("parallel", "arbitrary")),
      cost_estimate=_cost(m, k, n, num_groups, n // tn, lhs.dtype.itemsize,
                          out_dtype.itemsize),
      interpret=interpret,
      name="mxfp4_ragged_dot",
  )(group, tile, weight_group, offsets, _permute_columns(lhs, rows), w_packed, w_scale)
  return out[:m]
