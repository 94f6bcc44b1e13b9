"""Mosaic GPU VJP of KDA's chunk-parallel part vs `chunked.chunk_parts_vjp` (fp32, HIGHEST).

On CPU the kernel runs in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`) and is
lowered for CUDA without running. With K3JAX_KDA_TEST_ON_DEVICE=1 it is compiled for the
(Hopper) GPU instead and larger shapes are added.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunked
from pallas_kernels.kda import mosaic_gpu_bwd_intra
from pallas_kernels.kda import reference
from kda_testing import rel_err, segments

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
NAMES = ("q", "k", "v", "g", "beta")
GRADS = ("dq", "dk", "dv", "dg", "dbeta")
CHUNK = 64
# bf16 q, k, v, M, dW, dU and bf16 tensor-core operands with fp32 accumulation: measured
# relative L2 errors <= 5.6e-3 (dg; dk <= 4.9e-3, the rest <= 2.8e-3), about half of it from
# rounding the inputs to bf16.
TOL = 1e-2

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def ut_inverse(k, g, beta, segment_ids) -> np.ndarray:
  """M = (I + L)^{-1} [B, H, N, C, C] in fp64, L_rj = beta_r sum_c k_rc k_jc e^{G_rc - G_jc}
  for j < r in one segment (report Eq. 6)."""
  k, g, beta = (np.asarray(a, np.float64) for a in (k, g, beta))
  b, t = k.shape[:2]
  n = -(-t // CHUNK)
  pad = n * CHUNK - t
  chunks = lambda x: np.moveaxis(
      np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
          b, n, CHUNK, *x.shape[2:]), 3, 1)
  kc, bc = chunks(k), chunks(beta)
  G = np.cumsum(chunks(g), axis=-2)
  ids = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
  ids = np.pad(ids, ((0, 0), (0, pad)), mode="edge")
  starts = np.concatenate([np.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  count = np.cumsum(starts.reshape(b, 1, n, CHUNK), axis=-1)
  pos = np.arange(CHUNK)
  keep = (pos[:, None] > pos[None, :]) & (count[..., :, None] == count[..., None, :])
  expo = np.where(keep[..., None], G[..., :, None, :] - G[..., None, :, :], -np.inf)
  lower = bc[..., None] * np.sum(kc[..., :, None, :] * kc[..., None, :, :] * np.exp(expo), -1)
  return np.linalg.inv(np.eye(CHUNK) + lower)


def check(x: dict, segment_ids, seed: int, normalize_qk: bool = False) -> dict:
  """Kernel vs reference on random cotangents; returns the relative errors. With normalize_qk
  q, k are raw: the reference is the VJP of `chunk_parts_vjp`'s function after the L2 norm."""
  args = tuple(x[n] for n in NAMES)
  b, t, h, dk = x["q"].shape
  dv = x["v"].shape[-1]
  n = -(-t // CHUNK)
  rng = np.random.default_rng(seed)
  shapes = [(b, h, n, CHUNK, dk), (b, h, n, CHUNK, dk), (b, h, n, CHUNK, dv),
            (b, h, n, CHUNK, dk), (b, h, n, CHUNK, CHUNK), (b, h, n, dk)]
  cot = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  q, k = x["q"], x["k"]
  if normalize_qk:
    (q, k), norm_vjp = jax.vjp(lambda a, b: (reference.l2_normalize(a),
                                             reference.l2_normalize(b)), q, k)
  m = jnp.asarray(ut_inverse(k, x["g"], x["beta"], segment_ids), jnp.float32)
  kw = {"scale": dk ** -0.5, "segment_ids": segment_ids}
  got = mosaic_gpu_bwd_intra.parts_vjp(*args, m, cot, interpret=INTERPRET,
                                       normalize_qk=normalize_qk, **kw)
  want = chunked.chunk_parts_vjp(q, k, *args[2:], m, cot, gate_bound=-5.0, **kw)
  if normalize_qk:
    want = (*norm_vjp(tuple(want[:2])), *want[2:])
  errs = {}
  for name, arg, a, w in zip(GRADS, args, got, want):
    assert a.shape == arg.shape and a.dtype == arg.dtype, name
    assert np.isfinite(np.asarray(a)).all(), name
    errs[name] = rel_err(a, w)
  return errs


CASES = [
    (1, 130, 2, 128, 128, True),    # K = 128 (g scanned in-kernel), padded T, segments
    (1, 64, 1, 64, 128, False),     # one chunk, K = 64 (XLA cumsum), K < V
    (1, 100, 1, 128, 64, False),    # K > V, padded T
]
if ON_DEVICE:
  CASES += [(2, 1000, 4, 128, 128, True),
            (1, 4096, 2, 64, 64, False)]


@pytest.mark.parametrize("b, t, h, dk, dv, with_segments", CASES)
def test_parts_vjp_matches_chunked(b, t, h, dk, dv, with_segments):
  x = reference.example_inputs(jax.random.key(t + dk + dv), b, t, h, dk, dv, gate="bounded",
                               with_initial_state=False)
  errs = check(x, segments(t, b) if with_segments else None, t)
  assert max(errs.values()) < TOL, errs


def test_l2_norm_in_kernel():
  """normalize_qk: raw q, k (not unit rows) normalised in the kernel and dq, dk through the
  norm's VJP, against XLA's norm and its VJP around the fp32 reference."""
  b, t, h, d = 1, 130, 2, 128
  x = reference.example_inputs(jax.random.key(13), b, t, h, d, d, gate="bounded",
                               with_initial_state=False)
  x["q"], x["k"] = 3.0 * x["q"] + 0.5, 0.2 * x["k"] - 0.1
  errs = check(x, segments(t, b), 13, normalize_qk=True)
  assert max(errs.values()) < TOL, errs


def test_gate_at_the_bound():
  """g = -5 on most tokens: decays factorised up to 80 nats, all outputs finite and close."""
  b, t, h, d = 1, 64, 1, 64
  x = reference.example_inputs(jax.random.key(5), b, t, h, d, d, gate="bounded",
                               with_initial_state=False)
  x["g"] = jnp.full_like(x["g"], -5.0).at[:, ::7].set(-1e-6)
  errs = check(x, None, 5)
  assert max(errs.values()) < TOL, errs


def test_strong_decay_keeps_dg_accurate():
  """g = -5 sigmoid(N(0, 1)) (about -2.5 per token, benchmarks/kda.py's gate): dg is the sum of
  pair terms whose two directions cancel; rounded differently, they left dg 7% off (T = 1024)."""
  b, t, h, d = 1, 256, 2, 128
  x = reference.example_inputs(jax.random.key(7), b, t, h, d, d, gate="bounded",
                               with_initial_state=False)
  x["g"] = -5.0 * jax.nn.sigmoid(jax.random.normal(jax.random.key(8), x["g"].shape))
  errs = check(x, None, 7)
  assert max(errs.values()) < TOL, errs


def test_lowers_for_hopper():
  """Mosaic GPU lowering (layouts, TMA boxes, SMEM size) for CUDA, on any host."""
  for b, t, h, dk, dv, with_segments in [(1, 130, 2, 128, 128, True), (2, 64, 1, 64, 128, False)]:
    sds = lambda *shape, d=jnp.float32: jax.ShapeDtypeStruct(shape, d)
    n = -(-t // CHUNK)
    cot = (sds(b, h, n, CHUNK, dk), sds(b, h, n, CHUNK, dk), sds(b, h, n, CHUNK, dv),
           sds(b, h, n, CHUNK, dk), sds(b, h, n, CHUNK, CHUNK), sds(b, h, n, dk))
    args = (sds(b, t, h, dk, d=jnp.bfloat16), sds(b, t, h, dk, d=jnp.bfloat16),
            sds(b, t, h, dv, d=jnp.bfloat16), sds(b, t, h, dk), sds(b, t, h),
            sds(b, h, n, CHUNK, CHUNK), cot,
            sds(b, t, d=jnp.int32) if with_segments else None)

    def f(q, k, v, g, beta, m, cot, sid, scale=dk ** -0.5, normalize_qk=with_segments):
      return mosaic_gpu_bwd_intra.parts_vjp(q, k, v, g, beta, m, cot, scale=scale,
                                            segment_ids=sid, normalize_qk=normalize_qk)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
