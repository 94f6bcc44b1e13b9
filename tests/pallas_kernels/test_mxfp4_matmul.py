"""MXFP4-weight matmul on CPU: the reference against a numpy nibble-table oracle, the Mosaic GPU
tier in its interpreter against the reference, the kernel's bit formulas exhaustively, refusals,
bad inputs, the x-gradient, and the kernels' CUDA lowering at the K3 shapes.

The oracle's table (`mxfp4_testing.py`) is written out from the E2M1 spec (k3_techniques.md
§7), independent of `k3jax.mx`; random weights come from `mx.pack_k3`. The interpreter runs the
kernel's pipeline, wgmma and stores, but not its two `inline_mgpu` loads (int4 view of the
packed bytes, scale column), which the CUDA lowering covers and the GPU tests run.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax import mx
from mxfp4_testing import NIBBLE
from mxfp4_testing import dequantize
from mxfp4_testing import every_code
from mxfp4_testing import oracle
from mxfp4_testing import rel_err
from pallas_kernels.mxfp4_matmul import default_impls
from pallas_kernels.mxfp4_matmul import mosaic_gpu
from pallas_kernels.mxfp4_matmul import mxfp4_matmul
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan
from pallas_kernels.mxfp4_matmul import plan_ragged_dot
from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.mxfp4_matmul import xla
from pallas_kernels.mxfp4_matmul import triton
from pallas_kernels.ragged_dot import mosaic_gpu as gmm_kernel

# bf16 output: relative L2 ~3e-3 from the final rounding; a wrong nibble, scale or row is O(0.1).
BF16_TOL = 1e-2
# fp32 output of bf16 products: exact but for the fp32 summation order.
F32_TOL = 1e-5


def weights(seed: int, *shape: int):
  """mx.pack_k3 of N(0, 0.02) weights [*shape] -> (packed, scale)."""
  return mx.pack_k3(0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def activations(seed: int, m: int, k: int, dtype=jnp.bfloat16) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)


def test_reference_reads_hand_written_bytes():
  """Bytes written out from the spec: low nibble = even column. Row 0: 0x71 -> (0.5, 6),
  0x9F -> (-6, -0.5), 0x20 -> (0, 1), then zeros; scale 128 (2.0) for its first block and 125
  (0.25) for the second. Row 1: 0x08 -> (-0, 0) ... with scale 127 (1.0)."""
  packed = np.zeros((2, 32), np.uint8)
  packed[0, :3] = [0x71, 0x9F, 0x20]
  packed[0, 16] = 0x5C                       # column 32: code 0xC (-2), column 33: 0x5 (3)
  packed[1, :2] = [0x08, 0xB3]               # (-0, 0), (1.5, -1.5)
  scale = np.array([[128, 125], [127, 127]], np.uint8)
  want = np.zeros((2, 64))
  want[0, :6] = np.array([0.5, 6, -6, -0.5, 0, 1]) * 2.0
  want[0, 32:34] = np.array([-2, 3]) * 0.25
  want[1, :4] = [-0.0, 0.0, 1.5, -1.5]
  x = jnp.eye(64, dtype=jnp.float32)
  out = mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale))
  np.testing.assert_array_equal(np.asarray(out), want.T)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_against_nibble_table(dtype):
  n, k = 64, 256
  packed, scale = every_code(n, k, seed=0)
  p, s = jnp.asarray(packed), jnp.asarray(scale)
  exact = reference.matmul(jnp.eye(k, dtype=dtype), p, s, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(exact), dequantize(packed, scale).T)
  x = activations(1, 24, k, dtype)
  tol = BF16_TOL if dtype == jnp.bfloat16 else F32_TOL
  assert rel_err(reference.matmul(x, p, s), oracle(x, packed[None], scale[None], [24])) < tol


def test_xla_tier_dequantizes_every_code_and_scale_byte():
  """XLA's float4_e2m1fn / float8_e8m0fnu reading of the checkpoint bytes in fp32: the written-out
  E2M1 table for every byte value with scales 2^-125 ... 2^123 (bytes 2-250), and the reference's
  values up to 2^127 (byte 254; 6 x 2^127 overflows fp32 in both). Below, values under 2^-126
  are fp32 subnormals, which XLA may flush to zero (the tier's docstring)."""
  packed, _ = every_code(4, 512, seed=3)
  scale = (2 + np.arange(4 * 16).reshape(4, 16) * 248 // 63).astype(np.uint8)   # 2 ... 250
  got = xla.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), dequantize(packed, scale))
  scale[-1] = np.arange(239, 255)
  p, s = jnp.asarray(packed), jnp.asarray(scale)
  np.testing.assert_array_equal(np.asarray(xla.dequantize(p, s, jnp.float32)),
                                np.asarray(mx.unpack_k3(p, s)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_tier_equals_the_reference(dtype):
  """Same values, same products: dense and grouped (an empty group, rows past the groups)."""
  packed, scale = every_code(64, 256, seed=1)
  p, s = jnp.asarray(packed), jnp.asarray(scale)
  x = activations(7, 24, 256, dtype)
  for out_dtype in (None, jnp.float32):
    np.testing.assert_array_equal(
        np.asarray(mxfp4_matmul(x, p, s, impl="xla", preferred_element_type=out_dtype)),
        np.asarray(reference.matmul(x, p, s, preferred_element_type=out_dtype)))
  pg, sg = weights(8, 3, 64, 256)
  gs = jnp.asarray([10, 0, 9], jnp.int32)
  got = mxfp4_ragged_dot(x, pg, sg, gs, impl="xla", preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(got), np.asarray(reference.ragged_dot(x, pg, sg, gs,
                                                       preferred_element_type=jnp.float32)))
  assert rel_err(got, oracle(x, pg, sg, [10, 0, 9])) < (BF16_TOL if dtype == jnp.bfloat16
                                                         else F32_TOL)
  np.testing.assert_array_equal(np.asarray(got)[19:], 0.0)
  assert plan(x, p, s, impl="xla").impl == "xla"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_unpacked_tier_equals_the_reference(dtype):
  """The weight unpacked in HBM, then the bf16 products (on CPU: XLA's dot and ragged_dot, the
  reference's own, so equal but for the summation order of the compiled dot): dense and grouped
  (an empty group, rows past the groups)."""
  packed, scale = every_code(64, 256, seed=2)
  p, s = jnp.asarray(packed), jnp.asarray(scale)
  x = activations(9, 24, 256, dtype)
  for out_dtype in (None, jnp.float32):
    got = jax.jit(mxfp4_matmul, static_argnames=("impl", "preferred_element_type"))(
        x, p, s, impl="unpacked", preferred_element_type=out_dtype)
    want = reference.matmul(x, p, s, preferred_element_type=out_dtype)
    assert got.dtype == want.dtype and rel_err(got, want) < F32_TOL
  pg, sg = weights(10, 3, 64, 256)
  gs = jnp.asarray([10, 0, 9], jnp.int32)
  got = mxfp4_ragged_dot(x, pg, sg, gs, impl="unpacked", preferred_element_type=jnp.float32)
  assert rel_err(got, oracle(x, pg, sg, [10, 0, 9])) < (BF16_TOL if dtype == jnp.bfloat16
                                                         else F32_TOL)
  assert rel_err(got, reference.ragged_dot(x, pg, sg, gs,
                                           preferred_element_type=jnp.float32)) < F32_TOL
  np.testing.assert_array_equal(np.asarray(got)[19:], 0.0)
  assert plan_ragged_dot(x, pg, sg, gs, impl="unpacked").impl == "unpacked"


def test_unpacked_tier_grouped_through_the_gmm_kernel_in_its_interpreter():
  """Grouped, the unpacked weight [G, N, K] goes to the bf16 gmm kernel as stored
  (transpose_rhs): in the Mosaic GPU interpreter against the expert-loop oracle."""
  pg, sg = weights(11, 2, 256, 128)
  x = activations(12, 200, 128)
  gs = jnp.asarray([120, 70], jnp.int32)
  w_like = jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16)
  assert gmm_kernel.supports_gmm(x, w_like, gs, transpose_rhs=True, out_dtype=jnp.float32,
                                 interpret=True) is None
  got = mxfp4_ragged_dot(x, pg, sg, gs, impl="unpacked", interpret=True,
                         preferred_element_type=jnp.float32)
  assert rel_err(got, oracle(x, pg, sg, [120, 70])) < BF16_TOL
  assert rel_err(got, reference.ragged_dot(x, pg, sg, gs,
                                           preferred_element_type=jnp.float32)) < F32_TOL
  np.testing.assert_array_equal(np.asarray(got)[190:], 0.0)


def test_kernel_bit_formulas_cover_every_code_and_scale():
  """`e2m1_bits` for the 16 sign-extended codes and `e8m0_bf16` for the 256 scale bytes,
  compared as bits (no float arithmetic, so no platform denormal mode is involved)."""
  codes = jnp.asarray((np.arange(16) ^ 8) - 8, jnp.int16)
  bits = np.asarray(jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(mosaic_gpu.e2m1_bits(codes), jnp.bfloat16), jnp.uint16))
  want = np.asarray(jnp.asarray(NIBBLE, jnp.bfloat16).view(jnp.uint16))
  np.testing.assert_array_equal(bits, want)
  scale = np.asarray(jax.lax.bitcast_convert_type(
      triton.e8m0_bf16(jnp.arange(256, dtype=jnp.int16)), jnp.uint16))
  want = np.asarray(jnp.asarray(2.0 ** (np.arange(1, 255) - 127.0), jnp.bfloat16)
                    .view(jnp.uint16))
  np.testing.assert_array_equal(scale[1:255], want)
  assert scale[0] == 0x0040               # 2^-127, the bf16 subnormal
  assert np.isnan(np.asarray(jnp.asarray(scale[255], jnp.uint16).view(jnp.bfloat16), np.float32))


