r"""Held-out loss of a trained model with its routed experts as trained and packed to MXFP4.

  python -m experiments.mx_eval --workdir=runs/compare/qat/qat

Loads the newest checkpoint of WORKDIR twice, as trained and with
`model.moe.expert_format=mxfp4` (the routed experts packed at load, `k3jax.mx.pack_experts`;
k3_techniques.md §7), and prints both models' next-token loss on --batches batches (the run's
batch shape) of generated documents the run never saw: the default corpus under another seed.
--overrides=field=value,... sets config fields for both loads (`model.moe.qat=True`: MXFP8
expert inputs, e.g. for a model trained without QAT).
"""
import ast
import json

import grain
import jax
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx

from k3jax import data, generate, train
from launch import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json, checkpoints/).")
_BATCHES = flags.DEFINE_integer("batches", 16, "Held-out batches.", lower_bound=1)
_OVERRIDES = flags.DEFINE_string("overrides", "", "field=value,... set for both loads.")
flags.mark_flags_as_required(["workdir"])

HELD_OUT_SEED = data.DEFAULT_CORPUS_SEED + 1


def parse_overrides(text: str) -> dict:
  """'a.b=1,c.d=foo' -> {'a.b': 1, 'c.d': 'foo'} (Python literals, else strings)."""
  out = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    field, _, value = item.partition("=")
    try:
      out[field.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[field.strip()] = value.strip()
  return out


def held_out_batches(cfg: ml_collections.ConfigDict, count: int) -> list[dict]:
  """`count` packed batches [B, T] of generated documents under HELD_OUT_SEED."""
  corpus = data.DefaultCorpus(cfg.data.default_num_docs, seed=HELD_OUT_SEED)
  batches = iter(data.pack_documents(grain.MapDataset.source(corpus).to_iter_dataset(),
                                     seq_len=cfg.train.seq_len,
                                     batch_size=cfg.train.global_batch_size))
  return [next(batches) for _ in range(count)]


def mean_lm_loss(model, batches: list[dict]) -> float:
  """The next-token loss (`train.loss_fn`'s, MTP apart), averaged over the batches."""
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  loss = jax.jit(lambda params, buffers, batch: train.loss_fn(params, buffers, graphdef,
                                                              batch)[1][1])
  return float(np.mean([loss(params, buffers, batch) for batch in batches]))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  overrides = parse_overrides(_OVERRIDES.value)
  model, cfg, step = generate.load_model(_WORKDIR.value, overrides=overrides)
  packed, _, _ = generate.load_model(_WORKDIR.value, step=step,
                                     overrides={**overrides, "model.moe.expert_format": "mxfp4"})
  batches = held_out_batches(cfg, _BATCHES.value)
  losses = {"as_trained": mean_lm_loss(model, batches), "mxfp4": mean_lm_loss(packed, batches)}
  print(json.dumps({"workdir": _WORKDIR.value, "step": step, "overrides": overrides,
                    "batches": _BATCHES.value, "lm_loss": losses,
                    "difference": losses["mxfp4"] - losses["as_trained"]}, indent=1))


if __name__ == "__main__":
  cli.run(main)
