"""Public MXFP4-weight x bf16-activation matmuls for the routed experts (k3_techniques.md §7;
checkpoint layout k3_hf_names.md).

A weight W [N, K] (out, in) is given as the released K3 checkpoint stores it: `w_packed` uint8
[N, K/2] (element 2j in the low nibble, 2j+1 in the high one; a nibble is an E2M1 code, values
0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives) and `w_scale` uint8 [N, K/32] (E8M0 bits, the
block of 32 elements along K is scaled by 2^(s - 127)).
  mxfp4_matmul(x [M, K], w_packed, w_scale)                -> [M, N] = x @ W^T
  mxfp4_ragged_dot(lhs [M, K], w_packed [G, N, K/2], w_scale [G, N, K/32], group_sizes [G])
                                                           -> [M, N]
mxfp4_ragged_dot has `jax.lax.ragged_dot`'s semantics with expert g's weight W_g^T: rows sorted
by group, rows past sum(group_sizes) give zeros. Output dtype: preferred_element_type, else x's;
products accumulate in fp32.

Tiers ("impl"): "reference" (`k3jax.mx.unpack_k3` then `jnp.dot` / `jax.lax.ragged_dot`, any
platform), "xla" (the same product with the weight in XLA's float4_e2m1fn / float8_e8m0fnu
types, a dequantization XLA's GEMM fusion can take; any platform, `xla.py`), "unpacked" (the
weight unpacked to bf16 in HBM once per call, then cuBLAS / our bf16 grouped GEMM; any platform,
`unpacked.py`), "mosaic_gpu" (Hopper kernel dequantizing on chip, `mosaic_gpu.py`), "triton" (a
Pallas kernel on the Triton backend for few rows, decode: one launch streaming the packed
weights, `triton.py`), "mosaic_tpu" (`mosaic_tpu.py`, imported when asked for). impl=None is the
platform default (`default_impls`, by the rows of the call): a kernel joins it only after its
tests pass on its hardware and where it is the faster tier. On Hopper (GPU tests on the H200,
2026-12-02/03/06): `mxfp4_matmul` runs triton at one row, the reference from 2 to 7 rows (XLA
fuses the unpacking into its GEMV), triton from 8 to 16 and "unpacked" above;
`mxfp4_ragged_dot` runs triton up to 8 rows per expert (then mosaic_gpu where it declines),
mosaic_gpu below 128 and "unpacked" from 128. mosaic_tpu joins once its tests run on a TPU.
A named kernel that declines a call (`supports_*` gives the reason) falls through to the
reference (fail closed); `plan` / `plan_ragged_dot` return the choice and every reason.
`interpret=True` runs the kernel tiers in their interpreters (CPU tests).

The MoE experts' first product on packed W1 / W3 (report Eq. 11), for decoding:
  mxfp4_gate_up(x [N, K], rows [M], w1_packed, w1_scale, w3_packed, w3_scale [G, F, ...],
                group_sizes [G], beta1, beta2)  -> h [M, F] = SiTU(x[rows] W1_g^T, x[rows] W3_g^T)
tiers "reference" (gather, two reference products in fp32, `k3jax.situ.situ`) and "triton" (one
launch: the gather, both products and SiTU, `triton.gate_up`); impl=None: "triton" on Hopper
(its GPU tests pass; 1.15-1.4x the unfused gather, two grouped calls and SiTU at k3_small's
decode shapes, H100, 2026-12-07), the reference elsewhere. Not differentiable.

The MoE's routed experts whole on packed W1 / W3 / W2 (Eq. 11), for decoding:
  mxfp4_expert_ffn(x [N, K], weights [N, k], order, inverse [M = N k], w1_packed, w1_scale,
                   w3_packed, w3_scale [G, F, ...], w2_packed, w2_scale [G, D, ...],
                   group_sizes [G], beta1, beta2)
    -> u [N, D] fp32, u[n] = sum_j weights[n, j] W2_g SiTU(W1_g x_n, W3_g x_n)
tiers "reference" (`mxfp4_gate_up`'s reference, the W2 product in fp32, the weighted sum of each
token's copies) and "triton" (one launch for the gather, W1, W3, SiTU and W2, each program
writing its hidden block's share of the W2 product; one XLA fusion sums the shares and the
copies: `triton.expert_ffn`; its GPU tests pass on an H100, 2026-12-07); impl=None: the
reference (`EXPERT_FFN_IS_DEFAULT` off: no faster in a decode loop). Not differentiable.

Inference ops: differentiable with respect to x only (a custom VJP on every tier: d_x =
d_out @ W through the reference's dequantization); the packed weights and scales are integer
arrays and get no gradient (QAT trains the float weights through `k3jax.mx.fake_quantize`).
"""
import functools
import importlib
import logging
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tiers
from pallas_kernels.mxfp4_matmul import reference

