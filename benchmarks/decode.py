r"""Decoding over the dual cache (report §5.4) at long contexts: k3_small against its all-MLA and
KDA-only twins on one device.

Variants (`--variants`): "hybrid" (k3_small as configured: 3 KDA : 1 gated MLA,
model.full_attn_layers (4, 8, 12)), "all_mla" (every layer gated MLA: full_attn_layers 1..12) and
"kda_only" (every layer KDA, the last one too: full_attn_layers ()). Random weights, bf16
parameters (model.param_dtype, as served) and activations, no MTP layer (decoding does not use
it). Per variant and batch B (`--batches`: 1, 16) the two programs that serve are compiled once
(their compile times printed): a prefill chunk of C = min(--chunk_tokens // B, the contexts' gcd)
tokens a row continuing the cache (`K3ForCausalLM.hidden_states`, the cache donated; its queries
attend the filled latents and their own causally through `pallas_kernels.decode_attention`, KDA
continues its state) and the decode loop `k3jax.generate` serves with (`generate._decode`: one
`while_loop`, greedy). At each context L (`--contexts`: 4096, 32768, 131072) a cache of
max(contexts) + max(C, new_tokens) slots is filled to L with random values (`fill_cache`: the
step's work and bytes do not depend on them; prefilling 128k tokens of twelve MLA layers would
cost minutes of device time per point), one prefill chunk continuing it is timed, and the decode
loop runs `--new_tokens` - 1 steps from it.

Prefill tokens/s to L: a chunk's cost is affine in the depth it continues (its attention reads the
filled latents; everything else is fixed), so prefill to L takes about (L / C) (t(0) + t(L)) / 2
from the chunk times measured at depths 0 and L; the chunk's own rate at depth L is recorded too.

Per (variant, B, L) the record has the time per output token (tpot_ms: the wall-clock difference
of a decode loop of new_tokens - 1 steps and one of 1 step, over new_tokens - 2, so that a call's
fixed cost drops out; that cost is call_overhead_ms), decode tokens/s (B / tpot), prefill
tokens/s, the cache bytes per sequence at L (MLA latents L x 320 x 2 bytes a
layer; KDA a fixed fp32 state and conv tails), and the bytes-moved floor of one decode step: the
weights it reads (all but the embedding table, of which B rows, and the routed experts, of which
the expected share that B tokens select under uniform routing, 1 - (1 - k/E)^B) plus the caches
(the filled latents read; KDA states and conv tails read and written) at the device-to-device copy
rate measured in the same run (`common.copy_tbps`: bytes read + written per device second of an
fp32 pass over 1 GiB); floor_fraction = floor / tpot. Timing: wall clock of whole calls (a decode
loop of steps, a prefill chunk), each far longer than the ~0.07 ms below which a call's wall time
measures JAX's dispatch and a trace (`common.device_ms`) would be needed. Cached calls run the
layers unrolled (`K3ForCausalLM.hidden_states`), so a step reads each weight in place, once.
`--decode_attention_impl` picks the MLA layers' decode attention tier
(recorded with the tier that ran); `--expert_format=mxfp4` holds the routed experts packed, as
K3 serves them (random codes; the floor counts the packed bytes); `--kda_decode` and
`--expert_sort` pick the KDA layers' decode step and the MoE's sort ("xla" against the GPU's
Triton default; the KDA tier that ran is recorded). Records are merged into `--out` after
each L.
`--profile_dir=DIR` traces one decode loop per (variant, B) at the first context: device time
per kernel, then per part of the model (`benchmarks/step_parts.py`, with the kernels of each
part in the compiled loop; DIR/VARIANT_BB/parts.json).

  python3 -m benchmarks.decode --out=$OUT/decode_h200.json
`--toy` runs a 2-layer k3_tiny (KDA + MLA, and its twins) at B 2, contexts 32 and 64 on CPU.
"""
import collections
import functools
import gzip
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks import common
from benchmarks import step_parts
from k3jax import config as config_lib
from k3jax import generate
from k3jax import latent_moe
from k3jax.model import K3ForCausalLM
from pallas_kernels import decode_attention
from pallas_kernels.decode_matmul import api as decode_matmul_api
from pallas_kernels.expert_sort import api as expert_sort_api
from pallas_kernels import kda_decode
from pallas_kernels.kda_decode import api as kda_decode_api
from pallas_kernels.kda_decode import triton as kda_decode_triton
from pallas_kernels.moe_route import api as moe_route_api
from pallas_kernels.mxfp4_matmul import api as mxfp4_api
from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mosaic_gpu

