"""Token-by-token KDA for batched decoding as a Pallas Mosaic GPU kernel (Hopper).

Same contract as `api.fused_recurrent_kda` (fla layouts, see api.py) without
`segment_ids`; `supports` says when. fla-core 0.6.0 `naive_recurrent_kda`
(Kimi Linear report Eq. 1), per head with state S [K, V] and q <- q * scale:
  S <- S * exp(g_t)[:, None];  S <- S + (beta_t k_t) outer (v_t - S^T k_t);  o_t = S^T q_t.

One CTA (one warpgroup) per (value block of 64 columns, head, batch). It loads
the [T, K] rows of q * scale, k, beta * k, exp(g) (one [B, H, 4, T, K] operand, which XLA
writes in one fusion where four operands took a kernel each) and the [T, 64] rows of v by
TMA, its state block S [K, 64] from HBM into fp32 registers (WGMMA layout),
walks the T tokens with elementwise fp32 updates and column reductions (no
tensor cores: one token is a rank-1 update), writes each o_t [64] to HBM and
the new state block at the end. The per-token prefactors (scale, beta, exp)
are computed by XLA in fp32 before the kernel. The final state is written over the initial
state's buffer (the kernel writes a ref of it, which the lowering aliases), so a decode loop
carrying the state updates it in place.
Tested in the Mosaic GPU interpreter against the fp64 recurrence (relative RMS
<= 3e-7 with fp32 inputs) and lowered for CUDA on CPU; compiled on an H200 it passes all its
tests (2026-11-30), and with the state written in place on an H100 (2026-12-07, 45d1078).
"""
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.kda import reference

HEAD_DIMS = (64, 128)
BLOCK_V = 64        # value columns per CTA
MAX_TOKENS = 64     # inputs of T tokens are staged whole in SMEM (4 [T, K] + 1 [T, 64] fp32)
MAX_GRID = 65535    # CUDA's limit on the grid's y and z extents

_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)       # one value per row (key channel) of the [K, 64] state block
_COL = _WG.reduce(0)       # one value per column (value channel)
_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def supports(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             segment_ids=None) -> str | None:
  """None if the kernel handles the call, else why not."""
  del scale, output_final_state
  if segment_ids is not None:
    return "does not take segment_ids (a decode step that starts a document passes a zero state)"
  if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
    return f"needs K, V in {HEAD_DIMS}, got K={q.shape[-1]}, V={v.shape[-1]}"
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
  for name, x in arrays.items():
    if x is not None and jnp.dtype(x.dtype) not in _DTYPES:
      return f"needs bfloat16 or float32 inputs, got {name} of dtype {x.dtype}"
  b, t, h = q.shape[:3]
  if t > MAX_TOKENS:
    return f"needs T <= {MAX_TOKENS} (decode steps), got T={t}; use chunk_kda"
  if max(b, h) > MAX_GRID:
    return f"needs B, H <= {MAX_GRID} (CUDA grid), got B={b}, H={h}"
  return None


def _body(num_tokens: int, rows_ref, v_ref, s_ref, o_ref, q_s, k_s, kb_s, dec_s, v_s, bar):
  """The recurrence for one (value block, head, batch) over the call's tokens; its state block
  read from s_ref and the new one written back over it. rows_ref [B, H, 4, T, K]: q * scale,
  k, beta * k, exp(g)."""
  vt, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
  vcols = pl.ds(vt * BLOCK_V, BLOCK_V)
  for i, dst in enumerate((q_s, k_s, kb_s, dec_s)):
    plgpu.copy_gmem_to_smem(rows_ref.at[b, h, i], dst, bar)
  plgpu.copy_gmem_to_smem(v_ref.at[b, h, :, vcols], v_s, bar)
  s0 = plgpu.load(s_ref.at[b, h, :, vcols], layout=_WG, optimized=False)
  shape = s0.shape
  plgpu.barrier_wait(bar)

  def rows(ref, t):
    """Row t of a [T, K] SMEM ref as a per-key-channel column of a [K, 64] array."""
    return lax.broadcast_in_dim(plgpu.load(ref.at[t], layout=_ROW, optimized=False),
                                shape, [0])

  def step(t, s):
    s = s * rows(dec_s, t)
    pred = jnp.sum(s * rows(k_s, t), axis=0)
    u = plgpu.load(v_s.at[t], layout=_COL, optimized=False) - pred
    s = s + rows(kb_s, t) * lax.broadcast_in_dim(u, shape, [1])
    o_ref.at[b, h, t, vcols][...] = jnp.sum(s * rows(q_s, t), axis=0)
    return s

  s_ref.at[b, h, :, vcols][...] = lax.fori_loop(0, num_tokens, step, s0)


