"""Tests for k3jax.mx (OCP MX v1.0, k3_techniques.md §7) against vectors written out from the
spec's tables (E2M1 +-{0, .5, 1, 1.5, 2, 3, 4, 6}; E4M3 max 448, subnormals m 2^-9; E8M0
2^(e - 127), 0xFF NaN) and a numpy nearest-grid-point oracle."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
import qwix

from k3jax import mx
from mx_testing import E2M1_CODES, E2M1_GRID, E4M3_GRID, np_quantize



def bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def values(a):
  return np.asarray(a.astype(jnp.float32))


def block(*head):
  """A 32-element float32 block: `head`, then zeros."""
  return np.array(list(head) + [0.0] * (32 - len(head)), np.float32)


def test_e2m1_rounding_written_out():
  """X = 1 (max 7.9: floor(log2 7.9) - 2 = 0): ties go to the even code, 7.9 saturates."""
  x = block(0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.9, -0.25, -0.75, -2.9,
            -5.0, -6.5, 0.74, 2.6)
  want = block(0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -1.0, -3.0,
               -4.0, -6.0, 0.5, 3.0)
  for scale_exp in (0, -20, 40):
    elements, scales = mx.quantize(jnp.asarray(x * 2.0**scale_exp), "mxfp4")
    assert elements.dtype == jnp.float4_e2m1fn and scales.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(values(elements), want)
    np.testing.assert_array_equal(bits(scales), [127 + scale_exp])
  assert np.signbit(values(mx.quantize(jnp.asarray(x), "mxfp4")[0])[11])


def test_e4m3_rounding_written_out():
  """X = 1 (max 500: floor(log2 500) - 8 = 0): step 32 in [256, 512), 464 ties to 448 and
  anything above saturates to 448 (never the NaN code); subnormals m 2^-9."""
  x = block(500.0, 448.0, 464.0, 470.0, -304.0, -300.0, 17.0, 1.0625, 1.1875, 2.0**-9,
            2.0**-10, 3 * 2.0**-10, 5 * 2.0**-11, 0.1)
  want = block(448.0, 448.0, 448.0, 448.0, -320.0, -288.0, 16.0, 1.0, 1.25, 2.0**-9,
               0.0, 2.0**-8, 2.0**-9, 0.1015625)
  elements, scales = mx.quantize(jnp.asarray(x), "mxfp8")
  assert elements.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(values(elements), want)
  np.testing.assert_array_equal(bits(scales), [127])


@pytest.mark.parametrize("fmt,rule,amax,byte", [
    ("mxfp4", "floor", 1.0, 125), ("mxfp4", "floor", 6.0, 127), ("mxfp4", "floor", 0.1, 121),
    ("mxfp4", "floor", 1e30, 224), ("mxfp4", "ceil", 6.0, 127), ("mxfp4", "ceil", 6.01, 128),
    ("mxfp4", "ceil", 7.9, 128), ("mxfp4", "ceil", 3.0, 126), ("mxfp4", "ceil", 3.01, 127),
    ("mxfp4", "ceil", 1.0, 125), ("mxfp8", "floor", 1.0, 119), ("mxfp8", "floor", 500.0, 127),
    ("mxfp8", "ceil", 448.0, 127), ("mxfp8", "ceil", 449.0, 128), ("mxfp8", "ceil", 1.0, 119),
    ("mxfp8", "floor", 2.0**-100, 19),
    # Clamped to E8M0's smallest scale 2^-127: floor(log2 2^-126) - 2 = -128.
    ("mxfp4", "floor", 2.0**-126, 0), ("mxfp8", "floor", 2.0**-126, 0),
    ("mxfp8", "ceil", 2.0**-120, 0),
    # The largest float32 stays below E8M0's top: 127 - 2 = 125, ceil(log2(3.4e38 / 6)) = 126.
    ("mxfp4", "floor", 3.4e38, 252), ("mxfp4", "ceil", 3.4e38, 253),
])
def test_scale_bytes_written_out(fmt, rule, amax, byte):
  x = block(-amax, amax / 3)
  _, scales = mx.quantize(jnp.asarray(x), fmt, scale_rule=rule)
  np.testing.assert_array_equal(bits(scales), [byte])


def test_ceil_rule_never_clips_the_block_max():
  x = block(7.9, 1.25, -3.2)
  elements, scales = mx.quantize(jnp.asarray(x), "mxfp4", scale_rule="ceil")
  np.testing.assert_array_equal(bits(scales), [128])
  np.testing.assert_array_equal(values(elements), block(4.0, 0.5, -1.5))
  elements, scales = mx.quantize(jnp.asarray(x), "mxfp4")
  np.testing.assert_array_equal(values(elements)[0] * 2.0**(int(bits(scales)[0]) - 127), 6.0)


def test_clamped_scale_keeps_elements_exact():
  """A block whose max is 2^-126: the scale clamps to 2^-127, the elements are 2 and 1."""
  x = block(2.0**-126, -(2.0**-127))
  for fmt in ("mxfp4", "mxfp8"):
    elements, scales = mx.quantize(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(bits(scales), [0])
    np.testing.assert_array_equal(values(elements), block(2.0, -1.0))


def test_subnormal_inputs_are_read_from_their_bits():
  """float32 subnormals (the CPU flushes them in arithmetic) quantize on X = 2^-127."""
  x = np.array(list(block(2.0**-130, 2.0**-128, 3 * 2.0**-129, 3 * 2.0**-128, -(2.0**-128)))
               + list(block(2.0**-136, 2.0**-137, 3 * 2.0**-138, 2.0**-140, 7 * 2.0**-136)),
               np.float32)
  assert np.all(np.abs(x[x != 0]) < np.finfo(np.float32).tiny)
  e4, s4 = mx.quantize(jnp.asarray(x), "mxfp4")
  np.testing.assert_array_equal(bits(s4), [0, 0])
  np.testing.assert_array_equal(values(e4)[:32], block(0.0, 0.5, 1.0, 1.5, -0.5))
  np.testing.assert_array_equal(values(e4)[32:], block())
  e8, s8 = mx.quantize(jnp.asarray(x), "mxfp8")
  np.testing.assert_array_equal(bits(s8), [0, 0])
  np.testing.assert_array_equal(values(e8)[32:], block(2.0**-9, 0.0, 2.0**-9, 0.0, 7 * 2.0**-9))


def test_zero_block_dequantizes_to_exact_zeros():
  x = np.concatenate([block(), -block(), block(1.0)])
  for fmt in ("mxfp4", "mxfp8"):
    elements, scales = mx.quantize(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(bits(scales)[:2], [0, 0])
    out = np.asarray(mx.dequantize(elements, scales))
    np.testing.assert_array_equal(out[:64], 0.0)
    assert np.all(np.signbit(out[32:64]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_make_the_block_nan(bad):
  x = np.concatenate([block(1.0, bad, 2.0), block(3.0)])
  for fmt in ("mxfp4", "mxfp8"):
    elements, scales = mx.quantize(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(bits(scales)[0], 255)
    np.testing.assert_array_equal(values(elements)[:32], 0.0)
    out = np.asarray(mx.dequantize(elements, scales))
    assert np.all(np.isnan(out[:32]))
    np.testing.assert_array_equal(out[32:], block(3.0))


def test_dequantize_written_out():
  elements = jnp.asarray(np.concatenate([block(1.5, -6.0, 0.5), block(6.0, -0.5),
                                         block(1.0)]), jnp.float4_e2m1fn)
  scales = jax.lax.bitcast_convert_type(jnp.array([130, 0, 255], jnp.uint8), jnp.float8_e8m0fnu)
  out = np.asarray(mx.dequantize(elements, scales))
  assert out.dtype == np.float32
  np.testing.assert_array_equal(out[:32], block(12.0, -48.0, 4.0))
  np.testing.assert_array_equal(out[32], np.ldexp(6.0, -127))   # 1.5 2^-125: a normal float32
  assert np.all(np.isnan(out[64:]))
  np.testing.assert_array_equal(mx.dequantize(elements, jnp.array([130, 0, 255], jnp.uint8)),
                                out)


@pytest.mark.parametrize("fmt,grid,emax", [("mxfp4", E2M1_GRID, 2), ("mxfp8", E4M3_GRID, 8)])
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_random_blocks_match_numpy_oracle(fmt, grid, emax, rule):
  rng = np.random.default_rng(3)
  mags = 2.0 ** rng.integers(-30, 30, size=(64, 1))
  x = (rng.standard_normal((64, 32)) * mags).astype(np.float32).ravel()
  x[:32] = np.round(x[:32] * 4 / np.abs(x[:32]).max()) / 4 * 6  # ties and grid points
  want_el, want_scale = np_quantize(x, grid, emax, rule)
  elements, scales = jax.jit(lambda a: mx.quantize(a, fmt, scale_rule=rule))(jnp.asarray(x))
  np.testing.assert_array_equal(values(elements), want_el)
  np.testing.assert_array_equal(bits(scales), want_scale)
  np.testing.assert_array_equal(
      mx.dequantize(elements, scales),
      (want_el.reshape(-1, 32) * 2.0 ** (want_scale.astype(np.float64) - 127)[:, None]).ravel())


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_ceil_rule_matches_qwix(fmt):
  """qwix 0.1.8's MX quantizer (scale 2^ceil(log2(absmax / max)) kept as a float32 power of two,
  elements by XLA's conversion) on fp32 inputs of normal magnitudes equals the "ceil" rule
  bit for bit. (On bf16 inputs qwix divides in bf16, which can move a block's scale.)"""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((16, 128)) * 2.0 ** rng.integers(-20, 20, size=(16, 1)),
                  jnp.float32)
  theirs = qwix.dequantize(qwix.quantize(x, fmt, channelwise_axes=(0,), tiled_axes={1: 32}))
  np.testing.assert_array_equal(mx.dequantize(*mx.quantize(x, fmt, scale_rule="ceil")), theirs)


