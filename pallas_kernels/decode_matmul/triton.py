"""Triton tier: x [M, K] @ w [K, N] for M <= 16, bf16 x and w, fp32 sums.

A program per column block of `block_n` (the last one masked past N; with split_k > 1, one per
share of K too): it walks its K in steps of `block_k`, each x's [16, block_k] tile (rows past
M masked to 0) dotted with w's [block_k, block_n] on the MMA into an fp32 [16, block_n]
accumulator, the K loop pipelined over `num_stages`. At a decode step's shapes (M 16, K 1024,
N a few thousand) the column blocks of 32 are ~130 programs, one wave on an H100 / H200: every
SM streams a contiguous slab of w. With split_k > 1 each program writes its share's fp32
partial [S, M, N] and XLA sums the S shares (deterministic, no atomics; the sum may fuse into
the consumer).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import tiers

BLOCK_M = 16                    # the MMA's smallest M: x's rows padded to it by masked loads
_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Config:
  """block_n output columns per program, block_k of K per pipelined step, split_k shares of K
  (each a program; their number divides K / block_k); Triton's num_warps and num_stages."""
  block_n: int = 32
  block_k: int = 64
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 4


# Candidates for `benchmarks/decode_matmul.py --configs` (the default is "n32_k128_st6", the
# fastest at 5 of k3_small's 6 decode products on an H100, 2026-12-08).
CONFIGS = {
    "n32_k64": Config(),
    "n32_k128": Config(block_k=128),
    "n64_k64": Config(block_n=64),
    "n16_k128": Config(block_n=16, block_k=128),
    "n64_k64_s2": Config(block_n=64, split_k=2),
    "n32_k64_s2": Config(split_k=2),
    "n64_k128_w8": Config(block_n=64, block_k=128, num_warps=8),
    # Deeper pipelines: more of w in flight per SM (one program an SM at KDA's N).
    "n32_k64_st8": Config(num_stages=8),
    "n32_k128_st6": Config(block_k=128, num_stages=6),
}
DEFAULT = CONFIGS["n32_k128_st6"]


def default_config(k: int) -> Config:
  """DEFAULT with block_k halved (to 16 at least) until it divides K."""
  bk = DEFAULT.block_k
  while k % bk and bk > 16:
    bk //= 2
  return dataclasses.replace(DEFAULT, block_k=bk)


def is_gpu() -> bool:
  """True when the default device (or the abstract mesh's) is an NVIDIA GPU with bf16 MMA."""
  return tiers.gpu_compute_capability() >= 80


def supports(x, w, *, preferred_element_type=None, interpret: bool = False,
             config: Config | None = None) -> str | None:
  """None if the kernel takes the call (arrays or ShapeDtypeStructs), else why not."""
  (m, k), n = x.shape, w.shape[1]
  cfg = config or default_config(k)
  if not interpret and not is_gpu():
    return ("needs an NVIDIA GPU of compute capability >= 8.0 or interpret=True, the default "
            f"device is {jax.devices()[0].device_kind}")
  if jnp.dtype(x.dtype) != _BF16 or jnp.dtype(w.dtype) != _BF16:
    return f"needs bfloat16 x and w, got {jnp.dtype(x.dtype)} and {jnp.dtype(w.dtype)}"
  out = jnp.dtype(preferred_element_type or x.dtype)
  if out not in (_BF16, _F32):
    return f"output dtype must be bfloat16 or float32, got {out}"
  if not 1 <= m <= BLOCK_M:
    return f"M={m}: the kernel takes 1 to {BLOCK_M} rows"
  for name, b, least in (("block_n", cfg.block_n, 16), ("block_k", cfg.block_k, 16)):
    if b < least or b & (b - 1):
      return f"{name}={b} must be a power of two >= {least} (MMA tiles)"
  if k % cfg.block_k or cfg.split_k < 1 or (k // cfg.block_k) % cfg.split_k:
    return (f"K={k} must be a multiple of block_k={cfg.block_k} in a number of steps that "
            f"split_k={cfg.split_k} divides")
  if cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1) or cfg.num_stages < 1:
    return f"num_warps must be a power of two and num_stages >= 1, got {cfg}"
  return tiers.triton_offsets_reason(x=x, w=w)


def _kernel(x_ref, w_ref, out_ref, *, cfg: Config, m: int, n: int):
  """Program (j[, s]): out[:, j bn:(j + 1) bn] (of K's s-th share); the last column block's
  columns past N masked."""
  bn, bk = cfg.block_n, cfg.block_k
  n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
  steps = x_ref.shape[1] // bk // cfg.split_k
  first = pl.program_id(1) * steps if cfg.split_k > 1 else 0
  rows = (jnp.arange(BLOCK_M) < m)[:, None]
  cols = (n0 + jnp.arange(bn) < n)[None, :]

  def step(kk, acc):
    k0 = pl.multiple_of(kk * bk, bk)
    x = plgpu_triton.load(x_ref.at[pl.ds(0, BLOCK_M), pl.ds(k0, bk)], mask=rows, other=0)
    w = plgpu_triton.load(w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], mask=cols, other=0)
    return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(first, first + steps, step, jnp.zeros((BLOCK_M, bn), jnp.float32))
  tile = (pl.ds(0, BLOCK_M), pl.ds(n0, bn))
  if cfg.split_k > 1:
    plgpu_triton.store(out_ref.at[(pl.program_id(1), *tile)], acc, mask=rows & cols)
  else:
    plgpu_triton.store(out_ref.at[tile], acc.astype(out_ref.dtype), mask=rows & cols)


def matmul(x: jax.Array, w: jax.Array, *, preferred_element_type=None,
           interpret: bool = False, config: Config | None = None) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N] in preferred_element_type or x's dtype. Call `supports`
  first."""
  if reason := supports(x, w, preferred_element_type=preferred_element_type,
                        interpret=interpret, config=config):
    raise NotImplementedError(reason)
  (m, k), n = x.shape, w.shape[1]
  cfg = config or default_config(k)
  out_dtype = jnp.dtype(preferred_element_type or x.dtype)
  split = cfg.split_k > 1
  shape = (cfg.split_k, m, n) if split else (m, n)
  out = pl.pallas_call(
      functools.partial(_kernel, cfg=cfg, m=m, n=n),
      out_shape=jax.ShapeDtypeStruct(shape, _F32 if split else out_dtype),
      grid=(pl.cdiv(n, cfg.block_n), cfg.split_k) if split else (pl.cdiv(n, cfg.block_n),),
      compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages),
      interpret=interpret, name="decode_matmul_triton",
  )(x, w)
  return out.sum(axis=0).astype(out_dtype) if split else out
