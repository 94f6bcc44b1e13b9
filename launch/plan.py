r"""Parameter counts and per-device memory of a config on a mesh; nothing is allocated.

  python -m launch.plan --config=experiments/configs/k3_full.py --data=8 --expert=64 \
      --pipeline=16 --context=1 [--config.train.optimizer=muon ...]
  python -m launch.plan --config=experiments/configs/k3_full.py --devices=1024 --expert=64

The first lines are `total_params: N`, `active_params: N` and `mtp_params: N` (report convention:
LM head active, input embedding not, MTP on its own line); then the layer pattern, the mesh,
and bytes per device of parameters and optimizer state with a per-group breakdown
(`k3jax.plan`). Mesh flags left out keep the config's `mesh.*` values; with `--devices=N` a
`data` of -1 (the config default) takes the devices the other axes leave, and a mesh of another
size is an error.

`--compile_for=v5p:4x4x4` (a TPU topology; needs libtpu: `make tpu-setup`, then
PYTHONPATH=.libtpu) also compiles the train step for that slice on this host, with no TPU
(`k3jax.tpu_compile`), and prints the compiler's bytes per device (arguments, outputs, aliased,
temporaries, total) beside the analytic state. `mesh.data = -1` takes the devices left by the
other axes. `--compile_units=N` compiles twins that keep N and N + 1 of the scanned units
(`k3jax.tpu_compile.twin_config`) and extrapolates linearly to the config's unit count: the
full model's compile takes long and may not fit the slice's HBM.
"""
import jax
from absl import app, flags
from ml_collections import config_flags

from k3jax import config as config_lib
from k3jax import model
from k3jax import plan as plan_lib
from k3jax import tpu_compile
from launch import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_MESH = {axis: flags.DEFINE_integer(axis, None, f"Size of the `{axis}` mesh axis "
                                                f"(default: the config's mesh.{axis}).")
         for axis in ("data", "expert", "pipeline", "context")}
_DEVICES = flags.DEFINE_integer("devices", None, "Device count the mesh must fill (`data` = -1 "
                                "takes the rest).")
_COMPILE_FOR = flags.DEFINE_string("compile_for", "", "A TPU topology, e.g. v5p:4x4x4: also "
                                    "compile the train step for it (no TPU needed).")
_COMPILE_UNITS = flags.DEFINE_integer("compile_units", 0, "With --compile_for: compile twins of "
                                      "N and N + 1 scanned units and extrapolate (0: the config "
                                      "as it is).")
flags.mark_flags_as_required(["config"])
_UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = _CONFIG.value
  for axis, flag in _MESH.items():
    if flag.value is not None:
      if flag.value < 1:
        raise app.UsageError(f"--{axis} must be a positive integer, got {flag.value}")
      cfg.mesh[axis] = flag.value
  if not _COMPILE_FOR.value:
    if _COMPILE_UNITS.value:
      raise cli.FlagError("--compile_units needs --compile_for")
    if _DEVICES.value is not None:
      if _DEVICES.value < 1:
        raise cli.FlagError(f"--devices must be a positive integer, got {_DEVICES.value}")
      _fit_mesh(cfg, _DEVICES.value, f"--devices={_DEVICES.value}")
    if cfg.mesh.data == -1:
      raise app.UsageError("--data or --devices is needed: the config's mesh.data is -1 (all "
                           "devices)")
    print(plan_lib.format_plan(plan_lib.make_plan(config_lib.validate(cfg))))
    return
  if _DEVICES.value is not None:
    raise cli.FlagError("--devices: --compile_for gives the device count")
  jax.config.update("jax_platforms", "cpu")  # this host's backend; the TPU is a compile target
  try:
    devices = tpu_compile.topology(_COMPILE_FOR.value)
  except tpu_compile.TopologyError as e:
    raise cli.FlagError(f"--compile_for: {e}") from None
  _fit_mesh(cfg, len(devices), f"--compile_for={_COMPILE_FOR.value}")
  cfg = config_lib.validate(cfg)
  plan = plan_lib.make_plan(cfg)
  print(plan_lib.format_plan(plan))
  print(f"compile_for: {_COMPILE_FOR.value}, {len(devices)} x {devices[0].device_kind}")
  print(_compile_report(cfg, devices, plan, _COMPILE_UNITS.value))


