"""Triton tier: one Pallas kernel (Triton backend) for the gather, the grouped [W1 | W3]
matmul and the SiTU-GLU epilogue of the MoE experts (report §2.3, Eq. 11).

A program owns a tile of block_m sorted rows of one group and block_n columns of h. It loads the
rows' token indices, then for each block_k slice of K gathers the [block_m, block_k] token rows
of x straight from HBM (a pointer per row, masked past the tile: Triton's register/cp.async
gather, which Mosaic GPU's TMA cannot do on Hopper), loads the matching [block_k, block_n] tiles
of W1 and W3 and accumulates gate and up in fp32. The epilogue applies SiTU to the fp32
accumulators and stores h and, on request, [gate | up] or SiTU's partial derivatives
[dh/d gate | dh/d up] (what a backward needs) in x's dtype.

Row tiles start at each group's first row (as CUTLASS's grouped GEMM); rows past
sum(group_sizes) form an extra padding group whose tiles store zeros. SiTU is written with tanh
alone, sigmoid(g) = (1 + tanh(g / 2)) / 2, and on a GPU uses `tanh.approx.f32` (one MUFU op,
relative error ~2^-11, below bf16's 2^-8 rounding of h); the interpreter uses jnp.tanh.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import tiers
from pallas_kernels.ragged_dot import mosaic_gpu

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BLOCK_CHOICES = (64, 32, 16)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles: block_m rows x block_n columns of h per program, block_k of K per step.

  Default: the best of a sweep on the H200 at k3_small's shape (M 131072, K 512, F 512, G 64):
  0.378 ms with SiTU's tanh.approx, against 0.562 ms for the dispatch gather + our Mosaic GPU
  grouped matmul + XLA's SiTU (a scratch sweep of 2026-12-01; `benchmarks/moe_gate_up.py`)."""
  block_m: int = 128
  block_n: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3


def is_hopper() -> bool:
  """The tier is a default only where its tests passed: the H200 (Hopper)."""
  return mosaic_gpu.is_hopper()


def default_config(k: int, f: int) -> Config:
  """Config() with block_k / block_n shrunk to divide K / F (16 at least)."""
  bk = next((b for b in _BLOCK_CHOICES if k % b == 0), 0)
  bn = next((b for b in _BLOCK_CHOICES if f % b == 0), 0)
  return dataclasses.replace(Config(), block_k=bk, block_n=bn)


def supports(x, rows, w1, w3, group_sizes, *, interpret: bool = False,
             config: Config | None = None) -> str | None:
  """None if the kernel takes the call (arrays or ShapeDtypeStructs), else the reason."""
  # Outputs too: h [M, F] and, checked always (supports does not know whether they are
  # asked for), SiTU's partials [M, 2F].
  m, f = rows.shape[0], w1.shape[-1]
  if not interpret and (reason := tiers.triton_offsets_reason(
      x=x, rows=rows, w1=w1, w3=w3, h=jax.ShapeDtypeStruct((m, f), x.dtype),
      partials=jax.ShapeDtypeStruct((m, 2 * f), x.dtype))):
    return reason
  if not interpret and not plgpu_triton.is_gpu_device():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  if len({jnp.dtype(a.dtype) for a in (x, w1, w3)}) != 1 or jnp.dtype(x.dtype) not in DTYPES:
    return (f"x, w1 and w3 must all be bfloat16 or all float16, got {x.dtype}, {w1.dtype}, "
            f"{w3.dtype}")
  k, f = x.shape[1], w1.shape[2]
  smallest = _BLOCK_CHOICES[-1]
  if config is None and (k % smallest or f % smallest):
    return f"K={k} and F={f} must be multiples of {smallest} (the smallest tile)"
  cfg = default_config(k, f) if config is None else config
  for name, b in (("block_m", cfg.block_m), ("block_n", cfg.block_n), ("block_k", cfg.block_k)):
    if b < 16 or b & (b - 1):
      return f"{name}={b} must be a power of two >= 16 (Triton dot tiles)"
  if k % cfg.block_k:
    return f"K={k} is not a multiple of block_k={cfg.block_k}"
  if f % cfg.block_n:
    return f"F={f} is not a multiple of block_n={cfg.block_n}"
  if x.shape[0] == 0 or rows.shape[0] == 0:
    return "no tokens or no rows"
  del group_sizes
  return None


def situ_factors(gate, up, beta1: float, beta2: float, tanh):
  """SiTU (k3jax.situ) through tanh only: h = a b with a = b1 tanh(g/b1) s,
  s = sigmoid(g) = (1 + tanh(g/2))/2, b = b2 tanh(u/b2). Returns (a, b, tanh(g/b1), s,
  tanh(u/b2)), from which h and its partials (`_situ_partials`) are formed."""
  tg, tu = tanh(gate * (1.0 / beta1)), tanh(up * (1.0 / beta2))
  s = 0.5 + 0.5 * tanh(0.5 * gate)
  return beta1 * tg * s, beta2 * tu, tg, s, tu


