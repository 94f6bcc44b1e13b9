"""The KDA layer: Kimi Delta Attention (report §2.1; Kimi Linear arXiv 2510.26692 §4).

q, k = L2Norm(SiLU(ShortConv(x W_{q,k}))), v = SiLU(ShortConv(x W_v)); a low-rank per-channel
forget gate (K3 lower-bounded form g = lb * sigmoid(e^A (f + dt_bias)), or the Kimi Linear form
g = -e^A softplus(f + dt_bias)); beta = sigmoid(x W_b); the delta-rule recurrence from
`pallas_kernels.kda`; output W_o[sigmoid(x W_g) * RMSNorm_head(o)].
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import context_parallel
from k3jax import params
from k3jax.norms import rms_norm
from pallas_kernels import decode_matmul
from pallas_kernels import kda as kda_ops
from pallas_kernels import kda_decode
from pallas_kernels.kda.reference import forget_gate


def short_conv(x: jax.Array, kernel: jax.Array, segment_ids: jax.Array | None = None,
               cache: jax.Array | None = None, lengths: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv, y[t] = sum_w x[t-W+1+w] kernel[w], restarted at document starts.

  x: [B, T, C]; kernel: [W, C]; segment_ids: [B, T] (taps never cross a change of id);
  cache: [B, W-1, C], the inputs before x (decode). Returns (y [B, T, C], new cache): the last
  W-1 inputs, or with lengths [B] the W-1 inputs ending at row b's input lengths[b] - 1 (the
  rest of the row is right padding).
  """
  width = kernel.shape[0]
  b, t, c = x.shape
  if cache is None:
    cache = jnp.zeros((b, width - 1, c), x.dtype)
  xp = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
  if segment_ids is not None:
    seg = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (b, width - 1)), segment_ids], 1)
  y = jnp.zeros((b, t, c), jnp.float32)
  for w in range(width):
    lag = width - 1 - w
    tap = xp[:, w:w + t].astype(jnp.float32) * kernel[w].astype(jnp.float32)
    if segment_ids is not None and lag:
      tap = jnp.where((seg[:, w:w + t] == segment_ids)[..., None], tap, 0.0)
    y = y + tap
  if lengths is None:
    return y.astype(x.dtype), xp[:, t:]
  tail = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width - 1))(
      xp, lengths.astype(jnp.int32))
  return y.astype(x.dtype), tail