def test_shift_bits_are_the_values_times_2_to_the_minus_126():
  """`e2m1_scaled_bits` (dequant="shift") for the 16 codes, as bits, against the table's values
  times 2^-126 rounded by ml_dtypes in numpy (0.5 -> the subnormal 0x0040, -0 -> 0x8000)."""
  codes = jnp.asarray((np.arange(16) ^ 8) - 8, jnp.int16)
  bits = np.asarray(mosaic_gpu.e2m1_scaled_bits(codes)).view(np.uint16)
  want = (np.asarray(NIBBLE, np.float64) * 2.0 ** -126).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(bits, want.view(np.uint16))
  assert list(bits[[1, 8, 9]]) == [0x0040, 0x8000, 0x8040]


def test_ptx_word_shifts_and_x_permutation_agree():
  """dequant="ptx"'s bit placement, emulated on words of 8 random nibbles with the kernel's
  shift table (`_PTX_SHIFTS`) and masks: register m's halves are `e2m1_scaled_bits` of
  nibbles m and m + 4; and `permute_x` puts column 8 t + 4 e + m of each block of 32 at
  position 8 m + 2 t + e, the register's place in the WGMMA layout (lane t % 4 holds columns
  8 g + 2 t + e of column group g = 4 c + m). Together: W's column order is x's."""
  words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64)
  shift = lambda w, by: (w << by if by >= 0 else w >> -by) & 0xFFFFFFFF
  nibble = lambda j: jnp.asarray(((((words >> (4 * j)) & 15) ^ 8) - 8).astype(np.int16))
  for m, (mag, sign) in enumerate(mosaic_gpu._PTX_SHIFTS):
    bits = (shift(words, mag) & 0x01C001C0) | (shift(words, sign) & 0x80008000)
    for half, j in ((0, m), (1, m + 4)):
      want = np.asarray(mosaic_gpu.e2m1_scaled_bits(nibble(j))).view(np.uint16)
      np.testing.assert_array_equal((bits >> (16 * half)) & 0xFFFF, want)
  cols = np.asarray(mosaic_gpu.permute_x(jnp.arange(64, dtype=jnp.int32)[None]))[0]
  for c, m, t, e in itertools.product(range(2), range(4), range(4), range(2)):
    assert cols[32 * c + 8 * m + 2 * t + e] == 32 * c + 8 * t + 4 * e + m


