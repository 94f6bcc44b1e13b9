"""Mosaic TPU tier: one KDA layer's decode step, one program per head (xla.py states the math).

Grid (H,) ("parallel": the megacore splits the heads). A program's blocks hold every row of its
head: the q, k, v, z columns and the f_a and beta logits of proj (viewed [B, 1, N], so that a
row is a whole (1, K) slab), the conv tail rows of its q, k, v channels ([B, W-1, 3, HK], the
cache's own layout: one (3, K) tile a row and tap), the conv kernel, f_b's [R, K] columns,
dt_bias, the state [B, K, V] of the head, the lengths (scalar-prefetched) and A_log (SMEM). A loop
over the rows computes in fp32, in row vectors (1, K): the conv and SiLU, the L2 norms, the
gate (f_a f_b on the MXU), beta; the state's row decay and the delta rule's outer product need
the decay and beta k as columns (K, 1), which an NT product with the identity gives (the MXU
transposes); S^T k and S^T q are (1, K) @ S products; then the gated RMSNorm. The new state and
tail are written through `input_output_aliases` (each program writes only its head's blocks).
K and R must be multiples of 128. In a decode loop the state and the tail stay in place, but
the views of proj ([B, 1, N]) and f_b ([R, HK]) are relayout copies each step on a TPU (0.1
and 0.25 MiB at k3_small's shapes); a model that kept f_b in its [R, HK] view would save one.
Status: tested in the interpreter and compiled for v5e, v5p and v6e
(tests/tpu/test_kda_decode_tpu_compile.py); not yet run or timed on a TPU, so by name only.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels.kda import reference

LANES = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
VMEM_LIMIT = 48 * 2 ** 20
_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))       # a @ b^T


def vmem_bytes(b: int, k: int, r: int, width: int, itemsize: int) -> int:
  """The kernel's double-buffered blocks in VMEM (the state in and out, proj's six column
  blocks, the tail in and out, the conv kernel, f_b, o); Mosaic's own scratch comes on top
  (compiled at K3's 96 heads: 13.9 MiB scoped on v5e, 9.1 on v5p, 4.5 on v6e)."""
  state = 2 * 2 * b * k * k * 4
  proj = 2 * b * (4 * k + r + LANES) * itemsize * 8      # (1, K) slabs pad to 8 sublanes
  tail = 2 * 2 * b * (width - 1) * 8 * k * itemsize
  return state + proj + tail + 2 * (width * 8 * k + r * k) * itemsize + 2 * b * 8 * k * itemsize


def supports(proj, conv_tail, *, f_b, interpret: bool = False) -> str | None:
  """None if the kernel takes the call (arrays or ShapeDtypeStructs), else why not."""
  if not interpret and jax.devices()[0].platform != "tpu":
    return f"not a TPU ({jax.devices()[0].device_kind}) and interpret=False"
  return _decline(proj, conv_tail, f_b)


def _decline(proj, conv_tail, f_b) -> str | None:
  """Why the kernel cannot take these shapes and dtypes, or None."""
  r, _, k = f_b.shape
  h = f_b.shape[1]
  if k % LANES or r % LANES or (4 * h * k) % r:
    return f"needs K and R multiples of {LANES} and R dividing 4 H K, got K={k}, R={r}, H={h}"
  for name, a in (("proj", proj), ("conv_tail", conv_tail), ("f_b", f_b)):
    if jnp.dtype(a.dtype) not in DTYPES:
      return f"needs bfloat16 or float32 {name}, got {a.dtype}"
  need = vmem_bytes(proj.shape[0], k, r, conv_tail.shape[1] + 1, jnp.dtype(proj.dtype).itemsize)
  if need > VMEM_LIMIT:
    return f"B={proj.shape[0]} rows need about {need >> 20} MiB of VMEM (> {VMEM_LIMIT >> 20})"
  return None


def _column(row: jax.Array, eye: jax.Array) -> jax.Array:
  """row (1, n) -> (n, 1), as eye @ row^T on the MXU (exact: one nonzero product a sum)."""
  return jax.lax.dot_general(eye, row, _NT, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=_F32)


def _kernel(lengths_ref, alog_ref, q_ref, k_ref, v_ref, z_ref, fa_ref, beta_ref, tail_ref,
            cw_ref, fb_ref, dtb_ref, onorm_ref, state_ref, o_ref, tail_out, state_out, *,
            rows: int, k: int, width: int, gate: str, lower_bound: float, scale: float,
            eps: float):
  h = pl.program_id(0)
  f32 = lambda x: x.astype(_F32)
  eye = (jax.lax.broadcasted_iota(jnp.int32, (k, k), 0)
         == jax.lax.broadcasted_iota(jnp.int32, (k, k), 1)).astype(_F32)
  a = jnp.exp(jnp.full((1, 1), alog_ref[h], _F32))     # vectors: Mosaic's transcendentals
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  sec = jax.lax.broadcasted_iota(jnp.int32, (3, k), 0)
  cw = f32(cw_ref[...])                                               # [W, 3, K]
  fb = f32(fb_ref[...])                                               # [R, K]
  dtb, onorm = f32(dtb_ref[...]), f32(onorm_ref[...])                 # (1, K)

  def row(b, carry):
    valid = lengths_ref[b] > 0
    taps = [f32(tail_ref[b, j]) for j in range(width - 1)]            # (3, K) each
    new = jnp.where(sec == 0, f32(q_ref[b]), jnp.where(sec == 1, f32(k_ref[b]), f32(v_ref[b])))
    acc = new * cw[width - 1]
    for j in range(width - 1):
      acc = acc + taps[j] * cw[j]
    y = acc * jax.nn.sigmoid(acc)                                     # (3, K): q, k, v
    q, kk, v = y[0:1], y[1:2], y[2:3]
    norm = lambda x: jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + reference.L2_EPS)
    q = q * norm(q) * scale
    kk = kk * norm(kk)
    f = jnp.dot(f32(fa_ref[b]), fb, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=_F32) + dtb                    # (1, K)
    g = reference.gate(f, a, gate, lower_bound)
    beta = jax.nn.sigmoid(jnp.sum(jnp.where(lane == h % LANES, f32(beta_ref[b]), 0.0), axis=1,
                                  keepdims=True))                      # (1, 1)
    g = jnp.where(valid, g, 0.0)
    beta = jnp.where(valid, beta, 0.0)
    s = state_ref[b, 0] * _column(jnp.exp(g), eye)                    # [K, V]
    pred = jnp.dot(kk, s, precision=jax.lax.Precision.HIGHEST, preferred_element_type=_F32)
    s = s + _column(beta * kk, eye) * (v - pred)
    o = jnp.dot(q, s, precision=jax.lax.Precision.HIGHEST, preferred_element_type=_F32)
    o = o * jax.lax.rsqrt(jnp.sum(o * o, axis=1, keepdims=True) / k + eps)
    o = o * onorm * jax.nn.sigmoid(f32(z_ref[b]))
    o_ref[b] = o.astype(o_ref.dtype)
    state_out[b, 0] = s
    shifted = taps[1:] + [new]
    for j in range(width - 1):
      tail_out[b, j] = jnp.where(valid, shifted[j], taps[j]).astype(tail_out.dtype)
    return carry

  jax.lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("gate", "lower_bound", "scale", "norm_eps",
                                             "interpret"))
