"""benchmarks.step_parts: a CPU trace of a small K3 training step, attributed to its parts, and the
parsing it rests on (HLO name stacks, nested trace events) on hand-written inputs."""
import gzip
import json

import jax
import numpy as np
import pytest

from benchmarks import common, step_parts
from k3jax import config, train

TINY = "experiments/configs/k3_tiny.py"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  """One traced step of k3_tiny cut to a KDA + dense-FFN layer and a gated-MLA + MoE layer, with
  MTP, Muon + AdamW, QK-Clip, the bias update and full remat: (its part records, its HLO)."""
  cfg = config.load(TINY, {"model.num_layers": 2, "model.full_attn_layers": (2,),
                           "model.remat": "full", "train.global_batch_size": 2,
                           "train.seq_len": 16})
  setup, state = train.init(cfg, 0)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.model.vocab_size, (2, 17)).astype(np.int32)
  batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=np.ones((2, 16), np.int32),
               positions=np.tile(np.arange(16, dtype=np.int32), (2, 1)),
               loss_mask=np.ones((2, 16), np.float32))
  step = jax.jit(train.make_train_step(setup)).lower(state, batch).compile(
      compiler_options=dict(xla_backend_optimization_level=0,  # compiles in half the time
                            xla_llvm_disable_expensive_passes=True))
  jax.block_until_ready(step(state, batch))
  trace_dir = tmp_path_factory.mktemp("trace")
  with jax.profiler.trace(str(trace_dir)):
    jax.block_until_ready(step(state, batch))
  with gzip.open(common.find_trace(str(trace_dir))) as f:
    trace = json.load(f)
  return step_parts.part_records(trace, step.as_text(), steps=1), step.as_text()


def test_every_part_of_the_step_is_timed_and_shares_sum_to_one(records):
  records, hlo = records
  by_part = {r["part"]: r for r in records}
  for part in ("KDA layers", "MLA attention", "AttnRes", "dense FFN", "norms", "MoE routing",
               "MoE expert GEMMs", "MoE permutations (dispatch, combine)", "MTP block",
               "LM head + CE (main and MTP)", "remat recomputation",
               "optimizer: Muon (Newton-Schulz, momentum)", "optimizer: AdamW", "QK-Clip",
               "MoE bias update"):
    assert part in by_part and by_part[part]["ms_per_step"] > 0, part
  assert abs(sum(r["share"] for r in records) - 1.0) < 2e-3
  for part in ("KDA layers", "MLA attention"):
    assert by_part[part]["bwd_ms"] > 0 and by_part[part]["fwd_ms"] > 0, part
  recomputed = by_part["remat recomputation"]["recomputed_ms"]
  assert {"KDA layers", "MLA attention"} <= set(recomputed)
  # What stays unattributed, counted in kernels: its share of the CPU trace's time depends on
  # the host (0.25-0.35 seen on 2-core hosts), the compiled step's kernels do not (0.14).
  kernels = step_parts.kernel_counts(hlo)
  other = sum(n for (part, _), n in kernels.items() if part.startswith("other"))
  assert other / sum(kernels.values()) < 0.2, other
  table = step_parts.markdown(records)
  assert all(f"| {r['part']} |" in table for r in records) and "remat recomputes:" in table


def test_name_stacks_pick_the_first_matching_part_and_the_phase():
  assert step_parts.scopes("jit(step)/transpose(jvp(loss))/kda/dot") == [
      "step", "loss", "kda", "dot"]
  cls = step_parts.classify
  assert cls("jit(step)/jvp(loss)/mtp/mla/dot_general") == ("MTP block", "fwd")
  assert cls("jit(step)/transpose(jvp(mtp_loss))/lm_head_ce/while/body/dot") == (
      "LM head + CE (main and MTP)", "bwd")
  assert cls("jit(step)/transpose(jvp(loss))/jvp(loss)/checkpoint/rematted_computation/kda/x") == (
      "remat recomputation", "remat")
  assert cls("jit(step)/optimizer/muon/dot_general") == (
      "optimizer: Muon (Newton-Schulz, momentum)", "fwd")
  assert cls("jit(step)/jvp(loss)/moe/moe_experts/ragged_dot") == ("MoE expert GEMMs", "fwd")
  assert cls("jit(step)/jvp(loss)/normalize/add") == (step_parts.OTHER, "fwd")  # whole names


HLO = """HloModule jit_step, entry_computation_layout={()->f32[4]}

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(step)/jvp(loss)/kda/mul"}
}

%body (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  ROOT %copy.1 = f32[4]{0} copy(%s)
}

%cond (s: f32[4]) -> pred[] {
  %s = f32[4]{0} parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %while = f32[4]{0} while(%fusion), condition=%cond, body=%body, metadata={op_name="jit(step)/jvp(loss)/mla/while"}
  ROOT %copy.2 = f32[4]{0} copy(%while)
}
"""


def test_hlo_ops_take_their_root_or_caller_name_stack():
  names = step_parts.hlo_op_names(HLO)
  assert step_parts.hlo_module_name(HLO) == "jit_step"
  assert names["fusion"] == names["m"] == "jit(step)/jvp(loss)/kda/mul"  # the fused root's
  assert names["copy.1"] == "jit(step)/jvp(loss)/mla/while"  # the while's, for its body
  assert "copy.2" not in names  # entry op without metadata


def test_nested_events_count_their_own_time_once():
  meta = dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU"))
  ev = lambda op, ts, dur: dict(ph="X", pid=1, tid=7, ts=ts, dur=dur, name=op,
                                args=dict(hlo_module="jit_step", hlo_op=op))
  trace = dict(traceEvents=[meta, ev("while", 0.0, 100.0), ev("copy.1", 10.0, 30.0),
                            ev("fusion", 50.0, 40.0), ev("copy.2", 200.0, 10.0),
                            dict(ph="X", pid=1, tid=7, ts=0.0, dur=500.0, name="python")])
  recs = {r["part"]: r["ms_per_step"] for r in step_parts.part_records(trace, HLO, steps=1)}
  assert recs == {"MLA attention": 0.06, "KDA layers": 0.04, step_parts.UNMATCHED: 0.01}


def test_overlapping_events_and_device_timelines():
  """An event that starts inside another and ends after it takes from it only the overlap;
  a timeline's busy time is the union of its events, below their sum where they overlap."""
  meta = [dict(ph="M", name="process_name", pid=2, args=dict(name="/device:GPU:0")),
          dict(ph="M", name="thread_name", pid=2, tid=3, args=dict(name="Stream #3"))]
  ev = lambda op, ts, dur: dict(ph="X", pid=2, tid=3, ts=ts, dur=dur, name=op,
                                args=dict(hlo_module="jit_step", hlo_op=op))
  trace = dict(traceEvents=[*meta, ev("fusion", 0.0, 100.0), ev("copy.1", 90.0, 30.0),
                            ev("copy.2", 200.0, 50.0)])
  recs = {r["part"]: r["ms_per_step"] for r in step_parts.part_records(trace, HLO, steps=1)}
  assert recs == {"KDA layers": 0.09, "MLA attention": 0.03, step_parts.UNMATCHED: 0.05}
  (line,) = step_parts.timelines(trace, steps=2)
  assert line == dict(process="/device:GPU:0", thread="Stream #3", events=3, summed_ms=0.09,
                      busy_ms=0.085, span_ms=0.125)
