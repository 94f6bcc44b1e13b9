"""Mosaic GPU (Hopper, sm_90a) tier of the MXFP4-weight matmul (k3_techniques.md §7).

Weights in the K3 checkpoint layout (k3_hf_names.md): W [N, K] as `w_packed` uint8 [N, K/2]
(element 2j in the low nibble, 2j+1 in the high one, E2M1 bit codes) and `w_scale` uint8
[N, K/32] (E8M0, 2^(s - 127) per block of 32 along K).
  matmul(x [M, K], w_packed, w_scale)        -> [M, N] = x @ W^T
  ragged_dot(lhs [M, K], w_packed [G, N, K/2], w_scale [G, N, K/32], group_sizes [G])
                                             -> [M, N], `jax.lax.ragged_dot`'s semantics with
                                                expert g's weight W_g^T
matmul is ragged_dot with one group of M rows.

One persistent kernel, one CTA per SM, three warpgroups as in `pallas_kernels.ragged_dot`'s
"ws" kernels: warpgroup 2 issues the TMA loads of each K step (block_k = 64) into a ring of
`stages` slots: the x rows [block_m, 64] (bf16, 128-byte swizzle), the packed weight rows
[2 * block_n, 32] and their scale bytes [2 * block_n, 16] (the 16-byte row of scales that
covers the step's two blocks: a TMA box needs 16 bytes). Warpgroups 0 and 1 each own block_n
weight rows (output columns); per step each dequantizes its [block_n, 64] weight tile to bf16
into its own SMEM buffer (two, alternating by step) and issues wgmma x [block_m, 64] @ W^T.
The wgmma of step k runs while the warpgroup dequantizes step k + 1 (`wgmma_wait(1)`; a slot
is released once its wgmma has completed, one step later).

Dequantization on chip:
  1. the packed tile [block_n, 32] uint8 is read as int4 [block_n, 64] (the same bytes: element
     2j is the low nibble) in the `WGMMA_UPCAST_4X` layout, 8 nibbles per thread in one 32-bit
     load (`_load_codes`, a few lines of Mosaic GPU through `plgpu.inline_mgpu`: Pallas cannot
     bitcast a uint8 ref to int4), relayouted to the WGMMA layout at 4 bits and sign-extended
     to int16 (Mosaic GPU's int4 -> int8 conversion, then int8 -> int16): c = the signed
     nibble, whose sign bit is the E2M1 sign;
  2. bf16 bits of the E2M1 value, integer ops only: m = c & 7 (exponent and mantissa bits),
     magnitude bits (m << 6) + 0x3F00 for m >= 2 (exponent 126 + m // 2, mantissa m & 1),
     0x3F00 (0.5) for m = 1, 0 for m = 0; or'ed with c & 0x8000 (the sign);
  3. times the block's scale as bf16 (bits s << 7; 0 -> 2^-127 as the subnormal 0x0040, 255 ->
     NaN): a product of a 2-bit-mantissa value and a power of two, exact in bf16 unless it
     overflows or underflows.
  `Config.dequant="shift"` replaces step 2 by two integer ops: (c << 6) & 0x81C0 puts the
  sign at bit 15 and the three exponent / mantissa bits at bits 8-6, the bf16 bits of the
  value times 2^-126 (E2M1's subnormal 0.5 lands on the bf16 subnormal 2^-127: the same
  exponent field 0), then one bf16 multiply by 2^126 before the scale's. Exact where bf16
  products keep subnormal inputs (the GPU's bf16 multiply; XLA:CPU flushes them, so the
  interpreter evaluates "select": the same values). "shift" is the default of unswapped tiles:
  1.2-1.5x faster than "select" at every K3 shape on the H200 (2026-12-02); swapped tiles take
  "ptx" (below). The scale bytes of a block are loaded per row in the WGMMA row
     layout (`_load_scale_column`, inline Mosaic GPU: one SMEM byte load per register; Pallas'
     strided SMEM loads refuse a column of a byte tile) and broadcast along the block's 32
     columns.
With `interpret=True` the kernel runs in the Mosaic GPU interpreter on CPU, which cannot run
`inline_mgpu`: there the codes come from the packed bytes by jnp (`b & 15`, `b >> 4`, stacked)
and the scale column by plain indexing; steps 2-3, the pipeline and wgmma are shared.

Rows: ragged_dot's group-aligned row tiles (`pallas_kernels.ragged_dot.mosaic_gpu.row_tiles`,
tiles start at a group's first row rounded down to 8; rows past sum(group_sizes) up to M form a
padding group that runs no K steps and stores zeros), stored through SMEM by its ladder of
power-of-two TMA stores (`_store_rows`); rows past M are never stored. Empty groups take no
tiles: their weights are never read. x is padded with zero rows to a multiple of 8 and to at
least block_m (a copy when M % 8 != 0 or M < block_m), unless `Config.x_rows` is set (M, rounded
up to 8, below block_m: decode): then every K step loads only x's first x_rows rows (every row
tile reads them from row 0 and stores its own rows), x is padded to x_rows only, and the
wgmma's rows past x_rows read stale SMEM into output rows that are never stored.

Swapped operands (`Config.swap`, decode): the dequantized [block_n, 64] tile is wgmma's A from
registers and x's x_rows rows its N side; acc [block_n, x_rows] is stored transposed
(`ragged_dot.mosaic_gpu.store_transposed`). In the interpreter the tile goes through SMEM.
With `Config.dequant="ptx"` each thread turns its 32-bit words of 8 nibbles (the UPCAST_4X
load) into its WGMMA registers in inline PTX without relayout: register m of a word holds
nibbles m and m + 4, which the same shift pair places in both bf16 halves, so the tile's
columns come out permuted within each block of 32 and x is permuted alike before the kernel
(`permute_x`, an XLA op on x's M x K elements).

Split K: for few output tiles (decode) each tile's K steps are split over `split_k` units of
work so that every SM streams weights; the units write fp32 partial products [split_k, M, N]
(M rows only) that XLA sums (and casts) afterwards.

Constraints (`supports_*` give the reason): an NVIDIA Hopper GPU (or interpret), x bf16, output
bf16 or fp32, K a multiple of 512 (the scale rows' TMA stride, K / 32 bytes, must be a multiple
of 16), N a multiple of 2 * block_n. Not differentiable by itself (the API's custom VJP
differentiates x through the reference).
"""
import dataclasses
import functools

