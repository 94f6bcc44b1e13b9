r"""Where one training step's device time goes, by part of the model and the step (issue 23, item 1).

Each op of an XLA profiler trace names its HLO op (`args.hlo_op`, `args.hlo_module`); the step's
compiled HLO gives each op the JAX name stack it came from (`metadata={op_name="jit(step)/
transpose(jvp(loss_fn))/.../kda/..."}`), and the `jax.named_scope`s in k3jax name the parts.
An op goes to the first part of `PARTS` whose scope is on its stack; ops that a `jax.checkpoint`
(remat) recomputes in the backward carry `rematted_computation` and go to "remat recomputation"
(what they recompute is kept as a breakdown). Backward ops carry `transpose(...)`.

Device ops are the events of `/device:*` timelines; a CPU run has none, so there the XLA:CPU
thunks' events (host threads, with `hlo_op`) are used. A kernel run inside a CUDA graph names the
graph's op (`command_buffer_1`) instead of its own: it is matched by its kernel name where that
is its fusion's ("loop_add_fusion_42" for `loop_add_fusion.42`), else it is left out of the
parts (so `train_step.py` traces a compilation without CUDA graphs). Time is exclusive: an event's time minus
its nested events' (on CPU a `while` thunk contains its body's thunks).

`benchmarks/train_step.py --profile_dir=DIR` writes the table (and `DIR/train_step.hlo.txt`);
again from those files: `python3 -m benchmarks.step_parts --parts_dir=DIR [--parts_steps=2]`.
"""
import collections
import gzip
import json
import pathlib
import re

from absl import app, flags

from benchmarks.common import find_trace

# (part, scopes that select it), first match wins; scope names are the k3jax named scopes. The
# main and the MTP cross-entropy share a row: XLA keeps one copy of their identical loop bodies,
# whose ops then carry the main loss's name stack for both.
PARTS = (
    ("remat recomputation", ("rematted_computation",)),
    ("QK-Clip", ("qk_clip",)),
    ("MoE bias update", ("bias_update",)),
    ("optimizer: Muon (Newton-Schulz, momentum)", ("muon",)),
    ("optimizer: AdamW", ("adamw",)),
    ("optimizer: clip and apply", ("optimizer",)),
    ("LM head + CE (main and MTP)", ("lm_head_ce", "lm_loss", "mtp_loss")),
    ("MTP block", ("mtp",)),
    ("MoE routing", ("moe_routing",)),
    ("MoE permutations (dispatch, combine)", ("moe_dispatch", "moe_combine")),
    ("MoE expert GEMMs", ("moe_experts",)),
    ("MoE latent projections", ("moe_latent",)),
    ("MoE shared experts", ("moe_shared",)),
    ("MoE balancing statistics", ("moe_stats",)),
    ("MoE other", ("moe",)),
    ("MLA attention", ("mla",)),
    ("KDA layers", ("kda",)),
    ("AttnRes", ("attn_res",)),
    ("dense FFN", ("dense_ffn",)),
    ("norms", ("norm",)),
    ("metrics", ("metrics",)),
    ("other: unscoped loop bodies (layer scan slicing, carries)", ("while",)),
)
OTHER = "other (no part scope)"
UNMATCHED = "other (no JAX name stack: XLA-made copies, initial values)"

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r"metadata=\{[^}]*op_name=\"([^\"]*)\"")
_CALLEES = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)"
                      r"|\bbranch_computations=\{([^}]*)\}")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_KERNEL_SUFFIX = re.compile(r"_(\d+)$")  # a fusion's kernel: "loop_add_fusion_42" for op ".42"
_WRAP = re.compile(r"^[\w.\-]+\((.*)\)$")


