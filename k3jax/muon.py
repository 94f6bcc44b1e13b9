"""Per-Head Muon with Moonlight scaling, and QK-Clip (MuonClip).

Optimizer of K3 ([TR] §2.5, §3.3; k3_techniques.md §6):

- Muon (Jordan 2024): Nesterov momentum 0.95, then five Newton-Schulz steps
  (3.4445, -4.7750, 2.0315) orthogonalise each matrix block O = NS5(M).
- Moonlight (arXiv 2502.16982): W <- W - lr (0.2 sqrt(max(A, B)) O + wd W), with
  A x B the dims of the orthogonalised block, so AdamW's lr and weight decay
  transfer. `optax.contrib.muon(consistent_rms=0.2)` takes A and B as the
  products of the reduction and output axes only (`_get_shape_products`);
  batch axes (heads, experts) do not enter, so the factor is per block (tested).
- Per-Head Muon ([TR] §2.5): Q/K/V projections [r, H, x] are orthogonalised per
  head (the head axis is a Muon batch axis), so a head with small gradients gets
  the same update RMS as the others. Experts [E, a, b] are always per expert.
- Embedding, LM head, norm gains, KDA A_log/dt_bias, short-conv filters and
  AttnRes pseudo-queries stay on AdamW; weight decay only on AdamW matrices.
- QK-Clip (K2, arXiv 2507.20534): after the optimizer step, MLA heads whose
  max logit S_max exceeded tau are rescaled by gamma = tau / S_max.

The algorithm is `optax.contrib.muon`'s (equal to it in fp32, tested); this module decides
which axes form a block (`RULES`), batches the Newton-Schulz iterations of equal blocks across
leaves (`orthogonalize`: one batched matmul per product instead of one per leaf) and runs them in
`ns_dtype` (bf16 as in Muon's own code, the config default; fp32 for exact comparisons).

Rules match unstacked parameters; a scanned stack of layers adds a leading axis
and would need its own rows (`format_table` shows where every leaf went).

Sharding. All decisions use paths and static shapes, so the transform traces
under `jit` with sharded params and never syncs with the host. Moment states
are `zeros_like(params)`: `tx.init` called outside `jit` on sharded arrays
returns states with the params' shardings; a jitted `tx.init` without
`out_shardings` puts them on one device, so pass `out_shardings` (from
`jax.eval_shape(tx.init, params)` and the params' shardings). Updates come out
sharded like the params. Inside NS the batch axes (heads, experts) move to
the front and are batched:
- a head or expert axis sharded over a mesh axis: each device orthogonalises its
  own heads/experts; the Frobenius norm and the X X^T products are per block, so
  the compiled update has no collective, also with the leaves of many layers
  stacked into one group (tested on 4 host devices, tests/test_fsdp.py).
- a reduction or output axis of the block split over `data` (FSDP on d, latent, the
  LoRA ranks): traced under a mesh whose `data` axis has several devices, each
  group's blocks are spread whole over `expert` x `data` by one all-to-all, iterated
  there (each device 1 / (expert data) of the group) and sent back
  (`_spread_newton_schulz`; tested on 8 host devices, tests/test_muon.py). Left to
  itself XLA gathered the whole stacked group on every device and iterated all of it
  there.
- another axis splitting a reduction or output dim (H sharded when heads are merged
  into a block: `mode="whole"`, o_proj [H, D, d], gates): the norm and X X^T contract
  over the sharded axis, so XLA (Auto mesh axes, as in `k3jax.sharding.make_mesh`)
  inserts collectives in every NS step; the result equals the unsharded update. With
  Explicit mesh axes the same matmul is a ShardingTypeError: reshard the block first.
Hence shard Q/K/V [d, H, D] over H and experts over E.
"""
import dataclasses
import math
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

DimNums = MuonDimensionNumbers

MUON_PER_HEAD = "muon_per_head"
MUON_PER_EXPERT = "muon_per_expert"
MUON_WHOLE = "muon_whole"
ADAMW = "adamw"
ADAMW_NO_DECAY = "adamw_no_decay"
FROZEN = "frozen"

MODES = ("per_head", "whole")
MOONLIGHT_RMS = 0.2  # Moonlight: 0.2 sqrt(max(A, B)) matches AdamW's update RMS.

