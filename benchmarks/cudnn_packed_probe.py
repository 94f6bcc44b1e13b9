"""Probe: cuDNN's packed (ragged) layout for documents against the boolean-mask form.

python3 -m benchmarks.cudnn_packed_probe  (a GPU; prints errors and times)
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as sdpa


def offsets_from_ids(ids, max_segments):
  """ids [B, T] (contiguous runs, 0 = padding at the tail) -> seqlen [B, M], offsets [B, M+1]."""
  b, t = ids.shape
  pos = jnp.arange(t)
  start = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], 1) & (ids != 0)
  starts = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=t)[0])(start)
  valid = starts < t
  ends = jnp.concatenate([starts[:, 1:], jnp.full((b, 1), t)], 1)
  n_real = jnp.sum(ids != 0, axis=1)[:, None]
  ends = jnp.minimum(ends, n_real)
  seqlen = jnp.where(valid, ends - starts, -1).astype(jnp.int32)
  offs = jnp.where(valid, starts, -1).astype(jnp.int32)
  offs = jnp.concatenate([offs, jnp.full((b, 1), -1, jnp.int32)], 1)
  del pos
  return seqlen, offs


def packed(q, k, v, ids, scale, m):
  dk, dv = q.shape[-1], v.shape[-1]
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dk - dv)))
  seqlen, offs = offsets_from_ids(ids, m)
  o = sdpa.dot_product_attention(q, k, vp, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offs,
                                 kv_offsets=offs, scale=scale,
                                 mask_type=sdpa.MaskType.PADDING_CAUSAL)[..., :dv]
  return jnp.where((ids != 0)[:, :, None, None], o, 0)


def masked(q, k, v, ids, scale):
  mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, :, None] != 0)
  o = sdpa.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                 mask_type=sdpa.MaskType.CAUSAL)
  return jnp.where((ids != 0)[:, :, None, None], o, 0)


def bench(f, *a):
  f(*a)[0].block_until_ready() if isinstance(f(*a), tuple) else f(*a).block_until_ready()
  ts = []
  for _ in range(10):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*a))
    ts.append(time.perf_counter() - t0)
  return np.median(ts) * 1e3


def main():
  rng = np.random.default_rng(0)
  for (b, t, h, pad) in [(2, 8192, 8, 0), (2, 8192, 8, 300), (1, 8192, 32, 0)]:
    key = jax.random.key(0)
    kq, kk, kv, kg = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, h, 192), jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, h, 192), jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, h, 128), jnp.bfloat16)
    g = jax.random.normal(kg, (b, t, h, 128), jnp.bfloat16)
    ids = np.zeros((b, t), np.int32)
    for r in range(b):
      cuts = np.sort(rng.choice(np.arange(1, t - pad), 3, replace=False))
      bounds = [0, *cuts, t - pad]
      for i in range(4):
        ids[r, bounds[i]:bounds[i + 1]] = i + 1
    ids = jnp.asarray(ids)
    scale = 192 ** -0.5
    for m in (4, 16, 64):
      fp = jax.jit(lambda q, k, v, ids, m=m: packed(q, k, v, ids, scale, m))
      fm = jax.jit(lambda q, k, v, ids: masked(q, k, v, ids, scale))

      def loss(f):
        return lambda q, k, v, ids: jnp.sum(f(q, k, v, ids).astype(jnp.float32)
                                            * g.astype(jnp.float32))
      gp = jax.jit(jax.grad(loss(fp), argnums=(0, 1, 2)))
      gm = jax.jit(jax.grad(loss(fm), argnums=(0, 1, 2)))
      try:
        op, om = fp(q, k, v, ids), fm(q, k, v, ids)
        err = float(jnp.max(jnp.abs(op.astype(jnp.float32) - om.astype(jnp.float32))))
        dp, dm = gp(q, k, v, ids), gm(q, k, v, ids)
        gerr = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - c.astype(jnp.float32)))
                      / float(jnp.max(jnp.abs(c.astype(jnp.float32))))) for a, c in zip(dp, dm)]
        nan = [bool(jnp.any(jnp.isnan(x))) for x in (*dp, op)]
        print(f"B{b} T{t} H{h} pad{pad} M{m}: o max abs err {err:.3e}; grads rel {gerr}; "
              f"nan {nan}; fwd {bench(fp, q, k, v, ids):.2f} vs {bench(fm, q, k, v, ids):.2f} ms; "
              f"fwd+bwd {bench(gp, q, k, v, ids):.2f} vs {bench(gm, q, k, v, ids):.2f} ms",
              flush=True)
      except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
        print(f"B{b} T{t} H{h} pad{pad} M{m}: failed {type(e).__name__}: {str(e)[:300]}",
              flush=True)


if __name__ == "__main__":
  main()