def test_axis_and_shapes():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 64, 3)), jnp.float32)
  elements, scales = mx.quantize(x, "mxfp8", axis=1)
  assert elements.shape == (2, 64, 3) and scales.shape == (2, 2, 3)
  e_last, s_last = mx.quantize(jnp.swapaxes(x, 1, 2), "mxfp8")
  np.testing.assert_array_equal(values(elements), np.swapaxes(values(e_last), 1, 2))
  np.testing.assert_array_equal(bits(scales), np.swapaxes(bits(s_last), 1, 2))
  np.testing.assert_array_equal(mx.dequantize(elements, scales, axis=-2),
                                np.swapaxes(mx.dequantize(e_last, s_last), 1, 2))


def test_bad_arguments_raise():
  x = jnp.zeros((4, 40))
  with pytest.raises(ValueError, match="length 40 of axis 1"):
    mx.quantize(x, "mxfp4")
  with pytest.raises(ValueError, match="length 4 of axis 0"):
    mx.quantize(x, "mxfp8", axis=0)
  with pytest.raises(ValueError, match="fmt"):
    mx.quantize(jnp.zeros((32,)), "mxfp6")
  with pytest.raises(ValueError, match="scale_rule"):
    mx.quantize(jnp.zeros((32,)), "mxfp4", scale_rule="even")
  with pytest.raises(ValueError, match="scales must have shape"):
    mx.dequantize(jnp.zeros((64,)), jnp.zeros((3,), jnp.uint8))
  with pytest.raises(ValueError, match=r"\[..., out, in\]"):
    mx.pack_k3(jnp.zeros((4, 48)))
  with pytest.raises(ValueError, match="uint8"):
    mx.unpack_k3(jnp.zeros((4, 16), jnp.int32), jnp.zeros((4, 1), jnp.uint8))
  with pytest.raises(ValueError, match="weight_scale"):
    mx.unpack_k3(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 2), jnp.uint8))