# Optax partition label of each treatment.
_LABEL = {MUON_PER_HEAD: "muon", MUON_PER_EXPERT: "muon", MUON_WHOLE: "muon",
          ADAMW: "adamw", ADAMW_NO_DECAY: "adamw", FROZEN: "frozen"}


@dataclasses.dataclass(frozen=True)
class Rule:
  """One row of the treatment table.

  Attributes:
    pattern: regex searched in the dotted parameter path.
    ranks: ranks the row applies to (None: any rank).
    treatment: one of the treatment constants above.
    dims: Muon block axes (None for AdamW / frozen).
    reason: why, printed by `format_table`.
  """
  pattern: str
  ranks: tuple[int, ...] | None
  treatment: str
  dims: DimNums | None
  reason: str


_B = r"(?:^|\.)"  # start of a path component

# First matching row wins (pattern searched in the path, and rank matches).
RULES: tuple[Rule, ...] = (
    Rule(_B + r"e_score_correction_bias$", None, FROZEN, None,
         "router bias: set by Quantile Balancing outside the optimizer"),
    Rule(_B + r"embed_tokens\.embedding$", (2,), ADAMW, None,
         "embedding stays AdamW (Moonlight)"),
    Rule(_B + r"lm_head\.kernel$", (2,), ADAMW, None,
         "LM head stays AdamW (Moonlight)"),
    Rule(r"\.scale$", None, ADAMW_NO_DECAY, None, "norm gain, no decay"),
    Rule(r"_res_proj\.kernel$", (1,), ADAMW_NO_DECAY, None,
         "AttnRes pseudo-query vector, no decay"),
    Rule(_B + r"(?:A_log|dt_bias)$", (1,), ADAMW_NO_DECAY, None,
         "KDA decay parameters, no decay"),
    Rule(r"_conv1d\.kernel$", (2,), ADAMW, None,
         "depthwise short-conv filter [W, C], not a matmul"),
    Rule(_B + r"(?:q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.kernel$", (3,),
         MUON_PER_HEAD, DimNums(0, 2),
         "Per-Head Muon on Q/K/V [r, H, x] ([TR] 2.5): heads are batch axes"),
    Rule(_B + r"experts\.w[123]$", (3,), MUON_PER_EXPERT, DimNums(1, 2),
         "each expert [E, in, out] is its own matrix"),
    Rule(_B + r"(?:g_proj|g_b_proj|f_b_proj)\.kernel$", (3,), MUON_WHOLE,
         DimNums(0, (1, 2)), "gate [r, H, D]: one [r, H*D] matrix"),
    Rule(_B + r"o_proj\.kernel$", (3,), MUON_WHOLE, DimNums((0, 1), 2),
         "output projection [H, D, d]: one [H*D, d] matrix"),
    Rule(_B + r"gate\.kernel$", (2,), MUON_WHOLE, DimNums(0, 1),
         "MoE router [d, E]: a hidden matrix, Muon as in Moonlight"),
    Rule(r"", (2,), MUON_WHOLE, DimNums(0, 1), "2-D hidden matrix"),
    Rule(r"", (0, 1), ADAMW_NO_DECAY, None, "vector or scalar, no decay"),
    Rule(r"", None, ADAMW, None, "no rule for this rank: AdamW"),
)


@dataclasses.dataclass(frozen=True)
class Treatment:
  """The resolved treatment of one parameter."""
  rule: Rule
  treatment: str
  dims: DimNums | None


def _check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def path_str(path: tuple[Any, ...]) -> str:
  """Dotted path of a `jax.tree_util` key path; drops nnx's trailing `.value`."""
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == "value"):
    path = path[:-1]
  return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def resolve(path: str, shape: tuple[int, ...], mode: str = "per_head"
            ) -> Treatment:
  """Treatment of the parameter at dotted `path` with `shape` (first row wins)."""
  _check_mode(mode)
  for rule in RULES:
    if rule.ranks is not None and len(shape) not in rule.ranks:
      continue
    if re.search(rule.pattern, path):
      if mode == "whole" and rule.treatment == MUON_PER_HEAD:
        red = rule.dims.reduction_axis
        red_axes = (red,) if isinstance(red, int) else tuple(red)
        out = tuple(a for a in range(len(shape)) if a not in red_axes)
        return Treatment(rule, MUON_WHOLE, DimNums(red, out))
      return Treatment(rule, rule.treatment, rule.dims)
  raise AssertionError("RULES ends with a catch-all row")


