"""Parameter counts and per-device memory of a config on a mesh, from abstract shapes only.

Counts come from `k3jax.flops.count_params` (report convention, k3_techniques.md §1: the LM head
is active, the input embedding is not; MTP is counted on its own). Bytes per device come from
the real parameter tree (`nnx.eval_shape`, nothing allocated) plus the MTP layer
(`k3jax.mtp.MTP`) when `model.mtp_num_layers` is 1, and from the real optimizer state
(`jax.eval_shape` of `k3jax.train.make_optimizer(...).init`): AdamW keeps two moments per
parameter, Muon one momentum per Muon-treated parameter and two moments for the AdamW ones.

Sharding follows training (`k3jax.train.state_shardings`): each parameter's logical axis names
(`nnx.Param` metadata `out_sharding`) map to mesh axes by `mesh.logical_axis_rules`; a dim mapped
to mesh axes is split by the product of their sizes (FSDP: a dim that `data` does not divide stays
whole on it, `k3jax.sharding.param_spec`), other dims are replicated, and an
optimizer leaf is sharded like the parameter whose path is its longest suffix with equal shape.
Decoder layers are a Python list, not a stacked array, so no parameter carries the `layers`
axis; when the rules map `layers` to mesh axes of size > 1, the plan also reports the largest
contiguous stage of layers that a layer-stacked model would place on one device.
"""
import dataclasses
import math

import jax
import ml_collections
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

import k3jax  # noqa: F401  (turns off eager sharding before parameters are created)
from k3jax import config as config_lib
from k3jax import flops, muon, sharding, train
from k3jax.mtp import MTP

GROUPS = ("embedding", "attention", "routed_experts", "other", "mtp")
_UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))


@dataclasses.dataclass(frozen=True)
class Bytes:
  """Bytes on one device: parameters and optimizer state."""
  params: int
  optimizer: int

  @property
  def total(self) -> int:
    return self.params + self.optimizer


