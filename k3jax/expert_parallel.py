"""Expert parallelism of the routed experts of Stable LatentMoE (report §2.3, §5; k3_techniques.md
§4, §11).

Inside `jax.shard_map` over the mesh's token axes (data, expert, context), every device routes
its own tokens [N_local, d] (`latent_moe.route`), sorts its N_local*k token copies by expert
and sends each copy to the rank of the `expert` axis that holds its expert (experts are
sharded over `expert`, E_local = E / R per rank, replicated over data and context): one
all-to-all over `expert` within each (data, context) row. The receiver runs its E_local experts
on what it received (`latent_moe.grouped_experts`: the same grouped matmuls and fused gate/up
kernel as one device), sends the rows back by the reverse all-to-all, and the source combines
each token's k copies with its routing weights (`latent_moe.combine`). Expert compute is never
replicated: each device runs its own experts on the copies of its data row only.

Buffers are static: a receiver holds `receive_rows` = ceil(ep_capacity_factor * N_local * k)
rows (rounded up to 8, at most the worst case), N_local * k being a rank's balanced load.
Copies past that bound are dropped (they add zero to their token) and counted in
aux["ep_dropped"]; the train step reports it as `moe/ep_dropped_copies`, and `check_dropped`
raises on the host, naming `model.moe.ep_capacity_factor`.

Communication is `jax.lax.ragged_all_to_all` on GPU and TPU; XLA:CPU has no ragged all-to-all,
so there `padded_ragged_all_to_all` (same semantics through a padded `jax.lax.all_to_all`)
takes its place. Both are differentiable (the ragged one's transpose is the reverse
ragged all-to-all). Quantile Balancing's counts are summed over every token axis (psum), so
the bias update equals the one of a single device (App. D: histogram counts add).
"""
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import config as config_lib
from k3jax import latent_moe

MODES = ("auto", "off")
ALL_TO_ALL = ("auto", "ragged", "padded")
EXPERT_AXIS = "expert"
TOKEN_AXES = ("data", "expert", "context")  # batch over (data, expert), length over context


class ExpertParallelOverflowError(config_lib.ConfigError):
  """A step dropped token copies past the expert-parallel receive buffer."""


def enabled(mode: str, mesh) -> bool:
  """Whether LatentMoE takes the expert-parallel path: mode "auto" and a mesh (the abstract
  mesh of `jax.set_mesh`) with an `expert` axis of size > 1."""
  if mode not in MODES:
    raise config_lib.ConfigError("model.moe.expert_parallel",
                                 f"got {mode!r}; allowed values: {list(MODES)}")
  return (mode == "auto" and not mesh.empty and EXPERT_AXIS in mesh.axis_names
          and mesh.shape[EXPERT_AXIS] > 1)


def all_to_all_impl(impl: str) -> str:
  """"ragged" or "padded" for `model.moe.ep_all_to_all` ("auto": ragged on GPU and TPU)."""
  if impl not in ALL_TO_ALL:
    raise config_lib.ConfigError("model.moe.ep_all_to_all",
                                 f"got {impl!r}; allowed values: {list(ALL_TO_ALL)}")
  if impl == "auto":
    return "padded" if jax.default_backend() == "cpu" else "ragged"
  return impl


def receive_rows(tokens_local: int, top_k: int, expert_ranks: int, experts_local: int,
                 capacity_factor: float) -> int:
  """Rows of a rank's receive buffer: ceil(capacity_factor * N_local * k) rounded up to a
  multiple of 8, at most the worst case N_local * min(k, E_local) * R (every source sending
  all its copies to one rank), which no routing can overflow."""
  if not capacity_factor > 0:
    raise config_lib.ConfigError("model.moe.ep_capacity_factor",
                                 f"must be > 0, got {capacity_factor!r}")
  worst = tokens_local * min(top_k, experts_local) * expert_ranks
  rows = 8 * math.ceil(math.ceil(capacity_factor * tokens_local * top_k) / 8)
  return min(rows, worst)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
  return jnp.cumsum(x) - x


