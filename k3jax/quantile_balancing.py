"""Quantile Balancing of the MoE expert bias (report §2.3.3, App. C-D; k3_techniques.md §5).

Routing is T_i = argtop_k(s_i + b) (Eq. 13). After each step the bias is re-solved from that
step's scores: with token cutoffs alpha_i (the (k+1)-th value of s_i + b), expert j takes token i
iff b_j > r_ij := alpha_i - s_ij, so the bias that gives expert j exactly q = m*k/n tokens is a
quantile of r_{:, j}. This is exact coordinate minimisation of the dual of the balanced
assignment LP (App. C); it has no step size. The new bias is used from the next step on.

Notation: scores s [m, n] (m tokens, n experts, fp32 sigmoid scores), bias b [n], top-k k.
All functions are pure and jit-able; `k`, `num_bins` and the shapes are static.
"""
import math

import jax
import jax.numpy as jnp

from pallas_kernels import top_k as top_k_op


def _check_scores(scores: jax.Array, bias: jax.Array, k: int) -> None:
  if scores.ndim != 2:
    raise ValueError(f"scores must be [m, n], got shape {scores.shape}")
  n = scores.shape[1]
  if bias.shape != (n,):
    raise ValueError(f"bias must have shape ({n},) to match scores {scores.shape}, "
                     f"got {bias.shape}")
  if not 1 <= k < n:
    raise ValueError(f"k must satisfy 1 <= k < n = {n} (top-(k+1) is taken), got {k}")


def center(b_hat: jax.Array) -> jax.Array:
  """b_hat - mean(b_hat): a common offset does not change top-k (QB step 4)."""
  return b_hat - jnp.mean(b_hat)


def token_cutoffs(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
  """alpha [m]: the (k+1)-th largest value of s_i + b (QB step 1)."""
  _check_scores(scores, bias, k)
  biased = scores.astype(jnp.float32) + bias.astype(jnp.float32)
  return top_k_op.top_k(biased, k + 1)[0][:, k]


def exact_targets(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
  """Uncentred b_hat [n] = -[(q+1)-th largest of M_{:, j}], M = s - alpha[:, None] (QB steps 2-3).

  With the cutoffs alpha fixed, exactly q tokens then satisfy s_ij + b_hat_j > alpha_i
  (tie-free scores, integer q = m*k/n). For non-integer q the rank q+1 is fractional and
  b_hat interpolates linearly between the (floor(q)+1)-th and (floor(q)+2)-th largest
  margins, so b_hat is continuous in q and reduces to the report's rule for integer q.
  """
  m, n = scores.shape
  s = scores.astype(jnp.float32)
  margins = s - token_cutoffs(scores, bias, k)[:, None]
  q = m * k / n
  f = math.floor(q)
  frac = q - f
  desc = -jnp.sort(-margins, axis=0)
  upper = desc[f]
  lower = desc[min(f + 1, m - 1)]
  return -(upper + frac * (lower - upper))


def exact_update(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
  """New bias [n] from one batch by the exact sort-based rule (QB steps 1-4)."""
  return center(exact_targets(scores, bias, k))


def histogram_range(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(lo, hi) = (min b - 1, max b + 1): contains every r_ij because s, alpha - b in (0, 1).

  The range depends only on the bias, so every shard and micro-batch of a step bins the
  required biases identically and their counts add.
  """
  b = bias.astype(jnp.float32)
  return jnp.min(b) - 1.0, jnp.max(b) + 1.0


def histogram_counts(scores: jax.Array, bias: jax.Array, k: int, num_bins: int,
                     cutoffs: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Histogram of the required bias r = alpha - s per expert (App. D).

  Returns (counts [n, num_bins] int32, lo, hi). Counts from different shards or micro-batches
  routed with the same bias can be summed (psum over DP/EP, sum over grad-accum). `cutoffs`
  [m]: alpha when the router already has it (`latent_moe.route(..., return_cutoffs=True)`
  takes one top-(k+1) for both); otherwise `token_cutoffs`.
  """
  if num_bins < 1:
    raise ValueError(f"num_bins must be >= 1, got {num_bins}")
  n = scores.shape[1]
  if cutoffs is None:
    alpha = token_cutoffs(scores, bias, k)
  elif cutoffs.shape != scores.shape[:1]:
    raise ValueError(f"cutoffs must have shape ({scores.shape[0]},), got {cutoffs.shape}")
  else:
    alpha = cutoffs.astype(jnp.float32)
  r = alpha[:, None] - scores.astype(jnp.float32)
  lo, hi = histogram_range(bias)
  width = (hi - lo) / num_bins
  bins = jnp.clip(jnp.floor((r - lo) / width).astype(jnp.int32), 0, num_bins - 1)
  ids = jnp.arange(n, dtype=jnp.int32)[None, :] * num_bins + bins
  counts = jax.ops.segment_sum(jnp.ones(ids.size, jnp.int32), ids.reshape(-1),
                               num_segments=n * num_bins)
  return counts.reshape(n, num_bins), lo, hi


def histogram_targets(counts: jax.Array, lo: jax.Array, hi: jax.Array,
                      num_tokens: jax.Array | int, k: int) -> jax.Array:
  """Uncentred b_hat [n]: the point where expert j's binned CDF of r reaches q = m*k/n.

  The CDF is interpolated linearly inside a bin, so b_hat lies in the bin that holds the
  ceil(q)-th smallest r_{:, j}: within one bin width of the exact solution interval
  [q-th, (q+1)-th smallest r] (App. D).
  """
  if counts.ndim != 2:
    raise ValueError(f"counts must be [n, num_bins], got shape {counts.shape}")
  n, num_bins = counts.shape
  if not 1 <= k < n:
    raise ValueError(f"k must satisfy 1 <= k < n = {n}, got {k}")
  q = jnp.asarray(num_tokens, jnp.float32) * (k / n)
  width = (hi - lo) / num_bins
  cum = jnp.cumsum(counts, axis=1)
  jb = jnp.argmax(cum.astype(jnp.float32) >= q, axis=1)
  rows = jnp.arange(n)
  h = counts[rows, jb].astype(jnp.float32)
  c0 = cum[rows, jb].astype(jnp.float32) - h
  frac = jnp.clip((q - c0) / jnp.maximum(h, 1.0), 0.0, 1.0)
  return lo + (jb.astype(jnp.float32) + frac) * width


def histogram_update(counts: jax.Array, lo: jax.Array, hi: jax.Array,
                     num_tokens: jax.Array | int, k: int) -> jax.Array:
  """New bias [n] from (summed) histogram counts of `num_tokens` tokens (App. D)."""
  return center(histogram_targets(counts, lo, hi, num_tokens, k))


def sign_update(loads: jax.Array, bias: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free rule b += rate * sign(mean load - load), for comparison."""
  if loads.shape != bias.shape:
    raise ValueError(f"loads {loads.shape} and bias {bias.shape} must have the same shape")
  l = loads.astype(jnp.float32)
  return (bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(l) - l)).astype(bias.dtype)


def load_stats(loads: jax.Array) -> dict[str, jax.Array]:
  """Balance statistics of per-expert token counts [n]: max/mean, min/mean, std/mean (cv)."""
  l = loads.astype(jnp.float32)
  mean = jnp.maximum(jnp.mean(l), jnp.finfo(jnp.float32).tiny)
  return dict(max_over_mean=jnp.max(l) / mean, min_over_mean=jnp.min(l) / mean,
              cv=jnp.std(l) / mean)
