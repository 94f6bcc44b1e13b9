"""numpy oracles of the MX formats (k3_techniques.md §7) for the tests: the element grids
written out from the spec's tables and nearest-grid-point rounding (test_mx, test_qat)."""
import numpy as np

E2M1_GRID = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
# E2M1 code -> value: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.
E2M1_CODES = np.concatenate([E2M1_GRID, -E2M1_GRID])
# E4M3 positive codes 0..126 in order: subnormals m/8 2^-6, normals (1 + m/8) 2^e, e in
# [-6, 8]; code 127 (1.875 2^8) is NaN.
E4M3_GRID = np.array([m / 8 * 2.0**-6 for m in range(8)]
                     + [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)][:-1])
GRIDS = {"mxfp4": (E2M1_GRID, 2), "mxfp8": (E4M3_GRID, 8)}


def np_quantize(x, grid, emax, rule="floor"):
  """Blocks of 32 consecutive elements of x (flattened): (signed grid values [n] float64,
  E8M0 scale bytes [n/32] uint8). The scale exponent comes from float64 log2, the element is
  the nearest grid point of |x| / X, clipped to the largest (ties: the even code, i.e. the
  even grid index)."""
  x = np.asarray(x, np.float64).reshape(-1, 32)
  amax = np.abs(x).max(axis=1)
  with np.errstate(divide="ignore"):
    if rule == "floor":
      shared = np.floor(np.log2(amax)) - emax
    else:
      shared = np.ceil(np.log2(amax / grid[-1]))
  shared = np.clip(np.nan_to_num(shared, neginf=-127), -127, 127)
  v = np.minimum(np.abs(x) / 2.0**shared[:, None], grid[-1])
  hi = np.clip(np.searchsorted(grid, v), 1, len(grid) - 1)
  d_lo, d_hi = v - grid[hi - 1], grid[hi] - v
  pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, hi - 1)
  return (np.sign(x) * grid[pick]).ravel(), (shared + 127).astype(np.uint8)


def np_fake_quantize(x, fmt, axis=-1):
  """The dequantized MX value of x (float64), blocks of 32 along `axis` (spec's floor rule)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  values, scales = np_quantize(x, *GRIDS[fmt])
  out = values.reshape(-1, 32) * 2.0 ** (scales.astype(np.float64) - 127)[:, None]
  return np.moveaxis(out.reshape(x.shape), -1, axis)