def run_ptx(text: str, regs: dict) -> dict:
  """A few 32-bit integer PTX instructions (shl, shr, and, or, xor, not, add, mov) of `text`
  run on `regs` (name -> uint32), its declarations and braces skipped."""
  ops = {"shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
         "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "add": lambda a, b: a + b,
         "not": lambda a: ~a, "mov": lambda a: a}
  for line in text.replace(";", "\n").splitlines():
    line = line.strip()
    if not line or line[0] in "{}." or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    dst, *srcs = [a.strip() for a in args.split(",")]
    vals = [regs[a] if a in regs else int(a, 0) for a in srcs]
    regs[dst] = ops[op.split(".")[0]](*vals) & 0xFFFFFFFF
  return regs


def test_ptx_e8m0_factor_is_e8m0_bf16_in_both_halves():
  """dequant="ptx"'s scale factor (`mosaic_gpu._PTX_FACTOR`, which holds the Triton tier's
  `E8M0_PAIR_PTX`), run instruction by instruction for the 256 scale bytes: both bf16 halves
  are `triton.e8m0_bf16`'s bits (0 -> the subnormal 2^-127, 255 -> NaN)."""
  want = np.asarray(triton.e8m0_bf16(jnp.arange(256, dtype=jnp.int16))).view(np.uint16)
  for s in range(256):
    got = run_ptx(mosaic_gpu._PTX_FACTOR, {"$1": s})["$0"]
    assert (got & 0xFFFF, got >> 16) == (want[s], want[s]), s


