r"""Renders the tables of BENCHMARKS.md from benchmarks/results/*.json.

`python -m benchmarks.report` prints every table; `--write` replaces each table inside
BENCHMARKS.md between its `<!-- report:NAME -->` and `<!-- /report:NAME -->` markers and leaves
the prose around them alone.

Each table shows the newest record per shape and implementation of one results file. Records
whose implementation carries an `@label` (e.g. `xla@run1`) are kept runs of older code and are
left out. A record's provenance is its `date` (the day it was measured) and the commit that
first added it to its results file (`git log` of that file; a later rename to `@label` or an
edited note does not count as adding it).
"""
import functools
import json
import pathlib
import subprocess
from typing import Callable

from absl import app, flags

_WRITE = flags.DEFINE_bool("write", False, "Rewrite the tables inside BENCHMARKS.md.")
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_VOLATILE = ("note", "run", "versions")  # fields edited after a record was added

Record = dict


def identity(r: Record) -> str:
  """The record's measured content: the fields a later edit leaves alone, with the
  implementation's `@label` dropped."""
  core = {k: v for k, v in r.items() if k not in _VOLATILE}
  if isinstance(core.get("implementation"), str):
    core["implementation"] = core["implementation"].split("@")[0]
  return json.dumps(core, sort_keys=True)


def _git(root: pathlib.Path, *args: str) -> str | None:
  try:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    return None
  return proc.stdout


@functools.cache
def first_commits(root: pathlib.Path, rel_path: str) -> dict[str, str]:
  """identity(record) -> short hash of the commit since which `rel_path` holds the record
  without a break (a record dropped and later written again dates from its return)."""
  log = _git(root, "log", "--reverse", "--format=%h", "--", rel_path)
  found: dict[str, str] = {}
  held: set[str] = set()
  for commit in (log or "").split():
    text = _git(root, "show", f"{commit}:{rel_path}")
    try:
      now = {identity(r) for r in json.loads(text)} if text else set()
    except json.JSONDecodeError:
      continue
    for key in now - held:
      found[key] = commit
    held = now
  return found


class Results:
  """The records of one results file, newest last (as `common.merge_records` writes them)."""

  def __init__(self, root: pathlib.Path, name: str):
    self.root, self.rel_path = root, f"benchmarks/results/{name}"
    path = root / self.rel_path
    self.records: list[Record] = json.loads(path.read_text()) if path.exists() else []

  def current(self, op: str, **match) -> list[Record]:
    """Records of `op` without an `@label`, the newest per identity-less key."""
    newest: dict[str, Record] = {}
    for r in self.records:
      impl = r.get("implementation", "")
      if r.get("op") != op or "@" in str(impl) or r.get("error"):
        continue
      if any(r.get(k) != v for k, v in match.items()):
        continue
      key = {k: v for k, v in r.items()
             if v is not None and k in (
                 "implementation", "variant", "moe_decode_experts", "moe_kernels",
                 "expert_format", "pass",
                 "shape", "B", "T", "H", "config", "tokens",
                 "kda_impl", "ragged_dot_impl", "gate_up_train", "remat",
                 "xla_triton_gemm", "xla_flags", "compile_cache", "prebuild_mosaic_gpu",
                 "muon_ns_fold", "muon_ns_stack", "scan_layers")}
      newest[json.dumps(key, sort_keys=True)] = r
    return list(newest.values())

  def provenance(self, r: Record) -> str:
    commit = first_commits(self.root, self.rel_path).get(identity(r), "not yet committed")
    return f"{r.get('date', '?')} {commit}"

  def caption(self, records: list[Record]) -> str:
    runs = sorted({self.provenance(r) for r in records})
    return f"Recorded ({self.rel_path}; date measured, commit that added it): {'; '.join(runs)}."


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
  align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def _shape(s: dict) -> str:
  return " ".join(f"{k}{v}" for k, v in s.items())


def _shapes(recs: list[dict]) -> list[str]:
  """The records' shapes, each once, in order of first appearance."""
  return list(dict.fromkeys(_shape(r["shape"]) for r in recs))


