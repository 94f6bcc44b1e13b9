"""KDA public API: fla golden outputs, decode, dispatch and input validation."""
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda import fused_recurrent_kda
from pallas_kernels.kda import reference
from kda_testing import rel_err

GOLDEN_DIR = pathlib.Path(__file__).parents[1] / "golden"


def _inputs(with_initial_state: bool = True):
  """((q, k, v, g, beta), h0) with B=2, T=20, H=3, K=16, V=8."""
  x = reference.example_inputs(jax.random.key(0), 2, 20, 3, 16, 8, gate="bounded",
                               with_initial_state=with_initial_state)
  return (x["q"], x["k"], x["v"], x["g"], x["beta"]), x["h0"]


def _jit(**kwargs):
  return jax.jit(functools.partial(chunk_kda, **kwargs))


@pytest.mark.parametrize("name, impl, gate_bound", [
    ("bounded", "reference", None),
    ("bounded", "chunked", None),
    ("bounded", "chunked", -5.0),
    ("unbounded", "reference", None),
    ("unbounded", "chunked", None),
])
def test_matches_fla_naive_recurrent_kda(name, impl, gate_bound):
  """fla-core 0.6.0 naive_recurrent_kda outputs (tests/tools/make_fla_kda_golden.py)."""
  f = np.load(GOLDEN_DIR / f"kda_golden_{name}.npz")
  assert str(f["source"]).startswith("fla-core 0.6.0 naive_recurrent_kda")
  fn = _jit(scale=float(f["scale"]) if "scale" in f else None, output_final_state=True,
            gate_bound=gate_bound, impl=impl)
  o, s = fn(*(jnp.asarray(f[n]) for n in ("q", "k", "v", "g", "beta")),
            initial_state=jnp.asarray(f["h0"]) if "h0" in f else None)
  assert rel_err(o, f["o"]) < 5e-6
  assert rel_err(s, f["ht"]) < 5e-6


def test_decode_steps_match_full_sequence():
  """fused_recurrent_kda with T = 1, state carried, equals chunk_kda on the sequence."""
  (q, k, v, g, beta), h0 = _inputs()
  o_full, s_full = _jit(output_final_state=True)(q, k, v, g, beta, initial_state=h0)
  step = jax.jit(functools.partial(fused_recurrent_kda, output_final_state=True))
  q, k, v, g, beta = (np.asarray(x) for x in (q, k, v, g, beta))
  s = h0
  for t in range(q.shape[1]):
    o_t, s = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                  beta[:, t:t + 1], initial_state=s)
    np.testing.assert_allclose(o_t[:, 0], o_full[:, t], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s, s_full, rtol=1e-5, atol=1e-6)


def test_defaults_dtypes_and_dispatch():
  (q, k, v, g, beta), _ = _inputs(with_initial_state=False)
  o, s = _jit()(q, k, v, g, beta)
  assert s is None and o.shape == v.shape and o.dtype == q.dtype
  o_scaled, _ = _jit(scale=16 ** -0.5, impl="chunked")(q, k, v, g, beta)
  np.testing.assert_array_equal(o, o_scaled)
  o_ref, s_ref = _jit(impl="reference", output_final_state=True)(q, k, v, g, beta)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
  assert s_ref.shape == (2, 3, 16, 8) and s_ref.dtype == jnp.float32
  o_bf16, s_bf16 = _jit(output_final_state=True)(
      *(x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)))
  assert o_bf16.dtype == jnp.bfloat16 and s_bf16.dtype == jnp.float32


def _replace(i, new):
  def mutate(args):
    args = list(args)
    args[i] = new(args[i])
    return args
  return mutate