def test_mosaic_gpu_reads_every_code_exactly():
  """x = I [K, K]: the fp32 output is W^T, every element (all 16 codes in both nibbles, 51
  scales) through the interpreter's dequantization, SMEM tiles and wgmma; K split in 2."""
  n, k = 128, 512
  packed, scale = every_code(n, k, seed=1)
  cfg = mosaic_gpu.Config(block_m=128, block_n=64, stages=3, split_k=2)
  out = mosaic_gpu.matmul(jnp.eye(k, dtype=jnp.bfloat16), jnp.asarray(packed),
                          jnp.asarray(scale), preferred_element_type=jnp.float32,
                          interpret=True, config=cfg)
  np.testing.assert_array_equal(np.asarray(out), dequantize(packed, scale).T)


@pytest.mark.parametrize("m, out_dtype, tol", [(20, jnp.float32, F32_TOL),
                                               (72, jnp.bfloat16, BF16_TOL)])
def test_mosaic_gpu_matmul_against_reference(m, out_dtype, tol):
  """m = 20: the decode tiles (64 rows, K split over the 2 simulated SMs, fp32 partials summed
  by XLA); m = 72: one 256-row tile of mostly padding rows (M < block_m), bf16 stored by the
  kernel."""
  k, n = 512, 128
  x = activations(m, m, k)
  packed, scale = weights(m + 1, n, k)
  ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
  out = mxfp4_matmul(x, packed, scale, impl="mosaic_gpu", interpret=True,
                     preferred_element_type=out_dtype)
  assert out.shape == (m, n) and out.dtype == out_dtype
  assert rel_err(out, ref) < tol