def _num(x: float | None, digits: int = 0) -> str:
  return "" if x is None else f"{x:.{digits}f}"


def _grid(records: list[Record], row_of: Callable[[Record], str], col_of: Callable[[Record], str],
          cell: Callable[[Record], str], rows: list[tuple[str, str]], cols: list[tuple[str, str]],
          corner: str) -> str:
  """A table of `cell(r)` at (row_of(r), col_of(r)); `rows` / `cols` are (key, label) pairs,
  rows without any record are dropped."""
  at = {(row_of(r), col_of(r)): r for r in records}
  body = []
  for rk, rl in rows:
    cells = [cell(at[rk, ck]) if (rk, ck) in at else "" for ck, _ in cols]
    if any(cells):
      body.append([rl] + cells)
  return _table([corner] + [cl for _, cl in cols], body)


def kda(root: pathlib.Path) -> str:
  res = Results(root, "kda_h200.json")
  recs = res.current("chunk_kda")
  fla = {(r["H"], r["pass"]): r["median_ms"] for r in recs if r["implementation"] == "fla"}
  cols = [(f"{p} {h}", f"{p}, H = {h}") for h in (32, 96) for p in ("fwd", "fwd+bwd")]

  def cell(r):
    text = f"{r['median_ms']:.3f} ({r['tflops']:.0f})"
    ref = fla.get((r["H"], r["pass"]))
    if ref and r["implementation"] != "fla":
      text += f", {ref / r['median_ms']:.2f}x fla"
    return text

  rows = [("mosaic_gpu", "k3jax `mosaic_gpu` (default on Hopper)"),
          ("fla", "fla-core `chunk_kda` (Triton)"),
          ("mosaic_gpu_bwd_xla", "k3jax `mosaic_gpu`, `backward=\"kernel\"` (1)"),
          ("chunked", "k3jax `chunked`, pure JAX (1)")]
  keep = [r for r in recs if r["implementation"] in dict(rows)]
  table = _grid(keep, lambda r: r["implementation"], lambda r: f"{r['pass']} {r['H']}", cell,
                rows, cols, "ms (TFLOP/s)")
  return f"{table}\n\n{res.caption(keep)}"


def kda_accuracy(root: pathlib.Path) -> str:
  res = Results(root, "kda_accuracy_h200.json")
  recs = res.current("chunk_kda_accuracy")
  names = ("o", "dq", "dk", "dv", "dg", "dbeta")
  body = [[f"{r['implementation']}, H = {r['H']}"]
          + [f"{r['rel_l2_vs_fp64'][n]:.1e}" for n in names] for r in recs]
  return f"{_table(['relative L2 vs fp64', *names], body)}\n\n{res.caption(recs)}"


