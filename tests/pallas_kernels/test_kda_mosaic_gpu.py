"""Mosaic GPU KDA kernels vs the token-by-token recurrence in fp64.

On CPU the kernel runs in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`).
With K3JAX_KDA_TEST_ON_DEVICE=1 it is compiled for the (Hopper) GPU instead and
larger shapes are added (benchmarks/kda_kernels_gpu_test.sh).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import reference
from kda_testing import outputs_and_grads, rel_err, segments

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
NAMES = ("q", "k", "v", "g", "beta")
# bf16 operands on the tensor cores: fla's bf16 bounds (5e-3 for o and the state).
TOL = 5e-3

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def inputs(key: int, b, t, h, dk, dv, dtype=jnp.bfloat16) -> dict:
  x = reference.example_inputs(jax.random.key(key), b, t, h, dk, dv, gate="bounded",
                               with_initial_state=True)
  return {n: (a.astype(dtype) if n in ("q", "k", "v") else a) for n, a in x.items()}


def fp64_reference(x: dict, segment_ids, cot=None):
  """fp64 (o, state) of the rounded inputs and, given cotangents, every input's gradient."""
  with jax.enable_x64(True):
    args = {n: jnp.asarray(np.asarray(x[n], np.float32), jnp.float64) for n in (*NAMES, "h0")}

    def f(a):
      return reference.recurrent_kda(*(a[n] for n in NAMES), scale=x["q"].shape[-1] ** -0.5,
                                     initial_state=a["h0"], segment_ids=segment_ids)

    if cot is None:
      return jax.device_get(f(args)), None
    out, vjp = jax.vjp(f, args)
    return jax.device_get(out), jax.device_get(vjp(tuple(jnp.asarray(c, jnp.float64)
                                                         for c in cot))[0])


def kernel(x: dict, segment_ids=None, block_v=64):
  return mosaic_gpu.chunk_kda_mosaic_gpu(*(x[n] for n in NAMES), initial_state=x["h0"],
                                         output_final_state=True, segment_ids=segment_ids,
                                         interpret=INTERPRET, block_v=block_v)


CASES = [
    (1, 130, 1, 128, 128, True, 64),   # K = 128 (g scanned in-kernel), segments, 2 value blocks
    (1, 100, 1, 64, 128, False, 32),   # K != V (XLA cumsum), 4 value blocks of 32
]
if ON_DEVICE:
  CASES += [(1, 64, 1, 64, 64, False, 64), (2, 1000, 4, 128, 128, True, 64),
            (1, 4096, 2, 128, 64, False, 32)]


@pytest.mark.parametrize("b, t, h, dk, dv, with_segments, block_v", CASES)
def test_forward_matches_fp64(b, t, h, dk, dv, with_segments, block_v):
  x = inputs(t + dk + dv, b, t, h, dk, dv)
  sid = segments(t, b) if with_segments else None
  o, s = kernel(x, sid, block_v)
  (o_ref, s_ref), _ = fp64_reference(x, sid)
  assert o.shape == (b, t, h, dv) and o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert np.isfinite(np.asarray(o, np.float32)).all()
  assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_gate_at_the_bound_with_correlated_keys():
  """g = -5 on most tokens (largest factorised exponents, 80 nats) and keys of nearby tokens
  alike (entries of L near beta, the hard case for the UT solve); bf16 floor ~7e-3."""
  b, t, h, d = 1, 100, 1, 64
  x = inputs(3, b, t, h, d, d)
  rng = np.random.default_rng(0)
  base = np.cumsum(rng.standard_normal((b, t, h, d)) * 0.3, axis=1) + 3 * rng.standard_normal(d)

  def unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)

  x["k"] = jnp.asarray(unit(base + 0.5 * rng.standard_normal(base.shape)), jnp.bfloat16)
  x["q"] = jnp.asarray(unit(base + 0.5 * rng.standard_normal(base.shape)), jnp.bfloat16)
  x["beta"] = 0.5 + 0.5 * x["beta"]
  x["g"] = jnp.full_like(x["g"], -5.0).at[:, ::7].set(-1e-6)
  o, s = kernel(x)
  (o_ref, s_ref), _ = fp64_reference(x, None)
  assert rel_err(o, o_ref) < 1.5e-2 and rel_err(s, s_ref) < 1.5e-2


def test_fp32_inputs_gradients_segments_initial_state():
  """fp32 inputs: o in fp32 (bf16 tensor-core accuracy); with backward="chunked" the
  custom_vjp gradients of all six inputs come from the chunked tier in fp32, so they match
  fp64 closely (the default kernel backward: test_kda_mosaic_gpu_bwd.py)."""
  b, t, h, d = 1, 100, 1, 64
  x = inputs(9, b, t, h, d, d, jnp.float32)
  sid = segments(t, b)
  rng = np.random.default_rng(1)
  cot = (rng.standard_normal((b, t, h, d), np.float32),
         rng.standard_normal((b, h, d, d), np.float32))

  (o, s), grads = outputs_and_grads(mosaic_gpu.chunk_kda_mosaic_gpu, x, cot,
                                    segment_ids=sid, interpret=INTERPRET, backward="chunked")
  (o_ref, s_ref), g_ref = fp64_reference(x, sid, cot)
  assert o.dtype == jnp.float32
  assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
  for name in (*NAMES, "h0"):
    assert rel_err(grads[name], g_ref[name]) < 1e-3, name


def test_supports_and_errors():
  x = inputs(0, 1, 8, 1, 64, 64)
  args = [x[n] for n in NAMES]
  assert mosaic_gpu.supports(*args, gate_bound=-5.0) is None
  assert mosaic_gpu.supports(*args, gate_bound=-1.0) is None
  assert "gate_bound" in mosaic_gpu.supports(*args, gate_bound=None)
  assert "gate_bound" in mosaic_gpu.supports(*args, gate_bound=-6.0)
  wide = inputs(0, 1, 8, 1, 256, 64)
  assert "K, V" in mosaic_gpu.supports(*(wide[n] for n in NAMES), gate_bound=-5.0)
  half = {n: (a.astype(jnp.float16) if n in ("q", "k", "v") else a) for n, a in x.items()}
  assert "bfloat16 or float32" in mosaic_gpu.supports(*(half[n] for n in NAMES), gate_bound=-5.0)
  with pytest.raises(ValueError, match="K, V"):
    mosaic_gpu.chunk_kda_mosaic_gpu(*(wide[n] for n in NAMES), interpret=True)
  with pytest.raises(ValueError, match="block_v"):
    mosaic_gpu.chunk_kda_mosaic_gpu(*args, interpret=True, block_v=128)
  assert mosaic_gpu.pick_block_v(1, 32, 128) == 32     # 64 CTAs of 64 columns < 132 SMs
  assert mosaic_gpu.pick_block_v(1, 96, 128) == 64