def padded_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                             send_sizes: jax.Array, output_offsets: jax.Array,
                             recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
  """`jax.lax.ragged_all_to_all` with one slice per peer, through a padded all-to-all.

  operand [M, ...], output [M_out, ...], the four offset / size arrays [R] (R = the axis size):
  slice r, operand[input_offsets[r] : + send_sizes[r]], lands on peer r at its rows
  output_offsets[r] : + send_sizes[r]. Every peer's slice is padded to min(M, M_out) rows, so it
  moves R times the rows of the ragged collective: for backends without one (XLA:CPU).
  """
  del send_sizes  # equal to the peers' recv_sizes (the collective's contract)
  rows = min(operand.shape[0], output.shape[0])
  i = jnp.arange(rows, dtype=jnp.int32)
  src = input_offsets[:, None] + i
  send = jnp.take(operand, src.reshape(-1), axis=0, mode="clip").reshape(-1, rows,
                                                                        *operand.shape[1:])
  recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
  starts = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst = jnp.where(i < recv_sizes[:, None], starts[:, None] + i, output.shape[0])
  return output.at[dst.reshape(-1)].set(recv.reshape(-1, *operand.shape[1:]), mode="drop")


def exchange_sizes(group_sizes: jax.Array, capacity: int, axis_name: str
                   ) -> dict[str, jax.Array]:
  """Offsets and sizes of the dispatch all-to-all over the expert axis (R ranks).

  group_sizes [E] int32: this rank's copies per expert, sorted by expert, so the copies for
  rank r (experts r*E_local ... ) are one contiguous slice. Returns [R] arrays: input_offsets,
  send (kept) sizes, output_offsets (where each slice starts on its receiver), recv_offsets,
  recv (kept) sizes, source_offsets (where each received slice started on its source), and
  recv_counts [R, E_local] (copies per source and local expert, before the bound) and the
  dropped copies of this rank's sends. A receiver stores the slices source after source and
  keeps its first `capacity` rows.
  """
  ranks = jax.lax.axis_size(axis_name)
  counts = group_sizes.reshape(ranks, -1)
  send = jnp.sum(counts, axis=1)
  input_offsets = _exclusive_cumsum(send)
  recv_counts = jax.lax.all_to_all(counts, axis_name, 0, 0, tiled=True)
  recv_offsets = _exclusive_cumsum(jnp.sum(recv_counts, axis=1))
  output_offsets, source_offsets = jax.lax.all_to_all(
      jnp.stack([recv_offsets, input_offsets], axis=1), axis_name, 0, 0, tiled=True).T
  send_kept = jnp.clip(capacity - output_offsets, 0, send)
  recv_kept = jnp.clip(capacity - recv_offsets, 0, jnp.sum(recv_counts, axis=1))
  return dict(input_offsets=input_offsets, send_sizes=send_kept, output_offsets=output_offsets,
              recv_offsets=recv_offsets, recv_sizes=recv_kept, source_offsets=source_offsets,
              recv_counts=recv_counts, dropped=jnp.sum(send - send_kept))


