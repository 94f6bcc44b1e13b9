"""Masked softmax attention (MLA, report §2.1; QK-Clip's max logit, §2.5): the CPU tiers.

The reference tier is checked against an fp64 NumPy loop over (b, h, i); xla_blockwise against
the reference in forward, dq, dk, dv and the per-head max logit, on causal and full masks,
packed documents (several per row, padding id 0), separate q/kv ids with a fully masked row,
lengths that are no multiple of the blocks, fp32 and bf16. Dispatch: platform default, a named
kernel tier falling through with its reason (logged), bad arguments. cuDNN's packed layout
(derived on the device from the ids) is checked here; the kernel itself in
test_attention_gpu.py, splash in test_attention_splash.py (TPU interpreter).
"""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention
from pallas_kernels.attention import max_logit_triton
from pallas_kernels.attention import plan
from pallas_kernels.attention import reference
from pallas_kernels.attention import xla_blockwise

SCALE = 0.2


def numpy_attention(q, k, v, q_ids, kv_ids, causal, scale):
  """fp64 loop: (o [B, T, H, Dv], max logit [H])."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, _ = q.shape
  s = k.shape[1]
  o = np.zeros((b, t, h, v.shape[-1]))
  mx = np.full(h, -np.inf)
  for bi in range(b):
    for hi in range(h):
      for i in range(t):
        vis = [j for j in range(s) if (not causal or j <= i)
               and (q_ids is None or (q_ids[bi, i] == kv_ids[bi, j] != 0))]
        if not vis:
          continue
        logits = np.array([q[bi, i, hi] @ k[bi, j, hi] * scale for j in vis])
        mx[hi] = max(mx[hi], logits.max())
        p = np.exp(logits - logits.max())
        o[bi, i, hi] = (p / p.sum()) @ v[bi, vis, hi]
  return o, mx


def inputs(b, t, s, h, dk, dv, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, dk), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, h, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, h, dv), jnp.float32).astype(dtype)
  return q, k, v, jax.random.normal(ks[3], (b, t, h, dv), jnp.float32)


def packed_ids(b, t):
  """Several documents per row, ids increasing, padding (0) at a row's end and start."""
  rows = [[1] * (t // 4) + [2] * (t // 3) + [3] * (t - t // 4 - t // 3 - 5) + [0] * 5,
          [0] * 3 + [4] * (t // 2) + [7] * (t - 3 - t // 2)]
  return jnp.array(rows[:b], jnp.int32)


CASES = {
    # name: (b, t, s, causal, segments)
    "causal": (2, 37, 37, True, None),
    "full": (1, 21, 45, False, None),
    "causal_cross": (1, 45, 21, True, None),
    "packed": (2, 37, 37, True, "shared"),
    "separate": (2, 21, 37, False, "separate"),
}


def segments_of(kind, b, t, s):
  if kind is None:
    return None, None, None
  if kind == "shared":
    ids = packed_ids(b, t)
    return ids, ids, ids
  q_ids = jnp.array([[2] * 10 + [9] + [1] * 10, [1] * 21], jnp.int32)[:b]  # 9: fully masked row
  kv_ids = jnp.array([[1] * 20 + [2] * 17, [0] * 7 + [1] * 30], jnp.int32)[:b]
  return (q_ids, kv_ids), q_ids, kv_ids


def test_reference_matches_numpy_loop():
  for name in ("causal_cross", "packed", "separate"):
    b, t, s, causal, kind = CASES[name]
    q, k, v, _ = inputs(b, t, s, 1, 8, 4, jnp.float32)
    _, q_ids, kv_ids = segments_of(kind, b, t, s)
    o, mx = reference.attention(q, k, v, q_ids, kv_ids, causal=causal, scale=SCALE)
    want_o, want_mx = numpy_attention(q, k, v, None if q_ids is None else np.asarray(q_ids),
                                      None if kv_ids is None else np.asarray(kv_ids), causal,
                                      SCALE)
    np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(mx), want_mx, rtol=1e-5, err_msg=name)


def loss_and_grads(fn, q, k, v, w):
  """(o, max logit, (dq, dk, dv)) of sum(o * w)."""
  def loss(q, k, v):
    o, mx = fn(q, k, v)
    return jnp.sum(o.astype(jnp.float32) * w), (o, mx)
  (_, (o, mx)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      q, k, v)
  return o, mx, grads


@pytest.mark.parametrize("name,dtype", [(name, jnp.float32) for name in sorted(CASES)]
                         + [("packed", jnp.bfloat16), ("separate", jnp.bfloat16)])
def test_blockwise_matches_reference(name, dtype):
  b, t, s, causal, kind = CASES[name]
  q, k, v, w = inputs(b, t, s, 2, 24, 16, dtype)
  _, q_ids, kv_ids = segments_of(kind, b, t, s)
  ref = lambda q, k, v: reference.attention(q, k, v, q_ids, kv_ids, causal=causal, scale=SCALE)
  ours = lambda q, k, v: xla_blockwise.attention(q, k, v, q_ids, kv_ids, causal=causal,
                                                 scale=SCALE, block_q=8, block_k=16)
  o, mx, grads = loss_and_grads(ours, q, k, v, w)
  want_o, want_mx, want_grads = loss_and_grads(ref, q, k, v, w)
  assert o.dtype == dtype and o.shape == (b, t, 2, 16)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(mx), np.asarray(want_mx), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o), atol=tol)
  for label, g, want in zip(("dq", "dk", "dv"), grads, want_grads):
    assert g.dtype == dtype
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want, np.float32),
                               atol=tol * max(scale, 1.0), err_msg=label)
  if kind == "separate":  # row 10 of batch 0 has id 9, absent from the keys
    assert float(jnp.abs(o[0, 10].astype(jnp.float32)).max()) == 0.0
    assert float(jnp.abs(grads[0][0, 10].astype(jnp.float32)).max()) == 0.0
  assert float(xla_blockwise.max_logit(q, k, q_ids, kv_ids, causal=causal, scale=SCALE,
                                       block_q=16, block_k=8).max()) == pytest.approx(
                                           float(want_mx.max()), rel=1e-6)