def _resolver(mode: str, params_for_dims: Any | None
              ) -> Callable[[tuple[Any, ...], Any], Treatment]:
  """(key path, leaf) -> Treatment; frozen from `params_for_dims` if given."""
  _check_mode(mode)
  if params_for_dims is None:
    return lambda p, x: resolve(path_str(p), tuple(x.shape), mode)
  fixed = {path_str(p): (tuple(x.shape), resolve(path_str(p), tuple(x.shape),
                                                  mode))
           for p, x in jax.tree_util.tree_leaves_with_path(params_for_dims)}

  def lookup(p, x):
    key = path_str(p)
    if key not in fixed:
      raise ValueError(f"params_for_dims has no parameter {key!r}")
    shape, t = fixed[key]
    if tuple(x.shape) != shape:
      raise ValueError(f"params_for_dims has {key!r} with shape {shape}, the "
                       f"optimizer got {tuple(x.shape)}")
    return t
  return lookup


def muon_dimension_numbers(params: Any, *, mode: str = "per_head") -> Any:
  """Pytree like `params` of `MuonDimensionNumbers` (Muon) or None (AdamW)."""
  _check_mode(mode)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: resolve(path_str(p), tuple(x.shape), mode).dims, params)


@dataclasses.dataclass(frozen=True)
class TableRow:
  """Parameters that share a rule, treatment, shape and wildcard path."""
  pattern: str
  paths: tuple[str, ...]
  shape: tuple[int, ...]
  treatment: str
  dims: DimNums | None
  reason: str


def _wildcard(path: str) -> tuple[str, tuple[int, ...]]:
  parts = path.split(".")
  idx = tuple(int(q) for q in parts if q.isdigit())
  return ".".join("*" if q.isdigit() else q for q in parts), idx


def table_rows(params: Any, *, mode: str = "per_head") -> list[TableRow]:
  """Groups of parameters, one per (wildcard path, shape, treatment)."""
  groups: dict[tuple[Any, ...], list[str]] = {}
  for p, x in jax.tree_util.tree_leaves_with_path(params):
    path = path_str(p)
    t = resolve(path, tuple(x.shape), mode)
    key = (_wildcard(path)[0], tuple(x.shape), t.treatment, t.dims,
           t.rule.reason)
    groups.setdefault(key, []).append(path)
  return [TableRow(k[0], tuple(v), k[1], k[2], k[3], k[4])
          for k, v in groups.items()]


def _ranges(ints: list[int]) -> str:
  out, i = [], 0
  while i < len(ints):
    j = i
    while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
      j += 1
    out.append(str(ints[i]) if i == j else f"{ints[i]}-{ints[j]}")
    i = j + 1
  return ",".join(out)


def _fmt_dims(d: DimNums | None, shape: tuple[int, ...]) -> str:
  """'n x [A, B] *s': n blocks of A x B, Moonlight scale s = 0.2 sqrt(max(A, B))."""
  if d is None:
    return "-"
  axes = lambda a: (a,) if isinstance(a, int) else tuple(a)
  red, out = axes(d.reduction_axis), axes(d.output_axis)
  a = math.prod(shape[i] for i in red)
  b = math.prod(shape[i] for i in out)
  n = math.prod(shape) // (a * b)
  return f"{n}x[{a},{b}] *{MOONLIGHT_RMS * math.sqrt(max(a, b)):.3g}"


def format_table(params: Any, *, mode: str = "per_head") -> str:
  """Treatment table, one line per `table_rows` group (print at train start).

  Columns: treatment, Muon blocks "n x [A, B]" with their Moonlight factor,
  shape, number of params, wildcard path [layer indices], reason.
  """
  rows = table_rows(params, mode=mode)
  lines = [f"Muon treatment table (mode={mode}): {sum(len(r.paths) for r in rows)}"
           f" params in {len(rows)} groups"]
  for r in rows:
    idx = [_wildcard(p)[1] for p in r.paths]
    where = ""
    if idx[0]:
      where = (f" [{_ranges(sorted(i[0] for i in idx))}]" if len(idx[0]) == 1
               else f" {sorted(idx)}")
    lines.append(f"{r.treatment:15s} {_fmt_dims(r.dims, r.shape):22s} "
                 f"{str(list(r.shape)):18s} x{len(r.paths):<4d} "
                 f"{r.pattern}{where}  # {r.reason}")
  return "\n".join(lines)