def local_order(recv_counts: jax.Array, capacity: int) -> tuple[jax.Array, ...]:
  """The receive buffer [capacity] (source-major: source s, then local expert j) in expert
  order, without a sort.

  recv_counts [R, E_local] -> (order, inverse [capacity] int32, group_sizes [E_local] int32)
  as `latent_moe.sort_by_expert` gives for k = 1: only the first `capacity` rows count, the
  rows past the received ones stay last (no expert).
  """
  ranks, experts_local = recv_counts.shape
  starts = _exclusive_cumsum(recv_counts.reshape(-1))
  kept = jnp.clip(capacity - starts, 0, recv_counts.reshape(-1))
  by_expert = kept.reshape(ranks, experts_local).T.reshape(-1)
  expert_starts = _exclusive_cumsum(by_expert).reshape(experts_local, ranks).T.reshape(-1)
  ends = jnp.minimum(starts + kept, capacity)
  rows = jnp.arange(capacity, dtype=jnp.int32)
  segment = jnp.cumsum(jnp.zeros(capacity + 1, jnp.int32).at[ends].add(1))[:capacity]
  segment = jnp.minimum(segment, ranks * experts_local - 1)
  inverse = jnp.where(rows < jnp.sum(kept), expert_starts[segment] + rows - starts[segment],
                      rows).astype(jnp.int32)
  order = jnp.zeros_like(inverse).at[inverse].set(rows)
  return order, inverse, jnp.sum(kept.reshape(ranks, experts_local), axis=0)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """x marked as varying over `axes` where it is not yet: its cotangent is then psummed over
  them (the data-parallel reduction of a replicated parameter's gradient)."""
  missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def exchange_experts(z: jax.Array, weights: jax.Array, experts: jax.Array,
                     w1: latent_moe.ExpertWeight, w3: latent_moe.ExpertWeight,
                     w2: latent_moe.ExpertWeight, *, num_experts: int, capacity: int,
                     all_to_all: str, axes: tuple[str, ...], beta1: float, beta2: float,
                     ragged_dot: latent_moe.RaggedDot = jax.lax.ragged_dot,
                     gate_up_impl: str | None = "xla", gate_up_train: str = "kernel",
                     qat: bool = False) -> tuple[jax.Array, jax.Array]:
  """`latent_moe.routed_experts` of one device inside `jax.shard_map` (Eq. 11), its experts
  sharded over the `expert` axis.

  z [N_local, l], weights / experts [N_local, k] (global expert ids), w1/w3 [E_local, l, m],
  w2 [E_local, m, l] (or `latent_moe.PackedWeight`s) -> (u [N_local, l], copies of this device
  dropped past `capacity`).
  Copies sorted by expert go out in one all-to-all over `expert`; the receiver runs
  `latent_moe.grouped_experts` on its buffer [capacity, l] (`local_order` puts it in expert
  order) and the reverse all-to-all brings the rows back for `latent_moe.combine`. `axes`:
  the manual mesh axes, over which the buffers vary.
  """
  exchange = jax.lax.ragged_all_to_all if all_to_all == "ragged" else padded_ragged_all_to_all
  top_k = weights.shape[1]
  with jax.named_scope("moe_dispatch"):
    order, inverse, group_sizes = latent_moe.sort_by_expert(experts, num_experts)
    xs = latent_moe.dispatch(z, order, inverse, top_k)
    sizes = exchange_sizes(group_sizes, capacity, EXPERT_AXIS)
    received = exchange(xs, _varying(jnp.zeros((capacity, z.shape[1]), z.dtype), axes),
                        sizes["input_offsets"], sizes["send_sizes"], sizes["output_offsets"],
                        sizes["recv_sizes"], axis_name=EXPERT_AXIS)
    local, local_inverse, local_sizes = local_order(sizes["recv_counts"], capacity)
  ones = _varying(jnp.ones((capacity, 1), jnp.float32), axes)
  out = latent_moe.grouped_experts(received, ones, local, local_inverse, local_sizes, w1, w3,
                                   w2, beta1, beta2, ragged_dot, gate_up_impl, gate_up_train,
                                   qat=qat)
  with jax.named_scope("moe_combine"):
    back = exchange(out, _varying(jnp.zeros_like(xs), axes), sizes["recv_offsets"],
                    sizes["recv_sizes"], sizes["source_offsets"], sizes["send_sizes"],
                    axis_name=EXPERT_AXIS)
    u = latent_moe.combine(back, weights, order, inverse).astype(z.dtype)
  return u, sizes["dropped"]


