"""Context parallelism for long sequences (report §5.2): KDA and MLA across `context` ranks.

Each of the R ranks of the mesh axis `context` holds a contiguous slice of T / R tokens. The
token mixers run in a `jax.shard_map` manual over the token axes (batch over data and expert,
length over context, as `expert_parallel` splits them), so XLA never moves the batch inside.

KDA (kda.md §1, state S [K, V]): a slice maps the state entering it to the state leaving it
affinely, S_out = A S_in + B, with A [H, K, K] the product of the per-token transitions
(I - beta_t k_t k_t^T) Diag(alpha_t) and B [H, K, V] the final state from a zero start. Two
chunked passes over the slice give everything a rank needs, its outputs included:
  (o0, B) = chunk_kda(q, k, v, ...; S_in = 0),  (P, A) = chunk_kda(q, k, 0_K, ...; S_in = I_K),
so that P_t = A_{<=t}^T q_t (scaled) and, by linearity, o_t = o0_t + S_in^T P_t. One all-gather
of [A | B] [B, H, K, K + V] over `context`, a prefix combine in fp32 giving each rank its
entering state S_in, and the correction o0 + P S_in finish the layer: no second pass over the
tokens after the collective, and no gradient through an initial state. Document restarts are
exact: a reset inside a slice zeroes the whole state, the identity columns too, so A = 0 and
P_t = 0 past it; a reset at the slice's first token (its id differs from the previous rank's
last) zeroes the entering state. The short conv takes the previous rank's last W - 1 inputs
(and their segment ids) by a `ppermute`.

MLA: the latents [B, T / R, kr + dr] (576 values per token in K3) and the segment ids are
all-gathered over `context` instead of per-head K/V; each rank expands them and attends for its
own queries, causal at their global positions (`q_offset`); QK-Clip's per-head max logit is the
`pmax` over the token axes.

The shard_maps run with check_vma=False: the KDA and attention tiers start their loops from
constants (zero states, running maxima) that the varying-axes check rejects.
"""
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import attention as attention_op
from pallas_kernels import kda as kda_ops

CONTEXT = "context"
BATCH_AXES = ("data", "expert")  # the `activation_batch` axes of the configs
_HIGHEST = jax.lax.Precision.HIGHEST


def context_size() -> int:
  """Size of the ambient mesh's (`jax.set_mesh`) `context` axis when it is not manual, else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT not in mesh.axis_names or CONTEXT in mesh.manual_axes:
    return 1
  return mesh.shape[CONTEXT]


def _token_split(bsz: int, seq: int, min_slice: int = 1) -> tuple[P, tuple[str, ...]]:
  """(spec of [B, T, ...] arrays, manual axes) of the ambient mesh: B over the batch axes it
  has (not yet manual), T over `context`."""
  mesh = jax.sharding.get_abstract_mesh()
  batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in mesh.manual_axes)
  shards, size = math.prod(mesh.shape[a] for a in batch), mesh.shape[CONTEXT]
  if bsz % shards or seq % size or seq // size < min_slice:
    raise ValueError(f"context parallelism splits [B, T] = [{bsz}, {seq}] over mesh axes {batch} "
                     f"({shards}) and {CONTEXT} ({size}): both must divide, into slices of at "
                     f"least {min_slice} tokens")
  return P(batch or None, CONTEXT), batch + (CONTEXT,)


def local_pass(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               segment_ids: jax.Array | None, *, gate_bound: float | None, impl: str | None,
               use_qk_l2norm_in_kernel: bool = True
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """One slice's zero-start outputs and transition (report §5.2; `chunk_kda` layouts).

  q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; segment_ids: [B, T] or None.
  Returns o0 [B, T, H, V] (outputs from a zero entering state), p [B, T, H, K]
  (A_{<=t}^T q_t, scaled), a [B, H, K, K] and b [B, H, K, V] (fp32): S_out = a S_in + b.
  """
  bsz, _, h, dk = q.shape
  kw = dict(output_final_state=True, segment_ids=segment_ids, gate_bound=gate_bound, impl=impl,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
  o0, b = kda_ops.chunk_kda(q, k, v, g, beta, **kw)
  eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (bsz, h, dk, dk))
  p, a = kda_ops.chunk_kda(q, k, jnp.zeros(q.shape, v.dtype), g, beta, initial_state=eye, **kw)
  return o0, p, a, b


def prefix_state(ab: jax.Array, index: jax.Array) -> jax.Array:
  """The state entering slice `index` from a zero start, in fp32.

  ab: [R, B, H, K, K + V], slice j's map [A_j | B_j] (S_j = A_j S_{j-1} + B_j, its entry reset
  folded into A_j); index: int32 scalar. Returns the state leaving slice index - 1 [B, H, K, V].
  """
  dk = ab.shape[-2]
  ab = ab.astype(jnp.float32)
  s = jnp.zeros(ab.shape[1:-1] + (ab.shape[-1] - dk,), jnp.float32)
  for j in range(ab.shape[0]):
    nxt = jnp.einsum("bhkl,bhlv->bhkv", ab[j, ..., :dk], s, precision=_HIGHEST) + ab[j, ..., dk:]
    s = jnp.where(j < index, nxt, s)
  return s


def with_entry_state(o0: jax.Array, p: jax.Array, s_in: jax.Array) -> jax.Array:
  """o = o0 + S_in^T P per token: o0 [B, T, H, V], p [B, T, H, K], s_in [B, H, K, V] fp32."""
  corr = jnp.einsum("bthk,bhkv->bthv", p.astype(jnp.float32), s_in, precision=_HIGHEST)
  return (o0.astype(jnp.float32) + corr).astype(o0.dtype)


def _from_previous_rank(x: jax.Array, size: int) -> jax.Array:
  """Rank r of `context` receives rank r - 1's x; rank 0 receives zeros."""
  return jax.lax.ppermute(x, CONTEXT, [(i, i + 1) for i in range(size - 1)])


