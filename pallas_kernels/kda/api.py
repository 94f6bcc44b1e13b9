"""Public KDA ops with fla layouts (Kimi Linear report Eq. 1; fla `chunk_kda`).

Semantics of fla-core 0.6.0 `naive_recurrent_kda`: q <- q * scale; per token
S <- S * exp(g_t)[:, None]; S <- S + (beta_t k_t) outer (v_t - S^T k_t);
o_t = S^T q_t.

Layouts: q, k [B, T, H, K] (L2-normalised by the caller, or by the op with
`use_qk_l2norm_in_kernel=True`, fla's flag); v [B, T, H, V]; g [B, T, H, K]
natural-log decay (<= 0); beta [B, T, H] (after the sigmoid); state
[B, H, K, V], returned in fp32 (the inputs' dtype promoted to >= fp32);
o [B, T, H, V] in q's dtype. `segment_ids` [B, T] integer (documents packed in
a row, 0 for padding): the state is reset to zero before every token whose id
differs from the previous token's, so nothing leaks between documents.
`initial_state` is the state entering token 0 (so it reaches only the first
segment); the final state is the state after the last token (that of the
last segment, padding included). Resets are only seen between tokens of one
call: a decode step (T = 1) that starts a new document passes a zero state.
"""
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.kda import chunked, mosaic_gpu, mosaic_tpu, recurrent_decode
from pallas_kernels.kda import reference

IMPLS = ("reference", "chunked", "mosaic_gpu", "mosaic_tpu")
RECURRENT_IMPLS = ("reference", "mosaic_gpu")

# Kernel tiers: (supports(...) -> reason or None, kernel). A kernel joins `impl=None` on a
# platform only after its tests pass there: mosaic_gpu passed on the H200 (sm_90); mosaic_tpu
# has run only in the TPU interpreter, so it is reachable by name only.
_KERNELS = {"mosaic_gpu": (mosaic_gpu.supports, mosaic_gpu.chunk_kda_mosaic_gpu),
            "mosaic_tpu": (mosaic_tpu.supports, mosaic_tpu.chunk_kda_mosaic_tpu)}


def _default_kernel() -> str | None:
  """The kernel tier qualified for the default backend's device, if any."""
  device = jax.devices()[0]
  if device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0":
    return "mosaic_gpu"
  return None


