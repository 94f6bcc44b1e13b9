"""Mosaic GPU (Hopper, sm_90a) tier of the grouped matmul.

Two kernels per product, picked by the config's `kernel` field:
  "jax": JAX's own examples, imported and called as they are:
         `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (forward and, with
         `transpose_rhs=True`, d_lhs) and `transposed_ragged_dot_mgpu.transposed_ragged_dot`
         (d_rhs). One compute warpgroup per CTA issues both the TMA loads and the wgmma.
         Output dtype = input dtype; rows past sum(group_sizes) are zeroed by a jnp.where.
  "ws":  ours, written for this repo from the same two examples plus the warp-specialised
         pipeline of `hopper_matmul_mgpu`: one memory warpgroup issues the TMA loads
         (`plgpu.emit_pipeline_warp_specialized`, or with `tile_pipeline` one hand-written
         pipeline over all of a CTA's tiles, `_tile_pipeline`), two compute warpgroups issue
         wgmma on two halves of the tile.
         gmm row tiles start at each group's first row (as CUTLASS grouped GEMM: about
         G * block_m / 2 wasted rows, against G * block_m for ragged_dot_mgpu's tiles that
         straddle two groups and are computed once per group); the partial last tile of a
         group is stored with ragged_dot_mgpu's ladder of power-of-two TMA stores. Takes fp32
         output (preferred_element_type), writes zeros to the rows past sum(group_sizes) in
         the kernel (an extra "padding group"), takes the SM count as a parameter, and runs
         under `plgpu.InterpretGPUParams` on CPU.
  "swapped": ours, for few rows per group (decoding: B tokens x top-k copies over many
         experts): the operands swapped, so the weights fill wgmma's 64-row side and the
         group's few rows its N side. Each compute warpgroup computes out^T = W^T x^T for 64
         output columns ([64, block_m] in fp32) where "ws" would compute a [64+, 2*block_n]
         tile mostly of padding rows; row tiles of block_m rows (8-64) start at each group's
         first row rounded down to 8 as "ws"'s; one pipeline over all of a CTA's tiles; the
         tile is transposed back into SMEM (`store_transposed`) and stored by the same ladder.
         Not a default (`SWAPPED_IS_DEFAULT`): its GPU tests pass, but it is faster than
         "ws" / XLA only at k3_small's B 1 (BENCHMARKS.md "Decode").

Shapes: gmm lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N];
tgmm lhs [M, K], rhs [M, N] -> [G, K, N] with out[g] = lhs_g^T rhs_g.
Rows are sorted by group; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
TMA into tiled (swizzled) SMEM needs the row count to be a multiple of 8: other M are padded
with zero rows first (a copy of the [M, *] operands; the MoE's M = tokens * top_k is one).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import memref
from jax._src.lib.mlir.dialects import vector
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as jax_ragged_dot
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as jax_transposed

HOPPER_KINDS = ("H100", "H200", "H800")
KERNELS = ("ws", "jax", "swapped")
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 227 * 1024        # opt-in shared memory per block on sm_90
_SMEM_RESERVE = 2 * 1024       # barriers and alignment
_MEMORY_REGISTERS = 40         # registers of the TMA warpgroup (as hopper_matmul_mgpu)
_COMPUTE_REGISTERS = 232       # of each of the two compute warpgroups: (512 - 40) / 2, to 8
_INTERPRET_SMS = 2             # simulated SMs in interpret mode (several tiles per SM)
_WGMMA_ROWS = 64               # the M side of one wgmma: weight rows per warpgroup ("swapped")
# gmm_config would pick "swapped" for few rows per group; its GPU tests pass on the H200
# (2026-12-02) but it ties "ws" at B 16 and loses to XLA at K3's B 1 (BENCHMARKS.md "Decode"),
# so only an explicit config runs it.
SWAPPED_IS_DEFAULT = False


@dataclasses.dataclass(frozen=True)
class GmmConfig:
  """Tiles of gmm. "ws": a CTA tile is [block_m, 2 * block_n] (one half per compute warpgroup);
  "jax": [block_m, block_n]. grid_minor_dim/grid_tile_width order tiles (`plgpu.planar_snake`;
  "jax" always snakes along N with width grid_tile_width). "ws" only: cluster_n = 2 pairs CTAs
  on neighbouring N tiles of the same rows, which load the shared lhs tile once by TMA
  multicast (a sixth less L2->SMEM traffic per step at 128 x 256 x 64).
  "ws" only: tile_pipeline = True runs all of a CTA's (tile, step) pairs as one pipeline with
  hand-written barriers (as TgmmConfig's): the memory warpgroup loads the next tile's first
  stages while the compute warpgroups finish and store the current tile, instead of each tile
  starting with an empty pipeline (needs cluster_n = 1).
  epilogue_rows (None = block_m) stores each warpgroup's tile in slices of that many rows
  through a smaller SMEM buffer, which makes room for a fourth stage at 128 x 256 x 64.
  "swapped": block_m = rows of x per tile (a multiple of 8, at most 64: wgmma's N side),
  block_n = 64 (weight rows per compute warpgroup: wgmma's M side), block_k = K per pipeline
  stage (a multiple of 64, one wgmma per 64); always one pipeline over the CTA's tiles."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_minor_dim: int = 1
  grid_tile_width: int = 1
  kernel: str = "ws"
  cluster_n: int = 1
  tile_pipeline: bool = False
  epilogue_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
  """Tiles of tgmm: an output tile [block_m, block_n] of out[g] ("ws": [2 * block_m, block_n],
  one half of the K rows per compute warpgroup); block_k rows of the group per pipeline step.
  "ws" only: cluster_n = 2 pairs CTAs on neighbouring N tiles of the same (group, K rows), which
  load the shared lhs tile once by TMA multicast (a third less L2->SMEM traffic per step).
  "ws" only: group_rows = True starts each group's row blocks at its first row rounded down
  to 8 (as gmm's row tiles) instead of at a multiple of block_k: about half a step less per
  group and output tile, and no masked first block for groups starting on a multiple of 8.
  "ws" only: tile_pipeline = True runs all of a CTA's (tile, step) pairs as one pipeline with
  hand-written barriers: the memory warpgroup loads the next tile's first steps while the
  compute warpgroups finish and store the current tile, where one pipeline per tile waits for
  its last steps to be consumed first (`emit_pipeline_warp_specialized` takes no pipeline of
  pipelines over the per-group step counts of tgmm; needs cluster_n = 1).
  With tile_pipeline, boundary_blocks = True has XLA gather each group's first and last lhs
  row block with the rows outside the group zeroed ([G * 2 * block_k, K]: 2 * block_k rows
  per group), which the memory warpgroup loads in their place: no row masks in the kernel.
  With tile_pipeline, balance = True takes the groups in order of falling steps per tile and
  deals their output tiles serpentine (`serpentine_tile`) instead of round robin in group
  order: groups differ in steps per tile, and round robin can leave one CTA many dear tiles."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_minor_dim: int = 1
  grid_tile_width: int = 1
  kernel: str = "ws"
  cluster_n: int = 1
  group_rows: bool = False
  tile_pipeline: bool = False
  boundary_blocks: bool = False
  balance: bool = False


def is_hopper() -> bool:
  """True when the default device is an NVIDIA Hopper GPU (H100/H200/H800)."""
  device = jax.devices()[0]
  return device.platform == "gpu" and any(k in device.device_kind for k in HOPPER_KINDS)


def _num_sms(interpret: bool) -> int:
  return _INTERPRET_SMS if interpret else jax.devices()[0].core_count


def _interpret_params(interpret: bool):
  return plgpu.InterpretGPUParams() if interpret else None


def _transforms(block_minor: int, dtype) -> tuple:
  """TMA tiling + swizzle for an SMEM tile whose minor dim has `block_minor` elements."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _swizzle_elems(dtype) -> int:
  """Elements in one 128-byte swizzle row (the granularity of SMEM slices along the minor dim)."""
  return 128 // jnp.dtype(dtype).itemsize


def gmm_smem_bytes(cfg: GmmConfig, in_dtype, out_dtype) -> int:
  """Shared memory of one "ws" or "swapped" gmm CTA: pipeline stages + the two epilogue
  tiles."""
  isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  stage = (cfg.block_m * cfg.block_k + cfg.block_k * 2 * cfg.block_n) * isz
  epilogue = 2 * (cfg.epilogue_rows or cfg.block_m) * cfg.block_n * osz
  return cfg.max_concurrent_steps * stage + epilogue + _SMEM_RESERVE


def tgmm_smem_bytes(cfg: TgmmConfig, in_dtype, out_dtype) -> int:
  """Shared memory of one "ws" tgmm CTA: pipeline stages + the two epilogue tiles."""
  isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  stage = (cfg.block_k * 2 * cfg.block_m + cfg.block_k * cfg.block_n) * isz
  return cfg.max_concurrent_steps * stage + 2 * cfg.block_m * cfg.block_n * osz + _SMEM_RESERVE


def _row_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """Group starts/ends [G], clipped to [0, m] (rows past m belong to no group)."""
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def _pad_rows(x: jax.Array, multiple: int = 8) -> jax.Array:
  """Zero rows up to a multiple of 8: tiled TMA needs the row count to be one (a copy)."""
  pad = -x.shape[0] % multiple
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _zero_rows_past(out: jax.Array, total: jax.Array) -> jax.Array:
  rows = lax.broadcasted_iota(jnp.int32, out.shape, 0)
  return jnp.where(rows < total, out, jnp.zeros((), out.dtype))


# ------------------------------------------------------------------------------------------
# Config choice and support checks
# ------------------------------------------------------------------------------------------

# (min K, min N) -> base config; the first row whose minima the call meets is taken, then
# block_n/block_m shrink to divide N (K), cluster_n drops to 1 when the N tiles are odd, and the
# stage count shrinks to fit shared memory. The large-shape rows are the best of
# benchmarks/autotune_ragged_dot.py on the H200 at G32 M32768 K3584 N3072 (README.md "Tiles"):
# block 128 x 2*128 x 64, 3 stages (4 do not fit beside the epilogue tiles), no clusters (2-CTA
# multicast of the lhs tile measured no faster), N-minor tile order 4 wide and tile_pipeline
# for gmm (fwd 3-7% faster at G32, 10-20% at k3_small); for tgmm
# group_rows, tile_pipeline and boundary_blocks (together 10-11% faster at the G32 shapes, 5%
# at G8) and balance (1-2% more). The (512, 512) rows carry the same configs down to the
# k3_small expert shapes (K = 512), where the small row's 64 x 2*64 tiles and 2 stages ran the
# MoE layer's matmuls at 120 TFLOP/s.
GMM_TABLE: tuple[tuple[tuple[int, int], GmmConfig], ...] = (
    ((512, 512), GmmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3,
                           grid_minor_dim=1, grid_tile_width=4, tile_pipeline=True)),
    ((64, 128), GmmConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)),
)
TGMM_TABLE: tuple[tuple[tuple[int, int], TgmmConfig], ...] = (
    ((512, 512), TgmmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3,
                            grid_minor_dim=1, grid_tile_width=1, group_rows=True,
                            tile_pipeline=True, boundary_blocks=True, balance=True)),
    ((128, 64), TgmmConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)),
)
_BLOCK_N_CHOICES = (128, 64)   # per compute warpgroup
_BLOCK_M_CHOICES = (128, 64)