def _dt_bias_init(key, shape, dtype):
  """dt = exp(U(log 1e-3, log 0.1)) clamped >= 1e-4; dt_bias = softplus^-1(dt) (Mamba-2)."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)), 1e-4)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nnx.Module):
  """A KDA token mixer; parameter paths follow the HF checkpoint (k3_hf_names.md)."""

  def __init__(self, dim: int, *, num_heads: int, head_dim: int, conv_size: int, gate: str,
               gate_lower_bound: float, use_full_rank_gate: bool, eps: float,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, impl: str = "",
               decode_impl: str = ""):
    """impl: `pallas_kernels.kda` chunk tier; decode_impl: `pallas_kernels.kda_decode` tier
    ("" = the platform default)."""
    h, d_h = num_heads, head_dim
    self.num_heads, self.head_dim, self.eps = h, d_h, eps
    self.gate_kind, self.lower_bound, self.dtype, self.impl = gate, gate_lower_bound, dtype, impl
    self.decode_impl = decode_impl
    self.prepared_decode_weights = nnx.data(None)   # `prepare_decode`'s, in a decode trace
    lin = params.fan_in_init((0,))
    proj = lambda shape, axes, init=lin: nnx.Dict(
        kernel=params.param(rngs, init, shape, axes, param_dtype))
    self.q_proj = proj((dim, h, d_h), ("embed", "heads", "kv"))
    self.k_proj = proj((dim, h, d_h), ("embed", "heads", "kv"))
    self.v_proj = proj((dim, h, d_h), ("embed", "heads", "kv"))
    conv_init = params.fan_in_init((0,))
    self.q_conv1d = proj((conv_size, h * d_h), ("conv", "heads_kv"), conv_init)
    self.k_conv1d = proj((conv_size, h * d_h), ("conv", "heads_kv"), conv_init)
    self.v_conv1d = proj((conv_size, h * d_h), ("conv", "heads_kv"), conv_init)
    if gate == "lower_bound":
      a_init = params.zeros_init  # report §2.1: A_h = 0 for the bounded gate
    else:
      a_init = lambda key, shape, dt: jnp.log(jax.random.uniform(key, shape, dt, 1.0, 16.0))
    self.A_log = params.param(rngs, a_init, (h,), ("heads",))
    self.dt_bias = params.param(rngs, _dt_bias_init, (h * d_h,), ("heads_kv",))
    self.f_a_proj = proj((dim, d_h), ("embed", "kv"))
    self.f_b_proj = proj((d_h, h, d_h), ("kv", "heads", "kv"))
    self.b_proj = proj((dim, h), ("embed", "heads"))
    if use_full_rank_gate:
      self.g_proj = proj((dim, h, d_h), ("embed", "heads", "kv"))
    else:
      self.g_a_proj = proj((dim, d_h), ("embed", "kv"))
      self.g_b_proj = proj((d_h, h, d_h), ("kv", "heads", "kv"))
    self.use_full_rank_gate = use_full_rank_gate
    self.o_norm = nnx.Dict(scale=params.param(rngs, params.ones_init, (d_h,), ("kv",)))
    self.o_proj = proj((h, d_h, dim), ("heads", "kv", "embed"), params.fan_in_init((0, 1)))

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               cache: dict | None = None, lengths: jax.Array | None = None
               ) -> tuple[jax.Array, dict | None]:
    """x: [B, T, d] -> ([B, T, d], new cache or None).

    cache (decode and chunked prefill): {"state": [B, H, K, V] fp32, "conv": [B, W-1, 3, H*K],
    the q, k and v conv tails in one buffer}; pass one to receive the updated one. Cached calls
    of T > 1 (prefill chunks) run one conv over the [q | k | v] channels (the conv is
    depthwise) and `chunk_kda`; T = 1 (decoding) runs `decode_step`. lengths [B] (with a
    cache): row b's first lengths[b] tokens are its own and the rest right padding, which
    enters no state: its log-decay g and beta are 0 (the recurrence passes the state through
    unchanged) and the conv tails end at the row's last token. Without a cache, under a mesh
    with a `context` axis of size > 1 the conv and recurrence run split over it (report §5.2,
    `context_parallel.kda_token_mix`).
    """
    b, t, _ = x.shape
    if cache is not None and t == 1:
      return self.decode_step(x, cache, lengths)
    h, d_h, dt = self.num_heads, self.head_dim, self.dtype
    x = x.astype(dt)
    w = lambda p: p["kernel"][...].astype(dt)
    project = lambda p: jnp.einsum("btd,dhk->bthk", x, w(p)).reshape(b, t, h * d_h)

    f = jnp.einsum("btr,rhk->bthk", x @ w(self.f_a_proj), w(self.f_b_proj))
    g = forget_gate(f, self.A_log[...], self.dt_bias[...].reshape(h, d_h), self.gate_kind,
                    self.lower_bound)
    beta = jax.nn.sigmoid((x @ w(self.b_proj)).astype(jnp.float32))
    if lengths is not None:
      token = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, T]
      g = jnp.where(token[:, :, None, None], g, 0.0)
      beta = jnp.where(token[:, :, None], beta, 0.0)
    gate_bound = self.lower_bound if self.gate_kind == "lower_bound" else None
    pre = tuple(project(p) for p in (self.q_proj, self.k_proj, self.v_proj))
    kernels = tuple(w(c) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d))
    if cache is None and context_parallel.context_size() > 1:
      o = context_parallel.kda_token_mix(
          pre, kernels, g, beta, segment_ids,
          conv=lambda y, kernel, ids: short_conv(y, kernel, ids)[0],
          gate_bound=gate_bound, impl=self.impl or None)
    else:
      if cache is None:
        conv = None
        ys = [short_conv(y, kernel, segment_ids)[0] for y, kernel in zip(pre, kernels)]
      else:
        y, conv = short_conv(jnp.concatenate(pre, -1), jnp.concatenate(kernels, -1),
                             segment_ids, cache["conv"].reshape(b, -1, 3 * h * d_h), lengths)
        conv = conv.reshape(cache["conv"].shape)
        ys = jnp.split(y, 3, axis=-1)
      q, k, v = (jax.nn.silu(y).reshape(b, t, h, d_h) for y in ys)
      o, state = kda_ops.chunk_kda(
          q, k, v, g, beta, initial_state=None if cache is None else cache["state"],
          output_final_state=cache is not None, segment_ids=segment_ids,
          gate_bound=gate_bound, impl=self.impl or None, use_qk_l2norm_in_kernel=True)
    if self.use_full_rank_gate:
      z = jnp.einsum("btd,dhk->bthk", x, w(self.g_proj))
    else:
      z = jnp.einsum("btr,rhk->bthk", x @ w(self.g_a_proj), w(self.g_b_proj))
    o = rms_norm(o.astype(jnp.float32), self.o_norm["scale"][...], self.eps)
    o = (o * jax.nn.sigmoid(z.astype(jnp.float32))).astype(dt)
    y = jnp.einsum("bthk,hkd->btd", o, w(self.o_proj))
    new_cache = None if cache is None else {"state": state, "conv": conv}
    return y, new_cache

  def decode_weights(self) -> tuple[jax.Array, jax.Array]:
    """(W_in, conv) in the compute dtype: the input projections side by side, [q | k | v | z |
    f_a | b] [d, 4HK + R + H] ([q | k | v | f_a | b] with a low-rank output gate), and the
    q, k, v conv kernels stacked [W, 3, HK]: the concatenations `decode_step` reads."""
    d = self.q_proj["kernel"].shape[0]
    w = lambda p: p["kernel"][...].astype(self.dtype)
    flat = lambda p: w(p).reshape(d, -1)
    z = [flat(self.g_proj)] if self.use_full_rank_gate else []
    w_in = jnp.concatenate([flat(p) for p in (self.q_proj, self.k_proj, self.v_proj)] + z
                           + [w(self.f_a_proj), w(self.b_proj)], axis=1)
    conv = jnp.stack([w(c) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], axis=1)
    return w_in, conv

  def prepare_decode(self) -> None:
    """Computes `decode_weights` once for the decode steps that follow in the same trace (a
    decode loop calls it before its while loop: XLA on GPUs does not hoist the concatenations
    out of the loop, and k3_small copied 8.7 MB a KDA layer every step)."""
    self.prepared_decode_weights = self.decode_weights()

  def decode_step(self, x: jax.Array, cache: dict, lengths: jax.Array | None
                  ) -> tuple[jax.Array, dict]:
    """One new token per row, x [B, 1, d] (`__call__` with a cache and T = 1): every input
    projection as one GEMM into [q | k | v | z | f_a | beta logits] (`decode_weights`, or the
    ones `prepare_decode` made), `pallas_kernels.kda_decode` for the conv, gates, recurrence
    and gated output norm (one kernel on GPUs), then o_proj; the two products through
    `pallas_kernels.decode_matmul` (its default tier)."""
    b = x.shape[0]
    h, d_h, dt = self.num_heads, self.head_dim, self.dtype
    w = lambda p: p["kernel"][...].astype(dt)
    x = x[:, 0].astype(dt)
    w_in, conv_weight = self.prepared_decode_weights or self.decode_weights()
    proj = decode_matmul.matmul(x, w_in)
    if not self.use_full_rank_gate:
      z = (x @ w(self.g_a_proj)) @ w(self.g_b_proj).reshape(d_h, h * d_h)
      proj = jnp.concatenate([proj[:, :3 * h * d_h], z, proj[:, 3 * h * d_h:]], axis=1)
    o, conv, state = kda_decode.kda_decode_step(
        proj, cache["conv"], conv_weight, w(self.f_b_proj), self.A_log[...],
        self.dt_bias[...], self.o_norm["scale"][...], cache["state"], lengths,
        gate=self.gate_kind, lower_bound=self.lower_bound, norm_eps=self.eps,
        impl=self.decode_impl or None)
    y = decode_matmul.matmul(o.reshape(b, h * d_h), w(self.o_proj).reshape(h * d_h, -1))
    return y[:, None], {"state": state, "conv": conv}

  def init_cache(self, batch: int) -> dict:
    width, channels = self.q_conv1d["kernel"].shape
    return {"state": jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32),
            "conv": jnp.zeros((batch, width - 1, 3, channels), self.dtype)}