def moe_gemm(root: pathlib.Path) -> str:
  res = Results(root, "moe_h200.json")
  recs = [r for op in ("moe_gmm", "moe_gmm_d_lhs", "moe_gmm_d_rhs", "dense_matmul_same_flops")
          for r in res.current(op) if r["shape"].get("G") is not None]
  shapes = _shapes(recs)
  product = {"moe_gmm_d_lhs": "d_lhs", "moe_gmm_d_rhs": "d_rhs"}
  row_of = lambda r: f"{r['implementation']} {product.get(r['op'], r['pass'])}"
  rows = [("k3jax_mosaic_gpu fwd", "k3jax `mosaic_gpu`, fwd (default on Hopper)"),
          ("k3jax_mosaic_gpu fwd+bwd", "k3jax `mosaic_gpu`, fwd+bwd"),
          ("k3jax_mosaic_gpu d_lhs", "k3jax `mosaic_gpu`, d_lhs alone"),
          ("k3jax_mosaic_gpu d_rhs", "k3jax `mosaic_gpu`, d_rhs alone"),
          ("torch_grouped_mm fwd", "torch `_grouped_mm`, fwd"),
          ("torch_grouped_mm fwd+bwd", "torch `_grouped_mm`, fwd+bwd (autograd)"),
          ("jax_example_mgpu fwd", "JAX's example Mosaic GPU kernels, fwd"),
          ("jax_example_mgpu fwd+bwd", "JAX's example Mosaic GPU kernels, fwd+bwd"),
          ("xla_ragged_dot fwd", "`jax.lax.ragged_dot`, fwd"),
          ("xla_ragged_dot fwd+bwd", "`jax.lax.ragged_dot`, fwd+bwd"),
          ("xla fwd", "dense XLA matmul of the same FLOPs (ceiling)")]
  keep = [r for r in recs if row_of(r) in dict(rows)]
  table = _grid(keep, row_of, lambda r: _shape(r["shape"]), lambda r: _num(r["tflops"]),
                rows, [(s, s) for s in shapes], "TFLOP/s")
  ours = {(row_of(r), _shape(r["shape"])): r["tflops"] for r in keep}
  ratio = [[f"ours / torch, {p}"]
           + [f"{ours[f'k3jax_mosaic_gpu {p}', s] / ours[f'torch_grouped_mm {p}', s]:.2f}"
              if (f"k3jax_mosaic_gpu {p}", s) in ours and (f"torch_grouped_mm {p}", s) in ours
              else "" for s in shapes] for p in ("fwd", "fwd+bwd")]
  table += "\n" + "\n".join("| " + " | ".join(row) + " |" for row in ratio)
  return f"{table}\n\n{res.caption(keep)}"


def ceilings(root: pathlib.Path) -> str:
  res = Results(root, "moe_h200.json")
  recs = [r for r in res.current("dense_matmul") if r["implementation"] in ("xla", "torch")]
  body = [[f"bf16 matmul {_shape(r['shape'])}, {r['implementation']}", _num(r["tflops"], 1)]
          for r in recs]
  return f"{_table(['dense matmul', 'TFLOP/s'], body)}\n\n{res.caption(recs)}"


def moe_layer(root: pathlib.Path) -> str:
  res = Results(root, "moe_h200.json")
  recs = res.current("moe_layer", config="k3_small")
  tiers = [("default", "default"), ("fused_fwd", "fused_fwd"), ("unfused", "unfused"),
           ("xla", "xla")]
  def split(r):
    name = r["implementation"].removeprefix("layer_")
    device = name.endswith("_device")
    name = name.removesuffix("_device")
    passes, _, tier = name.partition("_")
    return passes + (", device time" if device else ""), tier

  whole = [r for r in recs
           if r["implementation"].startswith("layer_") and split(r)[1] in dict(tiers)]
  rows = [(p, p) for p in ("fwd", "fwd, device time", "fwd+bwd", "fwd+bwd, device time")]
  table = _grid(whole, lambda r: split(r)[0], lambda r: split(r)[1],
                lambda r: f"{r['median_ms']:.3f}", rows, tiers, "layer, ms")
  by = {r["implementation"]: r["median_ms"] for r in recs}
  parts = [("routing_fused_device", "routing + permutations without dispatch, fwd, device "
            "(the fused gate/up kernel gathers)", "layer_fwd_default_device"),
           ("routing_and_permutation_device", "routing + permutations, fwd, device",
            "layer_fwd_unfused_device"),
           ("routing_and_permutation_fwd+bwd_device",
            "routing + permutations with their VJPs, device", "layer_fwd+bwd_default_device"),
           ("grouped_gemms_default", "the three grouped matmuls alone, `mosaic_gpu`", None),
           ("grouped_gemms_xla", "the three grouped matmuls alone, `jax.lax.ragged_dot`", None),
           ("dense_same_flops", "dense bf16 matmul of the same FLOPs (ceiling)", None),
           ("elementwise_situ", "SiTU on the gate and up products (XLA)", None),
           ("elementwise_add_same_bytes", "an add of the same bytes (HBM rate)", None)]
  body = []
  for name, label, whole_name in parts:
    if name in by:
      share = (f"{by[name] / by[whole_name]:.1%} of `{whole_name}`"
               if whole_name in by else "")
      body.append([label, f"{by[name]:.3f}", share])
  part_recs = [r for r in recs if r["implementation"] in {p[0] for p in parts}]
  return (f"{table}\n\n{_table(['part', 'ms', 'share'], body)}\n\n"
          f"{res.caption(whole + part_recs)}")


