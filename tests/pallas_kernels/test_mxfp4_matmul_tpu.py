"""Mosaic TPU MXFP4 matmul kernels in Pallas's interpreters (CPU) against numpy oracles.

The oracle (`mxfp4_testing.py`) dequantizes the checkpoint layout with a nibble table written
out from the E2M1 spec, independent of `k3jax.mx`, and multiplies in float64, expert by expert
for ragged_dot. One-hot activations read the dequantized weight back exactly, element by
element; random weights come from `mx.pack_k3`. The kernels' TPU compilation is
tests/tpu/test_mxfp4_tpu_compile.py.
"""
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mx
from mxfp4_testing import dequantize
from mxfp4_testing import every_code
from mxfp4_testing import oracle
from mxfp4_testing import rel_err
from pallas_kernels.mxfp4_matmul import mosaic_tpu
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan_ragged_dot

# bf16 output: relative L2 error ~3e-3 from the final rounding; a wrong nibble, scale or row
# gives O(1e-1) or more.
BF16_TOL = 1e-2
# fp32 output of bf16 products (or fp32 at HIGHEST): exact but for the fp32 summation order.
F32_TOL = 1e-5


def weights(seed: int, *shape: int) -> tuple[jax.Array, jax.Array]:
  """mx.pack_k3 of N(0, 0.02) weights [*shape] -> (packed, scale)."""
  return mx.pack_k3(0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def activations(seed: int, m: int, k: int, dtype=jnp.bfloat16) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_hot_rows_read_the_weight_exactly(dtype):
  """x = I_K: out = W^T, every element of the dequantized weight (all 16 codes in both
  nibbles, 51 scales) exact through the permuted columns and the MXU product. Weight row 5
  has a NaN scale (E8M0 0xFF) on one block: its whole output column is NaN (0 * NaN in the
  product), no other."""
  n, k = 128, 256
  packed, scale = every_code(n, k, seed=1)
  want = dequantize(packed, scale).T.astype(np.float32)
  want[:, 5] = np.nan
  scale[5, 3] = 255
  out = mosaic_tpu.matmul(jnp.eye(k, dtype=dtype), jnp.asarray(packed), jnp.asarray(scale),
                          preferred_element_type=jnp.float32, interpret=True)
  np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("m, k, n", [
    (20, 512, 384),    # M padded to a 32-row tile; three N tiles of 128; two lane chunks
    (600, 256, 128),   # two row tiles of 304 reuse one dequantized weight tile
    (8, 4608, 96),     # K/32 = 144 block scales (two lane groups); N below 128: one full tile
])
def test_matmul_bf16(m, k, n):
  x = activations(m, m, k)
  packed, scale = weights(n + k, n, k)
  out = mosaic_tpu.matmul(x, packed, scale, interpret=True)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert rel_err(out, oracle(x, packed[None], scale[None], [m])) < BF16_TOL


def test_matmul_fp32_and_output_dtypes():
  m, k, n = 24, 256, 128
  x = activations(3, m, k, jnp.float32)
  packed, scale = weights(4, n, k)
  ref = oracle(x, packed[None], scale[None], [m])
  out = mosaic_tpu.matmul(x, packed, scale, interpret=True)
  assert out.dtype == jnp.float32 and rel_err(out, ref) < F32_TOL
  out = mosaic_tpu.matmul(x, packed, scale, preferred_element_type=jnp.bfloat16, interpret=True)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL


def test_visit_tables_by_hand():
  """Rows 0-99 group 1, 100-136 group 3, 137-226 group 4, tail 227-383; tiles of 128 rows."""
  group, tile, weight_group, offsets, count = mosaic_tpu.visits(
      jnp.asarray([0, 100, 0, 37, 90], jnp.int32), m=300, rows=384, tm=128)
  assert int(count) == 6
  assert np.asarray(group)[:6].tolist() == [1, 3, 3, 4, 5, 5]
  assert np.asarray(tile)[:6].tolist() == [0, 0, 1, 1, 1, 2]
  assert np.asarray(weight_group)[:6].tolist() == [1, 3, 3, 4, 4, 4]
  assert np.asarray(offsets).tolist() == [0, 0, 100, 100, 137, 227, 384]


RAGGED_CASES = {
    # empty first and middle groups, boundaries inside tiles, rows 227-299 past the sum
    "tail": (300, (0, 100, 0, 37, 90)),
    # the groups fill M; an empty last group; a one-row group on a tile boundary
    "full": (272, (128, 1, 143, 0)),
    # every row past the sum: the output is zeros
    "empty": (40, (0, 0, 0)),
}


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_dot_against_loop_over_experts(case):
  m, sizes = RAGGED_CASES[case]
  k, n = 256, 128
  x = activations(m, m, k)
  packed, scale = weights(len(sizes), len(sizes), n, k)
  out = mosaic_tpu.ragged_dot(x, packed, scale, jnp.asarray(sizes, jnp.int32),
                              preferred_element_type=jnp.float32, interpret=True)
  ref = oracle(x, packed, scale, sizes)
  end = sum(sizes)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert rel_err(out[:end], ref[:end]) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[end:], 0.0)


