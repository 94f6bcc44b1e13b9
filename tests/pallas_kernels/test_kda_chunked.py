"""Chunked KDA tier vs the token-by-token recurrence run in fp64 (report Eqs. 1-9)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference

# Relative RMS error bound ||x - ref|| / ||ref|| for fp32 inputs, for o, the
# final state and the gradients w.r.t. q, k, v, g, beta, h0. fla's are 5e-3
# (o, state), 8e-3 (dq, dk, dv, dh0), 2e-2 (dg, dbeta); we measure <= 1e-6.
TOL = 1e-5


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@functools.partial(jax.jit, static_argnames=("tier", "scale", "gate_bound"))
def fwd_bwd(args: dict, cotangents, *, tier: str, scale: float, gate_bound: float | None):
  """(o, state) of a tier at args = {q, k, v, g, beta[, h0]} and the VJP of cotangents."""
  def f(a):
    x = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    kw = dict(scale=scale, initial_state=a.get("h0"), segment_ids=None)
    if tier == "chunked":
      return chunked.chunk_kda(*x, gate_bound=gate_bound, **kw)
    return reference.recurrent_kda(*x, **kw)

  out, vjp = jax.vjp(f, args)
  return out, vjp(cotangents)[0]


def _compare(inputs: dict, scale: float, gate_bound: float | None) -> None:
  """Chunked tier in fp32 vs the recurrence in fp64: o, state and all input gradients."""
  b, t, h, dk = inputs["q"].shape
  dv = inputs["v"].shape[-1]
  rng = np.random.default_rng(123)
  cot = (rng.standard_normal((b, t, h, dv), np.float32),
         rng.standard_normal((b, h, dk, dv), np.float32))

  def run(tier, dtype):
    args = {n: jnp.asarray(x, dtype) for n, x in inputs.items() if x is not None}
    return fwd_bwd(args, tuple(jnp.asarray(c, dtype) for c in cot),
                   tier=tier, scale=scale, gate_bound=gate_bound)

  (o_ref, s_ref), g_ref = run("reference", jnp.float64)
  (o, s), grads = run("chunked", jnp.float32)
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32
  errs = dict(o=rel_err(o, o_ref), state=rel_err(s, s_ref))
  errs.update({n: rel_err(grads[n], g_ref[n]) for n in grads})
  for name, err in errs.items():
    assert err < TOL, f"{name}: rel err {err:.2e} >= {TOL:.0e} (all: {errs})"


@pytest.mark.parametrize(
    "b, t, h, dk, dv, gate, gate_bound, with_h0",
    [
        (1, 1, 3, 64, 64, "bounded", -5.0, True),
        (2, 17, 8, 64, 64, "unbounded", None, False),
        (2, 100, 1, 128, 128, "unbounded", None, True),
        (1, 200, 3, 128, 128, "bounded", -5.0, True),
        (1, 200, 3, 128, 128, "bounded", None, True),
    ])
def test_matches_fp64_recurrence(x64, b, t, h, dk, dv, gate, gate_bound, with_h0):
  """T = 1 (all padding), one partial chunk, several chunks; both diagonal-tile paths."""
  inputs = reference.example_inputs(jax.random.key(t * 10 + h), b, t, h, dk, dv, gate=gate,
                                    with_initial_state=with_h0)
  _compare(inputs, dk ** -0.5, gate_bound)


def test_gate_at_the_bound(x64):
  """g = -5 on most tokens: the largest exponents of the factorised tiles."""
  inputs = reference.example_inputs(jax.random.key(0), 1, 200, 3, 128, 128, gate="bounded",
                                    with_initial_state=True)
  inputs["g"] = jnp.full_like(inputs["g"], -5.0).at[:, ::7].set(-1e-6)
  _compare(inputs, 128 ** -0.5, -5.0)