def gmm_config(m: int, k: int, n: int, in_dtype, out_dtype) -> GmmConfig | str:
  """Heuristic "ws" gmm config for out [m, n] with contraction k, or why none fits."""
  base = next((cfg for (min_k, min_n), cfg in GMM_TABLE if k >= min_k and n >= min_n), None)
  if base is None:
    return f"K={k}, N={n} below the smallest tile (K >= 64, N >= 128)"
  block_m = next((b for b in _BLOCK_M_CHOICES if b <= base.block_m and m >= b), None)
  if block_m is None:
    return f"M={m} rows is below the smallest row tile {_BLOCK_M_CHOICES[-1]}"
  if k % base.block_k:
    return f"K={k} is not a multiple of block_k={base.block_k}"
  block_n = next((b for b in _BLOCK_N_CHOICES if b <= base.block_n and n % (2 * b) == 0),
                 None)
  if block_n is None:
    return f"N={n} is not a multiple of 2 * block_n for block_n in {_BLOCK_N_CHOICES}"
  cfg = dataclasses.replace(base, block_m=block_m, block_n=block_n)
  if (n // (2 * block_n)) % cfg.cluster_n:
    cfg = dataclasses.replace(cfg, cluster_n=1)
  return _fit_stages(cfg, gmm_smem_bytes, in_dtype, out_dtype)


def swapped_config(m: int, k: int, n: int, groups: int, in_dtype, out_dtype) -> GmmConfig | str:
  """"swapped" gmm config for out [m, n] with contraction k over `groups` groups, or why none
  fits: row tiles of ceil(m / groups) + 7 rows rounded up to 8 (one tile holds a group of the
  average size wherever its first row falls), at most 64; 128 K per stage, as many stages as
  fit (the weight bytes in flight bound a memory-bound product)."""
  if k % 64:
    return f"K={k} is not a multiple of 64"
  if n % (2 * _WGMMA_ROWS):
    return f"N={n} is not a multiple of the CTA tile {2 * _WGMMA_ROWS}"
  block_m = min(-(-(-(-m // groups) + 7) // 8) * 8, 64)
  cfg = GmmConfig(block_m=block_m, block_n=_WGMMA_ROWS, block_k=128 if k % 128 == 0 else 64,
                  max_concurrent_steps=6, kernel="swapped", tile_pipeline=True)
  return _fit_stages(cfg, gmm_smem_bytes, in_dtype, out_dtype)


def _gmm_config(m: int, k: int, n: int, groups: int, in_dtype, out_dtype) -> GmmConfig | str:
  """gmm_config, or swapped_config where the rows per group are few (M <= 8 * G) and
  SWAPPED_IS_DEFAULT."""
  if SWAPPED_IS_DEFAULT and m <= 8 * groups:
    return swapped_config(m, k, n, groups, in_dtype, out_dtype)
  return gmm_config(m, k, n, in_dtype, out_dtype)


def tgmm_config(m: int, k: int, n: int, in_dtype, out_dtype) -> TgmmConfig | str:
  """Heuristic "ws" tgmm config for out [G, k, n] over m rows, or why none fits."""
  del m
  base = next((cfg for (min_k, min_n), cfg in TGMM_TABLE if k >= min_k and n >= min_n), None)
  if base is None:
    return f"K={k}, N={n} below the smallest tile (K >= 128, N >= 64)"
  block_m = next((b for b in _BLOCK_M_CHOICES if b <= base.block_m and k % (2 * b) == 0),
                 None)
  if block_m is None:
    return f"K={k} is not a multiple of 2 * block_m for block_m in {_BLOCK_M_CHOICES}"
  block_n = next((b for b in _BLOCK_N_CHOICES if b <= base.block_n and n % b == 0), None)
  if block_n is None:
    return f"N={n} is not a multiple of block_n in {_BLOCK_N_CHOICES}"
  cfg = dataclasses.replace(base, block_m=block_m, block_n=block_n)
  if (n // block_n) % cfg.cluster_n:
    cfg = dataclasses.replace(cfg, cluster_n=1)
  return _fit_stages(cfg, tgmm_smem_bytes, in_dtype, out_dtype)


def _fit_stages(cfg, smem_bytes, in_dtype, out_dtype):
  while cfg.max_concurrent_steps > 2 and smem_bytes(cfg, in_dtype, out_dtype) > SMEM_BYTES:
    cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
  if smem_bytes(cfg, in_dtype, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs {smem_bytes(cfg, in_dtype, out_dtype)} B of shared memory"
  return cfg


def _check_common(lhs, rhs, out_dtype, interpret: bool) -> str | None:
  if not interpret and not is_hopper():
    return f"not an NVIDIA Hopper GPU ({jax.devices()[0].device_kind})"
  if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in INPUT_DTYPES:
    return f"needs lhs and rhs both bf16 or both f16, got {lhs.dtype} and {rhs.dtype}"
  if jnp.dtype(out_dtype) not in (jnp.dtype(lhs.dtype), jnp.dtype(jnp.float32)):
    return f"output dtype must be {lhs.dtype} or float32, got {jnp.dtype(out_dtype)}"
  return None


def _check_cluster(cfg, n_tiles: int) -> str | None:
  if cfg.cluster_n not in (1, 2):
    return f"cluster_n must be 1 or 2, got {cfg.cluster_n}"
  if n_tiles % cfg.cluster_n:
    return f"{n_tiles} N tiles do not split into clusters of {cfg.cluster_n}"
  return None


def _check_gmm_config(cfg: GmmConfig, m, k, n, in_dtype, out_dtype) -> str | None:
  if cfg.kernel not in KERNELS:
    return f"config.kernel must be one of {KERNELS}, got {cfg.kernel!r}"
  if cfg.kernel == "swapped":
    return _check_swapped_config(cfg, k, n, in_dtype, out_dtype)
  cta_n = cfg.block_n * (2 if cfg.kernel == "ws" else 1)
  if k % cfg.block_k:
    return f"K={k} is not a multiple of block_k={cfg.block_k}"
  if n % cta_n:
    return f"N={n} is not a multiple of the CTA tile {cta_n}"
  if cfg.kernel == "jax" and jnp.dtype(out_dtype) != jnp.dtype(in_dtype):
    return "JAX's ragged_dot_mgpu writes the input dtype only"
  if cfg.kernel == "ws" and m < cfg.block_m:
    return f"M={m} is below block_m={cfg.block_m}"
  if cfg.kernel == "ws" and (reason := _check_cluster(cfg, n // cta_n)):
    return reason
  if cfg.kernel == "ws" and cfg.block_n % _swizzle_elems(in_dtype):
    return (f"block_n={cfg.block_n} must be a multiple of the {_swizzle_elems(in_dtype)}-column"
            " swizzle tile (the warpgroups slice the rhs tile along it)")
  if cfg.kernel == "ws" and gmm_smem_bytes(cfg, in_dtype, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs more than {SMEM_BYTES} B of shared memory"
  if cfg.kernel == "jax" and (cfg.tile_pipeline or cfg.epilogue_rows):
    return "tile_pipeline and epilogue_rows are options of the 'ws' kernel"
  epi = cfg.epilogue_rows or cfg.block_m
  if cfg.block_m % epi or epi % 8:
    return (f"epilogue_rows={cfg.epilogue_rows} must divide block_m={cfg.block_m} and be a "
            "multiple of 8")
  if cfg.tile_pipeline and cfg.cluster_n != 1:
    return "tile_pipeline runs without clusters (cluster_n=1)"
  return None


def _check_swapped_config(cfg: GmmConfig, k, n, in_dtype, out_dtype) -> str | None:
  if cfg.block_n != _WGMMA_ROWS:
    return f"'swapped' takes block_n={_WGMMA_ROWS} (wgmma's M side), got {cfg.block_n}"
  if cfg.block_m % 8 or not 8 <= cfg.block_m <= 64:
    return f"'swapped' takes block_m a multiple of 8 in [8, 64], got {cfg.block_m}"
  if cfg.block_k % 64 or k % cfg.block_k:
    return f"K={k} must be a multiple of block_k={cfg.block_k}, itself a multiple of 64"
  if n % (2 * cfg.block_n):
    return f"N={n} is not a multiple of the CTA tile {2 * cfg.block_n}"
  if cfg.max_concurrent_steps < 2:
    return f"max_concurrent_steps={cfg.max_concurrent_steps} must be at least 2"
  if cfg.cluster_n != 1 or cfg.epilogue_rows is not None or not cfg.tile_pipeline:
    return "'swapped' runs one pipeline (tile_pipeline=True), no clusters, no epilogue_rows"
  if gmm_smem_bytes(cfg, in_dtype, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs more than {SMEM_BYTES} B of shared memory"
  return None


def _check_tgmm_config(cfg: TgmmConfig, k, n, in_dtype, out_dtype, interpret) -> str | None:
  if cfg.kernel not in KERNELS:
    return f"config.kernel must be one of {KERNELS}, got {cfg.kernel!r}"
  cta_m = cfg.block_m * (2 if cfg.kernel == "ws" else 1)
  if k % cta_m:
    return f"K={k} is not a multiple of the CTA tile {cta_m}"
  if n % cfg.block_n:
    return f"N={n} is not a multiple of block_n={cfg.block_n}"
  if cfg.kernel == "ws" and (reason := _check_cluster(cfg, n // cfg.block_n)):
    return reason
  if cfg.kernel == "ws" and cfg.block_m % _swizzle_elems(in_dtype):
    return (f"block_m={cfg.block_m} must be a multiple of the {_swizzle_elems(in_dtype)}-column"
            " swizzle tile (the warpgroups slice the lhs tile along it)")
  if cfg.kernel == "jax" and (cfg.group_rows or cfg.tile_pipeline):
    return "group_rows, tile_pipeline and boundary_blocks are options of the 'ws' kernel"
  if cfg.tile_pipeline and cfg.cluster_n != 1:
    return "tile_pipeline runs without clusters (cluster_n=1)"
  if (cfg.boundary_blocks or cfg.balance) and not cfg.tile_pipeline:
    return "boundary_blocks and balance are options of tile_pipeline"
  if cfg.kernel == "jax":
    if jnp.dtype(out_dtype) != jnp.dtype(in_dtype):
      return "JAX's transposed_ragged_dot_mgpu writes the input dtype only"
    if interpret:
      return ("JAX's transposed_ragged_dot_mgpu reads jax.devices()[0].core_count, "
              "which CPU devices lack (AttributeError): no interpret mode")
  if cfg.kernel == "ws" and tgmm_smem_bytes(cfg, in_dtype, out_dtype) > SMEM_BYTES:
    return f"{cfg} needs more than {SMEM_BYTES} B of shared memory"
  return None


def supports_gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None,
                 interpret: bool = False, config: GmmConfig | None = None) -> str | None:
  """None if `gmm` takes this call, else the reason it does not."""
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  if reason := _check_common(lhs, rhs, out_dtype, interpret):
    return reason
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if config is None:
    config = _gmm_config(m, k, n, group_sizes.shape[0], lhs.dtype, out_dtype)
    if isinstance(config, str):
      return config
  return _check_gmm_config(config, m, k, n, lhs.dtype, out_dtype)


def supports_tgmm(lhs, rhs, group_sizes, *, out_dtype=None, interpret: bool = False,
                  config: TgmmConfig | None = None) -> str | None:
  """None if `tgmm` takes this call, else the reason it does not."""
  del group_sizes
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  if reason := _check_common(lhs, rhs, out_dtype, interpret):
    return reason
  m, k = lhs.shape
  n = rhs.shape[1]
  if config is None:
    config = tgmm_config(m, k, n, lhs.dtype, out_dtype)
    if isinstance(config, str):
      return config
  return _check_tgmm_config(config, k, n, lhs.dtype, out_dtype, interpret)


# ------------------------------------------------------------------------------------------
# gmm: out[M, N] = lhs[M, K] @ rhs[g(row)]
# ------------------------------------------------------------------------------------------

def _await_epilogue_buffer():
  """Waits until this thread's earlier TMA stores have read their SMEM (before the epilogue
  buffer is written again)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _load_block(src, dst, barrier):
  """TMA-loads one operand block of a gmm pipeline step into its SMEM slot, arriving on
  `barrier` (one place for benchmarks/gmm_costs' load diagnostics)."""
  plgpu.copy_gmem_to_smem(src, dst, barrier)


def _store_rows(o_smem, o_gmem, smem_start, gmem_start, size, max_rows: int):
  """TMA-stores o_smem rows [smem_start, + size) to o_gmem rows [gmem_start, + size), with a
  ladder of power-of-two row counts (the trick of ragged_dot_mgpu: TMA boxes are static)."""
  remaining = max_rows
  while remaining > 0:
    rows = 1 << int(math.log2(remaining))
    remaining //= 2

    @pl.when(size & rows != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(smem_start, rows)],
                              o_gmem.at[pl.ds(gmem_start, rows)])

    smem_start += size & rows
    gmem_start += size & rows


def row_tiles(sizes_ext: jax.Array, block_m: int, grid_m: int, align: int = 8) -> jax.Array:
  """Row tiles aligned to group starts (as CUTLASS grouped GEMM) rounded down to a multiple of
  `align` rows (TMA loads into tiled SMEM need 8-aligned rows; 1 for loads without TMA): tile t
  of group i loads rows [floor_align(start_i) + t * block_m, + block_m) (rows past M read as
  zeros) and stores the ones in [start_i, end_i). Returns int32 [5, grid_m]: group, first row
  loaded, offset of the first stored row in the tile, rows stored (0 for the unused tail of
  the grid), and the number of used tiles (the same in every column)."""
  num = sizes_ext.shape[0]
  ends = jnp.cumsum(sizes_ext)
  starts = ends - sizes_ext
  aligned = starts // align * align
  tiles = jnp.where(sizes_ext > 0, (ends - aligned + block_m - 1) // block_m, 0)
  tile_end = jnp.cumsum(tiles)
  t = jnp.arange(grid_m, dtype=jnp.int32)
  # compare_all: one fused compare-and-sum; the default method is a loop, which XLA runs as
  # a while loop of small kernels (~7 per gmm call in the k3_small MoE layer's trace).
  group = jnp.searchsorted(tile_end, t, side="right", method="compare_all")
  group = jnp.minimum(group, num - 1).astype(jnp.int32)
  load0 = aligned[group] + (t - (tile_end - tiles)[group]) * block_m
  first = jnp.maximum(load0, starts[group])
  rows = jnp.where(t < tile_end[-1], jnp.minimum(load0 + block_m, ends[group]) - first, 0)
  used = jnp.broadcast_to(tile_end[-1], t.shape)
  return jnp.stack([group, load0, first - load0, rows, used]).astype(jnp.int32)


def _gmm_tile(tiles_gmem, t, tiles_m, grid_n, cfg: GmmConfig):
  """(N tile, group, first row loaded, offset of the first stored row, rows stored) of gmm's
  t-th (row tile, N tile) pair in `planar_snake` order; tiles_gmem: `row_tiles`' table."""
  mi, ni = plgpu.planar_snake(t, (tiles_m, grid_n), cfg.grid_minor_dim, cfg.grid_tile_width)
  return (ni, *(tiles_gmem[r, mi] for r in range(4)))


def _load_gmm_step(lhs_gmem, rhs_gmem, info, ki, lhs_dst, rhs_dst, barrier, *,
                   transpose_rhs: bool):
  """TMA-loads gmm's K step ki of the tile `info` (`_gmm_tile`): lhs rows [load0, + rows of
  lhs_dst) and the group's rhs block of the CTA's columns (rhs [G, K, N], or [G, N, K] with
  transpose_rhs), both arriving on `barrier`."""
  ni, group, load0 = info[:3]
  rows, bk = lhs_dst.shape
  cta_n = rhs_dst.shape[0 if transpose_rhs else 1]
  cols = pl.ds(ki * bk, bk)
  _load_block(lhs_gmem.at[pl.ds(pl.multiple_of(load0, 8), rows), cols], lhs_dst, barrier)
  rhs_g = rhs_gmem.at[jnp.minimum(group, rhs_gmem.shape[0] - 1)]
  n_cols = pl.ds(ni * cta_n, cta_n)
  _load_block(rhs_g.at[n_cols, cols] if transpose_rhs else rhs_g.at[cols, n_cols], rhs_dst,
              barrier)


def _tile_pipeline(*, stages: int, local_tiles, acc_shape, tile, load, mma, store):
  """All (tile, step) pairs of a CTA as one warp-specialised pipeline (`tile_pipeline` of gmm
  and tgmm): warpgroup 2 issues the TMA loads, warpgroups 0 and 1 the wgmma. Slot and barrier
  phase follow a step counter that runs on across tiles in all three alike, so the loads of a
  tile start as soon as the slots free up, while the compute warpgroups finish and store the
  one before. tile(i) -> (info, steps) of the CTA's tile i; load(info, kb, slot, barrier)
  issues step kb's two copies into `slot`, both arriving on `barrier`; mma(info, kb, slot,
  acc_ref) issues its wgmma; store(info, acc_ref) writes the tile. Allocates the barriers
  (call it inside the caller's `pl.run_scoped` of the SMEM slots)."""
  pl.run_scoped(
      functools.partial(_tile_pipeline_scoped, stages=stages, local_tiles=local_tiles,
                        acc_shape=acc_shape, tile=tile, load=load, mma=mma, store=store),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      collective_axes="wg")


def _tile_pipeline_scoped(*, stages, local_tiles, acc_shape, tile, load, mma, store, produced,
                          consumed):
  wg = lax.axis_index("wg")

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

    def one_tile(i, step):
      info, steps = tile(i)

      def one_step(kb, step):
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[slot])

        load(info, kb, slot, produced.at[slot])
        return step + 1

      return lax.fori_loop(0, steps, one_step, step)

    total = lax.fori_loop(0, local_tiles, one_tile, jnp.int32(0))

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _quiesce(step):     # observe the last releases before the barriers are freed
      plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

    def one_tile(i, step):
      info, steps = tile(i)

      def run(acc_ref):
        def one_step(kb, step):
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(produced.at[slot])
          mma(info, kb, slot, acc_ref)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[slot])
          return step + 1

        next_step = lax.fori_loop(0, steps, one_step, step)
        store(info, acc_ref)
        return next_step

      return pl.run_scoped(run, plgpu.ACC(acc_shape, jnp.float32))

    lax.fori_loop(0, local_tiles, one_tile, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# jitted: identical calls (every layer's) lower to one function, so XLA builds the kernel once
@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "transpose_rhs", "num_sms",
                                             "interpret"))
def _gmm_ws(lhs, rhs, sizes_ext, *, cfg: GmmConfig, out_dtype, transpose_rhs: bool,
            num_sms: int, interpret: bool):
  """Warp-specialised gmm; sizes_ext [G + 1] = group sizes + rows past their sum (the padding
  group, whose tiles store zeros)."""
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  cta_n = 2 * bn
  grid_m = pl.cdiv(m + 7 * (g + 1), bm) + g + 1   # >= the tiles of the G + 1 row groups
  c = cfg.cluster_n
  grid_n = n // cta_n // c          # in clusters of c neighbouring N tiles
  tiles = row_tiles(sizes_ext, bm, grid_m)
  transforms = _transforms(bk, lhs.dtype)
  rhs_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)
  epi = cfg.epilogue_rows or bm

  def rhs_half(b_smem, wg):
    """The compute warpgroup's half of the rhs tile, as wgmma's [bk, bn] operand."""
    if transpose_rhs:
      return b_smem.at[pl.ds(wg * bn, bn)].transpose((1, 0))
    return b_smem.at[:, pl.ds(wg * bn, bn)]

  def store_tile(acc, o_smem, out_gmem, ni, wg, load0, offset, rows, is_pad):
    """Stores the tile's rows [offset, offset + rows) (zeros for the padding group) through
    o_smem in slices of epi rows."""
    for lo in range(0, bm, epi):
      _await_epilogue_buffer()

      @pl.when(is_pad)
      def _():
        o_smem[...] = jnp.zeros((epi, bn), out_dtype)

      @pl.when(jnp.logical_not(is_pad))
      def _():
        o_smem[...] = acc[lo:lo + epi]

      plgpu.commit_smem()
      first = jnp.clip(offset, lo, lo + epi)
      size = jnp.clip(offset + rows, lo, lo + epi) - first
      _store_rows(o_smem, out_gmem.at[:, pl.ds(ni * cta_n + wg * bn, bn)], first - lo,
                  load0 + first, size, epi)

  def make_pipeline(body, compute_context, row0, n_idx):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // bk,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((pl.Element(bm), bk), lambda ki: (pl.multiple_of(row0, 8), ki),
                            transforms=transforms,
                            collective_axes=("cluster",) if c > 1 else ()),
            plgpu.BlockSpec(rhs_block,
                            (lambda ki: (n_idx, ki)) if transpose_rhs
                            else (lambda ki: (ki, n_idx)),
                            transforms=transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  def body(tiles_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    allocs = make_pipeline(ignore, ignore, 0, 0).get_allocations(lhs_gmem, rhs_gmem.at[0])

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                       out_smem=plgpu.SMEM((2, epi, bn), out_dtype), collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((grid_m * grid_n,), collective_axes="cluster_grid")
      def _tile(loop_info: plgpu.NDLoopInfo):
        mi, nj = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n),
                                    cfg.grid_minor_dim, cfg.grid_tile_width)
        ni = nj * c + lax.axis_index("cluster")
        group, load0, offset, rows = (tiles_gmem[r, mi] for r in range(4))

        def mma(_, a_smem, b_smem, acc_ref):
          plgpu.wgmma(acc_ref, a_smem, rhs_half(b_smem, wg))
          plgpu.wgmma_wait(0)
          return acc_ref

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            store_tile(acc_ref[...].astype(out_dtype), out_smem.at[wg], out_gmem, ni, wg,
                       load0, offset, rows, group == g)

        @pl.when(rows > 0)
        def _():
          make_pipeline(mma, compute_context, load0, ni)(
              lhs_gmem, rhs_gmem.at[jnp.minimum(group, g - 1)], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def tile_pipeline_body(tiles_gmem, lhs_gmem, rhs_gmem, out_gmem):
    """`_tile_pipeline` over the used row tiles only."""
    stages = cfg.max_concurrent_steps
    cta, num_ctas = lax.axis_index("cluster_grid"), num_sms
    tiles_m = tiles_gmem[4, 0]

    def tile(i):
      return _gmm_tile(tiles_gmem, cta + i * num_ctas, tiles_m, grid_n, cfg), k // bk

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, bm, bk), lhs.dtype, transforms=transforms),
        b_smem=plgpu.SMEM((stages, *rhs_block), rhs.dtype, transforms=transforms),
        out_smem=plgpu.SMEM((2, epi, bn), out_dtype),
        collective_axes="wg")
    def _scope(a_smem, b_smem, out_smem):
      wg = lax.axis_index("wg")

      def load(info, ki, slot, barrier):
        _load_gmm_step(lhs_gmem, rhs_gmem, info, ki, a_smem.at[slot], b_smem.at[slot], barrier,
                       transpose_rhs=transpose_rhs)

      def mma(info, _, slot, acc_ref):
        del info
        plgpu.wgmma(acc_ref, a_smem.at[slot], rhs_half(b_smem.at[slot], wg))

      def store(info, acc_ref):
        ni, group, load0, offset, rows = info
        store_tile(acc_ref[...].astype(out_dtype), out_smem.at[wg], out_gmem, ni, wg, load0,
                   offset, rows, group == g)

      _tile_pipeline(stages=stages,
                     local_tiles=(tiles_m * grid_n - cta + num_ctas - 1) // num_ctas,
                     acc_shape=(bm, bn), tile=tile, load=load, mma=mma, store=store)

  kernel = plgpu.kernel(
      tile_pipeline_body if cfg.tile_pipeline else body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_sms // c,),
      grid_names=("cluster_grid",),
      cluster=(c,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )
  return kernel(tiles, lhs, rhs)


def store_transposed(a: jax.Array, ref, interpret: bool) -> None:
  """ref [C, R] (SMEM) = a^T for a [R, C] in the WGMMA layout. On the GPU one SMEM store per
  element (inline Mosaic GPU: Pallas Mosaic GPU has no transpose of a register array and its
  loads from a transposed SMEM ref need unit-stride vectors); in the interpreter a.T."""
  if interpret:
    ref[...] = a.T
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(_, a, ref):
    index = ir.IndexType.get()
    for (row, col), reg in zip(a.layout.thread_idxs(a.shape), a.registers.flat):
      for j in range(ir.VectorType(reg.type).shape[0]):
        value = vector.extract(reg, dynamic_position=[],
                               static_position=ir.DenseI64ArrayAttr.get([j]))
        col_j = arith.addi(col, arith.constant(index, j)) if j else col
        memref.store(value, ref, [col_j, row])

  store(a, ref)


# jitted: identical calls (every layer's) lower to one function, so XLA builds the kernel once
@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "transpose_rhs", "num_sms",
                                             "interpret"))
def _gmm_swapped(lhs, rhs, sizes_ext, *, cfg: GmmConfig, out_dtype, transpose_rhs: bool,
                 num_sms: int, interpret: bool):
  """The "swapped" gmm (module docstring): per tile and compute warpgroup wg, acc [64, block_m]
  = W_g[:, 64 columns]^T @ x[tile rows]^T over K, stored transposed; sizes_ext as `_gmm_ws`."""
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.max_concurrent_steps
  cta_n, sub = 2 * bn, bk // 64
  grid_m = pl.cdiv(m + 7 * (g + 1), bm) + g + 1   # >= the tiles of the G + 1 row groups
  grid_n = n // cta_n
  tiles = row_tiles(sizes_ext, bm, grid_m)
  transforms = _transforms(64, lhs.dtype)
  rhs_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)

  def weight_operand(w_smem, wg, j):
    """wgmma's A [64 weight rows, 64 K] of warpgroup wg for the stage's j-th 64 K."""
    if transpose_rhs:
      return w_smem.at[pl.ds(wg * bn, bn), pl.ds(j * 64, 64)]
    return w_smem.at[pl.ds(j * 64, 64), pl.ds(wg * bn, bn)].T

  def body(tiles_gmem, lhs_gmem, rhs_gmem, out_gmem):
    cta = lax.axis_index("cluster_grid")
    tiles_m = tiles_gmem[4, 0]

    def tile(i):
      info = _gmm_tile(tiles_gmem, cta + i * num_sms, tiles_m, grid_n, cfg)
      return info, jnp.where(info[1] == g, 0, k // bk)

    @functools.partial(
        pl.run_scoped,
        x_smem=plgpu.SMEM((stages, bm, bk), lhs.dtype, transforms=transforms),
        w_smem=plgpu.SMEM((stages, *rhs_block), rhs.dtype, transforms=transforms),
        out_smem=plgpu.SMEM((2, bm, bn), out_dtype),
        collective_axes="wg")
    def _scope(x_smem, w_smem, out_smem):
      wg = lax.axis_index("wg")

      def load(info, ki, slot, barrier):
        _load_gmm_step(lhs_gmem, rhs_gmem, info, ki, x_smem.at[slot], w_smem.at[slot], barrier,
                       transpose_rhs=transpose_rhs)

      def mma(info, _, slot, acc_ref):
        del info
        for j in range(sub):
          plgpu.wgmma(acc_ref, weight_operand(w_smem.at[slot], wg, j),
                      x_smem.at[slot, :, pl.ds(j * 64, 64)].T)

      def store(info, acc_ref):
        ni, group, load0, offset, rows = info
        o_smem = out_smem.at[wg]
        _await_epilogue_buffer()

        @pl.when(group == g)
        def _():
          o_smem[...] = jnp.zeros((bm, bn), out_dtype)

        @pl.when(group != g)
        def _():
          store_transposed(acc_ref[...].astype(out_dtype), o_smem, interpret)

        plgpu.commit_smem()
        _store_rows(o_smem, out_gmem.at[:, pl.ds(ni * cta_n + wg * bn, bn)], offset,
                    load0 + offset, rows, bm)

      _tile_pipeline(stages=stages,
                     local_tiles=(tiles_m * grid_n - cta + num_sms - 1) // num_sms,
                     acc_shape=(bn, bm), tile=tile, load=load, mma=mma, store=store)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_sms,),
      grid_names=("cluster_grid",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )
  return kernel(tiles, lhs, rhs)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
        out_dtype=None, interpret: bool = False, config: GmmConfig | None = None) -> jax.Array:
  """out[M, N] = lhs[M, K] @ rhs[g] (rhs[g]^T with transpose_rhs) for the rows of group g;
  rows past sum(group_sizes) are zero. Call `supports_gmm` first."""
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if config is None:
    config = _gmm_config(m, k, n, group_sizes.shape[0], lhs.dtype, out_dtype)
  if reason := supports_gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                            out_dtype=out_dtype, interpret=interpret, config=config):
    raise NotImplementedError(reason)
  starts, ends = _row_bounds(group_sizes, m)
  lhs_p = _pad_rows(lhs)
  if config.kernel == "jax":
    with plgpu.force_gpu_interpret_mode(_interpret_params(interpret)):
      out = jax_ragged_dot.ragged_dot(
          lhs_p, rhs, group_sizes=ends - starts, block_m=config.block_m,
          block_n=config.block_n, block_k=config.block_k,
          max_concurrent_steps=config.max_concurrent_steps,
          grid_block_n=config.grid_tile_width, transpose_rhs=transpose_rhs)
    return _zero_rows_past(out[:m], ends[-1])
  if config.kernel == "swapped" and lhs_p.shape[0] < config.block_m:
    lhs_p = _pad_rows(lhs_p, config.block_m)    # a TMA box of block_m rows fits in x
  sizes_ext = jnp.concatenate([ends - starts, (lhs_p.shape[0] - ends[-1])[None]])
  kernel = _gmm_swapped if config.kernel == "swapped" else _gmm_ws
  out = kernel(lhs_p, rhs, sizes_ext, cfg=config, out_dtype=out_dtype,
               transpose_rhs=transpose_rhs, num_sms=_num_sms(interpret), interpret=interpret)
  return out[:m]


# ------------------------------------------------------------------------------------------
# tgmm: out[g] = lhs_g^T @ rhs_g  (the weight gradient)
# ------------------------------------------------------------------------------------------

def _mask_rows(a_smem, keep):
  """Zeroes the rows r of an SMEM tile [rows, cols] where keep(r) is False (in place)."""
  rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, a_smem.shape, 0),
                           plgpu.Layout.WGMMA)
  a_smem[...] = a_smem[...] * keep(rows).astype(a_smem.dtype)
  plgpu.commit_smem()