import jax
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import memref
from jax._src.lib.mlir.dialects import vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.mxfp4_matmul import triton as mx_triton
from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mosaic_gpu

BLOCK = 32                      # elements per E8M0 scale along K
DEQUANTS = ("select", "shift", "ptx")
BLOCK_K = 64                    # K elements per pipeline step (one 128-byte bf16 swizzle row)
SCALE_ROW = 16                  # scale bytes per TMA row: the blocks of 8 steps
K_MULTIPLE = BLOCK * SCALE_ROW  # 512
SMALL_M = 64                    # up to this many rows: 64-row tiles, split K
MAX_STAGES = 12
SMEM_BYTES = ragged_mosaic_gpu.SMEM_BYTES
_SMEM_RESERVE = 2 * 1024        # barriers and alignment
_MEMORY_REGISTERS = 40          # as ragged_dot's warp-specialised kernels
_COMPUTE_REGISTERS = 232
_INTERPRET_SMS = 2              # simulated SMs in interpret mode
_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)            # one value per row of a WGMMA-layout array
_SWIZZLE = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles: a CTA tile is [block_m, 2 * block_n] (block_n weight rows per compute warpgroup);
  `stages` slots of one K step each; `split_k` units per output tile (fp32 partials when > 1);
  tiles ordered by `plgpu.planar_snake` along N in bands of grid_tile_width; the epilogue
  stores each warpgroup's tile in slices of epilogue_rows rows (None = block_m); x_rows: rows
  of x loaded per K step when all of x fits one row tile (None = block_m from each tile's
  first row); dequant: "select" (E2M1 bits by compare and select), "shift" (two integer ops
  and a multiply by 2^126, module docstring) or "ptx" (with swap: "shift"'s numerics in inline
  PTX on the packed words, x's columns permuted to match, `_dequantize_ptx`). swap (needs
  x_rows, block_n = 64): the operands swapped, the dequantized weight tile [64, 64] as wgmma's
  A straight from registers and x's x_rows rows as its N side (acc [64, x_rows] per
  warpgroup, stored transposed), instead of the weight tile through SMEM as B against a 64-row
  x tile of mostly padding. overlap (with swap): each step's wgmma issued on the tile made
  during the previous step's, the next tile made before waiting for it (off: 1.04-1.17x slower
  than without at 16 rows, H200, 2026-12-06)."""
  block_m: int = 128
  block_n: int = 128
  stages: int = 3
  split_k: int = 1
  grid_tile_width: int = 4
  epilogue_rows: int | None = None
  x_rows: int | None = None
  dequant: str = "shift"
  swap: bool = False
  overlap: bool = False


# config() swaps the operands when x has fewer rows than a tile (its GPU tests pass on the H200,
# 2026-12-02; 1.1-1.2x the unswapped kernel at 1-16 rows, BENCHMARKS.md "MXFP4 matmul").
SWAP_IS_DEFAULT = True
# Swapped tiles dequantize in inline PTX (`_dequantize_ptx`; its GPU tests pass on an H100,
# 2026-12-06: every code and scale edge exact; 1.3-1.6x "shift" at 1-64 rows, dense and over 8
# experts, BENCHMARKS.md "MXFP4 matmul").
PTX_IS_DEFAULT = True


def is_hopper() -> bool:
  """True when the default device is an NVIDIA Hopper GPU (H100/H200/H800)."""
  return ragged_mosaic_gpu.is_hopper()


def num_sms(interpret: bool) -> int:
  return _INTERPRET_SMS if interpret else jax.devices()[0].core_count


def _kernel_out_dtype(cfg: Config, out_dtype) -> jnp.dtype:
  return _F32 if cfg.split_k > 1 else jnp.dtype(out_dtype)


def _round8(m: int) -> int:
  return -(-m // 8) * 8


def smem_bytes(cfg: Config, out_dtype) -> int:
  """Shared memory of one CTA: the stage ring, the dequantized tiles (none with swap: they stay
  in registers), the epilogue tiles."""
  x_tile = cfg.x_rows if cfg.swap else cfg.block_m
  stage = x_tile * BLOCK_K * 2 + 2 * cfg.block_n * (BLOCK_K // 2 + SCALE_ROW)
  dequantized = 0 if cfg.swap else 2 * 2 * cfg.block_n * BLOCK_K * 2
  epilogue = (2 * (cfg.x_rows if cfg.swap else cfg.epilogue_rows or cfg.block_m) * cfg.block_n
              * _kernel_out_dtype(cfg, out_dtype).itemsize)
  return cfg.stages * stage + dequantized + epilogue + _SMEM_RESERVE


def config(m: int, k: int, n: int, groups: int, out_dtype, sms: int,
           swap: bool = SWAP_IS_DEFAULT) -> Config | str:
  """The tile config for x [m, k] and `groups` weights [n, k] on `sms` SMs, or why none fits.

  m <= 64 (decode): 64-row tiles, 64 weight rows per warpgroup, K split so that the tiles
  times the splits fill the SMs (at least 4 steps per unit), as many stages as fit (the
  weight bytes in flight bound a memory-bound product). Larger m: 256 x 2*64 tiles for one
  group (a dequantized weight tile serves 256 rows), 128 x 2*128 for several (group-aligned
  tiles waste about half a tile per group), 3 stages. x_rows = m rounded up to 8 when that is
  below block_m (each K step loads those rows only); then, with `swap`, the operands swapped
  (and dequant "ptx" while PTX_IS_DEFAULT).
  """
  if m == 0:
    return "M=0: no rows"
  if k % K_MULTIPLE:
    return (f"K={k} is not a multiple of {K_MULTIPLE} (the scale rows' TMA stride K/32 bytes "
            "must be a multiple of 16)")
  if m <= SMALL_M:
    cfg = Config(block_m=64, block_n=64, stages=MAX_STAGES, grid_tile_width=1)
  elif groups == 1:
    cfg = Config(block_m=256, block_n=64, stages=3)
  else:
    cfg = Config(block_m=128, block_n=128, stages=3)
  if n % (2 * cfg.block_n):
    return f"N={n} is not a multiple of the CTA tile 2 * block_n = {2 * cfg.block_n}"
  if _round8(m) < cfg.block_m:
    swapped = swap and m <= SMALL_M
    cfg = dataclasses.replace(cfg, x_rows=_round8(m), swap=swapped,
                              dequant="ptx" if swapped and PTX_IS_DEFAULT else cfg.dequant)
  if m <= SMALL_M:
    row_tiles = min(groups, m) if groups > 1 else 1
    units = row_tiles * n // (2 * cfg.block_n)
    cfg = dataclasses.replace(cfg, split_k=max(1, min(sms // units, k // BLOCK_K // 4)))
  if (cfg.block_m > 64 and smem_bytes(cfg, out_dtype) > SMEM_BYTES
      and _kernel_out_dtype(cfg, out_dtype) == _F32):
    cfg = dataclasses.replace(cfg, epilogue_rows=64)
  while cfg.stages > 2 and smem_bytes(cfg, out_dtype) > SMEM_BYTES:
    cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
  if smem_bytes(cfg, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs {smem_bytes(cfg, out_dtype)} B of shared memory"
  return cfg


def _check_config(cfg: Config, m: int, k: int, n: int, out_dtype) -> str | None:
  if cfg.block_m % 64 or cfg.block_n % 64 or cfg.block_n > 128:
    return f"block_m must be a multiple of 64 and block_n 64 or 128, got {cfg}"
  if n % (2 * cfg.block_n):
    return f"N={n} is not a multiple of the CTA tile 2 * block_n = {2 * cfg.block_n}"
  if not 1 <= cfg.split_k <= k // BLOCK_K:
    return f"split_k={cfg.split_k} must be in [1, K / {BLOCK_K} = {k // BLOCK_K}]"
  if cfg.stages < 2:
    return f"stages={cfg.stages} must be at least 2"
  epi = cfg.epilogue_rows or cfg.block_m
  if cfg.block_m % epi or epi % 64:
    return f"epilogue_rows={epi} must divide block_m={cfg.block_m} and be a multiple of 64"
  if cfg.x_rows is not None and not (cfg.x_rows % 8 == 0
                                     and _round8(m) <= cfg.x_rows <= cfg.block_m):
    return (f"x_rows={cfg.x_rows} must be a multiple of 8 in [M rounded up to 8 = {_round8(m)}, "
            f"block_m = {cfg.block_m}]")
  if cfg.dequant not in DEQUANTS:
    return f"dequant must be one of {DEQUANTS}, got {cfg.dequant!r}"
  if cfg.dequant == "ptx" and not cfg.swap:
    return "dequant='ptx' makes wgmma's A operand in registers: it needs swap"
  if cfg.overlap and not cfg.swap:
    return "overlap carries wgmma's A operand in registers from step to step: it needs swap"
  if cfg.swap and (cfg.x_rows is None or cfg.block_n != 64):
    return f"swap needs x_rows (all of x in one row tile) and block_n = 64 (wgmma's M), got {cfg}"
  if smem_bytes(cfg, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs {smem_bytes(cfg, out_dtype)} B of shared memory"
  return None


def _supports(x, w_packed, groups: int, preferred_element_type, interpret: bool,
              cfg: Config | None) -> str | None:
  if not interpret and not is_hopper():
    return f"not an NVIDIA Hopper GPU ({jax.devices()[0].device_kind})"
  if jnp.dtype(x.dtype) != _BF16:
    return f"needs bfloat16 x (the dequantized weight is bf16), got {x.dtype}"
  out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
  if out_dtype not in (_BF16, _F32):
    return f"output dtype must be bfloat16 or float32, got {out_dtype}"
  (m, k), n = x.shape, w_packed.shape[-2]
  if cfg is None:
    cfg = config(m, k, n, groups, out_dtype, num_sms(interpret))
    if isinstance(cfg, str):
      return cfg
  if k % K_MULTIPLE:
    return f"K={k} is not a multiple of {K_MULTIPLE}"
  return _check_config(cfg, m, k, n, out_dtype)


def supports_matmul(x, w_packed, w_scale, *, preferred_element_type=None,
                    interpret: bool = False, config: Config | None = None) -> str | None:
  """None if `matmul` takes this call (shapes checked by the API), else the reason."""
  del w_scale
  return _supports(x, w_packed, 1, preferred_element_type, interpret, config)


def supports_ragged_dot(lhs, w_packed, w_scale, group_sizes, *, preferred_element_type=None,
                        interpret: bool = False, config: Config | None = None) -> str | None:
  """None if `ragged_dot` takes this call (shapes checked by the API), else the reason."""
  del w_scale, group_sizes
  return _supports(lhs, w_packed, w_packed.shape[0], preferred_element_type, interpret, config)


# ------------------------------------------------------------------------------------------
# Dequantization of one [rows, 64] weight tile
# ------------------------------------------------------------------------------------------

def _load_codes(p_ref, rows: int) -> jax.Array:
  """The packed tile p_ref [rows, 32] uint8 (SMEM, row-major) as int4 [rows, 64] in the
  WGMMA_UPCAST_4X layout: one 32-bit SMEM load of 8 nibbles per register."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((rows, BLOCK_K), jnp.int4,
                                                        layout=plgpu.Layout.WGMMA_UPCAST_4X))
  def load(_, ref):
    int4_ty = ir.MemRefType.get((rows, BLOCK_K), ir.IntegerType.get_signless(4),
                                memory_space=mgpu_utils.smem())
    codes = mgpu_utils.ptr_as_memref(mgpu_utils.memref_ptr(ref), int4_ty)
    return mgpu.FragmentedArray.load_untiled(codes, layout=mgpu.WGMMA_LAYOUT_UPCAST_4X,
                                             is_signed=True, optimized=False)
  return load(p_ref)


