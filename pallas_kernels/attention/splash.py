"""splash tier: TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`,
jax 0.11.2) with segment ids and a causal (or full) mask, forward and backward kernels.

Splash runs one batch row ([H, T, D] per call, vmapped over B here) with 128-lane blocks and no
scale argument. This wrapper scales q (in fp32, before the cast back), zero-pads the head dims
to multiples of 128 and the lengths to whole blocks, and maps segment id 0 (padding: no
attention either way) to -1 for queries and -2 for keys, so padding never matches; rows with
no visible key (padding) give garbage in splash and are zeroed here. Splash's causal mask is
top-left aligned like ours, but only T == S is mapped; separate q and kv segment ids are
declined (a query whose id is absent from the keys would have no visible key).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

BLOCK = 128
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def supports(q, k, v, *, segments: str, causal: bool, interpret: bool = False) -> str | None:
  """None if splash takes the call, else the reason."""
  if not interpret and jax.devices()[0].platform != "tpu":
    return f"needs a TPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  if jnp.dtype(q.dtype) not in DTYPES or not q.dtype == k.dtype == v.dtype:
    return f"q, k, v must all be float32 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
  if q.shape[1] != k.shape[1]:
    return f"T = {q.shape[1]} != S = {k.shape[1]} (only self-attention lengths are mapped)"
  if segments == "separate":
    return "separate q and kv segment ids (a query could have no visible key); pass one array"
  return None


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, length: int, causal: bool, interpret: bool):
  """The splash kernel for [heads, length, D] rows (its mask info is built once per shape)."""
  one = splash.CausalMask((length, length)) if causal else splash.FullMask((length, length))
  return splash.make_splash_mha_single_device(
      splash.MultiHeadMask([one] * heads), block_sizes=splash.BlockSizes.get_default(),
      interpret=interpret)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, *, causal: bool, scale: float,
              interpret: bool = False) -> jax.Array:
  """o [B, T, H, Dv] in q's dtype (the call must pass `supports`; kv_segment_ids is
  q_segment_ids or None)."""
  del kv_segment_ids
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  tp, dkp, dvp = _round_up(t, BLOCK), _round_up(dk, BLOCK), _round_up(dv, BLOCK)
  pad = lambda x, d: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d - x.shape[-1]))
                             ).transpose(0, 2, 1, 3)
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)
  ids = jnp.ones((b, t), jnp.int32) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
  ids = jnp.pad(ids, ((0, 0), (0, tp - t)))
  seg = splash.SegmentIds(q=jnp.where(ids == 0, -1, ids), kv=jnp.where(ids == 0, -2, ids))
  kernel = _kernel(h, tp, causal, interpret)
  o = jax.vmap(kernel)(pad(q, dkp), pad(k, dkp), pad(v, dvp), segment_ids=seg)
  o = o.transpose(0, 2, 1, 3)[:, :t, :, :dv]
  return jnp.where((ids[:, :t] != 0)[:, :, None, None], o, jnp.zeros((), o.dtype))
