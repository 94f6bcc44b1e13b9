"""Mosaic GPU (Hopper, sm_90a) tier: flash-decoding of absorbed MLA over the filled latent cache
(report §2.1's decoding; split-K flash-decoding as in FlashDecoding / FlashMLA).

The T * H query rows of a cache row (row r = t * H + h, padded with zero rows to a multiple of
64) are cut into tiles of 64 rows, the wgmma M; each cache row's filled positions
[0, lengths[b]) into `splits` contiguous splits of split_len positions (a multiple of 64, at
least `min_split`, computed in the program from max(lengths) so that the splits share out the
longest row). Grid (row tile, split, b), row tiles fastest: the CTAs of one split's cache blocks
run side by side and share them through L2. One CTA per cell, three warpgroups:
  * warpgroup 2 issues the TMA loads: the 64-row query tile [64, Dk] and its query positions once,
    then the split's cache blocks [64, Dk] (keys = all Dk channels, values = the first v_dim of
    the same rows) into a ring of `stages` slots;
  * warpgroups 0 and 1 each compute the scores S = Q K^T [64, 64] (wgmma, fp32), mask them
    (position < lengths[b], position <= the query's position), run the online softmax in fp32
    (base 2: scores times scale * log2 e, exp2) and accumulate P V over their half of the value
    channels, o [64, v_dim / 2] fp32 in registers (v_dim / 2 <= 256: a whole [64, 512] fp32
    accumulator would need 256 registers a thread). Both warpgroups compute the same S: 2x the
    Q K^T tensor work, no exchange of P through shared memory.
  Each CTA writes its split's normalised partial o [64, v_dim] fp32 and log2-sum-exp [64]; a split
  that starts at or past lengths[b] exits before issuing any load, so the cost follows each row's
  filled context. XLA then merges the splits (weights 2^(lse - max lse), over the splits that
  started before lengths[b] only: the others wrote nothing).
The last block of a cache whose S is no multiple of 64 is loaded from S - 64 on, its positions
before the block's start masked (counted by the previous block). Positions at or past a row's
length inside a loaded block must hold finite values (0 times NaN is NaN); blocks past it are
never loaded.

With `interpret=True` the kernel runs in the Mosaic GPU interpreter on CPU, whose wgmma reads both
operands from SMEM and cannot start from an initialised accumulator: there P is staged through
SMEM and each block's P V is added to the rescaled accumulator after the product; the
arithmetic is the same.

Constraints (`supports` gives the reason): an NVIDIA Hopper GPU (or interpret), q and cache both
bfloat16 or both float16, Dk a multiple of 64, v_dim a multiple of 128 and at most min(Dk, 512),
S >= 64, the query tile and two cache blocks in shared memory (Dk <= 576).
"""
import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mosaic_gpu

BLOCK_KV = 64                   # cache positions per pipeline step
ROWS = 64                       # query rows (heads x tokens) per CTA: the wgmma M
MIN_SPLIT = 256                 # fewest positions per split: the fp32 partial [64, 512] (128 KiB)
                                # stays under half the cache bytes the split reads (288 KiB)
MAX_STAGES = 4
MAX_HALF = 256                  # value channels per compute warpgroup (wgmma N <= 256)
MAX_GRID = 65535                # CUDA's limit on the grid's y and z extents
SMEM_BYTES = ragged_mosaic_gpu.SMEM_BYTES
_SMEM_RESERVE = 2 * 1024        # barriers and alignment
_MEMORY_REGISTERS = 40          # as ragged_dot's warp-specialised kernels
_COMPUTE_REGISTERS = 232
_INTERPRET_SMS = 2              # simulated SMs in interpret mode
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_NEG = -1e30  # initial running max: finite, so no -inf - -inf while nothing is seen
_LOG2E = math.log2(math.e)
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)            # one value per row of a WGMMA-layout array
_SWIZZLE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                               approx_math=True)


@dataclasses.dataclass(frozen=True)
class Config:
  """`splits` cache splits per (row tile, b) (the grid's second axis); `stages` cache blocks in
  flight; `min_split` the fewest positions per split (a multiple of BLOCK_KV)."""
  splits: int
  stages: int = 2
  min_split: int = MIN_SPLIT


