"""numpy oracles shared by the MXFP4 matmul tests: dequantization by the E2M1 table written out
from the spec (`tests/mx_testing.py`, independent of `k3jax.mx`), and weights holding every code."""
import numpy as np
from mx_testing import E2M1_CODES as NIBBLE


def dequantize(packed, scale) -> np.ndarray:
  """float64 W [..., N, K] from packed [..., N, K/2] (low nibble: even column) and scale
  [..., N, K/32] uint8 (2^(s - 127) per block of 32 along K) by the table."""
  packed, scale = np.asarray(packed), np.asarray(scale)
  w = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],))
  w[..., 0::2] = NIBBLE[packed & 0xF]
  w[..., 1::2] = NIBBLE[packed >> 4]
  return w * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)


def oracle(x, packed, scale, sizes) -> np.ndarray:
  """float64 loop over experts: rows of group g times W_g^T; rows past sum(sizes) are 0."""
  x, w = np.asarray(x, np.float64), dequantize(packed, scale)
  out = np.zeros((x.shape[0], w.shape[-2]))
  start = 0
  for g, size in enumerate(sizes):
    out[start:start + size] = x[start:start + size] @ w[g].T
    start += size
  return out


def every_code(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """packed [n, k/2] whose rows hold every code in both nibbles (k >= 256; every byte value for
  k >= 512) and scales [n, k/32] in [100, 150]."""
  rng = np.random.default_rng(seed)
  packed = np.arange(n * k // 2).reshape(n, k // 2) * 37 + rng.integers(0, 256, (n, 1))
  return (packed % 256).astype(np.uint8), rng.integers(100, 151, (n, k // 32)).astype(np.uint8)


def rel_err(x, ref) -> float:
  """Relative L2 error ||x - ref|| / ||ref|| in fp64."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def plant_overflow_and_nan(packed: np.ndarray, scale: np.ndarray) -> None:
  """In place: rows 0-2 all zero codes; weight (0, 10) 6 * 2^127 and (1, 19) -6 * 2^126 (past
  fp32's range) and a NaN scale byte at (2, block 4)."""
  packed[:3] = 0
  packed[0, 5], scale[0, 0] = 0x07, 254
  packed[1, 9], scale[1, 0] = 0xF0, 253
  scale[2, 4] = 255


def check_mxfp8_overflow_and_nan(out: np.ndarray, x8: np.ndarray, rows: int) -> None:
  """`out` of MXFP8-rounded x8 (float64) times weights of `plant_overflow_and_nan`, x's row
  `rows` holding an inf: columns 0 and 1 are x8's value times the large weight rounded once in
  fp32 (inf only where that overflows), column 2 and row `rows` NaN, the rest finite."""
  with np.errstate(over="ignore"):
    want = np.stack([x8[:rows, 10] * 6 * 2.0 ** 127, x8[:rows, 19] * -6 * 2.0 ** 126], axis=1)
    want = want.astype(np.float32)
  assert np.isinf(want).any() and np.isfinite(want).any()
  np.testing.assert_array_equal(out[:rows, :2], want)
  assert np.isnan(out[:, 2]).all() and np.isnan(out[rows]).all()
  assert np.isfinite(out[:rows, 3:]).all()
