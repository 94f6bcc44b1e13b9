"""Public softmax attention for MLA training and prefill (report §2.1; QK-Clip §2.5).

`attention(q [B, T, H, Dk], k [B, S, H, Dk], v [B, S, H, Dv])` with a causal mask (query i sees
keys j <= i, top-left aligned) and packed documents: key j is visible to query i iff their
segment ids are equal and nonzero (0 is padding: it neither attends nor is attended). A query
with no visible key gets o = 0. o comes in q's dtype; with `return_max_logit` also each head's
max visible logit scale * q.k over the batch [H] fp32 (-inf for a head with none), exact (not
estimated) and not differentiated. `q_offset` puts query i at causal position q_offset + i (a
context-parallel rank's queries against the gathered keys, report §5.2); the reference and
xla_blockwise tiers take it, the kernel tiers decline it.

Tiers ("impl"): "reference" (the written-out [B, H, T, S] form: the oracle), "xla_blockwise"
(flash attention in plain JAX: any platform), "cudnn" (cuDNN's fused attention, sm_90+),
"mosaic_gpu" (JAX's Hopper flash attention kernel), "splash" (TPU splash attention). Each
kernel tier's `supports(...)` returns None or the reason it declines; the first tier of
`default_impls()` (impl=None) or of [impl, "xla_blockwise"] (a named impl: fail closed) that
takes the call runs, and every decline is logged with its reason. `plan(...)` returns the
choice. The max logit of the kernel tiers comes from one Pallas Triton kernel on a GPU
(`max_logit_triton`), else (its decline logged) from xla_blockwise's scores-and-max pass.
"""
import logging
import types

import jax
import jax.numpy as jnp

from pallas_kernels import tiers
from pallas_kernels.attention import cudnn
from pallas_kernels.attention import max_logit_triton
from pallas_kernels.attention import mosaic_gpu
from pallas_kernels.attention import reference
from pallas_kernels.attention import splash
from pallas_kernels.attention import xla_blockwise

IMPLS = ("reference", "xla_blockwise", "cudnn", "mosaic_gpu", "splash")
KERNELS: dict[str, types.ModuleType] = {
    "xla_blockwise": xla_blockwise, "cudnn": cudnn, "mosaic_gpu": mosaic_gpu, "splash": splash}
Plan = tiers.Plan

# A kernel tier joins impl=None on a platform only after its tests pass there: cudnn on the
# H200 (tests/pallas_kernels/test_attention_gpu.py, packed documents as a boolean mask). A call
# it declines (a query offset, fp32) takes xla_blockwise, which never holds [B, H, T, S] scores.
# splash has run only in the TPU interpreter; mosaic_gpu takes no causal bf16 call.
_DEFAULTS: dict[str, tuple[str, ...]] = {"gpu": ("cudnn", "xla_blockwise"),
                                         "tpu": ("xla_blockwise",)}


def default_impls() -> tuple[str, ...]:
  """Tier order for impl=None on the default device."""
  return _DEFAULTS.get(jax.devices()[0].platform, ("xla_blockwise",))


def _order(impl: str | None) -> tuple[str, ...]:
  if impl is None:
    return default_impls()
  if impl not in IMPLS:
    raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
  return (impl,) if impl in ("reference", "xla_blockwise") else (impl, "xla_blockwise")


def _split_segments(segment_ids, b: int, t: int, s: int):
  """(q ids or None, kv ids or None, kind): kind "none", "shared" (one array for q and kv) or
  "separate"."""
  if segment_ids is None:
    return None, None, "none"
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be None, one [B, T] array (T == S) or a pair "
                       f"(q [B, T], kv [B, S]), got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    q_ids = kv_ids = segment_ids
  for name, ids, n in (("q segment_ids", q_ids, t), ("kv segment_ids", kv_ids, s)):
    if ids.shape != (b, n):
      raise ValueError(f"{name} must be [B, {'T' if n == t else 'S'}] = {(b, n)}, got "
                       f"{tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array (int32), got {ids.dtype}")
  return q_ids, kv_ids, ("shared" if q_ids is kv_ids else "separate")