IMPLS = ("reference", "xla", "unpacked", "mosaic_gpu", "mosaic_tpu", "triton")
BLOCK = 32
Plan = tiers.Plan


# On Hopper (BENCHMARKS.md "MXFP4 matmul", H200, 2026-12-03): unpacking to bf16 in HBM then
# cuBLAS beats every other tier dense from 16 rows (0.90x / 0.81x bf16 at 4096 rows), where at
# fewer rows XLA's GEMV with the unpacking fused is fastest; grouped, the on-chip kernel wins at
# 2-8 rows per expert and unpacking then the bf16 gmm at 512 (1.5-1.6x the kernel): straight
# lines through the two measured points cross near 130 rows per expert. The unpacked weight is
# materialised, so weights whose bf16 copy exceeds UNPACKED_MAX_BYTES stay on the kernel (all
# 896 of K3's experts of one matrix: 19.7 GB).
UNPACKED_MIN_ROWS = 17
UNPACKED_MIN_ROWS_PER_GROUP = 128
# The Triton kernel ("ptx" dequantization, H200, 2026-12-03, K3 shapes): dense at 16 rows
# 11.6-12.9 us against unpacked's 15.6-16.3 and the reference's 23.1-23.5, at 1 row 11.7-13.0
# against the reference's 10.8-11.3 (its time flat in the rows, the reference's growing: the
# lines cross between 2 and 6 rows, so from 8); grouped at 2-8 rows per expert 40.5-48.9 us,
# 1.4-2.3x the Mosaic GPU kernel's speed. Above 16 dense rows and 8 per expert it is unmeasured.
# One dense row (H200, 2026-12-06, 727e9f9): the Triton kernel's CUDA-core config with its K steps
# unrolled ("fma_n4_w2_unroll", `triton.default_config`) takes 9.1 / 9.8 us at (K, N) = (3584,
# 3072) / (3072, 3584) against the reference's 10.6 / 11.1 (and its own 16-row MMA config's 13.4
# / 12.0); from 2 rows each row is its own pass over the weights. Grouped, a program's MMA
# row block holds 16 rows, so 9-16 rows per expert cost a program what 2-8 do (16 a group is
# the MoE's `all_experts` decode path at B 16; not measured alone).
TRITON_MIN_ROWS = 8
TRITON_MAX_ROWS = 16
TRITON_MAX_ROWS_PER_GROUP = 16
UNPACKED_MAX_BYTES = 4 << 30


def hopper_impls(grouped: bool, m: int, groups: int = 1,
                 weight_elements: int = 0) -> tuple[str, ...]:
  """Hopper's tier order at m rows over `groups` weights of `weight_elements` elements in all:
  the unpacked tier from UNPACKED_MIN_ROWS (dense) or UNPACKED_MIN_ROWS_PER_GROUP per expert
  (grouped) while the bf16 weights fit UNPACKED_MAX_BYTES; else triton up to
  TRITON_MAX_ROWS_PER_GROUP per expert and mosaic_gpu above (grouped), triton at one row and
  from TRITON_MIN_ROWS to TRITON_MAX_ROWS, the reference elsewhere (dense)."""
  fits = 2 * weight_elements <= UNPACKED_MAX_BYTES
  if grouped:
    if fits and m >= UNPACKED_MIN_ROWS_PER_GROUP * groups:
      return ("unpacked", "reference")
    if m <= TRITON_MAX_ROWS_PER_GROUP * groups:
      return ("triton", "mosaic_gpu", "reference")
    return ("mosaic_gpu", "reference")
  if fits and m >= UNPACKED_MIN_ROWS:
    return ("unpacked", "reference")
  triton = m == 1 or TRITON_MIN_ROWS <= m <= TRITON_MAX_ROWS
  return ("triton", "reference") if triton else ("reference",)


def default_impls(grouped: bool, m: int = 0, groups: int = 1,
                  weight_elements: int = 0) -> tuple[str, ...]:
  """Tier order for impl=None: `hopper_impls` on Hopper, the reference elsewhere."""
  if not _tier("mosaic_gpu").is_hopper():
    return ("reference",)
  return hopper_impls(grouped, m, groups, weight_elements)


def _order(impl: str | None, grouped: bool, m: int, groups: int,
           weight_elements: int) -> tuple[str, ...]:
  if impl is None:
    return default_impls(grouped, m, groups, weight_elements)
  if impl not in IMPLS:
    raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
  return (impl,) if impl == "reference" else (impl, "reference")


