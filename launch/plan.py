r"""Parameter counts and per-device memory of a config on a mesh; nothing is allocated.

  python -m launch.plan --config=experiments/configs/k3_full.py --data=8 --expert=64 \
      --pipeline=16 --context=1 [--config.train.optimizer=muon ...]

The first lines are `total_params: N`, `active_params: N` and `mtp_params: N` (report convention:
LM head active, input embedding not, MTP on its own line); then the layer pattern, and bytes per
device of parameters and optimizer state with a per-group breakdown (`k3jax.plan`). Mesh flags
left out keep the config's `mesh.*` values.
"""
from absl import app, flags
from ml_collections import config_flags

from k3jax import config as config_lib
from k3jax import plan as plan_lib
from launch import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_MESH = {axis: flags.DEFINE_integer(axis, None, f"Size of the `{axis}` mesh axis "
                                                f"(default: the config's mesh.{axis}).")
         for axis in ("data", "expert", "pipeline", "context")}
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = _CONFIG.value
  for axis, flag in _MESH.items():
    if flag.value is not None:
      if flag.value < 1:
        raise app.UsageError(f"--{axis} must be a positive integer, got {flag.value}")
      cfg.mesh[axis] = flag.value
  if cfg.mesh.data == -1:
    raise app.UsageError("--data is needed: the config's mesh.data is -1 (all devices)")
  print(plan_lib.format_plan(plan_lib.make_plan(config_lib.validate(cfg))))


if __name__ == "__main__":
  cli.run(main)
