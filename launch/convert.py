r"""Kimi K3 checkpoints (Hugging Face form) <-> k3jax workdirs.

  python -m launch.convert --hf_dir=HF_DIR --workdir=DIR [--config=FILE --config.x=...]
  python -m launch.convert --workdir=DIR --hf_out=HF_DIR [--experts=mxfp4|bf16] [--step=N]

HF -> workdir: the model section of the config comes from HF_DIR/config.json (`k3jax.hf`), every
other section from --config (default: experiments/configs/k3_full.py, the release). DIR gets
what `launch.train` leaves: config.json and checkpoints/0 (the weights, a fresh optimizer state
for the config's optimizer, the data iterator at its start), plus hf_config.json (the original
config.json, for the way back). `launch.generate --workdir=DIR` samples from it; `launch.train`
with the same --config (the printed command) fine-tunes it. --init_mtp gives a checkpoint
without MTP weights (the release) a freshly initialised MTP layer.

workdir -> HF: the newest readable checkpoint (or --step) written as the release is: config.json,
safetensors shards of at most --max_shard_bytes with their index, routed experts in MXFP4
(--experts=bf16: bfloat16).

Bad input (a missing file, tensor or config field, a wrong shape, an unknown tensor) prints
`error: ...` naming it and exits 2; nothing is written (outputs are built in a temporary directory
renamed at the end).
"""
import json
import os
import shlex
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from k3jax import checkpoint, data, generate, hf, sharding, train
from k3jax import config as config_lib
from launch import cli

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "experiments", "configs", "k3_full.py")
HF_CONFIG = "hf_config.json"

_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "HF -> workdir: the experiment config of every section but the "
    "model's (train, data, mesh, kernels) and of the model fields config.json lacks.",
    lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Kimi K3 checkpoint directory to read.")
_WORKDIR = flags.DEFINE_string("workdir", None, "k3jax workdir: written (with --hf_dir) or read "
                               "(with --hf_out).")
_HF_OUT = flags.DEFINE_string("hf_out", None, "Kimi K3 checkpoint directory to write (must not "
                              "exist).")
_INIT_MTP = flags.DEFINE_bool("init_mtp", False, "HF -> workdir: a freshly initialised MTP layer "
                              "when the checkpoint has none.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of a freshly initialised MTP layer.")
_EXPERTS = flags.DEFINE_enum("experts", "mxfp4", hf.EXPERT_FORMATS, "workdir -> HF: the routed "
                             "experts' form.")
_MAX_SHARD_BYTES = flags.DEFINE_integer("max_shard_bytes", 5 * 10**9, "workdir -> HF: most bytes "
                                        "of one safetensors shard.", lower_bound=1)
_STEP = flags.DEFINE_integer("step", None, "workdir -> HF: checkpoint step (default: the newest "
                             "readable one).")


def _reject(names: tuple[str, ...], direction: str) -> None:
  """FlagError for a flag (or a `--config.x` override) that `direction` does not use."""
  for name in names:
    if flags.FLAGS[name].present or any(a.startswith(f"--{name}.") for a in sys.argv[1:]):
      raise cli.FlagError(f"--{name} does not apply to {direction}")


def train_command(workdir: str, base, cfg) -> str:
  """The launch.train command that fine-tunes `workdir`: this command's --config and its
  overrides, then `--config.x=v` for each field where `cfg` (config.json's model) differs."""
  fields = [line.split(": ", 1)[0] for line in config_lib.differences(base, cfg)]
  args = ["python", "-m", "launch.train",
          f"--config={os.path.relpath(config_flags.get_config_filename(flags.FLAGS['config']))}",
          f"--workdir={workdir}"]
  args += [a for a in sys.argv[1:] if a.startswith("--config.")]
  args += [f"--config.{f}={config_lib.get(cfg, f)}" for f in fields]
  return shlex.join(args)


def hf_to_workdir(hf_dir: str, workdir: str, base, *, init_mtp: bool, seed: int):
  """Converts; returns the config written into the workdir."""
  if os.path.isdir(workdir) and os.listdir(workdir):
    raise cli.FlagError(f"--workdir={workdir} is not empty; converting writes a new workdir")
  mesh = sharding.make_mesh(base.mesh)
  cfg, model = hf.load_checkpoint(hf_dir, mesh=mesh, config=base, init_mtp=init_mtp, seed=seed)
  _, params, buffers = nnx.split(model, nnx.Param, ...)
  params, buffers = nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)
  t = cfg.train
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "buffers": buffers,
           "opt_state": jax.jit(train.make_optimizer(t, params).init)(params)}
  data_iter = data.make_train_iterator(cfg.data, seq_len=t.seq_len,
                                       batch_size=t.global_batch_size,
                                       vocab_size=cfg.model.vocab_size, seed=t.seed)
  workdir = os.path.abspath(workdir)
  parent = os.path.dirname(workdir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(workdir)}.tmp-", dir=parent)
  try:
    ckpt = checkpoint.Checkpointer(tmp, every_n_steps=t.checkpoint_every,
                                   max_to_keep=t.keep_checkpoints, async_save=False)
    with checkpoint.quiet_libraries():
      ckpt.save(0, state, data_iter, force=True)
      ckpt.close()
    with open(os.path.join(tmp, "config.json"), "w") as f:
      f.write(cfg.to_json(indent=2))
    shutil.copyfile(os.path.join(hf_dir, hf.CONFIG_FILE), os.path.join(tmp, HF_CONFIG))
    if os.path.isdir(workdir):
      os.rmdir(workdir)
    os.rename(tmp, workdir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return cfg


def workdir_to_hf(workdir: str, hf_out: str, *, experts: str, max_shard_bytes: int,
                  step: int | None) -> int:
  """Converts; returns the checkpoint step written."""
  if os.path.exists(hf_out):
    raise cli.FlagError(f"--hf_out={hf_out} exists; converting writes a new directory")
  model, cfg, step = generate.load_model(workdir, step=step)
  hf_config = None
  path = os.path.join(workdir, HF_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      hf_config = json.load(f)
  hf.save_checkpoint(cfg, model, hf_out, experts=experts, max_shard_bytes=max_shard_bytes,
                     hf_config=hf_config)
  return step


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _HF_DIR.value and _WORKDIR.value and not _HF_OUT.value:
    _reject(("experts", "max_shard_bytes", "step"), "--hf_dir -> --workdir")
    base = config_lib.validate(_CONFIG.value)
    cfg = hf_to_workdir(_HF_DIR.value, _WORKDIR.value, base, init_mtp=_INIT_MTP.value,
                        seed=_SEED.value)
    print(f"converted {_HF_DIR.value} into {_WORKDIR.value} (checkpoint step 0)\n"
          f"fine-tune: {train_command(_WORKDIR.value, base, cfg)}\n"
          f"sample: python -m launch.generate --workdir={_WORKDIR.value}")
  elif _WORKDIR.value and _HF_OUT.value and not _HF_DIR.value:
    _reject(("config", "init_mtp", "seed"), "--workdir -> --hf_out")
    step = workdir_to_hf(_WORKDIR.value, _HF_OUT.value, experts=_EXPERTS.value,
                         max_shard_bytes=_MAX_SHARD_BYTES.value, step=_STEP.value)
    print(f"converted {_WORKDIR.value} (checkpoint step {step}) into {_HF_OUT.value} "
          f"(experts {_EXPERTS.value})")
  else:
    raise cli.FlagError("give --hf_dir and --workdir (HF -> workdir) or --workdir and --hf_out "
                        "(workdir -> HF)")


if __name__ == "__main__":
  cli.run(main)