def _tier(name: str) -> types.ModuleType:
  """The tier's module, imported on first use (mosaic_tpu only when asked for)."""
  return importlib.import_module(f"pallas_kernels.mxfp4_matmul.{name}")


def _validate(x_name: str, x, w_packed, w_scale, group_sizes, preferred_element_type) -> None:
  """ValueError naming the first argument that does not fit."""
  if len(x.shape) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{x_name} must be a floating [M, K] array, got shape {tuple(x.shape)} "
                     f"and dtype {x.dtype}")
  k = x.shape[1]
  if k % BLOCK:
    raise ValueError(f"{x_name}'s K={k} must be a multiple of {BLOCK} (the MX block)")
  lead = "" if group_sizes is None else "G, "
  rank = 2 if group_sizes is None else 3
  for name, arr, cols in (("w_packed", w_packed, k // 2), ("w_scale", w_scale, k // BLOCK)):
    if jnp.dtype(arr.dtype) != jnp.dtype(jnp.uint8):
      raise ValueError(f"{name} must be uint8, got {arr.dtype}")
    if len(arr.shape) != rank or arr.shape[-1] != cols:
      raise ValueError(f"{name} must be [{lead}N, {cols}] for K={k}, got shape "
                       f"{tuple(arr.shape)}")
  if tuple(w_scale.shape[:-1]) != tuple(w_packed.shape[:-1]):
    raise ValueError(f"w_scale must have the leading dims {tuple(w_packed.shape[:-1])} of "
                     f"w_packed, got shape {tuple(w_scale.shape)}")
  if group_sizes is not None:
    if tuple(group_sizes.shape) != (w_packed.shape[0],):
      raise ValueError(f"group_sizes must have shape [G] = ({w_packed.shape[0]},), got "
                       f"{tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
      raise ValueError(f"group_sizes must be an integer array (int32), got {group_sizes.dtype}")
  if (preferred_element_type is not None
      and not jnp.issubdtype(jnp.dtype(preferred_element_type), jnp.floating)):
    raise ValueError(f"preferred_element_type must be None or a floating dtype, got "
                     f"{preferred_element_type}")


def _plan(x, w_packed, w_scale, group_sizes, preferred_element_type, impl, interpret) -> Plan:
  def reason_of(name: str) -> str | None:
    tier = _tier(name)
    if group_sizes is None:
      return tier.supports_matmul(x, w_packed, w_scale,
                                  preferred_element_type=preferred_element_type,
                                  interpret=interpret)
    return tier.supports_ragged_dot(x, w_packed, w_scale, group_sizes,
                                    preferred_element_type=preferred_element_type,
                                    interpret=interpret)

  groups = 1 if group_sizes is None else w_packed.shape[0]
  order = _order(impl, group_sizes is not None, x.shape[0], groups, 2 * math.prod(w_packed.shape))
  return tiers.first_supported(order, reason_of, interpret)


def plan(x, w_packed, w_scale, *, preferred_element_type=None, impl: str | None = None,
         interpret: bool = False) -> Plan:
  """The tier `mxfp4_matmul` would use for these arguments (arrays or ShapeDtypeStructs)."""
  _validate("x", x, w_packed, w_scale, None, preferred_element_type)
  return _plan(x, w_packed, w_scale, None, preferred_element_type, impl, interpret)


def plan_ragged_dot(lhs, w_packed, w_scale, group_sizes, *, preferred_element_type=None,
                    impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `mxfp4_ragged_dot` would use for these arguments."""
  _validate("lhs", lhs, w_packed, w_scale, group_sizes, preferred_element_type)
  return _plan(lhs, w_packed, w_scale, group_sizes, preferred_element_type, impl, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _product(x, w_packed, w_scale, group_sizes, p: Plan, out_dtype: np.dtype):
  """The plan's tier: x @ W^T (group_sizes None) or the grouped product."""
  tier = _tier(p.impl)
  if group_sizes is None:
    return tier.matmul(x, w_packed, w_scale, preferred_element_type=out_dtype,
                       interpret=p.interpret)
  return tier.ragged_dot(x, w_packed, w_scale, group_sizes, preferred_element_type=out_dtype,
                         interpret=p.interpret)


def _product_fwd(x, w_packed, w_scale, group_sizes, p, out_dtype):
  # The VJP needs x's dtype, not x: a zero-size array of that dtype is the residual.
  return (_product(x, w_packed, w_scale, group_sizes, p, out_dtype),
          (jnp.zeros((0,), x.dtype), w_packed, w_scale, group_sizes))


def _product_bwd(p, out_dtype, residuals, d_out):
  del p, out_dtype
  x_like, w_packed, w_scale, group_sizes = residuals
  d_x = reference.x_cotangent(d_out, w_packed, w_scale, group_sizes, x_like.dtype)
  return d_x, None, None, None


_product.defvjp(_product_fwd, _product_bwd)


def _log_declines(p: Plan) -> None:
  for name, reason in p.declined:
    logging.info("mxfp4_matmul: tier %s declined (%s); trying the next", name, reason)


def mxfp4_matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
                 impl: str | None = None, preferred_element_type=None,
                 interpret: bool = False) -> jax.Array:
  """x [M, K] @ W^T -> [M, N] for W [N, K] as (w_packed [N, K/2], w_scale [N, K/32]) uint8.

  Output in preferred_element_type, else x's dtype. impl: None (platform default) or one of
  IMPLS; a kernel that declines the call runs the reference instead (see `plan`).
  """
  p = plan(x, w_packed, w_scale, preferred_element_type=preferred_element_type, impl=impl,
           interpret=interpret)
  _log_declines(p)
  return _product(x, w_packed, w_scale, None, p,
                  reference.out_dtype(x, preferred_element_type))


def mxfp4_ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array,
                     group_sizes: jax.Array, *, impl: str | None = None,
                     preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """Grouped product lhs [M, K], (w_packed [G, N, K/2], w_scale [G, N, K/32]), group_sizes [G]
  int -> [M, N]: row r of group g is lhs[r] @ W_g^T, rows past sum(group_sizes) are zero.

  Output dtype, impl and fallback as `mxfp4_matmul` (see `plan_ragged_dot`).
  """
  p = plan_ragged_dot(lhs, w_packed, w_scale, group_sizes,
                      preferred_element_type=preferred_element_type, impl=impl,
                      interpret=interpret)
  _log_declines(p)
  return _product(lhs, w_packed, w_scale, group_sizes.astype(jnp.int32), p,
                  reference.out_dtype(lhs, preferred_element_type))


GATE_UP_IMPLS = ("reference", "triton")


def gate_up_default_impls() -> tuple[str, ...]:
  """`mxfp4_gate_up`'s tier order for impl=None on the default device."""
  return ("triton", "reference") if _tier("mosaic_gpu").is_hopper() else ("reference",)


def plan_gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes, *,
                 impl: str | None = None, interpret: bool = False) -> Plan:
  """The tier `mxfp4_gate_up` would use for these arguments (arrays or ShapeDtypeStructs)."""
  if len(x.shape) != 2:
    raise ValueError(f"x must be a floating [N, K] array, got shape {tuple(x.shape)}")
  if len(rows.shape) != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f"rows must be an integer [M] array, got {rows.dtype}{list(rows.shape)}")
  gathered = jax.ShapeDtypeStruct((rows.shape[0], x.shape[-1]), x.dtype)
  for packed, scale in ((w1_packed, w1_scale), (w3_packed, w3_scale)):
    _validate("x", gathered, packed, scale, group_sizes, None)
  if tuple(w3_packed.shape) != tuple(w1_packed.shape):
    raise ValueError(f"w3_packed must have w1_packed's shape {tuple(w1_packed.shape)}, got "
                     f"{tuple(w3_packed.shape)}")
  if impl is not None and impl not in GATE_UP_IMPLS:
    raise ValueError(f"impl must be None or one of {GATE_UP_IMPLS}, got {impl!r}")
  if impl is None:
    order = gate_up_default_impls()
  else:
    order = ("reference",) if impl == "reference" else (impl, "reference")
  return tiers.first_supported(
      order, lambda name: None if name == "reference" else _tier(name).supports_gate_up(
          x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes, interpret=interpret),
      interpret)


def mxfp4_gate_up(x: jax.Array, rows: jax.Array, w1_packed: jax.Array, w1_scale: jax.Array,
                  w3_packed: jax.Array, w3_scale: jax.Array, group_sizes: jax.Array, *,
                  beta1: float, beta2: float, impl: str | None = None,
                  interpret: bool = False) -> jax.Array:
  """h [M, F] = SiTU(x[rows] W1_g^T, x[rows] W3_g^T) in x's dtype from fp32 products, for the
  rows of group g (rows: token indices into x, sorted by group; rows past sum(group_sizes) give
  zeros); W1 / W3 packed [G, F, K/2] with scales [G, F, K/32]. impl: None ("triton" on Hopper,
  else the reference) or one of GATE_UP_IMPLS; a kernel that declines the call runs the
  reference (see `plan_gate_up`)."""
  p = plan_gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes, impl=impl,
                   interpret=interpret)
  _log_declines(p)
  if p.impl == "triton":
    return _tier("triton").gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale,
                                   group_sizes, beta1=beta1, beta2=beta2, interpret=p.interpret)
  return reference.gate_up(x, rows, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes,
                           beta1=beta1, beta2=beta2)


