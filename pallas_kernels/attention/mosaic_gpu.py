"""mosaic_gpu tier: JAX's Hopper flash attention in Mosaic GPU
(`jax.experimental.pallas.ops.gpu.attention_mgpu`, jax 0.11.2), forward and backward kernels.

What that kernel takes (read from its source): q, k, v of one head dim (a multiple of 64; v is
zero-padded to Dk here and the output sliced), float16 only (its SMEM staging buffers are
float16: bfloat16 inputs fail to trace), no scale (q is scaled here, in fp32, before the cast),
no segment ids, T a multiple of 2 * block_q and S of block_kv, and a causal forward but no
causal backward ("Causal attention not supported in the backwards pass yet"). So it takes
non-causal float16 calls without segment ids; K3's training call (bfloat16, causal, packed
documents) is declined. It does not run in the Mosaic GPU interpreter on CPU either (its
import-time CUDA-version check, then "Cannot lower jaxpr with effects" inside the
interpreter), so it is tested only on a GPU.
"""
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu

BLOCK = 64
CONFIG = attention_mgpu.TuningConfig(
    block_q=BLOCK, block_kv=BLOCK, max_concurrent_steps=2, block_q_dkv=BLOCK,
    block_kv_dkv=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK)


def supports(q, k, v, *, segments: str, causal: bool, interpret: bool = False) -> str | None:
  """None if attention_mgpu takes the call, else the reason."""
  if interpret:
    return "attention_mgpu does not run in the Mosaic GPU interpreter"
  device = jax.devices()[0]
  if device.platform != "gpu" or getattr(device, "compute_capability", "") != "9.0":
    return f"needs a Hopper GPU (sm_90), the default device is {device.device_kind}"
  if not jnp.dtype(q.dtype) == k.dtype == v.dtype == jnp.float16:
    return (f"attention_mgpu stages q, k, v in float16 SMEM: all must be float16, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}")
  if segments != "none":
    return "attention_mgpu takes no segment ids"
  if causal:
    return "attention_mgpu has no causal backward (jax 0.11.2)"
  dk, dv = q.shape[-1], v.shape[-1]
  if dk % 64 or dv > dk:
    return f"head dims Dk = {dk} (a multiple of 64) and Dv = {dv} (<= Dk) needed"
  if q.shape[1] % (2 * BLOCK) or k.shape[1] % BLOCK:
    return (f"T = {q.shape[1]} must be a multiple of {2 * BLOCK} and S = {k.shape[1]} of "
            f"{BLOCK}")
  return None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              interpret: bool = False) -> jax.Array:
  """o [B, T, H, Dv] float16 (the call must pass `supports`)."""
  del q_segment_ids, kv_segment_ids, causal, interpret
  dv = v.shape[-1]
  v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)
  return attention_mgpu.attention(q, k, v, CONFIG)[..., :dv]
