"""Chunked KDA tier vs the token-by-token recurrence run in fp64 (report Eqs. 1-9)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference

# Relative RMS error bounds ||x - ref|| / ||ref|| for fp32 inputs. fla's are
# 5e-3 (o, state), 8e-3 (dq, dk, dv, dh0), 2e-2 (dg, dbeta); we measure <= 2e-5.
TOL = dict(o=1e-4, state=1e-4, q=1e-4, k=1e-4, v=1e-4, g=2e-4, beta=1e-4, h0=1e-4)


def make_inputs(rng: np.random.Generator, b: int, t: int, h: int, dk: int, dv: int,
                gate: str, with_h0: bool) -> dict[str, np.ndarray]:
  """fp64 inputs: unit-norm q, k; bounded (-5 sigmoid) or unbounded (softplus, -1000 spikes) g."""
  def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)

  x = dict(q=unit(rng.standard_normal((b, t, h, dk))),
           k=unit(rng.standard_normal((b, t, h, dk))),
           v=rng.standard_normal((b, t, h, dv)),
           beta=1 / (1 + np.exp(-rng.standard_normal((b, t, h)))))
  logits = rng.standard_normal((b, t, h, dk))
  if gate == "bounded":
    x["g"] = -5.0 / (1 + np.exp(-logits))
  else:
    g = -np.exp(rng.uniform(0, 1.5, (h, dk))) * np.logaddexp(0, logits + 1)
    g[rng.random(g.shape) < 0.01] = -1000.0
    x["g"] = g
  x["h0"] = rng.standard_normal((b, h, dk, dv)) if with_h0 else None
  return x


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@functools.partial(jax.jit, static_argnames=("tier", "scale", "gate_bound"))
def fwd_bwd(args: dict, segment_ids, cotangents, *, tier: str, scale: float,
            gate_bound: float | None):
  """(o, state) of a tier at args = {q, k, v, g, beta[, h0]} and the VJP of cotangents."""
  def f(a):
    kw = dict(scale=scale, initial_state=a.get("h0"), segment_ids=segment_ids)
    if tier == "chunked":
      return chunked.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], gate_bound=gate_bound, **kw)
    return reference.recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)

  out, vjp = jax.vjp(f, args)
  return out, vjp(cotangents)[0]


def _compare(inputs, scale, gate_bound, segment_ids=None):
  """Chunked tier in fp32 vs the recurrence in fp64: o, state and all input gradients."""
  b, t, h, dk = inputs["q"].shape
  dv = inputs["v"].shape[-1]
  rng = np.random.default_rng(123)
  cot = (rng.standard_normal((b, t, h, dv)), rng.standard_normal((b, h, dk, dv)))

  def run(tier, dtype):
    args = {n: jnp.asarray(x, dtype) for n, x in inputs.items() if x is not None}
    return fwd_bwd(args, segment_ids, tuple(jnp.asarray(c, dtype) for c in cot),
                   tier=tier, scale=scale, gate_bound=gate_bound)

  (o_ref, s_ref), g_ref = run("reference", jnp.float64)
  (o, s), grads = run("chunked", jnp.float32)
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32
  errs = dict(o=rel_err(o, o_ref), state=rel_err(s, s_ref))
  errs.update({n: rel_err(grads[n], g_ref[n]) for n in grads})
  for name, err in errs.items():
    assert err < TOL[name], f"{name}: rel err {err:.2e} >= {TOL[name]:.0e} (all: {errs})"
  return errs


@pytest.mark.parametrize(
    "b, t, h, dk, dv, gate, gate_bound, with_h0",
    [
        (1, 1, 3, 64, 64, "bounded", -5.0, True),
        (2, 17, 3, 64, 64, "unbounded", None, False),
        (1, 64, 8, 64, 64, "bounded", -5.0, False),
        (2, 100, 1, 128, 128, "unbounded", None, True),
        (1, 200, 3, 128, 128, "bounded", -5.0, True),
        (1, 200, 3, 128, 128, "unbounded", None, True),
    ])
def test_matches_fp64_recurrence(x64, b, t, h, dk, dv, gate, gate_bound, with_h0):
  inputs = make_inputs(np.random.default_rng(t * 10 + h), b, t, h, dk, dv, gate, with_h0)
  _compare(inputs, dk ** -0.5, gate_bound)


@pytest.mark.parametrize("gate_bound", [-5.0, None])
def test_gate_at_the_bound(x64, gate_bound):
  """g = -5 on most tokens: the largest exponents of the factorised tiles."""
  inputs = make_inputs(np.random.default_rng(0), 1, 130, 2, 32, 32, "bounded", True)
  inputs["g"] = np.full_like(inputs["g"], -5.0)
  inputs["g"][:, ::7] = -1e-6
  _compare(inputs, 32 ** -0.5, gate_bound)


@functools.partial(jax.jit, static_argnames=("gate_bound",))
def _both_tiers(q, k, v, g, beta, h0, *, gate_bound):
  kw = dict(scale=q.shape[-1] ** -0.5, initial_state=h0, segment_ids=None)
  return (reference.recurrent_kda(q, k, v, g, beta, **kw),
          chunked.chunk_kda(q, k, v, g, beta, gate_bound=gate_bound, **kw))


@pytest.mark.parametrize("gate, gate_bound", [("bounded", -5.0), ("unbounded", None)])
def test_long_bf16_stays_finite_and_accurate(gate, gate_bound):
  """T = 65536, bf16 inputs: chunked vs the fp32 recurrence on the same inputs.

  Both tiers compute in fp32, so the states agree to ~1e-6 (bound 1e-4) and o,
  stored in bf16, to bf16 rounding (bound 1e-2).
  """
  inputs = make_inputs(np.random.default_rng(7), 1, 65536, 1, 32, 32, gate, True)
  args = [jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v", "g", "beta")]
  (o_ref, s_ref), (o, s) = _both_tiers(*args, jnp.asarray(inputs["h0"], jnp.float32),
                                       gate_bound=gate_bound)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
  assert rel_err(s, s_ref) < 1e-4
  assert rel_err(o, o_ref) < 1e-2