EXPERT_FFN_IMPLS = ("reference", "triton")
# Off: its GPU tests pass on an H100 (2026-12-07) and it is 1.05-1.08x the unfused calls at
# k3_small's decode shapes, but k3_small's decode loop with it was no faster (2.94 against
# 2.82-2.89 ms a token; BENCHMARKS, decode section). `benchmarks.decode --expert_ffn=fused`.
EXPERT_FFN_IS_DEFAULT = False


def expert_ffn_default_impls() -> tuple[str, ...]:
  """`mxfp4_expert_ffn`'s tier order for impl=None on the default device."""
  hopper = EXPERT_FFN_IS_DEFAULT and _tier("mosaic_gpu").is_hopper()
  return ("triton", "reference") if hopper else ("reference",)


def plan_expert_ffn(x, weights, order, inverse, w1_packed, w1_scale, w3_packed, w3_scale,
                    w2_packed, w2_scale, group_sizes, *, impl: str | None = None,
                    interpret: bool = False) -> Plan:
  """The tier `mxfp4_expert_ffn` would use for these arguments (arrays or
  ShapeDtypeStructs); bad shapes raise ValueError naming the argument."""
  if len(weights.shape) != 2 or weights.shape[0] != x.shape[0]:
    raise ValueError(f"weights must be [N, k] with N = {x.shape[0]} (x's rows), got "
                     f"{tuple(weights.shape)}")
  copies = weights.shape[0] * weights.shape[1]
  for name, a in (("order", order), ("inverse", inverse)):
    if tuple(a.shape) != (copies,) or not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer [{copies}] array (N k), got "
                       f"{a.dtype}{list(a.shape)}")
  if impl is not None and impl not in EXPERT_FFN_IMPLS:
    raise ValueError(f"impl must be None or one of {EXPERT_FFN_IMPLS}, got {impl!r}")
  plan_gate_up(x, order, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes,
               impl="reference")
  g, f = w1_packed.shape[:2]
  if len(w2_packed.shape) != 3 or w2_packed.shape[0] != g:
    raise ValueError(f"w2_packed must hold G={g} experts (w1_packed's), got "
                     f"{tuple(w2_packed.shape)}")
  try:
    _validate("h", jax.ShapeDtypeStruct((copies, f), x.dtype), w2_packed, w2_scale,
              group_sizes, None)
  except ValueError as e:
    raise ValueError(f"W2 (the product of h [M, F={f}]): {e}") from None
  names = expert_ffn_default_impls() if impl is None else (
      ("reference",) if impl == "reference" else (impl, "reference"))
  return tiers.first_supported(
      names, lambda name: None if name == "reference" else _tier(name).supports_expert_ffn(
          x, order, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
          group_sizes, interpret=interpret), interpret)


