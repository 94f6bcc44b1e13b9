"""cudnn tier: cuDNN's fused flash attention (sm_90+) through JAX's cuDNN SDPA primitive.

`jax.nn.dot_product_attention(implementation="cudnn")` requires equal q/k and v head dims, so
this tier calls the function underneath it in jax 0.11.2,
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, which takes Dk != Dv natively
("MLA" in its checks: cuDNN >= 9.10 on Hopper); with an older cuDNN v is zero-padded to Dk and
the output sliced.

Packed documents (one id array for q and kv) go to cuDNN's packed layout: each row's runs of
equal nonzero ids become segments (`segments_of`: lengths and start offsets, at most
`PACKED_MAX_SEGMENTS` a row), and cuDNN computes each segment's causal (or full) attention alone,
skipping the blocks between documents. JAX's packed-layout offsets count q/k's head dim for v
and o as well, so v is zero-padded to Dk there and o sliced. cuDNN leaves the outputs and
gradients of tokens outside every segment (padding, id 0) unwritten: q, k, v enter through a
select on the valid tokens and o leaves through one, which zeroes those rows both ways. Rows the
packed layout cannot express (ids that are not increasing runs with padding only at the end, or
more than `PACKED_MAX_SEGMENTS` runs) take, by a runtime branch, xla_blockwise's flash
attention: under autodiff a `lax.cond` returns both branches' residuals, and cuDNN's mask form
would make every packed call write a zero [B, 1, T, S] bias for the branch it did not take
(268 MB a layer at k3_small's B 2 x T 8192). Separate q and kv ids take a boolean mask [B, 1, T,
S] (equal nonzero segment ids) beside the causal mask type: JAX turns it into a constant
additive bias (no bias gradient), which cuDNN reads for every head over all of [T, S] (1.7-1.9x
the unmasked time at K3's shapes).
"""
import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

from pallas_kernels.attention import xla_blockwise

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256
PACKED_MAX_SEGMENTS = 16


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


def segments_of(ids: jax.Array, max_segments: int = PACKED_MAX_SEGMENTS):
  """(ok, seqlen [B, M], offsets [B, M + 1]) of the runs of nonzero ids [B, T], as cuDNN's
  packed layout takes them (-1 past a row's last run). ok: every row's nonzero ids increase from
  run to run, padding (id 0) only at its end, at most M runs, and the batch has a run."""
  b, t = ids.shape
  start = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], 1) & (ids != 0)
  steps_ok = (ids[:, 1:] >= ids[:, :-1]) | (ids[:, 1:] == 0)
  tail_ok = (ids[:, :-1] != 0) | (ids[:, 1:] == 0)
  ok = (jnp.all(steps_ok & tail_ok) & jnp.all(jnp.sum(start, axis=1) <= max_segments)
        & jnp.any(start))
  starts = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=t)[0])(start)
  used = starts < t
  filled = jnp.sum(ids != 0, axis=1, keepdims=True)
  ends = jnp.minimum(jnp.concatenate([starts[:, 1:], jnp.full((b, 1), t)], 1), filled)
  seqlen = jnp.where(used, ends - starts, -1).astype(jnp.int32)
  offsets = jnp.concatenate([jnp.where(used, starts, -1), jnp.full((b, 1), -1)], 1)
  return ok, seqlen, offsets.astype(jnp.int32)


def _masked(q, k, v, q_ids, kv_ids, kind, scale):
  mask = ((q_ids[:, None, :, None] == kv_ids[:, None, None, :])
          & (q_ids[:, None, :, None] != 0))
  return cudnn_sdpa.dot_product_attention(q, k, v, mask=mask, scale=scale, mask_type=kind)


def _packed(q, k, v, ids, seqlen, offsets, causal, scale):
  valid = (ids != 0)[:, :, None, None]
  q, k, v = (jnp.where(valid, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
  v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])))
  kind = cudnn_sdpa.MaskType.PADDING_CAUSAL if causal else cudnn_sdpa.MaskType.PADDING
  return cudnn_sdpa.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen,
                                          q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                          mask_type=kind)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              interpret: bool = False) -> jax.Array:
  """o [B, T, H, Dv] in q's dtype (the call must pass `supports`)."""
  del interpret
  dv = v.shape[-1]
  if dv != q.shape[-1] and not _native_mla():
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
  kind = cudnn_sdpa.MaskType.CAUSAL if causal else cudnn_sdpa.MaskType.NO_MASK
  if q_segment_ids is None:
    return cudnn_sdpa.dot_product_attention(q, k, v, scale=scale, mask_type=kind)[..., :dv]
  if q_segment_ids is kv_segment_ids:
    ok, seqlen, offsets = segments_of(q_segment_ids)
    o = jax.lax.cond(
        ok,
        lambda q, k, v: _packed(q, k, v, q_segment_ids, seqlen, offsets, causal, scale)[
            ..., :dv],
        lambda q, k, v: xla_blockwise.attention(q, k, v, q_segment_ids, q_segment_ids,
                                                causal=causal, scale=scale)[0][..., :dv],
        q, k, v)
  else:
    o = _masked(q, k, v, q_segment_ids, kv_segment_ids, kind, scale)[..., :dv]
  return jnp.where((q_segment_ids != 0)[:, :, None, None], o, jnp.zeros((), o.dtype))