def _boundary_blocks(lhs, starts, ends, row0, num_blocks, bk: int) -> jax.Array:
  """Each group's first and last row block of lhs (rows row0 + [0, bk) and row0 +
  (num_blocks - 1) * bk + [0, bk)) with the rows outside [starts, ends) zeroed:
  [G * 2 * bk, K], block 2 g + j. One gather and select in XLA."""
  last = row0 + jnp.maximum(num_blocks - 1, 0) * bk
  rows = jnp.stack([row0, last], axis=1)[:, :, None] + jnp.arange(bk, dtype=jnp.int32)
  keep = (rows >= starts[:, None, None]) & (rows < ends[:, None, None])
  blocks = jnp.take(lhs, jnp.clip(rows, 0, lhs.shape[0] - 1).reshape(-1), axis=0)
  return jnp.where(keep.reshape(-1, 1), blocks, jnp.zeros((), lhs.dtype))


def serpentine_tile(i, cta, num_ctas: int):
  """Position of CTA cta's i-th tile when tiles are dealt in rounds of num_ctas, every other
  round in reverse (a serpentine draft: dealt in order of falling cost, no CTA takes the
  first, dearest tile of every round)."""
  return i * num_ctas + jnp.where(lax.rem(i, 2) == 0, cta, num_ctas - 1 - cta)


