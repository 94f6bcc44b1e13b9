"""Mosaic TPU KDA backward kernels (backward="kernel", TPU interpreter on CPU) vs fp64 autodiff."""
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import mosaic_tpu
from pallas_kernels.kda import reference
from kda_testing import outputs_and_grads, rel_err

NAMES = ("q", "k", "v", "g", "beta")
GRADS = (*NAMES, "h0")


def _segments(t: int) -> np.ndarray:
  """[1, T]: a boundary inside chunk 0, one on the chunk start 64, a one-token document."""
  ids = np.repeat(np.arange(1, 5), [40, 24, 1, t]).astype(np.int32)[:t]
  return ids[None]


def _reference_grads(x: dict, scale: float, segment_ids, cot) -> dict:
  """Gradients of every input of the fp64 recurrence for cotangents (do, d final state)."""
  with jax.enable_x64(True):
    args = {n: jnp.asarray(np.asarray(x[n], np.float32), jnp.float64) for n in GRADS}

    def f(a):
      return reference.recurrent_kda(*(a[n] for n in NAMES), scale=scale, initial_state=a["h0"],
                                     segment_ids=segment_ids)

    _, vjp = jax.vjp(f, args)
    return jax.device_get(vjp(tuple(jnp.asarray(c, jnp.float64) for c in cot))[0])


def _kernel_grads(x: dict, segment_ids, cot, interpret) -> dict:
  return outputs_and_grads(mosaic_tpu.chunk_kda_mosaic_tpu, x, cot, segment_ids=segment_ids,
                           interpret=interpret, backward="kernel")[1]


def _inputs(t: int, d: int, seed: int, dtype=jnp.float32):
  x = reference.example_inputs(jax.random.key(seed), 1, t, 2, d, d, gate="bounded",
                               with_initial_state=True)
  x = {n: (a.astype(dtype) if n in ("q", "k", "v") else a) for n, a in x.items()}
  rng = np.random.default_rng(seed)
  cot = (jnp.asarray(rng.standard_normal((1, t, 2, d), np.float32), dtype),   # o is in q's dtype
         jnp.asarray(rng.standard_normal((1, 2, d, d), np.float32)))
  return x, cot


@pytest.mark.parametrize("t, d, interpret", [
    (64, 128, True),
    (130, 64, pltpu.InterpretParams()),
])
def test_kernel_backward_fp32_matches_fp64(t, d, interpret):
  """fp32 inputs, segment ids and initial state: all six gradients within 1e-4."""
  x, cot = _inputs(t, d, t + d)
  sid = jnp.asarray(_segments(t))
  grads = _kernel_grads(x, sid, cot, interpret)
  ref = _reference_grads(x, d ** -0.5, sid, cot)
  for name in GRADS:
    assert grads[name].shape == x[name].shape, name
    assert rel_err(grads[name], ref[name]) < 1e-4, (name, rel_err(grads[name], ref[name]))


def test_kernel_backward_bf16_inputs():
  """bf16 q, k, v: gradients within fla's bf16 bounds (8e-3; 2e-2 for dg, dbeta)."""
  t, d = 130, 128
  x, cot = _inputs(t, d, 3, jnp.bfloat16)
  sid = jnp.asarray(_segments(t))
  grads = _kernel_grads(x, sid, cot, True)
  ref = _reference_grads(x, d ** -0.5, sid, cot)
  for name in GRADS:
    assert grads[name].dtype == x[name].dtype, name
    bound = 2e-2 if name in ("g", "beta") else 8e-3
    assert rel_err(grads[name], ref[name]) < bound, (name, rel_err(grads[name], ref[name]))


def test_kernel_backward_without_final_state_or_segments():
  """chunk_size 128 forward, no final-state output (zero cotangent), no segment ids."""
  t, d = 130, 64
  x, (do, _) = _inputs(t, d, 9)

  def f(a):
    o, _ = mosaic_tpu.chunk_kda_mosaic_tpu(*(a[n] for n in NAMES), initial_state=a["h0"],
                                           chunk_size=128, interpret=True, backward="kernel")
    return jnp.sum(o * do)

  grads = jax.grad(f)({n: x[n] for n in GRADS})
  ref = _reference_grads(x, d ** -0.5, None, (do, np.zeros((1, 2, d, d), np.float32)))
  for name in GRADS:
    assert rel_err(grads[name], ref[name]) < 1e-4, (name, rel_err(grads[name], ref[name]))


def test_backward_argument_is_checked():
  x, _ = _inputs(8, 64, 0)
  with pytest.raises(ValueError, match="backward"):
    mosaic_tpu.chunk_kda_mosaic_tpu(*(x[n] for n in NAMES), interpret=True, backward="xla")
