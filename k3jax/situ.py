"""SiTU-GLU, the bounded gated FFN of Stable LatentMoE (report §2.3, k3_techniques.md §4)."""
import functools

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


def situ_partials(gate: jax.Array, up: jax.Array, beta1: float,
                  beta2: float) -> tuple[jax.Array, jax.Array]:
  """The partial derivatives (dh/d gate, dh/d up) of h = situ(gate, up), in fp32. With
  s = sigmoid(g), a = b1 tanh(g/b1) s and b = b2 tanh(u/b2) (h = a b):
  dh/dg = b ((1 - tanh^2(g/b1)) s + a (1 - s)),  dh/du = a (1 - tanh^2(u/b2))."""
  g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
  tg, tu, s = jnp.tanh(g / beta1), jnp.tanh(u / beta2), jax.nn.sigmoid(g)
  a = beta1 * tg * s
  return (beta2 * tu) * ((1 - tg * tg) * s + a * (1 - s)), a * (1 - tu * tu)


def _situ_grads(gate, up, d_out, beta1, beta2):
  """(d gate, d up) = d_out * `situ_partials`, in the inputs' dtypes."""
  p_gate, p_up = situ_partials(gate, up, beta1, beta2)
  d = d_out.astype(jnp.float32)
  return (d * p_gate).astype(gate.dtype), (d * p_up).astype(up.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def situ_gate_up(gate_up: jax.Array, beta1: float, beta2: float) -> jax.Array:
  """`situ` of a fused [gate | up] product [..., 2F] -> [..., F].

  The VJP writes [d gate | d up] as one concatenation; JAX's VJP of the two slices pads each
  gradient to [..., 2F] and adds them, a second full pass (H200, k3_small experts: 0.36 ms).
  """
  width = gate_up.shape[-1] // 2
  return situ(gate_up[..., :width], gate_up[..., width:], beta1, beta2)


def _situ_gate_up_fwd(gate_up, beta1, beta2):
  return situ_gate_up(gate_up, beta1, beta2), gate_up


def _situ_gate_up_bwd(beta1, beta2, gate_up, d_out):
  width = gate_up.shape[-1] // 2
  grads = _situ_grads(gate_up[..., :width], gate_up[..., width:], d_out, beta1, beta2)
  return (jnp.concatenate(grads, axis=-1),)


situ_gate_up.defvjp(_situ_gate_up_fwd, _situ_gate_up_bwd)


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
