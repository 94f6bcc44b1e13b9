"""Pipeline parallelism over the mesh axis `pipeline`: 1F1B in one SPMD program ([TR] §5.2).

Placement (S stages, M micro-batches = `train.grad_accum_steps`; `describe` prints it):
- The scanned units (`model.scan_plan`: U units of p layers) are split into S runs of U / S;
  stage s runs units [s U/S, (s+1) U/S). Their parameters, stacked [U, ...] at call time
  (`K3ForCausalLM.unit_states`), enter a `jax.shard_map` manual over `pipeline` only (the
  other mesh axes stay with XLA's partitioner) with spec P("pipeline") on the unit axis. At
  rest each scanned layer's parameters and optimizer moments are split over `pipeline` along
  one of their own axes (`param_shardings`), so a device stores 1/S of the layer stack; the
  step's all-to-all over `pipeline` hands each stage its units (and their gradients back), the
  price of storing parameters per layer.
- Stage 0 owns the embedding and the leading irregular layers; stage S-1 the trailing ones,
  the output AttnRes mix, the final norm, the LM head + CE and the MTP layer + its CE. Their
  parameters enter replicated over `pipeline`, their gradients are summed over it. Every stage
  computes these parts and only the owner keeps the result: a conditional whose branch differs
  between stages cannot hold the collectives XLA places inside them (data, expert axes); a
  device waits in them for the devices of the other stage. In lockstep the owner's part is on
  the critical path anyway, so the cost is the other part: every tick holds stage 0's part
  (forward, recomputed forward and backward) and the last stage's (forward and backward).
- A stage boundary lies on an AttnRes block boundary (K3: stages must not split a block,
  k3_techniques.md §3), so what crosses it is the completed blocks: the first k block slots
  of the buffer (k the blocks completed before the last stage) and the partial sum, which is
  the last block, [k + 1, mb, T, d] in all; the count is static per stage and rebuilt by the
  receiver. `jax.lax.ppermute` sends it to stage s + 1 and its cotangent to s - 1.

Schedule (lockstep 1F1B, `Layout.forward_microbatch` / `backward_microbatch`): ticks t = 0 ..
M + 2S - 3, each a forward slot then a backward slot on every stage. Stage s runs the forward
of micro-batch t - s and the backward of micro-batch t - (2S - 2 - s); the last stage forms the
loss and its gradient in its forward slot, so its backward follows in the same tick. The first
S - 1 ticks skip the backward slot and the last S - 1 the forward slot (a conditional on t,
taken alike by every device), so the time is (M + S - 1)(F + B): bubble (S - 1)/(M + S - 1).
The backward is written out: `jax.vjp` of the stage's units per micro-batch in the forward
slot, its residuals kept in a buffer of 2S - 1 slots (the stage's parameters once, not per
slot; with `model.remat` = "none" also what the units derive from them, e.g. [W1 | W3], per
slot) and its pullback called in the backward slot. Stage s holds the residuals of at most
2(S - 1 - s) + 1 micro-batches (2S - 1 on stage 0, independent of M): in one SPMD program each
hop between stages takes a whole tick, where an event-driven 1F1B holds S - s. Stage 0
recomputes the embedding and leading layers in its backward slot instead of storing them.
The shard_map is never differentiated, so it runs without `check_vma` (the model's scans start
from constants that are not marked as varying over `pipeline`).
"""
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import config as config_lib
from k3jax import model as model_lib
from k3jax import muon, sharding

PIPELINE = "pipeline"