def moe_gate_up(root: pathlib.Path) -> str:
  res = Results(root, "moe_h200.json")
  recs = res.current("moe_gate_up")
  cols = _shapes(recs)
  rows = [("triton", "fused kernel (default on Hopper)"),
          ("triton+gate_up", "fused, also writing gate/up (removed)"),
          ("unfused", "unfused: XLA gather + `mosaic_gpu` grouped matmul + SiTU"),
          ("unfused_no_gather", "unfused, rows gathered beforehand")]
  table = _grid(recs, lambda r: r["implementation"], lambda r: _shape(r["shape"]),
                lambda r: f"{r['median_ms']:.3f} ({r['tflops']:.0f})", rows,
                [(c, c) for c in cols], "ms (TFLOP/s)")
  return f"{table}\n\n{res.caption(recs)}"


def top_k(root: pathlib.Path) -> str:
  res = Results(root, "moe_h200.json")
  recs = res.current("top_k")
  shapes = _shapes(recs)
  cols = [("lax", "`jax.lax.top_k`"), ("triton", "`pallas_kernels.top_k` (default on GPUs)"),
          ("ranks", "compare-and-count ranks (removed)")]
  table = _grid(recs, lambda r: _shape(r["shape"]), lambda r: r["implementation"],
                lambda r: f"{r['median_ms'] * 1e3:.1f}", [(s, s) for s in shapes], cols,
                "us per call")
  return f"{table}\n\n{res.caption(recs)}"


def train_step(root: pathlib.Path) -> str:
  res = Results(root, "train_h200.json")
  recs = res.current("train_step")

  def choices(r):
    kernels = f"{r.get('kda_impl')} / {r.get('ragged_dot_impl')} / {r.get('gate_up_train')}"
    if "remat" not in r:
      return kernels
    gemm = "Triton" if r.get("xla_triton_gemm", True) else "cuBLAS"
    flags = f"; {r['xla_flags']}" if r.get("xla_flags") else ""
    cache = f"; JAX cache {r['compile_cache']}" if r.get("compile_cache") else ""
    built = r.get("prebuild_mosaic_gpu")
    prebuild = f"; {built} Mosaic GPU kernels prebuilt" if built else ""
    fold = "; Muon NS folded" if r.get("muon_ns_fold") else ""
    fold += "; Muon NS per leaf" if r.get("muon_ns_stack") is False else ""
    unrolled = "; layers unrolled" if r.get("scan_layers") is False else ""
    return (f"{kernels}; remat {r['remat']}{unrolled}; XLA GEMMs {gemm}{flags}{cache}{prebuild}"
            f"{fold}")

  def compile_s(r):
    total = _num(r.get("compile_and_warmup_s"))
    if "xla_compile_s" not in r:
      return total
    return (f"{total} ({r['trace_s']:.0f} + {r['lower_s']:.0f} + {r['xla_compile_s']:.0f} + "
            f"{r['warmup_s']:.0f})")

  body = [[f"{r['config']} B {r['B']} x T {r['T']}", choices(r),
           f"{r['step_ms']:.1f}", f"{r['tokens_per_s'] / 1e3:.1f}k", _num(r["model_tflops"], 1),
           f"{r['mfu']:.1%}", compile_s(r), res.provenance(r)]
          for r in sorted(recs, key=lambda r: (r["B"], r["step_ms"]))]
  header = ["config", "kda / ragged_dot / gate_up_train; remat; XLA GEMMs; XLA_FLAGS", "ms / step",
            "tokens/s", "model TFLOP/s", "MFU",
            "compile + warm-up, s (trace + lower + XLA + 2 steps)", "recorded"]
  return (f"{_table(header, body, text_columns=2)}\n\n"
          f"Recorded: benchmarks/results/train_h200.json (date measured, commit that added it).")


