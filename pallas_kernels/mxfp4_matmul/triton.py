"""Triton tier of the MXFP4-weight matmul (k3_techniques.md §7): a Pallas kernel on the Triton
backend for few rows (decode: M <= 16 dense, a few rows per expert grouped), where the Mosaic GPU
kernel is latency-bound.

Weights in the K3 checkpoint layout (k3_hf_names.md): W [N, K] as `w_packed` uint8 [N, K/2]
(element 2j in the low nibble, 2j+1 in the high one, E2M1 bit codes) and `w_scale` uint8
[N, K/32] (E8M0, 2^(s - 127) per block of 32 along K).
  matmul(x [M, K], w_packed, w_scale)        -> [M, N] = x @ W^T
  ragged_dot(lhs [M, K], w_packed [G, N, K/2], w_scale [G, N, K/32], group_sizes [G])
                                             -> [M, N], `jax.lax.ragged_dot`'s semantics with
                                                expert g's weight W_g^T

One launch per call, no XLA op around it but free reshapes (split_k = 1). A program owns block_n
output columns (weight rows) of one row block (dense: grid (N / block_n, cdiv(M, block_m))) or of
one expert (grouped: grid (N / block_n, min(G, M) + 1), below) and loops over K in block_k steps,
which Triton software-pipelines (`num_stages`). `Config.split_k` > 1 divides those steps among
split_k programs (a third grid dim): each adds its fp32 partial into a zeroed fp32 output with
atomic adds, cast to the output dtype after (two small XLA ops around the kernel); the GPU's fp32
atomic add flushes subnormal sums (below 2^-126) to zero. At decoding rows a program's K steps
run one warp per scheduler on fewer programs than SMs; split-K puts split_k times as many
programs in flight at once. Per step it loads
  the packed tile [block_n, block_k/32, 16] uint8 (w_packed viewed as [N, K/32, 16]: a row of
    16 bytes per scale block, 16-byte vector loads),
  its scales [block_n, block_k/32] uint8,
  x's rows [block_m, block_k] bf16, masked to the rows the program owns (no padded copy of x:
    rows past M or outside the group are never read),
dequantizes the low nibbles to W's even columns and the high ones to its odd columns, each
[block_n, block_k/2] bf16 (no interleaving of the weight), splits x's columns into even and odd
ones ([block_m, block_k/2, 2] split along its last axis, in registers) and accumulates in fp32
  acc += x_even @ W_even^T + x_odd @ W_odd^T
(two `tl.dot`s, every dim >= 16: x's rows are padded to block_m = 16 by the masked load).
`Config.swap` computes acc^T [block_n, block_m] = W x^T instead (the weight tile as the MMA's
A operand) and stores it transposed. `Config.fma` keeps the products off the MMA, on the CUDA
cores in fp32: the E2M1 values unscaled (exact in bf16, then fp32), each 32-block's dot with x
summed, times the block's scale (a power of two, exact), accumulated per block across K steps
and summed at the end: acc[bm, bn, nb] += sum_16(v_even x_even + v_odd x_odd) * 2^(s - 127).
Tiles need no MMA shape (block_m, block_n from 1), so a call can run many small programs.

Dequantization (`Config.dequant`), exact in bf16 (a 2-bit-mantissa value times a power of two):
  "exp": integer ops only up to one multiply by 1. The bf16 bits of v(c) * 2^(s - 127) for
    the magnitude bits m = c & 7 of code c are (m << 6) + A for m >= 2 and m * A for m <= 1,
    A = (s - 1) << 7 (the bits of 0.5 * 2^(s - 127)), or'ed with the sign (c & 8) << 12. That
    holds for s in [2, 252] (no overflow or subnormal); outside, s is clamped to s' in [2, 252]
    and the value multiplied by F = 2^(s - s') (bf16; NaN for s = 255), F = 1 otherwise. No
    subnormal operand (so the interpreter's flushing XLA:CPU computes it too; its subnormal
    results are flushed there as the reference's are).
  "shift" (GPU only; the interpreter evaluates "exp"): as the Mosaic GPU kernel's, the code's
    sign and magnitude bits shifted into place, ((b << 12) >> 6) & 0x81C0 (low nibble; b << 8
    for the high one): the bf16 bits of v * 2^-126 (0.5 becomes the subnormal 2^-127), then
    bf16 multiplies by 2^126 and by the scale 2^(s - 127) (0 -> the subnormal 2^-127, 255 ->
    NaN). Three integer ops and two multiplies a weight instead of about seven and one.
  "ptx" (GPU only; the interpreter evaluates "exp"): "shift"'s bits and multiplies written in
    inline PTX (`elementwise_inline_asm`) on 32-bit registers, two weights an instruction: a
    register of 4 packed bytes is spread to two by byte permutes (`prmt`, a byte in each 16-bit
    half), each nibble's sign and magnitude bits shifted and masked into bf16 bit positions for
    both halves at once (`shl`, `and`, `or`), then `mul.rn.bf16x2` by 2^126 and by the scale:
    about 14 instructions per 4 weights, where "shift"'s integer ops take a register a weight.
    The scale's factor is made in PTX too, two bytes a register without compares (s << 7, and
    0x40 where all of s's bits are equal: 0 and 255).
The scales are broadcast along the 16 bytes of their block (a [block_n, block_k/32, 1]
operand), so there is no gather.

MXFP8 activations (`Config.act="mxfp8"`, K3's inference format: its QAT fake-quantizes the
routed experts' inputs to MXFP8 per 32 along K): small XLA ops before the kernel quantize x by
`k3jax.mx.quantize(x, "mxfp8")` (E4M3 elements, E8M0 scales sx per 32 along K, the floor rule)
into E4M3 bytes, each block's 32 columns permuted to [even 16 | odd 16], and fp32 factors
2^(sx - 121) (NaN for 255; normal for every sx of a bf16 x, at most 246). A nibble c becomes
the E4M3 byte ((c & 7) << 2) | ((c & 8) << 4), exactly v(c) * 2^-6 (exponent bits at E4M3's
low exponent bits, mantissa bit at its top mantissa bit; 0.5 becomes the subnormal 2^-7): for
a register r of 4 packed bytes, the low nibbles ((r << 2) & 0x1C1C1C1C) | ((r << 4) &
0x80808080), the high ones ((r >> 2) & 0x1C1C1C1C) | (r & 0x80808080), four weights an op
(inline PTX with dequant "ptx", else the same shifts on bytes), giving W's block as [low 16 |
high 16] = [even | odd], x's order. Each block of 32 along K (a [block_n, 16] packed load, x's
[block_m, 32] bytes) is one fp8 `dot` of K = 32 (the fp8 MMA's K) into fp32, then
  acc += dot * 2^(sx - 121) * 2^(sw - 127)
x's factor first (it also undoes the weights' 2^-6: the partial becomes x times the unscaled
E2M1 values), W's after. The K step's factor and scale tiles are loaded as rows and split into
columns in registers. The dot is a private primitive whose Triton op sets `maxNumImpreciseAcc`
= 32: with jax 0.11.2's `dot_general` lowering (0) Triton refuses wgmma for an fp8 dot into fp32
and runs mma.sync with both operands upcast to fp16 on Hopper. wgmma needs 64 rows of the
result, so on Hopper only `swap` with block_n 64 or 128 runs on the fp8 MMA. Accuracy: x is
rounded to E4M3, a relative error up to 2^-4 per element (~3e-2 relative L2 of the output at
random x); products and block sums are exact in fp32, so the result is the fp32 product of
MXFP8 x and W up to summation order and the MMA's accumulation. A weight past fp32's range
(|v| >= 4 under scale 253, >= 2 under 254) is never formed: its products are rounded once (the
bf16 mode and the reference give inf). The interpreter (XLA:CPU) flushes the subnormal factor
2^-127 of scale byte 0; the GPU keeps it.

Grouped: program (j, t) takes the t-th non-empty group (from group_sizes, loaded whole into
registers: prefix sums clamped to M, ranks of the non-empty groups by `cumsum`), and loops over
its rows in blocks of block_m (each block re-reads the weight tile, from L2); slot t = min(G, M)
stores zeros into the rows past sum(group_sizes), so every output row is written by the kernel.
Empty groups take no slot: their weights are never read, and a call over many experts (G = 896)
with few rows launches min(G, M) + 1 slots per column block, not G.

Constraints (`supports_*` give the reason): an NVIDIA GPU of compute capability >= 8.0 (or
interpret), x bf16, output bf16 or fp32, K a multiple of block_k, N a multiple of block_n, block
sizes powers of two (block_m, block_n >= 16, block_k >= 64), at most MAX_GROUPS groups; "mxfp8"
needs compute capability >= 8.9 (fp8 MMA) and no `fma`. Any M runs; the tier is meant for few
rows (each row block re-reads the weights). Not differentiable by itself (the API's custom VJP
differentiates x through the reference).
"""
import dataclasses
import functools