_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_h200.json", "Records (JSON list).")
_TOY = flags.DEFINE_bool("toy", False, "A 2-layer k3_tiny at B 2, contexts 32 and 64 on CPU.")
_VARIANTS = flags.DEFINE_list("variants", ["hybrid", "all_mla", "kda_only"], "Layer patterns.")
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "B values.")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096", "32768", "131072"], "Filled lengths L.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 33, "Tokens per decode run (new_tokens - 1 "
                                   "decode steps after the first token).", lower_bound=3)
_CHUNK_TOKENS = flags.DEFINE_integer("chunk_tokens", 16384, "Prefill tokens per call over the "
                                     "batch.", lower_bound=1)
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "", "Trace one decode loop per (variant, B) at "
                                   "the first context into this directory; print the device time "
                                   "per step by kernel and by part (`profile_decode`).")
_DECODE_ATTENTION_IMPL = flags.DEFINE_enum(
    "decode_attention_impl", "", ("",) + decode_attention.IMPLS,
    "kernels.decode_attention_impl of the MLA layers (\"\": the platform default).")
_MOE_DECODE_EXPERTS = flags.DEFINE_enum(
    "moe_decode_experts", "", ("", *latent_moe.DECODE_EXPERTS),
    "kernels.moe_decode_experts (\"\": the config's).")
_GATE_UP_IMPL = flags.DEFINE_enum(
    "gate_up_impl", "", ("", "xla", "triton"),
    "kernels.gate_up_impl (\"\": the config's; \"xla\": gather, then gate/up by ragged_dot).")
_SWAPPED_GMM = flags.DEFINE_bool(
    "swapped_gmm", False, "Run ragged_dot's calls with few rows per group (M <= 8 G) on the "
    "\"swapped\" Mosaic GPU kernel (sets pallas_kernels.ragged_dot.mosaic_gpu."
    "SWAPPED_IS_DEFAULT before the model is built; recorded as moe_kernels).")
# Tier switches: (flag, module, its default switch, the value that turns it on). Each flag's
# "" keeps the default; another value sets the switch before the model is built. The MoE ones
# are recorded in moe_kernels, kda_decode in kda_decode_tier, decode_matmul in decode_matmul.
_SWITCHES = []


def _switch(name: str, module, attr: str, on: str, off: str, help_text: str):
  flag = flags.DEFINE_enum(name, "", ("", off, on), f"{help_text} (\"\": the default; sets "
                           f"{module.__name__}.{attr} to the flag == {on!r}).")
  _SWITCHES.append((flag, module, attr, on))
  return flag


_EXPERT_SORT = _switch("expert_sort", expert_sort_api, "TRITON_IS_DEFAULT", "triton", "xla",
                       "The MoE's sort of copies by expert (the Triton counting sort on a GPU)")
_EXPERT_FFN = _switch("expert_ffn", mxfp4_api, "EXPERT_FFN_IS_DEFAULT", "fused", "unfused",
                      "Packed experts' FFN (fused: W1, W3, SiTU and W2 in one Triton launch)")
_MOE_ROUTE = _switch("moe_route", moe_route_api, "TRITON_IS_DEFAULT", "triton", "xla",
                     "Decode steps' routing and sort (triton: one Triton kernel)")
_KDA_DECODE = _switch("kda_decode", kda_decode_api, "TRITON_IS_DEFAULT", "triton", "xla",
                      "The KDA layers' decode step")
