"""Public grouped-matmul ops for the MoE experts (report §2.3, Eq. 11: W1/W3/W2 per expert).

`ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])` has the semantics of
`jax.lax.ragged_dot`: rows are sorted by group, row r of group g gives lhs[r] @ rhs[g], rows
past sum(group_sizes) give zeros. Its backward is two grouped matmuls:
  d_lhs = ragged_dot(d_out, rhs^T)          (gmm with transpose_rhs: no transposed copy of rhs)
  d_rhs[g] = lhs_g^T d_out_g                (tgmm = `transposed_ragged_dot`)

Tiers ("impl"): "xla" (`jax.lax.ragged_dot`, the reference, differentiated by JAX itself),
"mosaic_gpu" (Hopper Pallas kernels, `mosaic_gpu.py`), "mosaic_tpu" (megablox,
`mosaic_tpu.py`). impl=None picks mosaic_gpu on H100/H200/H800 and xla otherwise (mosaic_tpu
by name only until its tests run on a TPU). Each product (forward, d_lhs, d_rhs) goes to the
first tier of [impl, "xla"] whose `supports_*` accepts it (fail closed); `plan(...)` returns the choice and every reason a tier
declined. `interpret=True` runs the kernel tiers in their interpret modes (CPU testing).
"""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tiers
from pallas_kernels.ragged_dot import mosaic_gpu
from pallas_kernels.ragged_dot import mosaic_tpu
from pallas_kernels.ragged_dot import xla

IMPLS = ("xla", "mosaic_gpu", "mosaic_tpu")
TIERS: dict[str, types.ModuleType] = {
    "xla": xla, "mosaic_gpu": mosaic_gpu, "mosaic_tpu": mosaic_tpu}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The tier of each product of one call and the (product, tier, reason) of each refusal."""
  forward: str
  d_lhs: str
  d_rhs: str
  declined: tuple[tuple[str, str, str], ...]
  out_dtype: np.dtype
  interpret: bool


def default_impls() -> tuple[str, ...]:
  """Tier order for impl=None on the default device. A kernel joins it on a platform only
  after its tests pass there: mosaic_gpu passed on the H200; mosaic_tpu (megablox) has run
  only in the TPU interpreter, so it is reachable by name only."""
  if mosaic_gpu.is_hopper():
    return ("mosaic_gpu", "xla")
  return ("xla",)


def _check_floating(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")


def _check_group_sizes(group_sizes, num_groups: int | None) -> None:
  if group_sizes.ndim != 1 or (num_groups is not None and group_sizes.shape[0] != num_groups):
    want = "[G]" if num_groups is None else f"[G] = ({num_groups},)"
    raise ValueError(f"group_sizes must have shape {want}, got {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array (int32), got {group_sizes.dtype}")


def _out_dtype(lhs, rhs, preferred_element_type) -> np.dtype:
  if preferred_element_type is None:
    return jnp.result_type(lhs.dtype, rhs.dtype)
  return jnp.dtype(preferred_element_type)


def _pick(order, product: str, label: str, declined: list, *args, **kwargs) -> str:
  for name in order:
    reason = getattr(TIERS[name], f"supports_{product}")(*args, **kwargs)
    if reason is None:
      return name
    declined.append((label, name, reason))
  raise AssertionError("the xla tier takes every call")


def _validate(lhs, rhs, group_sizes, transposed: bool) -> None:
  _check_floating("lhs", lhs)
  _check_floating("rhs", rhs)
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
  if transposed:
    if rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
      raise ValueError(f"rhs must be [M, N] with M = {lhs.shape[0]}, got shape {rhs.shape}")
    _check_group_sizes(group_sizes, None)
  else:
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
      raise ValueError(f"rhs must be [G, K, N] with K = {lhs.shape[1]}, got shape {rhs.shape}")
    _check_group_sizes(group_sizes, rhs.shape[0])


def _plan(lhs, rhs, group_sizes, transposed: bool, preferred_element_type, impl: str | None,
          interpret: bool) -> Plan:
  """The tier of each of the three products (forward, d_lhs, d_rhs), first that supports it.

  gmm: forward gmm, d_lhs = gmm(d_out, rhs^T), d_rhs = tgmm(lhs, d_out).
  tgmm: forward tgmm, d_lhs = gmm(rhs, d_out^T), d_rhs = gmm(lhs, d_out).
  """
  _validate(lhs, rhs, group_sizes, transposed)
  order = tiers.order(impl, IMPLS, default_impls())
  out_dtype = _out_dtype(lhs, rhs, preferred_element_type)
  if transposed:
    cot = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), lhs.dtype)
    products = (("tgmm", lhs, rhs), ("gmm", rhs, cot), ("gmm", lhs, cot))
  else:
    cot = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    products = (("gmm", lhs, rhs), ("gmm", cot, rhs), ("tgmm", lhs, cot))
  declined: list = []
  chosen = [
      _pick(order, product, label, declined, a, b, group_sizes, out_dtype=dtype,
            interpret=interpret, **({"transpose_rhs": True} if label == "d_lhs" else {}))
      for (product, a, b), label, dtype in zip(products, ("forward", "d_lhs", "d_rhs"),
                                                (out_dtype, lhs.dtype, rhs.dtype))]
  return Plan(*chosen, tuple(declined), out_dtype, interpret)


def plan(lhs, rhs, group_sizes, *, preferred_element_type=None, impl: str | None = None,
         interpret: bool = False) -> Plan:
  """Tiers that `ragged_dot` would use for these arguments (arrays or ShapeDtypeStructs)."""
  return _plan(lhs, rhs, group_sizes, False, preferred_element_type, impl, interpret)


def plan_transposed(lhs, rhs, group_sizes, *, preferred_element_type=None,
                    impl: str | None = None, interpret: bool = False) -> Plan:
  """Tiers that `transposed_ragged_dot` would use (d_lhs, d_rhs are gmm products)."""
  return _plan(lhs, rhs, group_sizes, True, preferred_element_type, impl, interpret)


def _gmm(tier, lhs, rhs, group_sizes, p: Plan, **kwargs):
  return TIERS[tier].gmm(lhs, rhs, group_sizes, interpret=p.interpret, **kwargs)


def _tgmm(tier, lhs, rhs, group_sizes, p: Plan, **kwargs):
  return TIERS[tier].tgmm(lhs, rhs, group_sizes, interpret=p.interpret, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_vjp(lhs, rhs, group_sizes, p: Plan, transposed: bool):
  """gmm (transposed=False) or tgmm on the plan's forward tier; its VJP is two products."""
  product = _tgmm if transposed else _gmm
  return product(p.forward, lhs, rhs, group_sizes, p, out_dtype=p.out_dtype)


