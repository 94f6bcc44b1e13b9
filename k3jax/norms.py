"""RMSNorm (every norm in K3 is an RMSNorm; report §2)."""
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import params


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """y = x / sqrt(mean(x^2) + eps) * scale over the last axis, computed in fp32."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned per-channel `scale` (HF: `.weight`)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis_name: str = "norm"):
    self.eps = eps
    self.scale = params.param(rngs, params.ones_init, (dim,), (axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)