def train_parts(root: pathlib.Path) -> str:
  """The newest train-step record with a per-part table (`benchmarks/step_parts.py`)."""
  res = Results(root, "train_h200.json")
  recs = [r for r in res.records if r.get("op") == "train_step" and r.get("parts")]
  if not recs:
    return "No train-step record with a per-part table yet."
  r = recs[-1]
  total = sum(p["ms_per_step"] for p in r["parts"])
  body = [[p["part"], f"{p['ms_per_step']:.1f}", f"{p['share']:.1%}", _num(p.get("fwd_ms"), 1),
           _num(p.get("bwd_ms"), 1)] for p in r["parts"] if p["share"] >= 0.005]
  body.append(["**total** (parts under 0.5% included)", f"{total:.1f}", "100%", "", ""])
  return (f"{_table(['part', 'ms / step', 'share', 'forward ms', 'backward ms'], body)}\n\n"
          f"{r['config']} B {r['B']} x T {r['T']}, {r['step_ms']:.1f} ms per step with CUDA "
          f"graphs ({r['mfu']:.1%} MFU); recorded {res.provenance(r)}, code at "
          f"{r.get('commit', '?')}.")


def mla_attention(root: pathlib.Path) -> str:
  res = Results(root, "train_h200.json")
  recs = res.current("mla_attention")
  shapes = _shapes(recs)
  cols = [(f"{i}/{p}", f"{i} {'fwd' if p == 'fwd' else 'fwd+bwd'}")
          for i in ("cudnn", "cudnn_unpacked", "cudnn_own", "xla_blockwise", "reference")
          for p in ("fwd", "fwd_bwd")]
  table = _grid(recs, lambda r: _shape(r["shape"]), lambda r: f"{r['implementation']}/{r['pass']}",
                lambda r: f"{r['median_ms']:.2f}", [(s, s) for s in shapes], cols, "ms per call")
  return f"{table}\n\n{res.caption(recs)}"


def _copy_rate(records: list[Record], lead: str) -> str:
  """A sentence `lead` + the copy rates the records' fractions are taken against and their
  sources; "" when no record has one."""
  rates = {(r["copy_tbps"], r.get("copy_source")) for r in records if r.get("copy_tbps")}
  if not rates:
    return ""
  return lead + " and ".join(f"{rate} TB/s: {source or 'measured in the run'}"
                             for rate, source in sorted(rates, key=str)) + ". "


def _triton_default_name(op: str, shape: dict) -> str | None:
  """The name in `triton.CONFIGS` of the Triton tier's default config at this shape."""
  from pallas_kernels.mxfp4_matmul import triton
  grouped, k = op == "mxfp4_ragged_dot", shape["K"]
  want = triton.default_config(shape["M"], k, shape["N"], grouped)
  return next((n for n, c in triton.CONFIGS.items() if triton.fit(c, k) == want), None)