def test_fake_quantize_forward_and_straight_through_gradient():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  for fmt in ("mxfp4", "mxfp8"):
    want = mx.dequantize(*mx.quantize(x, fmt))
    np.testing.assert_array_equal(mx.fake_quantize(x, fmt), want)
    xb = x.astype(jnp.bfloat16)
    out = mx.fake_quantize(xb, fmt)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.astype(jnp.float32), mx.dequantize(*mx.quantize(xb, fmt)))
    cot = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    grad = jax.grad(lambda a: jnp.sum(mx.fake_quantize(a, fmt) * cot))(x)
    np.testing.assert_array_equal(grad, cot)


def test_pack_k3_written_out():
  """Block 0: the 16 E2M1 values in code order (X = 1); block 1: max 12 -> X = 2."""
  codes = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
  w = np.concatenate([block(*codes), block(12.0, -3.0, 0.9)])[None]
  packed, scale = mx.pack_k3(jnp.asarray(w))
  assert packed.dtype == jnp.uint8 and scale.dtype == jnp.uint8
  assert packed.shape == (1, 32) and scale.shape == (1, 2)
  want = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8 + [0xB7, 0x01] + [0] * 14
  np.testing.assert_array_equal(packed, [want])
  np.testing.assert_array_equal(scale, [[127, 128]])
  np.testing.assert_array_equal(mx.unpack_k3(packed, scale),
                                np.concatenate([block(*codes), block(12.0, -3.0, 1.0)])[None])