def _block_layout(shape: tuple[int, ...], dims: DimNums
                  ) -> tuple[tuple[int, ...], tuple[int, int, int], bool]:
  """(transpose to batch + reduction + output axes, [b, A, B], whether A > B)."""
  axes = lambda a: (a % len(shape),) if isinstance(a, int) else tuple(i % len(shape) for i in a)
  red, out = axes(dims.reduction_axis), axes(dims.output_axis)
  if len(shape) < 2 or set(red) & set(out):
    raise ValueError(f"Muon block axes {dims} do not fit a parameter of shape {shape}")
  batch = tuple(i for i in range(len(shape)) if i not in red + out)
  a, b = math.prod(shape[i] for i in red), math.prod(shape[i] for i in out)
  return batch + red + out, (math.prod(shape[i] for i in batch), a, b), a > b


def block_groups(params: Any, *, mode: str = "per_head") -> dict[tuple[str, int, int], int]:
  """{(treatment, m, n): blocks} of the Muon leaves of `params` (arrays or ShapeDtypeStructs)
  as `orthogonalize` groups them: blocks [m, n] with m <= n, counted over leaves."""
  res = _resolver(mode, None)
  groups: dict[tuple[str, int, int], int] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    t = res(path, x)
    if t.dims is None:
      continue
    _, (b, a, c), _ = _block_layout(tuple(x.shape), t.dims)
    key = (t.treatment, min(a, c), max(a, c))
    groups[key] = groups.get(key, 0) + b
  return groups


def newton_schulz(x: jax.Array, coeffs: tuple[float, float, float], steps: int,
                  eps: float = 1e-8, dtype: Any = jnp.float32, fold: bool = False
                  ) -> jax.Array:
  """NS5 of a batch of blocks x [..., m, n], m <= n: X <- aX + (b XX^T + c (XX^T)^2) X, formed
  as (aI + bA + cA^2) X with A = XX^T: one elementwise pass over [m, m] a step (aX + BX took
  one over [m, m] and one over [m, n]).

  Each block is first divided by its Frobenius norm (in fp32), then iterated in `dtype`
  (Muon, Jordan 2024, runs bf16; fp32 reproduces `optax.contrib.muon`). Returns fp32.
  `fold` iterates the same map with every elementwise term a product's scaled output plus one
  addend (`_newton_schulz_folded`).
  """
  x = x.astype(jnp.float32)
  x = x / (jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) + eps)
  x = x.astype(dtype)
  if fold:
    return _newton_schulz_folded(x, coeffs, steps, dtype)
  c0, c1, c2 = (jnp.asarray(c, dtype) for c in coeffs)
  eye = jnp.eye(x.shape[-2], dtype=dtype)
  for _ in range(steps):
    a = jnp.einsum("...ij,...kj->...ik", x, x)
    x = jnp.einsum("...ij,...jk->...ik", c0 * eye + c1 * a + c2 * (a @ a), x)
  return x.astype(jnp.float32)


def _newton_schulz_folded(y: jax.Array, coeffs: tuple[float, float, float], steps: int,
                          dtype: Any) -> jax.Array:
  """NS5 as `newton_schulz`, each step's scalars folded into the scales of its products so
  that every elementwise term has the form alpha (A B) + C (a GEMM's own epilogue in cuBLAS,
  where the plain form needs a pass over [m, m] and one over [m, n] a step besides).

  X = s Y with s a running scalar: S = (c1 / c2) X X^T, B~ = (c2 / c1)^2 S S + S = B / c2
  (B = c1 A + c2 A^2), then X' = c0 X + B X = c0 s (Y + (c2 / c0) B~ Y), so Y <- (c2 / c0)
  B~ Y + Y and s <- c0 s. Returns s Y in fp32."""
  c0, c1, c2 = coeffs
  scale = 1.0
  k = lambda v: jnp.asarray(v, dtype)
  for _ in range(steps):
    sa = k(scale * scale * c1 / c2) * jnp.einsum("...ij,...kj->...ik", y, y)
    bt = k((c2 / c1) ** 2) * (sa @ sa) + sa
    y = k(c2 / c0) * (bt @ y) + y
    scale *= c0
  return y.astype(jnp.float32) * scale


