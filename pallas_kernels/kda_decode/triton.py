"""Triton tier: one KDA layer's decode step in one kernel, one program per (row, head).

Each program reads its head's K columns of q, k, v, z and the row's f_a and beta logit from
proj, the W-1 tail rows of its q, k, v channels, its [R, K] slice of f_b and its state
S [K, K] (fp32), and computes in fp32 registers (xla.py states the math): the conv and SiLU,
the L2 norms, the gate (f_a f_b in the program), beta, the decay, delta rule and readout, and
the gated RMSNorm of the output. It writes o and the new state and conv tail over the old
ones' buffers (`input_output_aliases`), so a decode loop carrying them updates them in place.
Only the program of a (row, head) touches that head's state and tail channels; the state is
written after the readout's reductions and the tail rows last, so every thread has read the old
values before any is overwritten. Splitting a head's columns over programs (as fla's
fused_recurrent_kda does) would race there: every program reads all of the head's q and k
tail channels.
`Config.block`: the state walked in [K, block] column blocks (f_a f_b in [block, K] slices of
f_b; None or >= K: the whole [K, K] state at once, one program an SM at 8 warps; block 32 at
4 warps: 167 registers a thread on sm_90a, three programs an SM, for K3's B 16 x 96 heads =
1536 programs). Every entry of `CONFIGS` passed the GPU tests (H100, 2026-12-07); the default,
"c64_w4", was the fastest at three of the four measured shapes there and within 1% at the
fourth (B 1 and 16 x H 8 and 96: 0.84-0.98x the time of "tile_w8", then a separate kernel for
the whole state, since folded into this one; `benchmarks/kda_decode.py`, this op's README). At k3_small's decode (B 16, H 8, K 128) it is one kernel where the XLA
form of the same step takes six (gate product, gate and operand fusion, conv tail update and
its copy, recurrence, output norm).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import tiers
from pallas_kernels.kda import reference

MAX_DIM = 128       # K and R
_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Config:
  """block: state columns (and f_b rows) a step, None (or more than K) for all K; num_warps
  per program."""
  block: int | None = None
  num_warps: int = 8


# The benchmark sweep's candidates (`benchmarks/kda_decode.py --triton_configs`).
CONFIGS = {"tile_w8": Config(), "c64_w4": Config(block=64, num_warps=4),
           "c32_w4": Config(block=32, num_warps=4), "c32_w2": Config(block=32, num_warps=2)}
DEFAULT = CONFIGS["c64_w4"]


def config_name(cfg: Config) -> str:
  """cfg's name in CONFIGS, else its repr."""
  return next((name for name, c in CONFIGS.items() if c == cfg), repr(cfg))


def is_gpu() -> bool:
  return plgpu_triton.is_gpu_device()


def supports(proj, conv_tail, *, f_b, interpret: bool = False,
             config: Config | None = None) -> str | None:
  """None if the kernel takes the call (arrays or ShapeDtypeStructs), else why not."""
  if not interpret and not is_gpu():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  r, _, k = f_b.shape
  for name, n in (("K", k), ("R", r)):
    if n > MAX_DIM or n & (n - 1) or n < 16:
      return f"needs {name} a power of two in [16, {MAX_DIM}], got {name}={n}"
  block = (config or DEFAULT).block
  if block is not None and (block & (block - 1) or block < 16):
    return f"needs config.block a power of two >= 16, got {block}"
  for name, a in (("proj", proj), ("conv_tail", conv_tail), ("f_b", f_b)):
    if jnp.dtype(a.dtype) not in _DTYPES:
      return f"needs bfloat16 or float32 {name}, got {a.dtype}"
  return tiers.triton_offsets_reason(proj=proj, conv_tail=conv_tail)


def _i32(i: int) -> jax.Array:
  """A static index as a traced scalar (Pallas's interpreter indexes refs by arrays only)."""
  return jnp.int32(i)


