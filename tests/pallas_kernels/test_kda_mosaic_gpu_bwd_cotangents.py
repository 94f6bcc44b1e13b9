"""Mosaic GPU cotangents of KDA's chunk parts vs `chunked.chunk_parts_cotangents` (fp32, HIGHEST).

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
from pallas_kernels.kda import mosaic_gpu_bwd_cotangents
from kda_testing import rel_err

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
NAMES = ("dQ_d", "dW", "dU", "dK_g", "dA_qk", "d_dec")
CHUNK = 64
# bf16 W, dO and bf16 tensor-core operands (S_n, dS_n, V_new, dV_new) with fp32 accumulation:
# measured relative L2 errors <= 3.4e-3 (dK_g, dA_qk, through bf16 V_new), <= 2.4e-3 (dQ_d, dW);
# dU is dV_new itself and d_dec fp32 (~1e-7).
TOL = 1e-2

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def inputs(seed: int, b: int, h: int, n: int, dk: int, dv: int) -> tuple[jax.Array, ...]:
  """Random (w, u, s_in, ds, dvn, do) fp32 in `chunk_parts_cotangents`' layouts."""
  rng = np.random.default_rng(seed)
  shapes = [(b, h, n, CHUNK, dk), (b, h, n, CHUNK, dv), (b, h, n, dk, dv), (b, h, n, dk, dv),
            (b, h, n, CHUNK, dv), (b, h, n, CHUNK, dv)]
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


CASES = [
    (1, 2, 2, 128, 128),
    (1, 1, 3, 64, 128),             # K < V
    (1, 1, 2, 128, 64),             # K > V
]
if ON_DEVICE:
  CASES += [(2, 4, 16, 128, 128), (1, 8, 32, 64, 64)]


@pytest.mark.parametrize("b, h, n, dk, dv", CASES)
def test_cotangents_match_chunked(b, h, n, dk, dv):
  args = inputs(n + dk + dv, b, h, n, dk, dv)
  got = mosaic_gpu_bwd_cotangents.cotangents(*args, interpret=INTERPRET)
  want = chunked.chunk_parts_cotangents(*args, precision=jax.lax.Precision.HIGHEST)
  errs = {}
  for name, a, w in zip(NAMES, got, want):
    assert a.shape == w.shape and a.dtype == jnp.float32, name
    assert np.isfinite(np.asarray(a)).all(), name
    errs[name] = rel_err(a, w)
  print(f"relative L2 errors {(b, h, n, dk, dv)}:",
        {k: f"{e:.2e}" for k, e in errs.items()})
  assert max(errs.values()) < TOL, errs


def test_lowers_for_hopper():
  """Mosaic GPU lowering (layouts, TMA boxes, SMEM size) for CUDA, on any host."""
  for b, h, n, dk, dv in [(1, 2, 3, 128, 128), (2, 1, 2, 64, 128), (1, 1, 2, 128, 64)]:
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = (sds(b, h, n, CHUNK, dk), sds(b, h, n, CHUNK, dv), sds(b, h, n, dk, dv),
            sds(b, h, n, dk, dv), sds(b, h, n, CHUNK, dv), sds(b, h, n, CHUNK, dv))
    text = jax.jit(mosaic_gpu_bwd_cotangents.cotangents).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