import jax
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton
import jax.numpy as jnp

from k3jax import mx
from pallas_kernels import tiers
from pallas_kernels.moe_gate_up import triton as gate_up_triton
from pallas_kernels.mxfp4_matmul import reference

BLOCK = 32                      # elements per E8M0 scale along K
HALF = BLOCK // 2               # packed bytes per scale block
DEQUANTS = ("exp", "shift", "ptx")
ACTS = ("bf16", "mxfp8")
MAX_GROUPS = 1 << 14            # group_sizes is loaded whole into one program's registers
MAX_GRID = 65535                # CUDA's limit on the grid's second dim (row blocks or slots)
_BLOCK_K_CHOICES = (512, 256, 128, 64)
_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Config:
  """block_n weight rows (output columns) per program, block_k of K per pipelined step, x's rows
  in blocks of block_m (>= 16, the MMA's smallest dim); Triton's num_warps and num_stages;
  dequant "exp", "shift" or "ptx" (module docstring); swap: acc^T = W x^T (the weight tile as
  the MMA's A operand) instead of acc = x W^T; split_k: programs sharing one output tile's K
  steps (their number divides K / block_k; `fit` lowers it to the largest divisor); fma: the
  products on the CUDA cores instead of the MMA (module docstring; block_m and block_n from 1);
  act: "bf16" (x as given, bf16 MMAs) or "mxfp8" (x quantized to MXFP8, fp8 MMAs per block of
  32, wgmma on Hopper with swap and block_n >= 64; dequant "ptx" converts the nibbles in inline
  PTX, "exp" and "shift" with the same shifts on bytes); unroll: the program's K steps written
  out one after another (no loop, so no software pipeline: every step's loads are independent
  and ptxas may issue them all before the first product) instead of a pipelined loop."""
  block_n: int = 16
  block_k: int = 512
  block_m: int = 16
  num_warps: int = 4
  num_stages: int = 4
  dequant: str = "exp"
  swap: bool = False
  split_k: int = 1
  fma: bool = False
  act: str = "bf16"
  unroll: bool = False


# Candidates for the benchmark sweep (`benchmarks/mxfp4_matmul.py --triton_configs`); block_k
# shrinks to divide K where it does not (`fit`).
CONFIGS = {
    "n16": Config(),
    "shift": Config(dequant="shift"),
    "n32": Config(block_n=32),
    "n64": Config(block_n=64, block_k=256),
    "k256_s6": Config(block_k=256, num_stages=6),
    "k1024_s3": Config(block_k=1024, num_stages=3),
    "w8": Config(block_n=32, num_warps=8),
    "swap64": Config(block_n=64, block_k=256, swap=True),
    "n32_shift": Config(block_n=32, dequant="shift"),
    "n64_shift": Config(block_n=64, block_k=256, dequant="shift"),
    # The dequantization in inline PTX, two weights an instruction (the defaults since
    # 2026-12-03: 1.05-1.1x "shift" dense, 1.3x grouped).
    "n32_ptx": Config(block_n=32, dequant="ptx"),
    "n64_ptx": Config(block_n=64, block_k=256, dequant="ptx"),
    # Split-K, one K step a program and so one stage (no pipeline; a quarter of the shared
    # memory, more programs resident per SM): dense 1.0-1.3x n32_ptx, grouped slower.
    "n32_ptx_k256_s16_st1": Config(block_n=32, block_k=256, dequant="ptx", split_k=16,
                                   num_stages=1),
    "n64_ptx_k256_s16_st1": Config(block_n=64, block_k=256, dequant="ptx", split_k=16,
                                   num_stages=1),
    # Products on the CUDA cores (`fma`): 768 programs of 2 warps at N 3072, ~6 resident per SM.
    # The fastest tier at one row (9.8-10.4 us, H200, 2026-12-03), ~10x slower at 16 rows (each
    # row its own pass over the weight tile); block_n 8 and 16 were 1.5-1.7x slower at one row.
    "fma_n4_w2": Config(block_n=4, block_m=1, num_warps=2, dequant="ptx", fma=True),
    # MXFP8 x on the fp8 MMA (`act`): slower than n32_ptx dense and the grouped default (H100,
    # 2026-12-06), a candidate only. Swapped with 64 or 128 weight rows, wgmma's M on Hopper
    # (sm_90a SASS per K step of 64 x 256 weights: 568 instructions against n32_ptx's 811 for
    # the same count); split-K; n32_ptx's tile unswapped, whose 16-row dots Triton runs on
    # mma.sync with both operands upcast to fp16 on Hopper (native fp8 from sm_89's mma.sync).
    "swap64_fp8": Config(block_n=64, block_k=256, dequant="ptx", swap=True, act="mxfp8"),
    "swap128_fp8": Config(block_n=128, block_k=256, dequant="ptx", swap=True, act="mxfp8"),
    "swap64_fp8_k256_s16_st1": Config(block_n=64, block_k=256, dequant="ptx", swap=True,
                                      split_k=16, num_stages=1, act="mxfp8"),
    "n32_fp8": Config(block_n=32, dequant="ptx", act="mxfp8"),
    # fma with the K steps unrolled, every weight load issued before the first product (sm_90a
    # SASS: all LDGs of the program first, 96 registers): the default at one dense row (9.1 /
    # 9.8 us against fma_n4_w2's 10.3 / 9.9, H200, 2026-12-06; block_n 8 was slower, 10.6-10.9,
    # and was dropped). The MMA tiles unrolled spill (7 steps of [16+, 256] bytes held at once).
    # Split-K over short K steps (atomic adds: candidates only): every program's x slice and
    # weight tile small, the programs (96 column blocks x 8 at K3's N 3072) in one wave.
    "n32_k64_s8": Config(block_n=32, block_k=64, dequant="ptx", split_k=8),
    "n64_k64_s8": Config(block_n=64, block_k=64, dequant="ptx", split_k=8),
    "fma_n4_w2_unroll": Config(block_n=4, block_m=1, num_warps=2, dequant="ptx", fma=True,
                               unroll=True),
}

