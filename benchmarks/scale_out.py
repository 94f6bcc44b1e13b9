r"""Training on several devices: the data, expert and pipeline axes against one device.

Each run trains `--config` (k3_small) for `--steps` steps with `k3jax.loop.run` (the real loop:
default data, the config's optimizer, checkpoints at the end) on a mesh given by a run spec,
in its own process with exactly the devices the mesh uses (CUDA_VISIBLE_DEVICES on GPUs, virtual
devices on CPU), and records:
- tokens/s (median over the steps after the first `WARMUP_STEPS`, each step timed by the loop's
  per-step metrics fetch), MFU against the device's peak, per-device peak memory
  (`memory_stats`, null where the platform has none), the loss of every step;
- from an XLA trace of two steps (`PROFILED_STEPS`; GPU only, a CPU trace has no device
  timeline): per device, the share of the step in all-to-all kernels (expert parallelism),
  collective-permute / send-recv kernels (the pipeline's carries), other collectives (FSDP
  gathers, gradient reductions), the exposed part of each (no compute kernel running beside
  it), and idle time (no kernel at all: launch gaps, and on a pipeline its bubbles).
A run spec is `key=value` pairs joined by commas: the mesh axes `data`, `expert`, `pipeline`,
`context` (default 1) and optionally `batch` (global batch; default per_device_batch x data x
expert, the batch shards) and `accum` (train.grad_accum_steps; default 2 x pipeline, the
1F1B micro-batches, or 1). Runs are separated by semicolons.
Derived for each run (in its record): `scaling_efficiency` = tokens/s per device against a
one-device run with the same per-device batch, and `max_loss_rel_diff` against a one-device run
with the same global batch (the same math; `accum` keeps it in memory); the one-device runs of
earlier invocations in --out (same config and device) count.

  python3 -m benchmarks.scale_out --runs="data=1;data=1,batch=4,accum=2;data=2;expert=2" \
      --out=$OUT/scale_out_h200.json
`--toy` trains a 4-layer k3_tiny on CPU devices (`XLA_FLAGS` sets how many exist).
"""
import collections
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags
import jax