def test_ragged_dot_matches_lax_ragged_dot_in_the_tpu_interpreter():
  """bf16 output in the TPU interpreter (uninitialized VMEM reads as NaN, so an output row
  that no visit writes would show) against lax.ragged_dot of the mx-dequantized weights."""
  m, k, n, sizes = 150, 512, 128, (40, 0, 70, 17)
  x = activations(5, m, k)
  packed, scale = weights(6, len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  out = mosaic_tpu.ragged_dot(x, packed, scale, gs,
                              interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
  w_t = jnp.swapaxes(mx.unpack_k3(packed, scale), 1, 2)
  ref = jax.lax.ragged_dot(x.astype(jnp.float32), w_t, gs, precision=jax.lax.Precision.HIGHEST)
  assert out.dtype == jnp.bfloat16 and not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, ref) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes):], 0.0)


def test_public_op_runs_this_tier_by_name():
  m, k, n, sizes = 48, 256, 128, (20, 28)
  x = activations(7, m, k)
  packed, scale = weights(8, len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  assert plan_ragged_dot(x, packed, scale, gs, impl="mosaic_tpu", interpret=True).impl == (
      "mosaic_tpu")
  out = mxfp4_ragged_dot(x, packed, scale, gs, impl="mosaic_tpu", interpret=True)
  assert out.dtype == jnp.bfloat16 and rel_err(out, oracle(x, packed, scale, sizes)) < BF16_TOL


def test_supports_reasons():
  x = jnp.zeros((16, 512), jnp.bfloat16)
  packed, scale = jnp.zeros((256, 256), jnp.uint8), jnp.zeros((256, 16), jnp.uint8)
  gs = jnp.zeros((2,), jnp.int32)
  assert mosaic_tpu.supports_matmul(x, packed, scale, interpret=True) is None
  assert mosaic_tpu.supports_ragged_dot(x, packed[None].repeat(2, 0), scale[None].repeat(2, 0),
                                        gs, interpret=True) is None
  assert "not a TPU" in mosaic_tpu.supports_matmul(x, packed, scale)
  assert "K=288" in mosaic_tpu.supports_matmul(
      jnp.zeros((16, 288), jnp.bfloat16), jnp.zeros((256, 144), jnp.uint8),
      jnp.zeros((256, 9), jnp.uint8), interpret=True)
  assert "N=200" in mosaic_tpu.supports_matmul(x, packed[:200], scale[:200], interpret=True)
  assert "float16" in mosaic_tpu.supports_matmul(x.astype(jnp.float16), packed, scale,
                                                 interpret=True)
  assert "output" in mosaic_tpu.supports_matmul(x, packed, scale,
                                                preferred_element_type=jnp.int32, interpret=True)
  assert "w_packed must be uint8" in mosaic_tpu.supports_matmul(
      x, packed.astype(jnp.int8), scale, interpret=True)
  assert "group_sizes" in mosaic_tpu.supports_ragged_dot(
      x, packed[None].repeat(2, 0), scale[None].repeat(2, 0), gs[:1], interpret=True)


@pytest.mark.parametrize("args, match", [
    (((16, 512), (256, 128), (256, 16)), "w_packed must be"),
    (((16, 512), (256, 256), (256, 32)), "w_scale must have shape"),
    (((16, 4, 512), (256, 256), (256, 16)), "x must be"),
])
def test_bad_shapes_raise(args, match):
  x, packed, scale = (jnp.zeros(s, d) for s, d in zip(args, (jnp.bfloat16, jnp.uint8,
                                                              jnp.uint8)))
  with pytest.raises(ValueError, match=match):
    mosaic_tpu.matmul(x, packed, scale, interpret=True)


def test_bad_group_sizes_raise():
  x, packed, scale = (jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((2, 256, 256), jnp.uint8),
                      jnp.zeros((2, 256, 16), jnp.uint8))
  with pytest.raises(ValueError, match="group_sizes must be int32"):
    mosaic_tpu.ragged_dot(x, packed, scale, jnp.zeros((2,), jnp.uint32), interpret=True)
  with pytest.raises(ValueError, match=r"group_sizes must have shape \(2,\)"):
    mosaic_tpu.ragged_dot(x, packed, scale, jnp.zeros((3,), jnp.int32), interpret=True)
