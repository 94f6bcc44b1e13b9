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