RAGGED_CASES = {
    # 128-row tiles, N = 2 * 128: an empty first and middle group, group starts off the
    # 8-row grid (37), rows 87-99 past the sum
    "tail": (100, (0, 37, 0, 50), None),
    # decode tiles with K split in 2 and a 2-slot ring: a one-row group, an empty last group,
    # rows 20-23 past the sum
    "split": (24, (10, 1, 9, 0), mosaic_gpu.Config(block_m=64, block_n=64, stages=2, split_k=2)),
    # the same with x_rows: every tile loads x's 24 rows from row 0
    "x_rows": (24, (10, 1, 9, 0), mosaic_gpu.Config(block_m=64, block_n=64, stages=2, split_k=2,
                                                    x_rows=24)),
    # and with the operands swapped (x's 24 rows on wgmma's N side, the tile stored transposed)
    "swap": (24, (10, 1, 9, 0), mosaic_gpu.Config(block_m=64, block_n=64, stages=2, split_k=2,
                                                  x_rows=24, swap=True)),
    # swapped without split K: the kernel stores the rows of each group directly
    "swap_whole_k": (16, (3, 0, 12, 1), mosaic_gpu.Config(block_m=64, block_n=64, stages=3,
                                                          x_rows=16, swap=True)),
    # each step's product on the tile made during the previous one (`overlap`), split and whole
    # K: several units a CTA, the padding group's units without steps
    "swap_overlap": (24, (10, 1, 9, 0), mosaic_gpu.Config(block_m=64, block_n=64, stages=2,
                                                          split_k=2, x_rows=24, swap=True,
                                                          overlap=True)),
    "swap_overlap_whole_k": (16, (3, 0, 12, 1), mosaic_gpu.Config(
        block_m=64, block_n=64, stages=3, x_rows=16, swap=True, overlap=True)),
}


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_mosaic_gpu_ragged_dot_against_loop_over_experts(case):
  m, sizes, cfg = RAGGED_CASES[case]
  k, n = 512, 256
  x = activations(m, m, k)
  packed, scale = weights(len(sizes), len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  out = mosaic_gpu.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32,
                              interpret=True, config=cfg)
  ref = reference.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32)
  end = sum(sizes)
  assert out.shape == (m, n) and rel_err(out, ref) < F32_TOL
  assert rel_err(out, oracle(x, packed, scale, sizes)) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out)[end:], 0.0)


def test_reference_ragged_dot_against_loop_over_experts():
  m, sizes, k, n = 40, (0, 13, 0, 20), 256, 64
  x = activations(2, m, k)
  packed, scale = weights(3, len(sizes), n, k)
  out = mxfp4_ragged_dot(x, packed, scale, jnp.asarray(sizes, jnp.int32),
                         preferred_element_type=jnp.float32)
  assert rel_err(out, oracle(x, packed, scale, sizes)) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)


def test_gradient_with_respect_to_x():
  """d_x = ct @ W (loop over experts for the grouped form; zero rows past the groups)."""
  m, sizes, k, n = 40, (0, 13, 0, 20), 256, 64
  x = activations(4, m, k, jnp.float32)
  ct = np.asarray(activations(5, m, n, jnp.float32), np.float64)
  packed, scale = weights(6, len(sizes), n, k)
  w = dequantize(packed, scale)
  d_x = jax.grad(lambda a: jnp.sum(mxfp4_matmul(a, packed[0], scale[0]) * ct))(x)
  assert rel_err(d_x, ct @ w[0]) < F32_TOL
  gs = jnp.asarray(sizes, jnp.int32)
  d_x = jax.grad(lambda a: jnp.sum(mxfp4_ragged_dot(a, packed, scale, gs) * ct))(x)
  want = np.zeros((m, k))
  start = 0
  for g, size in enumerate(sizes):
    want[start:start + size] = ct[start:start + size] @ w[g]
    start += size
  assert rel_err(d_x, want) < F32_TOL
  np.testing.assert_array_equal(np.asarray(d_x)[sum(sizes):], 0.0)