def _check_inputs(q, k, v, g, beta, initial_state, segment_ids, scale) -> float:
  """Validates shapes/dtypes; returns the scale (default K**-0.5)."""
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
  for name, x in arrays.items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
  b, t, h, dk = q.shape
  if t == 0:
    raise ValueError("q has T = 0 tokens; T must be >= 1")
  if k.shape != q.shape:
    raise ValueError(f"k must have q's shape [B, T, H, K] = {q.shape}, got {k.shape}")
  if v.ndim != 4 or v.shape[:3] != (b, t, h):
    raise ValueError(f"v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {v.shape}")
  if g.shape != q.shape:
    raise ValueError(f"g must have q's shape [B, T, H, K] = {q.shape}, got {g.shape}")
  if beta.shape != (b, t, h):
    raise ValueError(f"beta must be [B, T, H] = {(b, t, h)}, got {beta.shape}")
  dv = v.shape[-1]
  if initial_state is not None:
    if initial_state.shape != (b, h, dk, dv):
      raise ValueError(f"initial_state must be [B, H, K, V] = {(b, h, dk, dv)}, "
                       f"got {initial_state.shape}")
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"initial_state must be floating, got {initial_state.dtype}")
  if segment_ids is not None:
    if segment_ids.shape != (b, t):
      raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array (int32), got {segment_ids.dtype}")
  if scale is None:
    return dk ** -0.5
  return scale


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    gate_bound: float | None = None,
    impl: str | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """KDA over a whole sequence (training / prefill).

  Args:
    q, k, v, g, beta, initial_state, segment_ids: see the module docstring.
    scale: multiplies q; defaults to K**-0.5.
    output_final_state: return the final state [B, H, K, V] (else None).
    gate_bound: static promise g >= gate_bound, a float in [-5, 0] (K3's gate:
      -5.0); it selects the chunked tier's matmul-only tile factorisation.
      None (default) is exact for any g <= 0 (e.g. Kimi Linear's softplus gate).
      It never changes the result, only the numerical path.
    impl: one of `IMPLS`, or None for the best tier that supports the call:
      "mosaic_gpu" on Hopper GPUs when its `supports` accepts the call, else
      "chunked" (fail closed). An explicitly named kernel that cannot take the
      call raises ValueError with the reason. "reference" is the
      token-by-token `lax.scan`.
    use_qk_l2norm_in_kernel: q and k are raw and the op L2-normalises them
      (`reference.l2_normalize`): inside the Mosaic GPU intra kernel, by XLA first for the
      other tiers.

  Returns:
    (o [B, T, H, V] in q's dtype, final state or None).
  """
  scale = _check_inputs(q, k, v, g, beta, initial_state, segment_ids, scale)
  if impl is not None and impl not in IMPLS:
    raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
  if gate_bound is not None and not (isinstance(gate_bound, numbers.Real)
                                     and chunked.MIN_GATE_BOUND <= gate_bound <= 0):
    raise ValueError(f"gate_bound must be None or a float in [{chunked.MIN_GATE_BOUND}, 0], "
                     f"got {gate_bound!r}; use None for gates that can go below "
                     f"{chunked.MIN_GATE_BOUND}")
  kernel = impl if impl in _KERNELS else (_default_kernel() if impl is None else None)
  if kernel is not None:
    supports, fn = _KERNELS[kernel]
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              segment_ids=segment_ids)
    reason = supports(q, k, v, g, beta, gate_bound=gate_bound, **kw)
    if reason is None:
      if kernel == "mosaic_gpu":
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)
      if use_qk_l2norm_in_kernel:
        q, k = reference.l2_normalize(q), reference.l2_normalize(k)
      return fn(q, k, v, g, beta, **kw)
    if impl is not None:
      raise ValueError(f"impl={impl!r} cannot run this call: {reason}")
  if use_qk_l2norm_in_kernel:
    q, k = reference.l2_normalize(q), reference.l2_normalize(k)
  if impl == "reference":
    o, s = reference.recurrent_kda(q, k, v, g, beta, scale=scale,
                                   initial_state=initial_state, segment_ids=segment_ids)
  else:
    o, s = chunked.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids, gate_bound=gate_bound)
  return o, (s if output_final_state else None)


def fused_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Token-by-token KDA for decode (T = 1); arguments as in `chunk_kda`
  (`use_qk_l2norm_in_kernel`: q and k L2-normalised by XLA first).

  impl: None (the `recurrent_decode` kernel on Hopper GPUs when it supports the call, which
  passed its tests on the H200; else the reference), "reference" (the token-by-token
  `lax.scan`) or "mosaic_gpu" (`recurrent_decode`). A named kernel that cannot take the call
  raises ValueError with the reason.

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] or None).
  """
  scale = _check_inputs(q, k, v, g, beta, initial_state, segment_ids, scale)
  if impl is not None and impl not in RECURRENT_IMPLS:
    raise ValueError(f"impl must be None or one of {RECURRENT_IMPLS}, got {impl!r}")
  if use_qk_l2norm_in_kernel:
    q, k = reference.l2_normalize(q), reference.l2_normalize(k)
  if impl == "mosaic_gpu" or (impl is None and _default_kernel() == "mosaic_gpu"):
    reason = recurrent_decode.supports(q, k, v, g, beta, initial_state=initial_state,
                                       segment_ids=segment_ids)
    if reason is None:
      return recurrent_decode.fused_recurrent_kda_mosaic_gpu(
          q, k, v, g, beta, scale=scale, initial_state=initial_state,
          output_final_state=output_final_state)
    if impl is not None:
      raise ValueError(f"impl='mosaic_gpu' cannot run this call: {reason}")
  o, s = reference.recurrent_kda(q, k, v, g, beta, scale=scale,
                                 initial_state=initial_state, segment_ids=segment_ids)
  return o, (s if output_final_state else None)
