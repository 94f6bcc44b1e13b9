"""unpacked tier: the MXFP4 weight unpacked to x's dtype in HBM once per call, then the fastest
bf16 product: `jnp.dot` (cuBLAS on GPU) dense; grouped, the bf16 grouped GEMM's Mosaic GPU kernel
reading the weight as stored ([G, N, K], `transpose_rhs`) where it takes the call, else
`pallas_kernels.ragged_dot` (its own default tier) of the transposed weight.

The unpacked weight is materialised (`jax.lax.optimization_barrier`), so XLA cannot fold the
dequantization into a GEMM fusion of its own choosing: at many rows the extra bytes (the bf16
weight written and read once, ~4.7x the packed bytes) cost less than dequantizing on chip in
every row tile (BENCHMARKS.md "MXFP4 matmul"). Same values as the reference (`unpack_k3`, exact
in bf16); the grouped product differs from the reference's `jax.lax.ragged_dot` only in the fp32
summation order. Takes every valid call, on any platform.
"""
import jax
import jax.numpy as jnp

from k3jax import mx
from pallas_kernels import ragged_dot as grouped_gemm
from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.ragged_dot import mosaic_gpu as gmm_kernel

# Like the reference, the tier takes every valid call.
supports_matmul = reference.supports_matmul
supports_ragged_dot = reference.supports_ragged_dot


def _unpacked(w_packed: jax.Array, w_scale: jax.Array, dtype, *, transpose: bool) -> jax.Array:
  """W [..., N, K] (W^T [..., K, N] if `transpose`) in `dtype`, written to HBM: no fusion of
  the dequantization into the consumer."""
  w = mx.unpack_k3(w_packed, w_scale, dtype)
  return jax.lax.optimization_barrier(jnp.swapaxes(w, -1, -2) if transpose else w)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """x [M, K] @ W^T -> [M, N], W from (w_packed [N, K/2], w_scale [N, K/32])."""
  del interpret
  # Straight to the output dtype: the GEMM sums in fp32 and rounds once, as an fp32 result
  # then cast would, without writing and reading [M, N] in fp32 (H200, M 4096: 128.2 -> 125.2
  # us at K3's w1 / w3 shape, 143.7 -> 125.0 at w2's).
  return jnp.dot(x, _unpacked(w_packed, w_scale, x.dtype, transpose=False).T,
                 preferred_element_type=reference.out_dtype(x, preferred_element_type))


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """`jax.lax.ragged_dot(lhs [M, K], W^T [G, K, N], group_sizes)`, W [G, N, K]: the Mosaic GPU
  gmm reading W as stored (`transpose_rhs`), else `pallas_kernels.ragged_dot` of W^T."""
  group_sizes = group_sizes.astype(jnp.int32)
  out_dtype = reference.out_dtype(lhs, preferred_element_type)
  w_like = jax.ShapeDtypeStruct((*w_packed.shape[:-1], lhs.shape[1]), lhs.dtype)
  if gmm_kernel.supports_gmm(lhs, w_like, group_sizes, transpose_rhs=True, out_dtype=out_dtype,
                             interpret=interpret) is None:
    w = _unpacked(w_packed, w_scale, lhs.dtype, transpose=False)
    return gmm_kernel.gmm(lhs, w, group_sizes, transpose_rhs=True, out_dtype=out_dtype,
                          interpret=interpret)
  w_t = _unpacked(w_packed, w_scale, lhs.dtype, transpose=True)
  out = grouped_gemm.ragged_dot(lhs, w_t, group_sizes, preferred_element_type=jnp.float32,
                                interpret=interpret)
  return out.astype(out_dtype)