def _fit_mesh(cfg, num_devices: int, source: str) -> None:
  """Sets mesh.data = -1 from the device count (given by the flag `source`); a mesh of another
  size is a flag error."""
  m = cfg.mesh
  others = m.pipeline * m.expert * m.context
  if m.data == -1 and num_devices % others == 0:
    m.data = num_devices // others
  if m.data * others != num_devices:
    data = "-1 (all devices)" if m.data == -1 else m.data
    raise cli.FlagError(
        f"{source}: the mesh --data={data} --expert={m.expert} --pipeline={m.pipeline} "
        f"--context={m.context} does not fill {num_devices} devices")


def _compile_report(cfg, devices, plan, units: int) -> str:
  """The compiled bytes per device beside the analytic state (`plan`)."""
  try:
    if units:
      total = model.scan_plan(cfg.model).units
      twins = [tpu_compile.twin_config(cfg, u) for u in (units, units + 1)]
    else:
      twins = [cfg]
  except ValueError as e:
    raise cli.FlagError(f"--compile_units: {e}") from None
  runs = [tpu_compile.compile_train_step(twin, devices) for twin in twins]
  first = runs[0]
  layers = " and ".join(str(t.model.num_layers) for t in twins)
  lowered = " + ".join(f"{r.lower_s:.1f} s" for r in runs)
  compiled = " + ".join(f"{r.compile_s:.1f} s" for r in runs)
  lines = [f"hbm_bytes_per_device: {first.hbm}",
           f"compiled: model.num_layers = {layers}; lowered in {lowered}, compiled in "
           f"{compiled}"]
  if any(r.memory is None for r in runs):
    return "\n".join(lines + [f"compiled: does not fit: {r.oom}" for r in runs if r.oom])
  memory = first.memory
  if units:
    memory = first.memory.extrapolate(runs[1].memory, units, units + 1, total)
    lines.append(f"compiled bytes: extrapolated from the twins of {units} and {units + 1} "
                 f"scanned units to {total} (linear in the unit count)")
    if not tpu_compile.Memory.temporaries_linear(first.memory, runs[1].memory):
      lines.append(f"compiled: temporaries shrink from {first.memory.temporaries} to "
                   f"{runs[1].memory.temporaries} bytes between the twins (the compiler "
                   "recomputes more near the HBM limit): not extrapolated; the larger twin's "
                   "figure is a lower bound")
  state = plan.per_device.total
  unit, scale = next(u for u in _UNITS if memory.total >= u[1] or u[1] == 1)
  fits = "fits" if memory.total <= first.hbm else "does not fit"
  rows = [("arguments", memory.arguments, state + first.batch_bytes, "state + batch"),
          ("outputs", memory.outputs, state, "state"),
          ("aliased", memory.aliased, state, "donated state"),
          ("temporaries", memory.temporaries, None, ""),
          ("total", memory.total, None, f"HBM {first.hbm / scale:.2f}: {fits}")]
  lines += [f"compiled_argument_bytes_per_device: {memory.arguments}",
            f"compiled_output_bytes_per_device: {memory.outputs}",
            f"compiled_alias_bytes_per_device: {memory.aliased}",
            f"compiled_temp_bytes_per_device: {memory.temporaries}",
            f"compiled_total_bytes_per_device: {memory.total}",
            f"compiled_batch_bytes_per_device: {first.batch_bytes}",
            f"{f'per device ({unit})':18s} {'compiled':>10s} {'analytic':>10s}"]
  for name, got, want, note in rows:
    want = "-" if want is None else f"{want / scale:.2f}"
    lines.append(f"  {name:16s} {got / scale:10.2f} {want:>10s}  {note}".rstrip())
  return "\n".join(lines)


if __name__ == "__main__":
  cli.run(main)
