r"""Sample from a model: a training workdir or a Kimi K3 checkpoint directory.

  python -m launch.generate --workdir=DIR --prompt="..."
  python -m launch.generate --hf_dir=HF_DIR --prompts_file=prompts.txt --batch_size=16

--workdir loads the newest readable checkpoint in DIR (or `--step`, `k3jax.generate.load_model`);
--hf_dir a Hugging Face checkpoint (`k3jax.hf.load_checkpoint`; `--config.x=y` sets the fields
its config.json does not, e.g. `--config.model.param_dtype=bfloat16`). Prompts are byte-tokenized
as [BOS, utf-8 bytes...] (the tokenizer of the default corpus and of tools/make_token_file.py;
K3's own tokenizer is not part of k3jax): --prompt, or --prompts_file with one prompt per line,
run --batch_size at a time (the last batch padded with one-token rows). Each continuation samples
up to --max_new_tokens bytes (stopping at EOS); bytes that are not valid UTF-8 print as U+FFFD.
--temperature=0 is greedy. Batches share compiled programs through the buckets
(`k3jax.generate.Buckets`: --min_prompt_bucket, --cache_buckets); each new shape is compiled
first by a one-token run, so the last line's rates (prefill: the prompts' tokens per second;
decode: the new tokens after each row's first per second) exclude compilation. With more than one
device the model is split over a mesh of all of them (the config's `mesh` section and
`mesh.logical_axis_rules`). `--config.x=y` overrides a field of the workdir's config for
sampling, e.g. `--config.model.moe.expert_format=mxfp4` packs a float checkpoint's routed experts
to MXFP4 at load (`k3jax.mx.pack_experts`).
"""
import jax
from absl import app, flags
from ml_collections import config_flags

from experiments.configs import base
from k3jax import data
from k3jax import generate
from k3jax import hf
from k3jax import sharding
from launch import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json, checkpoints/).")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Kimi K3 checkpoint directory (config.json, "
                              "*.safetensors), instead of --workdir.")
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue.")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "UTF-8 text file, one prompt per line "
                                    "(instead of --prompt).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per batch (--prompts_file).",
                                   lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens (bytes) to sample.",
                                       lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.",
                                  lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 0.9, "Nucleus sampling mass in (0, 1]; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (--workdir); default: the newest "
                             "readable one.")
_MIN_PROMPT_BUCKET = flags.DEFINE_integer(
    "min_prompt_bucket", generate.Buckets.min_prompt, "Prompts are padded to the smallest power "
    "of two >= the batch's longest, and at least to this.", lower_bound=1)
_CACHE_BUCKETS = flags.DEFINE_list(
    "cache_buckets", [str(s) for s in generate.Buckets.cache_sizes], "Cache slots to choose "
    "from, increasing (beyond the last: the next power of two).")
config_flags.DEFINE_config_dict(
    "config", base.get_base_config(), "Only its `--config.x=y` overrides are used: they change "
    "the workdir's config for sampling, or the fields an --hf_dir's config.json does not set.")


def _buckets() -> generate.Buckets:
  try:
    sizes = tuple(int(s) for s in _CACHE_BUCKETS.value)
    return generate.Buckets(min_prompt=_MIN_PROMPT_BUCKET.value, cache_sizes=sizes)
  except ValueError as e:
    raise cli.FlagError(f"--cache_buckets must be increasing positive integers, got "
                        f"{','.join(_CACHE_BUCKETS.value)!r} ({e})") from None


def _prompts() -> list[str]:
  if _PROMPTS_FILE.value is None:
    return [_PROMPT.value]
  if flags.FLAGS["prompt"].present:
    raise cli.FlagError("--prompt and --prompts_file exclude each other; give one")
  with open(_PROMPTS_FILE.value, encoding="utf-8") as f:
    lines = f.read().splitlines()
  if not lines:
    raise cli.FlagError(f"--prompts_file={_PROMPTS_FILE.value} holds no prompt (one per line)")
  return lines


def _load(overrides: dict):
  """(model, config, header line, mesh) from --workdir or --hf_dir."""
  if (_WORKDIR.value is None) == (_HF_DIR.value is None):
    raise cli.FlagError("give exactly one of --workdir (a training workdir) and --hf_dir (a Kimi "
                        "K3 checkpoint directory)")
  config = flags.FLAGS["config"].value
  mesh = sharding.make_mesh(config.mesh) if jax.device_count() > 1 else None
  if _HF_DIR.value is not None:
    if _STEP.value is not None:
      raise cli.FlagError("--step applies to --workdir only")
    cfg, model = hf.load_checkpoint(_HF_DIR.value, config=config, mesh=mesh)
    return model, cfg, f"[{cfg.name}, {_HF_DIR.value}]", mesh
  model, cfg, step = generate.load_model(_WORKDIR.value, step=_STEP.value, overrides=overrides,
                                         mesh=mesh)
  return model, cfg, f"[{cfg.name}, step {step}, {_WORKDIR.value}]", mesh


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not 0 < _TOP_P.value <= 1:
    raise cli.FlagError(f"--top_p must lie in (0, 1], got {_TOP_P.value}")
  buckets = _buckets()
  texts = _prompts()
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  model, cfg, header, mesh = _load(overrides)
  if cfg.model.vocab_size < data.BYTE_VOCAB_SIZE:
    raise cli.FlagError(f"the model's vocab_size={cfg.model.vocab_size} is smaller than the "
                        f"byte tokenizer's {data.BYTE_VOCAB_SIZE}")
  prompts = [data.encode_bytes(t)[:-1] for t in texts]  # no EOS: the documents go on
  size = min(_BATCH_SIZE.value, len(prompts))
  settings = dict(max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                  top_p=_TOP_P.value, seed=_SEED.value, eos_id=data.EOS, buckets=buckets,
                  mesh=mesh, rules=cfg.mesh.logical_axis_rules)
  print(header)
  compiled, warmup_s, prompt_tokens, new_tokens, prefill_s, decode_s = set(), 0.0, 0, 0, 0.0, 0.0
  for first in range(0, len(prompts), size):
    batch = prompts[first:first + size]
    rows = batch + [prompts[0][:1]] * (size - len(batch))  # one-token rows fill the last batch
    shape = buckets.shape(size, max(p.size for p in rows), _MAX_NEW_TOKENS.value)
    if _MAX_NEW_TOKENS.value and shape not in compiled:
      compiled.add(shape)
      warmup = generate.generate_timed(model, rows, **{**settings, "max_new_tokens": 1},
                                       cache_len=shape[2])
      warmup_s += warmup.prefill_s + warmup.decode_s
    result = generate.generate_timed(model, rows, **settings)
    prompt_tokens += sum(p.size for p in batch)
    new_tokens += len(batch) * max(result.new_tokens - 1, 0)
    prefill_s += result.prefill_s
    decode_s += result.decode_s
    for text, prompt, tokens in zip(texts[first:], batch, result.tokens):
      print(f"prompt: {text}")
      print(f"continuation: {data.decode_bytes(tokens[prompt.size:])}")
  rate = lambda n, s: f"{n / s:.1f} tokens/s" if s > 0 else "-"
  print(f"prefill: {prompt_tokens} tokens, {prefill_s:.3f} s, {rate(prompt_tokens, prefill_s)}; "
        f"decode: {new_tokens} tokens, {decode_s:.3f} s, {rate(new_tokens, decode_s)}; "
        f"warm-up (compiles): {warmup_s:.1f} s for (batch, prompt, cache) {sorted(compiled)}")


if __name__ == "__main__":
  cli.run(main)
