"""Meshes and logical-axis sharding (MaxText convention; rules live in the config).

Parameters carry logical axis names (`k3jax.params.param`); `mesh.logical_axis_rules` maps each
name to mesh axes. The mesh axes are (pipeline, data, expert, context).

FSDP (ZeRO-3) over `data`: the batch is split over `data`, and the rules may map parameter axes
to `data` too (base config: `embed`, `latent`, `q_lora`, `kv_lora`, `kv`). Parameters, gradients
and optimizer state are then stored split over `data`; `fsdp_gather` gathers one layer's (one
scanned unit's) parameters where they are used and reduces their gradients to the slices. A dim that
`data` does not divide stays whole on that dim (`param_spec`); any other mesh axis must divide
its dims.
"""
import contextlib
import contextvars
import functools
import math
from typing import Any, Iterator, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("pipeline", "data", "expert", "context")
FSDP_AXIS = "data"

_RULES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("logical_axis_rules",
                                                                    default=None)


def make_mesh(mesh_cfg: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with `mesh.data = -1` taking what is left."""
  devices = list(jax.devices() if devices is None else devices)
  fixed = mesh_cfg.pipeline * mesh_cfg.expert * mesh_cfg.context
  data = mesh_cfg.data
  if data == -1:
    if len(devices) % fixed:
      raise ValueError(f"config field `mesh`: pipeline*expert*context = {fixed} does not divide "
                       f"the {len(devices)} devices")
    data = len(devices) // fixed
  shape = (mesh_cfg.pipeline, data, mesh_cfg.expert, mesh_cfg.context)
  if math.prod(shape) != len(devices):
    raise ValueError(f"config field `mesh`: axes {dict(zip(MESH_AXES, shape))} need "
                     f"{math.prod(shape)} devices, have {len(devices)}")
  return Mesh(np.array(devices).reshape(shape), MESH_AXES)


def logical_to_mesh(names: Sequence[str | None] | None, rules) -> PartitionSpec:
  """PartitionSpec for a tuple of logical axis names; each mesh axis is used at most once."""
  if names is None:
    return PartitionSpec()
  table = {logical: tuple(axes) if axes else () for logical, axes in rules}
  used, spec = set(), []
  for name in names:
    axes = tuple(a for a in table.get(name, ()) if a not in used)
    used.update(axes)
    spec.append(_spec_entry(axes))
  return PartitionSpec(*spec)


def _entry_axes(entry) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _spec_entry(axes: tuple[str, ...]):
  return axes[0] if len(axes) == 1 else (axes or None)


def param_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh, rules
               ) -> PartitionSpec:
  """Storage spec of a parameter: `logical_to_mesh`, then `data` dropped from any dim it does not
  divide (FSDP is a layout: such a dim stays whole). Another mesh axis that does not divide its
  dim is an error naming the rules to change."""
  spec = []
  for dim, entry in zip(shape, logical_to_mesh(names, rules)):
    axes = _entry_axes(entry)
    if dim % num_shards(mesh, axes) and FSDP_AXIS in axes:
      axes = tuple(a for a in axes if a != FSDP_AXIS)
    if dim % num_shards(mesh, axes):
      raise ValueError(f"logical axes {names} of an array of shape {tuple(shape)} map dim {dim} "
                       f"to mesh axes {axes}: {dim} is not divisible by "
                       f"{num_shards(mesh, axes)}; change `mesh.logical_axis_rules` or the mesh "
                       f"shape")
    spec.append(_spec_entry(axes))
  return PartitionSpec(*spec)


def tree_shardings(tree, names, mesh: Mesh, rules):
  """NamedShardings for a pytree of arrays given a matching pytree of logical-name tuples."""
  def one(path, x, axes):
    try:
      return NamedSharding(mesh, param_spec(axes, x.shape, mesh, rules))
    except ValueError as e:
      raise ValueError(f"{'.'.join(_keys(path))}: {e}") from None
  return jax.tree_util.tree_map_with_path(
      one, tree, names, is_leaf=lambda x: x is None or isinstance(x, tuple))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Sharding of [B, T] batch arrays: batch over `activation_batch`, length over
  `activation_length`."""
  return NamedSharding(mesh, logical_to_mesh(("activation_batch", "activation_length"), rules))


def num_shards(mesh: Mesh, entry) -> int:
  """How many shards one PartitionSpec entry (None, an axis, or a tuple of axes) makes."""
  return math.prod(mesh.shape[a] for a in _entry_axes(entry))


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded arrays (one shard of each leaf)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


@contextlib.contextmanager
def logical_axis_rules(rules) -> Iterator[None]:
  """The rules `fsdp_gather` resolves logical names with while a step is traced."""
  token = _RULES.set(tuple(rules))
  try:
    yield
  finally:
    _RULES.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x: jax.Array, stored: PartitionSpec, used: PartitionSpec) -> jax.Array:
  return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, stored), used)


def _gather_fwd(x, stored, used):
  return _gather(x, stored, used), None


def _gather_bwd(stored, used, _, ct):
  del used
  return (jax.lax.with_sharding_constraint(ct, stored),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def fsdp_active() -> bool:
  """Whether `fsdp_gather` gathers: traced under `jax.set_mesh` with `data` > 1 and rules set."""
  mesh = jax.sharding.get_abstract_mesh()
  return _RULES.get() is not None and not mesh.empty and mesh.shape.get(FSDP_AXIS, 1) > 1


def fsdp_gather(state: Any) -> Any:
  """One layer's (or scanned unit's) variables gathered over `data` for use (ZeRO-3).

  Each variable whose storage spec (`param_spec` of its logical names under the rules of
  `logical_axis_rules`) uses `data` is constrained to that spec, then to the spec without `data`;
  its gradient is constrained back to the storage spec, so each device keeps its slice of the sum
  over the batch (a reduce-scatter, or an all-reduce and a slice). Called on the slice of a
  scanned stack, this keeps the gathers inside the loop body; with `model.remat` other than
  "none" the backward pass gathers again (with "none" the forward's gathered parameters stay
  alive until the backward). A no-op unless `fsdp_active()`: the single-device program is
  unchanged.
  """
  if not fsdp_active():
    return state
  rules, mesh = _RULES.get(), jax.sharding.get_abstract_mesh()

  def one(v):
    stored = param_spec(v.get_metadata().get("out_sharding"), v.shape, mesh, rules)
    kept = [tuple(a for a in _entry_axes(e) if a != FSDP_AXIS) for e in stored]
    if kept == [_entry_axes(e) for e in stored]:
      return v
    return v.replace(_gather(v[...], stored, PartitionSpec(*map(_spec_entry, kept))))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def tree_shardings_like(tree, reference: dict, reference_shardings: dict, mesh: Mesh):
  """Shardings for a tree whose leaves mirror `reference` leaves (e.g. optimizer moments).

  A leaf takes the sharding of the reference leaf whose key path is the longest suffix of its
  own path and whose shape matches; any other leaf (counts, scalars) is replicated.
  """
  ref = {_keys(path): (leaf.shape, s) for (path, leaf), s in zip(
      jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(reference_shardings))}
  replicated = NamedSharding(mesh, PartitionSpec())

  def one(path, leaf):
    keys = _keys(path)
    for start in range(len(keys)):
      hit = ref.get(keys[start:])
      if hit is not None and hit[0] == getattr(leaf, "shape", None):
        return hit[1]
    return replicated
  return jax.tree_util.tree_map_with_path(one, tree)
