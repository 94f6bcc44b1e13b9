"""Chunked KDA tier vs the token-by-token recurrence run in fp64 (report Eqs. 1-9)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference
from kda_testing import rel_err

# Relative RMS error bound ||x - ref|| / ||ref|| for fp32 inputs, for o, the
# final state and the gradients w.r.t. q, k, v, g, beta, h0. fla's are 5e-3
# (o, state), 8e-3 (dq, dk, dv, dh0), 2e-2 (dg, dbeta); we measure <= 1e-6.
TOL = 1e-5


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


def ut_inverse_fp64(k, g, beta, segment_ids, chunk=chunked.CHUNK) -> np.ndarray:
  """M = (I + L)^{-1} per chunk in numpy fp64, L_rj = beta_r sum_c k_rc k_jc e^{G_rc - G_jc}
  for j < r in one segment (report Eq. 6), from the pairwise decays: [B, H, N, C, C]."""
  k, g, beta = (np.asarray(a, np.float64) for a in (k, g, beta))
  b, t, h, _ = k.shape
  n = -(-t // chunk)
  pad = n * chunk - t
  k = np.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
  g = np.pad(g, ((0, 0), (0, pad), (0, 0), (0, 0)))
  beta = np.pad(beta, ((0, 0), (0, pad), (0, 0)))
  ids = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
  ids = np.pad(ids, ((0, 0), (0, pad)), mode="edge")
  m = np.zeros((b, h, n, chunk, chunk))
  for bi in range(b):
    for hi in range(h):
      for ni in range(n):
        sl = slice(ni * chunk, (ni + 1) * chunk)
        kk, bb, cur = k[bi, sl, hi], beta[bi, sl, hi], ids[bi, sl]
        G = np.cumsum(g[bi, sl, hi], axis=0)
        starts = np.concatenate([[0], (cur[1:] != cur[:-1]).astype(int)]).cumsum()
        lower = np.zeros((chunk, chunk))
        for r in range(chunk):
          for j in range(r):
            if starts[r] == starts[j]:
              lower[r, j] = bb[r] * np.sum(kk[r] * kk[j] * np.exp(G[r] - G[j]))
        m[bi, hi, ni] = np.linalg.inv(np.eye(chunk) + lower)
  return m


@pytest.mark.parametrize("t, h, dk, dv, gate_bound, with_segments", [
    (100, 2, 64, 128, -5.0, True),
    (64, 1, 128, 64, -5.0, False),
    (130, 1, 64, 64, None, True),
])
def test_chunk_parts_vjp_matches_autodiff(x64, t, h, dk, dv, gate_bound, with_segments):
  """The hand-written VJP of `chunk_parts` (given M) equals JAX's autodiff of it, in fp64."""
  gate = "bounded" if gate_bound is not None else "unbounded"
  x = reference.example_inputs(jax.random.key(t + dk), 1, t, h, dk, dv, gate=gate,
                               with_initial_state=False)
  x = {n: jnp.asarray(np.asarray(a, np.float64)) for n, a in x.items() if a is not None}
  if gate_bound is None:
    x["g"] = x["g"].at[:, 5, :, :3].set(-1000.0)     # through the LOG_DECAY_FLOOR clamp
  sid = None
  if with_segments:
    sid = jnp.asarray(np.repeat([[1, 2, 3]], [40, 30, t - 70], axis=1).astype(np.int32))
  args = tuple(x[n] for n in ("q", "k", "v", "g", "beta"))
  kw = dict(scale=dk ** -0.5, segment_ids=sid, gate_bound=gate_bound)
  parts, vjp = jax.vjp(functools.partial(chunked.chunk_parts, dt=jnp.float64, **kw), *args)
  rng = np.random.default_rng(t)
  cot = tuple(jnp.asarray(rng.standard_normal(p.shape)) for p in parts)
  want = vjp(cot)
  m = jnp.asarray(ut_inverse_fp64(x["k"], x["g"], x["beta"], sid))
  got = chunked.chunk_parts_vjp(*args, m, cot, **kw)
  for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert rel_err(a, b) < 1e-9, (name, rel_err(a, b))