def num_stages() -> int:
  """Size of the ambient mesh's (`jax.set_mesh`) `pipeline` axis when it is not manual, else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or PIPELINE not in mesh.axis_names or PIPELINE in mesh.manual_axes:
    return 1
  return mesh.shape[PIPELINE]


@dataclasses.dataclass(frozen=True)
class Layout:
  """The stages' share of the layers and the 1F1B schedule of M micro-batches over S stages."""
  plan: model_lib.ScanPlan
  num_layers: int
  block_size: int
  mtp: bool
  remat: str
  stages: int
  microbatches: int

  def forward_microbatch(self, tick, stage):
    """The micro-batch whose forward the stage runs at the tick (valid in [0, M))."""
    return tick - stage

  def backward_microbatch(self, tick, stage):
    """The micro-batch whose backward the stage runs at the tick (valid in [0, M))."""
    return tick - (2 * self.stages - 2 - stage)

  @property
  def units_per_stage(self) -> int:
    return self.plan.units // self.stages

  def entry_layer(self, stage: int) -> int:
    """First layer of the stage's units."""
    return self.plan.layer(stage * self.units_per_stage, 0)

  def blocks_before(self, layer: int) -> int:
    """AttnRes blocks completed when `layer` starts (layers 0, b, 2b, ... push one each)."""
    return -(-layer // self.block_size)

  @property
  def sent_blocks(self) -> int:
    """Block slots that cross a stage boundary (those completed before the last stage)."""
    return self.blocks_before(self.entry_layer(self.stages - 1)) if self.block_size else 0

  @property
  def ticks(self) -> int:
    return self.microbatches + 2 * self.stages - 2

  @property
  def slots(self) -> int:
    """Micro-batches whose residuals a stage keeps at once (stage 0 needs them all)."""
    return 2 * self.stages - 1

  @property
  def bubble(self) -> float:
    return (self.stages - 1) / (self.microbatches + self.stages - 1)

  def describe(self) -> str:
    """Where each part runs, the schedule and its bubble fraction."""
    s, m, plan, u = self.stages, self.microbatches, self.plan, self.units_per_stage
    lines = [f"pipeline: {s} stages, 1F1B over {m} micro-batches (train.grad_accum_steps); "
             f"bubble (S-1)/(M+S-1) = {s - 1}/{m + s - 1} = {100 * self.bubble:.1f}%"]
    for k in range(s):
      parts = []
      if k == 0:
        parts.append("embedding")
        if plan.start:
          parts.append(f"layers 0-{plan.start - 1} (unrolled)")
      first, last = self.entry_layer(k), self.entry_layer(k) + u * plan.period - 1
      parts.append(f"units {k * u}-{(k + 1) * u - 1} = layers {first}-{last} (scanned)")
      if k == s - 1:
        if plan.stop < self.num_layers:
          parts.append(f"layers {plan.stop}-{self.num_layers - 1} (unrolled)")
        parts.append(("output AttnRes mix, " if self.block_size else "") + "final norm, "
                     "LM head + CE" + (", MTP layer + CE" if self.mtp else ""))
      lines.append(f"  stage {k}: " + "; ".join(parts))
    carry = (f"AttnRes blocks 0-{self.sent_blocks - 1} and the partial sum, "
             f"[{self.sent_blocks + 1}, mb, T, d]" if self.block_size
             else "the residual stream [mb, T, d]")
    lines.append(f"  between stages: {carry} (ppermute); residuals of at most 2(S-1-s)+1 "
                 f"micro-batches on stage s ({self.slots} slots)")
    return "\n".join(lines)


def layout(model_cfg: ml_collections.ConfigDict, stages: int, microbatches: int) -> Layout:
  """The Layout of `stages` stages; a config the pipeline cannot split raises ConfigError."""
  if not model_cfg.scan_layers:
    raise config_lib.ConfigError("model.scan_layers", f"mesh.pipeline={stages} splits the "
                                 "scanned units between stages; set it to True")
  plan = model_lib.scan_plan(model_cfg)
  if plan is None:
    raise config_lib.ConfigError("model.num_layers", "no repeating unit of layers "
                                 f"(model.scan_plan) to split over mesh.pipeline={stages}")
  if plan.units % stages:
    raise config_lib.ConfigError(
        "mesh.pipeline", f"{stages} stages do not divide the {plan.units} scanned units (layers "
        f"{plan.start}-{plan.stop - 1} in units of {plan.period}); use a divisor of {plan.units}")
  lay = Layout(plan, model_cfg.num_layers, model_cfg.attn_res_block_size,
               bool(model_cfg.mtp_num_layers), model_cfg.remat, stages, microbatches)
  for k in range(1, stages):
    if lay.block_size and lay.entry_layer(k) % lay.block_size:
      raise config_lib.ConfigError(
          "model.attn_res_block_size", f"stage {k} of mesh.pipeline={stages} starts at layer "
          f"{lay.entry_layer(k)}, inside a block of {lay.block_size} layers; pipeline stages "
          "must start on a block boundary")
  return lay


def describe(cfg: ml_collections.ConfigDict) -> str:
  """`Layout.describe` of a run's config (`mesh.pipeline` stages, `train.grad_accum_steps`)."""
  return layout(cfg.model, cfg.mesh.pipeline, cfg.train.grad_accum_steps).describe()


def param_shardings(shardings, params, model_cfg: ml_collections.ConfigDict, mesh):
  """The parameters' storage shardings with each scanned layer's leaves also split over
  `pipeline`: on a Muon batch axis (heads, experts: no collective in Newton-Schulz) if one
  divides, else on the largest axis that divides; a leaf no axis of which divides stays whole."""
  stages = dict(mesh.shape).get(PIPELINE, 1)
  if stages == 1:
    return shardings
  plan = layout(model_cfg, stages, 1).plan

  def one(path, sh, x):
    if path[0].key != "layers" or not plan.scanned(path[1].key):
      return sh
    spec = list(sh.spec) + [None] * (x.ndim - len(sh.spec))
    axes = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]
    if any(PIPELINE in a for a in axes):
      return sh
    dims = muon.resolve(muon.path_str(path), x.shape).dims
    used = set() if dims is None else {
        a for entry in (dims.reduction_axis, dims.output_axis)
        for a in ((entry,) if isinstance(entry, int) else entry)}
    order = sorted(range(x.ndim), key=lambda d: (d in used, -x.shape[d]))
    for d in order:
      if x.shape[d] % (sharding.num_shards(mesh, spec[d]) * stages) == 0:
        spec[d] = axes[d] + (PIPELINE,) if axes[d] else PIPELINE
        return NamedSharding(mesh, P(*spec))
    return sh
  return jax.tree_util.tree_map_with_path(one, shardings, params)