def hlo_module_name(hlo_text: str) -> str:
  """The name of the module in `compiled.as_text()` (e.g. "jit_step")."""
  m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
  if not m:
    raise ValueError("hlo_text does not start with an HloModule line")
  return m.group(1)


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its JAX name stack (op_name metadata).

  An op without metadata (XLA made it: a copy, a loop state's initial value) takes its called
  computation's root's, else that of the op calling its computation (a `while` body's op takes
  the `while`'s); ops of the entry computation without metadata are left out.
  """
  names, comp_of, callees, callers, roots, comp = {}, {}, {}, {}, {}, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("(")[0]:
      comp = m.group(1)
      continue
    m = _INSTR.match(line)
    if not m or comp is None:
      continue
    op = m.group(1)
    comp_of[op] = comp
    if line.lstrip().startswith("ROOT"):
      roots[comp] = op
    if (meta := _OP_NAME.search(line)):
      names[op] = meta.group(1)
    for one, many in _CALLEES.findall(line):
      for callee in (one or many).split(","):
        callee = callee.strip().lstrip("%")
        callees.setdefault(op, callee)
        callers.setdefault(callee, op)

  memo: dict[str, str | None] = {}

  def resolve(op: str, depth: int = 0) -> str | None:
    """Memoised (each op resolved once: the walk down to roots and up to callers branches);
    an op on the current walk resolves to None, which breaks cycles."""
    if op in names or depth > 50:
      return names.get(op)
    if op in memo:
      return memo[op]
    memo[op] = None
    root = roots.get(callees.get(op, ""))
    found = resolve(root, depth + 1) if root and root != op else None
    caller = callers.get(comp_of.get(op, ""))
    if found is None and caller is not None:
      found = resolve(caller, depth + 1)
    memo[op] = found
    return found

  return {op: n for op in comp_of if (n := resolve(op)) is not None}


def scopes(op_name: str) -> list[str]:
  """The names on a stack, transformations unwrapped: "transpose(jvp(kda))" -> "kda"."""
  out = []
  for part in op_name.split("/"):
    while (m := _WRAP.match(part)):
      part = m.group(1)
    out.append(part)
  return out


def classify(op_name: str) -> tuple[str, str]:
  """(part, phase) of an op from its name stack; phase is "fwd", "bwd" or "remat"."""
  names = set(scopes(op_name))
  if "rematted_computation" in names:
    phase = "remat"
  else:
    phase = "bwd" if "transpose(" in op_name else "fwd"
  for part, selectors in PARTS:
    if names.intersection(selectors):
      return part, phase
  return OTHER, phase


_KERNEL_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+\s+"
                        r"(fusion|custom-call|dot|convolution)\(")


def kernel_counts(hlo_text: str) -> dict[tuple[str, str], int]:
  """(part, phase) -> kernels in a compiled module's text (`compiled.as_text()`)."""
  names = hlo_op_names(hlo_text)
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    if (m := _KERNEL_OP.match(line)):
      counts[classify(names.get(m.group(1), ""))] += 1
  return dict(counts)


def _exclusive_times(events: list[dict]) -> list[tuple[dict, float]]:
  """(event, its duration minus the time of events nested in it on its thread; an event that
  starts inside another and ends after it counts only its overlap)."""
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[(e["pid"], e.get("tid"))].append(e)
  out = []
  for evs in by_thread.values():
    evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    stack: list[list] = []  # [event, end, child time]
    for e in evs:
      start, dur = float(e["ts"]), float(e["dur"])
      while stack and stack[-1][1] <= start:
        done = stack.pop()
        out.append((done[0], float(done[0]["dur"]) - done[2]))
      if stack:
        stack[-1][2] += min(start + dur, stack[-1][1]) - start
      stack.append([e, start + dur, 0.0])
    out.extend((done[0], float(done[0]["dur"]) - done[2]) for done in stack)
  return out


def op_events(trace: dict) -> list[dict]:
  """The events of device ops: the `/device:*` timelines' events, or on a CPU run the host's
  events that name an HLO op."""
  events = trace["traceEvents"]
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if devices:
    return [e for e in spans if e["pid"] in devices]
  return [e for e in spans if "hlo_op" in e.get("args", {})]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The union of [start, end) intervals, sorted and disjoint."""
  merged: list[list[float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def length(intervals) -> float:
  return sum(e - s for s, e in intervals)


def timelines(trace: dict, steps: int) -> list[dict]:
  """Per device timeline (process, thread): events, their summed and their busy (union) ms per
  step, and the span from its first event's start to its last event's end. Busy below the
  step's wall time is time with no kernel running on that timeline."""
  events = trace["traceEvents"]
  names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "thread_name"}
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  by_line = collections.defaultdict(list)
  for e in op_events(trace):
    by_line[(e["pid"], e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  ms = lambda us: round(us / steps / 1e3, 3)
  out = []
  for key, spans in sorted(by_line.items(), key=lambda kv: -len(kv[1])):
    busy = union(spans)
    out.append(dict(process=procs.get(key[0], str(key[0])), thread=names.get(key, str(key[1])),
                    events=len(spans), summed_ms=ms(length(spans)), busy_ms=ms(length(busy)),
                    span_ms=ms(busy[-1][1] - busy[0][0])))
  return out


def part_records(trace: dict, hlo_text: str, steps: int) -> list[dict]:
  """One record per part: ms per step (total, forward, backward), share of the step's device time
  and, for "remat recomputation", what it recomputes. Largest first."""
  module = hlo_module_name(hlo_text)
  names = hlo_op_names(hlo_text)
  totals = collections.defaultdict(lambda: collections.defaultdict(float))
  recomputed = collections.defaultdict(float)
  for e, us in _exclusive_times(op_events(trace)):
    args = e.get("args", {})
    if args.get("hlo_module", module) != module:
      continue
    op_name = names.get(args.get("hlo_op", "")) or names.get(_KERNEL_SUFFIX.sub(r".\1", e["name"]))
    part, phase = classify(op_name) if op_name is not None else (UNMATCHED, "fwd")
    totals[part][phase] += us
    if phase == "remat":
      recomputed[classify(op_name.replace("rematted_computation", ""))[0]] += us
  total = sum(sum(p.values()) for p in totals.values())
  if not total:
    raise ValueError(f"the trace has no op of HLO module {module}")
  recs = []
  for part, phases in totals.items():
    us = sum(phases.values())
    rec = dict(part=part, ms_per_step=round(us / steps / 1e3, 4), share=round(us / total, 4),
               fwd_ms=round(phases["fwd"] / steps / 1e3, 4),
               bwd_ms=round(phases["bwd"] / steps / 1e3, 4))
    if phases["remat"]:
      rec["recomputed_ms"] = {p: round(v / steps / 1e3, 4)
                              for p, v in sorted(recomputed.items(), key=lambda kv: -kv[1])}
    recs.append(rec)
  return sorted(recs, key=lambda r: -r["ms_per_step"])


def markdown(records: list[dict]) -> str:
  """The records as a Markdown table (+ the remat breakdown)."""
  lines = ["| part | ms / step | share | forward ms | backward ms |", "|---|---:|---:|---:|---:|"]
  for r in records:
    lines.append(f"| {r['part']} | {r['ms_per_step']:.3f} | {100 * r['share']:.1f}% | "
                 f"{r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} |")
  total = sum(r["ms_per_step"] for r in records)
  lines.append(f"| **total** | {total:.3f} | 100.0% | | |")
  for r in records:
    if "recomputed_ms" in r:
      lines.append("\nremat recomputes: " + ", ".join(
          f"{p} {ms:.3f} ms" for p, ms in r["recomputed_ms"].items()))
  return "\n".join(lines)


HLO_FILE = "train_step.hlo.txt"
_DIR = flags.DEFINE_string("parts_dir", None, "The --profile_dir of train_step.py: its trace "
                            f"and {HLO_FILE}.")
_STEPS = flags.DEFINE_integer("parts_steps", 2, "Steps in the trace.")


def load_dir(profile_dir: str) -> tuple[dict, str]:
  """(the newest trace under `profile_dir`, its `HLO_FILE`'s text)."""
  with gzip.open(find_trace(profile_dir)) as f:
    trace = json.load(f)
  return trace, (pathlib.Path(profile_dir) / HLO_FILE).read_text()


def table_from_dir(profile_dir: str, steps: int) -> list[dict]:
  """`part_records` of the newest trace under `profile_dir` and its `HLO_FILE`."""
  return part_records(*load_dir(profile_dir), steps)


def main(argv):
  del argv
  trace, hlo = load_dir(_DIR.value)
  print(markdown(part_records(trace, hlo, _STEPS.value)))
  for line in timelines(trace, _STEPS.value):
    print(line)


if __name__ == "__main__":
  flags.mark_flag_as_required("parts_dir")
  app.run(main)
