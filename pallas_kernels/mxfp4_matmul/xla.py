"""xla tier: the MXFP4 weight handed to XLA in its own types, so that the compiler may fuse the
dequantization into the matmul instead of writing a bf16 weight first.

`w_packed` is bitcast to float4_e2m1fn pairs (the checkpoint's nibble order is XLA's: element
2j in the low nibble) and `w_scale` to float8_e8m0fnu; both are converted, multiplied per block
of 32 along K in fp32 and cast to x's dtype (exact: an E2M1 value times a power of two), then
`jnp.dot` / `jax.lax.ragged_dot` as in the reference. The same values as the reference tier,
which unpacks with integer ops (`k3jax.mx.unpack_k3`) that no GEMM fusion takes. Whether XLA
reads the packed weight inside its GEMM (a Triton GEMM fusion: `kernels.xla_triton_gemm`, and
on GPU `--xla_gpu_experimental_enable_subchannel_dequantisation_fusion`) is its choice;
`benchmarks/mxfp4_matmul.py` measures it. Takes every valid call, on any platform. Weights
under 2^-126 in magnitude (scale bytes 0 and 1, fp32 subnormals) may be flushed to zero, as
XLA flushes subnormals on some backends; the reference keeps them.
"""
import jax
import jax.numpy as jnp

from k3jax import mx
from pallas_kernels.mxfp4_matmul import reference

# Like the reference, the tier takes every valid call.
supports_matmul = reference.supports_matmul
supports_ragged_dot = reference.supports_ragged_dot


def dequantize(w_packed: jax.Array, w_scale: jax.Array, dtype) -> jax.Array:
  """W [..., N, K] in `dtype` from w_packed [..., N, K/2] and w_scale [..., N, K/32] uint8,
  through XLA's float4_e2m1fn and float8_e8m0fnu."""
  codes = jax.lax.bitcast_convert_type(w_packed, jnp.float4_e2m1fn)     # [..., N, K/2, 2]
  values = codes.reshape(*w_packed.shape[:-1], -1).astype(jnp.float32)
  scales = jax.lax.bitcast_convert_type(w_scale, jnp.float8_e8m0fnu).astype(jnp.float32)
  return (values * jnp.repeat(scales, mx.BLOCK, axis=-1)).astype(dtype)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """x [M, K] @ W^T -> [M, N], W from (w_packed [N, K/2], w_scale [N, K/32])."""
  del interpret
  out = jnp.dot(x, dequantize(w_packed, w_scale, x.dtype).T,
                precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return out.astype(reference.out_dtype(x, preferred_element_type))


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """`jax.lax.ragged_dot(lhs [M, K], W^T [G, K, N], group_sizes)`, W [G, N, K]."""
  del interpret
  w = dequantize(w_packed, w_scale, lhs.dtype)
  out = jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(reference.out_dtype(lhs, preferred_element_type))
