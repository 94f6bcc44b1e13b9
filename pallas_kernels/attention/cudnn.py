"""cudnn tier: cuDNN's fused flash attention (sm_90+) through JAX's cuDNN SDPA primitive.

`jax.nn.dot_product_attention(implementation="cudnn")` requires equal q/k and v head dims, so
this tier calls the function underneath it in jax 0.11.2,
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, which takes Dk != Dv natively
("MLA" in its checks: cuDNN >= 9.10 on Hopper); with an older cuDNN v is zero-padded to Dk and
the output sliced.

Packed documents go in as a boolean mask [B, 1, T, S] (equal nonzero segment ids) beside the
causal mask type: JAX turns a boolean mask into a constant additive bias, so the backward
computes no bias gradient; the mask costs B T S bytes (128 MiB at B 2, T 8192), not the
[B, H, T, S] fp32 scores of the written-out form. Queries with no visible key (padding, id 0)
get o = 0 (cuDNN would average over the masked keys). cuDNN's packed layout (ragged q/kv
seqlens and offsets from the segment ids) is not used: it gave wrong outputs, NaN losses and an
illegal instruction on the H200 on 2026-12-02.
"""
import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256


def _compute_capability() -> tuple[int, int] | None:
  device = jax.devices()[0]
  if device.platform != "gpu" or not hasattr(device, "compute_capability"):
    return None
  return tuple(int(x) for x in device.compute_capability.split("."))


def supports(q, k, v, *, segments: str, causal: bool, interpret: bool = False) -> str | None:
  """None if cuDNN takes the call, else the reason. segments: "none", "shared" or "separate"."""
  if interpret:
    return "cuDNN has no interpret mode"
  cc = _compute_capability()
  if cc is None:
    return f"needs an NVIDIA GPU, the default device is {jax.devices()[0].device_kind}"
  if cc < (9, 0):
    return f"needs sm_90+ (Dk != Dv), the GPU is sm_{cc[0]}{cc[1]}"
  if jnp.dtype(q.dtype) not in DTYPES or not q.dtype == k.dtype == v.dtype:
    return f"q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}"
  dk, dv = q.shape[-1], v.shape[-1]
  if dk > MAX_HEAD_DIM or dk % 8:
    return f"q/k head dim {dk} is not a multiple of 8 up to {MAX_HEAD_DIM}"
  if dv > dk or dv % 8:
    return f"v head dim {dv} must be a multiple of 8 and <= the q/k head dim {dk}"
  if causal and q.shape[1] != k.shape[1]:
    return f"causal with T = {q.shape[1]} != S = {k.shape[1]} (only T == S is mapped)"
  return None


def _native_mla() -> bool:
  """cuDNN >= 9.10 takes Dk != Dv (the check in JAX's cuDNN SDPA)."""
  return cudnn_sdpa.check_cudnn_version() >= 91000


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              interpret: bool = False) -> jax.Array:
  """o [B, T, H, Dv] in q's dtype (the call must pass `supports`)."""
  del interpret
  dv = v.shape[-1]
  if dv != q.shape[-1] and not _native_mla():
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
  kind = cudnn_sdpa.MaskType.CAUSAL if causal else cudnn_sdpa.MaskType.NO_MASK
  mask = None
  if q_segment_ids is not None:
    mask = ((q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
            & (q_segment_ids[:, None, :, None] != 0))
  o = cudnn_sdpa.dot_product_attention(q, k, v, mask=mask, scale=scale, mask_type=kind)[..., :dv]
  if q_segment_ids is None:
    return o
  return jnp.where((q_segment_ids != 0)[:, :, None, None], o, jnp.zeros((), o.dtype))