def is_hopper() -> bool:
  """True when the default device is an NVIDIA Hopper GPU (H100/H200/H800)."""
  return ragged_mosaic_gpu.is_hopper()


def num_sms(interpret: bool) -> int:
  return _INTERPRET_SMS if interpret else jax.devices()[0].core_count


def padded_rows(t: int, h: int) -> int:
  """T * H query rows rounded up to whole 64-row tiles."""
  return -(-t * h // ROWS) * ROWS


def smem_bytes(dk: int, stages: int, interpret: bool) -> int:
  """Shared memory of one CTA: the query tile, its positions, the cache ring, the log2-sum-exp
  row and (interpreter only) each compute warpgroup's P."""
  staged_p = 2 * ROWS * BLOCK_KV * 2 if interpret else 0
  return (ROWS * dk * 2 + ROWS * 4 + stages * BLOCK_KV * dk * 2 + ROWS * 4 + staged_p
          + _SMEM_RESERVE)


def default_config(b: int, t: int, h: int, s: int, dk: int, sms: int,
                   interpret: bool = False) -> Config | str:
  """The config for B rows of T * H queries over a cache [B, S, Dk] on `sms` SMs, or why none
  fits: as many splits as keep (row tiles x splits x B) within one wave of CTAs (one CTA per SM:
  a few CTAs more would take a second wave), at least 1 and at most S / MIN_SPLIT; as many
  stages as fit (up to MAX_STAGES)."""
  tiles = padded_rows(t, h) // ROWS
  splits = max(1, min(sms // (b * tiles), s // MIN_SPLIT, MAX_GRID))
  stages = MAX_STAGES
  while stages > 2 and smem_bytes(dk, stages, interpret) > SMEM_BYTES:
    stages -= 1
  if smem_bytes(dk, stages, interpret) > SMEM_BYTES:
    return (f"Dk={dk}: the query tile and {stages} cache blocks need "
            f"{smem_bytes(dk, stages, interpret)} B of shared memory (> {SMEM_BYTES})")
  return Config(splits=splits, stages=stages)


def _check_config(cfg: Config, b: int, dk: int, interpret: bool) -> str | None:
  if not 1 <= cfg.splits <= MAX_GRID or b > MAX_GRID:
    return f"splits={cfg.splits} and B={b} must be in [1, {MAX_GRID}] (CUDA grid)"
  if cfg.stages < 2 or smem_bytes(dk, cfg.stages, interpret) > SMEM_BYTES:
    return (f"stages={cfg.stages} must be >= 2 and fit shared memory "
            f"({smem_bytes(dk, cfg.stages, interpret)} B needed)")
  if cfg.min_split < BLOCK_KV or cfg.min_split % BLOCK_KV:
    return f"min_split={cfg.min_split} must be a positive multiple of {BLOCK_KV}"
  return None


def supports(q, cache, lengths, *, v_dim: int, q_positions=None, interpret: bool = False,
             config: Config | None = None) -> str | None:
  """None if `decode_attention` takes this call (shapes checked by the API), else the reason."""
  del lengths, q_positions
  if not interpret and not is_hopper():
    return f"not an NVIDIA Hopper GPU ({jax.devices()[0].device_kind})"
  if jnp.dtype(q.dtype) not in _DTYPES or jnp.dtype(q.dtype) != jnp.dtype(cache.dtype):
    return (f"q and cache must both be bfloat16 or both float16 (the wgmma operands), got "
            f"{q.dtype} and {cache.dtype}")
  b, t, h, dk = q.shape
  s = cache.shape[1]
  if dk % 64:
    return f"Dk={dk} is not a multiple of 64 (the 128-byte swizzle)"
  if v_dim % 128 or v_dim > min(dk, 2 * MAX_HALF):
    return (f"v_dim={v_dim} must be a multiple of 128 and at most min(Dk, {2 * MAX_HALF}) (each "
            f"compute warpgroup holds v_dim / 2 <= {MAX_HALF} fp32 columns)")
  if s < BLOCK_KV:
    return f"S={s} is shorter than one cache block ({BLOCK_KV})"
  cfg = config or default_config(b, t, h, s, dk, num_sms(interpret), interpret)
  if isinstance(cfg, str):
    return cfg
  return _check_config(cfg, b, dk, interpret)


# jitted: identical calls (every layer's) lower to one function, so XLA builds the kernel once
@functools.partial(jax.jit, static_argnames=("cfg", "v_dim", "scale", "interpret"))
def _kernel(meta, q, qpos, cache, *, cfg: Config, v_dim: int, scale: float, interpret: bool):
  """(o [B, splits, M_pad, v_dim] fp32, lse [B, splits, M_pad] fp32): each split's normalised
  partial output and log2-sum-exp (-inf where a row saw nothing); splits that start at or past
  lengths[b] leave theirs unwritten. meta [1 + B] int32: split_len, then lengths."""
  b, m_pad, dk = q.shape
  s_len = cache.shape[1]
  half = v_dim // 2
  stages = cfg.stages
  log2_scale = scale * _LOG2E

  def decode_attention_kernel(meta_ref, q_ref, qpos_ref, cache_ref, o_ref, lse_ref):
    mi, si, bi = lax.axis_index("m"), lax.axis_index("split"), lax.axis_index("b")
    split_len, length = meta_ref[0], meta_ref[1 + bi]
    start = si * split_len
    end = jnp.minimum(start + split_len, length)
    steps = jnp.where(end > start, (end - start + BLOCK_KV - 1) // BLOCK_KV, 0)
    rows = pl.ds(mi * ROWS, ROWS)

    def block_start(i):
      """(nominal first position, first position loaded) of the split's i-th block."""
      first = start + i * BLOCK_KV
      return first, jnp.minimum(first, s_len - BLOCK_KV)

    def scoped(q_s, qpos_s, kv_s, lse_s, p_s, q_bar, produced, consumed):
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _memory():
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

        @pl.when(steps > 0)
        def _():
          plgpu.copy_gmem_to_smem(q_ref.at[bi, rows], q_s, q_bar)
          plgpu.copy_gmem_to_smem(qpos_ref.at[bi, rows], qpos_s, q_bar)

        @pl.loop(0, steps)
        def _load(i):
          slot = lax.rem(i, stages)

          @pl.when(i >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])

          plgpu.copy_gmem_to_smem(cache_ref.at[bi, pl.ds(block_start(i)[1], BLOCK_KV)],
                                  kv_s.at[slot], produced.at[slot])

        @pl.loop(jnp.maximum(steps - stages, 0), steps)
        def _quiesce(i):        # observe the last releases before the barriers are freed
          plgpu.barrier_wait(consumed.at[lax.rem(i, stages)])

      @pl.when(wg < 2)
      def _compute():
        plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

        @pl.when(steps > 0)
        def _():
          plgpu.barrier_wait(q_bar)
          qpos = lax.broadcast_in_dim(plgpu.load(qpos_s, layout=_ROW, optimized=False),
                                      (ROWS, BLOCK_KV), [0])
          cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_KV), 1, layout=_WG)
          values = pl.ds(wg * half, half)

          def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(produced.at[slot])

            def scores(acc_ref):
              plgpu.wgmma(acc_ref, q_s, kv_s.at[slot].T)
              return acc_ref[...]

            # Reading an accumulator waits for its wgmma without a data dependency; the
            # barrier keeps the arithmetic on the result after that wait (as the KDA kernels).
            s = lax.optimization_barrier(pl.run_scoped(scores, plgpu.ACC((ROWS, BLOCK_KV), _F32)))
            first, loaded = block_start(i)
            pos = loaded + cols
            visible = (pos >= first) & (pos < length) & (pos <= qpos)
            s = jnp.where(visible, s * log2_scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(cache.dtype)
            v = kv_s.at[slot, :, values]
            if interpret:
              p_s.at[wg][...] = p
              plgpu.commit_smem()

              def product(acc_ref):
                plgpu.wgmma(acc_ref, p_s.at[wg], v)
                return acc_ref[...]

              acc = acc + lax.optimization_barrier(
                  pl.run_scoped(product, plgpu.ACC((ROWS, half), _F32)))
            else:
              acc = lax.optimization_barrier(pl.run_state(
                  lambda acc_ref: plgpu.wgmma(acc_ref, p, v))(plgpu.ACC.init(acc)))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_new, l

          init = (plgpu.layout_cast(jnp.zeros((ROWS, half), _F32), _WG),
                  plgpu.layout_cast(jnp.full((ROWS,), _NEG, _F32), _ROW),
                  plgpu.layout_cast(jnp.zeros((ROWS,), _F32), _ROW))
          acc, m, l = lax.fori_loop(0, steps, step, init)
          seen = l > 0
          inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
          o_ref.at[bi, si, rows, values][...] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])

          @pl.when(wg == 0)
          def _():
            lse_s[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * _LOG2E,
                                   -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[bi, si, rows])
            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, dk), cache.dtype, transforms=_SWIZZLE),
        plgpu.SMEM((ROWS,), jnp.int32),
        plgpu.SMEM((stages, BLOCK_KV, dk), cache.dtype, transforms=_SWIZZLE),
        plgpu.SMEM((ROWS,), _F32),
        plgpu.SMEM((2, ROWS, BLOCK_KV), cache.dtype, transforms=_SWIZZLE) if interpret else None,
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        collective_axes="wg")

  kernel = plgpu.kernel(
      decode_attention_kernel,
      out_type=(jax.ShapeDtypeStruct((b, cfg.splits, m_pad, v_dim), _F32),
                jax.ShapeDtypeStruct((b, cfg.splits, m_pad), _F32)),
      grid=(m_pad // ROWS, cfg.splits, b),
      grid_names=("m", "split", "b"),
      num_threads=3,
      thread_name="wg",
      compiler_params=_PARAMS,
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return kernel(meta, q, qpos, cache)


def split_length(lengths: jax.Array, cfg: Config) -> jax.Array:
  """Positions per split (int32 scalar): max(lengths) over `splits`, rounded up to whole
  blocks, at least min_split."""
  per_split = -(-jnp.max(lengths) // cfg.splits)
  return jnp.maximum(-(-per_split // BLOCK_KV) * BLOCK_KV, cfg.min_split).astype(jnp.int32)


def combine(o: jax.Array, lse: jax.Array, lengths: jax.Array, split_len: jax.Array
            ) -> jax.Array:
  """Merges the splits' partials o [B, P, M, Dv], lse [B, P, M] (log2) -> [B, M, Dv] fp32, over
  the splits that start before lengths[b] (the others were never written)."""
  started = jnp.arange(o.shape[1], dtype=jnp.int32)[None, :] * split_len < lengths[:, None]
  lse = jnp.where(started[:, :, None], lse, -jnp.inf)
  top = jnp.max(lse, axis=1, keepdims=True)
  w = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))
  total = jnp.sum(w, axis=1)
  o = jnp.sum(w[..., None] * jnp.where(started[:, :, None, None], o, 0.0), axis=1)
  return jnp.where(total[..., None] > 0, o / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def decode_attention(q: jax.Array, cache: jax.Array, lengths: jax.Array, positions: jax.Array,
                     *, v_dim: int, scale: float, interpret: bool = False,
                     config: Config | None = None) -> jax.Array:
  """q [B, T, H, Dk], cache [B, S, Dk], lengths [B] int32 (in [0, S]), positions [B, T] int32
  -> o [B, T, H, v_dim] fp32. Call `supports` first."""
  if reason := supports(q, cache, lengths, v_dim=v_dim, interpret=interpret, config=config):
    raise NotImplementedError(reason)
  b, t, h, dk = q.shape
  m_pad = padded_rows(t, h)
  cfg = config or default_config(b, t, h, cache.shape[1], dk, num_sms(interpret), interpret)
  q_rows = jnp.pad(q.reshape(b, t * h, dk), ((0, 0), (0, m_pad - t * h), (0, 0)))
  qpos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), h, axis=1),
                 ((0, 0), (0, m_pad - t * h)), constant_values=-1)
  lengths = lengths.astype(jnp.int32)
  split_len = split_length(lengths, cfg)
  meta = jnp.concatenate([split_len[None], lengths])
  o, lse = _kernel(meta, q_rows, qpos, cache, cfg=cfg, v_dim=v_dim, scale=scale,
                   interpret=interpret)
  o = combine(o, lse, lengths, split_len)
  return o[:, :t * h].reshape(b, t, h, v_dim)