def test_hopper_defaults_follow_the_rows(monkeypatch):
  """On Hopper the default tier follows the rows: dense, the Triton kernel at one row, the
  reference from 2 to 7 rows, the Triton kernel from 8 to 16 and the unpacked tier above;
  grouped, the Triton kernel up to 16 rows per expert (the Mosaic GPU kernel where it declines),
  the Mosaic GPU kernel below 128, unpacked from 128; never unpacked where the bf16 weights
  would exceed UNPACKED_MAX_BYTES."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "num_sms", lambda interpret: 132)
  assert default_impls(grouped=False, m=1) == ("triton", "reference")
  assert default_impls(grouped=False, m=2) == ("reference",)
  assert default_impls(grouped=False, m=7) == ("reference",)
  assert default_impls(grouped=False, m=8) == ("triton", "reference")
  assert default_impls(grouped=False, m=16) == ("triton", "reference")
  assert default_impls(grouped=False, m=17) == ("unpacked", "reference")
  assert default_impls(grouped=True, m=8 * 16, groups=8) == ("triton", "mosaic_gpu", "reference")
  assert default_impls(grouped=True, m=8 * 16 + 1, groups=8) == ("mosaic_gpu", "reference")
  assert default_impls(grouped=True, m=8 * 127, groups=8) == ("mosaic_gpu", "reference")
  assert default_impls(grouped=True, m=8 * 128, groups=8) == ("unpacked", "reference")
  # A bf16 copy over UNPACKED_MAX_BYTES (K3's 896 experts of one matrix) stays on the kernel.
  k3_experts = 896 * 3072 * 3584
  assert default_impls(grouped=True, m=896 * 512, groups=896, weight_elements=k3_experts) == (
      "mosaic_gpu", "reference")
  assert default_impls(grouped=False, m=64, weight_elements=3 << 30) == ("reference",)
  x = activations(0, 1024, 512)
  packed, scale = weights(0, 8, 128, 512)
  gs = jax.ShapeDtypeStruct((8,), jnp.int32)
  assert plan_ragged_dot(x, packed, scale, gs).impl == "unpacked"
  p = plan_ragged_dot(x[:64], packed, scale, gs)        # triton declines off a GPU: next tier
  assert p.impl == "mosaic_gpu" and p.declined[0][0] == "triton", p
  monkeypatch.setattr(triton, "is_gpu", lambda: True)
  assert plan_ragged_dot(x[:64], packed, scale, gs).impl == "triton"


def test_plan_defaults_and_falls_through_with_reasons():
  x = activations(0, 16, 512)
  packed, scale = weights(0, 128, 512)
  assert default_impls(grouped=False, m=4096) == ("reference",)  # not Hopper here
  assert default_impls(grouped=True, m=16, groups=8) == ("reference",)
  p = plan(x, packed, scale)
  assert p.impl == "reference" and not p.declined
  assert plan(x, packed, scale, impl="mosaic_gpu", interpret=True).impl == "mosaic_gpu"
  refusals = {
      "not an NVIDIA Hopper GPU": plan(x, packed, scale, impl="mosaic_gpu"),
      "needs bfloat16 x": plan(x.astype(jnp.float32), packed, scale, impl="mosaic_gpu",
                               interpret=True),
      "output dtype must be bfloat16 or float32": plan(
          x, packed, scale, impl="mosaic_gpu", interpret=True,
          preferred_element_type=jnp.float16),
      "K=288 is not a multiple of 512": plan(x[:, :288], packed[:, :144], scale[:, :9],
                                             impl="mosaic_gpu", interpret=True),
      "N=64 is not a multiple of the CTA tile": plan(x, packed[:64], scale[:64],
                                                     impl="mosaic_gpu", interpret=True),
      "not a TPU": plan(x, packed, scale, impl="mosaic_tpu"),
  }
  for reason, p in refusals.items():
    assert p.impl == "reference" and len(p.declined) == 1, p
    assert reason in p.declined[0][1], (reason, p.declined)
  gs = jnp.asarray([16, 0], jnp.int32)
  two = plan_ragged_dot(x, jnp.stack([packed] * 2), jnp.stack([scale] * 2), gs,
                        impl="mosaic_gpu")
  assert two.impl == "reference" and "Hopper" in two.declined[0][1]
  out = mxfp4_matmul(x[:, :288], packed[:, :144], scale[:, :9], impl="mosaic_gpu",
                     interpret=True)
  want = oracle(x[:, :288], packed[None, :, :144], scale[None, :, :9], [16])
  assert rel_err(out, want) < BF16_TOL


BAD = {
    "x must be a floating": dict(x=((16, 512), jnp.int32)),
    "x must be a floating \\[M, K\\]": dict(x=((2, 16, 512), jnp.bfloat16)),
    "x's K=48 must be a multiple of 32": dict(x=((16, 48), jnp.bfloat16)),
    "w_packed must be uint8": dict(w_packed=((128, 256), jnp.int8)),
    "w_packed must be \\[N, 256\\]": dict(w_packed=((128, 128), jnp.uint8)),
    "w_scale must be uint8": dict(w_scale=((128, 16), jnp.float32)),
    "w_scale must be \\[N, 16\\]": dict(w_scale=((128, 8), jnp.uint8)),
    "w_scale must have the leading dims": dict(w_scale=((64, 16), jnp.uint8)),
    "preferred_element_type must be": dict(preferred_element_type=jnp.int32),
    "impl must be None or one of": dict(impl="cuda"),
}


@pytest.mark.parametrize("match", BAD)
def test_bad_matmul_arguments(match):
  args = dict(x=((16, 512), jnp.bfloat16), w_packed=((128, 256), jnp.uint8),
              w_scale=((128, 16), jnp.uint8))
  kwargs = {k: v for k, v in BAD[match].items() if k not in args}
  args.update({k: v for k, v in BAD[match].items() if k in args})
  x, packed, scale = (jnp.zeros(*args[k]) for k in ("x", "w_packed", "w_scale"))
  with pytest.raises(ValueError, match=match):
    mxfp4_matmul(x, packed, scale, **kwargs)


def test_bad_ragged_dot_arguments():
  x = jnp.zeros((16, 512), jnp.bfloat16)
  packed, scale = jnp.zeros((2, 128, 256), jnp.uint8), jnp.zeros((2, 128, 16), jnp.uint8)
  gs = jnp.asarray([8, 8], jnp.int32)
  with pytest.raises(ValueError, match=r"group_sizes must have shape \[G\] = \(2,\)"):
    mxfp4_ragged_dot(x, packed, scale, gs[:1])
  with pytest.raises(ValueError, match="group_sizes must be an integer"):
    mxfp4_ragged_dot(x, packed, scale, gs.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"w_packed must be \[G, N, 256\]"):
    mxfp4_ragged_dot(x, packed[0], scale, gs)
  with pytest.raises(ValueError, match="lhs must be a floating"):
    mxfp4_ragged_dot(x[None], packed, scale, gs)


K3_SHAPES = [(1, 3584, 3072, 1), (4096, 3072, 3584, 1), (16, 3584, 3072, 8),
             (4096, 3584, 3072, 8)]


@pytest.mark.parametrize("m, k, n, g", K3_SHAPES)
def test_config_fits_and_kernel_lowers_for_hopper(monkeypatch, m, k, n, g):
  """At the K3 expert shapes the config fits shared memory, small M splits K over the SMs, and
  the kernel (with its inline Mosaic GPU loads) lowers for CUDA on CPU."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "num_sms", lambda interpret: 132)
  cfg = mosaic_gpu.config(m, k, n, g, jnp.bfloat16, 132)
  assert isinstance(cfg, mosaic_gpu.Config), cfg
  assert cfg.x_rows == (-(-m // 8) * 8 if m < cfg.block_m else None), cfg
  assert mosaic_gpu.smem_bytes(cfg, jnp.bfloat16) <= mosaic_gpu.SMEM_BYTES
  if m <= mosaic_gpu.SMALL_M and g == 1:
    units = n // (2 * cfg.block_n) * cfg.split_k
    assert cfg.split_k > 1 and units <= 132, cfg
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  lead = (g,) if g > 1 else ()
  args = [s(m, k), s(*lead, n, k // 2, dtype=jnp.uint8), s(*lead, n, k // 32, dtype=jnp.uint8)]
  if g > 1:
    fn = lambda x, p, sc, gs: mosaic_gpu.ragged_dot(x, p, sc, gs)
    args.append(s(g, dtype=jnp.int32))
  else:
    fn = lambda x, p, sc: mosaic_gpu.matmul(x, p, sc)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("m", [16, 4096])
def test_select_dequant_and_full_x_lower_for_hopper(monkeypatch, m):
  """The benchmark's variants: dequant="select" and x_rows=None (x loaded as block_m rows)."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "num_sms", lambda interpret: 132)
  k, n = 3584, 3072
  cfg = dataclasses.replace(mosaic_gpu.config(m, k, n, 1, jnp.bfloat16, 132, swap=False),
                            dequant="select", x_rows=None)
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  fn = lambda x, p, sc: mosaic_gpu.matmul(x, p, sc, config=cfg)
  args = (s(m, k), s(n, k // 2, dtype=jnp.uint8), s(n, k // 32, dtype=jnp.uint8))
  assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_swapped_reads_every_code_exactly():
  """swap: x = 8 rows of I (the first 8 of K): every code and scale of those columns through
  the swapped product and its transposed store."""
  n, k = 128, 512
  packed, scale = every_code(n, k, seed=2)
  cfg = mosaic_gpu.Config(block_m=64, block_n=64, stages=2, split_k=2, x_rows=8, swap=True)
  x = jnp.eye(k, dtype=jnp.bfloat16)[:8]
  out = mosaic_gpu.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                          preferred_element_type=jnp.float32, interpret=True, config=cfg)
  np.testing.assert_array_equal(np.asarray(out), dequantize(packed, scale).T[:8])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("m, k, n, g", [(1, 3584, 3072, 1), (16, 3584, 3072, 8)])
def test_swapped_kernel_lowers_for_hopper(monkeypatch, m, k, n, g, overlap):
  """swap at the K3 decode shapes: the dequantized tile as wgmma's register operand, made in
  inline PTX (`_dequantize_ptx`), and the transposed epilogue (GPU-only paths: the interpreter
  goes through SMEM and jnp) lower for CUDA, with `overlap` too; SWAP_IS_DEFAULT and
  PTX_IS_DEFAULT make config() choose them there."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "num_sms", lambda interpret: 132)
  monkeypatch.setattr(mosaic_gpu, "SWAP_IS_DEFAULT", True)
  cfg = dataclasses.replace(mosaic_gpu.config(m, k, n, g, jnp.bfloat16, 132), overlap=overlap)
  assert cfg.swap and cfg.dequant == "ptx", cfg
  assert mosaic_gpu.smem_bytes(cfg, jnp.bfloat16) <= mosaic_gpu.SMEM_BYTES, cfg
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  lead = (g,) if g > 1 else ()
  args = [s(m, k), s(*lead, n, k // 2, dtype=jnp.uint8), s(*lead, n, k // 32, dtype=jnp.uint8)]
  if g > 1:
    fn = lambda x, p, sc, gs: mosaic_gpu.ragged_dot(x, p, sc, gs, config=cfg)
    args.append(s(g, dtype=jnp.int32))
  else:
    fn = lambda x, p, sc: mosaic_gpu.matmul(x, p, sc, config=cfg)
  assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_configs_are_refused():
  x = activations(0, 20, 512)
  packed, scale = weights(0, 128, 512)
  for cfg, reason in ((mosaic_gpu.Config(block_m=64, block_n=64, x_rows=16), "x_rows=16"),
                      (mosaic_gpu.Config(block_m=64, block_n=64, x_rows=72), "x_rows=72"),
                      (mosaic_gpu.Config(block_m=64, block_n=64, dequant="lut"), "dequant"),
                      (mosaic_gpu.Config(block_m=64, block_n=64, swap=True), "swap needs"),
                      (mosaic_gpu.Config(block_m=64, block_n=64, overlap=True), "overlap"),
                      (mosaic_gpu.Config(block_m=64, block_n=64, dequant="ptx"), "ptx")):
    got = mosaic_gpu.supports_matmul(x, packed, scale, interpret=True, config=cfg)
    assert got is not None and reason in got, got

  wide_packed, wide_scale = weights(0, 256, 512)
  wide = mosaic_gpu.Config(block_m=64, block_n=128, x_rows=24, swap=True)
  assert "swap needs" in mosaic_gpu.supports_matmul(x, wide_packed, wide_scale, interpret=True,
                                                    config=wide)
