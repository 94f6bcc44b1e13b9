"""SiTU-GLU, the bounded gated FFN of Stable LatentMoE (report §2.3, k3_techniques.md §4)."""
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import params


def situ(gate: jax.Array, up: jax.Array, beta1: float, beta2: float) -> jax.Array:
  """[b1 tanh(g/b1) * sigmoid(g)] * [b2 tanh(u/b2)], in fp32; |out| <= b1*b2."""
  g = gate.astype(jnp.float32)
  u = up.astype(jnp.float32)
  out = beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g) * (beta2 * jnp.tanh(u / beta2))
  return out.astype(gate.dtype)


class SiTUGLU(nnx.Module):
  """Dense SiTU-GLU FFN: down(situ(gate(x), up(x))). Layer 0's FFN and the shared experts."""

  def __init__(self, dim: int, hidden: int, *, beta1: float, beta2: float,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
               embed_axis: str = "embed", mlp_axis: str = "mlp"):
    self.beta1, self.beta2, self.dtype = beta1, beta2, dtype
    init_in = params.fan_in_init((0,))
    self.gate_proj = nnx.Dict(kernel=params.param(
        rngs, init_in, (dim, hidden), (embed_axis, mlp_axis), param_dtype))
    self.up_proj = nnx.Dict(kernel=params.param(
        rngs, init_in, (dim, hidden), (embed_axis, mlp_axis), param_dtype))
    self.down_proj = nnx.Dict(kernel=params.param(
        rngs, init_in, (hidden, dim), (mlp_axis, embed_axis), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    g = x @ self.gate_proj["kernel"][...].astype(self.dtype)
    u = x @ self.up_proj["kernel"][...].astype(self.dtype)
    h = situ(g, u, self.beta1, self.beta2)
    return h @ self.down_proj["kernel"][...].astype(self.dtype)