def test_unpack_k3_written_out():
  packed = np.zeros((2, 16), np.uint8)
  packed[0, :2] = [0x21, 0xF9]     # nibbles 1, 2, 9, 15: .5, 1, -.5, -6
  packed[1, 15] = 0x70             # column 30: 0, column 31: 6
  scale = np.array([[129], [0]], np.uint8)
  out = np.asarray(mx.unpack_k3(jnp.asarray(packed), jnp.asarray(scale)))
  np.testing.assert_array_equal(out[0], block(2.0, 4.0, -2.0, -24.0))
  np.testing.assert_array_equal(out[1, :31], 0.0)
  np.testing.assert_array_equal(out[1, 31], np.ldexp(6.0, -127))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_unpack_k3_16_bit_equals_the_float32_values_rounded(dtype):
  """The 16-bit form (two values' bits per byte as one uint32) against unpack_k3's float32
  values rounded to the dtype, bit for bit: every byte of codes with every scale byte (NaN for
  255, overflow to inf, underflow to zero and subnormals included), batch dims, under jit."""
  packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(2, 128, 256)
  scale = np.repeat(np.arange(256, dtype=np.uint8), 16).reshape(2, 128, 16)
  want = np.asarray(mx.unpack_k3(jnp.asarray(packed), jnp.asarray(scale)).astype(dtype))
  got = jax.jit(mx.unpack_k3, static_argnums=2)(jnp.asarray(packed), jnp.asarray(scale), dtype)
  assert got.dtype == dtype and got.shape == (2, 128, 512)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def test_pack_k3_round_trip_on_the_grid():
  """Any weight on the MXFP4 grid (E2M1 values times a power of two per block of 32 along
  `in`) survives pack -> unpack exactly; batch dims (experts) pass through."""
  rng = np.random.default_rng(6)
  codes = rng.integers(0, 16, size=(3, 5, 4, 64))
  exps = rng.integers(20, 235, size=(3, 5, 4, 2))
  w = (E2M1_CODES[codes].reshape(3, 5, 4, 2, 32)
       * np.ldexp(1.0, exps - 127)[..., None]).reshape(3, 5, 4, 64).astype(np.float32)
  w[0, 0, 0, :32] = 0.0
  packed, scale = jax.jit(mx.pack_k3)(jnp.asarray(w))
  assert packed.shape == (3, 5, 4, 32) and scale.shape == (3, 5, 4, 2)
  np.testing.assert_array_equal(jax.jit(mx.unpack_k3)(packed, scale), w)
  off_grid = jnp.asarray(rng.standard_normal((6, 96)), jnp.float32)
  np.testing.assert_array_equal(mx.unpack_k3(*mx.pack_k3(off_grid)),
                                mx.fake_quantize(off_grid, "mxfp4"))