def _situ_partials(a, b, tg, s, tu):
  """(dh/d gate, dh/d up) from `situ_factors` (k3jax.situ.situ_partials)."""
  return b * ((1.0 - tg * tg) * s + a * (1.0 - s)), a * (1.0 - tu * tu)


def _kernel(tiles_ref, rows_ref, x_ref, w1_ref, w3_ref, h_ref, *aux_ref, cfg: Config,
            beta1: float, beta2: float, tanh, situ_grads: bool):
  """Program (j, t): columns [j bn, + bn) of h for row tile t (see the module docstring);
  situ_grads also stores [dh/d gate | dh/d up]."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  num_groups, k, f = w1_ref.shape
  j, t = pl.program_id(0), pl.program_id(1)
  # `mosaic_gpu.row_tiles` with align=1: a tile's first stored row is its first row.
  group, first, count = tiles_ref[0, t], tiles_ref[1, t], tiles_ref[3, t]
  valid = jnp.arange(bm) < count
  out_rows = pl.ds(first, bm)

  def store(gate, up):
    mask = valid[:, None]
    a, b, tg, s, tu = situ_factors(gate, up, beta1, beta2, tanh)
    h = a * b
    plgpu_triton.store(h_ref.at[out_rows, pl.ds(j * bn, bn)], h.astype(h_ref.dtype), mask=mask)
    if situ_grads:
      (aux_out,) = aux_ref
      left, right = _situ_partials(a, b, tg, s, tu)
      plgpu_triton.store(aux_out.at[out_rows, pl.ds(j * bn, bn)], left.astype(aux_out.dtype),
                         mask=mask)
      plgpu_triton.store(aux_out.at[out_rows, pl.ds(f + j * bn, bn)],
                         right.astype(aux_out.dtype), mask=mask)

  zeros = jnp.zeros((bm, bn), jnp.float32)

  @pl.when((count > 0) & (group < num_groups))
  def _():
    tokens = plgpu_triton.load(rows_ref.at[out_rows], mask=valid, other=0)

    def step(i, acc):
      gate, up = acc
      cols = pl.ds(pl.multiple_of(i * bk, bk), bk)
      a = x_ref[tokens, cols]
      w_cols = pl.ds(j * bn, bn)
      gate += jnp.dot(a, w1_ref[group, cols, w_cols], preferred_element_type=jnp.float32)
      up += jnp.dot(a, w3_ref[group, cols, w_cols], preferred_element_type=jnp.float32)
      return gate, up

    store(*jax.lax.fori_loop(0, k // bk, step, (zeros, zeros)))

  @pl.when((count > 0) & (group == num_groups))
  def _():
    store(zeros, zeros)


# jitted: every layer's call shares one lowering (and one Triton kernel for XLA to build)
@functools.partial(jax.jit, static_argnames=("beta1", "beta2", "return_situ_grads",
                                             "interpret", "config"))
def gate_up(x: jax.Array, rows: jax.Array, w1: jax.Array, w3: jax.Array,
            group_sizes: jax.Array, *, beta1: float, beta2: float,
            return_situ_grads: bool = False, interpret: bool = False,
            config: Config | None = None):
  """h [M, F] = SiTU(x[rows] W1_g, x[rows] W3_g) (and SiTU's partials [M, 2F]);
  see `api.gate_up`."""
  if reason := supports(x, rows, w1, w3, group_sizes, interpret=interpret, config=config):
    raise ValueError(f"the triton tier does not take this call: {reason}")
  cfg = default_config(x.shape[1], w1.shape[2]) if config is None else config
  m, (g, _, f) = rows.shape[0], w1.shape
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  sizes_ext = jnp.concatenate([jnp.diff(ends, prepend=0), (m - ends[-1])[None]])
  grid_m = pl.cdiv(m, cfg.block_m) + g + 1      # >= the tiles of the G + 1 row groups
  out_shape = [jax.ShapeDtypeStruct((m, f), x.dtype)]
  if return_situ_grads:
    out_shape.append(jax.ShapeDtypeStruct((m, 2 * f), x.dtype))
  tanh = jnp.tanh if interpret else plgpu_triton.approx_tanh
  out = pl.pallas_call(
      functools.partial(_kernel, cfg=cfg, beta1=beta1, beta2=beta2, tanh=tanh,
                        situ_grads=return_situ_grads),
      out_shape=tuple(out_shape),
      grid=(f // cfg.block_n, grid_m),
      compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages),
      interpret=interpret,
      name="moe_gate_up",
  )(mosaic_gpu.row_tiles(sizes_ext, cfg.block_m, grid_m, align=1), rows.astype(jnp.int32),
    x, w1, w3)
  return tuple(out) if return_situ_grads else out[0]
