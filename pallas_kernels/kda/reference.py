"""Token-by-token KDA recurrence: the oracle tier (Kimi Linear report Eq. 1).

Per head, with state S [K, V] and q pre-multiplied by `scale`:
  S <- S * exp(g_t)[:, None]                     # per-key-channel decay Diag(alpha_t)
  S <- S + (beta_t k_t) outer (v_t - S^T k_t)     # delta rule on the decayed state
  o_t = S^T q_t
This is fla-core 0.6.0 `naive_recurrent_kda`. A segment boundary (segment_ids
changes from token t-1 to token t) zeroes the state before token t.
"""
import functools
import itertools
import math

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(*arrays: jax.Array | None) -> jnp.dtype:
  """The inputs' common float dtype promoted to at least fp32."""
  dtypes = [a.dtype for a in arrays if a is not None]
  return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


L2_EPS = 1e-6


def forget_gate(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array, kind: str,
                lower_bound: float) -> jax.Array:
  """Log-decay g [B, T, H, K] in fp32 from the low-rank logits f [B, T, H, K].

  lower_bound (K3): g = lb * sigmoid(e^A (f + dt_bias)) in (lb, 0).
  softplus (Kimi Linear): g = -e^A * softplus(f + dt_bias), unbounded below.
  """
  z = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  return gate(z, jnp.exp(a_log.astype(jnp.float32))[:, None], kind, lower_bound)


def gate(z: jax.Array, a: jax.Array, kind: str, lower_bound: float) -> jax.Array:
  """The gate of `forget_gate` from z = f + dt_bias and a = e^A (broadcastable), in fp32 ops
  that the Triton and Mosaic TPU kernels also lower (softplus as max(z, 0) + log1p(e^-|z|))."""
  if kind == "lower_bound":
    return lower_bound * jax.nn.sigmoid(a * z)
  return -a * (jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z))))


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
  """x / sqrt(sum x^2 + eps) over the last axis in fp32, back in x's dtype (fla `l2norm`)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def scale_and_state(q: jax.Array, v: jax.Array, scale: float | None,
                    initial_state: jax.Array | None) -> tuple[float, jax.Array]:
  """The kernels' defaults: scale K**-0.5 and a zero state; the state [B, H, K, V] in fp32."""
  if scale is None:
    scale = q.shape[-1] ** -0.5
  if initial_state is None:
    initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
  return float(scale), initial_state.astype(jnp.float32)


def segment_resets(segment_ids: jax.Array) -> jax.Array:
  """[B, T] bool: True where token t starts a new segment (t > 0 only)."""
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.pad(changed, ((0, 0), (1, 0)))


def recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
  """KDA by `lax.scan` over tokens, in the inputs' dtype promoted to >= fp32.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0);
    beta: [B, T, H]; scale: multiplies q; initial_state: [B, H, K, V] or None;
    segment_ids: [B, T] int or None.

  Returns:
    o [B, T, H, V] in q's dtype and the final state [B, H, K, V] in the
    compute dtype.
  """
  dt = compute_dtype(q, k, v, g, beta, initial_state)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  if initial_state is None:
    s0 = jnp.zeros((b, h, dk, dv), dt)
  else:
    s0 = initial_state.astype(dt)
  if segment_ids is None:
    resets = jnp.zeros((b, t), bool)
  else:
    resets = segment_resets(segment_ids)

  def time_major(x):
    return jnp.moveaxis(x.astype(dt), 1, 0)

  xs = (time_major(q) * scale, time_major(k), time_major(v), time_major(g),
        time_major(beta), jnp.moveaxis(resets, 1, 0))

  def step(s, x):
    q_t, k_t, v_t, g_t, beta_t, reset_t = x
    s = jnp.where(reset_t[:, None, None, None], 0, s)
    s = s * jnp.exp(g_t)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=_HIGHEST)
    s = s + jnp.einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - pred,
                       precision=_HIGHEST)
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=_HIGHEST)
    return s, o_t

  s, o = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(o, 0, 1).astype(q.dtype), s


@functools.partial(jax.jit, static_argnames=("b", "t", "h", "dk", "dv", "gate",
                                             "with_initial_state", "dtype"))
def example_inputs(key: jax.Array, b: int, t: int, h: int, dk: int, dv: int, *,
                   gate: str, with_initial_state: bool,
                   dtype=jnp.float32) -> dict[str, jax.Array | None]:
  """Random KDA inputs shaped like a layer's, for tests and benchmarks.

  q, k are L2-normalised (report §4); beta = sigmoid(N(0, 1)). Each (head, key
  channel) gets an offset c ~ U(-8, 0) (bounded) or U(-7, 1) (unbounded), so
  decay rates range from ~1e-3 (memory across many chunks) to ~3 per token.
  gate="bounded" is K3's gate g = -5 sigmoid(x + c) (fla
  `naive_kda_lowerbound_gate`, A_log = 0); gate="unbounded" is Kimi Linear's
  g = -exp(A) softplus(x + c), A ~ U(0, 1.5) (fla `naive_kda_gate`), with 1% of
  entries set to -1000 like the -1736 outliers of Kimi Linear's layer 0
  (kda.md §2.2). x ~ N(0, 1); h0 ~ N(0, 1) or None.

  Values are drawn in fp32 (the same under jax_enable_x64) and cast to dtype.

  Returns:
    dict of q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H];
    h0 [B, H, K, V] (fp32) or None.
  """
  shapes = dict(q=(b, t, h, dk), k=(b, t, h, dk), v=(b, t, h, dv), g=(b, t, h, dk),
                beta=(b, t, h), h0=(b, h, dk, dv))
  sizes = [math.prod(shape) for shape in shapes.values()]
  key_normal, key_uniform = jax.random.split(key)
  flat = jnp.split(jax.random.normal(key_normal, (sum(sizes),), jnp.float32),
                   list(itertools.accumulate(sizes))[:-1])
  n = {name: x.reshape(shape) for (name, shape), x in zip(shapes.items(), flat)}

  def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  u = jax.random.uniform(key_uniform, (2 * h * dk + b * t * h * dk,), jnp.float32)
  offset = u[:h * dk].reshape(h, dk)
  if gate == "bounded":
    g = -5.0 * jax.nn.sigmoid(n["g"] - 8.0 * offset)
  elif gate == "unbounded":
    a = 1.5 * u[h * dk:2 * h * dk].reshape(h, dk)
    g = -jnp.exp(a) * jax.nn.softplus(n["g"] + 1.0 - 8.0 * offset)
    g = jnp.where(u[2 * h * dk:].reshape(g.shape) < 0.01, -1000.0, g)
  else:
    raise ValueError(f"gate must be 'bounded' or 'unbounded', got {gate!r}")
  x = dict(q=unit(n["q"]), k=unit(n["k"]), v=n["v"], g=g, beta=jax.nn.sigmoid(n["beta"]))
  x = {name: a.astype(dtype) for name, a in x.items()}
  x["h0"] = n["h0"] if with_initial_state else None
  return x