def mxfp4_matmul(root: pathlib.Path) -> str:
  """The MXFP4 tiers (our kernel at its default config, unpacked, reference, the Triton kernel
  at its fastest recorded config) against bf16, and the tier that dispatch picks on Hopper
  (`api.hopper_impls`) against bf16."""
  from pallas_kernels.mxfp4_matmul import api
  res = Results(root, "mxfp4_h200.json")
  recs = [r for op in ("mxfp4_matmul", "mxfp4_ragged_dot") for r in res.current(op)
          if r.get("median_ms")]
  column = lambda r: "bf16" if r["implementation"] in ("bf16_xla", "bf16_ragged_dot") else (
      r["implementation"].removeprefix("mxfp4_"))
  cols = ["mosaic_gpu", "unpacked", "reference", "bf16"]
  keep = [r for r in recs if column(r) in cols]
  row_of = lambda r: f"`{r['op']}` {_shape(r['shape'])}"
  dense_first = sorted(keep, key=lambda r: (r["op"] != "mxfp4_matmul", -r["shape"]["K"],
                                            r["shape"]["M"]))
  first = {}                       # row -> its first record (op and shape)
  for r in dense_first:
    first.setdefault(row_of(r), r)
  at = {(row_of(r), column(r)): r for r in keep}
  # (row, config name) -> the Triton tier's record; "default" names the tier run by name.
  triton_rows = {(row_of(r), column(r).removeprefix("triton").lstrip("_") or "default"): r
                 for r in recs if column(r).startswith("triton")}
  fastest_triton = {}              # row -> (config name, record)
  for (row, name), r in triton_rows.items():
    if row not in fastest_triton or r["median_ms"] < fastest_triton[row][1]["median_ms"]:
      fastest_triton[row] = (name, r)
  body = []
  for row, rec in first.items():
    cells = [f"{at[row, c]['median_ms'] * 1e3:.1f}" if (row, c) in at else "" for c in cols]
    name, t = fastest_triton.get(row, (None, None))
    cells.insert(1, f"{t['median_ms'] * 1e3:.1f} ({name})" if t else "")
    shape = rec["shape"]
    tier = api.hopper_impls(rec["op"] == "mxfp4_ragged_dot", shape["M"], shape["G"],
                            shape["G"] * shape["N"] * shape["K"])[0]
    chosen, bf16 = at.get((row, tier)), at.get((row, "bf16"))
    if tier == "triton":   # the default config's candidate row, else the tier by name
      chosen = (triton_rows.get((row, _triton_default_name(rec["op"], shape)))
                or triton_rows.get((row, "default")))
    cells.append(f"{tier}: {bf16['median_ms'] / chosen['median_ms']:.2f}x"
                 if chosen and bf16 else tier)
    ours = at.get((row, "mosaic_gpu"))
    cells.append(f"{ours['weight_tbps']:.2f} ({ours['copy_fraction']:.0%})"
                 if ours and ours.get("copy_fraction") is not None else "")
    body.append([row] + cells)
  header = ["us per call (device time)", "kernel (mosaic_gpu, default config)",
            "triton (fastest config)", "unpacked (bf16 in HBM, then cuBLAS / gmm)",
            "reference (unpack + XLA)",
            "bf16 XLA / bf16 grouped GEMM", "default tier: bf16 / it",
            "kernel: weights TB/s (of copy)"]
  return f"{_table(header, body)}\n\n{_copy_rate(keep, 'Copy rate ')}{res.caption(keep)}"


def decode_attention(root: pathlib.Path) -> str:
  """The decode attention tiers by (B, H, S, filled length), mosaic_gpu against its floor."""
  res = Results(root, "decode_attention_h200.json")
  keep = [r for r in res.current("decode_attention") if r.get("median_ms")
          and r["implementation"] in ("reference", "xla", "mosaic_gpu")]
  shape_of = lambda r: tuple(r["shape"][k] for k in ("B", "H", "S", "length"))
  at = {(shape_of(r), r["implementation"]): r for r in keep}
  body = []
  for key in sorted({shape_of(r) for r in keep}, key=lambda k: (*k[:3], -k[3])):
    b, h, s, length = key
    cells = [f"{at[key, i]['median_ms']:.3f}" if (key, i) in at else ""
             for i in ("reference", "xla", "mosaic_gpu")]
    ours = at.get((key, "mosaic_gpu"))
    cells.append(f"{ours['floor_fraction']:.0%} ({ours['tbps']:.2f} TB/s)"
                 if ours and ours.get("floor_fraction") is not None else "")
    body.append([f"B {b}, H {h}, S {s}, filled {length}"] + cells)
  header = ["ms per call (device time)", "reference", "xla", "mosaic_gpu",
            "mosaic_gpu: floor / time (TB/s read)"]
  floor = _copy_rate(keep, "Floor: the bytes a call must read at the copy rate, ")
  return f"{_table(header, body)}\n\n{floor}{res.caption(keep)}"