def _load_scale_column(s_ref, rows: int) -> jax.Array:
  """s_ref [rows, 1] uint8 (a column of the SMEM scale tile) as [rows] in the WGMMA row layout:
  one byte load per register at the register's row."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((rows,), jnp.uint8, layout=_ROW))
  def load(_, ref):
    layout = mgpu.WGMMA_ROW_LAYOUT
    zero = mgpu_utils.c(0, ir.IndexType.get())
    byte = ir.VectorType.get((1,), ir.IntegerType.get_signless(8))
    regs = [vector.broadcast(byte, memref.load(ref, [row, zero]))
            for (row,) in layout.thread_idxs((rows,))]
    regs = np.asarray(regs, dtype=object).reshape(layout.registers_shape((rows,)))
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=False)
  return load(s_ref)


def e2m1_bits(codes: jax.Array) -> jax.Array:
  """Sign-extended E2M1 codes (int16, the sign bit of the nibble extended) -> the bf16 bits
  (int16) of their values."""
  m = codes & 7
  magnitude = jnp.where(m >= 2, (m << 6) + 0x3F00, m * 0x3F00).astype(jnp.int16)
  return magnitude | (codes & jnp.int16(-0x8000))


def e2m1_scaled_bits(codes: jax.Array) -> jax.Array:
  """Sign-extended E2M1 codes (int16) -> the bf16 bits (int16) of their values times 2^-126:
  (c << 6) & 0x81C0, sign at bit 15, exponent and mantissa bits at bits 8-6 (code 1, 0.5,
  becomes the subnormal 2^-127)."""
  return (codes << 6) & jnp.int16(0x81C0 - 0x10000)


def _dequantize(p_ref, s_ref, scale_col, rows: int, dequant: str, interpret: bool) -> jax.Array:
  """bf16 [rows, 64] weight tile (WGMMA layout) from its packed bytes p_ref [rows, 32] and the
  scale tile s_ref [rows, 16], whose columns scale_col, scale_col + 1 hold its two blocks;
  dequant: `Config.dequant`."""
  if interpret:
    b = p_ref[...].astype(jnp.int16)
    codes = jnp.stack([b & 15, b >> 4], axis=-1).reshape(rows, BLOCK_K)
    codes = (codes ^ 8) - 8
  else:
    codes = plgpu.layout_cast(_load_codes(p_ref, rows), _WG)
    codes = codes.astype(jnp.int8).astype(jnp.int16)
  if dequant == "shift" and not interpret:  # XLA:CPU flushes the bf16 subnormal of code 0.5
    w = (lax.bitcast_convert_type(e2m1_scaled_bits(codes), jnp.bfloat16)
         * jnp.asarray(2.0 ** 126, jnp.bfloat16))
  else:
    w = lax.bitcast_convert_type(e2m1_bits(codes), jnp.bfloat16)
  scales = []
  for j in range(BLOCK_K // BLOCK):
    if interpret:
      s = s_ref[:, scale_col + j]
    else:
      s = _load_scale_column(s_ref.at[:, pl.ds(scale_col + j, 1)], rows)
    scales.append(lax.broadcast_in_dim(mx_triton.e8m0_bf16(s.astype(jnp.int16)), (rows, BLOCK),
                                      [0]))
  return w * jnp.concatenate(scales, axis=1)


# A scale byte ($1, as i32) -> its factor 2^(s - 127) as bf16x2 (both halves).
_PTX_FACTOR = ("{\n.reg .b32 t, u;\nshl.b32 t, $1, 16;\nor.b32 t, t, $1;\n"
               + mx_triton.E8M0_PAIR_PTX.format(out=0) + "}")

# (shift of the magnitude bits, shift of the sign bit) that bring nibbles m and m + 4 of a word
# (bits 4m and 4m + 16) to bf16 bits 8-6 and 15 of the low and high half (negative: right).
_PTX_SHIFTS = ((6, 12), (2, 8), (-2, 4), (-6, 0))


def _ptx_shift(dst: str, src: str, by: int) -> str:
  if by == 0:
    return f"mov.b32 {dst}, {src};\n"
  return f"{'shl' if by > 0 else 'shr'}.b32 {dst}, {src}, {abs(by)};\n"


# A word of 8 nibbles ($4) and its scale's factor ($5) -> 4 bf16x2 registers ($0-$3): register m
# holds nibbles m and m + 4, their sign and magnitude bits moved into bf16 bit positions (the
# value times 2^-126), times 2^126 and the factor.
_PTX_WORD = "".join([
    "{\n.reg .b32 a, b, c;\nmov.b32 c, 0x7E807E80;\n",
    *(_ptx_shift("a", "$4", mag) + "and.b32 a, a, 0x01C001C0;\n" + _ptx_shift("b", "$4", sign)
      + f"and.b32 b, b, 0x80008000;\nor.b32 a, a, b;\nmul.rn.bf16x2 a, a, c;\n"
      f"mul.rn.bf16x2 ${m}, a, $5;\n" for m, (mag, sign) in enumerate(_PTX_SHIFTS)),
    "}"])


def permute_x(x: jax.Array) -> jax.Array:
  """x [M, K] -> its columns in the order of `_dequantize_ptx`'s tile: in each block of 32, the
  position 8 m + 2 t + e holds column 8 t + 4 e + m (m, t < 4, e < 2)."""
  m, k = x.shape
  return x.reshape(m, k // BLOCK, 4, 2, 4).transpose(0, 1, 4, 2, 3).reshape(m, k)


def _dequantize_ptx(p_ref, s_ref, rows: int) -> jax.Array:
  """bf16 [rows, 64] weight tile in the WGMMA layout, its columns in `permute_x`'s order, from
  its packed bytes p_ref [rows, 32] and its two blocks' scales s_ref [rows, 2] (SMEM).

  Each thread loads its words in the WGMMA_UPCAST_4X layout (8 consecutive nibbles of one row,
  columns 8 t + j of a 32-column block for lane t = lane % 4, the WGMMA layout's rows) and makes
  each word four WGMMA registers in inline PTX, register m (column group 4 c + m of block c)
  holding nibbles m and m + 4: their bits need one shift pair for both halves, no permutes or
  shuffles. Numerics of dequant "shift" (bits of v * 2^-126, times 2^126, times the scale)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((rows, BLOCK_K), jnp.bfloat16,
                                                        layout=_WG))
  def dequantize(_, pref, sref):
    i32 = ir.IntegerType.get_signless(32)
    int4_ty = ir.MemRefType.get((rows, BLOCK_K), ir.IntegerType.get_signless(4),
                                memory_space=mgpu_utils.smem())
    codes = mgpu_utils.ptr_as_memref(mgpu_utils.memref_ptr(pref), int4_ty)
    words = mgpu.FragmentedArray.load_untiled(codes, layout=mgpu.WGMMA_LAYOUT_UPCAST_4X,
                                              is_signed=True, optimized=False).registers
    row_regs = np.asarray([row for (row,) in mgpu.WGMMA_ROW_LAYOUT.thread_idxs((rows,))],
                          dtype=object).reshape(rows // 64, 2)
    out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((rows, BLOCK_K)), dtype=object)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    for idx, word in np.ndenumerate(words):
      tile, block, half = idx[0], idx[1], idx[4]
      byte = memref.load(sref, [row_regs[tile, half], mgpu_utils.c(block, ir.IndexType.get())])
      factor = mgpu_utils.inline_ptx(_PTX_FACTOR, arith.extui(i32, byte), result_types=i32)
      regs = mgpu_utils.inline_ptx(_PTX_WORD, mgpu_utils.bitcast(word, i32), factor,
                                   result_types=[i32] * 4)
      for m, reg in enumerate(regs):
        out[(tile, 4 * block + m, *idx[2:])] = mgpu_utils.bitcast(reg, pair)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
  return dequantize(p_ref, s_ref)


