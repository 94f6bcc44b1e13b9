"""Triton tier: a Pallas kernel on the Triton backend for rows of up to 1024 columns.

One program per block of R rows (a grid over cdiv(N, R) blocks). It loads its [R, E_pad] block
(E_pad = next power of two >= E: Triton tensors have power-of-two sizes; rows >= N and columns
>= E are masked off) and maps each value to its IEEE total-order key, the int32 that XLA's sort
comparator for `lax.top_k` builds (the bits, with the magnitude bits flipped when the sign bit
is set; so -0.0 ranks below +0.0). Then k times, per row:
  m = max key over the not-taken columns;  idx = smallest not-taken column whose key is m;
  record (m, idx);  mark idx taken.
The taken mask is kept apart from the keys (padding columns start taken), so -inf entries,
and rows with fewer than k finite entries, get lax.top_k's indices: equal values go to the
lower column. Values are the keys mapped back, bit for bit x's values. NaN is not supported.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import tiers

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_COLS = 1024          # E_pad * R values (keys and taken flags) live in registers
BLOCK_ELEMENTS = 1024    # R * E_pad per program for the default R
MAX_BLOCK_ROWS = 256
KEY_MIN = int(jnp.iinfo(jnp.int32).min)


def is_gpu() -> bool:
  """True when the default device (or the abstract mesh's device, when lowering ahead of time
  for one) is a GPU."""
  return plgpu_triton.is_gpu_device()


def default_block_rows(num_cols: int) -> int:
  """R for E = num_cols: BLOCK_ELEMENTS // E_pad rows (a power of two), 1 to MAX_BLOCK_ROWS.

  H200 sweep (`benchmarks/top_k.py --sweep`): fewer rows per program won at both router
  widths, R = 16 at E = 64 (8.8 us with 8 warps against 14.6 at R = 64, 4 warps) and R = 1 at
  E = 896 (171 against 235 us at R = 4).
  """
  return max(1, min(MAX_BLOCK_ROWS, BLOCK_ELEMENTS // pl.next_power_of_2(num_cols)))


def default_num_warps(num_cols: int) -> int:
  """Warps per program: 8 for rows of up to 128 columns, 4 above (the same sweep)."""
  return 8 if pl.next_power_of_2(num_cols) <= 128 else 4


def supports(x, k: int, *, interpret: bool = False) -> str | None:
  """None if the kernel takes top-k of x (an array or ShapeDtypeStruct), else the reason."""
  if not interpret and (reason := tiers.triton_offsets_reason(
      x=x, indices=jax.ShapeDtypeStruct((x.shape[0], k), jnp.int32))):
    return reason
  if not interpret and not is_gpu():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  if len(x.shape) != 2:
    return f"x must be [N, E], got shape {tuple(x.shape)}"
  if jnp.dtype(x.dtype) not in DTYPES:
    return f"dtype {jnp.dtype(x.dtype)}: the kernel takes float32, bfloat16 or float16"
  n, e = x.shape
  if e > MAX_COLS:
    return f"E = {e} > {MAX_COLS} columns (a row block must fit in registers)"
  if not 1 <= k <= e:
    return f"k = {k} is not in [1, E] = [1, {e}]"
  if n == 0:
    return "no rows (N = 0)"
  return None


def total_order_key(v: jax.Array) -> jax.Array:
  """fp32 -> int32 whose signed order is IEEE totalOrder; the map is its own inverse on bits."""
  bits = jax.lax.bitcast_convert_type(v, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _from_key(key: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _kernel(x_ref, values_ref, indices_ref, *, k: int, block_rows: int):
  """x_ref [N, E] -> values_ref, indices_ref [N, k] for the rows of block program_id(0)."""
  n, e = x_ref.shape
  e_pad, k_pad = pl.next_power_of_2(e), pl.next_power_of_2(k)
  first = pl.program_id(0) * block_rows
  rows = first + jnp.arange(block_rows)[:, None]    # [R, 1]
  cols = jnp.arange(e_pad)[None, :]                  # [1, E_pad]
  slots = jnp.arange(k_pad)[None, :]                 # [1, k_pad]
  x = plgpu_triton.load(x_ref.at[pl.ds(first, block_rows), pl.ds(0, e_pad)],
                        mask=(rows < n) & (cols < e), other=-jnp.inf)
  key = total_order_key(x.astype(jnp.float32))      # [R, E_pad]

  def pick(j, carry):
    taken, keys, indices = carry
    m = jnp.max(jnp.where(taken, KEY_MIN, key), axis=1, keepdims=True)
    idx = jnp.min(jnp.where(taken | (key != m), e_pad, cols), axis=1, keepdims=True)
    return (taken | (cols == idx), jnp.where(slots == j, m, keys),
            jnp.where(slots == j, idx, indices))

  empty = jnp.zeros((block_rows, k_pad), jnp.int32)
  init = (jnp.broadcast_to(cols >= e, (block_rows, e_pad)), empty, empty)
  _, keys, indices = jax.lax.fori_loop(0, k, pick, init)
  out = (pl.ds(first, block_rows), pl.ds(0, k_pad))
  mask = (rows < n) & (slots < k)
  plgpu_triton.store(values_ref.at[out], _from_key(keys).astype(values_ref.dtype), mask=mask)
  plgpu_triton.store(indices_ref.at[out], indices, mask=mask)


# jitted: every layer's call shares one lowering (and one Triton kernel for XLA to build)
@functools.partial(jax.jit, static_argnames=("k", "block_rows", "num_warps", "interpret"))
def top_k(x: jax.Array, k: int, *, block_rows: int | None = None, num_warps: int | None = None,
          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """x [N, E] -> (values [N, k] x.dtype, indices [N, k] int32), lax.top_k's result.

  block_rows: R, a power of two (default `default_block_rows(E)`); num_warps: Triton warps per
  program. interpret=True runs Pallas's interpreter (CPU tests). Not differentiable by itself:
  the API wraps it in a custom JVP.
  """
  if reason := supports(x, k, interpret=interpret):
    raise ValueError(f"the triton tier does not take this call: {reason}")
  n, e = x.shape
  block_rows = default_block_rows(e) if block_rows is None else block_rows
  num_warps = default_num_warps(e) if num_warps is None else num_warps
  for name, value in (("block_rows", block_rows), ("num_warps", num_warps)):
    if value < 1 or value & (value - 1):
      raise ValueError(f"{name} must be a power of two >= 1, got {value}")
  return pl.pallas_call(
      functools.partial(_kernel, k=k, block_rows=block_rows),
      out_shape=(jax.ShapeDtypeStruct((n, k), x.dtype), jax.ShapeDtypeStruct((n, k), jnp.int32)),
      grid=(pl.cdiv(n, block_rows),),
      compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="top_k",
  )(x)
