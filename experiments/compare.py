r"""Train variants of a config side by side and plot their curves.

  python -m experiments.compare --name=optimizers --steps=300 \
      --variants="adamw:train.optimizer=adamw;muon:train.optimizer=muon;muon_whole:train.optimizer=muon_whole" \
      --metrics=lm_loss

Each variant is `label:field=value,field=value`; runs go to WORKDIR/<label> (resuming if present),
the figure and a JSON summary to experiments/results/<name>.{png,json}.
"""
import ast
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import app, flags

from k3jax import config as config_lib
from k3jax import loop

_NAME = flags.DEFINE_string("name", None, "Experiment name (output file stem).")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/k3_tiny.py", "Base config file.")
_VARIANTS = flags.DEFINE_string("variants", None, "label:field=value,...;label:...")
_METRICS = flags.DEFINE_list("metrics", ["lm_loss"], "Metrics to plot, one panel each.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per variant.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Parent of the variants' workdirs.")
_OUTDIR = flags.DEFINE_string("outdir", "experiments/results", "Where the PNG and JSON go.")
_SMOOTH = flags.DEFINE_float("smooth", 0.8, "EMA factor for the plotted curves (0 = raw).")
flags.mark_flags_as_required(["name", "variants"])


def _parse_value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_variants(spec: str) -> dict[str, dict]:
  """'a:x.y=1,z=foo;b:...' -> {'a': {'x.y': 1, 'z': 'foo'}, ...}."""
  out = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    label, _, assigns = part.partition(":")
    overrides = {}
    for item in filter(None, assigns.split(",")):
      field, _, value = item.partition("=")
      overrides[field.strip()] = _parse_value(value.strip())
    out[label.strip()] = overrides
  return out


def read_metrics(workdir: str) -> list[dict]:
  """metrics.jsonl, last record per step (a resumed run may repeat steps)."""
  by_step = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      by_step[rec["step"]] = rec
  return [by_step[s] for s in sorted(by_step)]


def ema(values: list[float], factor: float) -> list[float]:
  """Exponential moving average, started at the first value (same-data noise hides trends)."""
  out, acc = [], None
  for v in values:
    acc = v if acc is None else factor * acc + (1 - factor) * v
    out.append(acc)
  return out


def main(argv):
  del argv
  variants = parse_variants(_VARIANTS.value)
  curves = {}
  for label, overrides in variants.items():
    cfg = config_lib.load(_CONFIG.value, {"train.steps": _STEPS.value, "train.log_every": 5,
                                          **overrides})
    workdir = os.path.join(_WORKDIR.value, _NAME.value, label)
    loop.run(cfg, workdir)
    curves[label] = read_metrics(workdir)
  fig, axes = plt.subplots(1, len(_METRICS.value), figsize=(6 * len(_METRICS.value), 4),
                           squeeze=False)
  summary = {}
  for ax, metric in zip(axes[0], _METRICS.value):
    for label, recs in curves.items():
      pts = [(r["step"], r[metric]) for r in recs if metric in r]
      ax.plot([p[0] for p in pts], ema([p[1] for p in pts], _SMOOTH.value), label=label)
      tail = [p[1] for p in pts[-5:]]
      summary.setdefault(label, {})[f"{metric}_final_mean5"] = sum(tail) / max(len(tail), 1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{metric} (EMA {_SMOOTH.value})" if _SMOOTH.value else metric)
    ax.set_title(f"{_NAME.value}: {metric}")
    ax.legend()
  os.makedirs(_OUTDIR.value, exist_ok=True)
  fig.tight_layout()
  fig.savefig(os.path.join(_OUTDIR.value, f"{_NAME.value}.png"), dpi=110)
  with open(os.path.join(_OUTDIR.value, f"{_NAME.value}.json"), "w") as f:
    json.dump({"config": _CONFIG.value, "steps": _STEPS.value, "variants": variants,
               "summary": summary}, f, indent=1)
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  app.run(main)