# ------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------

# jitted: identical calls (every layer's) lower to one function, so XLA builds the kernel once
@functools.partial(jax.jit, static_argnames=("cfg", "num_ctas", "out_dtype", "interpret"))
def _kernel(tiles, x, w_packed, w_scale, *, cfg: Config, num_ctas: int, out_dtype,
            interpret: bool):
  """out [split_k, M_pad, N]: split s of x @ W_g^T for the rows of group g, zeros past the
  groups. tiles: `row_tiles`' [5, grid_m] table over x's rows."""
  m_pad, k = x.shape
  g, n = w_packed.shape[:2]
  bm, bn, stages, split = cfg.block_m, cfg.block_n, cfg.stages, cfg.split_k
  epi = cfg.epilogue_rows or bm
  x_rows = cfg.x_rows or bm
  x_tile = x_rows if cfg.swap else bm         # rows of the x tile in SMEM
  grid_n = n // (2 * bn)
  k_steps = k // BLOCK_K
  kernel_dtype = _kernel_out_dtype(cfg, out_dtype)
  ptx = _ptx(cfg, interpret)

  def mxfp4_matmul_kernel(tiles_gmem, x_gmem, p_gmem, s_gmem, out_gmem):
    cta = lax.axis_index("sm")
    tiles_m = tiles_gmem[4, 0]
    num_units = tiles_m * grid_n * split

    def unit(i):
      """The CTA's i-th unit: (split, N tile, group, first row loaded, offset of the first
      stored row, rows stored, first K step) and its K steps (none for the padding group)."""
      u = cta + i * num_ctas
      s, t = lax.rem(u, split), u // split
      mi, ni = plgpu.planar_snake(t, (tiles_m, grid_n), 1, cfg.grid_tile_width)
      group, load0, offset, rows = (tiles_gmem[r, mi] for r in range(4))
      k0 = s * k_steps // split
      steps = jnp.where(group == g, 0, (s + 1) * k_steps // split - k0)
      return (s, ni, group, load0, offset, rows, k0), steps

    local_units = (num_units - cta + num_ctas - 1) // num_ctas

    def scoped(x_s, p_s, s_s, w_s, o_s, produced, consumed):
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _memory():
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

        def one_unit(i, step):
          (_, ni, group, load0, _, _, k0), steps = unit(i)
          group = jnp.minimum(group, g - 1)
          cols = pl.ds(ni * 2 * bn, 2 * bn)

          def one_step(kk, step):
            slot, kb = lax.rem(step, stages), k0 + kk

            @pl.when(step >= stages)
            def _():
              plgpu.barrier_wait(consumed.at[slot])

            bar = produced.at[slot]
            x_dst = x_s.at[slot] if x_rows == x_tile else x_s.at[slot, pl.ds(0, x_rows)]
            plgpu.copy_gmem_to_smem(
                x_gmem.at[pl.ds(pl.multiple_of(load0, 8), x_rows),
                          pl.ds(kb * BLOCK_K, BLOCK_K)],
                x_dst, bar)
            plgpu.copy_gmem_to_smem(
                p_gmem.at[group, cols, pl.ds(kb * (BLOCK_K // 2), BLOCK_K // 2)],
                p_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(
                s_gmem.at[group, cols, pl.ds(kb // 8 * SCALE_ROW, SCALE_ROW)], s_s.at[slot], bar)
            return step + 1

          return lax.fori_loop(0, steps, one_step, step)

        total = lax.fori_loop(0, local_units, one_unit, jnp.int32(0))

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _quiesce(step):     # observe the last releases before the barriers are freed
          plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

      @pl.when(wg < 2)
      def _compute():
        plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
        mine = pl.ds(wg * bn, bn)

        def release(step):
          plgpu.barrier_arrive(consumed.at[lax.rem(step, stages)])

        def one_unit(i, step):
          (s, ni, _, load0, offset, rows, k0), steps = unit(i)

          def run_swapped(acc_ref):
            """acc [bn, x_rows] = W tile^T x^T: the dequantized tile is wgmma's A from registers
            (through SMEM in the interpreter, whose wgmma takes refs only)."""
            def dequantize(step, kb):
              """The weight tile of the slot of `step` (K step kb)."""
              slot = lax.rem(step, stages)
              if ptx:
                return _dequantize_ptx(p_s.at[slot, mine],
                                       s_s.at[slot, mine, pl.ds(lax.rem(kb, 8) * 2, 2)], bn)
              w = _dequantize(p_s.at[slot, mine], s_s.at[slot, mine], lax.rem(kb, 8) * 2, bn,
                              cfg.dequant, interpret)
              return w if interpret else plgpu.layout_cast(w, _WG)

            def product(w, slot):
              if interpret:
                w_buf = w_s.at[wg, 0]
                w_buf[...] = w
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, w_buf, x_s.at[slot].T)
              else:
                plgpu.wgmma(acc_ref, w, x_s.at[slot].T)

            def one_step(kk, step):
              slot = lax.rem(step, stages)
              plgpu.barrier_wait(produced.at[slot])
              product(dequantize(step, k0 + kk), slot)
              plgpu.wgmma_wait(0)       # its registers and slot are free once it is done
              release(step)
              return step + 1

            def overlapped_step(kk, carry):
              """Step kk's product from the tile made during step kk - 1's, then step kk + 1's
              tile made while it runs (on the last step from a slot not waited for: unused)."""
              step, w = carry
              product(w, lax.rem(step, stages))

              @pl.when(kk + 1 < steps)
              def _():
                plgpu.barrier_wait(produced.at[lax.rem(step + 1, stages)])

              w_next = dequantize(step + 1, k0 + kk + 1)
              plgpu.wgmma_wait(0)
              release(step)
              return step + 1, w_next

            if cfg.overlap:
              @pl.when(steps > 0)
              def _():
                plgpu.barrier_wait(produced.at[lax.rem(step, stages)])

              end, _ = lax.fori_loop(0, steps, overlapped_step, (step, dequantize(step, k0)))
            else:
              end = lax.fori_loop(0, steps, one_step, step)
            o_smem = o_s.at[wg]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            ragged_mosaic_gpu.store_transposed(acc_ref[...].astype(kernel_dtype), o_smem,
                                               interpret)
            plgpu.commit_smem()
            ragged_mosaic_gpu._store_rows(
                o_smem, out_gmem.at[s, :, pl.ds(ni * 2 * bn + wg * bn, bn)], offset,
                load0 + offset, rows, x_rows)
            return end

          if cfg.swap:
            return pl.run_scoped(run_swapped, plgpu.ACC((bn, x_rows), jnp.float32))

          def run(acc_ref):
            def one_step(kk, step):
              slot, kb = lax.rem(step, stages), k0 + kk
              plgpu.barrier_wait(produced.at[slot])
              w = _dequantize(p_s.at[slot, mine], s_s.at[slot, mine], lax.rem(kb, 8) * 2, bn,
                              cfg.dequant, interpret)
              w_buf = w_s.at[wg, lax.rem(step, 2)]
              w_buf[...] = w
              plgpu.commit_smem()
              plgpu.wgmma(acc_ref, x_s.at[slot], w_buf.T)
              plgpu.wgmma_wait(1)       # step - 1's product is done: its slot and buffer free

              @pl.when(kk > 0)
              def _():
                release(step - 1)

              return step + 1

            end = lax.fori_loop(0, steps, one_step, step)
            plgpu.wgmma_wait(0)

            @pl.when(steps > 0)
            def _():
              release(end - 1)

            acc = acc_ref[...]
            out_cols = out_gmem.at[s, :, pl.ds(ni * 2 * bn + wg * bn, bn)]
            for lo in range(0, bm, epi):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              o_s.at[wg][...] = acc[lo:lo + epi].astype(kernel_dtype)
              plgpu.commit_smem()
              first = jnp.clip(offset, lo, lo + epi)
              size = jnp.clip(offset + rows, lo, lo + epi) - first
              ragged_mosaic_gpu._store_rows(o_s.at[wg], out_cols, first - lo, load0 + first,
                                            size, epi)
            return end

          return pl.run_scoped(run, plgpu.ACC((bm, bn), jnp.float32))

        lax.fori_loop(0, local_units, one_unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(
        scoped,
        x_s=plgpu.SMEM((stages, x_tile, BLOCK_K), jnp.bfloat16, transforms=_SWIZZLE),
        p_s=plgpu.SMEM((stages, 2 * bn, BLOCK_K // 2), jnp.uint8),
        s_s=plgpu.SMEM((stages, 2 * bn, SCALE_ROW), jnp.uint8),
        w_s=(None if cfg.swap and not interpret
             else plgpu.SMEM((2, 2, bn, BLOCK_K), jnp.bfloat16, transforms=_SWIZZLE)),
        o_s=plgpu.SMEM((2, x_rows if cfg.swap else epi, bn), kernel_dtype),
        produced=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        collective_axes="wg")

  kernel = plgpu.kernel(
      mxfp4_matmul_kernel,
      out_type=jax.ShapeDtypeStruct((split, m_pad, n), kernel_dtype),
      grid=(num_ctas,),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return kernel(tiles, x, w_packed, w_scale)


def _ptx(cfg: Config, interpret: bool) -> bool:
  """Whether the kernel dequantizes in inline PTX (dequant "ptx" off the interpreter, which
  evaluates "select" with x in its own order)."""
  return cfg.dequant == "ptx" and not interpret


def _grouped(x, w_packed, w_scale, group_sizes, out_dtype, interpret: bool,
             cfg: Config | None) -> jax.Array:
  (m, k), (g, n) = x.shape, w_packed.shape[:2]
  if cfg is None:
    cfg = config(m, k, n, g, out_dtype, num_sms(interpret))
  rows = cfg.x_rows or max(_round8(m), cfg.block_m)
  x_p = permute_x(x) if _ptx(cfg, interpret) else x
  x_p = jnp.pad(x_p, ((0, rows - m), (0, 0))) if rows > m else x_p
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  sizes = jnp.diff(ends, prepend=0)
  sizes_ext = jnp.concatenate([sizes, (m - ends[-1])[None]])   # padding group: rows up to M
  grid_m = -(-(rows + 7 * (g + 1)) // cfg.block_m) + g + 1   # >= the tiles of G + 1 groups
  tiles = ragged_mosaic_gpu.row_tiles(sizes_ext, cfg.block_m, grid_m)
  if cfg.x_rows is not None:    # every tile loads x's rows from row 0: offsets become rows
    tiles = tiles.at[2].add(tiles[1]).at[1].set(0)
  out = _kernel(tiles, x_p, w_packed, w_scale, cfg=cfg, num_ctas=num_sms(interpret),
                out_dtype=out_dtype, interpret=interpret)
  out = out[0, :m] if cfg.split_k == 1 else jnp.sum(out[:, :m], axis=0)
  return out.astype(out_dtype)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret: bool = False,
           config: Config | None = None) -> jax.Array:
  """x [M, K] @ W^T -> [M, N] for W [N, K] as (w_packed [N, K/2], w_scale [N, K/32]) uint8;
  output in x's dtype unless preferred_element_type. Call `supports_matmul` first."""
  if reason := supports_matmul(x, w_packed, w_scale, preferred_element_type=preferred_element_type,
                               interpret=interpret, config=config):
    raise NotImplementedError(reason)
  return _grouped(x, w_packed[None], w_scale[None], jnp.asarray([x.shape[0]], jnp.int32),
                  reference.out_dtype(x, preferred_element_type), interpret, config)


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret: bool = False,
               config: Config | None = None) -> jax.Array:
  """Row r of group g: lhs[r] @ W_g^T for W_g as (w_packed [G, N, K/2], w_scale [G, N, K/32])
  uint8; rows past sum(group_sizes) are zero. Call `supports_ragged_dot` first."""
  if reason := supports_ragged_dot(lhs, w_packed, w_scale, group_sizes,
                                   preferred_element_type=preferred_element_type,
                                   interpret=interpret, config=config):
    raise NotImplementedError(reason)
  return _grouped(lhs, w_packed, w_scale, group_sizes,
                  reference.out_dtype(lhs, preferred_element_type),
                  interpret, config)