# Candidates at the MoE's decoding shapes besides the grouped default ("n64_ptx"), for
# `benchmarks/moe_decode_gemm.py` (--grouped_configs: rows "mxfp4_<name>", the packed grouped
# products, gate/up as two calls; --gate_up_configs: rows "fused_<name>", MMA tiles only) and
# `benchmarks/triton_sass.py`. At k3_small's K 512 the default's
# programs run two K steps each, so their count and size, not the K pipeline, set the time.
# n32_k256_ptx (fused gate/up, H100, 2026-12-07): faster from 1 token (8.3 against 9.5 us),
# slower from 16 (28.2 against 26.2); 168 registers against 231 (sm_90a, K 1024, F 512).
DECODE_CONFIGS = {
    "n32_k256_ptx": Config(block_n=32, block_k=256, dequant="ptx"),
    "n16_k512": Config(block_n=16, block_k=512, dequant="ptx"),
    "n32_k512": Config(block_n=32, block_k=512, dequant="ptx"),
    "n64_k512": Config(block_n=64, block_k=512, dequant="ptx"),
    "n64_k256_w8": Config(block_n=64, block_k=256, num_warps=8, dequant="ptx"),
    "n128_k256_w8": Config(block_n=128, block_k=256, num_warps=8, dequant="ptx"),
    "swap64_k256": Config(block_n=64, block_k=256, swap=True, dequant="ptx"),
    "swap128_k256_w8": Config(block_n=128, block_k=256, num_warps=8, swap=True, dequant="ptx"),
    # Shorter K steps, more programs resident: the fused gate/up at the all-experts shape (16
    # tokens, 64 experts, K 512; sm_90a, offline) takes 242 registers in n64_k256 (n64_ptx,
    # the default before 1450d1b: 2 programs an SM), 156 in n64_k128 (3), 116 in n32_k128 (4),
    # 96 in n64_k64 (5: its 520 programs in one wave), none spilling.
    "n64_k256": Config(block_n=64, block_k=256, dequant="ptx"),   # = n64_ptx, by this name
    "n64_k128": Config(block_n=64, block_k=128, dequant="ptx"),
    "n32_k128": Config(block_n=32, block_k=128, dequant="ptx"),
    "n64_k64": Config(block_n=64, block_k=64, dequant="ptx"),
    # Around the short-K default (SHORT_K): narrower and wider tiles, shallower pipelines.
    "n32_k64": Config(block_n=32, block_k=64, dequant="ptx"),
    "n128_k64_w8": Config(block_n=128, block_k=64, num_warps=8, dequant="ptx"),
    "n64_k64_s2": Config(block_n=64, block_k=64, num_stages=2, dequant="ptx"),
    "n64_k64_s3": Config(block_n=64, block_k=64, num_stages=3, dequant="ptx"),
    "n64_k64_w2": Config(block_n=64, block_k=64, num_warps=2, dequant="ptx"),
    # MXFP8 x on the fp8 MMA (fewer instructions a weight; slower at K3's shapes, H100,
    # 2026-12-06): the all-experts shapes' 1024 weight-row blocks of 64 fill the GPU. x rounded
    # to MXFP8 moves the output (2.9e-2 relative L2 from the bf16-x reference in the CPU toy run).
    "swap64_fp8_k256": Config(block_n=64, block_k=256, swap=True, dequant="ptx", act="mxfp8"),
}
# Every named candidate (the names are distinct), for the benchmarks' --configs flags.
ALL_CONFIGS = {**CONFIGS, **DECODE_CONFIGS}


def is_gpu() -> bool:
  """True when the default device (or the abstract mesh's, when lowering ahead of time for
  one) is an NVIDIA GPU with bf16 MMA (compute capability >= 8.0)."""
  return tiers.gpu_compute_capability() >= 80


def _device_kind() -> str:
  return jax.devices()[0].device_kind