def orthogonalize(tree: Any, treatments: Any, *, coeffs: tuple[float, float, float],
                  steps: int, eps: float = 1e-8, dtype: Any = jnp.float32,
                  fold: bool = False, stack: bool = True) -> Any:
  """NS5 of every Muon leaf of `tree` per its block axes ([TR] §2.5), blocks grouped.

  Leaves are reshaped to [b, A, B] blocks (transposed to A <= B), and the leaves of one
  treatment and one [b, A, B] are stacked [L, b, A, B] into one batched iteration: K3 has
  hundreds of equal matrices, and one batched matmul per NS product keeps the GPU busy where a
  matmul per leaf would not. Grouping by treatment keeps leaves sharded alike (experts over
  `expert`, heads over their axis) together, and stacking on a new axis (not concatenating on
  the head or expert axis) keeps each device's heads or experts on it: no collective. `treatments`
  is a pytree like `tree` of `Treatment`; leaves with `dims=None` pass through. `fold`: as
  `newton_schulz`'s. `stack=False` iterates each leaf's blocks alone (no copy of the leaves into
  a group; `benchmarks/muon_ns.py` times both).
  """
  leaves, treedef = jax.tree.flatten(tree)
  ts = treedef.flatten_up_to(treatments)
  groups: dict[tuple[Any, ...], list[int]] = {}
  layouts = {}
  for i, (x, t) in enumerate(zip(leaves, ts)):
    if t.dims is None:
      continue
    perm, (b, a, c), flip = _block_layout(tuple(x.shape), t.dims)
    blocks = x.transpose(perm).reshape(b, a, c)
    if flip:
      blocks = blocks.transpose(0, 2, 1)
    layouts[i] = (perm, blocks)
    groups.setdefault((t.treatment,) + blocks.shape + (() if stack else (i,)), []).append(i)
  out = list(leaves)
  for members in groups.values():
    parts = [layouts[i][1] for i in members]
    done = _spread_newton_schulz(jnp.stack(parts) if len(parts) > 1 else parts[0][None],
                                 lambda x: newton_schulz(x, coeffs, steps, eps, dtype, fold))
    for i, part in zip(members, done):
      perm, _ = layouts[i]
      x = leaves[i]
      _, (b, a, c), flip = _block_layout(tuple(x.shape), ts[i].dims)
      if flip:
        part = part.transpose(0, 2, 1)
      shape = tuple(x.shape[j] for j in perm)
      out[i] = part.reshape(shape).transpose(tuple(perm.index(j) for j in range(x.ndim))
                                              ).astype(x.dtype)
  return treedef.unflatten(out)


SPREAD_AXES = ("expert", "data")
"""Mesh axes a group's blocks are spread over when `data` splits them (`_spread_newton_schulz`)."""
SPREAD_CHUNK_BYTES = 1 << 30
"""Bytes of blocks (fp32 moments) a device iterates at once in a spread group: the group runs as
a `lax.map` over chunks of at most this, so NS's products do not grow with the layers."""