def serpentine_count(num_tiles, cta, num_ctas: int):
  """How many of num_tiles serpentine-dealt tiles CTA cta takes."""
  rounds, rem = num_tiles // num_ctas, lax.rem(num_tiles, num_ctas)
  return rounds + (jnp.where(lax.rem(rounds, 2) == 0, cta, num_ctas - 1 - cta) < rem)


@functools.partial(jax.jit, static_argnames=("num_groups", "cfg", "out_dtype", "num_sms",
                                             "interpret"))
def _tgmm_ws(lhs, rhs, starts, ends, *, num_groups: int, cfg: TgmmConfig, out_dtype,
             num_sms: int, interpret: bool):
  """Warp-specialised tgmm; the compute warpgroups split the K rows of each output tile."""
  k = lhs.shape[1]
  n = rhs.shape[1]
  g = num_groups
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  cta_m = 2 * bm
  c = cfg.cluster_n
  grid_m = k // cta_m
  grid_n = n // bn // c             # in clusters of c neighbouring N tiles
  # A group's steps load rows [row0 + kb * bk, + bk); rows outside [starts, ends) are masked.
  row0 = starts // 8 * 8 if cfg.group_rows else starts // bk * bk
  num_blocks = jnp.where(ends > starts, pl.cdiv(ends - row0, bk), 0).astype(jnp.int32)
  first_row = starts - row0                                  # masked below, first step
  last_row = lax.rem(ends - 1 - row0, bk)                    # masked above, last step
  origin = row0 if cfg.group_rows else row0 // bk            # in rows / in blocks of bk
  lhs_transforms = _transforms(cta_m, lhs.dtype)
  rhs_transforms = _transforms(bn, rhs.dtype)
  out_transforms = _transforms(bn, out_dtype)

  def row_block(group_origin, kb):
    """The pipeline's row index of step kb: in rows (group_rows) or in blocks of bk."""
    if cfg.group_rows:
      return pl.multiple_of(group_origin + kb * bk, 8)
    return group_origin + kb

  def row_slice(group_origin, kb):
    start = row_block(group_origin, kb)
    return pl.ds(start if cfg.group_rows else pl.multiple_of(start * bk, bk), bk)

  def mma_step(kb, steps, first_row, last_row, a_smem, b_smem, acc_ref, wg):
    """One step of a compute warpgroup: mask the rows outside the group (unless the memory
    warpgroup loaded boundary blocks), then issue the wgmma."""
    a = a_smem.at[:, pl.ds(wg * bm, bm)]
    if not cfg.boundary_blocks:
      @pl.when(kb == 0)
      def _():
        _mask_rows(a, lambda r: r >= first_row)

      @pl.when(kb == steps - 1)
      def _():
        _mask_rows(a, lambda r: r <= last_row)

    plgpu.wgmma(acc_ref, a.transpose((1, 0)), b_smem)

  def store_tile(acc_ref, o_smem, out_gmem, gi, mi, ni, wg):
    _await_epilogue_buffer()
    o_smem[...] = acc_ref[...].astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        o_smem, out_gmem.at[gi, pl.ds(mi * cta_m + wg * bm, bm), pl.ds(ni * bn, bn)])

  def make_pipeline(body, compute_context, steps, group_origin, m_idx, n_idx):
    rows = pl.Element(bk) if cfg.group_rows else bk
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((rows, cta_m), lambda kb: (row_block(group_origin, kb), m_idx),
                            transforms=lhs_transforms,
                            collective_axes=("cluster",) if c > 1 else ()),
            plgpu.BlockSpec((rows, bn), lambda kb: (row_block(group_origin, kb), n_idx),
                            transforms=rhs_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  def body(origin_gmem, nblocks_gmem, first_gmem, last_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    allocs = make_pipeline(ignore, ignore, nblocks_gmem[0], 0, 0, 0).get_allocations(
        lhs_gmem, rhs_gmem)

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                       out_smem=plgpu.SMEM((2, bm, bn), out_dtype, transforms=out_transforms),
                       collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="cluster_grid")
      def _tile(loop_info: plgpu.NDLoopInfo):
        gi = loop_info.index[0]
        mi, nj = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n),
                                    cfg.grid_minor_dim, cfg.grid_tile_width)
        ni = nj * c + lax.axis_index("cluster")
        steps, first_row, last_row = nblocks_gmem[gi], first_gmem[gi], last_gmem[gi]

        def mma(idxs, a_smem, b_smem, acc_ref):
          mma_step(idxs[0], steps, first_row, last_row, a_smem, b_smem, acc_ref, wg)
          plgpu.wgmma_wait(0)
          return acc_ref

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            store_tile(acc_ref, out_smem.at[wg], out_gmem, gi, mi, ni, wg)

        make_pipeline(mma, compute_context, steps, origin_gmem[gi], mi, ni)(
            lhs_gmem, rhs_gmem, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def tile_pipeline_body(origin_gmem, nblocks_gmem, first_gmem, last_gmem, lhs_gmem, rhs_gmem,
                         *extras_and_out):
    """`_tile_pipeline` over the (group, output tile) pairs; with boundary_blocks each group's
    first and last lhs blocks come from XLA's masked copies, with balance each CTA's tiles
    from its row of XLA's table."""
    *extras, out_gmem = extras_and_out
    extras = iter(extras)
    bounds = next(extras) if cfg.boundary_blocks else None
    group_order = next(extras) if cfg.balance else None
    stages = cfg.max_concurrent_steps
    cta, num_ctas = lax.axis_index("cluster_grid"), num_sms
    num_tiles = g * grid_m * grid_n

    def tile(i):
      if cfg.balance:
        t = serpentine_tile(i, cta, num_ctas)
        gi = group_order[t // (grid_m * grid_n)]
      else:
        t = cta + i * num_ctas
        gi = t // (grid_m * grid_n)
      mi, ni = plgpu.planar_snake(t % (grid_m * grid_n), (grid_m, grid_n),
                                  cfg.grid_minor_dim, cfg.grid_tile_width)
      steps = nblocks_gmem[gi]
      return (gi, mi, ni, steps, origin_gmem[gi], first_gmem[gi], last_gmem[gi]), steps

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, bk, cta_m), lhs.dtype, transforms=lhs_transforms),
        b_smem=plgpu.SMEM((stages, bk, bn), rhs.dtype, transforms=rhs_transforms),
        out_smem=plgpu.SMEM((2, bm, bn), out_dtype, transforms=out_transforms),
        collective_axes="wg")
    def _scope(a_smem, b_smem, out_smem):
      wg = lax.axis_index("wg")

      def load(info, kb, slot, barrier):
        gi, mi, ni, steps, group_origin, _, _ = info
        rows, cols = row_slice(group_origin, kb), pl.ds(mi * cta_m, cta_m)
        if cfg.boundary_blocks:
          first, last = kb == 0, kb == steps - 1

          @pl.when(first | last)
          def _():
            block = pl.multiple_of((2 * gi + jnp.where(first, 0, 1)) * bk, bk)
            plgpu.copy_gmem_to_smem(bounds.at[pl.ds(block, bk), cols], a_smem.at[slot], barrier)

          @pl.when(jnp.logical_not(first | last))
          def _():
            plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, cols], a_smem.at[slot], barrier)
        else:
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, cols], a_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(rhs_gmem.at[rows, pl.ds(ni * bn, bn)], b_smem.at[slot], barrier)

      def mma(info, kb, slot, acc_ref):
        _, _, _, steps, _, first_row, last_row = info
        mma_step(kb, steps, first_row, last_row, a_smem.at[slot], b_smem.at[slot], acc_ref, wg)

      def store(info, acc_ref):
        gi, mi, ni = info[:3]
        store_tile(acc_ref, out_smem.at[wg], out_gmem, gi, mi, ni, wg)

      _tile_pipeline(stages=stages,
                     local_tiles=(serpentine_count(num_tiles, cta, num_ctas) if cfg.balance
                                  else (num_tiles - cta + num_ctas - 1) // num_ctas),
                     acc_shape=(bm, bn), tile=tile, load=load, mma=mma, store=store)

  kernel = plgpu.kernel(
      tile_pipeline_body if cfg.tile_pipeline else body,
      out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid=(num_sms // c,),
      grid_names=("cluster_grid",),
      cluster=(c,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )
  extras = []
  if cfg.boundary_blocks:
    extras.append(_boundary_blocks(lhs, starts, ends, row0, num_blocks, bk))
  if cfg.balance:     # groups by falling steps (ties in group order)
    extras.append(jnp.argsort(-num_blocks, stable=True).astype(jnp.int32))
  return kernel(origin, num_blocks, first_row, last_row, lhs, rhs, *extras)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
         interpret: bool = False, config: TgmmConfig | None = None) -> jax.Array:
  """out[g] = lhs[rows of g]^T @ rhs[rows of g]: lhs [M, K], rhs [M, N] -> [G, K, N]; empty
  groups give zeros and rows past sum(group_sizes) take no part. Call `supports_tgmm` first."""
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1]
  if config is None:
    config = tgmm_config(m, k, n, lhs.dtype, out_dtype)
  if reason := supports_tgmm(lhs, rhs, group_sizes, out_dtype=out_dtype, interpret=interpret,
                             config=config):
    raise NotImplementedError(reason)
  starts, ends = _row_bounds(group_sizes, m)
  lhs, rhs = _pad_rows(lhs), _pad_rows(rhs)
  if config.kernel == "jax":
    return jax_transposed.transposed_ragged_dot(
        lhs, rhs, group_sizes=ends - starts, block_m=config.block_m, block_n=config.block_n,
        block_k=config.block_k, max_concurrent_steps=config.max_concurrent_steps,
        grid_block_n=config.grid_tile_width)
  return _tgmm_ws(lhs, rhs, starts, ends, num_groups=group_sizes.shape[0], cfg=config,
                  out_dtype=out_dtype, num_sms=_num_sms(interpret), interpret=interpret)