def test_public_op_and_max_logit_of_all_padding():
  q, k, v, _ = inputs(2, 37, 37, 3, 24, 16, jnp.float32)
  ids = packed_ids(2, 37)
  o, mx = attention(q, k, v, segment_ids=ids, scale=SCALE, return_max_logit=True)
  want_o, want_mx = reference.attention(q, k, v, ids, ids, causal=True, scale=SCALE)
  np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-5)
  np.testing.assert_allclose(np.asarray(mx), np.asarray(want_mx), rtol=1e-6)
  ref_o = attention(q, k, v, segment_ids=ids, scale=SCALE, impl="reference")
  np.testing.assert_allclose(np.asarray(ref_o), np.asarray(want_o), atol=1e-6)
  grad_of_max = jax.grad(lambda q: attention(q, k, v, segment_ids=ids, return_max_logit=True)[1]
                         .sum())(q)
  assert float(jnp.abs(grad_of_max).max()) == 0.0  # stop_gradient
  pad = jnp.zeros((2, 37), jnp.int32)
  o, mx = attention(q, k, v, segment_ids=pad, return_max_logit=True)
  assert float(jnp.abs(o).max()) == 0.0 and bool(jnp.all(mx == -jnp.inf))
  o_default = attention(q, k, v)  # default scale Dk**-0.5, causal
  want = reference.attention(q, k, v, None, None, causal=True, scale=24 ** -0.5)[0]
  np.testing.assert_allclose(np.asarray(o_default), np.asarray(want), atol=1e-5)


