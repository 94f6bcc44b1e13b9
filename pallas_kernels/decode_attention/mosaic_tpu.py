"""Mosaic TPU tier: absorbed-MLA decode attention over the filled latent cache (report §2.1).

Grid (B, S / block): row b's cache blocks in order ("parallel" over B for the megacore,
"arbitrary" over the blocks), with the lengths scalar-prefetched into SMEM. The cache block's
index map clamps block j to the row's last filled block, min(j, cdiv(lengths[b], block) - 1):
Pallas copies a block only when its index changes between grid steps, so the blocks past a
row's length are never copied (a row of length 0 copies its first block once), and
`pl.when(j * block < lengths[b])` skips their compute. The T * H query rows of the row (row
r = t * H + h, padded to a multiple of 16) and their positions stay in VMEM across the blocks;
per block the kernel forms the scores [M, block] = q K^T on the MXU (fp32 accumulation, HIGHEST
precision for fp32 inputs), masks them (position < lengths[b], position <= the query's position)
and updates the online softmax (running max and sum [M, 128] lane-replicated, accumulator
[M, v_dim], all fp32 VMEM scratch) with p V, p cast to the cache's dtype; the last grid step
writes o = acc / sum (0 where a query saw nothing) in fp32. Values are the first v_dim lanes of
the same cache block. Positions at or past a row's length inside its last block must hold finite
values (0 times NaN is NaN).

Layout: the kernel reads the cache row-major ([B, S, Dk], Dk minor). XLA's default layout for a
[B, S, 576] bf16 parameter puts S minor (576 is no multiple of 128), so a jit that takes the
cache as an argument in that layout copies it into the kernel's layout on every call; give the
argument a row-major `jax.experimental.layout.Format` (or keep the cache inside one jit, as a
generation loop's carry) and no copy is made (tests/tpu/test_decode_attention_tpu_compile.py).

Blocks: S itself when S <= 512, else the largest of 512, 256, 128 that divides S. Constraints
(`supports` gives the reason): a TPU (or interpret), q and cache of one dtype (bfloat16 or
float32), S <= 512 or a multiple of 128, v_dim a multiple of 128 or Dk (a lane-aligned slice), the
buffers within VMEM_BUDGET. `interpret=True` runs the kernel in Pallas's interpreter (any
backend). Status: tested in the interpreter and compiled for v5e, v5p and v6e
(tests/tpu/test_decode_attention_tpu_compile.py); not yet run or timed on a TPU.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

BLOCKS = (512, 256, 128)
ROW_MULTIPLE = 16                    # query rows padded to whole bf16 sublane tiles
LANES = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
VMEM_BUDGET = 32 * 2 ** 20           # buffers of one kernel (estimate)
VMEM_LIMIT = 48 * 2 ** 20            # Mosaic's scoped VMEM limit for the kernel
_NEG = -1e30  # initial running max: finite, so no -inf - -inf while nothing is seen
_NT = (((1,), (1,)), ((), ()))       # a @ b^T


def padded_rows(t: int, h: int) -> int:
  return -(-t * h // ROW_MULTIPLE) * ROW_MULTIPLE


def block_size(s: int) -> int | str:
  """Cache positions per grid step for a cache of S positions, or why none tiles S."""
  if s <= BLOCKS[0]:
    return s
  for bk in BLOCKS:
    if s % bk == 0:
      return bk
  return f"S={s} is above {BLOCKS[0]} and not a multiple of {BLOCKS[-1]}"


def vmem_bytes(m: int, bk: int, dk: int, v_dim: int, itemsize: int) -> int:
  """Scoped VMEM of the kernel, an upper estimate: double-buffered query rows, positions, cache
  block and fp32 output, the scratch (accumulator, max and sum), three [M, block] fp32
  temporaries (scores, mask, p)."""
  return (2 * m * dk * itemsize + 2 * m * LANES * 4 + 2 * bk * dk * itemsize
          + 2 * m * v_dim * 4 + m * v_dim * 4 + 2 * m * LANES * 4 + 3 * m * bk * 4)


def _decline(q, cache, v_dim: int) -> str | None:
  """Why the kernel cannot take these shapes and dtypes, or None."""
  if jnp.dtype(q.dtype) not in DTYPES or jnp.dtype(q.dtype) != jnp.dtype(cache.dtype):
    return (f"q and cache must both be bfloat16 or both float32, got {q.dtype} and "
            f"{cache.dtype}")
  _, t, h, dk = q.shape
  bk = block_size(cache.shape[1])
  if isinstance(bk, str):
    return bk
  if v_dim % LANES and v_dim != dk:
    return f"v_dim={v_dim} must be a multiple of {LANES} or Dk={dk} (a lane-aligned slice)"
  need = vmem_bytes(padded_rows(t, h), bk, dk, v_dim, jnp.dtype(cache.dtype).itemsize)
  if need > VMEM_BUDGET:
    return f"T * H = {t * h} rows need about {need >> 20} MiB of VMEM (> {VMEM_BUDGET >> 20})"
  return None


def supports(q, cache, lengths, *, v_dim: int, q_positions=None, interpret: bool = False
             ) -> str | None:
  """None if `decode_attention` takes this call (shapes checked by the API), else the reason."""
  del lengths, q_positions
  if not interpret and jax.devices()[0].platform != "tpu":
    return f"not a TPU ({jax.devices()[0].device_kind}) and interpret=False"
  return _decline(q, cache, v_dim)


def cache_block(j, length, bk: int):
  """The cache block grid step j reads: j, clamped to the row's last filled block (block 0 for
  an empty row), so no step addresses a block past the length."""
  return jnp.minimum(j, jnp.maximum((length + bk - 1) // bk - 1, 0))


def _kernel(lengths_ref, q_ref, qpos_ref, kv_ref, o_ref, m_s, l_s, acc_s, *, bk: int,
            v_dim: int, scale: float, blocks: int):
  b, j = pl.program_id(0), pl.program_id(1)
  length = lengths_ref[b]

  @pl.when(j == 0)
  def _init():
    m_s[...] = jnp.full(m_s.shape, _NEG, jnp.float32)
    l_s[...] = jnp.zeros(l_s.shape, jnp.float32)
    acc_s[...] = jnp.zeros(acc_s.shape, jnp.float32)

  @pl.when(j * bk < length)
  def _block():
    kv = kv_ref[...]
    precision = jax.lax.Precision.HIGHEST if kv.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q_ref[...], kv, _NT, precision=precision,
                            preferred_element_type=jnp.float32) * scale
    pos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s = jnp.where((pos < length) & (pos <= qpos_ref[...]), s, -jnp.inf)
    m_prev = m_s[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new[:, :1])
    l_s[...] = alpha * l_s[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(kv.dtype), kv[:, :v_dim], (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    acc_s[...] = alpha[:, :1] * acc_s[...] + pv
    m_s[...] = m_new

  @pl.when(j == blocks - 1)
  def _output():
    l = l_s[...][:, :1]
    o_ref[...] = jnp.where(l > 0, acc_s[...] / jnp.where(l > 0, l, 1.0), 0.0)


def decode_attention(q: jax.Array, cache: jax.Array, lengths: jax.Array, positions: jax.Array,
                     *, v_dim: int, scale: float, interpret=False) -> jax.Array:
  """q [B, T, H, Dk], cache [B, S, Dk], lengths [B] int32 (in [0, S]), positions [B, T] int32
  -> o [B, T, H, v_dim] fp32 (compiled for the TPU of the current mesh or default device, or
  interpreted). Call `supports` first."""
  if reason := _decline(q, cache, v_dim):
    raise NotImplementedError(reason)
  b, t, h, dk = q.shape
  s_len = cache.shape[1]
  bk = block_size(s_len)
  m = padded_rows(t, h)
  blocks = s_len // bk
  q_rows = jnp.pad(q.reshape(b, t * h, dk), ((0, 0), (0, m - t * h), (0, 0)))
  qpos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), h, axis=1), ((0, 0), (0, m - t * h)),
                 constant_values=-1)[..., None]
  itemsize = jnp.dtype(cache.dtype).itemsize
  out = pl.pallas_call(
      functools.partial(_kernel, bk=bk, v_dim=v_dim, scale=scale, blocks=blocks),
      out_shape=jax.ShapeDtypeStruct((b, m, v_dim), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, blocks),
          in_specs=[
              pl.BlockSpec((None, m, dk), lambda i, j, lens: (i, 0, 0)),
              pl.BlockSpec((None, m, 1), lambda i, j, lens: (i, 0, 0)),
              pl.BlockSpec((None, bk, dk),
                           lambda i, j, lens: (i, cache_block(j, lens[i], bk), 0)),
          ],
          out_specs=pl.BlockSpec((None, m, v_dim), lambda i, j, lens: (i, 0, 0)),
          scratch_shapes=[pltpu.VMEM((m, LANES), jnp.float32),
                          pltpu.VMEM((m, LANES), jnp.float32),
                          pltpu.VMEM((m, v_dim), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT),
      cost_estimate=pl.CostEstimate(
          flops=2 * b * m * s_len * (dk + v_dim), transcendentals=b * m * s_len,
          bytes_accessed=b * s_len * dk * itemsize + b * m * (dk * itemsize + v_dim * 4)),
      interpret=interpret,
      name="decode_attention",
  )(lengths.astype(jnp.int32), q_rows, qpos, cache)
  return out[:, :t * h].reshape(b, t, h, v_dim)