def routed_moe(x: jax.Array, z: jax.Array, router_kernel: jax.Array, bias: jax.Array,
               w1: latent_moe.ExpertWeight, w3: latent_moe.ExpertWeight,
               w2: latent_moe.ExpertWeight, *, top_k: int, routed_scaling_factor: float,
               norm_topk_prob: bool, beta1: float, beta2: float, qb_num_bins: int,
               keep_scores: bool, capacity_factor: float, all_to_all: str = "auto",
               ragged_dot: latent_moe.RaggedDot = jax.lax.ragged_dot,
               gate_up_impl: str | None = "xla", gate_up_train: str = "kernel",
               qat: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Routing, routed experts and QB statistics of LatentMoE with experts over `expert`.

  x [B, T, d] (router input), z [B, T, l] (expert input), router_kernel [d, E], bias [E],
  w1/w3 [E, l, m], w2 [E, m, l] (or `latent_moe.PackedWeight`s, split over E alike)
  -> (u [B, T, l], aux) under the mesh of `jax.set_mesh`: B is split over (data, expert), T
  over context. aux: `latent_moe.routing_stats` summed over all devices (loads, qb_counts;
  qb_lo, qb_hi), ep_dropped (copies dropped past the receive buffers, all devices), and
  scores [B, T, E] when keep_scores. qat: MXFP8 expert inputs (`latent_moe.expert_input`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
  batch = tuple(a for a in ("data", EXPERT_AXIS) if a in axes)
  length = tuple(a for a in ("context",) if a in axes)
  bsz, seq, _ = x.shape
  batch_shards = math.prod(mesh.shape[a] for a in batch)
  length_shards = math.prod(mesh.shape[a] for a in length)
  if bsz % batch_shards or seq % length_shards:
    raise ValueError(f"expert parallelism splits the batch [B, T] = [{bsz}, {seq}] over mesh "
                     f"axes {batch} ({batch_shards}) and {length} ({length_shards}): both must "
                     f"divide; change `mesh` or set `model.moe.expert_parallel` = 'off'")
  num_experts = router_kernel.shape[1]
  ranks = mesh.shape[EXPERT_AXIS]
  if num_experts % ranks:
    raise ValueError(f"`mesh.expert` = {ranks} does not divide `model.moe.num_experts` = "
                     f"{num_experts}")
  tokens_local = bsz // batch_shards * (seq // length_shards)
  experts_kw = dict(
      num_experts=num_experts, axes=axes, all_to_all=all_to_all_impl(all_to_all),
      capacity=receive_rows(tokens_local, top_k, ranks, num_experts // ranks, capacity_factor),
      beta1=beta1, beta2=beta2, ragged_dot=ragged_dot, gate_up_impl=gate_up_impl,
      gate_up_train=gate_up_train, qat=qat)

  def local(x, z, router_kernel, bias, w1, w3, w2):
    xf, zf = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])
    w1, w3, w2 = jax.tree.map(lambda w: _varying(w, axes), (w1, w3, w2))
    with jax.named_scope("moe_routing"):
      weights, experts, scores, cutoffs = latent_moe.route(
          xf, _varying(router_kernel, axes), bias, top_k, routed_scaling_factor,
          norm_topk_prob, return_cutoffs=True)
    u, dropped = exchange_experts(zf, weights, experts, w1, w3, w2, **experts_kw)
    with jax.named_scope("moe_stats"):
      aux = latent_moe.routing_stats(scores, experts, bias, cutoffs, top_k, qb_num_bins)
      aux["loads"], aux["qb_counts"], aux["ep_dropped"] = jax.lax.psum(
          (aux["loads"], aux["qb_counts"], dropped), axes)
    if keep_scores:
      aux["scores"] = jax.lax.stop_gradient(scores).reshape(*x.shape[:2], -1)
    return u.reshape(*z.shape[:2], -1), aux

  tokens = P(batch, length, None)
  aux_specs = dict(loads=P(), qb_counts=P(), qb_lo=P(), qb_hi=P(), ep_dropped=P())
  if keep_scores:
    aux_specs["scores"] = tokens
  experts_spec = P(EXPERT_AXIS, None, None)
  return jax.shard_map(
      local, mesh=mesh, axis_names=set(axes),
      in_specs=(tokens, tokens, P(), P(), experts_spec, experts_spec, experts_spec),
      out_specs=(tokens, aux_specs))(x, z, router_kernel, bias, w1, w3, w2)


def check_dropped(metrics: dict[str, float]) -> None:
  """Raises `ExpertParallelOverflowError` when a step's metrics report dropped token copies."""
  dropped = metrics.get("moe/ep_dropped_copies", 0)
  if dropped:
    raise ExpertParallelOverflowError(
        "model.moe.ep_capacity_factor",
        f"expert parallelism dropped {int(dropped)} token copies past the receive buffers; "
        f"raise it (receive rows = factor * tokens per device * top-k; expert ranks * "
        f"min(top-k, experts per rank) / top-k never drops)")