_DECODE_MATMUL = _switch("decode_matmul", decode_matmul_api, "TRITON_IS_DEFAULT", "triton",
                         "xla", "A decode step's dense products through "
                         "pallas_kernels.decode_matmul (KDA's input product and o_proj, the "
                         "MoE's merged W_in / W_out, MLA's W_x and absorbed W_qb; recorded as "
                         "decode_matmul)")
_KDA_DECODE_CONFIG = flags.DEFINE_enum(
    "kda_decode_config", "", ("", *kda_decode_triton.CONFIGS),
    "The triton tier's tile and warps (\"\": its DEFAULT; else sets pallas_kernels.kda_decode."
    "triton.DEFAULT to that entry of CONFIGS; kda_decode_tier records \"triton:<name>\").")
_EXPERT_FORMAT = flags.DEFINE_enum(
    "expert_format", "float", latent_moe.EXPERT_FORMATS,
    "model.moe.expert_format: \"mxfp4\" holds the routed experts packed (random E2M1 codes, "
    "E8M0 scales 2^-7..2^0) and runs them through pallas_kernels.mxfp4_matmul.")
_PREFILL = flags.DEFINE_bool("prefill", True, "Compile and time the prefill chunks (off: decode "
                             "only, prefill fields null).")
CONFIG = "experiments/configs/k3_small.py"
TOY_CONFIG = "experiments/configs/k3_tiny.py"
TOY = dict(batches=(2,), contexts=(32, 64), new_tokens=6, chunk_tokens=32)
KEY_FIELDS = ("op", "variant", "shape", "decode_attention_tier", "kda_decode_tier",
              "moe_decode_experts", "moe_kernels", "expert_format", "xla_flags", "device",
              "decode_matmul")


def variant_config(name: str, toy: bool, decode_attention_impl: str = "",
                   moe_decode_experts: str = "", gate_up_impl: str = "",
                   expert_format: str = "float"):
  """The config of a variant: k3_small (toy: k3_tiny with 2 layers) with bf16 parameters and no
  MTP layer, its layer pattern as `name` says."""
  overrides = {"model.param_dtype": "bfloat16", "model.mtp_num_layers": 0,
               "kernels.decode_attention_impl": decode_attention_impl,
               "model.moe.expert_format": expert_format}
  if moe_decode_experts:
    overrides["kernels.moe_decode_experts"] = moe_decode_experts
  if gate_up_impl:
    overrides["kernels.gate_up_impl"] = gate_up_impl
  if toy:
    overrides.update({"model.num_layers": 2, "model.full_attn_layers": (2,),
                      "model.dtype": "bfloat16"})
  cfg = config_lib.load(TOY_CONFIG if toy else CONFIG, overrides)
  layers = cfg.model.num_layers
  pattern = {"hybrid": cfg.model.full_attn_layers, "all_mla": tuple(range(1, layers + 1)),
             "kda_only": ()}
  if name not in pattern:
    raise ValueError(f"variant must be one of {sorted(pattern)}, got {name!r}")
  return config_lib.override(cfg, {"model.full_attn_layers": pattern[name]})


def randomize_packed_experts(model: K3ForCausalLM, key: jax.Array) -> None:
  """Random E2M1 codes and E8M0 scales (2^-7..2^0) in every packed routed expert, in place
  (a model built with expert_format="mxfp4" starts with zeros)."""
  flat = nnx.to_flat_state(nnx.state(model, latent_moe.PackedExperts))
  for i, (path, var) in enumerate(flat):
    k = jax.random.fold_in(key, i)
    x = var.get_value()
    lo, hi = (0, 256) if str(path[-1]).endswith("_packed") else (120, 128)
    var.set_value(jax.random.randint(k, x.shape, lo, hi, jnp.int32).astype(x.dtype))


def copy_tbps(toy: bool) -> float:
  """`common.copy_tbps` (device time of an fp32 pass over 1 GiB); toy: the wall clock of one
  pass over 64 MiB (CPU runs have no device trace). Bytes read + written per second, in TB/s."""
  if not toy:
    return common.copy_tbps()
  a = jnp.zeros(2 ** 24, jnp.float32)
  return 2 * 2 ** 26 / common.time_jax_once(jax.jit(lambda v: v + 1), a) / 1e9