@pytest.mark.parametrize("mutate, kwargs, match", [
    (_replace(0, lambda q: q[0]), {}, r"q must be \[B, T, H, K\]"),
    (_replace(0, lambda q: q.astype(jnp.int32)), {}, "q must be a floating"),
    (_replace(0, lambda q: q[:, :0]), {}, "T must be >= 1"),
    (_replace(1, lambda k: k[..., :8]), {}, "k must have q's shape"),
    (_replace(2, lambda v: v[:1]), {}, r"v must be \[B, T, H, V\]"),
    (_replace(3, lambda g: g[..., :8]), {}, "g must have q's shape"),
    (_replace(4, lambda b: b[..., None]), {}, r"beta must be \[B, T, H\]"),
    (None, dict(initial_state=jnp.zeros((2, 3, 8, 16))), r"initial_state must be \[B, H, K, V\]"),
    (None, dict(segment_ids=jnp.zeros((2, 19), jnp.int32)), r"segment_ids must be \[B, T\]"),
    (None, dict(segment_ids=jnp.zeros((2, 20))), "segment_ids must be an integer"),
    (None, dict(impl="mosaic"), "impl must be None or one of " + re.escape(str(api.IMPLS))),
    (None, dict(gate_bound=-10.0), r"gate_bound must be None or a float in \[-5.0, 0\]"),
    (None, dict(gate_bound=1.0), "gate_bound must be"),
])
def test_bad_inputs_raise(mutate, kwargs, match):
  args, _ = _inputs()
  if mutate is not None:
    args = mutate(args)
  with pytest.raises(ValueError, match=match):
    chunk_kda(*args, **kwargs)


def test_fused_recurrent_validates_inputs():
  (q, k, v, g, beta), _ = _inputs()
  with pytest.raises(ValueError, match="k must have q's shape"):
    fused_recurrent_kda(q, k[..., :8], v, g, beta)


def test_named_kernel_that_cannot_take_the_call_says_why():
  """Fail closed: an explicit kernel tier rejects an unbounded gate with its reason."""
  q = jnp.ones((1, 8, 1, 64), jnp.float32) / 8.0
  beta = jnp.full((1, 8, 1), 0.5, jnp.float32)
  for impl in ("mosaic_gpu", "mosaic_tpu"):
    with pytest.raises(ValueError, match=f"impl='{impl}' cannot run this call"):
      api.chunk_kda(q, q, q, -q, beta, impl=impl)


def test_default_tier_on_this_platform_is_the_chunked_one():
  """On CPU no kernel is qualified: impl=None equals the chunked tier exactly."""
  x = jax.random.normal(jax.random.key(0), (1, 70, 2, 64)) / 8.0
  g = -jax.nn.softplus(x)
  beta = jax.nn.sigmoid(x[..., 0])
  a, _ = api.chunk_kda(x, x, x, g, beta)
  b, _ = api.chunk_kda(x, x, x, g, beta, impl="chunked")
  assert jnp.array_equal(a, b)


def test_recurrent_impls_are_checked():
  q = jnp.ones((1, 1, 1, 64), jnp.float32) / 8.0
  beta = jnp.full((1, 1, 1), 0.5, jnp.float32)
  with pytest.raises(ValueError, match="impl must be None or one of"):
    api.fused_recurrent_kda(q, q, q, -q, beta, impl="chunked")
  seg = jnp.ones((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="impl='mosaic_gpu' cannot run this call"):
    api.fused_recurrent_kda(q, q, q, -q, beta, segment_ids=seg, impl="mosaic_gpu")


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_use_qk_l2norm_in_kernel_normalises_q_and_k(impl):
  """The flag equals normalising q and k first (`reference.l2_normalize`): chunk_kda's values
  and gradients, and a fused_recurrent_kda step."""
  x = reference.example_inputs(jax.random.key(4), 1, 70, 2, 32, 32, gate="bounded",
                               with_initial_state=False)
  raw_q, raw_k = 2.0 * x["q"] + 0.3, 0.5 * x["k"] - 0.2

  def loss(q, k, flag):
    if not flag:
      q, k = reference.l2_normalize(q), reference.l2_normalize(k)
    o, _ = chunk_kda(q, k, x["v"], x["g"], x["beta"], impl=impl, gate_bound=-5.0,
                     use_qk_l2norm_in_kernel=flag)
    return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))

  grad = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
  (v1, g1), (v2, g2) = grad(raw_q, raw_k, True), grad(raw_q, raw_k, False)
  np.testing.assert_allclose(v1, v2, rtol=1e-6)
  for a, b in zip(g1, g2):
    assert rel_err(a, b) < 1e-6
  step = fused_recurrent_kda(raw_q[:, :1], raw_k[:, :1], x["v"][:, :1], x["g"][:, :1],
                             x["beta"][:, :1], use_qk_l2norm_in_kernel=True)[0]
  want = fused_recurrent_kda(reference.l2_normalize(raw_q[:, :1]),
                             reference.l2_normalize(raw_k[:, :1]), x["v"][:, :1],
                             x["g"][:, :1], x["beta"][:, :1])[0]
  np.testing.assert_allclose(step, want, rtol=1e-6)
