"""Long bf16 sequences: the chunked KDA tier stays finite and matches the recurrence."""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference
from kda_testing import rel_err


@functools.partial(jax.jit, static_argnames=("gate_bound",))
def _both_tiers(q, k, v, g, beta, h0, *, gate_bound):
  kw = dict(scale=q.shape[-1] ** -0.5, initial_state=h0, segment_ids=None)
  return (reference.recurrent_kda(q, k, v, g, beta, **kw),
          chunked.chunk_kda(q, k, v, g, beta, gate_bound=gate_bound, **kw))


@pytest.mark.parametrize("gate, gate_bound", [("bounded", -5.0), ("unbounded", None)])
def test_t65536_bf16_finite_and_close_to_fp32_recurrence(gate, gate_bound):
  """T = 65536 (1024 chunks), H = 1, K = V = 32, bf16 q, k, v, g, beta.

  Both tiers compute in fp32 on the same bf16 values: the final states agree to
  ~2e-7 relative RMS (bound 1e-5) and o, rounded to bf16, to ~4e-5 (bound 1e-3).
  """
  x = reference.example_inputs(jax.random.key(7), 1, 65536, 1, 32, 32, gate=gate,
                               with_initial_state=True, dtype=jnp.bfloat16)
  (o_ref, s_ref), (o, s) = _both_tiers(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"],
                                       gate_bound=gate_bound)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
  assert rel_err(s, s_ref) < 1e-5
  assert rel_err(o, o_ref) < 1e-3