def _kernel(rows, v, h0, interpret):
  """o [B, H, T, V] and the final state [B, H, K, V], fp32, from rows [B, H, 4, T, K] (q *
  scale, k, beta * k, exp(g)) and v [B, H, T, V], fp32. The
  kernel writes the final state over a ref of h0 (`jax.new_ref`), which the call's lowering
  aliases to h0's buffer: a decode loop that carries the state updates it in place instead of
  copying the kernel's output into the carry every step."""
  b, h, _, t, dk = rows.shape
  dv = v.shape[-1]
  call = plgpu.kernel(
      functools.partial(_body, t),
      out_type=jax.ShapeDtypeStruct((b, h, t, dv), _F32),
      scratch_types=[plgpu.SMEM((t, dk), _F32), plgpu.SMEM((t, dk), _F32),
                     plgpu.SMEM((t, dk), _F32), plgpu.SMEM((t, dk), _F32),
                     plgpu.SMEM((t, BLOCK_V), _F32), plgpu.Barrier(num_arrivals=5)],
      grid=(dv // BLOCK_V, h, b), grid_names=("v", "h", "b"),
      compiler_params=_PARAMS, interpret=interpret, kernel_name="kda_recurrent_decode")
  state = jax.new_ref(h0)
  o = call(rows, v, state)
  return o, jax.ref.freeze(state)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _forward(q, k, v, g, beta, h0, *, scale: float, interpret):
  """XLA prefactors in fp32, token-major rows [B, H, T, .], the kernel, back to fla layouts."""

  def heads_first(x):
    return jnp.swapaxes(x.astype(_F32), 1, 2)

  kf = heads_first(k)
  rows = jnp.stack([heads_first(q) * scale, kf, kf * heads_first(beta)[..., None],
                    jnp.exp(heads_first(g))], axis=2)
  o, s = _kernel(rows, heads_first(v), h0.astype(_F32), interpret)
  return jnp.swapaxes(o, 1, 2).astype(q.dtype), s


def fused_recurrent_kda_mosaic_gpu(q, k, v, g, beta, *, scale: float | None = None,
                                   initial_state: jax.Array | None = None,
                                   output_final_state: bool = False,
                                   interpret=False) -> tuple[jax.Array, jax.Array | None]:
  """`api.fused_recurrent_kda` semantics (no segment_ids) on the Hopper decode kernel.

  Args:
    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] natural-log decay (<= 0);
      beta [B, T, H]; initial_state [B, H, K, V] or None (zeros).
    scale: multiplies q; defaults to K**-0.5.
    interpret: False on a Hopper GPU; True or a `plgpu.InterpretGPUParams` to run
      the kernel in the Mosaic GPU interpreter (CPU tests).

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).
  """
  reason = supports(q, k, v, g, beta, initial_state=initial_state)
  if reason is not None:
    raise ValueError(f"fused_recurrent_kda_mosaic_gpu: {reason}")
  scale, h0 = reference.scale_and_state(q, v, scale, initial_state)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  o, s = _forward(q, k, v, g, beta, h0, scale=scale, interpret=interpret or None)
  return o, (s if output_final_state else None)