def _spread_newton_schulz(stacked: jax.Array, ns: Callable[[jax.Array], jax.Array]
                          ) -> jax.Array:
  """`ns` of a group's blocks [L, b, A, B], each device iterating whole blocks of its own.

  FSDP splits a block's A or B over `data` (the `embed`, `latent`, ... rules), and NS contracts
  over both: left to itself XLA gathers the whole stacked group on every device and iterates
  all of it there, so each `data` rank holds and computes every layer's blocks (on a TPU the
  step's memory then grows by the gathered stack per scanned unit: notes/tpu_compile.md). Under
  a mesh whose `data` axis has several devices, the blocks are reordered expert-major [b L, A,
  B] (b's own `expert` split stays in place), padded per `expert` chunk and split over
  `SPREAD_AXES`: one all-to-all over `data` brings each device whole blocks, 1 / (expert data)
  of the group, which it iterates in chunks of at most `SPREAD_CHUNK_BYTES`, and one takes the
  result back. Without such a mesh (one device; experts or heads split over `expert` alone,
  where each device already holds whole blocks) `ns` runs on the stack as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  if sizes.get("data", 1) == 1 or any(a not in sizes for a in SPREAD_AXES):
    return ns(stacked)
  n_layers, b, a, c = stacked.shape
  devices = sizes["expert"] * sizes["data"]
  chunks = sizes["expert"] if b % sizes["expert"] == 0 else 1
  per_chunk, m = devices // chunks, b // chunks * n_layers
  local = -(-m // per_chunk)
  steps = max(1, -(-local * a * c * stacked.dtype.itemsize // SPREAD_CHUNK_BYTES))
  k = -(-local // steps)
  x = stacked.transpose(1, 0, 2, 3).reshape(chunks, m, a, c)
  x = jnp.pad(x, ((0, 0), (0, per_chunk * steps * k - m), (0, 0), (0, 0)))
  spec = jax.sharding.PartitionSpec(SPREAD_AXES, None, None, None)
  x = jax.lax.with_sharding_constraint(x.reshape(devices, steps, k, a, c),
                                       jax.sharding.PartitionSpec(SPREAD_AXES, None, None, None,
                                                                  None))

  def chunk(xs):
    xs = jax.lax.with_sharding_constraint(xs, spec)
    return ns(xs.reshape(devices * k, a, c)).reshape(devices, k, a, c)

  y = jax.lax.map(chunk, x.transpose(1, 0, 2, 3, 4)).transpose(1, 0, 2, 3, 4)
  y = y.reshape(chunks, per_chunk * steps * k, a, c)[:, :m]
  return y.reshape(b, n_layers, a, c).transpose(1, 0, 2, 3)


class MomentumState(NamedTuple):
  """Muon's momentum: step count and first moment (as `optax.contrib.MuonState`)."""
  count: jax.Array
  mu: Any