def cache_bytes(cache: dict, batch: int) -> tuple[float, float]:
  """(bytes per row per latent slot, bytes per row of the fixed-size KDA states and tails)."""
  per_slot = per_row = 0.0
  for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
    if getattr(path[-1], "key", None) == "latent":  # [B, S, C]
      per_slot += x.size / (batch * x.shape[-2]) * x.dtype.itemsize
    elif getattr(path[-1], "key", None) != "index":
      per_row += x.size / batch * x.dtype.itemsize
  return per_slot, per_row


def weight_bytes_per_step(model: K3ForCausalLM, batch: int) -> float:
  """Parameter bytes one decode step of `batch` rows must read: the embedding's B rows, the
  routed experts' expected selected share 1 - (1 - k/E)^B, everything else whole."""
  moe = model.cfg.moe
  share = 1 - (1 - moe.num_experts_per_tok / moe.num_experts) ** batch if moe.num_experts else 1
  total = 0.0
  for path, var in nnx.to_flat_state(nnx.state(model, (nnx.Param, latent_moe.PackedExperts))):
    names = [str(k) for k in path]
    x = var.get_value()
    nbytes = x.size * x.dtype.itemsize
    if names[0] == "embed_tokens":
      nbytes = batch * x.shape[-1] * x.dtype.itemsize
    elif "experts" in names and names[-1].split("_")[0] in latent_moe.EXPERT_WEIGHTS:
      nbytes *= share
    total += nbytes
  return total


@functools.partial(nnx.jit, donate_argnames=("cache",))
def prefill_chunk(model: K3ForCausalLM, tokens: jax.Array, cache: dict
                  ) -> tuple[jax.Array, dict]:
  """tokens [B, C] continuing the cache: (the last position's logits [B, V], the cache)."""
  h, _, cache = model.hidden_states(tokens, cache=cache)
  return model.logits(h[:, -1:])[:, 0], cache


def decode_tier(model: K3ForCausalLM, batch: int, slots: int) -> str:
  """The decode attention tier the MLA layers run ("" without MLA layers)."""
  mla = [layer.self_attn for layer in model.layers if layer.kind == "mla"]
  if not mla:
    return ""
  a = mla[0]
  q = jax.ShapeDtypeStruct((batch, 1, a.num_heads, a.kr + a.dr), a.dtype)
  cache = jax.ShapeDtypeStruct((batch, slots, a.kr + a.dr), a.dtype)
  return decode_attention.plan(q, cache, jax.ShapeDtypeStruct((batch,), jnp.int32), v_dim=a.kr,
                               impl=a.decode_attention_impl).impl


def kda_decode_tier(model: K3ForCausalLM, batch: int) -> str:
  """The decode step tier the KDA layers run ("" without KDA layers)."""
  kda = [layer.self_attn for layer in model.layers if layer.kind == "kda"]
  if not kda:
    return ""
  a = kda[0]
  h, k = a.num_heads, a.head_dim
  r, width = a.f_b_proj["kernel"].shape[0], a.q_conv1d["kernel"].shape[0]
  sds = jax.ShapeDtypeStruct
  tier = kda_decode.plan(sds((batch, kda_decode.proj_width(h, k, r)), a.dtype),
                         sds((batch, width - 1, 3, h * k), a.dtype),
                         sds((r, h, k), a.dtype), impl=a.decode_impl or None).impl
  if tier == "triton":
    tier += ":" + kda_decode_triton.config_name(kda_decode_triton.DEFAULT)
  return tier


