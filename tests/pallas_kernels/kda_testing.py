"""Helpers shared by the KDA kernel tests."""
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(x, ref) -> float:
  """Relative L2 error ||x - ref|| / ||ref|| in fp64."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def segments(t: int, b: int = 1) -> jax.Array:
  """[B, T] ids with boundaries inside chunk 0 (token 40) and on the chunk start 64; the rest
  one document (T > 64)."""
  row = np.concatenate([np.full(40, 1), np.full(24, 2), np.full(t - 64, 3)])
  return jnp.asarray(np.tile(row, (b, 1)).astype(np.int32))


NAMES = ("q", "k", "v", "g", "beta")


def outputs_and_grads(op, x: dict, cot, **kwargs):
  """((o, S_T), gradients of q, k, v, g, beta, h0) of op(q, k, v, g, beta, initial_state=h0,
  output_final_state=True, **kwargs) for the cotangents cot = (d_o, d_S_T)."""
  def f(a):
    return op(*(a[n] for n in NAMES), initial_state=a["h0"], output_final_state=True, **kwargs)

  out, vjp = jax.vjp(f, {n: x[n] for n in (*NAMES, "h0")})
  return out, vjp(tuple(jnp.asarray(c) for c in cot))[0]
