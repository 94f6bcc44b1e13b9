"""Block Attention Residuals (report Eq. 8-10; k3_techniques.md §3, exact K3 wiring).

There is no ordinary residual stream. Layer outputs are summed into the current block's partial
sum; each sublayer's input is a softmax mix over the completed block sums [b_0 (the embedding),
b_1, ...] and the partial sum, scored by a learned pseudo-query against RMS-normalised keys
(values are not normalised).
"""
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import params


def attn_res_mix(sources: list[jax.Array], query: jax.Array, norm_scale: jax.Array,
                 eps: float) -> jax.Array:
  """h = sum_i softmax_i(<v_i / rms(v_i), norm_scale * query>) v_i, in fp32 (Eq. 9).

  sources: S arrays [B, T, d]; query, norm_scale: [d]. Returns [B, T, d] in the sources' dtype.
  """
  v = jnp.stack(sources).astype(jnp.float32)  # [S, B, T, d]
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  w = norm_scale.astype(jnp.float32) * query.astype(jnp.float32)
  alpha = jax.nn.softmax(jnp.einsum("sbtd,d->sbt", keys, w), axis=0)
  return jnp.einsum("sbt,sbtd->btd", alpha, v).astype(sources[-1].dtype)


def pseudo_query(dim: int, *, rngs: nnx.Rngs) -> tuple[nnx.Dict, nnx.Dict]:
  """(key-norm weight `*_res_norm.scale`, pseudo-query `*_res_proj.kernel`), both [d].

  The pseudo-query starts at zero, so every mix starts as a uniform average (report §2.2).
  """
  norm = nnx.Dict(scale=params.param(rngs, params.ones_init, (dim,), ("norm",)))
  proj = nnx.Dict(kernel=params.param(rngs, params.zeros_init, (dim,), ("norm",)))
  return norm, proj


def mix(sources: list[jax.Array], norm: nnx.Dict, proj: nnx.Dict, eps: float) -> jax.Array:
  return attn_res_mix(sources, proj["kernel"][...], norm["scale"][...], eps)
