"""XLA tier (the reference): the router's selection (report Eq. 13) and `expert_sort`'s sort.

  s = sigmoid(logits);  T = argtop_k(s + b) (`pallas_kernels.top_k`);
  p_j = s_j / (sum_{r in T} s_r + 1e-20) * scale (without `normalize`: s_j * scale).
"""
import jax
import jax.numpy as jnp

from pallas_kernels import expert_sort
from pallas_kernels import top_k as top_k_op
from pallas_kernels.top_k import triton as top_k_triton


def supports(logits, top_k: int, *, interpret: bool = False) -> str | None:
  del logits, top_k, interpret
  return None


def route(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float, normalize: bool,
          cutoffs: bool = False) -> tuple[jax.Array, ...]:
  """logits [N, E] fp32 -> (weights [N, k] fp32, experts [N, k] int32, scores [N, E] fp32),
  with QB's token cutoffs alpha [N] fp32 appended when `cutoffs` (the (k+1)-th largest
  s + b, from the same top-(k+1) as the selection). The selection sees s + b through
  stop_gradient; the weights are differentiable in the logits."""
  scores = jax.nn.sigmoid(logits)
  sel = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))
  picked, experts = top_k_op.top_k(sel, top_k + 1 if cutoffs else top_k)
  experts = experts[:, :top_k].astype(jnp.int32)
  weights = jnp.take_along_axis(scores, experts, axis=1)
  if normalize:
    weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
  out = (weights * scale, experts, scores)
  return out + (picked[:, top_k],) if cutoffs else out


def route_dense(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float,
                normalize: bool) -> jax.Array:
  """`route`'s weights scattered over the experts, logits [N, E] fp32 -> p [N, E] fp32 (0 where
  an expert is not picked), without a top-k: expert e is picked iff fewer than k experts come
  before it in `top_k`'s order (larger s + b first, IEEE total order, ties to the lower
  column), counted over all pairs [N, E, E] in one fusion. The normaliser sums the picks in
  column order (`route` in pick order: ~1 ulp apart)."""
  scores = jax.nn.sigmoid(logits)
  key = top_k_triton.total_order_key(jax.lax.stop_gradient(scores + bias.astype(jnp.float32)))
  col = jnp.arange(logits.shape[1])
  other, this = key[:, None, :], key[:, :, None]           # [N, e, j]
  ahead = (other > this) | ((other == this) & (col[None, :] < col[:, None]))
  picked = jnp.sum(ahead, axis=2, dtype=jnp.int32) < top_k
  weights = jnp.where(picked, scores, 0.0)
  if normalize:
    weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
  return weights * scale


def route_and_sort(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float,
                   normalize: bool) -> tuple[jax.Array, ...]:
  """`route`'s weights and experts, then the copies sorted by expert: (weights [N, k] fp32,
  experts [N, k] int32, order, inverse [N k] int32, group_sizes [E] int32)."""
  weights, experts, _ = route(logits, bias, top_k, scale=scale, normalize=normalize)
  return (weights, experts) + tuple(expert_sort.sort_by_expert(experts, logits.shape[1]))