def fit(cfg: Config, k: int) -> Config:
  """cfg with block_k halved until it divides K (64 at least; unchanged if none does), then
  split_k lowered to the largest divisor of K / block_k not above it."""
  bk = cfg.block_k
  while k % bk and bk > _BLOCK_K_CHOICES[-1]:
    bk //= 2
  if k % bk:
    return cfg
  split = max(d for d in range(1, max(cfg.split_k, 1) + 1) if (k // bk) % d == 0)
  return dataclasses.replace(cfg, block_k=bk, split_k=split)


# Grouped calls of K <= SHORT_K and at most SHORT_K_MAX_ROWS rows (k3_small's decode) take
# K steps of 64: at the all-experts shapes (16 rows on each of 64 experts, K 512; H100,
# 2026-12-07) "n64_k64" took 19.0 us against n64_ptx's 25.6 (W1 | W3 as one N 1024), 9.7
# against 13.3 (W2). Of its variants (H100, 2026-12-08) two warps ("n64_k64_w2") took W2 in
# 9.0 us against 9.9, three stages ("n64_k64_s3") the fused gate/up in 14.9 against 15.3.
SHORT_K = 512
SHORT_K_MAX_ROWS = 1024


def default_config(m: int, k: int, n: int, grouped: bool, gate_up: bool = False) -> Config:
  """The fastest deterministic candidate measured at the K3 expert shapes (H200, 2026-12-03
  and 2026-12-06): "fma_n4_w2_unroll" dense at one row, "n32_ptx" dense at more, "n64_ptx"
  grouped (split-K's atomic adds are not), "n64_k64_w2" grouped at short K and few rows
  (SHORT_K; "n64_k64_s3" for the fused gate/up, `gate_up`); block_n halved (to 16 at least, 1
  for fma) until it divides N, block_k until it divides K (0 if no power of two from 64 does:
  the call is declined)."""
  one_row = not grouped and m == 1
  if grouped and k <= SHORT_K and m <= SHORT_K_MAX_ROWS:
    cfg = DECODE_CONFIGS["n64_k64_s3" if gate_up else "n64_k64_w2"]
  else:
    cfg = CONFIGS["n64_ptx" if grouped else "fma_n4_w2_unroll" if one_row else "n32_ptx"]
  bn, least = cfg.block_n, 1 if cfg.fma else 16
  while n % bn and bn > least:
    bn //= 2
  cfg = fit(dataclasses.replace(cfg, block_n=bn), k)
  return cfg if k % cfg.block_k == 0 else dataclasses.replace(cfg, block_k=0)


def check_config(cfg: Config, k: int, n: int) -> str | None:
  """None if cfg fits K and N, else why not."""
  mma_least = 1 if cfg.fma else 16
  for name, b, least in (("block_m", cfg.block_m, mma_least), ("block_n", cfg.block_n, mma_least),
                         ("block_k", cfg.block_k, 64)):
    if b < least or b & (b - 1):
      return f"{name}={b} must be a power of two >= {least} (Triton tiles, MMA dims >= 16)"
  if cfg.fma and cfg.swap:
    return "swap transposes the MMA's operands; fma has no MMA"
  if cfg.act not in ACTS:
    return f"act must be one of {ACTS}, got {cfg.act!r}"
  if cfg.fma and cfg.act == "mxfp8":
    return "act='mxfp8' feeds fp8 MMAs; fma has no MMA"
  if cfg.unroll and cfg.act == "mxfp8":
    return "unroll loads whole K steps first; act='mxfp8' loads x block by block"
  if k % cfg.block_k:
    return f"K={k} is not a multiple of block_k={cfg.block_k}"
  if cfg.split_k < 1 or (k // cfg.block_k) % cfg.split_k:
    return (f"split_k={cfg.split_k} must divide K / block_k = {k // cfg.block_k} "
            f"(`fit` lowers it to a divisor)")
  if n % cfg.block_n:
    return f"N={n} is not a multiple of block_n={cfg.block_n}"
  if cfg.dequant not in DEQUANTS:
    return f"dequant must be one of {DEQUANTS}, got {cfg.dequant!r}"
  if cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1) or cfg.num_stages < 1:
    return f"num_warps must be a power of two and num_stages >= 1, got {cfg}"
  return None


def _supports(x, w_packed, w_scale, groups: int, preferred_element_type, interpret: bool,
              config: Config | None) -> str | None:
  out = jax.ShapeDtypeStruct((x.shape[0], w_packed.shape[-2]), jnp.float32)  # split-K's, at most
  if not interpret and (reason := tiers.triton_offsets_reason(x=x, w_packed=w_packed,
                                                              w_scale=w_scale, out=out)):
    return reason
  if not interpret and not is_gpu():
    return (f"needs an NVIDIA GPU of compute capability >= 8.0 or interpret=True, the default "
            f"device is {_device_kind()}")
  if jnp.dtype(x.dtype) != _BF16:
    return f"needs bfloat16 x (the dequantized weight is bf16), got {x.dtype}"
  out_dtype = reference.out_dtype(x, preferred_element_type)
  if out_dtype not in (_BF16, _F32):
    return f"output dtype must be bfloat16 or float32, got {out_dtype}"
  (m, k), n = x.shape, w_packed.shape[-2]
  if m == 0:
    return "M=0: no rows"
  if groups > MAX_GROUPS:
    return f"G={groups} groups > {MAX_GROUPS} (group_sizes is loaded into one program)"
  if config is None and k % _BLOCK_K_CHOICES[-1]:
    return f"K={k} is not a multiple of {_BLOCK_K_CHOICES[-1]} (the smallest block_k)"
  cfg = default_config(m, k, n, groups > 1) if config is None else config
  if reason := check_config(cfg, k, n):
    return reason
  if not interpret and cfg.act == "mxfp8" and tiers.gpu_compute_capability() < 89:
    return (f"act='mxfp8' needs fp8 MMA (compute capability >= 8.9), the default device is "
            f"{_device_kind()}")
  if groups == 1 and pl.cdiv(m, cfg.block_m) > MAX_GRID:
    return f"M={m} needs more than {MAX_GRID} row blocks of {cfg.block_m} (CUDA's grid y)"
  return None


def supports_matmul(x, w_packed, w_scale, *, preferred_element_type=None,
                    interpret: bool = False, config: Config | None = None) -> str | None:
  """None if `matmul` takes this call (shapes checked by the API), else the reason."""
  return _supports(x, w_packed, w_scale, 1, preferred_element_type, interpret, config)


def supports_ragged_dot(lhs, w_packed, w_scale, group_sizes, *, preferred_element_type=None,
                        interpret: bool = False, config: Config | None = None) -> str | None:
  """None if `ragged_dot` takes this call (shapes checked by the API), else the reason."""
  del group_sizes
  return _supports(lhs, w_packed, w_scale, w_packed.shape[0], preferred_element_type, interpret,
                   config)


# ------------------------------------------------------------------------------------------
# Dequantization
# ------------------------------------------------------------------------------------------

def _bf16(bits: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)


def exp_values(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """E2M1 codes (int16, 0-15) times 2^(scale - 127) (scale: E8M0 bytes as int16, broadcast
  against codes) in bf16, "exp" (module docstring): integer ops, then a multiply by F (1 unless
  the scale byte is outside [2, 252])."""
  clamped = jnp.clip(scale, 2, 252)
  a = (clamped - 1) << 7                                    # bf16 bits of 0.5 * 2^(s' - 127)
  f = _bf16(jnp.where(scale == 255, 0x7FC0, (scale - clamped + 127) << 7))
  m = codes & 7
  magnitude = jnp.where(m >= 2, (m << 6) + a, m * a)
  return _bf16(magnitude | ((codes & 8) << 12)) * f


def shift_bits(shifted: jax.Array) -> jax.Array:
  """int16 whose top nibble (bits 15-12) is an E2M1 code -> the bf16 bits (int16) of its value
  times 2^-126: ((c << 12) >> 6) & 0x81C0 with the arithmetic shift spreading the sign."""
  return (shifted >> 6) & jnp.int16(0x81C0 - 0x10000)


def e8m0_bf16(scale: jax.Array) -> jax.Array:
  """E8M0 bytes (as int16) -> 2^(s - 127) in bf16 (0 -> the subnormal 2^-127, 255 -> NaN)."""
  bits = jnp.where(scale == 255, jnp.int16(0x7FC0),
                   jnp.where(scale == 0, jnp.int16(0x0040), scale << 7))
  return _bf16(bits)


# Four packed bytes ($2) and their scale's bf16x2 ($3, $4, equal) -> the values of one nibble of
# each ($0: bytes 0, 1; $1: bytes 2, 3), bf16x2 registers. A byte in each 16-bit half (prmt),
# then per half: the nibble's sign bit to 15 and its magnitude bits to 8..6 (the bf16 bits of
# v * 2^-126; shifts {s} and {m}: 12 and 6 for the low nibble, 8 and 2 for the high one), times
# 2^126 (0x7E80) and the scale, or only 2^126 for the unscaled values (the and / and / or pair
# becomes one LOP3 in ptxas). One output a call: Pallas's lowering of `elementwise_inline_asm`
# returns one result.
_PTX_PAIR = """prmt.b32 t, $2, z, {select};
shl.b32 a, t, {m};
shl.b32 b, t, {s};
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
{scale}"""
_PTX_SCALED = "mul.rn.bf16x2 a, a, c;\nmul.rn.bf16x2 ${out}, a, ${factor};\n"
_PTX_UNSCALED = "mul.rn.bf16x2 ${out}, a, c;\n"


def _ptx_values(packed: jax.Array, factor: jax.Array | None, high: bool) -> jax.Array:
  """packed [..., 16] uint8, factor bf16 of its shape -> the low (or high) nibbles' values
  (factor None: the E2M1 values unscaled)."""
  shifts = dict(s=8, m=2) if high else dict(s=12, m=6)
  tail = _PTX_UNSCALED if factor is None else _PTX_SCALED
  pairs = [_PTX_PAIR.format(select=select, scale=tail.format(out=out, factor=3 + out), **shifts)
           for out, select in enumerate(("0x4140", "0x4342"))]
  asm = "".join(["{\n.reg .b32 t, a, b, c, z;\nmov.b32 c, 0x7E807E80;\nmov.b32 z, 0;\n",
                 *pairs, "}"])
  args = [packed] if factor is None else [packed, factor]
  [out] = plgpu_triton.elementwise_inline_asm(
      asm, args=args, constraints=",".join(["=r,=r,r"] + ["r,r"] * (len(args) - 1)), pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)])
  return out


# The E8M0 byte s in each 16-bit half of register t -> 2^(s - 127) as bf16x2 into ${out} (t, u
# clobbered), `e8m0_bf16` without compares: s << 7, or'ed with 0x40 where all 8 bits of s are
# equal (s = 0: the subnormal 2^-127; s = 255: NaN 0x7FC0): u = (t ^ (t >> 1)) & 0x7F is 0
# exactly then, and u + 0x7F sets bit 7 exactly when not.
E8M0_PAIR_PTX = """shr.b32 u, t, 1;
xor.b32 u, u, t;
and.b32 u, u, 0x007F007F;
add.u32 u, u, 0x007F007F;
not.b32 u, u;
shr.b32 u, u, 1;
and.b32 u, u, 0x00400040;
shl.b32 t, t, 7;
or.b32 ${out}, t, u;
"""
# Four E8M0 bytes ($2) -> their factors as two bf16x2 registers ($0: bytes 0, 1; $1: bytes 2, 3):
# a byte in each 16-bit half (prmt), then `E8M0_PAIR_PTX`.
_PTX_FACTOR_PAIR = "prmt.b32 t, $2, 0, {select};\n" + E8M0_PAIR_PTX


def _ptx_factor(scale: jax.Array) -> jax.Array:
  """E8M0 bytes (uint8) -> 2^(s - 127) in bf16, `e8m0_bf16`'s values, four bytes a call."""
  pairs = [_PTX_FACTOR_PAIR.format(select=select, out=out)
           for out, select in enumerate(("0x4140", "0x4342"))]
  [out] = plgpu_triton.elementwise_inline_asm(
      "".join(["{\n.reg .b32 t, u;\n", *pairs, "}"]), args=[scale],
      constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(scale.shape, jnp.bfloat16)])
  return out


def dequantize(packed: jax.Array, scale: jax.Array, dequant: str,
               interpret: bool) -> tuple[jax.Array, jax.Array]:
  """packed [bn, nb, 16] uint8 and scale [bn, nb] uint8 -> (W's even columns, W's odd columns),
  each [bn, nb * 16] bf16."""
  bn, nb, _ = packed.shape
  if dequant == "ptx" and not interpret:
    factor = jnp.broadcast_to(_ptx_factor(scale)[:, :, None], packed.shape)
    lo, hi = (_ptx_values(packed, factor, high) for high in (False, True))
    return lo.reshape(bn, nb * HALF), hi.reshape(bn, nb * HALF)
  b = packed.astype(jnp.int16)
  s = lax.broadcast_in_dim(scale.astype(jnp.int16), (bn, nb, 1), (0, 1))
  if dequant == "shift" and not interpret:   # XLA:CPU flushes the bf16 subnormal of code 0.5
    factor = e8m0_bf16(s)
    two126 = jnp.asarray(2.0 ** 126, jnp.bfloat16)
    lo = _bf16(shift_bits(b << 12)) * two126 * factor
    hi = _bf16(shift_bits(b << 8)) * two126 * factor
  else:
    lo, hi = exp_values(b & 15, s), exp_values(b >> 4, s)
  return lo.reshape(bn, nb * HALF), hi.reshape(bn, nb * HALF)


