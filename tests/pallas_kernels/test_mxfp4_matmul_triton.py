"""The MXFP4 matmul's Triton tier (`pallas_kernels/mxfp4_matmul/triton.py`) on CPU: the kernel
in Pallas's interpreter against the reference (`k3jax.mx.unpack_k3`, bf16 operands, fp32 sums)
and the spec's nibble table (`mxfp4_testing.py`), its bit formulas exhaustively, the API's
routing and refusals, and its lowering to Triton IR for an H200.

The interpreter runs the kernel's loads, masks, even / odd split of x, dots and stores with the
"exp" dequantization ("shift" needs the GPU's subnormal bf16 multiply; XLA:CPU flushes
subnormals, there and in the reference alike, so values below 2^-126 are zero on both sides
here; the GPU tests check them). fp32 outputs are compared at 1e-5 relative L2 (bf16 products
summed in fp32: the order only), bf16 outputs at 1e-2 (their rounding, ~3e-3). MXFP8 activations
(`Config.act="mxfp8"`) against their own oracle: x through `mx.quantize(x, "mxfp8")` and
`mx.dequantize` in fp32 times the reference's weight in fp32, at 1e-6 (summation order only).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import triton_sass
from pallas_kernels import tiers
from k3jax import mx
from mxfp4_testing import NIBBLE
from mxfp4_testing import check_mxfp8_overflow_and_nan
from mxfp4_testing import dequantize
from mxfp4_testing import every_code
from mxfp4_testing import oracle
from mxfp4_testing import plant_overflow_and_nan
from mxfp4_testing import rel_err
from pallas_kernels.mxfp4_matmul import IMPLS
from pallas_kernels.mxfp4_matmul import mosaic_gpu as mxfp4_mosaic_gpu
from pallas_kernels.mxfp4_matmul import api as mxfp4_api
from pallas_kernels.mxfp4_matmul import mxfp4_expert_ffn
from pallas_kernels.mxfp4_matmul import mxfp4_gate_up
from pallas_kernels.mxfp4_matmul import mxfp4_matmul
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan
from pallas_kernels.mxfp4_matmul import plan_expert_ffn
from pallas_kernels.mxfp4_matmul import plan_gate_up
from pallas_kernels.mxfp4_matmul import plan_ragged_dot
from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.mxfp4_matmul import triton

BF16_TOL = 1e-2
F32_TOL = 1e-5
# Scale bytes whose weights are all finite: 2^-127 (products below 2^-126: flushed on CPU),
# 2^-126, ..., the clamp bounds of "exp" (2, 252) and their neighbours, 1 and 2.
FINITE_EDGES = np.array([0, 1, 2, 3, 64, 126, 127, 128, 200, 251, 252], np.uint8)
F8_TOL = 1e-6
FP8 = dict(act="mxfp8")
# E2M1 code -> the E4M3 byte of its value times 2^-6, written out: 0, 2^-7 (subnormal 4/8 of
# 2^-6), 2^-6, 1.5 2^-6, 2^-5, 1.5 2^-5, 2^-4, 1.5 2^-4, then the same with the sign bit.
E4M3_OF_CODE = np.array([0x00, 0x04, 0x08, 0x0C, 0x10, 0x14, 0x18, 0x1C,
                         0x80, 0x84, 0x88, 0x8C, 0x90, 0x94, 0x98, 0x9C], np.uint8)


def weights(seed: int, *shape: int):
  return mx.pack_k3(0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def activations(seed: int, m: int, k: int) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


def mxfp8_x(x: jax.Array) -> jax.Array:
  """x rounded to MXFP8 along K (the library's quantizer), dequantized to fp32."""
  return mx.dequantize(*mx.quantize(x, "mxfp8", axis=-1))


def mxfp8_oracle(x, packed, scale, gs=None) -> jax.Array:
  """fp32 product of MXFP8-rounded x and the dequantized weight (the reference tier with fp32
  operands at HIGHEST precision), dense or grouped."""
  if gs is None:
    return reference.matmul(mxfp8_x(x), packed, scale, preferred_element_type=jnp.float32)
  return reference.ragged_dot(mxfp8_x(x), packed, scale, gs, preferred_element_type=jnp.float32)


def flushed(w: np.ndarray) -> np.ndarray:
  """float32 of w with magnitudes below 2^-126 set to zero (XLA:CPU's flushing)."""
  w = w.astype(np.float32)
  return np.where(np.abs(w) < 2.0 ** -126, np.float32(0), w)


def test_every_code_and_finite_scale_edge_exactly():
  """x = I [K, K]: out = W^T for every code in both nibbles under scales 0 (2^-127) ... 252,
  exactly (the nibble table; flushed below 2^-126 as the reference is on CPU), and equal to the
  reference bit for bit. 32 row blocks of x, 4 column blocks."""
  n, k = 64, 512
  packed, _ = every_code(n, k, seed=11)
  scale = FINITE_EDGES[(np.arange(n)[:, None] + np.arange(k // 32)[None, :]) % len(FINITE_EDGES)]
  p, s = jnp.asarray(packed), jnp.asarray(scale)
  x = jnp.eye(k, dtype=jnp.bfloat16)
  out = np.asarray(mxfp4_matmul(x, p, s, impl="triton", interpret=True,
                                preferred_element_type=jnp.float32))
  want = flushed(dequantize(packed, scale).T)
  assert np.count_nonzero(want) > want.size // 2     # mostly normal values
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(out, np.asarray(reference.matmul(
      x, p, s, preferred_element_type=jnp.float32)))


def test_large_scales_overflow_and_nan():
  """Scales 253 / 254 with |value| <= 1.5: exact (x = I). Then a lone 6 * 2^127 weight gives
  +inf by x's sign in its column, a lone -6 * 2^126 -inf, a NaN scale byte a NaN column; the
  other columns (scales 100-150) match the reference."""
  n, k = 64, 512
  rng = np.random.default_rng(4)
  packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8) & 0xBB    # codes 0-3, 8-11
  scale = np.where(rng.random((n, k // 32)) < 0.5, 253, 254).astype(np.uint8)
  run = lambda x: np.asarray(triton.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                                           preferred_element_type=jnp.float32, interpret=True))
  np.testing.assert_array_equal(run(jnp.eye(k, dtype=jnp.bfloat16)),
                                dequantize(packed, scale).T.astype(np.float32))
  packed[:3], scale[3:] = 0, rng.integers(100, 151, (n - 3, k // 32))
  packed[0, 5], scale[0, 0] = 0x07, 254      # element 10: 6 * 2^127 -> +inf
  packed[1, 9], scale[1, 0] = 0xF0, 253      # element 19: -6 * 2^126 -> -inf
  scale[2, 4] = 255                          # NaN
  x = activations(3, 5, k)
  out = run(x)
  sign = np.sign(np.asarray(x, np.float32))
  np.testing.assert_array_equal(out[:, 0], sign[:, 10] * np.inf)
  np.testing.assert_array_equal(out[:, 1], -sign[:, 19] * np.inf)
  assert np.isnan(out[:, 2]).all() and np.isfinite(out[:, 3:]).all()
  ref = np.asarray(reference.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                                    preferred_element_type=jnp.float32))
  np.testing.assert_array_equal(out[:, :3], ref[:, :3])
  assert rel_err(out[:, 3:], ref[:, 3:]) < F32_TOL


def test_exp_bits_for_every_code_and_scale():
  """`exp_values` for the 16 codes x the scale bytes 2-252 (where it is integer ops only, its
  multiply by F = 1 exact on any platform) as bf16 bits against the table's values times
  2^(s - 127) rounded by ml_dtypes; `e8m0_bf16` for all 256 bytes; `shift_bits` for the codes."""
  codes = np.arange(16, dtype=np.int16)[:, None]
  scales = np.arange(2, 253, dtype=np.int16)[None, :]
  got = jax.jit(triton.exp_values)(jnp.asarray(codes), jnp.asarray(scales))
  want = (NIBBLE[:, None] * 2.0 ** (scales.astype(np.float64) - 127)).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
  e8m0 = np.asarray(triton.e8m0_bf16(jnp.arange(256, dtype=jnp.int16))).view(np.uint16)
  want = (2.0 ** (np.arange(255) - 127.0)).astype(ml_dtypes.bfloat16).view(np.uint16)
  np.testing.assert_array_equal(e8m0[:255], want)           # 2^-127: the subnormal 0x0040
  assert e8m0[0] == 0x0040 and e8m0[255] == 0x7FC0
  bits = np.asarray(triton.shift_bits(jnp.asarray(np.arange(16, dtype=np.int16) << 12)))
  want = (NIBBLE * 2.0 ** -126).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(bits.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("m, k, n", [(1, 1024, 64), (5, 512, 128), (16, 512, 64),
                                     (37, 512, 64)])
def test_matmul_against_reference(m, k, n):
  """Dense, fp32 and bf16 outputs: one row (15 masked), 5, a full block of 16, and 37 rows (3
  row blocks, the last partial); K = 1024 in 2 steps of 512."""
  x = activations(m, m, k)
  packed, scale = weights(m + 1, n, k)
  ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
  out = mxfp4_matmul(x, packed, scale, impl="triton", interpret=True,
                     preferred_element_type=jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.float32 and rel_err(out, ref) < F32_TOL
  assert rel_err(out, oracle(x, packed[None], scale[None], [m])) < BF16_TOL
  out = mxfp4_matmul(x, packed, scale, impl="triton", interpret=True)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL


RAGGED_CASES = {
    # an empty expert, a 20-row one (2 row blocks), a one-row one, rows 33-37 past the groups
    "uneven": (38, (3, 0, 20, 1, 9), None),
    # more experts than rows: slots min(G, M) + 1 = 6 over 8 experts, empty first and last
    "sparse": (5, (0, 1, 0, 2, 0, 0, 1, 0), None),
    # swapped operands (acc^T = W x^T, stored transposed), block_n 32, K in 4 steps of 128
    "swap": (20, (7, 0, 9), triton.Config(block_n=32, block_k=128, swap=True)),
    # split-K: 8 steps of 64 shared by 4 programs, added into the zeroed output (no zero slot)
    "split": (38, (3, 0, 20, 1, 9), triton.Config(block_k=64, split_k=4)),
}


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_dot_against_reference(case):
  m, sizes, cfg = RAGGED_CASES[case]
  k, n = 512, 64
  x = activations(m, m, k)
  packed, scale = weights(len(sizes), len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = reference.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = triton.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32,
                          interpret=True, config=cfg)
  end = sum(sizes)
  assert out.shape == (m, n) and rel_err(out, ref) < F32_TOL
  assert rel_err(out, oracle(x, packed, scale, sizes)) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out)[end:], 0.0)
  out = mxfp4_ragged_dot(x, packed, scale, gs, impl="triton", interpret=True)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out, np.float32)[end:], 0.0)


def test_dense_swap_and_wide_tiles():
  """The swapped product and block_n = 64 dense (two row blocks, fp32)."""
  m, k, n = 20, 512, 128
  x = activations(1, m, k)
  packed, scale = weights(2, n, k)
  ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
  for cfg in (triton.Config(block_n=64, block_k=256, swap=True), triton.Config(block_n=64)):
    out = triton.matmul(x, packed, scale, preferred_element_type=jnp.float32, interpret=True,
                        config=cfg)
    assert rel_err(out, ref) < F32_TOL, cfg


def test_split_k_dense():
  """split_k programs per output tile, each adding its K steps' fp32 partial: 37 rows (the last
  row block partial), K = 512 in 8 steps of 64 shared by 2 and by 8 programs, swapped too; fp32
  and bf16 outputs."""
  m, k, n = 37, 512, 64
  x = activations(3, m, k)
  packed, scale = weights(4, n, k)
  ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
  for cfg in (triton.Config(block_k=64, split_k=2), triton.Config(block_k=64, split_k=8),
              triton.Config(block_n=32, block_k=64, split_k=4, swap=True)):
    out = triton.matmul(x, packed, scale, preferred_element_type=jnp.float32, interpret=True,
                        config=cfg)
    assert out.dtype == jnp.float32 and rel_err(out, ref) < F32_TOL, cfg
    out = triton.matmul(x, packed, scale, interpret=True, config=cfg)
    assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL, cfg


def test_fma_products():
  """The products on the CUDA cores (`Config.fma`): each 32-block's dot of unscaled values
  times its scale, in fp32. Dense: 1 row, 5 and 37 rows (partial row blocks of 1, 2 and 4),
  block_n 4 and 8; grouped with an empty expert and rows past the groups; fp32 and bf16."""
  k, n = 512, 64
  packed, scale = weights(6, n, k)
  for m, cfg in ((1, triton.Config(block_n=4, block_m=1, fma=True)),
                 (5, triton.Config(block_n=8, block_k=128, block_m=2, fma=True)),
                 (37, triton.Config(block_n=4, block_k=256, block_m=4, fma=True))):
    x = activations(m, m, k)
    ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
    out = triton.matmul(x, packed, scale, preferred_element_type=jnp.float32, interpret=True,
                        config=cfg)
    assert rel_err(out, ref) < F32_TOL, cfg
    out = triton.matmul(x, packed, scale, interpret=True, config=cfg)
    assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL, cfg
  sizes = (3, 0, 6, 1)
  x = activations(7, 12, k)
  packed, scale = weights(7, len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = reference.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = triton.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32,
                          interpret=True, config=triton.Config(block_n=4, block_m=2, fma=True))
  assert rel_err(out, ref) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)


def test_unrolled_k_steps():
  """`Config.unroll` (every K step's loads first, then the products, no loop): dense on the MMA
  (plain, swapped, split-K 2) and on the CUDA cores (fma, 1 and 5 rows), grouped with an empty
  expert and rows past the groups; against the reference in fp32."""
  k, n = 512, 64
  packed, scale = weights(8, n, k)
  for m, cfg in ((16, triton.Config(block_k=128, unroll=True)),
                 (21, triton.Config(block_n=32, block_k=64, swap=True, unroll=True)),
                 (16, triton.Config(block_k=64, split_k=2, unroll=True)),
                 (1, triton.Config(block_n=4, block_m=1, fma=True, unroll=True)),
                 (5, triton.Config(block_n=8, block_k=128, block_m=2, fma=True, unroll=True))):
    x = activations(m + 1, m, k)
    ref = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
    out = triton.matmul(x, packed, scale, preferred_element_type=jnp.float32, interpret=True,
                        config=cfg)
    assert rel_err(out, ref) < F32_TOL, cfg
  sizes = (3, 0, 6, 1)
  x = activations(9, 12, k)
  packed, scale = weights(9, len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = reference.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32)
  for cfg in (triton.Config(block_k=128, unroll=True),
              triton.Config(block_n=4, block_m=1, fma=True, unroll=True)):
    out = triton.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32,
                            interpret=True, config=cfg)
    assert rel_err(out, ref) < F32_TOL, cfg
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)


def gate_up_oracle(x, rows, w1, w3, sizes, beta1, beta2) -> np.ndarray:
  """SiTU(x[rows] W1_g^T, x[rows] W3_g^T) in float64 by a loop over the rows: each row's
  token and expert looked up one by one, the weights unpacked by `mx.unpack_k3`, SiTU written
  out; rows past the groups zero."""
  x = np.asarray(x, np.float64)
  w1, w3 = (np.asarray(mx.unpack_k3(*w), np.float64) for w in (w1, w3))
  expert = np.repeat(np.arange(len(sizes)), sizes)
  h = np.zeros((len(rows), w1.shape[1]))
  for r, e in enumerate(expert):
    g, u = w1[e] @ x[rows[r]], w3[e] @ x[rows[r]]
    h[r] = beta1 * np.tanh(g / beta1) / (1 + np.exp(-g)) * beta2 * np.tanh(u / beta2)
  return h


def test_gate_up_gathers_both_products_and_situ():
  """`triton.gate_up` (one kernel: the gather of each row's token, W1 and W3 dequantized and
  dotted, SiTU) against a float64 loop over the rows: tokens picked twice and never, an empty
  expert, rows past the groups (zeros); block_m 16 over a 20-row expert (two row blocks);
  through the API with impl="triton" and, by default off Hopper, the reference."""
  n, k, f, beta1, beta2 = 9, 256, 64, 4.0, 2.0
  sizes = (3, 0, 20, 1)
  m = sum(sizes) + 2
  x = activations(11, n, k)
  rows = jnp.asarray(np.random.default_rng(0).integers(0, n - 1, m), jnp.int32)  # never n-1
  w1, w3 = weights(12, len(sizes), f, k), weights(13, len(sizes), f, k)
  gs = jnp.asarray(sizes, jnp.int32)
  want = gate_up_oracle(x.astype(jnp.float32), np.asarray(rows), w1, w3, sizes, beta1, beta2)
  for cfg in (triton.Config(block_n=32, block_k=128), triton.Config(block_k=64, block_n=64)):
    h = triton.gate_up(x, rows, *w1, *w3, gs, beta1=beta1, beta2=beta2, interpret=True,
                       config=cfg)
    assert h.dtype == jnp.bfloat16 and rel_err(h, want) < BF16_TOL, cfg
    np.testing.assert_array_equal(np.asarray(h, np.float32)[sum(sizes):], 0.0)
  for impl in ("triton", None):
    p = plan_gate_up(x, rows, *w1, *w3, gs, impl=impl, interpret=True)
    assert p.impl == (impl or "reference"), p
    h = mxfp4_gate_up(x, rows, *w1, *w3, gs, beta1=beta1, beta2=beta2, impl=impl,
                      interpret=True)
    assert rel_err(h, want) < BF16_TOL, impl


def test_gate_up_default_is_the_kernel_on_hopper(monkeypatch):
  """impl=None: the Triton kernel first on Hopper (the reference when it declines), the
  reference elsewhere."""
  x = activations(0, 4, 128)
  rows = jnp.arange(8, dtype=jnp.int32) % 4
  w, gs = weights(0, 2, 32, 128), jnp.asarray([5, 3], jnp.int32)
  assert plan_gate_up(x, rows, *w, *w, gs, interpret=True).impl == "reference"
  monkeypatch.setattr(mxfp4_mosaic_gpu, "is_hopper", lambda: True)
  assert plan_gate_up(x, rows, *w, *w, gs, interpret=True).impl == "triton"
  p = plan_gate_up(x.astype(jnp.float32), rows, *w, *w, gs, interpret=True)
  assert p.impl == "reference" and p.declined[0][0] == "triton", p


def test_gate_up_refusals():
  """The kernel takes MMA tiles only (a named config with split-K, swap or fma is refused,
  and the API falls through to the reference with the reason); bad shapes name the argument."""
  x = activations(0, 4, 128)
  rows = jnp.arange(8, dtype=jnp.int32) % 4
  w, gs = weights(0, 2, 32, 128), jnp.asarray([5, 3], jnp.int32)
  for cfg in (triton.Config(block_k=64, split_k=2),
              triton.Config(block_n=32, block_k=64, swap=True),
              triton.Config(block_n=4, block_k=64, block_m=1, fma=True)):
    reason = triton.supports_gate_up(x, rows, *w, *w, gs, interpret=True, config=cfg)
    assert reason is not None and "gate_up takes an MMA tile" in reason, (cfg, reason)
  p = plan_gate_up(x.astype(jnp.float32), rows, *w, *w, gs, impl="triton", interpret=True)
  assert p.impl == "reference" and "bfloat16" in p.declined[0][1], p
  with pytest.raises(ValueError, match=r"x must be a floating \[N, K\] array"):
    plan_gate_up(x[None], rows, *w, *w, gs)
  with pytest.raises(ValueError, match="rows must be an integer"):
    plan_gate_up(x, rows.astype(jnp.float32), *w, *w, gs)
  with pytest.raises(ValueError, match="w3_packed must have w1_packed's shape"):
    plan_gate_up(x, rows, *w, *weights(1, 2, 64, 128), gs)
  with pytest.raises(ValueError, match="impl must be None or one of"):
    plan_gate_up(x, rows, *w, *w, gs, impl="mosaic_gpu")


@pytest.mark.parametrize("n, m, k, f, g", [(16, 128, 512, 512, 64), (16, 256, 3584, 3072, 896)])
def test_gate_up_lowers_to_one_triton_call_for_h200(n, m, k, f, g):
  """`triton.gate_up` at k3_small's decode shape (16 tokens x top-8 over 64 experts, 512 ->
  512) and K3's (top-16 over 896, 3584 -> 3072) lowers for an H200 to one Triton kernel whose
  grid is (F / block_n, min(G, M) + 1) (`benchmarks.triton_sass`'s abstract device)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
  args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.int32),
          u8(g, f, k // 2), u8(g, f, k // 32), u8(g, f, k // 2), u8(g, f, k // 32),
          jax.ShapeDtypeStruct((g,), jnp.int32))
  fn = lambda *a: triton.gate_up(*a, beta1=4.0, beta2=2.0)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  [(name, params, _)] = triton_sass.triton_modules(lowered)
  cfg = triton.default_config(m, k, f, True, gate_up=True)
  assert name == "mxfp4_gate_up_triton", name
  assert (params["grid_x"], params["grid_y"]) == (f // cfg.block_n, min(g, m) + 1), params


def routing(seed: int, n: int, top_k: int, g: int, skip: int | None = None):
  """Random top-k experts of n tokens (expert `skip` never picked): weights [n, k] fp32, and
  the copies sorted by expert with numpy (order, inverse, sizes)."""
  rng = np.random.default_rng(seed)
  pool = [e for e in range(g) if e != skip]
  experts = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(n)])
  order = np.argsort(experts.reshape(-1), kind="stable")
  sizes = np.bincount(experts.reshape(-1), minlength=g)
  w = rng.uniform(0.1, 1.0, (n, top_k)).astype(np.float32)
  return (jnp.asarray(w), jnp.asarray(order, jnp.int32),
          jnp.asarray(np.argsort(order), jnp.int32), experts, sizes)


def expert_ffn_oracle(x, w, experts, w1, w3, w2, beta1, beta2) -> np.ndarray:
  """u[n] = sum_j w[n, j] W2_e SiTU(W1_e x_n, W3_e x_n) in float64, token by token and copy
  by copy (e = experts[n, j]), h rounded to bf16 as the kernel's W2 operand is."""
  x = np.asarray(x, np.float64)
  w1, w3, w2 = (np.asarray(mx.unpack_k3(*a), np.float64) for a in (w1, w3, w2))
  u = np.zeros((x.shape[0], w2.shape[1]))
  for n in range(x.shape[0]):
    for j, e in enumerate(experts[n]):
      g, up = w1[e] @ x[n], w3[e] @ x[n]
      h = beta1 * np.tanh(g / beta1) / (1 + np.exp(-g)) * beta2 * np.tanh(up / beta2)
      h = np.asarray(h.astype(ml_dtypes.bfloat16), np.float64)
      u[n] += w[n, j] * (w2[e] @ h)
  return u


@pytest.mark.parametrize("cfg", [triton.Config(block_n=32, block_k=128),
                                 triton.Config(block_n=64, block_k=64)])
def test_expert_ffn_matches_a_loop_over_copies(cfg):
  """`triton.expert_ffn` (one kernel: gather, W1 / W3, SiTU, W2 by hidden blocks, then one
  fusion summing blocks and copies) against a float64 loop over every token's copies: an
  expert never picked, K 256 in two or four steps, D 256 in two chunks of FFN_BLOCK_D; the
  reference tier the same; copies past the groups (a larger order) give no output."""
  n, top_k, g, k, f, d, beta1, beta2 = 10, 3, 5, 256, 128, 256, 4.0, 2.0
  w, order, inverse, experts, sizes = routing(3, n, top_k, g, skip=2)
  assert sizes[2] == 0
  x = activations(21, n, k)
  w1, w3, w2 = weights(22, g, f, k), weights(23, g, f, k), weights(24, g, d, f)
  gs = jnp.asarray(sizes, jnp.int32)
  want = expert_ffn_oracle(x.astype(jnp.float32), np.asarray(w), experts, w1, w3, w2,
                           beta1, beta2)
  u = triton.expert_ffn(x, w, order, inverse, *w1, *w3, *w2, gs, beta1=beta1, beta2=beta2,
                        interpret=True, config=cfg)
  assert u.dtype == jnp.float32 and u.shape == (n, d)
  assert rel_err(u, want) < 1e-3, cfg
  ref = reference.expert_ffn(x, w, order, inverse, *w1, *w3, *w2, gs, beta1=beta1,
                             beta2=beta2)
  assert rel_err(ref, want) < 1e-3


def test_expert_ffn_api_default_and_refusals(monkeypatch):
  """impl=None: the reference (the kernel joins Hopper's default with EXPERT_FFN_IS_DEFAULT);
  impl="triton" in the interpreter equals the reference; a config the kernel cannot take and
  bad arguments are named."""
  n, top_k, g, k, f, d = 6, 2, 4, 128, 64, 64
  w, order, inverse, experts, sizes = routing(5, n, top_k, g)
  x = activations(1, n, k)
  ws = (*weights(2, g, f, k), *weights(3, g, f, k), *weights(4, g, d, f))
  gs = jnp.asarray(sizes, jnp.int32)
  args = (x, w, order, inverse, *ws, gs)
  assert plan_expert_ffn(*args, interpret=True).impl == "reference"
  monkeypatch.setattr(mxfp4_mosaic_gpu, "is_hopper", lambda: True)
  assert plan_expert_ffn(*args, interpret=True).impl == "reference"
  monkeypatch.setattr(mxfp4_api, "EXPERT_FFN_IS_DEFAULT", True)
  assert plan_expert_ffn(*args, interpret=True).impl == "triton"
  got = {impl: mxfp4_expert_ffn(*args, beta1=4.0, beta2=2.0, impl=impl, interpret=True)
         for impl in ("triton", "reference")}
  assert rel_err(got["triton"], np.asarray(got["reference"], np.float64)) < 1e-3
  small = triton.Config(block_n=16, block_k=64)
  assert "W2's K step" in triton.supports_expert_ffn(x, order, *ws, gs, interpret=True,
                                                      config=small)
  odd = (*ws[:4], *weights(4, g, 48, f))
  assert "output width D=48" in triton.supports_expert_ffn(x, order, *odd, gs, interpret=True)
  with pytest.raises(ValueError, match=r"weights must be \[N, k\] with N = 6"):
    plan_expert_ffn(x, w[:5], order, inverse, *ws, gs)
  with pytest.raises(ValueError, match=r"inverse must be an integer \[12\] array"):
    plan_expert_ffn(x, w, order, inverse[:5], *ws, gs)
  with pytest.raises(ValueError, match=r"W2 \(the product of h \[M, F=64\]\): w_packed"):
    plan_expert_ffn(x, w, order, inverse, *ws[:4], *weights(4, g, d, 2 * f), gs)
  with pytest.raises(ValueError, match="w2_packed must hold G=4 experts"):
    plan_expert_ffn(x, w, order, inverse, *ws[:4], *weights(4, g + 1, d, f), gs)


def test_expert_ffn_lowers_to_one_triton_call_for_h200():
  """`triton.expert_ffn` at k3_small's decode shape (16 tokens x top-8 over 64 experts, 512 ->
  512 -> 512) lowers for an H200 to one Triton kernel, grid (F / block_n, min(G, M) + 1)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  n, top_k, g, k, f, d = 16, 8, 64, 512, 512, 512
  u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((n, top_k), jnp.float32), i32(n * top_k), i32(n * top_k),
          u8(g, f, k // 2), u8(g, f, k // 32), u8(g, f, k // 2), u8(g, f, k // 32),
          u8(g, d, f // 2), u8(g, d, f // 32), i32(g))
  fn = lambda *a: triton.expert_ffn(*a, beta1=4.0, beta2=2.0)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  [(name, params, _)] = triton_sass.triton_modules(lowered)
  cfg = triton.default_config(n * top_k, k, f, True, gate_up=True)
  assert name == "mxfp4_expert_ffn_triton", name
  assert (params["grid_x"], params["grid_y"]) == (f // cfg.block_n, min(g, n * top_k) + 1)


# ------------------------------------------------------------------------------------------
# MXFP8 activations (`Config.act="mxfp8"`): fp8 MMAs per block of 32
# ------------------------------------------------------------------------------------------

def spread(seed: int, rows: int, k: int, span: int) -> np.ndarray:
  """[rows, k] powers of two 2^e, e uniform in [-span, span], constant over each block of 32
  along K: scales that differ by row and by block."""
  e = np.random.default_rng(seed).integers(-span, span + 1, (rows, k // 32))
  return np.repeat(2.0 ** e, 32, axis=1).astype(np.float32)


def test_e4m3_bytes_of_every_code_and_x_factor():
  """Both nibbles of all 256 bytes against the E4M3 table written out above, bit for bit; the
  table's E4M3 values are the nibble table's times 2^-6 (ml_dtypes); `fp8_weights` gives a block
  as [low nibbles | high ones] = [W's even columns | odd ones]. x's factor 2^(s - 121) for every
  scale byte a bf16 x can get (at most 246, bf16's largest block) and NaN for 255."""
  b = np.arange(256, dtype=np.uint8)
  low, high = jax.jit(triton.e4m3_bytes)(jnp.asarray(b))
  np.testing.assert_array_equal(np.asarray(low), E4M3_OF_CODE[b & 15])
  np.testing.assert_array_equal(np.asarray(high), E4M3_OF_CODE[b >> 4])
  np.testing.assert_array_equal(E4M3_OF_CODE.view(ml_dtypes.float8_e4m3fn).astype(np.float64),
                                NIBBLE * 2.0 ** -6)
  packed = b.reshape(16, 16)
  w = triton.fp8_weights(jnp.asarray(packed), "ptx", interpret=True)
  assert w.dtype == jnp.float8_e4m3fn and w.shape == (16, 32)
  want = dequantize(packed, np.full((16, 1), 127 - 6, np.uint8))
  np.testing.assert_array_equal(np.asarray(w, np.float64),
                                np.concatenate([want[:, 0::2], want[:, 1::2]], axis=1))
  f = np.asarray(triton.x_factor(jnp.asarray(b)))
  np.testing.assert_array_equal(f[:247], 2.0 ** (np.arange(247) - 121.0))
  assert np.isnan(f[255])
  big = jnp.full((1, 32), jnp.finfo(jnp.bfloat16).max, jnp.bfloat16)
  assert int(jax.lax.bitcast_convert_type(mx.quantize(big, "mxfp8")[1], jnp.uint8)[0, 0]) == 246


def test_mxfp8_large_scales_overflow_and_nan():
  """Scales 253 / 254 with |value| <= 1.5: exact (x = I). A weight past fp32's range (6 * 2^127,
  -6 * 2^126) is never formed: its column is x's E4M3 value times it rounded once in fp32, inf
  only where that overflows (the reference, which forms the weight, gives inf throughout). A NaN
  scale byte gives a NaN column, an inf in x (its block's scale byte 255) a NaN row; the other
  entries match the MXFP8 oracle."""
  n, k = 64, 512
  rng = np.random.default_rng(4)
  packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8) & 0xBB    # codes 0-3, 8-11
  scale = np.where(rng.random((n, k // 32)) < 0.5, 253, 254).astype(np.uint8)
  run = lambda x: np.asarray(triton.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                                           preferred_element_type=jnp.float32, interpret=True,
                                           config=triton.Config(**FP8)))
  np.testing.assert_array_equal(run(jnp.eye(k, dtype=jnp.bfloat16)),
                                dequantize(packed, scale).T.astype(np.float32))
  scale[3:] = rng.integers(100, 151, (n - 3, k // 32))
  plant_overflow_and_nan(packed, scale)
  x = activations(3, 5, k).at[4, 300].set(jnp.inf)
  out = run(x)
  check_mxfp8_overflow_and_nan(out, np.asarray(mxfp8_x(x), np.float64), rows=4)
  ref = np.asarray(mxfp8_oracle(x, jnp.asarray(packed), jnp.asarray(scale)))
  assert rel_err(out[:4, 3:], ref[:4, 3:]) < F8_TOL


@pytest.mark.parametrize("swap", [False, True])
def test_mxfp8_every_code_and_scale_edge_exactly(swap):
  """x = I [K, K] (E4M3-exact: each row's block holds one 1): out = W^T exactly for every code
  in both nibbles under the scale edges 0 ... 252, flushed below 2^-126 as the reference is on
  CPU and zero under scale byte 0 (its factor 2^-127 is a subnormal, which XLA:CPU flushes; the
  GPU tests keep it). Then x = diag(2^e), e in [-40, 40] by row (x's scale bytes 79 ... 159):
  out = 2^e W^T exactly, so a wrong 2^6, a scale on the wrong axis or a block out of K order
  shows."""
  n, k = 64, 512
  packed, random_scale = every_code(n, k, seed=12)
  scale = FINITE_EDGES[(np.arange(n)[:, None] + np.arange(k // 32)[None, :]) % len(FINITE_EDGES)]
  cfg = triton.Config(block_n=32, block_k=128, swap=swap, act="mxfp8")
  run = lambda x, s: np.asarray(triton.matmul(x, jnp.asarray(packed), jnp.asarray(s),
                                              preferred_element_type=jnp.float32,
                                              interpret=True, config=cfg))
  want = np.where(np.repeat(scale == 0, 32, axis=1), 0, flushed(dequantize(packed, scale))).T
  np.testing.assert_array_equal(run(jnp.eye(k, dtype=jnp.bfloat16), scale), want)
  e = (np.arange(k) * 7) % 81 - 40
  x = jnp.asarray(np.diag(2.0 ** e), jnp.bfloat16)
  want = (2.0 ** e[:, None] * dequantize(packed, random_scale).T).astype(np.float32)
  np.testing.assert_array_equal(run(x, random_scale), want)


@pytest.mark.parametrize("m, cfg", [
    (1, triton.Config(block_n=32, **FP8)),
    (5, triton.Config(block_n=32, block_k=128, swap=True, **FP8)),
    (16, triton.Config(block_k=256, dequant="exp", **FP8)),
    (37, triton.Config(block_n=64, block_k=64, split_k=4, **FP8)),
])
def test_mxfp8_matmul_against_oracle(m, cfg):
  """Dense, x and W scaled by 2^-12 ... 2^12 per row and block of 32 (x's and W's scale bytes
  differ along both axes): fp32 output at 1e-6 of the MXFP8 oracle and bf16 at 1e-2. One row,
  5 (swapped), a full block of 16, 37 in 3 row blocks with split-K; the bf16 reference (x
  exact) is ~3e-2 away: x is rounded to E4M3."""
  k, n = 512, 128
  x = (activations(m, m, k).astype(jnp.float32) * spread(m, m, k, 12)).astype(jnp.bfloat16)
  packed, scale = mx.pack_k3(jnp.asarray(spread(m + 1, n, k, 12))
                             * 0.02 * jax.random.normal(jax.random.key(m), (n, k)))
  want = mxfp8_oracle(x, packed, scale)
  out = triton.matmul(x, packed, scale, preferred_element_type=jnp.float32, interpret=True,
                      config=cfg)
  assert out.shape == (m, n) and rel_err(out, want) < F8_TOL, cfg
  exact = reference.matmul(x, packed, scale, preferred_element_type=jnp.float32)
  assert 1e-2 < rel_err(out, exact) < 6e-2
  out = triton.matmul(x, packed, scale, interpret=True, config=cfg)
  assert out.dtype == jnp.bfloat16 and rel_err(out, want) < BF16_TOL


RAGGED_FP8_CASES = {
    "uneven": (38, (3, 0, 20, 1, 9), triton.Config(block_n=32, **FP8)),
    "sparse_swap": (5, (0, 1, 0, 2, 0, 0, 1, 0),
                    triton.Config(block_n=32, block_k=128, swap=True, **FP8)),
    "split": (38, (3, 0, 20, 1, 9), triton.Config(block_k=64, split_k=4, **FP8)),
}


@pytest.mark.parametrize("case", RAGGED_FP8_CASES)
def test_mxfp8_ragged_dot_against_oracle(case):
  """Grouped against the MXFP8 oracle (`reference.ragged_dot` of MXFP8-rounded x in fp32): an
  empty expert, a 20-row one (2 row blocks), more experts than rows, swapped, split-K; rows
  past the groups zero."""
  m, sizes, cfg = RAGGED_FP8_CASES[case]
  k, n = 512, 64
  x = (activations(m, m, k).astype(jnp.float32) * spread(m, m, k, 8)).astype(jnp.bfloat16)
  packed, scale = weights(len(sizes), len(sizes), n, k)
  gs = jnp.asarray(sizes, jnp.int32)
  out = triton.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32,
                          interpret=True, config=cfg)
  assert out.shape == (m, n) and rel_err(out, mxfp8_oracle(x, packed, scale, gs)) < F8_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)


def test_mxfp8_needs_fp8_mma():
  """An A100 (compute capability 8.0) takes the bf16 mode and declines "mxfp8" with the reason
  (shapes only, lowering ahead of time for an abstract device)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  s = jax.ShapeDtypeStruct
  x, packed, scale = s((16, 512), jnp.bfloat16), s((64, 256), jnp.uint8), s((64, 16), jnp.uint8)
  with jax.sharding.use_abstract_mesh(mesh):
    assert triton.supports_matmul(x, packed, scale, config=triton.Config()) is None
    reason = triton.supports_matmul(x, packed, scale, config=triton.Config(**FP8))
  assert "needs fp8 MMA (compute capability >= 8.9)" in reason, reason


def test_plan_routes_and_declines_with_reasons():
  x = activations(0, 16, 512)
  packed, scale = weights(0, 128, 512)
  assert "triton" in IMPLS
  p = plan(x, packed, scale, impl="triton", interpret=True)
  assert p.impl == "triton" and not p.declined
  gs = jnp.asarray([10, 6], jnp.int32)
  two = (jnp.stack([packed] * 2), jnp.stack([scale] * 2))
  assert plan_ragged_dot(x, *two, gs, impl="triton", interpret=True).impl == "triton"
  refusals = {
      "needs an NVIDIA GPU": plan(x, packed, scale, impl="triton"),
      "needs bfloat16 x": plan(x.astype(jnp.float32), packed, scale, impl="triton",
                               interpret=True),
      "output dtype must be bfloat16 or float32": plan(
          x, packed, scale, impl="triton", interpret=True, preferred_element_type=jnp.float16),
      "K=288 is not a multiple of 64": plan(x[:, :288], packed[:, :144], scale[:, :9],
                                                   impl="triton", interpret=True),
      "N=8 is not a multiple of block_n=16": plan(x, packed[:8], scale[:8], impl="triton",
                                                  interpret=True),
      "M=0": plan(x[:0], packed, scale, impl="triton", interpret=True),
  }
  for reason, p in refusals.items():
    assert p.impl == "reference" and len(p.declined) == 1, p
    assert p.declined[0][0] == "triton" and reason in p.declined[0][1], (reason, p.declined)
  # a declined call runs the reference
  out = mxfp4_matmul(x[:, :288], packed[:, :144], scale[:, :9], impl="triton", interpret=True)
  want = reference.matmul(x[:, :288], packed[:, :144], scale[:, :9])
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  with pytest.raises(NotImplementedError, match="K=288 is not a multiple of 64"):
    triton.matmul(x[:, :288], packed[:, :144], scale[:, :9], interpret=True)


def test_weights_between_2_and_4_gib_are_declined():
  """Pallas Triton addresses arrays of (2^31, 2^32] bytes with sign-extended 32-bit offsets
  (`tiers.triton_offsets_reason`): such a weight is declined on the GPU path with the reason,
  the interpreter (no such offsets) takes it, and a weight past 4 GiB (64-bit offsets) is
  not declined for its size. Shapes only: nothing of that size is allocated."""
  s = jax.ShapeDtypeStruct
  x, gs = s((256, 3584), jnp.bfloat16), s((256,), jnp.int32)
  for experts, declined in ((256, True), (128, False), (896, False)):
    packed, scale = s((experts, 6144, 1792), jnp.uint8), s((experts, 6144, 112), jnp.uint8)
    reason = triton.supports_ragged_dot(x, packed, scale, gs) or ""
    assert ("w_packed holds" in reason) == declined, (experts, reason)
    assert triton.supports_ragged_dot(x, packed, scale, gs, interpret=True) is None
  u8 = lambda n: s((n,), jnp.uint8)
  for nbytes, declined in ((2 ** 31, False), (2 ** 31 + 1, True), (2 ** 32, True),
                           (2 ** 32 + 1, False)):
    assert (tiers.triton_offsets_reason(w=u8(nbytes)) is not None) == declined, nbytes
  reason = tiers.triton_offsets_reason(x=s((2 ** 20, 2 ** 10), jnp.float32))
  assert reason.startswith("x holds 4294967296 bytes"), reason


def test_bad_configs_are_refused():
  x = activations(0, 16, 512)
  packed, scale = weights(0, 128, 512)
  for cfg, reason in ((triton.Config(block_n=8), "block_n=8 must be a power of two >= 16"),
                      (triton.Config(block_k=384), "block_k=384"),
                      (triton.Config(block_k=1024), "K=512 is not a multiple of block_k=1024"),
                      (triton.Config(block_m=8), "block_m=8"),
                      (triton.Config(dequant="lut"), "dequant must be one of"),
                      (triton.Config(num_warps=3), "num_warps"),
                      (triton.Config(block_k=128, split_k=3), "split_k=3 must divide"),
                      (triton.Config(block_n=4), "block_n=4 must be a power of two >= 16"),
                      (triton.Config(block_n=4, fma=True, swap=True), "fma has no MMA"),
                      (triton.Config(act="fp8"), "act must be one of"),
                      (triton.Config(block_n=4, block_m=1, fma=True, **FP8),
                       "act='mxfp8' feeds fp8 MMAs; fma has no MMA"),
                      (triton.Config(unroll=True, **FP8), "unroll loads whole K steps")):
    got = triton.supports_matmul(x, packed, scale, interpret=True, config=cfg)
    assert got is not None and reason in got, (cfg, got)
  assert triton.fit(triton.Config(block_k=1024), 3584).block_k == 512
  assert triton.fit(triton.Config(block_k=512), 3072).block_k == 512
  assert triton.fit(triton.Config(split_k=8), 3584).split_k == 7     # 7 steps of 512
  assert triton.fit(triton.Config(split_k=8), 3072).split_k == 6
  assert triton.fit(triton.Config(block_k=256, split_k=4), 3584).split_k == 2
  assert triton.default_config(1, 3584, 3072, False) == triton.CONFIGS["fma_n4_w2_unroll"]
  assert triton.default_config(2, 3584, 3072, False) == triton.CONFIGS["n32_ptx"]
  assert triton.default_config(1, 512, 6, False).block_n == 2        # 4 does not divide 6
  assert triton.default_config(16, 3072, 3584, True) == triton.CONFIGS["n64_ptx"]
  assert len(triton.ALL_CONFIGS) == len(triton.CONFIGS) + len(triton.DECODE_CONFIGS)
  short = triton.DECODE_CONFIGS                 # k3_small's all-experts decode (SHORT_K)
  assert triton.default_config(1024, 512, 512, True) == short["n64_k64_w2"]
  assert triton.default_config(1024, 512, 512, True, gate_up=True) == short["n64_k64_s3"]
  assert triton.default_config(1025, 512, 512, True) == triton.CONFIGS["n64_ptx"]
  assert triton.default_config(2, 512, 48, False).block_n == 16      # 32 does not divide 48
  assert triton.default_config(1, 96, 64, False).block_k == 0        # no block_k divides 96


@pytest.mark.parametrize("act", triton.ACTS)
@pytest.mark.parametrize("m, k, n, g", [(1, 3584, 3072, 1), (16, 3072, 3584, 8),
                                        (16, 3584, 3072, 896)])
def test_lowers_to_triton_for_h200(m, k, n, g, act):
  """Every candidate config of the mode (block_k fitted to K) lowers to Triton IR for an H200 at
  the K3 shapes, dense and grouped (896 experts: group_sizes loaded whole, 17 slots per column
  block); the default config is taken there (a refused call raises: `triton.matmul` checks
  `supports_*` first). The lowering is `benchmarks.triton_sass.lower`'s, which its SASS
  counts start from. "mxfp8" (the default's tiles with that mode, the candidates, "exp"
  conversion, swapped): the Triton module parses and verifies (Pallas does not verify it) and
  multiplies E4M3 by E4M3 into fp32 with K = 32, the MMA accumulating its K (Triton's
  maxNumImpreciseAcc, without which Hopper gets no fp8 wgmma)."""
  configs = [c for c in triton.CONFIGS.values() if c.act == act]
  if act == "bf16":
    configs = [None, *configs]
  else:
    default = triton.default_config(16, k, n, g > 1)   # an MMA tile (one row: fma, no MMA)
    configs += [dataclasses.replace(default, act=act), dataclasses.replace(default, act=act,
                                                                             dequant="exp")]
  for cfg in [c if c is None else triton.fit(c, k) for c in configs]:
    lowered = triton_sass.lower(cfg, m, k, n, g)
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1, cfg
    if act == "mxfp8":
      [(_, _, module)] = triton_sass.triton_modules(lowered)
      assert re.search(r"tt\.dot .*\{maxNumImpreciseAcc = 32 : i32\} : tensor<\d+x32xf8E4M3FN> "
                       r"\* tensor<32x\d+xf8E4M3FN> -> tensor<\d+x\d+xf32>", module), cfg