def kda_decode_step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths,
                    *, gate: str, lower_bound: float, scale: float, norm_eps: float,
                    interpret: bool = False):
  """See `api.kda_decode_step`; the tail and the state are written in place (compiled for the
  TPU of the current mesh or default device, or interpreted)."""
  if reason := _decline(proj, conv_tail, f_b):
    raise ValueError(f"the mosaic_tpu tier does not take this call: {reason}")
  r, h, k = f_b.shape
  b, n = proj.shape
  width = conv_weight.shape[0]
  hk = h * k
  if lengths is None:
    lengths = jnp.ones((b,), jnp.int32)
  beta_block = (4 * hk + r) // LANES
  col = lambda first: pl.BlockSpec((b, 1, k), lambda i, *_: (0, 0, first + i))
  specs = [col(0), col(h), col(2 * h), col(3 * h),                      # q, k, v, z
           pl.BlockSpec((b, 1, r), lambda i, *_: (0, 0, 4 * hk // r)),   # f_a
           pl.BlockSpec((b, 1, LANES), lambda i, *_: (0, 0, beta_block + i // LANES)),
           pl.BlockSpec((b, width - 1, 3, k), lambda i, *_: (0, 0, 0, i)),
           pl.BlockSpec((width, 3, k), lambda i, *_: (0, 0, i)),
           pl.BlockSpec((r, k), lambda i, *_: (0, i)),
           pl.BlockSpec((1, k), lambda i, *_: (0, i)),
           pl.BlockSpec((1, k), lambda i, *_: (0, 0)),
           pl.BlockSpec((b, 1, k, k), lambda i, *_: (0, i, 0, 0))]
  p3 = proj.reshape(b, 1, n)
  out = pl.pallas_call(
      functools.partial(_kernel, rows=b, k=k, width=width, gate=gate, lower_bound=lower_bound,
                        scale=scale, eps=norm_eps),
      out_shape=(jax.ShapeDtypeStruct((b, 1, hk), proj.dtype),
                 jax.ShapeDtypeStruct((b, width - 1, 3, hk), conv_tail.dtype),
                 jax.ShapeDtypeStruct(state.shape, _F32)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(h,),
          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + specs,
          out_specs=[col(0), specs[6], specs[-1]]),
      input_output_aliases={8: 1, 13: 2},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=VMEM_LIMIT),
      interpret=interpret,
      name="kda_decode_step",
  )(lengths.astype(jnp.int32), a_log.astype(_F32), p3, p3, p3, p3, p3, p3, conv_tail,
    conv_weight, f_b.reshape(r, hk), dt_bias.reshape(1, hk), o_norm.reshape(1, k),
    state.astype(_F32))
  return out[0].reshape(b, hk), out[1], out[2]