def _kernel(proj_ref, tail_ref, cw_ref, fb_ref, alog_ref, dtb_ref, onorm_ref, state_ref,
            len_ref, o_ref, tail_out, state_out, *, heads: int, k: int, r: int, width: int,
            block: int, gate: str, lower_bound: float, scale: float, eps: float):
  """One (row, head): the state in [K, block] column blocks (one block: the whole state)."""
  b, h = pl.program_id(0), pl.program_id(1)
  hk = heads * k
  load = lambda ref: plgpu_triton.load(ref).astype(_F32)
  valid = plgpu_triton.load(len_ref.at[pl.ds(b, 1)]) > 0                     # [1]
  tails = []

  def conv(first, n):
    """SiLU(conv) of channels [first, first + n) and their new tail rows."""
    cols = pl.ds(first, n)
    x = load(proj_ref.at[b, cols])
    taps = [load(tail_ref.at[b, _i32(j), cols]) for j in range(width - 1)]
    acc = x * load(cw_ref.at[_i32(width - 1), cols])
    for j in range(width - 1):
      acc = acc + taps[j] * load(cw_ref.at[_i32(j), cols])
    tails.append((cols, [jnp.where(valid, new, old) for new, old in zip(taps[1:] + [x], taps)]))
    return acc * jax.nn.sigmoid(acc)

  q, kk = conv(h * k, k), conv(hk + h * k, k)
  q = q * jax.lax.rsqrt(jnp.sum(q * q) + reference.L2_EPS) * scale
  kk = kk * jax.lax.rsqrt(jnp.sum(kk * kk) + reference.L2_EPS)
  f = load(dtb_ref.at[pl.ds(h * k, k)])
  n = min(block, r)
  for c in range(0, r, n):                       # f_a f_b in [n, K] slices of f_b
    fa = load(proj_ref.at[b, pl.ds(4 * hk + c, n)])
    f = f + jnp.sum(fa[:, None] * load(fb_ref.at[pl.ds(c, n), h, pl.ds(0, k)]), axis=0)
  g = reference.gate(f, jnp.exp(load(alog_ref.at[pl.ds(h, 1)])), gate, lower_bound)
  beta = jax.nn.sigmoid(load(proj_ref.at[b, pl.ds(4 * hk + r + h, 1)]))
  decay = jnp.exp(jnp.where(valid, g, 0.0))
  kb = jnp.where(valid, beta, 0.0) * kk
  outs = []
  for c in range(0, k, block):                   # the state in [K, block] column blocks
    cols = pl.ds(c, block)
    v = conv(2 * hk + h * k + c, block)
    st = plgpu_triton.load(state_ref.at[b, h, pl.ds(0, k), cols]) * decay[:, None]
    u = v - jnp.sum(st * kk[:, None], axis=0)
    st = st + kb[:, None] * u[None, :]
    outs.append(jnp.sum(st * q[:, None], axis=0))
    plgpu_triton.store(state_out.at[b, h, pl.ds(0, k), cols], st)
  rms = jax.lax.rsqrt(sum(jnp.sum(o * o) for o in outs) / k + eps)
  for i, o in enumerate(outs):
    cols = pl.ds(i * block, block)
    z = load(proj_ref.at[b, pl.ds(3 * hk + h * k + i * block, block)])
    o = o * rms * load(onorm_ref.at[cols]) * jax.nn.sigmoid(z)
    plgpu_triton.store(o_ref.at[b, pl.ds(h * k + i * block, block)], o.astype(o_ref.dtype))
  for cols, rows in tails:
    for j, row in enumerate(rows):
      plgpu_triton.store(tail_out.at[b, _i32(j), cols], row.astype(tail_out.dtype))


def kda_decode_step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths,
                    *, gate: str, lower_bound: float, scale: float, norm_eps: float,
                    interpret: bool = False, config: Config | None = None):
  """See `api.kda_decode_step`; the tail and the state are written in place. config: the
  tile and warps (`Config`), None for `DEFAULT` as it is at the call (a jitted caller traced
  before `DEFAULT` changed keeps the old one)."""
  cfg = config or DEFAULT
  if reason := supports(proj, conv_tail, f_b=f_b, interpret=interpret, config=cfg):
    raise ValueError(f"the triton tier does not take this call: {reason}")
  return _step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths,
               gate=gate, lower_bound=lower_bound, scale=scale, norm_eps=norm_eps,
               interpret=interpret, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("gate", "lower_bound", "scale", "norm_eps",
                                             "interpret", "cfg"))
def _step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths, *,
          gate, lower_bound, scale, norm_eps, interpret, cfg):
  r, h, k = f_b.shape
  b = proj.shape[0]
  if lengths is None:
    lengths = jnp.ones((b,), jnp.int32)
  shape = conv_tail.shape                 # [B, W-1, 3, HK], read as [B, W-1, 3HK] (a bitcast)
  conv_tail = conv_tail.reshape(b, shape[1], 3 * h * k)
  conv_weight = conv_weight.reshape(shape[1] + 1, 3 * h * k)
  kernel = functools.partial(_kernel, heads=h, k=k, r=r, width=conv_weight.shape[0],
                             block=min(cfg.block or k, k), gate=gate, lower_bound=lower_bound,
                             scale=scale, eps=norm_eps)
  o, tail, state = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((b, h * k), proj.dtype),
                 jax.ShapeDtypeStruct(conv_tail.shape, conv_tail.dtype),
                 jax.ShapeDtypeStruct(state.shape, _F32)),
      grid=(b, h),
      input_output_aliases={1: 1, 7: 2},
      compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=interpret,
      name="kda_decode_step",
  )(proj, conv_tail, conv_weight, f_b, a_log.astype(_F32), dt_bias, o_norm,
    state.astype(_F32), lengths.astype(jnp.int32))
  return o, tail.reshape(shape), state