@dataclasses.dataclass(frozen=True)
class Stages:
  """The largest pipeline stage if the decoder layers were split over the `layers` mesh axes."""
  num_stages: int
  layers_per_stage: int
  first_layer: int
  last_layer: int
  bytes: Bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  counts: flops.ParamCount
  mtp_params: int
  layer_summary: str
  mesh: dict[str, int]
  optimizer_summary: str
  groups: dict[str, Bytes]  # per device, by GROUPS
  stages: Stages | None

  @property
  def per_device(self) -> Bytes:
    return Bytes(sum(g.params for g in self.groups.values()),
                 sum(g.optimizer for g in self.groups.values()))


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One parameter: its global and per-device element counts and optimizer bytes (global)."""
  group: str
  layer: int | None
  names: tuple
  shape: tuple[int, ...]
  itemsize: int
  per_device_elems: int
  opt_bytes: int = 0


def _group(keys: tuple[str, ...]) -> str:
  if keys[0] == "mtp":
    return "mtp"
  if keys[0] in ("embed_tokens", "lm_head"):
    return "embedding"
  if "experts" in keys:
    return "routed_experts"
  if "self_attn" in keys:
    return "attention"
  return "other"


def abstract_params(model_cfg: ml_collections.ConfigDict) -> tuple[dict, dict]:
  """(params, logical names): pure dicts of ShapeDtypeStructs and axis-name tuples.

  The backbone from `flops.abstract_model`, with `mtp` taken from `k3jax.mtp.MTP` when
  `model.mtp_num_layers` is 1 (whether or not the model owns one).
  """
  if model_cfg.mtp_num_layers > 1:
    raise ValueError(f"config field `model.mtp_num_layers`: k3jax.mtp implements one MTP depth, "
                     f"got {model_cfg.mtp_num_layers}")
  modules = {"": flops.abstract_model(model_cfg)}
  if model_cfg.mtp_num_layers:
    modules["mtp"] = nnx.eval_shape(lambda: MTP(model_cfg, rngs=nnx.Rngs(0)))
  params, names = {}, {}
  for key, module in modules.items():
    state = nnx.state(module, nnx.Param)
    axes = jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
    p, n = nnx.to_pure_dict(state), nnx.to_pure_dict(axes)
    if key:
      params[key], names[key] = p, n
    else:
      params.update({k: v for k, v in p.items() if k != "mtp"})
      names.update({k: v for k, v in n.items() if k != "mtp"})
  return params, names


def mesh_sizes(mesh_cfg: ml_collections.ConfigDict) -> dict[str, int]:
  if mesh_cfg.data == -1:
    raise ValueError("config field `mesh.data`: is -1 (all devices); the plan needs an explicit "
                     "size (--data=N)")
  return {axis: int(mesh_cfg[axis]) for axis in sharding.MESH_AXES}


def layer_summary(model_cfg: ml_collections.ConfigDict) -> str:
  """E.g. '93 = 69 KDA + 24 gated MLA | FFN: 1 dense + 92 LatentMoE (...) | AttnRes block 12'."""
  kinds = config_lib.layer_types(model_cfg)
  mla = "gated MLA" if model_cfg.mla.use_output_gate else "MLA"
  parts = [f"{len(kinds)} = {kinds.count('kda')} KDA + {kinds.count('mla')} {mla}"]
  e = model_cfg.moe
  if e.num_experts:
    dense = min(model_cfg.first_k_dense_replace, len(kinds))
    moe = "LatentMoE" if e.latent_size else "MoE"
    parts.append(f"FFN: {dense} dense + {len(kinds) - dense} {moe} ({e.num_experts} experts, "
                 f"top-{e.num_experts_per_tok}, {e.n_shared_experts} shared)")
  else:
    parts.append(f"FFN: {len(kinds)} dense")
  bs = model_cfg.attn_res_block_size
  parts.append(f"AttnRes block {bs}" if bs else "pre-norm residual")
  if model_cfg.mtp_num_layers:
    parts.append(f"MTP: 1 {mla} + {'MoE' if e.num_experts else 'dense'} block")
  return " | ".join(parts)


def _keys(path) -> tuple[str, ...]:
  return tuple(muon.path_str(path).split("."))


def _layer_index(keys: tuple[str, ...]) -> int | None:
  if keys[0] == "layers":
    return int(keys[1])
  return None


def _per_device_elems(shape, spec: PartitionSpec, mesh: AbstractMesh) -> int:
  return math.prod(NamedSharding(mesh, spec).shard_shape(tuple(shape)))


def _leaves(cfg: ml_collections.ConfigDict, mesh: AbstractMesh
            ) -> tuple[dict[tuple[str, ...], _Leaf], int, str]:
  """Per-parameter records, replicated optimizer bytes (counters), optimizer summary."""
  params, names = abstract_params(cfg.model)
  rules = cfg.mesh.logical_axis_rules
  shardings = sharding.tree_shardings(params, names, mesh, rules)
  leaves = {}
  all_names = jax.tree.leaves(names, is_leaf=lambda n: n is None or isinstance(n, tuple))
  for (path, x), s, axes in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(shardings), all_names):
    keys = _keys(path)
    axes = tuple(axes) if axes is not None else (None,) * len(x.shape)
    leaves[keys] = _Leaf(_group(keys), _layer_index(keys), axes, tuple(x.shape),
                         x.dtype.itemsize, math.prod(s.shard_shape(tuple(x.shape))))
  opt_state = jax.eval_shape(train.make_optimizer(cfg.train, params).init, params)
  opt_bytes = dict.fromkeys(leaves, 0)
  replicated = 0
  for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
    keys, size = _keys(path), math.prod(x.shape) * x.dtype.itemsize
    owner = next((keys[i:] for i in range(len(keys))
                  if keys[i:] in leaves and leaves[keys[i:]].shape == tuple(x.shape)), None)
    if owner is None:
      replicated += size
    else:
      opt_bytes[owner] += size
  leaves = {k: dataclasses.replace(v, opt_bytes=opt_bytes[k]) for k, v in leaves.items()}
  if cfg.train.optimizer == "adamw":
    summary = "adamw, 2 moments per parameter"
  else:
    mode = "per_head" if cfg.train.optimizer == "muon" else "whole"
    dims = jax.tree.leaves(muon.muon_dimension_numbers(params, mode=mode),
                           is_leaf=lambda d: d is None or isinstance(d, muon.DimNums))
    n_muon = sum(math.prod(x.shape) for x, d in zip(jax.tree.leaves(params), dims) if d is not None)
    n_all = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    summary = (f"{cfg.train.optimizer} ({mode}), 1 momentum for {n_muon} Muon values, "
               f"2 moments for {n_all - n_muon} AdamW values")
  return leaves, replicated, summary


def _bytes(leaf: _Leaf, per_device_elems: int) -> Bytes:
  """Per-device bytes of a parameter and its optimizer leaves, sharded alike."""
  global_elems = math.prod(leaf.shape)
  return Bytes(per_device_elems * leaf.itemsize, leaf.opt_bytes * per_device_elems // global_elems)


def _stages(cfg, leaves: dict, mesh: AbstractMesh) -> Stages | None:
  """The largest stage of contiguous layers if `layers` split the decoder list."""
  rules = cfg.mesh.logical_axis_rules
  axes = sharding.logical_to_mesh(("layers",), rules)[0]
  num = sharding.num_shards(mesh, axes)
  if num == 1 or any("layers" in leaf.names for leaf in leaves.values()):
    return None
  n_layers = cfg.model.num_layers
  per_stage = -(-n_layers // num)
  stage_bytes = [Bytes(0, 0) for _ in range(-(-n_layers // per_stage))]
  shared = Bytes(0, 0)
  for leaf in leaves.values():
    if leaf.layer is None:
      b = _bytes(leaf, leaf.per_device_elems)
      shared = Bytes(shared.params + b.params, shared.optimizer + b.optimizer)
      continue
    spec = PartitionSpec(*sharding.logical_to_mesh(("layers",) + leaf.names, rules)[1:])
    b = _bytes(leaf, _per_device_elems(leaf.shape, spec, mesh))
    s = leaf.layer // per_stage
    stage_bytes[s] = Bytes(stage_bytes[s].params + b.params, stage_bytes[s].optimizer + b.optimizer)
  big = max(range(len(stage_bytes)), key=lambda s: stage_bytes[s].total)
  return Stages(num, per_stage, big * per_stage, min(n_layers, (big + 1) * per_stage) - 1,
                Bytes(stage_bytes[big].params + shared.params,
                      stage_bytes[big].optimizer + shared.optimizer))


def make_plan(cfg: ml_collections.ConfigDict) -> Plan:
  """The plan of a validated config on the mesh `cfg.mesh` (`mesh.data` must be explicit)."""
  sizes = mesh_sizes(cfg.mesh)
  mesh = AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES)
  counts = flops.count_params(cfg.model)
  leaves, replicated, summary = _leaves(cfg, mesh)
  groups = {g: Bytes(0, 0) for g in GROUPS}
  for leaf in leaves.values():
    b, g = _bytes(leaf, leaf.per_device_elems), groups[leaf.group]
    groups[leaf.group] = Bytes(g.params + b.params, g.optimizer + b.optimizer)
  groups["other"] = Bytes(groups["other"].params, groups["other"].optimizer + replicated)
  mtp_params = sum(math.prod(v.shape) for k, v in leaves.items() if k[0] == "mtp")
  return Plan(counts, mtp_params, layer_summary(cfg.model), sizes, summary, groups,
              _stages(cfg, leaves, mesh))


def format_plan(plan: Plan) -> str:
  """The report; the first lines are `total_params: N`, `active_params: N`, `mtp_params: N`."""
  per_device = plan.per_device
  unit, scale = next(u for u in _UNITS if per_device.total >= u[1] or u[1] == 1)
  mesh = " ".join(f"{a}={n}" for a, n in plan.mesh.items())
  lines = [f"total_params: {plan.counts.total}",
           f"active_params: {plan.counts.active}",
           f"mtp_params: {plan.mtp_params}",
           f"layers: {plan.layer_summary}",
           f"mesh: {mesh} ({math.prod(plan.mesh.values())} devices)",
           f"optimizer: {plan.optimizer_summary}",
           f"param_bytes_per_device: {per_device.params}",
           f"optimizer_bytes_per_device: {per_device.optimizer}",
           f"state_bytes_per_device: {per_device.total}",
           f"{f'per device ({unit})':18s} {'params':>10s} {'optimizer':>10s} {'total':>10s}"]
  for name, b in [*plan.groups.items(), ("total", per_device)]:
    lines.append(f"  {name:16s} {b.params / scale:10.2f} {b.optimizer / scale:10.2f} "
                 f"{b.total / scale:10.2f}")
  s = plan.stages
  if s is not None:
    lines += [f"pipeline: no parameter carries the `layers` axis (unstacked layers), so the "
              f"bytes above replicate every layer; split into {s.num_stages} stages of <= "
              f"{s.layers_per_stage} layers, the largest stage (layers {s.first_layer}-"
              f"{s.last_layer}, plus every non-layer parameter) holds:",
              f"staged_param_bytes_per_device: {s.bytes.params}",
              f"staged_optimizer_bytes_per_device: {s.bytes.optimizer}",
              f"staged_state_bytes_per_device: {s.bytes.total}"]
  return "\n".join(lines)
