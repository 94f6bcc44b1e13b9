"""Public decode attention of absorbed MLA over the filled part of the latent cache (report §2.1:
decoding uses the absorbed form, MQA over the 576-value cache [RMSNorm(c) | k_rope]).

`decode_attention(q [B, T, H, Dk], cache [B, S, Dk], lengths [B], v_dim=, scale=)` -> o
[B, T, H, v_dim]: multi-query attention with one shared key/value row per cache position, keys
cache[..., :Dk] and values cache[..., :v_dim] (the first v_dim channels of the same rows, the
latent c of absorbed MLA). Row b attends only to positions s < lengths[b]; its T new tokens
(T > 1: speculative or chunked decoding) attend causally: query t sits at position
lengths[b] - T + t, or at q_positions[b, t] when given, and sees s <= its position. lengths are
clipped to [0, S]. A query that sees no position (a row of length 0, a position below 0) gets
o = 0. fp32 softmax and accumulation; o comes in q's dtype. Positions at or past lengths[b]
must hold finite values (zeros from `init_cache`, or older tokens): they get probability 0, but
0 times NaN is NaN in the tiers that read them with a block.

Tiers ("impl"): "reference" (the masked softmax written out over the whole S: the oracle),
"xla" (blockwise online softmax in plain JAX over the blocks up to max(lengths): any platform),
"mosaic_gpu" (Hopper flash-decoding kernel: splits of the filled context per CTA, partials merged
by XLA), "mosaic_tpu" (Pallas TPU kernel with scalar-prefetched lengths: blocks past a row's
length are neither copied nor computed; imported when asked for). impl=None is the platform
default (`default_impls`): mosaic_gpu then "xla" on Hopper, where its GPU tests passed
(H200, 2026-12-02), "xla" elsewhere (mosaic_tpu joins once its tests run on a TPU). A named kernel that declines a call (`supports` gives
the reason) falls through to "xla" (fail closed), and every decline is logged; `plan(...)`
returns the choice. `interpret=True` runs the kernel tiers in their interpreters (CPU tests).
"""
import importlib
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tiers
from pallas_kernels.decode_attention import reference
from pallas_kernels.decode_attention import xla

IMPLS = ("reference", "xla", "mosaic_gpu", "mosaic_tpu")
Plan = tiers.Plan


def default_impls() -> tuple[str, ...]:
  """Tier order for impl=None: mosaic_gpu then xla on Hopper (GPU tests 8/8 on the H200,
  2026-12-02; 1.4-9x the xla tier's device time at B 1-16, S 4k-128k), "xla" elsewhere
  (mosaic_tpu has run only in the TPU interpreter and deviceless compiles)."""
  if _tier("mosaic_gpu").is_hopper():
    return ("mosaic_gpu", "xla")
  return ("xla",)


def _tier(name: str) -> types.ModuleType:
  """The tier's module, imported on first use (mosaic_tpu only when asked for)."""
  if name == "reference":
    return reference
  return importlib.import_module(f"pallas_kernels.decode_attention.{name}")


def _validate(q, cache, lengths, v_dim, q_positions) -> None:
  """ValueError naming the first argument that does not fit."""
  if len(q.shape) != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be a floating [B, T, H, Dk] array, got shape {tuple(q.shape)} and "
                     f"dtype {q.dtype}")
  b, t, h, dk = q.shape
  if min(b, t, h, dk) == 0:
    raise ValueError(f"q must have B, T, H, Dk >= 1, got shape {tuple(q.shape)}")
  if (len(cache.shape) != 3 or not jnp.issubdtype(cache.dtype, jnp.floating)
      or cache.shape[0] != b or cache.shape[2] != dk or cache.shape[1] == 0):
    raise ValueError(f"cache must be a floating [B, S, Dk] = [{b}, S >= 1, {dk}] array, got "
                     f"shape {tuple(cache.shape)} and dtype {cache.dtype}")
  if tuple(lengths.shape) != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer [B] = ({b},) array, got shape "
                     f"{tuple(lengths.shape)} and dtype {lengths.dtype}")
  if isinstance(v_dim, bool) or not isinstance(v_dim, (int, np.integer)) or not 1 <= v_dim <= dk:
    raise ValueError(f"v_dim must be an int in [1, Dk] = [1, {dk}], got {v_dim!r}")
  if q_positions is not None and (tuple(q_positions.shape) != (b, t)
                                  or not jnp.issubdtype(q_positions.dtype, jnp.integer)):
    raise ValueError(f"q_positions must be None or an integer [B, T] = ({b}, {t}) array, got "
                     f"shape {tuple(q_positions.shape)} and dtype {q_positions.dtype}")


def plan(q, cache, lengths, *, v_dim: int, q_positions=None, impl: str | None = None,
         interpret: bool = False) -> Plan:
  """The tier `decode_attention` would use (arguments may be ShapeDtypeStructs)."""
  _validate(q, cache, lengths, v_dim, q_positions)

  def reason_of(name: str) -> str | None:
    return _tier(name).supports(q, cache, lengths, v_dim=int(v_dim), q_positions=q_positions,
                                interpret=interpret)

  return tiers.first_supported(tiers.order(impl, IMPLS, default_impls()), reason_of, interpret)


def positions(lengths: jax.Array, t: int, q_positions: jax.Array | None) -> jax.Array:
  """[B, T] int32 query positions: q_positions, else lengths[b] - T + t."""
  if q_positions is not None:
    return q_positions.astype(jnp.int32)
  return lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]


def decode_attention(q: jax.Array, cache: jax.Array, lengths: jax.Array, *, v_dim: int,
                     scale: float, q_positions: jax.Array | None = None, impl: str | None = None,
                     interpret: bool = False) -> jax.Array:
  """Absorbed-MLA decode attention over the filled cache; see the module docstring.

  Args:
    q: [B, T, H, Dk] floating: the T new tokens' queries (absorbed MLA: [W_UK q_nope | q_rope]).
    cache: [B, S, Dk] floating: the latent cache, keys all Dk channels, values the first v_dim.
    lengths: [B] integer: filled positions per row (clipped to [0, S]).
    v_dim: value channels (static int in [1, Dk]).
    scale: logit scale (a positive float).
    q_positions: None, or [B, T] integer positions of the queries (default lengths[b] - T + t).
    impl: None (platform default) or one of IMPLS; a named kernel that declines falls through
      to "xla".
    interpret: run the kernel tiers in their interpreters (CPU tests).

  Returns:
    o [B, T, H, v_dim] in q's dtype.
  """
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < np.inf:
    raise ValueError(f"scale must be a positive finite float, got {scale!r}")
  p = plan(q, cache, lengths, v_dim=v_dim, q_positions=q_positions, impl=impl,
           interpret=interpret)
  for name, reason in p.declined:
    logging.info("decode_attention: tier %s declined (%s); trying the next", name, reason)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, cache.shape[1])
  pos = positions(lengths, q.shape[1], q_positions)
  kwargs = dict(v_dim=int(v_dim), scale=float(scale))
  if p.impl in ("mosaic_gpu", "mosaic_tpu"):
    kwargs["interpret"] = interpret
  o = _tier(p.impl).decode_attention(q, cache, lengths, pos, **kwargs)
  return o.astype(q.dtype)