def mxfp4_expert_ffn(x: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array,
                     w1_packed: jax.Array, w1_scale: jax.Array, w3_packed: jax.Array,
                     w3_scale: jax.Array, w2_packed: jax.Array, w2_scale: jax.Array,
                     group_sizes: jax.Array, *, beta1: float, beta2: float,
                     impl: str | None = None, interpret: bool = False) -> jax.Array:
  """u [N, D] fp32: the routed experts of N tokens past the sort (report Eq. 11), u[n] =
  sum_j weights[n, j] W2_g SiTU(W1_g x_n, W3_g x_n) for the copy n k + j of group g (order
  lists the copies by group, inverse undoes it; copies past sum(group_sizes) give zeros);
  W1 / W3 packed [G, F, K/2] with scales [G, F, K/32], W2 [G, D, F/2] and [G, D, F/32]. impl:
  None (the platform default, `expert_ffn_default_impls`) or one of EXPERT_FFN_IMPLS; a kernel
  that declines the call runs the reference (see `plan_expert_ffn`)."""
  args = (x, weights, order, inverse, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
          w2_scale, group_sizes)
  p = plan_expert_ffn(*args, impl=impl, interpret=interpret)
  _log_declines(p)
  if p.impl == "triton":
    return _tier("triton").expert_ffn(*args, beta1=beta1, beta2=beta2, interpret=p.interpret)
  return reference.expert_ffn(*args, beta1=beta1, beta2=beta2)