@functools.partial(jax.jit, static_argnames=("context",), donate_argnames=("cache",))
def fill_cache(cache: dict, key: jax.Array, *, context: int) -> dict:
  """The cache as if `context` tokens had been prefilled: latents in slots < context, KDA states
  and conv tails random (N(0, 0.02^2): timing does not depend on the values), index = context."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(cache)
  out = []
  for i, (path, x) in enumerate(leaves):
    name = getattr(path[-1], "key", None)
    if name == "index":
      out.append(jnp.full_like(x, context))
      continue
    r = (0.02 * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype)
    if name == "latent":  # [B, S, C]
      r = jnp.where(jnp.arange(x.shape[-2])[:, None] < context, r, 0).astype(x.dtype)
    out.append(r)
  return jax.tree_util.tree_unflatten(treedef, out)


def profile_decode(directory: str, model: K3ForCausalLM, cache: dict, first: jax.Array,
                   settings: tuple, steps: int, new_tokens: int, slots: int, top: int = 25):
  """One decode loop under the profiler: device ms and kernels per step by kernel, then by part
  (`benchmarks/step_parts.py`: the loop compiled again without CUDA graphs, whose kernels do not
  name their HLO op, and traced again). Returns the cache; the parts table also goes to
  `directory`/parts.json."""
  graphdef, state = nnx.split(model)
  with jax.profiler.trace(directory):
    out, _, cache = generate._decode(graphdef, state, cache, first, *settings,
                                     jnp.int32(new_tokens), capacity=slots)
    jax.block_until_ready(out)
  with gzip.open(common.find_trace(directory)) as f:
    rows = common.device_op_times(json.load(f), by_hlo_op=True)
  total = sum(us for _, _, us in rows)
  print(f"  trace {directory}: {total / 1e3 / steps:.3f} device ms per step in "
        f"{sum(n for _, n, _ in rows) / steps:.0f} kernels", flush=True)
  for op, n, us in rows[:top]:
    print(f"  {us / 1e3 / steps:8.4f} ms/step {n / steps:6.1f}x  {op[:150]}", flush=True)

  args = (first, *settings, jnp.int32(new_tokens))
  options = ({"xla_gpu_enable_command_buffer": ""}
             if jax.devices()[0].platform == "gpu" else {})
  compiled = generate._decode.lower(graphdef, state, cache, *args, capacity=slots).compile(
      compiler_options=options)
  compiled = functools.partial(compiled, state)
  parts_dir = pathlib.Path(directory) / "parts"
  cache = compiled(cache, *args)[2]
  jax.block_until_ready(cache)
  with jax.profiler.trace(str(parts_dir)):
    cache = compiled(cache, *args)[2]
    jax.block_until_ready(cache)
  hlo = compiled.func.as_text()
  (parts_dir / step_parts.HLO_FILE).write_text(hlo)
  parts = step_parts.table_from_dir(str(parts_dir), steps)
  counts = collections.Counter()
  for (part, _), n in step_parts.kernel_counts(hlo).items():
    counts[part] += n
  for r in parts:
    r["kernels_in_hlo"] = counts.get(r["part"], 0)
  (pathlib.Path(directory) / "parts.json").write_text(json.dumps(parts, indent=1))
  print(f"  by part (no CUDA graphs; kernels in the compiled loop's HLO, {sum(counts.values())} "
        "in all):", flush=True)
  for r in parts:
    print(f"  {r['ms_per_step']:8.4f} ms/step {100 * r['share']:5.1f}%  "
          f"{r['kernels_in_hlo']:4d} kernels  {r['part']}", flush=True)
  return cache


def run_batch(name: str, model: K3ForCausalLM, batch: int, contexts: tuple[int, ...],
              new_tokens: int, chunk_tokens: int, copy: float, toy: bool) -> None:
  """Compile the prefill chunk and the decode loop once, then at each context L: a cache filled
  to L (`fill_cache`), one timed prefill chunk continuing it, and the timed decode loop; records
  merged into --out after each L."""
  chunk = min(max(1, chunk_tokens // batch), math.gcd(*contexts))
  slots = max(contexts) + max(chunk, new_tokens)
  rng = np.random.default_rng(batch)
  vocab = model.cfg.vocab_size
  tokens = lambda t: jnp.asarray(rng.integers(0, vocab, (batch, t)), jnp.int32)
  steps = new_tokens - 1
  settings = (jax.random.key(0), jnp.float32(0), jnp.float32(1), jnp.int32(-1))
  key = jax.random.key(batch)
  log = lambda msg: print(f"{name:8s} B={batch:<2d} {msg}", flush=True)

  prefill = _PREFILL.value
  if prefill:
    start = time.perf_counter()
    cache = model.init_cache(batch, slots)
    jax.block_until_ready(prefill_chunk(model, tokens(chunk), cache))
    log(f"prefill chunk of {chunk} compiled in {time.perf_counter() - start:.1f} s")
  start = time.perf_counter()
  first = jnp.asarray(rng.integers(0, vocab, (batch,)), jnp.int32)
  graphdef, state = nnx.split(model)
  jax.block_until_ready(generate._decode(graphdef, state, model.init_cache(batch, slots), first,
                                         *settings, jnp.int32(2), capacity=slots))
  log(f"decode loop compiled in {time.perf_counter() - start:.1f} s")
  cache = model.init_cache(batch, slots)
  per_slot, per_row = cache_bytes(cache, batch)
  weights = weight_bytes_per_step(model, batch)
  tier = decode_tier(model, batch, slots)
  moe_choice = next((layer.block_sparse_moe.decode_experts for layer in model.layers
                     if layer.is_moe), "")

  def chunk_s(context: int, cache: dict) -> tuple[float, dict]:
    cache = jax.block_until_ready(fill_cache(cache, key, context=context))
    start = time.perf_counter()
    logits, cache = prefill_chunk(model, tokens(chunk), cache)
    jax.block_until_ready((logits, cache))
    return time.perf_counter() - start, cache

  empty_s, cache = chunk_s(0, cache) if prefill else (None, cache)
  for context in contexts:
    prefill_rates = dict(prefill_tokens_per_s=None, prefill_chunk_tokens_per_s=None,
                         prefill_s=None)
    if prefill:
      depth_s, cache = chunk_s(context, cache)
      # A chunk's cost is affine in the depth it continues (its attention reads the filled
      # latents): prefill to L in L / C chunks takes about (L / C) * (t(0) + t(L)) / 2.
      prefill_s = context / chunk * (empty_s + depth_s) / 2
      prefill_rates = dict(prefill_tokens_per_s=round(batch * context / prefill_s, 1),
                           prefill_chunk_tokens_per_s=round(batch * chunk / depth_s, 1),
                           prefill_s=round(prefill_s, 3))
    first = jnp.asarray(rng.integers(0, vocab, (batch,)), jnp.int32)

    def decode_s(tokens: int, cache: dict) -> tuple[float, dict]:
      cache = jax.block_until_ready(fill_cache(cache, key, context=context))
      start = time.perf_counter()
      out, n, cache = generate._decode(graphdef, state, cache, first, *settings,
                                       jnp.int32(tokens), capacity=slots)
      jax.block_until_ready(out)
      assert int(n) == tokens, (int(n), tokens)
      return time.perf_counter() - start, cache

    # Per token: the difference of a loop of `steps` steps and one of 1 step, so that the
    # call's fixed cost (nnx.jit's graph walk, dispatch, the output buffers) drops out.
    one_s, cache = decode_s(2, cache)
    loop_s, cache = decode_s(new_tokens, cache)
    tpot = (loop_s - one_s) / (steps - 1) * 1e3
    if _PROFILE_DIR.value and context == contexts[0]:
      cache = profile_decode(f"{_PROFILE_DIR.value}/{name}_B{batch}", model, cache, first,
                             settings, steps, new_tokens, slots)
    cache_read = batch * (per_slot * context + 2 * per_row)
    floor = (weights + cache_read) / copy / 1e9
    rec = dict(op="decode", variant=name,
               shape=dict(B=batch, context=context, slots=slots, new_tokens=new_tokens,
                          chunk=chunk),
               dtype="bfloat16", tpot_ms=round(tpot, 4),
               decode_tokens_per_s=round(batch / tpot * 1e3, 2) if tpot > 0 else None,
               call_overhead_ms=round((one_s * 1e3 - tpot), 3), **prefill_rates,
               cache_bytes_per_seq=int(per_slot * context + per_row),
               weight_bytes_per_step=int(weights), cache_bytes_per_step=int(cache_read),
               floor_ms=round(floor, 4),
               floor_fraction=round(floor / tpot, 3) if tpot > 0 else None,
               copy_tbps=round(copy, 3), decode_attention_tier=tier,
               kda_decode_tier=kda_decode_tier(model, batch),
               moe_decode_experts=moe_choice, moe_kernels=moe_kernels(),
               decode_matmul=_DECODE_MATMUL.value or None,
               expert_format=None if _EXPERT_FORMAT.value == "float" else _EXPERT_FORMAT.value,
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               timing="wall_once" if toy else "wall", device=common.device_name(),
               date=common.today(), commit=common.code_commit(), versions=common.versions())
    prefill_note = (f"prefill {rec['prefill_tokens_per_s']:9.1f} tok/s (chunk at L "
                    f"{rec['prefill_chunk_tokens_per_s']:9.1f})  " if prefill else "")
    log(f"L={context:<6d} tpot {tpot:8.3f} ms (floor {floor:.3f} ms; a call's overhead "
        f"{rec['call_overhead_ms']:.1f} ms)  "
        f"{prefill_note}cache/seq {rec['cache_bytes_per_seq'] / 2**20:8.1f} MiB  "
        f"[{tier or 'no MLA'}, KDA {rec['kda_decode_tier'] or '-'}, "
        f"{rec['moe_decode_experts']} {_EXPERT_FORMAT.value} experts]")
    common.merge_records(_OUT.value, [rec], KEY_FIELDS, runs_of="tpot_ms")


def moe_kernels() -> str | None:
  """The MoE kernel choices of this run that differ from the defaults (None: the defaults)."""
  parts = ([f"gate_up_impl={_GATE_UP_IMPL.value}"] if _GATE_UP_IMPL.value else []) + (
      ["gmm swapped for M <= 8 G"] if _SWAPPED_GMM.value else []) + (
      [f"{f.name}={f.value}" for f in (_EXPERT_SORT, _EXPERT_FFN, _MOE_ROUTE) if f.value])
  return ", ".join(parts) or None


def main(argv):
  del argv
  if _SWAPPED_GMM.value:
    ragged_mosaic_gpu.SWAPPED_IS_DEFAULT = True
  for flag, module, attr, on in _SWITCHES:
    if flag.value:
      setattr(module, attr, flag.value == on)
  if _KDA_DECODE_CONFIG.value:
    kda_decode_triton.DEFAULT = kda_decode_triton.CONFIGS[_KDA_DECODE_CONFIG.value]
  toy = _TOY.value
  ints = lambda values: tuple(int(v) for v in values)
  batches = TOY["batches"] if toy else ints(_BATCHES.value)
  contexts = TOY["contexts"] if toy else tuple(sorted(ints(_CONTEXTS.value)))
  new_tokens = TOY["new_tokens"] if toy else _NEW_TOKENS.value
  chunk_tokens = TOY["chunk_tokens"] if toy else _CHUNK_TOKENS.value
  copy = copy_tbps(toy)
  print(f"device {common.device_name()}: copy {copy:.2f} TB/s", flush=True)
  for name in _VARIANTS.value:
    cfg = variant_config(name, toy, _DECODE_ATTENTION_IMPL.value, _MOE_DECODE_EXPERTS.value,
                         _GATE_UP_IMPL.value, _EXPERT_FORMAT.value)
    # Eagerly: jitted, the hybrid's initialisation sat in XLA's GPU backend for minutes.
    model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels)
    randomize_packed_experts(model, jax.random.key(1))
    for batch in batches:
      run_batch(name, model, batch, contexts, new_tokens, chunk_tokens, copy, toy)
    del model


if __name__ == "__main__":
  app.run(main)