def _grouped_fwd(lhs, rhs, group_sizes, p: Plan, transposed: bool):
  return _grouped_vjp(lhs, rhs, group_sizes, p, transposed), (lhs, rhs, group_sizes)


def _grouped_bwd(p: Plan, transposed: bool, residuals, d_out):
  """gmm: d_lhs = d_out rhs^T, d_rhs = tgmm(lhs, d_out). tgmm: d_lhs = rhs d_out^T,
  d_rhs = lhs d_out (both gmm)."""
  lhs, rhs, group_sizes = residuals
  d_out = d_out.astype(lhs.dtype)
  if transposed:
    d_lhs = _gmm(p.d_lhs, rhs, d_out, group_sizes, p, transpose_rhs=True, out_dtype=lhs.dtype)
    d_rhs = _gmm(p.d_rhs, lhs, d_out, group_sizes, p, out_dtype=rhs.dtype)
  else:
    d_lhs = _gmm(p.d_lhs, d_out, rhs, group_sizes, p, transpose_rhs=True, out_dtype=lhs.dtype)
    d_rhs = _tgmm(p.d_rhs, lhs, d_out, group_sizes, p, out_dtype=rhs.dtype)
  return d_lhs, d_rhs, None


_grouped_vjp.defvjp(_grouped_fwd, _grouped_bwd)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               preferred_element_type=None, impl: str | None = None,
               interpret: bool = False) -> jax.Array:
  """Grouped matmul lhs [M, K], rhs [G, K, N], group_sizes [G] int -> [M, N].

  Output dtype: preferred_element_type, else the promoted input dtype; kernels accumulate in
  fp32. impl: None (platform default) or one of IMPLS; a call the kernel cannot take (tiles,
  dtype, device) runs on "xla" instead (see `plan`). Differentiable in lhs and rhs.
  """
  p = plan(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, impl=impl,
           interpret=interpret)
  group_sizes = group_sizes.astype(jnp.int32)
  if p.forward == "xla":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=p.out_dtype)
  return _grouped_vjp(lhs, rhs, group_sizes, p, False)


def transposed_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                          preferred_element_type=None, impl: str | None = None,
                          interpret: bool = False) -> jax.Array:
  """Per-group lhs_g^T rhs_g: lhs [M, K], rhs [M, N], group_sizes [G] int -> [G, K, N].

  The weight gradient of `ragged_dot`; rows past sum(group_sizes) take no part and empty
  groups give zeros. Tiers and fallback as `ragged_dot`; differentiable in lhs and rhs on
  every tier through two gmm products (JAX 0.11.2 has no transpose rule for
  `ragged_dot_general` with a ragged contracting dim, so the xla tier uses them too).
  """
  p = plan_transposed(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                      impl=impl, interpret=interpret)
  return _grouped_vjp(lhs, rhs, group_sizes.astype(jnp.int32), p, True)
