"""Reference tier of the MXFP4-weight matmul (k3_techniques.md §7): dequantize with
`k3jax.mx.unpack_k3` (the one place that reads the K3 checkpoint's packed format), then XLA's
`jnp.dot` / `jax.lax.ragged_dot` with fp32 accumulation.

The dequantized weight is cast to x's dtype first (exact in bf16: an E2M1 value times a power
of two), so a bf16 x gives the product the kernels compute, bf16 operands with fp32
accumulation; fp32 x multiplies at HIGHEST precision. Takes every valid call, on any platform.
"""
import jax
import jax.numpy as jnp

from k3jax import mx
from k3jax import situ as situ_lib


def supports_matmul(x, w_packed, w_scale, *, preferred_element_type=None,
                    interpret: bool = False) -> None:
  """The reference takes every valid call."""
  del x, w_packed, w_scale, preferred_element_type, interpret


def supports_ragged_dot(lhs, w_packed, w_scale, group_sizes, *, preferred_element_type=None,
                        interpret: bool = False) -> None:
  """The reference takes every valid call."""
  del lhs, w_packed, w_scale, group_sizes, preferred_element_type, interpret


def out_dtype(x, preferred_element_type) -> jnp.dtype:
  """preferred_element_type, else x's dtype: the output dtype of every tier."""
  return jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)


def matmul(x: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
           preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """x [M, K] @ W^T -> [M, N], W = unpack_k3(w_packed [N, K/2], w_scale [N, K/32])."""
  del interpret
  w = mx.unpack_k3(w_packed, w_scale).astype(x.dtype)
  out = jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  return out.astype(out_dtype(x, preferred_element_type))


def ragged_dot(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array,
               *, preferred_element_type=None, interpret: bool = False) -> jax.Array:
  """`jax.lax.ragged_dot(lhs [M, K], W^T [G, K, N], group_sizes)`, W [G, N, K] unpacked."""
  del interpret
  w = mx.unpack_k3(w_packed, w_scale).astype(lhs.dtype)
  out = jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(out_dtype(lhs, preferred_element_type))


def x_cotangent(d_out: jax.Array, w_packed: jax.Array, w_scale: jax.Array,
                group_sizes: jax.Array | None, x_dtype) -> jax.Array:
  """d_x = d_out @ W (or rows of group g times W_g, zeros past sum(group_sizes)): the VJP of
  either product with respect to x, d_out [M, N] -> [M, K] in x's dtype."""
  w = mx.unpack_k3(w_packed, w_scale).astype(x_dtype)
  d_out = d_out.astype(x_dtype)
  hi = jax.lax.Precision.HIGHEST
  if group_sizes is None:
    d_x = jnp.dot(d_out, w, precision=hi, preferred_element_type=jnp.float32)
  else:
    d_x = jax.lax.ragged_dot(d_out, w, group_sizes.astype(jnp.int32), precision=hi,
                             preferred_element_type=jnp.float32)
  return d_x.astype(x_dtype)


def gate_up(x: jax.Array, rows: jax.Array, w1_packed: jax.Array, w1_scale: jax.Array,
            w3_packed: jax.Array, w3_scale: jax.Array, group_sizes: jax.Array, *, beta1: float,
            beta2: float) -> jax.Array:
  """SiTU(x[rows] W1_g^T, x[rows] W3_g^T) [M, F] in x's dtype: the two products in fp32
  (`ragged_dot`), then `k3jax.situ.situ` (report Eq. 11)."""
  xs = x[rows]
  gate, up = (ragged_dot(xs, p, s, group_sizes, preferred_element_type=jnp.float32)
              for p, s in ((w1_packed, w1_scale), (w3_packed, w3_scale)))
  return situ_lib.situ(gate, up, beta1, beta2).astype(x.dtype)


def expert_ffn(x: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array,
               w1_packed: jax.Array, w1_scale: jax.Array, w3_packed: jax.Array,
               w3_scale: jax.Array, w2_packed: jax.Array, w2_scale: jax.Array,
               group_sizes: jax.Array, *, beta1: float, beta2: float) -> jax.Array:
  """The routed experts of a MoE layer past the sort (report Eq. 11), fp32 u [N, D]:
  u[n] = sum_j weights[n, j] W2_g SiTU(W1_g x_n, W3_g x_n) for copy p = inverse[n k + j] of
  group g; h in x's dtype (`gate_up`), the W2 product and the sum in fp32."""
  n, top_k = weights.shape
  h = gate_up(x, order // top_k, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes,
              beta1=beta1, beta2=beta2)
  out = ragged_dot(h, w2_packed, w2_scale, group_sizes, preferred_element_type=jnp.float32)
  return jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32),
                    out[inverse].reshape(n, top_k, -1), preferred_element_type=jnp.float32)