def scale_by_grouped_muon(treatments: Callable[[Any], Any], *, beta: float, nesterov: bool,
                          coeffs: tuple[float, float, float], steps: int, eps: float = 1e-8,
                          ns_dtype: Any = jnp.float32, ns_fold: bool = False,
                          ns_stack: bool = True) -> optax.GradientTransformation:
  """Muon's momentum (`optax.contrib.scale_by_muon`'s, bias-corrected, Nesterov) then NS5 of
  the blocks, grouped (`orthogonalize`; `ns_stack` its `stack`). `treatments(tree)` gives each
  leaf's `Treatment`."""

  def init(params):
    return MomentumState(jnp.zeros([], jnp.int32),
                         jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    out = orthogonalize(mu_hat, treatments(updates), coeffs=coeffs, steps=steps, eps=eps,
                        dtype=ns_dtype, fold=ns_fold, stack=ns_stack)
    return out, MomentumState(count, mu)

  return optax.GradientTransformation(init, update)


def scale_by_block_shape(treatments: Callable[[Any], Any], rms: float
                         ) -> optax.GradientTransformation:
  """Moonlight's factor rms * sqrt(max(A, B)) of each leaf's [A, B] block ([TR] §2.5)."""

  def update(updates, state, params=None):
    del params

    def one(u, t):
      _, (_, a, b), _ = _block_layout(tuple(u.shape), t.dims)
      return u * (rms * math.sqrt(max(a, b)))
    return jax.tree.map(one, updates, treatments(updates)), state

  return optax.GradientTransformation(optax.init_empty_state, update)


NS_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def per_head_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.1,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    ns_dtype: str = "float32",
    ns_fold: bool = False,
    ns_stack: bool = True,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    mode: str = "per_head",
    params_for_dims: Any | None = None,
) -> optax.GradientTransformation:
  """Per-Head Muon + Moonlight scaling, AdamW for the rest ([TR] §2.5, §3.3).

  An `optax.partition` of three branches. "muon": `optax.contrib.muon`'s algorithm (momentum,
  NS5, `consistent_rms=0.2`, decoupled decay, lr; equal to it in fp32, tested) with the NS
  blocks of equal shape batched across leaves (`orthogonalize`) and the iteration in
  `ns_dtype`. "adamw": `optax.adamw` (plain, not Nesterov) with decay masked to matrices;
  `optax.contrib.muon`'s AdamW branch is not used because it has no decay mask, shares NS's
  eps and turns Nesterov Adam on with `nesterov`. "frozen": `optax.set_to_zero`. `update`
  needs `params`.

  Args:
    learning_rate: float or optax schedule, shared by Muon and AdamW.
    weight_decay: decoupled decay (times lr) on Muon and AdamW matrices.
    beta: Muon momentum.
    nesterov: Nesterov momentum for Muon.
    ns_steps: Newton-Schulz steps.
    ns_coeffs: quintic Newton-Schulz coefficients (a, b, c).
    ns_dtype: "float32" or "bfloat16" (Muon's own choice: 2-4x faster on GPUs).
    ns_fold: iterate NS5 in its folded form (`newton_schulz`'s `fold`).
    ns_stack: stack equal blocks of several leaves into one batch (`orthogonalize`'s `stack`);
      False iterates each leaf's blocks alone.
    adam_b1: AdamW beta1.
    adam_b2: AdamW beta2.
    adam_eps: AdamW epsilon.
    mode: "per_head" ([TR] §2.5) or "whole" (Q/K/V heads merged; ablation).
    params_for_dims: optional params (arrays or ShapeDtypeStructs); when given,
      the table is resolved once from it (errors surface here) and the
      optimizer must see exactly these paths and shapes.
  """
  if ns_dtype not in NS_DTYPES:
    raise ValueError(f"ns_dtype must be one of {sorted(NS_DTYPES)}, got {ns_dtype!r}")
  res = _resolver(mode, params_for_dims)

  def treatments(tree):
    return jax.tree_util.tree_map_with_path(res, tree)

  def labels(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _LABEL[res(p, x).treatment], tree)

  def adam_decay_mask(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: res(p, x).treatment == ADAMW, tree)

  muon_branch = optax.chain(
      scale_by_grouped_muon(treatments, beta=beta, nesterov=nesterov, coeffs=ns_coeffs,
                            steps=ns_steps, ns_dtype=NS_DTYPES[ns_dtype], ns_fold=ns_fold,
                            ns_stack=ns_stack),
      scale_by_block_shape(treatments, MOONLIGHT_RMS),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
  adam_branch = optax.adamw(learning_rate, b1=adam_b1, b2=adam_b2,
                            eps=adam_eps, weight_decay=weight_decay,
                            mask=adam_decay_mask)
  return optax.partition(
      {"muon": _scoped("muon", muon_branch), "adamw": _scoped("adamw", adam_branch),
       "frozen": optax.set_to_zero()}, labels)


def _scoped(name: str, tx: optax.GradientTransformation
            ) -> optax.GradientTransformationExtraArgs:
  """`tx` with its update under `jax.named_scope(name)`: its ops carry the name in traces."""
  tx = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra_args):
    with jax.named_scope(name):
      return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def cosine_schedule_args(peak_lr: float, total_steps: int, warmup_frac: float = 0.01,
                         final_frac: float = 0.1) -> dict[str, float | int]:
  """`cosine_lr`'s arguments, checked: linear warmup over `warmup_frac` of the steps (at least
  one), then cosine to final_frac * peak at `total_steps`. K3 ([TR] §3.3): 1% warmup."""
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  if not 0.0 <= warmup_frac < 1.0:
    raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac}")
  if not 0.0 <= final_frac <= 1.0:
    raise ValueError(f"final_frac must be in [0, 1], got {final_frac}")
  warmup = max(1, round(warmup_frac * total_steps))
  if total_steps <= warmup:
    raise ValueError(f"total_steps must exceed the {warmup} warmup step(s), got {total_steps}")
  return {"peak_lr": float(peak_lr), "warmup_steps": warmup, "total_steps": int(total_steps),
          "final_lr": float(final_frac * peak_lr)}


