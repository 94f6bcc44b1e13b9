"""segment_ids: documents packed in a row give the same result as separate runs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import reference
from kda_testing import rel_err

# Row 0: boundaries inside chunks 0 and 1. Row 1: a boundary on a chunk start
# (64), a one-token document, then padding (id 0) up to T = 150.
SEGMENT_IDS = np.stack([np.repeat([1, 2, 3], [40, 70, 40]),
                        np.repeat([5, 6, 7, 0], [64, 1, 60, 25])]).astype(np.int32)


def numpy_kda(q, k, v, g, beta, scale, h0):
  """fp64 NumPy loop over tokens for one sequence (q [T, H, K] ...); returns (o, S)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  s = np.array(h0, np.float64)
  o = np.zeros(v.shape)
  for t in range(q.shape[0]):
    s = s * np.exp(g[t])[..., None]
    s = s + np.einsum("hk,hv->hkv", beta[t][:, None] * k[t], v[t] - np.einsum("hk,hkv->hv", k[t], s))
    o[t] = np.einsum("hk,hkv->hv", q[t] * scale, s)
  return o, s


def _documents(row: np.ndarray):
  """(start, end) of each run of equal ids."""
  starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
  return list(zip(starts, starts[1:] + [len(row)]))


@pytest.mark.parametrize("impl, gate, gate_bound", [("reference", "unbounded", None),
                                                    ("chunked", "unbounded", None),
                                                    ("chunked", "bounded", -5.0)])
def test_packed_documents_match_separate_runs(impl, gate, gate_bound):
  """No leakage: each document sees only itself (the first also sees initial_state)."""
  x = reference.example_inputs(jax.random.key(3), 2, 150, 2, 32, 16, gate=gate,
                               with_initial_state=True)
  scale = 0.3
  fn = jax.jit(functools.partial(api.chunk_kda, scale=scale, output_final_state=True,
                                 gate_bound=gate_bound, impl=impl))
  o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
            segment_ids=jnp.asarray(SEGMENT_IDS))
  for b, row in enumerate(SEGMENT_IDS):
    for start, end in _documents(row):
      h0 = x["h0"][b] if start == 0 else np.zeros(x["h0"].shape[1:])
      o_doc, s_doc = numpy_kda(*(x[n][b, start:end] for n in ("q", "k", "v", "g", "beta")),
                               scale, h0)
      assert rel_err(o[b, start:end], o_doc) < 1e-5, (b, start, end)
    assert rel_err(s[b], s_doc) < 1e-5, b


def test_chunked_segment_gradients_match_fp64_recurrence():
  """Gradients w.r.t. every input with segment_ids: chunked (fp32) vs reference (fp64)."""
  with jax.enable_x64(True):
    x = reference.example_inputs(jax.random.key(4), 2, 150, 2, 32, 32, gate="unbounded",
                                 with_initial_state=True)
    rng = np.random.default_rng(0)
    do = rng.standard_normal((2, 150, 2, 32), np.float32)
    ds = rng.standard_normal((2, 2, 32, 32), np.float32)

    def grads(impl, dtype):
      def loss(a):
        o, s = api.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                             segment_ids=jnp.asarray(SEGMENT_IDS), output_final_state=True,
                             impl=impl)
        return jnp.sum(o * do.astype(dtype)) + jnp.sum(s * ds.astype(dtype))
      return jax.jit(jax.grad(loss))({n: a.astype(dtype) for n, a in x.items()})

    ref, got = grads("reference", jnp.float64), grads("chunked", jnp.float32)
  for name in ref:
    assert rel_err(got[name], ref[name]) < 1e-5, name
