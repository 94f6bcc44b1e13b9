"""Compiles for a TPU slice without a TPU: libtpu's compiler on a deviceless topology.

`topology("v5p:4x4x4")` gives the devices of a slice (`jax.experimental.topologies`) to build a
mesh on; `jax.jit(...).lower(...).compile()` under `jax.set_mesh` of that mesh runs the XLA TPU
compiler (and Mosaic for Pallas TPU kernels) on this host, and `memory_analysis()` gives the
program's bytes per device. Nothing runs, nothing is allocated.

libtpu lives outside .venv (`make tpu-setup` installs it into .libtpu; put that directory on
PYTHONPATH): with libtpu importable, every process that starts JAX's backends without
JAX_PLATFORMS=cpu tries to open a TPU and logs errors on stderr. Processes that compile this
way should set JAX_PLATFORMS=cpu (the host's backend is all they need).
"""
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu

from k3jax import config as config_lib
from k3jax import model, sharding, train

LIBTPU_HINT = "run `make tpu-setup` and put .libtpu on PYTHONPATH"
# libtpu asks a TPU VM's metadata server for these two and logs errors without them; they do not
# change what is compiled (the topology decides). One libtpu process per host holds a lock file
# unless ALLOW_MULTIPLE_LIBTPU_LOAD is set (pytest workers, a compile beside a test).
_QUIET_ENV = (("TPU_ACCELERATOR_TYPE", "v5p-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
              ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"))
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class TopologyError(ValueError):
  """A TPU topology that cannot be had: an unknown name, or libtpu not installed."""


def topology(name: str) -> list[jax.Device]:
  """The devices of the TPU slice `name`, e.g. "v5e:2x2", "v5p:4x4x4", "v6e:4x4" (compile only)."""
  try:
    import libtpu  # noqa: F401  (pylint: disable=import-outside-toplevel,unused-import)
  except ImportError:
    raise TopologyError(f"libtpu is not installed: {LIBTPU_HINT}") from None
  for key, value in _QUIET_ENV:
    os.environ.setdefault(key, value)
  try:
    desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
  except jax.errors.JaxRuntimeError as e:
    reason = str(e).split("\n", 1)[0].removeprefix("INVALID_ARGUMENT: ")
    raise TopologyError(f"TPU topology {name!r}: {reason} (names look like v5e:2x2, "
                        f"v5p:4x4x4, v6e:4x8)") from None
  return list(desc.devices)


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device of a compiled program (`Compiled.memory_analysis()`).

  `aliased` output bytes reuse donated arguments (the train state), so the peak is
  arguments + outputs - aliased + temporaries (generated code apart).
  """
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries

  @classmethod
  def of(cls, compiled) -> "Memory":
    m = compiled.memory_analysis()
    return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
               m.temp_size_in_bytes, m.generated_code_size_in_bytes)

  def extrapolate(self, other: "Memory", units: int, other_units: int, to_units: int) -> "Memory":
    """The bytes linear in the scanned unit count through (units, self) and (other_units,
    other); the code as `other`'s (one scan body however many units). Temporaries that shrink
    from the smaller twin to the larger (the compiler recomputing more near the HBM limit) are
    no line: the larger of the two is kept, a lower bound (`temporaries_linear` False)."""
    def line(a: int, b: int) -> int:
      return a + round((b - a) * (to_units - units) / (other_units - units))
    temporaries = (line(self.temporaries, other.temporaries)
                   if Memory.temporaries_linear(self, other)
                   else max(self.temporaries, other.temporaries))
    return Memory(line(self.arguments, other.arguments), line(self.outputs, other.outputs),
                  line(self.aliased, other.aliased), temporaries, other.code)

  @staticmethod
  def temporaries_linear(a: "Memory", b: "Memory") -> bool:
    """Whether `extrapolate` draws the temporaries' line (they do not shrink from a to b)."""
    return b.temporaries >= a.temporaries


def twin_config(cfg: ml_collections.ConfigDict, units: int) -> ml_collections.ConfigDict:
  """`cfg` with only `units` of its scanned units (`model.scan_plan`), the layers before and
  after the scan kept; every other field as in `cfg`. K3 with 2 units: layers 0-3, 2 x (3 KDA +
  1 MLA), layer 92 -> 13 layers."""
  plan = model.scan_plan(cfg.model)
  if plan is None:
    raise ValueError("the config's layers have no repeating unit to scan (model.scan_plan)")
  if not 2 <= units <= plan.units:
    raise ValueError(f"a twin keeps 2..{plan.units} scanned units (one unit is not scanned), "
                     f"got {units}")
  kinds = config_lib.layer_types(cfg.model)
  keep = kinds[:plan.layer(units, 0)] + kinds[plan.stop:]
  twin = cfg.copy_and_resolve_references()
  twin.model.num_layers = len(keep)
  twin.model.full_attn_layers = tuple(i + 1 for i, k in enumerate(keep) if k == "mla")
  twin.model.kda_layers = ()
  twin = config_lib.validate(twin)
  want = model.ScanPlan(plan.start, plan.period, units)
  if model.scan_plan(twin.model) != want or model.layer_kinds(twin.model) != (
      model.layer_kinds(cfg.model)[:want.stop] + model.layer_kinds(cfg.model)[plan.stop:]):
    raise ValueError(f"a twin of {units} units does not keep the config's layer pattern")
  return twin


def hbm_bytes(device: jax.Device) -> int:
  """HBM of one device (a chip; megacore chips count both cores), from Pallas's chip table."""
  mesh = jax.sharding.Mesh([device], ("x",))
  with jax.set_mesh(mesh):
    return pltpu.get_tpu_info().hbm_capacity_bytes * device.num_cores


@dataclasses.dataclass(frozen=True)
class StepCompile:
  """A train step compiled for a mesh of TPU devices, or the compiler's out-of-memory message."""
  memory: Memory | None  # None: the program does not fit the device's HBM (`oom` says why)
  oom: str | None
  hbm: int
  batch_bytes: int  # the global batch's bytes on one device (part of `memory.arguments`)
  lower_s: float
  compile_s: float


def abstract_state(cfg: ml_collections.ConfigDict) -> tuple[train.Setup, dict]:
  """(setup, train state as ShapeDtypeStructs) of `train.init`, nothing allocated."""
  holder = {}

  def init():
    holder["setup"], state = train.init(cfg, cfg.train.seed)
    return state

  state = jax.eval_shape(init)
  return holder["setup"], state


def compile_train_step(cfg: ml_collections.ConfigDict, devices: list[jax.Device]) -> StepCompile:
  """Lowers and compiles `train.make_train_step` for `devices` on the mesh `cfg.mesh`.

  The state is sharded as in training (`train.state_shardings`) and donated, the batch
  [global_batch_size, seq_len] is sharded over the mesh's batch axes (`sharding.batch_sharding`).
  A program larger than the device's HBM fails in the compiler: its message is kept in `oom`.
  Raises ValueError (ConfigError for the batch) when the mesh does not match the devices or a
  dimension does not divide.
  """
  mesh = sharding.make_mesh(cfg.mesh, devices)
  rules = cfg.mesh.logical_axis_rules
  t = cfg.train
  batch_sharding = sharding.batch_sharding(mesh, rules)
  shards = sharding.num_shards(mesh, batch_sharding.spec[0])
  if t.global_batch_size % shards:
    raise config_lib.ConfigError("train.global_batch_size", f"{t.global_batch_size} is not "
                                 f"divisible by the {shards} batch shards of the mesh")
  setup, state = abstract_state(cfg)
  state_shardings = train.state_shardings(setup, state, mesh, rules)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       state, state_shardings)
  batch = {k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len),
                                   jnp.float32 if k == "loss_mask" else jnp.int32,
                                   sharding=batch_sharding) for k in BATCH_KEYS}
  step = jax.jit(train.make_train_step(setup), donate_argnums=0,
                 out_shardings=(state_shardings, None),
                 compiler_options=train.compiler_options(cfg))
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    try:
      memory, oom = Memory.of(lowered.compile()), None
    except jax.errors.JaxRuntimeError as e:
      if not str(e).startswith("RESOURCE_EXHAUSTED"):
        raise
      memory, oom = None, str(e).split("\n", 1)[0].removeprefix("RESOURCE_EXHAUSTED: ")
    t2 = time.perf_counter()
  return StepCompile(memory, oom, hbm_bytes(devices[0]), sharding.per_device_bytes(batch),
                     t1 - t0, t2 - t1)