def cosine_lr(count: jax.Array, args: dict[str, Any]) -> jax.Array:
  """The learning rate at step `count` of the schedule `args` (`cosine_schedule_args`; report
  §3.3): `optax.warmup_cosine_decay_schedule`'s values from 0, to fp32 rounding. The arguments
  may be traced arrays, so that one compiled train step serves runs of any length or peak
  (optax checks its step counts in Python, so its schedules bake them into the program)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  count, peak, end = f32(count), f32(args["peak_lr"]), f32(args["final_lr"])
  warmup, decay = f32(args["warmup_steps"]), f32(args["total_steps"]) - f32(args["warmup_steps"])
  warm = peak * jnp.clip(count, 0, warmup) / warmup
  t = jnp.minimum(count - warmup, decay)
  cosine = (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * t / decay)) + end
  return jnp.where(count < warmup, warm, cosine)


def cosine_schedule(peak_lr: float, total_steps: int, warmup_frac: float = 0.01,
                    final_frac: float = 0.1) -> optax.Schedule:
  """`cosine_lr` with its arguments fixed (`cosine_schedule_args`'s checks)."""
  args = cosine_schedule_args(peak_lr, total_steps, warmup_frac, final_frac)
  return lambda count: cosine_lr(count, args)


_QK_CLIP_TARGETS = ("q_b_proj", "q_proj", "kv_b_proj")


def qk_clip(params: Any, max_logits: dict[str, jax.Array], *, tau: float,
            qk_nope_head_dim: int, qk_rope_head_dim: int) -> Any:
  """QK-Clip (MuonClip, K2 arXiv 2507.20534), applied after the update.

  For each MLA layer prefix in `max_logits` ([H] max pre-softmax logit, softmax
  scale included) and each head with S_max > tau, gamma = tau / S_max scales
  the head's q nope columns and k nope columns (kv_b) by sqrt(gamma) and its q
  rope columns by gamma, so every logit of that head is scaled by gamma. The
  shared k rope (kv_a_proj_with_mqa) and the v columns are untouched.

  Args:
    params: pytree with `{prefix}.q_b_proj.kernel` (or `q_proj`) [r, H, dn+dr]
      and `{prefix}.kv_b_proj.kernel` [kr, H, dn+dv].
    max_logits: MLA layer path prefix (e.g. "layers.3.self_attn") -> [H].
    tau: logit cap, a Python float (K2: 100).
    qk_nope_head_dim: dn.
    qk_rope_head_dim: dr.

  Returns:
    params with the clipped kernels replaced.
  """
  if tau <= 0:
    raise ValueError(f"tau must be > 0, got {tau}")
  dn, dr = qk_nope_head_dim, qk_rope_head_dim
  targets = {f"{pre}.{name}.kernel": (pre, name) for pre in max_logits
             for name in _QK_CLIP_TARGETS}
  found: dict[str, set[str]] = {pre: set() for pre in max_logits}

  def clip(p, w):
    key = path_str(p)
    if key not in targets:
      return w
    pre, name = targets[key]
    s = jnp.asarray(max_logits[pre], jnp.float32)
    if w.ndim != 3 or s.shape != (w.shape[1],):
      raise ValueError(f"max_logits[{pre!r}] has shape {s.shape}, {key} has "
                       f"shape {w.shape}: expected [H] and [r, H, x]")
    gamma = jnp.where(s > tau, tau / s, 1.0)
    root = jnp.sqrt(gamma)
    if name == "kv_b_proj":
      if w.shape[2] <= dn:
        raise ValueError(f"{key} has last dim {w.shape[2]}, expected dn + dv "
                         f"with qk_nope_head_dim={dn}")
      factor = jnp.concatenate(
          [jnp.broadcast_to(root[:, None], (s.shape[0], dn)),
           jnp.ones((s.shape[0], w.shape[2] - dn), jnp.float32)], axis=1)
    else:
      if w.shape[2] != dn + dr:
        raise ValueError(f"{key} has last dim {w.shape[2]}, expected "
                         f"qk_nope_head_dim + qk_rope_head_dim = {dn + dr}")
      factor = jnp.concatenate(
          [jnp.broadcast_to(root[:, None], (s.shape[0], dn)),
           jnp.broadcast_to(gamma[:, None], (s.shape[0], dr))], axis=1)
    found[pre].add("kv" if name == "kv_b_proj" else "q")
    return (w.astype(jnp.float32) * factor[None]).astype(w.dtype)

  out = jax.tree_util.tree_map_with_path(clip, params)
  for pre, kinds in found.items():
    if kinds != {"q", "kv"}:
      raise ValueError(f"max_logits names MLA layer {pre!r}, but params lack "
                       f"{pre}.q_b_proj/q_proj.kernel or {pre}.kv_b_proj.kernel")
  return out
