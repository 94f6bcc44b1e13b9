"""Public fused decode step of one KDA layer (report §2.1; Kimi Linear arXiv 2510.26692 §4).

`kda_decode_step(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths)`
runs one new token per row through a KDA token mixer after its input projections and before
its output projection: the causal conv over the cached tail, SiLU, the q / k L2 norms, the
forget gate from the low-rank logits, beta, the delta-rule recurrence, and the output's
per-head RMSNorm times sigmoid(z). fla splits the same work over `causal_conv1d_update`,
`fused_recurrent_kda(..., use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)` and
`FusedRMSNormGated`; here it is one op so that a decode step is one kernel a layer.

Shapes (H heads of dim K, conv width W, gate rank R):
  proj [B, 4HK + R + H]: one token's projections side by side, [q | k | v | z | f_a | beta
    logits] (q, k, v before the conv; z the output gate's logits; f_a the gate's low-rank
    input), so that one GEMM writes them all and the kernel reads them in place;
  conv_tail [B, W-1, 3, HK]: the last W-1 inputs of the q, k, v convs; conv_weight [W, 3, HK]
    (the q, k, v kernels stacked; [.., 3, HK] is also the TPU's tiling, where a [.., 3HK] view
    would be a relayout copy);
  f_b [R, H, K]; a_log [H]; dt_bias [HK]; o_norm [K]; state [B, H, K, K] (fp32);
  lengths [B] or None: row b is padding (no state change, tail kept) where lengths[b] == 0.
Returns (o [B, HK] in proj's dtype, the new conv_tail, the new state fp32).

Tiers ("impl"): "xla" (the reference, `xla.py`, fp32), "triton" (one program per row and
head, `triton.py`) and "mosaic_tpu" (one program per head, `mosaic_tpu.py`; by name only: not
yet run on a TPU); the kernels write the tail and the state over their inputs' buffers.
impl=None runs triton on a GPU (while TRITON_IS_DEFAULT), else xla; a named tier that declines
falls through to xla. `plan(...)` returns the tier and every reason a tier declined.
"""
import types

import jax
import jax.numpy as jnp

from pallas_kernels import tiers
from pallas_kernels.kda_decode import mosaic_tpu
from pallas_kernels.kda_decode import triton
from pallas_kernels.kda_decode import xla

IMPLS = ("xla", "triton", "mosaic_tpu")
TIERS: dict[str, types.ModuleType] = {"xla": xla, "triton": triton, "mosaic_tpu": mosaic_tpu}
GATES = ("lower_bound", "softplus")
# On since its tests passed compiled on an H100 (2026-12-07).
TRITON_IS_DEFAULT = True
Plan = tiers.Plan


def proj_width(num_heads: int, head_dim: int, gate_rank: int) -> int:
  """Columns of `proj`: q, k, v, z (H K each), f_a (R) and the beta logits (H)."""
  return 4 * num_heads * head_dim + gate_rank + num_heads


def default_impls() -> tuple[str, ...]:
  return ("triton", "xla") if TRITON_IS_DEFAULT and triton.is_gpu() else ("xla",)


def _check(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths):
  if f_b.ndim != 3:
    raise ValueError(f"f_b must be [R, H, K], got shape {tuple(f_b.shape)}")
  r, h, k = f_b.shape
  b = proj.shape[0] if proj.ndim == 2 else None
  want = dict(proj=(b, proj_width(h, k, r)), conv_weight=(conv_weight.shape[0], 3, h * k),
              conv_tail=(b, conv_weight.shape[0] - 1, 3, h * k), a_log=(h,), dt_bias=(h * k,),
              o_norm=(k,), state=(b, h, k, k))
  if lengths is not None:
    want["lengths"] = (b,)
  arrays = dict(proj=proj, conv_weight=conv_weight, conv_tail=conv_tail, f_b=f_b, a_log=a_log,
                dt_bias=dt_bias, o_norm=o_norm, state=state)
  for name, shape in want.items():
    got = tuple((lengths if name == "lengths" else arrays[name]).shape)
    if got != shape:
      raise ValueError(f"{name} must have shape {shape} (H={h}, K={k}, R={r} from f_b), got "
                       f"{got}")
  for name, a in arrays.items():
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating array, got dtype {a.dtype}")
  if lengths is not None and not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array, got dtype {lengths.dtype}")
  if conv_weight.shape[0] < 2:
    raise ValueError(f"conv_weight must have a width W >= 2, got {conv_weight.shape[0]}")


def plan(proj, conv_tail, f_b, *, impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `kda_decode_step` would use (arrays or ShapeDtypeStructs)."""
  return tiers.first_supported(
      tiers.order(impl, IMPLS, default_impls()),
      lambda name: TIERS[name].supports(proj, conv_tail, f_b=f_b, interpret=interpret),
      interpret)


def kda_decode_step(proj: jax.Array, conv_tail: jax.Array, conv_weight: jax.Array,
                    f_b: jax.Array, a_log: jax.Array, dt_bias: jax.Array, o_norm: jax.Array,
                    state: jax.Array, lengths: jax.Array | None = None, *,
                    gate: str = "lower_bound", lower_bound: float = -5.0,
                    scale: float | None = None, norm_eps: float = 1e-5,
                    impl: str | None = None, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode step of a KDA layer (shapes in the module docstring).

  gate: "lower_bound" (K3: g = lower_bound * sigmoid(e^A (f + dt_bias))) or "softplus"
  (Kimi Linear: g = -e^A softplus(f + dt_bias)); scale multiplies q (default K**-0.5);
  norm_eps is the output RMSNorm's. Raises ValueError naming a mis-shaped argument.
  """
  _check(proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths)
  if gate not in GATES:
    raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
  scale = float(f_b.shape[-1] ** -0.5 if scale is None else scale)
  p = plan(proj, conv_tail, f_b, impl=impl, interpret=interpret)
  kw = dict(gate=gate, lower_bound=float(lower_bound), scale=scale, norm_eps=float(norm_eps))
  args = (proj, conv_tail, conv_weight, f_b, a_log, dt_bias, o_norm, state, lengths)
  if p.impl in ("triton", "mosaic_tpu"):
    return TIERS[p.impl].kda_decode_step(*args, interpret=p.interpret, **kw)
  return xla.kda_decode_step(*args, **kw)