def test_dispatch_falls_through_with_reasons(caplog):
  q = jax.ShapeDtypeStruct((1, 256, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  assert plan(q, q, v).impl == "xla_blockwise" and plan(q, q, v).declined == ()
  assert plan(q, q, v, impl="reference").impl == "reference"
  for impl, words in (("cudnn", "GPU"), ("mosaic_gpu", "Hopper"), ("splash", "TPU")):
    p = plan(q, q, v, segment_ids=ids, impl=impl)
    assert p.impl == "xla_blockwise" and p.declined[0][0] == impl and words in p.declined[0][1]
  kv_ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  p = plan(q, q, v, segment_ids=(ids, kv_ids), impl="splash", interpret=True)
  assert p.impl == "xla_blockwise" and "separate" in p.declined[0][1]
  assert plan(q, q, v, segment_ids=ids, impl="splash", interpret=True).impl == "splash"
  p = plan(q, q, v, impl="mosaic_gpu", interpret=True)
  assert p.impl == "xla_blockwise" and "interpreter" in p.declined[0][1]
  x = jnp.ones((1, 8, 2, 16))
  with caplog.at_level(logging.INFO):
    attention(x, x, x, impl="cudnn")
  assert "cudnn declined" in caplog.text


@pytest.mark.parametrize("kwargs,words", [
    (dict(impl="flash"), "impl must be"),
    (dict(segment_ids=jnp.ones((1, 7), jnp.int32)), "q segment_ids must be [B, T]"),
    (dict(segment_ids=jnp.ones((1, 8), jnp.float32)), "integer"),
    (dict(scale=-1.0), "scale"),
])
def test_bad_arguments(kwargs, words):
  x = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match=words.replace("[", r"\[")):
    attention(x, x, x, **kwargs)
  with pytest.raises(ValueError, match="v must be"):
    attention(x, x, x[:, :4])
  with pytest.raises(ValueError, match="floating"):
    attention(x.astype(jnp.int32), x, x)


@pytest.mark.parametrize("causal,kind,dk,s", [(True, None, 192, 256), (True, "shared", 192, 256),
                                              (False, "separate", 48, 128)])
def test_max_logit_triton_matches_reference(causal, kind, dk, s):
  """The Pallas Triton max-logit kernel in its interpreter against the reference: causal and
  full masks, packed documents with padding, separate q / kv ids with a head whose only
  visible keys are in one row, head dims of two and three power-of-two chunks."""
  b, t, h = 2, 256, 3
  q, k, _, _ = inputs(b, t, s, h, dk, 8, jnp.bfloat16, seed=dk)
  q_ids = kv_ids = None
  if kind == "shared":
    q_ids = kv_ids = jnp.array([[1] * 100 + [2] * 150 + [0] * 6, [0] * 3 + [4] * 253], jnp.int32)
  elif kind == "separate":
    q_ids = jnp.array([[1] * 128 + [2] * 128, [3] * 256], jnp.int32)
    kv_ids = jnp.array([[2] * 64 + [0] * 64, [0] * 127 + [3]], jnp.int32)
  assert max_logit_triton.chunks(dk) == (((0, 128), (128, 64)) if dk == 192 else
                                         ((0, 32), (32, 16)))
  assert max_logit_triton.supports(q, k, causal=causal, interpret=True) is None
  got = max_logit_triton.max_logit(q, k, q_ids, kv_ids, causal=causal, scale=SCALE,
                                   interpret=True)
  up = lambda x: x.astype(jnp.float32)
  want = reference.attention(up(q), up(k), up(k[..., :8]), q_ids, kv_ids, causal=causal,
                             scale=SCALE)[1]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_max_logit_triton_declines_with_reasons():
  s = jax.ShapeDtypeStruct
  q = s((1, 256, 2, 192), jnp.bfloat16)
  reasons = {
      "needs a GPU": max_logit_triton.supports(q, q, causal=True),
      "bfloat16 or float16": max_logit_triton.supports(s(q.shape, jnp.float32),
                                                       s(q.shape, jnp.float32), causal=True,
                                                       interpret=True),
      "multiple of 16": max_logit_triton.supports(s((1, 256, 2, 40), jnp.bfloat16),
                                                  s((1, 256, 2, 40), jnp.bfloat16),
                                                  causal=True, interpret=True),
      "T = 200 must be a multiple of 128": max_logit_triton.supports(
          s((1, 200, 2, 192), jnp.bfloat16), s((1, 200, 2, 192), jnp.bfloat16), causal=False,
          interpret=True),
      "T = 256 != S = 128": max_logit_triton.supports(q, s((1, 128, 2, 192), jnp.bfloat16),
                                                      causal=True, interpret=True),
  }
  for want, got in reasons.items():
    assert got is not None and want in got, (want, got)


def test_max_logit_triton_lowers_for_h200():
  """k3_small's call (B 2, T 8192, H 8, D 192, packed ids) lowers to one Triton kernel for an
  H200, on a CPU host."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  s = jax.ShapeDtypeStruct
  q, ids = s((2, 8192, 8, 192), jnp.bfloat16), s((2, 8192), jnp.int32)
  with jax.sharding.use_abstract_mesh(mesh):
    assert max_logit_triton.supports(q, q, causal=True) is None
    fn = lambda q, k, i: max_logit_triton.max_logit(q, k, i, i, causal=True, scale=SCALE)
    text = jax.jit(fn).trace(q, q, ids).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1


def _runs_loop(row, max_segments):
  """Oracle for `cudnn.segments_of`: one row's runs by a Python loop."""
  row = [int(x) for x in row]
  runs, i = [], 0
  while i < len(row):
    j = i
    while j < len(row) and row[j] == row[i]:
      j += 1
    runs.append((row[i], i, j - i))
    i = j
  real = [(s, n) for x, s, n in runs if x]
  ids = [x for x, _, _ in runs]
  zeros_at_end = all(x == 0 for x in ids[ids.index(0):]) if 0 in ids else True
  increasing = all(a < b for a, b in zip([x for x in ids if x], [x for x in ids if x][1:]))
  ok = zeros_at_end and increasing and len(real) <= max_segments
  pad = max_segments - min(len(real), max_segments)
  seqlen = [n for _, n in real][:max_segments] + [-1] * pad
  offsets = [s for s, _ in real][:max_segments] + [-1] * (pad + 1)
  return ok, seqlen, offsets


@pytest.mark.parametrize("rows", [
    [[1, 1, 2, 2, 2, 3, 0, 0], [5, 5, 5, 5, 7, 7, 7, 7]],
    [[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1, 1, 1, 1, 1]],
    [[1, 1, 2, 1, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]],
    [[1, 1, 0, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]],
    [[3, 3, 3, 3, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]],
    [[0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]],
])
def test_cudnn_segments_match_a_loop(rows):
  """The packed layout's segments (lengths, offsets) and its runtime condition (increasing runs,
  padding only at the end, at most M runs, a run in the batch) against a loop over each row."""
  from pallas_kernels.attention import cudnn
  ids = jnp.asarray(rows, jnp.int32)
  for m in (4, 8):
    ok, seqlen, offsets = cudnn.segments_of(ids, m)
    want = [_runs_loop(r, m) for r in rows]
    has_run = any(x for r in rows for x in r)
    assert bool(ok) == (all(w[0] for w in want) and has_run), (rows, m)
    if bool(ok):
      np.testing.assert_array_equal(np.asarray(seqlen), [w[1] for w in want])
      np.testing.assert_array_equal(np.asarray(offsets), [w[2] for w in want])
