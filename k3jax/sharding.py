"""Meshes and logical-axis sharding (MaxText convention; rules live in the config).

Parameters carry logical axis names (`k3jax.params.param`); `mesh.logical_axis_rules` maps each
name to mesh axes. The mesh axes are (pipeline, data, expert, context).
"""
import math
from typing import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("pipeline", "data", "expert", "context")


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
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*spec)


def tree_shardings(tree, names, mesh: Mesh, rules):
  """NamedShardings for a pytree of arrays given a matching pytree of logical-name tuples."""
  def one(x, axes):
    spec = logical_to_mesh(axes, rules)
    for dim, entry in zip(x.shape, spec):
      if dim % num_shards(mesh, entry):
        raise ValueError(f"logical axes {axes} of an array of shape {x.shape} map to mesh axes "
                         f"{spec}: dim {dim} is not divisible by {num_shards(mesh, entry)}; "
                         f"change `mesh.logical_axis_rules` or the mesh shape")
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, tree, names, is_leaf=lambda x: x is None or isinstance(x, tuple))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Sharding of [B, T] batch arrays: batch over `activation_batch`, length over `activation_length`."""
  return NamedSharding(mesh, logical_to_mesh(("activation_batch", "activation_length"), rules))


def num_shards(mesh: Mesh, entry) -> int:
  """How many shards one PartitionSpec entry (None, an axis, or a tuple of axes) makes."""
  axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
  return math.prod(mesh.shape[a] for a in axes)


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