def values(packed: jax.Array, dequant: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """packed [bn, nb, 16] uint8 -> the E2M1 values of its low and high nibbles, unscaled, each
  [bn, nb, 16] bf16 (exact)."""
  if dequant == "ptx" and not interpret:
    return tuple(_ptx_values(packed, None, high) for high in (False, True))
  b = packed.astype(jnp.int16)
  one = jnp.full(b.shape, 127, jnp.int16)                   # E8M0 of 1
  return exp_values(b & 15, one), exp_values(b >> 4, one)


def e8m0_f32(scale: jax.Array) -> jax.Array:
  """E8M0 bytes -> 2^(s - 127) in fp32 (0 -> the subnormal 2^-127, 255 -> NaN)."""
  s = scale.astype(jnp.int32)
  bits = jnp.where(s == 255, 0x7FC00000, jnp.where(s == 0, 0x00400000, s << 23))
  return lax.bitcast_convert_type(bits, jnp.float32)


def x_factor(scale: jax.Array) -> jax.Array:
  """x's E8M0 bytes s (at most 246 from a bf16 x, or 255) -> 2^(s - 121) = 2^(s - 127) * 2^6 in
  fp32, the factor that also undoes the weights' E4M3 form (v * 2^-6); NaN for 255."""
  s = scale.astype(jnp.int32)
  return lax.bitcast_convert_type(jnp.where(s == 255, 0x7FC00000, (s + 6) << 23), jnp.float32)


# ------------------------------------------------------------------------------------------
# MXFP8 activations: the nibbles as E4M3 bytes
# ------------------------------------------------------------------------------------------

def e4m3_bytes(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """packed uint8 -> the E4M3 bytes (uint8) of its low and high nibbles' values times 2^-6: the
  code's exponent and mantissa bits at bits 4-2, its sign at bit 7."""
  low = ((packed << 2) & 0x1C) | ((packed << 4) & 0x80)
  high = ((packed >> 2) & 0x1C) | (packed & 0x80)
  return low, high


# A register of 4 packed bytes ($1) -> the E4M3 bytes of one nibble of each ($0), four weights
# an instruction (the and / or pairs become LOP3s in ptxas).
_PTX_E4M3 = {
    False: "shl.b32 a, $1, 2;\nshl.b32 b, $1, 4;\nand.b32 a, a, 0x1C1C1C1C;\n"
           "and.b32 b, b, 0x80808080;\n",
    True: "shr.b32 a, $1, 2;\nand.b32 a, a, 0x1C1C1C1C;\nand.b32 b, $1, 0x80808080;\n",
}


def fp8_weights(packed: jax.Array, dequant: str, interpret: bool) -> jax.Array:
  """packed [bn, 16] uint8 (a block of 32 weights a row) -> W's block [bn, 32] as float8_e4m3fn,
  each weight times 2^-6 (exact), the low nibbles (W's even columns) then the high ones."""
  bn = packed.shape[0]
  if dequant == "ptx" and not interpret:
    low, high = (plgpu_triton.elementwise_inline_asm(
        "{\n.reg .b32 a, b;\n" + _PTX_E4M3[h] + "or.b32 $0, a, b;\n}", args=[packed],
        constraints="=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int8)])[0]
                 for h in (False, True))
  else:
    low, high = e4m3_bytes(packed)
  w = jnp.stack([low, high], axis=-1).transpose(0, 2, 1).reshape(bn, BLOCK)
  return lax.bitcast_convert_type(w, jnp.float8_e4m3fn)


def _columns(tile: jax.Array) -> list[jax.Array]:
  """tile [p, nb] -> its nb columns, each [p] (split in registers: `lax.split` lowers to
  reshapes and Triton's split)."""
  return [c.reshape(tile.shape[0]) for c in jnp.split(tile, tile.shape[1], axis=1)]


# ------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------

def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [p, k] @ b [q, k]^T -> [p, q] fp32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# fp8 a [p, 32] @ b [q, 32]^T -> [p, q] fp32 whose Triton dot lets the MMA accumulate its K = 32
# (`maxNumImpreciseAcc`). jax 0.11.2's lowering of `dot_general` leaves that 0, and Triton then
# refuses Hopper's wgmma for an fp8 dot into fp32 and falls back to mma.sync, which on sm_90
# upcasts both operands to fp16 (a conversion per element). Elsewhere (the interpreter) a plain
# dot_general.
_fp8_dot_p = jax_core.Primitive("mxfp4_fp8_dot")
_fp8_dot_p.def_impl(lambda a, b: _dot_t(a, b))
_fp8_dot_p.def_abstract_eval(
    lambda a, b: jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32))
mlir.register_lowering(_fp8_dot_p, mlir.lower_fun(_dot_t, multiple_results=False))


@triton_lowering.register_lowering(_fp8_dot_p)
def _fp8_dot_lowering(ctx, a, b):
  [out] = ctx.avals_out
  acc = triton_lowering._zeros(  # pylint: disable=protected-access
      ir.RankedTensorType.get(out.shape, ir.F32Type.get()))
  return tt_dialect.dot(a, tt_dialect.trans(b, (1, 0)), acc, max_num_imprecise_acc=BLOCK)


def _aligned(offset, multiple: int):
  """`pl.multiple_of` of a traced offset; an unrolled step's offset may be a Python int."""
  return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _rows(first, end, x_ref, xs_ref, p_ref, s_ref, out_ref, group, n0, cfg: Config,
          interpret: bool):
  """out[first:end, n0:n0 + bn] = x[first:end] @ W_group[n0:n0 + bn]^T, in row blocks of
  block_m (end - first rows, any number >= 0); with split_k > 1, this program's share of K
  (grid dim 2) added into out atomically. act "mxfp8": x_ref holds x's E4M3 bytes (each block's
  columns in `fp8_weights`'s order) and xs_ref their factors [M, K/32] fp32 (`x_factor`), else
  None."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  nb = bk // BLOCK
  steps = x_ref.shape[1] // bk // cfg.split_k
  k_first = pl.program_id(2) * steps if cfg.split_k > 1 else 0

  def row_block(r0, valid):
    valid = valid[:, None]                                   # [bm, 1]

    def load(kk):
      """K step kk's packed tile [bn, nb, 16] and scales [bn, nb] (uint8), x's rows [bm, bk]."""
      blocks = pl.ds(_aligned(kk * nb, nb), nb)
      x = plgpu_triton.load(x_ref.at[pl.ds(r0, bm), pl.ds(_aligned(kk * bk, bk), bk)],
                            mask=valid, other=0)
      return p_ref[group, pl.ds(n0, bn), blocks, :], s_ref[group, pl.ds(n0, bn), blocks], x

    def step(kk, acc, tiles=None):
      p, s, x = load(kk) if tiles is None else tiles
      return _mma_step(acc, _halves(x), p, s, cfg, interpret)

    def fp8_step(kk, acc):
      k0 = _aligned(kk * bk, bk)
      blocks = pl.ds(_aligned(kk * nb, nb), nb)
      fw = _columns(e8m0_f32(s_ref[group, pl.ds(n0, bn), blocks]))
      fx = _columns(plgpu_triton.load(xs_ref.at[pl.ds(r0, bm), blocks], mask=valid, other=0))
      for b in range(nb):
        w = fp8_weights(p_ref[group, pl.ds(n0, bn), kk * nb + b, :], cfg.dequant, interpret)
        x = lax.bitcast_convert_type(
            plgpu_triton.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0 + b * BLOCK, BLOCK)],
                              mask=valid, other=0), jnp.float8_e4m3fn)
        if cfg.swap:      # x's factor first: the product of x and the unscaled E2M1 values
          acc += _fp8_dot_p.bind(w, x) * fx[b][None, :] * fw[b][:, None]
        else:
          acc += _fp8_dot_p.bind(x, w) * fx[b][:, None] * fw[b][None, :]
      return acc

    def fma_step(kk, acc, tiles=None):
      p, s, x = load(kk) if tiles is None else tiles
      x_even, x_odd = lax.unstack(x.astype(jnp.float32).reshape(bm, 1, nb, HALF, 2), axis=4)
      v_even, v_odd = (v.astype(jnp.float32)[None] for v in values(p, cfg.dequant, interpret))
      part = jnp.sum(v_even * x_even + v_odd * x_odd, axis=3)   # [bm, bn, nb]: a block's dot
      return acc + part * e8m0_f32(s)[None]

    def k_steps(body, acc):
      if not cfg.unroll:
        return lax.fori_loop(k_first, k_first + steps, body, acc)
      tiles = [load(k_first + i) for i in range(steps)]    # every load before any product
      for i, t in enumerate(tiles):
        acc = body(k_first + i, acc, t)
      return acc

    if cfg.fma:
      acc = k_steps(fma_step, jnp.zeros((bm, bn, nb), jnp.float32)).sum(axis=2)
    else:
      shape = (bn, bm) if cfg.swap else (bm, bn)
      acc = k_steps(fp8_step if cfg.act == "mxfp8" else step, jnp.zeros(shape, jnp.float32))
      if cfg.swap:
        acc = acc.T
    tile = (pl.ds(r0, bm), pl.ds(n0, bn))
    if cfg.split_k > 1 and interpret:     # programs run one by one there; no masked atomics
      mine = plgpu_triton.load(out_ref.at[tile], mask=valid, other=0)
      plgpu_triton.store(out_ref.at[tile], mine + acc, mask=valid)
    elif cfg.split_k > 1:
      plgpu_triton.atomic_add(out_ref, tile, acc, mask=jnp.broadcast_to(valid, (bm, bn)))
    else:
      plgpu_triton.store(out_ref.at[tile], acc.astype(out_ref.dtype), mask=valid)

  _row_blocks(first, end, bm, row_block)


def _row_blocks(first, end, bm: int, body) -> None:
  """body(r0, valid) for each block [r0, r0 + bm) of the rows [first, end) (any number >= 0);
  valid [bm] marks the block's rows below end."""
  def row_block(r, carry):
    r0 = first + r * bm
    body(r0, r0 + jnp.arange(bm) < end)
    return carry

  lax.fori_loop(0, pl.cdiv(end - first, bm), row_block, 0)


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x's rows [bm, bk] -> (even columns, odd columns), each [bm, bk / 2]: the low and high
  nibbles' partners."""
  return lax.unstack(x.reshape(x.shape[0], x.shape[1] // 2, 2), axis=2)


def _mma_step(acc, x_halves, p, s, cfg: Config, interpret: bool):
  """acc + x @ W^T for one K step (acc + W @ x^T with cfg.swap): W's packed tile p [bn, nb,
  16] and scales s [bn, nb] dequantized, dotted with x's halves (`_halves`) on the MMA."""
  (x_even, x_odd), (w_even, w_odd) = x_halves, dequantize(p, s, cfg.dequant, interpret)
  if cfg.swap:
    return acc + _dot_t(w_even, x_even) + _dot_t(w_odd, x_odd)
  return acc + _dot_t(x_even, w_even) + _dot_t(x_odd, w_odd)


def _zero_rows(first, end, out_ref, n0, cfg: Config):
  """out[first:end, n0:n0 + bn] = 0."""
  bm, bn = cfg.block_m, cfg.block_n

  def row_block(r0, valid):
    valid = valid[:, None]
    plgpu_triton.store(out_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)],
                       jnp.zeros((bm, bn), out_ref.dtype), mask=valid)

  _row_blocks(first, end, bm, row_block)


def _group_slots(past, m: int, out_ref, n0, cfg: Config, rows) -> None:
  """A grouped kernel's slot t = program_id(1) below the last runs rows() (its group's rows);
  the last slot zeros out's rows [past, m), past every group."""
  t, last = pl.program_id(1), pl.num_programs(1) - 1
  pl.when(t < last)(rows)
  pl.when(t == last)(lambda: _zero_rows(past, m, out_ref, n0, cfg))


def _x_factors(refs, cfg: Config):
  """x's factor ref from a kernel's trailing refs (first with act "mxfp8"), else None."""
  return refs[0] if cfg.act == "mxfp8" else None


def _dense_kernel(x_ref, p_ref, s_ref, *refs, cfg: Config, interpret: bool):
  """Program (j, i[, s]): columns [j bn, + bn) of rows [i bm, + bm) (of K's s-th share). refs:
  x's factors with act "mxfp8", then out, or (the zeroed fp32 output aliased to out, out) with
  split_k > 1."""
  out_ref = refs[-1]
  m = x_ref.shape[0]
  n0 = pl.multiple_of(pl.program_id(0) * cfg.block_n, cfg.block_n)
  first = pl.program_id(1) * cfg.block_m
  _rows(first, jnp.minimum(first + cfg.block_m, m), x_ref, _x_factors(refs, cfg), p_ref, s_ref,
        out_ref, 0, n0, cfg, interpret)


def _grouped_kernel(gs_ref, x_ref, p_ref, s_ref, *refs, cfg: Config, interpret: bool):
  """Program (j, t[, s]): columns [j bn, + bn) of the rows of the t-th non-empty group (of K's
  s-th share); with split_k = 1 the last slot zeros the rows past the groups (with split_k > 1
  the output starts zeroed). refs as `_dense_kernel`'s."""
  out_ref = refs[-1]
  m = x_ref.shape[0]
  n0 = pl.multiple_of(pl.program_id(0) * cfg.block_n, cfg.block_n)
  group, first, end, past = _slot_group(gs_ref, p_ref.shape[0], m)
  rows = functools.partial(_rows, first, end, x_ref, _x_factors(refs, cfg), p_ref, s_ref,
                           out_ref, group, n0, cfg, interpret)
  if cfg.split_k > 1:
    rows()
  else:
    _group_slots(past, m, out_ref, n0, cfg, rows)


def _slot_group(gs_ref, g: int, m: int):
  """(group, first, end, past) for grid slot t = program_id(1): the t-th non-empty group of
  group_sizes (g of them) and its rows [first, end) of the m (end = 0 if there is none), and
  the first row past every group."""
  g_pad = pl.next_power_of_2(g)
  t = pl.program_id(1)
  idx = jnp.arange(g_pad)
  sizes = plgpu_triton.load(gs_ref.at[pl.ds(0, g_pad)], mask=idx < g, other=0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)            # group g: rows [starts, ends)
  starts = jnp.minimum(jnp.cumsum(sizes) - sizes, m)
  nonempty = (ends > starts).astype(jnp.int32)
  mine = (nonempty > 0) & (jnp.cumsum(nonempty) == t + 1)
  group = jnp.sum(jnp.where(mine, idx, 0))
  first = jnp.sum(jnp.where(mine, starts, 0))
  end = jnp.sum(jnp.where(mine, ends, 0))           # 0 (no rows) when there is no t-th group
  return group, first, end, jnp.max(ends)


# jitted: every layer's call shares one lowering (and one Triton kernel for XLA to build)
@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def _call(x, w_packed, w_scale, group_sizes, *, cfg: Config, out_dtype, interpret: bool):
  """x [M, K], w_packed [G, N, K/2], w_scale [G, N, K/32], group_sizes [G] int32 or None
  (dense: G = 1) -> [M, N] out_dtype."""
  (m, k), (g, n) = x.shape, w_packed.shape[:2]
  packed = w_packed.reshape(g, n, k // BLOCK, HALF)           # free: a row of 16 bytes a block
  params = plgpu_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  split = cfg.split_k > 1
  out_shape = jax.ShapeDtypeStruct((m, n), jnp.float32 if split else out_dtype)
  if cfg.act == "mxfp8":       # XLA ops: x's E4M3 bytes and factors, after the weights
    x8, xs = (lax.bitcast_convert_type(a, jnp.uint8) for a in mx.quantize(x, "mxfp8", axis=-1))
    x8 = x8.reshape(m, k // BLOCK, HALF, 2).swapaxes(2, 3).reshape(m, k)   # [even | odd]
    operands = (x8, packed, w_scale, x_factor(xs))
  else:
    operands = (x, packed, w_scale)
  if group_sizes is None:
    kernel, name, rows = _dense_kernel, "mxfp4_matmul_triton", pl.cdiv(m, cfg.block_m)
  else:
    operands = (group_sizes.astype(jnp.int32), *operands)
    kernel, name, rows = _grouped_kernel, "mxfp4_ragged_dot_triton", min(g, m) + (not split)
  grid = (n // cfg.block_n, rows, cfg.split_k) if split else (n // cfg.block_n, rows)
  if split:
    operands = (*operands, jnp.zeros((m, n), jnp.float32))
  out = pl.pallas_call(
      functools.partial(kernel, cfg=cfg, interpret=interpret), out_shape=out_shape, grid=grid,
      input_output_aliases={len(operands) - 1: 0} if split else {}, compiler_params=params,
      interpret=interpret, name=name,
  )(*operands)
  return out.astype(out_dtype)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret: bool = False,
           config: Config | None = None) -> jax.Array:
  """x [M, K] @ W^T -> [M, N] for W [N, K] as (w_packed [N, K/2], w_scale [N, K/32]) uint8;
  output in x's dtype unless preferred_element_type. Call `supports_matmul` first."""
  if reason := supports_matmul(x, w_packed, w_scale, preferred_element_type=preferred_element_type,
                               interpret=interpret, config=config):
    raise NotImplementedError(reason)
  (m, k), n = x.shape, w_packed.shape[0]
  cfg = default_config(m, k, n, False) if config is None else config
  return _call(x, w_packed[None], w_scale[None], None, cfg=cfg,
               out_dtype=reference.out_dtype(x, preferred_element_type), interpret=interpret)


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret: bool = False,
               config: Config | None = None) -> jax.Array:
  """Row r of group g: lhs[r] @ W_g^T for W_g as (w_packed [G, N, K/2], w_scale [G, N, K/32])
  uint8; rows past sum(group_sizes) are zero. Call `supports_ragged_dot` first."""
  if reason := supports_ragged_dot(lhs, w_packed, w_scale, group_sizes,
                                   preferred_element_type=preferred_element_type,
                                   interpret=interpret, config=config):
    raise NotImplementedError(reason)
  (m, k), n = lhs.shape, w_packed.shape[1]
  cfg = default_config(m, k, n, True) if config is None else config
  return _call(lhs, w_packed, w_scale, group_sizes, cfg=cfg,
               out_dtype=reference.out_dtype(lhs, preferred_element_type), interpret=interpret)


# ------------------------------------------------------------------------------------------
# The MoE experts' first product on packed W1 and W3: gather, both products, SiTU
# ------------------------------------------------------------------------------------------

def _gate_up_rows(first, end, rows_ref, x_ref, weights, h_ref, group, n0, cfg: Config,
                  situ, interpret: bool):
  """h[first:end, n0:n0 + bn] = situ(x[rows] @ W1_group^T, x[rows] @ W3_group^T) for the
  group's sorted rows [first, end) in row blocks of block_m (`_gate_up_tile`)."""
  bm, bn = cfg.block_m, cfg.block_n

  def row_block(r0, valid):
    gate, up = _gate_up_tile(r0, valid, rows_ref, x_ref, weights, group, n0, cfg, interpret)
    plgpu_triton.store(h_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)],
                       situ(gate, up).astype(h_ref.dtype), mask=valid[:, None])

  _row_blocks(first, end, bm, row_block)


def _gate_up_tile(r0, valid, rows_ref, x_ref, weights, group, n0, cfg: Config,
                  interpret: bool):
  """(x[rows] @ W1_group^T, x[rows] @ W3_group^T) [bm, bn] fp32 for the sorted rows [r0, +
  bm) (valid marks the real ones) and columns [n0, + bn): each row's token index from
  rows_ref, its x row gathered per K step and dotted with both weights' dequantized tiles.
  weights: ((w1 packed ref, w1 scale ref), (w3 packed ref, w3 scale ref))."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  nb = bk // BLOCK
  tokens = plgpu_triton.load(rows_ref.at[pl.ds(r0, bm)], mask=valid, other=0)

  def step(kk, acc):
    x = _halves(x_ref[tokens, pl.ds(_aligned(kk * bk, bk), bk)])   # one row a token
    blocks = pl.ds(_aligned(kk * nb, nb), nb)
    return tuple(_mma_step(a, x, p_ref[group, pl.ds(n0, bn), blocks, :],
                           s_ref[group, pl.ds(n0, bn), blocks], cfg, interpret)
                 for (p_ref, s_ref), a in zip(weights, acc))

  zeros = jnp.zeros((bm, bn), jnp.float32)
  return lax.fori_loop(0, x_ref.shape[1] // bk, step, (zeros, zeros))


def _gate_up_kernel(gs_ref, rows_ref, x_ref, p1_ref, s1_ref, p3_ref, s3_ref, h_ref, *,
                    cfg: Config, situ, interpret: bool):
  """Program (j, t): columns [j bn, + bn) of h for the rows of the t-th non-empty group; the
  last slot zeros the rows past the groups."""
  m = rows_ref.shape[0]
  n0 = pl.multiple_of(pl.program_id(0) * cfg.block_n, cfg.block_n)
  group, first, end, past = _slot_group(gs_ref, p1_ref.shape[0], m)
  _group_slots(past, m, h_ref, n0, cfg, lambda: _gate_up_rows(
      first, end, rows_ref, x_ref, ((p1_ref, s1_ref), (p3_ref, s3_ref)), h_ref, group, n0, cfg,
      situ, interpret))


def supports_gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes, *,
                     interpret: bool = False, config: Config | None = None) -> str | None:
  """None if `gate_up` takes this call (shapes checked by the API), else the reason: the
  ragged_dot tier's conditions on the gathered rows and each weight, and an MMA tile config
  (no split-K, swap, fma or MXFP8 x)."""
  m = rows.shape[0]
  rows_x = jax.ShapeDtypeStruct((m, x.shape[1]), x.dtype)
  for packed, scale in ((w1_packed, w1_scale), (w3_packed, w3_scale)):
    if reason := supports_ragged_dot(rows_x, packed, scale, group_sizes, interpret=interpret,
                                     config=config):
      return reason
  if not interpret and (reason := tiers.triton_offsets_reason(x=x, rows=rows)):
    return reason
  if x.shape[0] == 0:
    return "no tokens"
  cfg = (default_config(m, x.shape[1], w1_packed.shape[1], True, gate_up=True) if config is None
         else config)
  if cfg.split_k > 1 or cfg.swap or cfg.fma or cfg.act != "bf16":
    return (f"gate_up takes an MMA tile of bf16 x without split-K, swap or fma, got split_k="
            f"{cfg.split_k}, swap={cfg.swap}, fma={cfg.fma}, act={cfg.act!r}")
  return None


@functools.partial(jax.jit, static_argnames=("beta1", "beta2", "interpret", "config"))
def gate_up(x: jax.Array, rows: jax.Array, w1_packed: jax.Array, w1_scale: jax.Array,
            w3_packed: jax.Array, w3_scale: jax.Array, group_sizes: jax.Array, *, beta1: float,
            beta2: float, interpret: bool = False, config: Config | None = None) -> jax.Array:
  """h [M, F] = SiTU(x[rows] W1_g^T, x[rows] W3_g^T) (report Eq. 11) in x's dtype for the
  rows of group g (rows [M] token indices into x [N, K], sorted by group; rows past
  sum(group_sizes) give zeros), W1 / W3 packed as (w_packed [G, F, K/2], w_scale [G, F, K/32])
  uint8: one launch for the gather, both products (fp32) and SiTU (`moe_gate_up.triton`'s,
  tanh.approx on a GPU). Call `supports_gate_up` first."""
  if reason := supports_gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes,
                                interpret=interpret, config=config):
    raise NotImplementedError(reason)
  (m,), (g, f, half) = rows.shape, w1_packed.shape
  k = 2 * half
  cfg = default_config(m, k, f, True, gate_up=True) if config is None else config
  tanh = jnp.tanh if interpret else plgpu_triton.approx_tanh

  def situ(gate, up):
    a, b, *_ = gate_up_triton.situ_factors(gate, up, beta1, beta2, tanh)
    return a * b

  view = lambda p: p.reshape(g, f, k // BLOCK, HALF)         # free: a row of 16 bytes a block
  return pl.pallas_call(
      functools.partial(_gate_up_kernel, cfg=cfg, situ=situ, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
      grid=(f // cfg.block_n, min(g, m) + 1),
      compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages),
      interpret=interpret, name="mxfp4_gate_up_triton",
  )(group_sizes.astype(jnp.int32), rows.astype(jnp.int32), x, view(w1_packed), w1_scale,
    view(w3_packed), w3_scale)


# ------------------------------------------------------------------------------------------
# The MoE experts whole: gather, W1 and W3, SiTU, W2, in one launch
# ------------------------------------------------------------------------------------------

FFN_BLOCK_D = 128      # W2's output columns per product of the down step


def _ffn_kernel(gs_ref, rows_ref, x_ref, p1_ref, s1_ref, p3_ref, s3_ref, p2_ref, s2_ref,
                out_ref, *, cfg: Config, situ, interpret: bool):
  """Program (j, t): hidden columns [j bn, + bn) of the rows of the t-th non-empty group: h's
  tile [bm, bn] (`_gate_up_rows`' products and SiTU, rounded to x's dtype), then its part of
  the down product, h_tile @ W2_group[:, j bn: + bn]^T [bm, D] in fp32, into out[j]; the last
  slot zeros out[j]'s rows past the groups."""
  bm, bn = cfg.block_m, cfg.block_n
  d = out_ref.shape[2]
  bd = min(FFN_BLOCK_D, d)
  j = pl.program_id(0)
  m = rows_ref.shape[0]
  n0 = pl.multiple_of(j * bn, bn)
  w2_blocks = pl.ds(pl.multiple_of(j * (bn // BLOCK), bn // BLOCK), bn // BLOCK)
  group, first, end, past = _slot_group(gs_ref, p1_ref.shape[0], m)

  def row_block(r0, valid):
    gate, up = _gate_up_tile(r0, valid, rows_ref, x_ref, ((p1_ref, s1_ref), (p3_ref, s3_ref)),
                             group, n0, cfg, interpret)
    h = _halves(situ(gate, up).astype(x_ref.dtype))

    def down(c, carry):
      cols = pl.ds(pl.multiple_of(c * bd, bd), bd)
      part = _mma_step(jnp.zeros((bm, bd), jnp.float32), h, p2_ref[group, cols, w2_blocks, :],
                       s2_ref[group, cols, w2_blocks], cfg, interpret)
      plgpu_triton.store(out_ref.at[j, pl.ds(r0, bm), cols], part, mask=valid[:, None])
      return carry

    lax.fori_loop(0, d // bd, down, 0)

  def zero_rows(r0, valid):
    def chunk(c, carry):
      cols = pl.ds(pl.multiple_of(c * bd, bd), bd)
      plgpu_triton.store(out_ref.at[j, pl.ds(r0, bm), cols], jnp.zeros((bm, bd), jnp.float32),
                         mask=valid[:, None])
      return carry
    lax.fori_loop(0, d // bd, chunk, 0)

  t, last = pl.program_id(1), pl.num_programs(1) - 1
  pl.when(t < last)(lambda: _row_blocks(first, end, bm, row_block))
  pl.when(t == last)(lambda: _row_blocks(past, m, bm, zero_rows))


def supports_expert_ffn(x, order, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                        w2_scale, group_sizes, *, interpret: bool = False,
                        config: Config | None = None) -> str | None:
  """None if `expert_ffn` takes this call (shapes checked by the API), else the reason:
  `supports_gate_up`'s, block_n (W2's K step) at least 32, and W2's output width D a power of
  two from 16 or a multiple of FFN_BLOCK_D."""
  if reason := supports_gate_up(x, order, w1_packed, w1_scale, w3_packed, w3_scale,
                                group_sizes, interpret=interpret, config=config):
    return reason
  m, f, d = order.shape[0], w1_packed.shape[1], w2_packed.shape[1]
  cfg = default_config(m, x.shape[1], f, True, gate_up=True) if config is None else config
  if cfg.block_n < BLOCK:
    return f"block_n={cfg.block_n} is W2's K step: at least one scale block ({BLOCK})"
  if d % FFN_BLOCK_D and (d < 16 or d & (d - 1)):
    return f"W2's output width D={d} must be a power of two >= 16 or a multiple of {FFN_BLOCK_D}"
  parts = jax.ShapeDtypeStruct((f // cfg.block_n, m, d), jnp.float32)
  if not interpret and (reason := tiers.triton_offsets_reason(
      w2_packed=w2_packed, w2_scale=w2_scale, parts=parts)):
    return reason
  return None


@functools.partial(jax.jit, static_argnames=("beta1", "beta2", "interpret", "config"))
def expert_ffn(x: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array,
               w1_packed: jax.Array, w1_scale: jax.Array, w3_packed: jax.Array,
               w3_scale: jax.Array, w2_packed: jax.Array, w2_scale: jax.Array,
               group_sizes: jax.Array, *, beta1: float, beta2: float, interpret: bool = False,
               config: Config | None = None) -> jax.Array:
  """`reference.expert_ffn` (u [N, D] fp32) in one launch and one XLA fusion: the kernel
  (`_ffn_kernel`, grid (F / block_n, min(G, M) + 1)) writes each hidden block's share of every
  copy's W2 product, fp32 [F / block_n, M, D], never h; the fusion gathers each token's copies
  from it and sums them with the routing weights. Call `supports_expert_ffn` first."""
  if reason := supports_expert_ffn(x, order, w1_packed, w1_scale, w3_packed, w3_scale,
                                   w2_packed, w2_scale, group_sizes, interpret=interpret,
                                   config=config):
    raise NotImplementedError(reason)
  (n, top_k), (m,), (g, f, half) = weights.shape, order.shape, w1_packed.shape
  k, d = 2 * half, w2_packed.shape[1]
  cfg = default_config(m, k, f, True, gate_up=True) if config is None else config
  tanh = jnp.tanh if interpret else plgpu_triton.approx_tanh

  def situ(gate, up):
    a, b, *_ = gate_up_triton.situ_factors(gate, up, beta1, beta2, tanh)
    return a * b

  view = lambda p, cols: p.reshape(g, p.shape[1], cols // BLOCK, HALF)   # free
  parts = pl.pallas_call(
      functools.partial(_ffn_kernel, cfg=cfg, situ=situ, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((f // cfg.block_n, m, d), jnp.float32),
      grid=(f // cfg.block_n, min(g, m) + 1),
      compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages),
      interpret=interpret, name="mxfp4_expert_ffn_triton",
  )(group_sizes.astype(jnp.int32), (order // top_k).astype(jnp.int32), x, view(w1_packed, k),
    w1_scale, view(w3_packed, k), w3_scale, view(w2_packed, f), w2_scale)
  copies = parts[:, inverse].reshape(parts.shape[0], n, top_k, d)
  return jnp.einsum("nk,pnkl->nl", weights.astype(jnp.float32), copies,
                    preferred_element_type=jnp.float32)