from benchmarks import common, step_parts
from k3jax import config as config_lib, flops, loop

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when the module runs as a program only: the tests import
  its functions beside other benchmark modules that define flags of the same names."""
  flags.DEFINE_string("out", "benchmarks/results/scale_out_h200.json", "Records (JSON list).")
  flags.DEFINE_string("config", "experiments/configs/k3_small.py", "Config file.")
  flags.DEFINE_string("runs", "data=1;data=2", "Run specs (module docstring).")
  flags.DEFINE_integer("per_device_batch", 2, "Sequences per batch shard.")
  flags.DEFINE_integer("steps", 12, "Training steps per run.", lower_bound=5)
  flags.DEFINE_integer("seq_len", 0, "train.seq_len (0: the config's).")
  flags.DEFINE_integer("run_s", 900, "Seconds a run may take before it is stopped.")
  flags.DEFINE_bool("toy", False, "A 4-layer k3_tiny at T 32 on CPU devices.")
  flags.DEFINE_string("run_one", "", "Internal: run this spec in this process and print its "
                      "record after RESULT.")


WARMUP_STEPS = 2
PROFILED_STEPS = 2
MESH_AXES = ("data", "expert", "pipeline", "context")
TOY_OVERRIDES = {"model.num_layers": 4, "model.full_attn_layers": (2, 4),
                 "model.attn_res_block_size": 2, "data.default_num_docs": 400}
KEY_FIELDS = ("op", "config", "run", "device")


def parse_spec(spec: str, per_device_batch: int) -> dict[str, int]:
  """{data, expert, pipeline, context, batch, accum, devices} of a run spec; ValueError naming
  the bad item."""
  out = dict.fromkeys(MESH_AXES, 1)
  given = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    key, sep, value = item.partition("=")
    if not sep or key not in (*MESH_AXES, "batch", "accum") or not value.isdigit() or (
        int(value) < 1):
      raise ValueError(f"run spec {spec!r}: bad item {item!r} (want key=positive integer, key "
                       f"one of {', '.join(MESH_AXES)}, batch, accum)")
    given[key] = int(value)
  out.update({k: v for k, v in given.items() if k in MESH_AXES})
  out["batch"] = given.get("batch", per_device_batch * out["data"] * out["expert"])
  out["accum"] = given.get("accum", 2 * out["pipeline"] if out["pipeline"] > 1 else 1)
  out["devices"] = math.prod(out[a] for a in MESH_AXES)
  return out


def overrides(run: dict[str, int], toy: bool, steps: int, seq_len: int) -> dict:
  """Config overrides of a run: its mesh, batch and micro-batches (and the scanned layers a
  pipeline splits), a metrics row per step, one checkpoint at the end."""
  out = {f"mesh.{a}": run[a] for a in MESH_AXES}
  out.update({"train.global_batch_size": run["batch"], "train.grad_accum_steps": run["accum"],
              "train.steps": steps, "train.log_every": 1, "train.checkpoint_every": steps})
  if run["pipeline"] > 1:
    out["model.scan_layers"] = True
  if seq_len:
    out["train.seq_len"] = seq_len
  if toy:
    out.update(TOY_OVERRIDES)
    out.setdefault("train.seq_len", 32)
  return out


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  """Length of the union `a` outside the union `b` (both sorted, disjoint)."""
  total, j = 0.0, 0
  for s, e in a:
    cur = s
    while j < len(b) and b[j][1] <= cur:
      j += 1
    k = j
    while k < len(b) and b[k][0] < e:
      if b[k][0] > cur:
        total += b[k][0] - cur
      cur = max(cur, b[k][1])
      k += 1
    total += max(0.0, e - cur)
  return total


def collective_kind(name: str) -> str | None:
  """"all_to_all", "permute" (collective-permute / send-recv: the pipeline's carries),
  "other" (all-reduce, all-gather, reduce-scatter) or None (compute) for a kernel name."""
  n = name.lower().replace("-", "").replace("_", "")
  if "alltoall" in n:
    return "all_to_all"
  if "sendrecv" in n or "collectivepermute" in n or "ncclsend" in n or "ncclrecv" in n:
    return "permute"
  if any(k in n for k in ("allreduce", "allgather", "reducescatter", "nccl")):
    return "other"
  return None


def trace_shares(trace: dict, steps: int) -> dict:
  """Per device of an XLA trace of `steps` steps: ms per step of the span (first kernel start
  to last kernel end), busy time (any kernel), each collective kind's kernel time and its
  exposed part (no compute kernel beside it), idle time; and their shares of the span averaged
  over the devices."""
  names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  spans: dict[int, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
  for e in step_parts.op_events(trace):
    interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    spans[e["pid"]][collective_kind(e["name"]) or "compute"].append(interval)
  per_device = {}
  for pid, kinds in sorted(spans.items()):
    everything = step_parts.union([i for ivs in kinds.values() for i in ivs])
    compute = step_parts.union(kinds.get("compute", []))
    span = everything[-1][1] - everything[0][0]
    busy = step_parts.length(everything)
    row = {"span_ms": span / steps / 1e3, "busy_ms": busy / steps / 1e3,
           "idle_ms": (span - busy) / steps / 1e3}
    for kind in ("all_to_all", "permute", "other"):
      ivs = step_parts.union(kinds.get(kind, []))
      row[f"{kind}_ms"] = step_parts.length(ivs) / steps / 1e3
      row[f"{kind}_exposed_ms"] = _minus(ivs, compute) / steps / 1e3
    per_device[names[pid]] = {k: round(v, 3) for k, v in row.items()}
  shares = {}
  if per_device:
    for key in next(iter(per_device.values())):
      if key != "span_ms":
        shares[key.replace("_ms", "_share")] = round(statistics.mean(
            r[key] / r["span_ms"] for r in per_device.values() if r["span_ms"] > 0), 4)
  return {"per_device": per_device, "shares": shares}


def run_one(spec: str) -> dict:
  """Trains one run in this process (its devices set by the parent) and returns its record."""
  run = parse_spec(spec, FLAGS.per_device_batch)
  toy = FLAGS.toy
  config_file = "experiments/configs/k3_tiny.py" if toy else FLAGS.config
  cfg = config_lib.load(config_file, overrides(run, toy, FLAGS.steps, FLAGS.seq_len))
  if jax.device_count() != run["devices"]:
    raise RuntimeError(f"run {spec!r} needs {run['devices']} devices, this process has "
                       f"{jax.device_count()}")
  steps = cfg.train.steps
  window = (steps - PROFILED_STEPS, steps)
  with tempfile.TemporaryDirectory() as workdir:
    history = loop.run(cfg, workdir, profile_window=window)
    shares = None
    profile = os.path.join(workdir, "profile")
    if jax.devices()[0].platform != "cpu" and os.path.isdir(profile):
      with gzip.open(common.find_trace(profile)) as f:
        shares = trace_shares(json.load(f), PROFILED_STEPS)
  timed = [h["tokens_per_sec"] for h in history
           if WARMUP_STEPS < h["step"] <= window[0]]
  tok_s = statistics.median(timed)
  counts = flops.count_params(cfg.model)
  per_token = flops.train_flops_per_token(cfg.model, cfg.train.seq_len, counts)
  peak, peak_source = flops.peak_flops_per_device()
  memory = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  return dict(
      op="scale_out", config=cfg.name, run=spec, mesh={a: run[a] for a in MESH_AXES},
      devices=run["devices"], global_batch=run["batch"], grad_accum_steps=run["accum"],
      per_device_batch=run["batch"] / (run["data"] * run["expert"]), seq_len=cfg.train.seq_len,
      steps=steps, tokens_per_s=round(tok_s, 1),
      tokens_per_s_per_device=round(tok_s / run["devices"], 1),
      mfu=round(tok_s * per_token / (peak * run["devices"]), 4), peak_source=peak_source,
      peak_memory_bytes=memory, losses=[round(h["loss"], 6) for h in history],
      trace=shares, device=common.device_name(), date=common.today(),
      commit=common.code_commit(), versions=common.versions())


def derive(records: list[dict]) -> None:
  """Adds scaling_efficiency and max_loss_rel_diff to each record (module docstring)."""
  singles = [r for r in records if r["devices"] == 1]
  for r in records:
    base = next((s for s in singles if s["per_device_batch"] == r["per_device_batch"]
                 and s["seq_len"] == r["seq_len"]), None)
    r["scaling_efficiency"] = (None if base is None else round(
        r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"], 4))
    same = next((s for s in singles if s["global_batch"] == r["global_batch"]
                 and s["seq_len"] == r["seq_len"]), None)
    r["max_loss_rel_diff"] = (None if same is None else max(
        abs(a - b) / abs(b) for a, b in zip(r["losses"], same["losses"])))


def earlier(records: list[dict]) -> list[dict]:
  """The records in --out of the same config and device as `records` but of other runs: the
  one-device baselines of earlier invocations count for `derive`."""
  if not os.path.exists(FLAGS.out):
    return []
  now = records[-1]
  with open(FLAGS.out) as f:
    return [r for r in json.load(f) if r.get("op") == "scale_out" and r["config"] == now["config"]
            and r["device"] == now["device"] and r["run"] not in {x["run"] for x in records}]


def _child_env(devices: int, toy: bool) -> dict[str, str]:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if toy:
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  else:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
  return env


def main(argv):
  del argv
  if FLAGS.run_one:
    print("RESULT" + json.dumps(run_one(FLAGS.run_one)), flush=True)
    return
  specs = [s.strip() for s in FLAGS.runs.split(";") if s.strip()]
  for spec in specs:      # every spec checked before anything runs
    parse_spec(spec, FLAGS.per_device_batch)
  records = []
  for spec in specs:
    run = parse_spec(spec, FLAGS.per_device_batch)
    args = [sys.executable, "-m", "benchmarks.scale_out", f"--run_one={spec}",
            f"--config={FLAGS.config}", f"--per_device_batch={FLAGS.per_device_batch}",
            f"--steps={FLAGS.steps}", f"--seq_len={FLAGS.seq_len}"] + (
                ["--toy"] if FLAGS.toy else [])
    try:
      proc = subprocess.run(args, capture_output=True, text=True, timeout=FLAGS.run_s,
                            env=_child_env(run["devices"], FLAGS.toy))
    except subprocess.TimeoutExpired:
      print(f"{spec}: stopped after {FLAGS.run_s} s", flush=True)
      continue
    if proc.returncode != 0 or "RESULT" not in proc.stdout:
      print(f"{spec}: failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
      continue
    rec = json.loads(proc.stdout.split("RESULT", 1)[1])
    records.append(rec)
    derive(records + earlier(records))   # this invocation's one-device runs first
    shares = (rec["trace"] or {}).get("shares", {})
    print(f"{spec:36s} {rec['tokens_per_s']:10.1f} tok/s  {100 * rec['mfu']:5.2f}% MFU  "
          f"efficiency {rec['scaling_efficiency']}  loss diff {rec['max_loss_rel_diff']}  "
          f"all-to-all {shares.get('all_to_all_share')}  idle {shares.get('idle_share')}",
          flush=True)
    common.merge_records(FLAGS.out, records, KEY_FIELDS)   # a run cut short keeps the others


if __name__ == "__main__":
  define_flags()
  app.run(main)