def _zeros(tree):
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _select(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _residuals(vjp_fn, invariant: list) -> tuple[list, tuple]:
  """The residual leaves of a pullback that are not `invariant` leaves (the stage's parameters
  and other values alike for every micro-batch, kept once), and how to rebuild it
  (`_pullback`)."""
  leaves, treedef = jax.tree.flatten(vjp_fn)
  index = {id(x): k for k, x in enumerate(invariant)}
  refs = tuple(index.get(id(x)) for x in leaves)
  return [x for x, r in zip(leaves, refs) if r is None], (treedef, refs)


def _pullback(kept: list, structure: tuple, invariant: list):
  treedef, refs = structure
  kept = iter(kept)
  return jax.tree.unflatten(treedef, [next(kept) if r is None else invariant[r] for r in refs])


def _with_units(tree: dict, units: dict) -> dict:
  """`tree` with the scanned layers' entries `units` put back under "layers"."""
  return {**tree, "layers": {**tree["layers"], **units}} if units else tree


def accumulated_grads(params, buffers, graphdef, batch: dict[str, jax.Array], steps: int, *,
                      head_loss: Callable, merge_layer_aux: Callable):
  """`k3jax.train.accumulated_grads` through the 1F1B pipeline over the ambient mesh's stages.

  head_loss(model, h, batch) -> (loss, lm_loss, MTP aux or None) (`k3jax.train.head_loss`);
  merge_layer_aux(a, b): one layer's aux of two micro-batches combined. Returns
  ((loss, (aux per layer index, lm_loss)), grads): the means over the `steps` micro-batches of
  the batch split as `train.accumulated_grads` splits it, the MoE statistics merged over them.
  """
  model = nnx.merge(graphdef, params, buffers)
  lay = layout(model.cfg, num_stages(), steps)
  plan = lay.plan
  unit_graphdefs, unit_states = model.unit_states(nnx.Param, ...)
  unit_params = [p for p, _ in unit_states]
  unit_rest = [r for _, r in unit_states]

  def split(tree):
    if "layers" not in tree:
      return tree, {}
    layers = tree["layers"]
    outside = {**tree, "layers": {i: v for i, v in layers.items() if not plan.scanned(i)}}
    return outside, {i: v for i, v in layers.items() if plan.scanned(i)}

  shared_params, scanned_params = split(params)
  shared_buffers, scanned_buffers = split(buffers)
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  placeholders = (abstract(scanned_params), abstract(scanned_buffers))
  micro = jax.tree.map(lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)
  program = functools.partial(_stage_program, lay, graphdef, unit_graphdefs, placeholders,
                              head_loss, merge_layer_aux)
  g_units, g_shared, unit_aux, shared_aux, loss, lm_loss = jax.shard_map(
      program, in_specs=(P(PIPELINE), P(PIPELINE), P(), P(), P()),
      out_specs=(P(PIPELINE), P(), P(PIPELINE), P(), P(), P()), axis_names={PIPELINE},
      check_vma=False)(unit_params, unit_rest, shared_params, shared_buffers, micro)
  grads = _with_units(g_shared, {
      plan.layer(u, j): nnx.to_pure_dict(jax.tree.map(lambda g, u=u: g[u], g_units[j]))
      for u in range(plan.units) for j in range(plan.period)})
  aux = {**shared_aux, **{plan.layer(u, j): jax.tree.map(lambda a, u=u: a[u], unit_aux[j])
                          for u in range(plan.units) for j in range(plan.period)}}
  if lay.num_layers in aux:
    aux[lay.num_layers] = {k: v / steps if k == "mtp_loss" else v
                           for k, v in aux[lay.num_layers].items()}
  return (loss, (dict(sorted(aux.items())), lm_loss)), grads


def _stage_program(lay: Layout, graphdef, unit_graphdefs: list, placeholders: tuple,
                   head_loss: Callable, merge_layer_aux: Callable, unit_params: list,
                   unit_rest: list, shared_params: dict, shared_buffers: dict, micro: dict):
  """One stage's whole step (inside the shard_map over `pipeline`): the 1F1B ticks.

  unit_params, unit_rest: per unit position, the stage's units [U/S, ...] (Param / other
  variables); shared_*: everything outside the scanned units; micro: the batch [M, mb, T].
  Returns (unit grads [U/S, ...], shared grads summed over stages, unit aux [U/S, ...], aux of
  the other layers, loss, lm_loss).
  """
  stages, m_total, plan = lay.stages, lay.microbatches, lay.plan
  stage = jax.lax.axis_index(PIPELINE)
  is_first, is_last = stage == 0, stage == stages - 1
  first_layers = plan.start + plan.period * (stage * lay.units_per_stage
                                             + jnp.arange(lay.units_per_stage, dtype=jnp.int32))
  entry_blocks = jnp.asarray([lay.blocks_before(lay.entry_layer(k)) if lay.block_size else 0
                              for k in range(stages)], jnp.int32)[stage]
  invariant = jax.tree.leaves((unit_params, unit_rest, first_layers))

  def model_of(sp):
    # The embedding table whole on each device: XLA's partitioner cannot reshard the row
    # gather of a table split over `data` (FSDP) to tokens split over (data, expert) inside a
    # shard_map manual over `pipeline` (its fallback, replicate then split, aborts there).
    table = jax.lax.with_sharding_constraint(sp["embed_tokens"]["embedding"], P())
    sp = {**sp, "embed_tokens": {**sp["embed_tokens"], "embedding": table}}
    return nnx.merge(graphdef, _with_units(sp, placeholders[0]),
                     _with_units(shared_buffers, placeholders[1]))

  def microbatch(m):
    return jax.tree.map(lambda x: x[jnp.clip(m, 0, m_total - 1)], micro)

  def carry_of(diff, count):
    """The decoder's carry from its differentiable part (the block buffer may be the sent
    prefix: the slots past it are empty) and the count of completed blocks."""
    if not lay.block_size:
      return diff[0]
    blocks, partial = diff
    n_blocks = (lay.num_layers - 1) // lay.block_size + 1
    pad = jnp.zeros((n_blocks - blocks.shape[0],) + blocks.shape[1:], blocks.dtype)
    return jnp.concatenate([blocks, pad]), jnp.asarray(count, jnp.int32), partial

  def diff_of(carry):
    return (carry[0], carry[2]) if lay.block_size else (carry,)

  def sent(diff):
    return (diff[0][:lay.sent_blocks], diff[1]) if lay.block_size else diff

  def padded(diff_sent):
    return diff_of(carry_of(diff_sent, 0)) if lay.block_size else diff_sent

  def pre(sp, mb):
    """Stage 0 before its units: embedding, leading layers -> (sent carry, their aux)."""
    model = model_of(sp)
    carry = model.initial_carry(model.embed(mb["inputs"]))
    carry, aux = model.run_layers(range(plan.start), carry, mb["segment_ids"], mb["positions"])
    return sent(diff_of(carry)), aux

  def units(p, rest, first, diff_in, mb):
    """The stage's units: sent carry -> (carry, without the count; aux per position)."""
    carry = carry_of(diff_in, entry_blocks)
    carry, auxs = model_lib.run_units(unit_graphdefs, list(zip(p, rest)), first, carry,
                                      mb["segment_ids"], mb["positions"], lay.block_size,
                                      lay.remat)
    return diff_of(carry), auxs

  def post(sp, diff, mb):
    """The last stage after its units: loss / M and (lm_loss / M, aux of its layers)."""
    model = model_of(sp)
    carry = carry_of(diff, lay.blocks_before(plan.stop) if lay.block_size else None)
    carry, aux = model.run_layers(range(plan.stop, lay.num_layers), carry, mb["segment_ids"],
                                  mb["positions"])
    loss, lm_loss, mtp_aux = head_loss(model, model.norm(model.output_hidden(carry)), mb)
    if mtp_aux is not None:
      aux[lay.num_layers] = mtp_aux
    return loss / m_total, (lm_loss / m_total, aux)

  def forward(diff_in, mb):
    return jax.vjp(lambda p, x: units(p, unit_rest, first_layers, x, mb), unit_params, diff_in,
                   has_aux=True)

  def merged(acc, new, m, valid, merge):
    """acc with micro-batch m's aux merged in where valid (micro-batch 0 starts it)."""
    both = new if m_total == 1 else _select(m == 0, new, merge(acc, new))
    return _select(valid, both, acc)

  merge_list = lambda a, b: [merge_layer_aux(x, y) for x, y in zip(a, b)]
  merge_dict = lambda a, b: {i: merge_layer_aux(a[i], b[i]) for i in a}

  mb0 = microbatch(jnp.int32(0))
  sent0, pre_aux0 = jax.eval_shape(pre, shared_params, mb0)

  def kept_shapes(p, rest, first, x, mb):
    _, vjp_fn, _ = jax.vjp(lambda p, x: units(p, rest, first, x, mb), p, x, has_aux=True)
    return _residuals(vjp_fn, jax.tree.leaves((p, rest, first)))[0]

  residual0 = jax.eval_shape(kept_shapes, unit_params, unit_rest, first_layers, sent0, mb0)
  full0, unit_aux0 = jax.eval_shape(lambda x, mb: forward(x, mb)[::2], sent0, mb0)
  _, (_, post_aux0) = jax.eval_shape(post, shared_params, full0, mb0)
  state = _zeros({
      "recv_f": sent0, "recv_b": sent0,
      "res": [jax.ShapeDtypeStruct((lay.slots,) + x.shape, x.dtype) for x in residual0],
      "g_units": unit_params, "g_shared": shared_params, "unit_aux": unit_aux0,
      "pre_aux": pre_aux0, "post_aux": post_aux0,
      "loss": jax.ShapeDtypeStruct((), jnp.float32),
      "lm_loss": jax.ShapeDtypeStruct((), jnp.float32)})
  fwd_perm = [(k, k + 1) for k in range(stages - 1)]
  bwd_perm = [(k + 1, k) for k in range(stages - 1)]

  def forward_slot(t, st):
    """Forward of micro-batch t - stage; on the last stage also its loss and head gradient.
    Returns (state, carry to send, cotangent for this tick's backward slot)."""
    m = lay.forward_microbatch(t, stage)
    valid = (m >= 0) & (m < m_total)
    mb = microbatch(m)
    pre_out, pre_aux = pre(shared_params, mb)
    diff_out, vjp_fn, unit_aux = forward(_select(is_first, pre_out, st["recv_f"]), mb)
    kept = _residuals(vjp_fn, invariant)[0]
    if [(x.shape, x.dtype) for x in kept] != [(x.shape[1:], x.dtype) for x in st["res"]]:
      raise RuntimeError("the stage's residuals changed structure between traces")
    slot = jnp.mod(m, lay.slots)
    st = {**st, "res": [jax.lax.dynamic_update_index_in_dim(buf, x, slot, 0)
                        for buf, x in zip(st["res"], kept)],
          "unit_aux": merged(st["unit_aux"], unit_aux, m, valid, merge_list),
          "pre_aux": merged(st["pre_aux"], pre_aux, m, is_first & valid, merge_dict)}

    def head(st):
      (loss, (lm_loss, post_aux)), (d_sp, d_diff) = jax.value_and_grad(
          post, argnums=(0, 1), has_aux=True)(shared_params, diff_out, mb)
      take = is_last & valid
      st = {**st, "g_shared": _select(take, _add(st["g_shared"], d_sp), st["g_shared"]),
            "loss": st["loss"] + jnp.where(take, loss, 0.0),
            "lm_loss": st["lm_loss"] + jnp.where(take, lm_loss, 0.0),
            "post_aux": merged(st["post_aux"], post_aux, m, take, merge_dict)}
      return st, _select(is_last, d_diff, padded(st["recv_b"]))

    # Ticks before S - 1 hold no micro-batch on the last stage (same predicate on all devices).
    st, cotangent = jax.lax.cond(t >= stages - 1, head, lambda st: (st, padded(st["recv_b"])),
                                 st)
    return st, sent(diff_out), cotangent

  def backward_slot(t, st, cotangent):
    """Backward of micro-batch t - (2S - 2 - stage) from its stored residuals; on stage 0 also
    the embedding's and leading layers' (recomputed). Returns (state, cotangent to send)."""
    m = lay.backward_microbatch(t, stage)
    valid = (m >= 0) & (m < m_total)
    mb = microbatch(m)
    _, vjp_fn, _ = forward(st["recv_f"], mb)  # the pullback's structure: its values are unused
    kept = [jax.lax.dynamic_index_in_dim(buf, jnp.mod(m, lay.slots), 0, keepdims=False)
            for buf in st["res"]]
    d_params, d_sent = _pullback(kept, _residuals(vjp_fn, invariant)[1], invariant)(cotangent)
    _, pre_pullback = jax.vjp(lambda sp: pre(sp, mb)[0], shared_params)
    d_sp = pre_pullback(d_sent)[0]
    return {**st, "g_shared": _select(is_first & valid, _add(st["g_shared"], d_sp),
                                      st["g_shared"]),
            "g_units": _select(valid, _add(st["g_units"], d_params), st["g_units"])}, d_sent

  def tick(t, st):
    """Forward slot, then backward slot; the first S - 1 ticks skip the backward slot and the
    last S - 1 the forward slot (predicates on t only: every device takes the same branch, so
    the collectives inside stay matched)."""
    st, out, cotangent = jax.lax.cond(
        t < m_total + stages - 1, functools.partial(forward_slot, t),
        lambda st: (st, st["recv_f"], padded(st["recv_b"])), st)
    recv_f = jax.lax.ppermute(out, PIPELINE, fwd_perm)
    st, d_sent = jax.lax.cond(t >= stages - 1,
                              lambda st: backward_slot(t, st, cotangent),
                              lambda st: (st, st["recv_b"]), st)
    return {**st, "recv_f": recv_f, "recv_b": jax.lax.ppermute(d_sent, PIPELINE, bwd_perm)}

  state = jax.lax.fori_loop(0, lay.ticks, tick, state)
  psum = lambda x: jax.lax.psum(x, PIPELINE)
  return (state["g_units"], psum(state["g_shared"]), state["unit_aux"],
          psum({**state["pre_aux"], **state["post_aux"]}), psum(state["loss"]),
          psum(state["lm_loss"]))
