"""Mosaic TPU KDA kernel (interpret mode on CPU) vs the token-by-token recurrence in fp64."""
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import mosaic_tpu
from pallas_kernels.kda import reference
from kda_testing import outputs_and_grads, rel_err

NAMES = ("q", "k", "v", "g", "beta")
# Row 0: boundaries inside chunk 0 and on the chunk start 128; row 1: one
# document, then a one-token document and padding-like id 0 at the end.
SEGMENTS = np.stack([np.repeat([1, 2, 3], [40, 88, 72]),
                     np.repeat([4, 5, 0], [150, 1, 49])]).astype(np.int32)


def _reference(x: dict, scale: float, segment_ids, cot=None):
  """fp64 (o, state) and, given cotangents (do, ds), the gradients of every input."""
  with jax.enable_x64(True):
    args = {n: jnp.asarray(np.asarray(x[n], np.float32), jnp.float64) for n in (*NAMES, "h0")}

    def f(a):
      return reference.recurrent_kda(*(a[n] for n in NAMES), scale=scale, initial_state=a["h0"],
                                     segment_ids=segment_ids)

    if cot is None:
      return jax.device_get(f(args)), None
    out, vjp = jax.vjp(f, args)
    grads = vjp(tuple(jnp.asarray(c, jnp.float64) for c in cot))[0]
    return jax.device_get(out), jax.device_get(grads)


def _kernel(x: dict, segment_ids=None, chunk_size=64, interpret=True):
  return mosaic_tpu.chunk_kda_mosaic_tpu(
      *(x[n] for n in NAMES), initial_state=x["h0"], output_final_state=True,
      segment_ids=segment_ids, chunk_size=chunk_size, interpret=interpret)


@pytest.mark.parametrize("b, t, h, d, chunk_size, segments", [
    (1, 150, 2, 64, 64, False),
    (2, 200, 2, 128, 128, True),
])
def test_forward_matches_fp64(b, t, h, d, chunk_size, segments):
  """fp32 inputs: o and final state within 1e-5 (measured ~2e-7)."""
  x = reference.example_inputs(jax.random.key(t + d), b, t, h, d, d, gate="bounded",
                               with_initial_state=True)
  sid = jnp.asarray(SEGMENTS[:b]) if segments else None
  o, s = _kernel(x, sid, chunk_size)
  (o_ref, s_ref), _ = _reference(x, d ** -0.5, sid)
  assert o.shape == x["v"].shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
  assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_gate_at_the_bound_tpu_interpreter():
  """g = -5 almost everywhere (largest factorised exponents), TPU memory model interpreter."""
  x = reference.example_inputs(jax.random.key(7), 1, 130, 2, 64, 64, gate="bounded",
                               with_initial_state=True)
  x["g"] = jnp.full_like(x["g"], -5.0).at[:, ::7].set(-1e-6)
  o, s = _kernel(x, interpret=pltpu.InterpretParams())
  (o_ref, s_ref), _ = _reference(x, 64 ** -0.5, None)
  assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_bf16_inputs():
  """bf16 q, k, v: bf16 state matmuls; fla's bf16 bound (5e-3) on the rounded inputs."""
  x = reference.example_inputs(jax.random.key(5), 1, 200, 2, 128, 128, gate="bounded",
                               with_initial_state=True)
  x = {n: (a.astype(jnp.bfloat16) if n in ("q", "k", "v") else a) for n, a in x.items()}
  o, s = _kernel(x, jnp.asarray(SEGMENTS[:1]))
  (o_ref, s_ref), _ = _reference(x, 128 ** -0.5, jnp.asarray(SEGMENTS[:1]))
  assert o.dtype == jnp.bfloat16
  assert rel_err(o, o_ref) < 5e-3 and rel_err(s, s_ref) < 5e-3


def test_gradients_with_segments_and_initial_state():
  """custom_vjp (chunked-tier backward): all six input gradients vs fp64 autodiff."""
  b, t, h, d = 1, 200, 2, 64
  x = reference.example_inputs(jax.random.key(11), b, t, h, d, d, gate="bounded",
                               with_initial_state=True)
  sid = jnp.asarray(SEGMENTS[:1])
  rng = np.random.default_rng(0)
  cot = (rng.standard_normal((b, t, h, d), np.float32),
         rng.standard_normal((b, h, d, d), np.float32))

  (o, s), grads = outputs_and_grads(mosaic_tpu.chunk_kda_mosaic_tpu, x, cot,
                                    segment_ids=sid, interpret=True)
  (o_ref, s_ref), g_ref = _reference(x, d ** -0.5, sid, cot)
  assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
  for name in (*NAMES, "h0"):
    assert rel_err(grads[name], g_ref[name]) < 2e-4, name


def test_supports_and_errors():
  x = reference.example_inputs(jax.random.key(0), 1, 8, 1, 64, 64, gate="bounded",
                               with_initial_state=False)
  args = [x[n] for n in NAMES]
  assert mosaic_tpu.supports(*args, gate_bound=-5.0) is None
  assert "gate_bound" in mosaic_tpu.supports(*args, gate_bound=None)
  assert "gate_bound" in mosaic_tpu.supports(*args, gate_bound=-10.0)
  assert "chunk_size" in mosaic_tpu.supports(*args, gate_bound=-5.0, chunk_size=32)
  small = reference.example_inputs(jax.random.key(0), 1, 8, 1, 32, 64, gate="bounded",
                                   with_initial_state=False)
  assert "K, V" in mosaic_tpu.supports(*(small[n] for n in NAMES), gate_bound=-5.0)
  with pytest.raises(ValueError, match="K, V"):
    mosaic_tpu.chunk_kda_mosaic_tpu(*(small[n] for n in NAMES), interpret=True)
