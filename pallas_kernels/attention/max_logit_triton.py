"""The per-head max logit for QK-Clip (report §2.5) as one Pallas Triton kernel (GPU): the
scores of flash attention's forward without its softmax, only their masked row max kept.

`xla_blockwise.max_logit` runs the same pass as an XLA loop over [B, H, 512, 512] blocks, one
block after another. Here a grid of (B H, T / block_q) programs runs at once, each looping over
the key blocks its causal mask leaves visible. q and k are read in place ([B, T, H, D]: a tile's
row is one head's D contiguous values); D is cut into power-of-two chunks (192 = 128 + 64) for
Triton's tiles. Scores are fp32 sums of the inputs' products (the MMA), scaled and masked as in
the reference: key j is visible to query i iff (not causal or j <= i) and the segment ids are
equal and nonzero. Row maxima [B, H, T] (-inf where no key is visible) go to HBM and XLA takes
the max over B and T. Not differentiated (QK-Clip reads it under stop_gradient).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import tiers

BLOCK_Q = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 2
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def chunks(d: int) -> tuple[tuple[int, int], ...]:
  """(offset, size) of the power-of-two pieces of a head dim d (largest first)."""
  out, offset = [], 0
  for bit in reversed(range(d.bit_length())):
    if d & (1 << bit):
      out.append((offset, 1 << bit))
      offset += 1 << bit
  return tuple(out)


def supports(q, k, *, causal: bool, interpret: bool = False) -> str | None:
  """None if the kernel takes q [B, T, H, D], k [B, S, H, D] (arrays or ShapeDtypeStructs),
  else the reason."""
  if not interpret and (reason := tiers.triton_offsets_reason(q=q, k=k)):
    return reason
  if not interpret and not plgpu_triton.is_gpu_device():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  if jnp.dtype(q.dtype) not in DTYPES or q.dtype != k.dtype:
    return f"q and k must both be bfloat16 or float16, got {q.dtype} and {k.dtype}"
  (_, t, _, d), s = q.shape, k.shape[1]
  if d % 16:
    return f"head dim {d} is not a multiple of 16 (the MMA's K)"
  if t % BLOCK_Q or s % BLOCK_K:
    return f"T = {t} must be a multiple of {BLOCK_Q} and S = {s} of {BLOCK_K}"
  if causal and t != s:
    return f"causal with T = {t} != S = {s} (only T == S is mapped)"
  return None


def _kernel(q_ref, k_ref, qs_ref, ks_ref, out_ref, *, heads: int, scale: float, causal: bool):
  """Program (b h, i): the row maxima of query block i of head h in batch row b."""
  bh, i = pl.program_id(0), pl.program_id(1)
  b, h = bh // heads, bh % heads
  q0 = pl.multiple_of(i * BLOCK_Q, BLOCK_Q)
  parts = chunks(q_ref.shape[-1])
  q_ids = qs_ref[b, pl.ds(q0, BLOCK_Q)]
  qs = [q_ref[b, pl.ds(q0, BLOCK_Q), h, pl.ds(o, c)] for o, c in parts]
  rows = q0 + jnp.arange(BLOCK_Q)

  def step(j, m):
    k0 = pl.multiple_of(j * BLOCK_K, BLOCK_K)
    s = None
    for q_c, (o, c) in zip(qs, parts):
      part = lax.dot_general(q_c, k_ref[b, pl.ds(k0, BLOCK_K), h, pl.ds(o, c)],
                             (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      s = part if s is None else s + part
    k_ids = ks_ref[b, pl.ds(k0, BLOCK_K)]
    visible = (q_ids[:, None] == k_ids[None, :]) & (q_ids[:, None] != 0)
    if causal:
      visible = visible & (rows[:, None] >= (k0 + jnp.arange(BLOCK_K))[None, :])
    return jnp.maximum(m, jnp.max(jnp.where(visible, s * scale, -jnp.inf), axis=1))

  blocks = (q0 + BLOCK_Q - 1) // BLOCK_K + 1 if causal else k_ref.shape[1] // BLOCK_K
  m = lax.fori_loop(0, blocks, step, jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32))
  out_ref[b, h, pl.ds(q0, BLOCK_Q)] = m


# jitted: every layer's call shares one lowering (and one Triton kernel for XLA to build)
@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret"))
def max_logit(q: jax.Array, k: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              interpret: bool = False) -> jax.Array:
  """Per-head max of the visible scaled logits [H] fp32 (-inf for a head with none); the call
  must pass `supports`."""
  b, t, h, _ = q.shape
  s = k.shape[1]
  q_ids = jnp.ones((b, t), jnp.int32) if q_segment_ids is None else q_segment_ids
  kv_ids = jnp.ones((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids
  q, k = lax.stop_gradient(q), lax.stop_gradient(k)
  rows = pl.pallas_call(
      functools.partial(_kernel, heads=h, scale=scale, causal=causal),
      out_shape=jax.ShapeDtypeStruct((b, h, t), jnp.float32), grid=(b * h, t // BLOCK_Q),
      compiler_params=plgpu_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      interpret=interpret, name="mla_max_logit_triton",
  )(q, k, q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))
  return rows.max(axis=(0, 2))
