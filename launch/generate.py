r"""Sample from a trained model: `python -m launch.generate --workdir=DIR --prompt="..."`.

Loads the newest readable checkpoint in DIR (or `--step`), byte-tokenizes the prompt as
[BOS, utf-8 bytes...] (the tokenizer of the default corpus and of tools/make_token_file.py),
samples up to --max_new_tokens bytes (stopping at EOS) and prints the prompt and the
continuation; bytes that are not valid UTF-8 print as U+FFFD. --temperature=0 is greedy.
`--config.x=y` overrides a field of the workdir's config for sampling, e.g.
`--config.model.moe.expert_format=mxfp4` packs a float checkpoint's routed experts to MXFP4 at
load (`k3jax.mx.pack_experts`).
"""
from absl import app, flags
from ml_collections import config_flags

from experiments.configs import base
from k3jax import data
from k3jax import generate
from launch import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json, checkpoints/).")
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens (bytes) to sample.",
                                       lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.",
                                  lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 0.9, "Nucleus sampling mass in (0, 1]; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest readable one.")
config_flags.DEFINE_config_dict(
    "config", base.get_base_config(), "Only its `--config.x=y` overrides are used: they change "
    "the workdir's config for sampling.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not 0 < _TOP_P.value <= 1:
    raise app.UsageError(f"--top_p must lie in (0, 1], got {_TOP_P.value}")
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  model, cfg, step = generate.load_model(_WORKDIR.value, step=_STEP.value, overrides=overrides)
  if cfg.model.vocab_size < data.BYTE_VOCAB_SIZE:
    raise app.UsageError(f"the model's vocab_size={cfg.model.vocab_size} is smaller than the "
                         f"byte tokenizer's {data.BYTE_VOCAB_SIZE}")
  prompt = data.encode_bytes(_PROMPT.value)[:-1]  # no EOS: the document goes on
  tokens = generate.generate(model, prompt[None], max_new_tokens=_MAX_NEW_TOKENS.value,
                             temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                             seed=_SEED.value, eos_id=data.EOS)
  print(f"[{cfg.name}, step {step}, {_WORKDIR.value}]")
  print(f"prompt: {_PROMPT.value}")
  print(f"continuation: {data.decode_bytes(tokens[0, prompt.size:])}")


if __name__ == "__main__":
  cli.run(main)