def kda_token_mix(pre: tuple[jax.Array, jax.Array, jax.Array],
                  conv_kernels: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array,
                  beta: jax.Array, segment_ids: jax.Array | None, *,
                  conv: Callable, gate_bound: float | None, impl: str | None) -> jax.Array:
  """KDA's conv, activations and recurrence with T split over `context` (report §5.2).

  pre: the q, k, v projections before the conv [B, T, H*K] (v: [B, T, H*V]); conv_kernels:
  [W, H*K] each; g: [B, T, H, K] log-decay; beta: [B, T, H]; segment_ids: [B, T] or None;
  conv: `k3jax.kda.short_conv`. Returns o [B, T, H, V] in q's dtype, equal to the recurrence over
  the whole sequence.
  """
  size = context_size()
  h = g.shape[2]
  width = conv_kernels[0].shape[0]
  seq, axes = _token_split(*g.shape[:2], min_slice=width - 1)
  has_ids = segment_ids is not None

  def local(g, beta, *rest):
    xs, kernels, ids = rest[:3], rest[3:6], (rest[6] if has_ids else None)
    bsz, n, _, dk = g.shape
    halo = _from_previous_rank(jnp.concatenate([x[:, n - width + 1:] for x in xs], -1), size)
    halo = jnp.split(halo, [xs[0].shape[-1], xs[0].shape[-1] + xs[1].shape[-1]], -1)
    if has_ids:
      prev_ids = _from_previous_rank(ids[:, n - width + 1:], size)
      ext_ids = jnp.concatenate([prev_ids, ids], 1)
      keep = (ids[:, 0] == prev_ids[:, -1]).astype(jnp.float32)[:, None, None, None]
    else:
      ext_ids, keep = None, 1.0
    q, k, v = (jax.nn.silu(conv(jnp.concatenate([hx, x], 1), w, ext_ids)[:, width - 1:])
               .reshape(bsz, n, h, -1) for hx, x, w in zip(halo, xs, kernels))
    o0, p, a, b = local_pass(q, k, v, g, beta, ids, gate_bound=gate_bound, impl=impl)
    ab = jax.lax.all_gather(jnp.concatenate([a * keep, b], -1), CONTEXT)
    return with_entry_state(o0, p, keep * prefix_state(ab, jax.lax.axis_index(CONTEXT)))

  args = (g, beta, *pre, *conv_kernels) + ((segment_ids,) if has_ids else ())
  specs = (seq,) * 5 + (P(),) * 3 + ((seq,) if has_ids else ())
  return jax.shard_map(local, in_specs=specs, out_specs=seq, axis_names=set(axes),
                       check_vma=False)(*args)


def mla_attention(q: jax.Array, lat: jax.Array, w_kv: jax.Array, segment_ids: jax.Array, *,
                  expand: Callable, scale: float, impl: str | None
                  ) -> tuple[jax.Array, jax.Array]:
  """Gated MLA's attention with T split over `context` (report §5.2).

  q: [B, T, H, dn + dr]; lat: [B, T, kr + dr] latents; w_kv: [kr, H, dn + dv]; segment_ids:
  [B, T]; expand: (latents, w_kv) -> (k [B, S, H, dn + dr], v [B, S, H, dv]). Returns
  (o [B, T, H, dv], per-head max logit [H]) as `pallas_kernels.attention` gives them.
  """
  seq, axes = _token_split(*q.shape[:2])

  def local(q, lat, ids, w_kv):
    k, v = expand(jax.lax.all_gather(lat, CONTEXT, axis=1, tiled=True), w_kv)
    all_ids = jax.lax.all_gather(ids, CONTEXT, axis=1, tiled=True)
    o, max_logit = attention_op.attention(
        q, k, v, segment_ids=(ids, all_ids), causal=True, scale=scale, return_max_logit=True,
        impl=impl, q_offset=jax.lax.axis_index(CONTEXT) * q.shape[1])
    return o, jax.lax.pmax(max_logit, axes)

  return jax.shard_map(local, in_specs=(seq, seq, seq, P()), out_specs=(seq, P()),
                       axis_names=set(axes), check_vma=False)(q, lat, segment_ids, w_kv)
