"""The MXFP4 matmul's Triton tier (`pallas_kernels/mxfp4_matmul/triton.py`) on CPU: the kernel
in Pallas's interpreter against the reference (`k3jax.mx.unpack_k3`, bf16 operands, fp32 sums)
and the spec's nibble table (`mxfp4_testing.py`), its bit formulas exhaustively, the API's
routing and refusals, and its lowering to Triton IR for an H200.

The interpreter runs the kernel's loads, masks, even / odd split of x, dots and stores with the
"exp" dequantization ("shift" needs the GPU's subnormal bf16 multiply; XLA:CPU flushes
subnormals, there and in the reference alike, so values below 2^-126 are zero on both sides
here; the GPU tests check them). fp32 outputs are compared at 1e-5 relative L2 (bf16 products
summed in fp32: the order only), bf16 outputs at 1e-2 (their rounding, ~3e-3).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import triton_sass
from pallas_kernels import tiers
from k3jax import mx
from mxfp4_testing import NIBBLE
from mxfp4_testing import dequantize
from mxfp4_testing import every_code
from mxfp4_testing import oracle
from mxfp4_testing import rel_err
from pallas_kernels.mxfp4_matmul import IMPLS
from pallas_kernels.mxfp4_matmul import mxfp4_matmul
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan
from pallas_kernels.mxfp4_matmul import plan_ragged_dot
from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.mxfp4_matmul import triton

BF16_TOL = 1e-2
F32_TOL = 1e-5
# Scale bytes whose weights are all finite: 2^-127 (products below 2^-126: flushed on CPU),
# 2^-126, ..., the clamp bounds of "exp" (2, 252) and their neighbours, 1 and 2.
FINITE_EDGES = np.array([0, 1, 2, 3, 64, 126, 127, 128, 200, 251, 252], np.uint8)


def weights(seed: int, *shape: int):
  return mx.pack_k3(0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def activations(seed: int, m: int, k: int) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


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
                      (triton.Config(block_n=4, fma=True, swap=True), "fma has no MMA")):
    got = triton.supports_matmul(x, packed, scale, interpret=True, config=cfg)
    assert got is not None and reason in got, (cfg, got)
  assert triton.fit(triton.Config(block_k=1024), 3584).block_k == 512
  assert triton.fit(triton.Config(block_k=512), 3072).block_k == 512
  assert triton.fit(triton.Config(split_k=8), 3584).split_k == 7     # 7 steps of 512
  assert triton.fit(triton.Config(split_k=8), 3072).split_k == 6
  assert triton.fit(triton.Config(block_k=256, split_k=4), 3584).split_k == 2
  assert triton.default_config(1, 3584, 3072, False) == triton.CONFIGS["n32_ptx"]
  assert triton.default_config(16, 3072, 3584, True) == triton.CONFIGS["n64_ptx"]
  assert triton.default_config(1, 512, 48, False).block_n == 16      # 32 does not divide 48
  assert triton.default_config(1, 96, 64, False).block_k == 0        # no block_k divides 96


@pytest.mark.parametrize("m, k, n, g", [(1, 3584, 3072, 1), (16, 3072, 3584, 8),
                                        (16, 3584, 3072, 896)])
def test_lowers_to_triton_for_h200(m, k, n, g):
  """Every candidate config (block_k fitted to K) lowers to Triton IR for an H200 at the K3
  shapes, dense and grouped (896 experts: group_sizes loaded whole, 17 slots per column block);
  the default config is taken there (a refused call raises: `triton.matmul` checks
  `supports_*` first). The lowering is `benchmarks.triton_sass.lower`'s, which its SASS
  counts start from."""
  for cfg in [None, *(triton.fit(c, k) for c in triton.CONFIGS.values())]:
    text = triton_sass.lower(cfg, m, k, n, g).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, cfg