def _validate(q, k, v, segment_ids, scale):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(x.shape) != 4:
      raise ValueError(f"{name} must be 4-D [B, N, H, D], got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
  b, t, h, dk = q.shape
  s = k.shape[1]
  if t == 0 or s == 0:
    raise ValueError(f"T = {t} and S = {s} must both be >= 1")
  if k.shape != (b, s, h, dk):
    raise ValueError(f"k must be [B, S, H, Dk] = [{b}, S, {h}, {dk}], got {tuple(k.shape)}")
  if v.shape[:3] != (b, s, h):
    raise ValueError(f"v must be [B, S, H, Dv] = [{b}, {s}, {h}, Dv], got {tuple(v.shape)}")
  if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
    raise ValueError(f"scale must be None or a positive float, got {scale!r}")
  return _split_segments(segment_ids, b, t, s)


def plan(q, k, v, *, segment_ids=None, causal: bool = True, impl: str | None = None,
         interpret: bool = False, q_offset=None) -> Plan:
  """The tier `attention` would use (arguments may be ShapeDtypeStructs)."""
  _, _, kind = _validate(q, k, v, segment_ids, None)

  def reason_of(name: str) -> str | None:
    if name == "reference":
      return None
    if q_offset is not None and name != "xla_blockwise":
      return "q_offset: only the reference and xla_blockwise tiers take a query offset"
    return KERNELS[name].supports(q, k, v, segments=kind, causal=bool(causal),
                                  interpret=interpret)

  return tiers.first_supported(_order(impl), reason_of, interpret)


def _kernel_max_logit(q, k, q_ids, kv_ids, *, causal: bool, scale: float,
                      interpret: bool = False) -> jax.Array:
  """The kernel tiers' per-head max logit [H]: `max_logit_triton` where it takes the call,
  else xla_blockwise's pass (the reason logged)."""
  reason = max_logit_triton.supports(q, k, causal=causal, interpret=interpret)
  if reason is None:
    return max_logit_triton.max_logit(q, k, q_ids, kv_ids, causal=causal, scale=scale,
                                      interpret=interpret)
  logging.info("attention: max_logit_triton declined (%s); using xla_blockwise", reason)
  return xla_blockwise.max_logit(q, k, q_ids, kv_ids, causal=causal, scale=scale)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
              segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
              causal: bool = True, scale: float | None = None, return_max_logit: bool = False,
              impl: str | None = None, interpret: bool = False, q_offset=None
              ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Masked softmax attention; see the module docstring.

  Args:
    q: [B, T, H, Dk]; k: [B, S, H, Dk]; v: [B, S, H, Dv] (floating).
    segment_ids: None, one integer [B, T] array for q and kv (T == S), or a pair
      (q [B, T], kv [B, S]).
    causal: query i sees keys j <= i.
    scale: logit scale, default Dk**-0.5.
    return_max_logit: also return the per-head max visible logit [H] fp32 (stop_gradient).
    impl: None (platform default) or one of IMPLS; a named kernel that declines falls
      through to xla_blockwise.
    interpret: run kernel tiers that have one in their interpreter (CPU tests of splash).
    q_offset: None, or an int / int32 scalar (may be traced): the causal position of query 0.

  Returns:
    o [B, T, H, Dv] in q's dtype, and the max logit [H] when asked.
  """
  q_ids, kv_ids, _ = _validate(q, k, v, segment_ids, scale)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  p = plan(q, k, v, segment_ids=segment_ids, causal=causal, impl=impl, interpret=interpret,
           q_offset=q_offset)
  offset = 0 if q_offset is None else q_offset
  for name, reason in p.declined:
    logging.info("attention: tier %s declined (%s); trying the next", name, reason)
  causal = bool(causal)
  if p.impl == "reference":
    o, max_logit = reference.attention(q, k, v, q_ids, kv_ids, causal=causal, scale=scale,
                                       q_offset=offset)
    o = o.astype(q.dtype)
  elif p.impl == "xla_blockwise":
    o, max_logit = xla_blockwise.attention(q, k, v, q_ids, kv_ids, causal=causal, scale=scale,
                                           q_offset=offset)
  else:
    o = KERNELS[p.impl].attention(q, k, v, q_ids, kv_ids, causal=causal, scale=scale,
                                  interpret=interpret)
    if not return_max_logit:
      return o
    max_logit = _kernel_max_logit(q, k, q_ids, kv_ids, causal=causal, scale=scale,
                                  interpret=interpret)
  if return_max_logit:
    return o, jax.lax.stop_gradient(max_logit)
  return o