def decode(root: pathlib.Path) -> str:
  """k3_small's decode loop against its all-MLA and KDA-only twins by (B, context), with the
  default MoE kernels (records of `--swapped_gmm` / `--gate_up_impl` runs left out); runs with
  the routed experts packed (`--expert_format=mxfp4`) in rows of their own."""
  res = Results(root, "decode_h200.json")
  keep = [r for r in res.current("decode", moe_kernels=None) if r.get("tpot_ms")]
  key_of = lambda r: (r.get("expert_format") or "", r["shape"]["B"], r["shape"]["context"])
  at = {(key_of(r), r["variant"]): r for r in keep}
  variants = ("hybrid", "all_mla", "kda_only")
  body = []
  for key in sorted({key_of(r) for r in keep}):
    cells = []
    for v in variants:
      r = at.get((key, v))
      cells.append(f"{r['tpot_ms']:.2f} ({r['floor_ms']:.2f})" if r else "")
    hybrid, mla = at.get((key, "hybrid")), at.get((key, "all_mla"))
    cells.append(f"{mla['tpot_ms'] / hybrid['tpot_ms']:.2f}" if hybrid and mla else "")
    cells.append(f"{hybrid['tpot_ms'] / hybrid['floor_ms']:.1f}" if hybrid else "")
    prefill = hybrid and hybrid.get("prefill_tokens_per_s")
    cells += [f"{hybrid['decode_tokens_per_s']:.0f}", f"{prefill:.0f}" if prefill else "",
              f"{hybrid['cache_bytes_per_seq'] / 2**20:.1f}"] if hybrid else ["", "", ""]
    cells.append(f"{mla['cache_bytes_per_seq'] / 2**20:.1f}" if mla else "")
    experts = f", {key[0].upper()} experts" if key[0] else ""
    body.append([f"B {key[1]}, context {key[2]}{experts}"] + cells)
  header = ["per output token, ms (floor)", "k3_small (3 KDA : 1 MLA)", "all-MLA twin",
            "KDA-only twin", "all-MLA / k3_small", "k3_small / floor", "k3_small decode tok/s",
            "k3_small prefill tok/s", "k3_small cache MiB/seq", "all-MLA cache MiB/seq"]
  rates = sorted(r["copy_tbps"] for r in keep)
  floor = (f"Floor: the bytes one step reads (and KDA states written) at the copy rate measured "
           f"in each run, {rates[0]:.2f}-{rates[-1]:.2f} TB/s. " if rates else "")
  return f"{_table(header, body)}\n\n{floor}{res.caption(keep)}"


TABLES: dict[str, Callable[[pathlib.Path], str]] = {
    "ceilings": ceilings, "kda": kda, "kda_accuracy": kda_accuracy, "moe_gemm": moe_gemm,
    "moe_layer": moe_layer, "moe_gate_up": moe_gate_up, "top_k": top_k,
    "train_step": train_step, "train_parts": train_parts, "mla_attention": mla_attention,
    "mxfp4_matmul": mxfp4_matmul, "decode_attention": decode_attention, "decode": decode}


def fill(doc: str, tables: dict[str, str]) -> str:
  """`doc` with the text between each `<!-- report:NAME -->` and `<!-- /report:NAME -->`
  replaced by `tables[NAME]`; a marker pair missing from `doc` is a ValueError."""
  for name, text in tables.items():
    begin, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
    head, found, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not (found and found_end):
      raise ValueError(f"doc: no '{begin}' ... '{end}' pair for table {name!r}")
    doc = f"{head}{begin}\n{text}\n{end}{tail}"
  return doc


def render(root: pathlib.Path = _ROOT) -> dict[str, str]:
  return {name: make(root) for name, make in TABLES.items()}


def main(argv):
  del argv
  tables = render()
  if not _WRITE.value:
    print("\n\n".join(f"## {name}\n\n{text}" for name, text in tables.items()))
    return
  path = _ROOT / "BENCHMARKS.md"
  path.write_text(fill(path.read_text(), tables))


if __name__ == "__main__":
  app.run(main)
