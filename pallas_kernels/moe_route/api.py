"""Public MoE routing (report Eq. 13, sigmoid scores with a selection-only bias) for the MoE
layer's experts, and for decoding, the token copies sorted by expert in the same call.

`route(logits [N, E], bias [E], k, scale=, normalize=, cutoffs=)` returns (weights [N, k]
fp32, experts [N, k] int32, scores [N, E] fp32[, cutoffs [N]]): s = sigmoid(logits), the top-k
of s + b (stop_gradient'ed), each pick's s, renormalised over the k (+1e-20) with `normalize`,
times `scale`; QB's cutoffs alpha, the (k+1)-th largest s + b (§2.3.3), with `cutoffs`.
Differentiable in the logits (the training path; the xla tier only).

`route_dense(logits, bias, k, scale=, normalize=)` returns `route`'s weights scattered over the
experts, [N, E] fp32 with 0 where an expert is not picked, the picks counted by rank (pairs of
experts compared, no top-k op): one or two XLA fusions where `route` takes the top-k kernel, a
gather and a normalisation; for decoding steps that run every expert (`latent_moe.all_experts`).
Differentiable in the logits.

`route_and_sort(logits, bias, k, scale=, normalize=)` returns (weights, experts, order,
inverse [N k] int32, group_sizes [E] int32): `route` then `pallas_kernels.expert_sort`'s sort.
Not differentiable (decoding). Tiers: "xla" (`xla.py`: the top-k op, XLA's gather and
normalisation, the sort op) and "triton" (one program, `triton.py`; few tokens and experts).
impl=None runs triton on a GPU while TRITON_IS_DEFAULT, else xla; a tier that declines falls
through to xla. `plan(...)` returns the tier and every reason a tier declined.
"""
import types

import jax
import jax.numpy as jnp

from pallas_kernels import tiers
from pallas_kernels.moe_route import triton
from pallas_kernels.moe_route import xla

IMPLS = ("xla", "triton")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton}
# Off: its GPU tests pass on an H100 (2026-12-07), but k3_small's decode loop with it was no
# faster (2.95 against 2.82-2.89 ms a token; benchmarks/decode.py --moe_route=triton).
TRITON_IS_DEFAULT = False
Plan = tiers.Plan


def default_impls() -> tuple[str, ...]:
  return ("triton", "xla") if TRITON_IS_DEFAULT and triton.is_gpu() else ("xla",)


def _check(logits, bias, top_k) -> None:
  if len(logits.shape) != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be a floating [N, E] array, got {logits.dtype}"
                     f"{list(logits.shape)}")
  e = logits.shape[1]
  if tuple(bias.shape) != (e,):
    raise ValueError(f"bias must have shape ({e},) (E from logits), got {tuple(bias.shape)}")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
    raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")


def plan(logits, top_k: int, *, impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `route_and_sort` would use (arrays or ShapeDtypeStructs)."""
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls()),
      lambda name: TIERS[name].supports(logits, top_k, interpret=interpret), interpret)


def route(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float = 1.0,
          normalize: bool = True, cutoffs: bool = False) -> tuple[jax.Array, ...]:
  """The router's weights, experts and scores (module docstring); cutoffs needs k < E."""
  _check(logits, bias, top_k)
  if cutoffs and top_k >= logits.shape[1]:
    raise ValueError(f"top_k must be < E={logits.shape[1]} with cutoffs (a (k+1)-th pick), "
                     f"got {top_k}")
  return xla.route(logits.astype(jnp.float32), bias, top_k, scale=float(scale),
                   normalize=bool(normalize), cutoffs=cutoffs)


def route_dense(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float = 1.0,
                normalize: bool = True) -> jax.Array:
  """`route`'s weights as [N, E] fp32, 0 where an expert is not picked (module docstring)."""
  _check(logits, bias, top_k)
  return xla.route_dense(logits.astype(jnp.float32), bias, top_k, scale=float(scale),
                         normalize=bool(normalize))


def route_and_sort(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float = 1.0,
                   normalize: bool = True, impl: str | None = None,
                   interpret: bool = False) -> tuple[jax.Array, ...]:
  """(weights, experts, order, inverse, group_sizes) of a decode step (module docstring)."""
  _check(logits, bias, top_k)
  p = plan(logits, top_k, impl=impl, interpret=interpret)
  kw = dict(scale=float(scale), normalize=bool(normalize))
  if p.impl == "triton":
    return triton.route_and_sort(logits, bias, top_k, interpret=p.interpret, **kw)
  return xla.route_and_sort(logits.astype(jnp.float32), bias, top_k, **kw)
