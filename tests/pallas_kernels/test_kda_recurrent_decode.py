"""Mosaic GPU KDA decode kernel vs the token-by-token recurrence in fp64.

On CPU the kernel runs in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`)
and is lowered for CUDA (layout and TMA rules) without running. With
K3JAX_KDA_TEST_ON_DEVICE=1 it is compiled for the (Hopper) GPU instead and
larger shapes are added.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import recurrent_decode
from pallas_kernels.kda import reference
from kda_testing import rel_err

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
NAMES = ("q", "k", "v", "g", "beta")
# fp32 arithmetic throughout (no tensor cores): fp32 rounding, measured <= 3e-7.
TOL = 1e-5
# bf16 o: one bf16 rounding of each entry (relative 2^-9).
TOL_BF16_O = 5e-3

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def inputs(key: int, b, t, h, dk, dv, with_initial_state=True, dtype=jnp.float32) -> dict:
  return reference.example_inputs(jax.random.key(key), b, t, h, dk, dv, gate="bounded",
                                  with_initial_state=with_initial_state, dtype=dtype)


def fp64_reference(x: dict):
  """fp64 (o, final state) of the (rounded) inputs."""
  with jax.enable_x64(True):
    a = {n: jnp.asarray(np.asarray(x[n], np.float32), jnp.float64) for n in NAMES}
    h0 = None if x["h0"] is None else jnp.asarray(np.asarray(x["h0"]), jnp.float64)
    out = reference.recurrent_kda(*(a[n] for n in NAMES), scale=x["q"].shape[-1] ** -0.5,
                                  initial_state=h0, segment_ids=None)
    return jax.device_get(out)


def kernel(x: dict, initial_state=None):
  h0 = x["h0"] if initial_state is None else initial_state
  return recurrent_decode.fused_recurrent_kda_mosaic_gpu(
      *(x[n] for n in NAMES), initial_state=h0, output_final_state=True, interpret=INTERPRET)


CASES = [(b, t, d, with_h0) for b in (1, 3) for t in (1, 4) for d in (64, 128)
         for with_h0 in (True, False)]
if ON_DEVICE:
  CASES += [(64, 1, 128, True), (8, 64, 128, True), (128, 1, 64, True)]


@pytest.mark.parametrize("b, t, d, with_h0", CASES)
def test_matches_fp64(b, t, d, with_h0):
  h = 2
  x = inputs(b * 1000 + t * 10 + d + with_h0, b, t, h, d, d, with_h0)
  o, s = kernel(x)
  o_ref, s_ref = fp64_reference(x)
  assert o.shape == (b, t, h, d) and o.dtype == jnp.float32
  assert s.shape == (b, h, d, d) and s.dtype == jnp.float32
  assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_bf16_inputs_key_dim_differs_from_value_dim():
  """bf16 q, k, v, g, beta, K = 128 and V = 64 (one value block), T = 3."""
  x = inputs(7, 3, 3, 2, 128, 64, dtype=jnp.bfloat16)
  o, s = kernel(x)
  o_ref, s_ref = fp64_reference(x)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert rel_err(o, o_ref) < TOL_BF16_O and rel_err(s, s_ref) < TOL


def test_decode_steps_chain_like_one_call():
  """Four T = 1 calls feeding each call's state to the next equal one T = 4 call; the first
  call's initial state, whose buffer the kernel's output aliases, is still intact after it."""
  x = inputs(11, 1, 4, 2, 64, 64)
  h0 = np.array(x["h0"])
  o_all, s_all = kernel(x)
  np.testing.assert_array_equal(np.asarray(x["h0"]), h0)
  s = x["h0"]
  outs = []
  for t in range(4):
    o, s = kernel({n: a[:, t:t + 1] for n, a in x.items() if n != "h0"} | {"h0": None}, s)
    outs.append(o)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), o_all, rtol=0, atol=1e-6)
  np.testing.assert_allclose(s, s_all, rtol=0, atol=1e-6)


def test_lowers_for_hopper():
  """Mosaic GPU lowering (layouts, reductions, TMA boxes) for CUDA, on any host; the final
  state (output 1) aliases the initial state's buffer (operand 2, after the packed key-side
  rows and v), so that a decode loop carrying it needs no copy a step."""
  for b, t, dk, dv, dtype in [(3, 1, 64, 128, jnp.bfloat16), (2, 64, 128, 64, jnp.float32)]:
    sds = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)

    def f(q, k, v, g, beta, h0):
      return recurrent_decode.fused_recurrent_kda_mosaic_gpu(
          q, k, v, g, beta, initial_state=h0, output_final_state=True)

    args = (sds(b, t, 2, dk), sds(b, t, 2, dk), sds(b, t, 2, dv), sds(b, t, 2, dk),
            sds(b, t, 2), sds(b, 2, dk, dv, d=jnp.float32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = "
            "[1], operand_index = 2" in call), call[:300]


def test_supports_and_errors():
  x = inputs(0, 1, 2, 1, 64, 64)
  args = [x[n] for n in NAMES]
  assert recurrent_decode.supports(*args, initial_state=x["h0"]) is None
  sid = jnp.ones((1, 2), jnp.int32)
  assert "segment_ids" in recurrent_decode.supports(*args, segment_ids=sid)
  wide = inputs(0, 1, 2, 1, 256, 64)
  assert "K, V" in recurrent_decode.supports(*(wide[n] for n in NAMES))
  half = [a.astype(jnp.float16) for a in args]
  assert "bfloat16 or float32" in recurrent_decode.supports(*half)
  assert "initial_state" in recurrent_decode.supports(
      *args, initial_state=x["h0"].astype(jnp.float16))
  long = inputs(0, 1, 65, 1, 64, 64)
  assert "T <= 64" in recurrent_decode.supports(*(long[n] for n in NAMES))
  with pytest.raises(ValueError, match="K, V"):
    recurrent_decode.fused_recurrent_kda_mosaic_gpu(*(wide[n] for n in NAMES), interpret=True)
  assert recurrent_decode.fused_recurrent_kda_mosaic_gpu(*args, interpret=True)[1] is None


@pytest.mark.skipif(not ON_DEVICE, reason="compiles for the GPU (K3JAX_KDA_TEST_ON_DEVICE=1)")
def test_decode_loop_updates_the_state_in_place():
  """Compiled for the GPU, a loop carrying the state through the kernel (as the decode loop
  does) copies no state: the kernel's final state is written over its initial state."""
  b, h, d = 16, 8, 128
  x = inputs(5, b, 1, h, d, d, dtype=jnp.bfloat16)

  def loop(s):
    return jax.lax.fori_loop(0, 4, lambda i, s: kernel(x, s)[1], s)

  hlo = jax.jit(loop, donate_argnums=0).lower(x["h0"]).compile().as_text()
  state = f"f32[{b},{h},{d},{d}]"
  copies = [line for line in hlo.splitlines() if " copy(" in line and state in line]
  assert not copies, copies[:3]
