"""Decode attention over the filled latent cache on CPU: the reference against a numpy float64 loop
over rows, tokens and visible positions; the xla tier, the Mosaic GPU kernel (in its interpreter)
and the Mosaic TPU kernel (in Pallas's interpreter) against the reference with ragged lengths (0,
1, S, lengths that are no multiple of the block), T = 1 and T > 1, bf16 and fp32; that neither
the xla tier nor the GPU kernel reads the blocks past the filled length (NaN there would reach
the output: 0 times NaN is NaN) and that the TPU kernel's index map never addresses them; the
plan's choices and refusals; bad arguments; the GPU kernel's CUDA lowering at the K3 shapes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention import default_impls
from pallas_kernels.decode_attention import mosaic_gpu
from pallas_kernels.decode_attention import mosaic_tpu
from pallas_kernels.decode_attention import plan
from pallas_kernels.decode_attention import reference
from pallas_kernels.decode_attention import xla

F32_TOL = 1e-5      # max |error| / max |o| of fp32 tiers: summation order only
BF16_TOL = 2e-2     # bf16 p in the value product and the bf16 output: ~4e-3 expected


def inputs(b, t, h, s, dk, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 2)
  q = jax.random.normal(ks[0], (b, t, h, dk), jnp.float32).astype(dtype)
  cache = jax.random.normal(ks[1], (b, s, dk), jnp.float32).astype(dtype)
  return q, cache


def default_positions(lengths, t):
  return np.asarray(lengths)[:, None] - t + np.arange(t)[None, :]


def oracle(q, cache, lengths, positions, v_dim, scale):
  """float64 loop: for each row b and token t, the softmax over the positions s < lengths[b],
  s <= positions[b, t] (o = 0 when there is none)."""
  q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
  c = np.asarray(jnp.asarray(cache, jnp.float32), np.float64)
  b, t, h, _ = q.shape
  o = np.zeros((b, t, h, v_dim))
  for i in range(b):
    for j in range(t):
      seen = [s for s in range(c.shape[1]) if s < lengths[i] and s <= positions[i][j]]
      if seen:
        logits = scale * q[i, j] @ c[i, seen].T              # [H, n]
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        o[i, j] = (w / w.sum(axis=1, keepdims=True)) @ c[i, seen, :v_dim]
  return o


def err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def nan_from(cache, ends):
  """cache with NaN at positions >= ends[b] of each row."""
  slots = jnp.arange(cache.shape[1])[None, :, None]
  return jnp.where(slots >= jnp.asarray(ends)[:, None, None], jnp.nan, cache).astype(cache.dtype)


@pytest.mark.parametrize("t", [1, 4])
def test_reference_against_numpy_loop(t):
  b, h, s, dk, dv = 5, 3, 40, 24, 16
  q, cache = inputs(b, t, h, s, dk, jnp.float32)
  lengths = np.array([0, 1, 17, 40, 3])
  out = decode_attention(q, cache, jnp.asarray(lengths, jnp.int32), v_dim=dv, scale=0.3,
                         impl="reference")
  assert out.dtype == jnp.float32 and out.shape == (b, t, h, dv)
  assert err(out, oracle(q, cache, lengths, default_positions(lengths, t), dv, 0.3)) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
  if t > 1:   # length 1 < T: only the last token (position 0) sees anything
    np.testing.assert_array_equal(np.asarray(out)[1, :t - 1], 0.0)


def test_explicit_positions_and_lengths_past_s():
  """q_positions bound each query (a position of -1 sees nothing); lengths above S count as S."""
  b, t, h, s, dk, dv = 3, 3, 2, 30, 16, 8
  q, cache = inputs(b, t, h, s, dk, jnp.float32, seed=1)
  lengths = np.array([30, 12, 35])
  pos = np.array([[4, 29, -1], [11, 0, 20], [33, 7, 7]])
  want = oracle(q, cache, np.minimum(lengths, s), pos, dv, 0.25)
  for impl in ("reference", "xla"):
    out = decode_attention(q, cache, jnp.asarray(lengths, jnp.int32), v_dim=dv, scale=0.25,
                           q_positions=jnp.asarray(pos, jnp.int32), impl=impl)
    assert err(out, want) < F32_TOL, impl
    np.testing.assert_array_equal(np.asarray(out)[0, 2], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 4])
def test_xla_tier_against_reference(dtype, t):
  """Through the API (one block: S below MIN_BLOCK) and the tier with 16-position blocks (the
  last one read from S - 16 on), jitted with traced lengths."""
  b, h, s, dk, dv = 5, 4, 100, 64, 48
  q, cache = inputs(b, t, h, s, dk, dtype, seed=2)
  lengths = jnp.asarray([0, 1, 37, 100, 64], jnp.int32)
  pos = jnp.asarray(default_positions(lengths, t), jnp.int32)
  want = reference.decode_attention(q, cache, lengths, pos, v_dim=dv, scale=0.125)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  out = jax.jit(lambda q, c, l: decode_attention(q, c, l, v_dim=dv, scale=0.125))(
      q, cache, lengths)
  assert out.dtype == dtype and err(out, want) < tol
  blocked = jax.jit(lambda q, c, l, p: xla.decode_attention(q, c, l, p, v_dim=dv, scale=0.125,
                                                            block=16))(q, cache, lengths, pos)
  assert err(blocked, want) < (F32_TOL if dtype == jnp.float32 else 5e-3)
  np.testing.assert_array_equal(np.asarray(blocked)[0], 0.0)


def test_xla_tier_reads_no_block_past_max_length():
  """NaN in every block past max(lengths) leaves the output as it was; one NaN position inside
  the last block read makes it NaN (the test can fail)."""
  b, t, h, s, dk, dv = 3, 2, 2, 96, 32, 32
  q, cache = inputs(b, t, h, s, dk, jnp.float32, seed=3)
  lengths = jnp.asarray([21, 0, 37], jnp.int32)
  pos = jnp.asarray(default_positions(lengths, t), jnp.int32)
  run = lambda c, block: xla.decode_attention(q, c, lengths, pos, v_dim=dv, scale=0.2,
                                              block=block)
  for block in (16, 10):
    clean = run(cache, block)
    ends = np.full(b, -(-37 // block) * block)
    assert bool(jnp.all(run(nan_from(cache, ends), block) == clean)), block
    assert bool(jnp.isnan(run(nan_from(cache, ends - 1), block)).any()), block
  api = lambda c, l: decode_attention(q, c, l, v_dim=dv, scale=0.2)
  np.testing.assert_array_equal(
      np.asarray(api(jnp.full_like(cache, jnp.nan), jnp.zeros(b, jnp.int32))), 0.0)


def test_xla_block_size_follows_the_score_budget():
  assert xla.block_size(1, 1, 64, 131072) == xla.MAX_BLOCK
  assert xla.block_size(16, 1, 64, 131072) == 2048
  assert xla.block_size(64, 8, 96, 131072) == xla.MIN_BLOCK
  assert xla.block_size(1, 1, 8, 300) == 300


GPU_CFG = mosaic_gpu.Config(splits=3, stages=3, min_split=64)


@pytest.mark.parametrize("t, h", [(1, 8), (3, 4)])
def test_mosaic_gpu_in_interpreter_against_reference(t, h):
  """Three splits of 64-position blocks over S = 200 (the last block loaded from 136 on), lengths
  0, 1, 130, 200; NaN from each row's first unfilled block on: those blocks are never loaded."""
  b, s, dk, dv = 4, 200, 192, 128
  q, cache = inputs(b, t, h, s, dk, jnp.bfloat16, seed=4)
  lengths = jnp.asarray([0, 1, 130, 200], jnp.int32)
  pos = jnp.asarray(default_positions(lengths, t), jnp.int32)
  ends = -(-np.asarray(lengths) // mosaic_gpu.BLOCK_KV) * mosaic_gpu.BLOCK_KV
  out = mosaic_gpu.decode_attention(q, nan_from(cache, ends), lengths, pos, v_dim=dv,
                                    scale=dk ** -0.5, interpret=True, config=GPU_CFG)
  want = reference.decode_attention(q, cache, lengths, pos, v_dim=dv, scale=dk ** -0.5)
  assert err(out, want) < 5e-3
  np.testing.assert_array_equal(np.asarray(out)[0], 0.0)


def test_mosaic_gpu_through_the_api_with_positions():
  """The default config (one split per CTA on the interpreter's 2 SMs), explicit positions."""
  b, t, h, s, dk, dv = 2, 2, 16, 128, 128, 128
  q, cache = inputs(b, t, h, s, dk, jnp.bfloat16, seed=5)
  lengths = jnp.asarray([128, 70], jnp.int32)
  pos = jnp.asarray([[5, 127], [69, -1]], jnp.int32)
  p = plan(q, cache, lengths, v_dim=dv, q_positions=pos, impl="mosaic_gpu", interpret=True)
  assert p.impl == "mosaic_gpu" and not p.declined
  out = decode_attention(q, cache, lengths, v_dim=dv, scale=0.1, q_positions=pos,
                         impl="mosaic_gpu", interpret=True)
  assert out.dtype == jnp.bfloat16
  assert err(out, oracle(q, cache, np.asarray(lengths), np.asarray(pos), dv, 0.1)) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out)[1, 1], 0.0)


def test_mosaic_gpu_splits_and_combine():
  lengths = jnp.asarray([0, 700, 5000], jnp.int32)
  cfg = mosaic_gpu.Config(splits=8)
  assert int(mosaic_gpu.split_length(lengths, cfg)) == 640        # cdiv(5000, 8) -> 64s
  assert int(mosaic_gpu.split_length(lengths[:2], cfg)) == mosaic_gpu.MIN_SPLIT
  # Two splits of one row: weights 2^lse; an unstarted split's NaN partials are ignored.
  o = jnp.asarray([[[[1.0]], [[3.0]], [[jnp.nan]]]])               # [B=1, P=3, M=1, Dv=1]
  lse = jnp.asarray([[[0.0], [1.0], [jnp.nan]]])
  out = mosaic_gpu.combine(o, lse, jnp.asarray([2 * 64], jnp.int32), jnp.int32(64))
  np.testing.assert_allclose(np.asarray(out), [[[(1 + 2 * 3) / 3]]], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 4])
def test_mosaic_tpu_in_interpreter_against_reference(dtype, t):
  """S = 640: five 128-position blocks; lengths 0, 1, 300, 640."""
  b, h, s, dk, dv = 4, 4, 640, 192, 128
  assert mosaic_tpu.block_size(s) == 128
  q, cache = inputs(b, t, h, s, dk, dtype, seed=6)
  lengths = jnp.asarray([0, 1, 300, 640], jnp.int32)
  assert plan(q, cache, lengths, v_dim=dv, impl="mosaic_tpu", interpret=True).impl == "mosaic_tpu"
  out = decode_attention(q, cache, lengths, v_dim=dv, scale=0.1, impl="mosaic_tpu",
                         interpret=True)
  pos = jnp.asarray(default_positions(lengths, t), jnp.int32)
  want = reference.decode_attention(q, cache, lengths, pos, v_dim=dv, scale=0.1)
  assert out.dtype == dtype and err(out, want) < (F32_TOL if dtype == jnp.float32 else BF16_TOL)
  np.testing.assert_array_equal(np.asarray(out)[0], 0.0)


def test_mosaic_tpu_index_map_addresses_only_filled_blocks():
  """The cache block of grid step j is min(j, last filled block): over a row's steps the blocks
  addressed are exactly those holding positions below its length (block 0 for length 0)."""
  bk, blocks = 128, 8
  for length in (0, 1, 128, 129, 700, 1024):
    seen = {int(mosaic_tpu.cache_block(j, jnp.int32(length), bk)) for j in range(blocks)}
    assert seen == set(range(max(-(-length // bk), 1))), length


def test_plan_defaults_and_falls_through_with_reasons():
  q, cache = inputs(1, 1, 4, 128, 128, jnp.bfloat16)
  lengths = jnp.asarray([5], jnp.int32)
  assert default_impls() == ("xla",)
  assert plan(q, cache, lengths, v_dim=128) == plan(q, cache, lengths, v_dim=128, impl="xla")
  assert plan(q, cache, lengths, v_dim=128).impl == "xla"
  refusals = {
      "not an NVIDIA Hopper GPU": plan(q, cache, lengths, v_dim=128, impl="mosaic_gpu"),
      "both be bfloat16 or both float16": plan(q.astype(jnp.float32), cache, lengths,
                                               v_dim=128, impl="mosaic_gpu", interpret=True),
      "Dk=96 is not a multiple of 64": plan(q[..., :96], cache[..., :96], lengths, v_dim=64,
                                            impl="mosaic_gpu", interpret=True),
      "v_dim=64 must be a multiple of 128": plan(q, cache, lengths, v_dim=64, impl="mosaic_gpu",
                                                 interpret=True),
      "S=32 is shorter than one cache block": plan(q, cache[:, :32], lengths, v_dim=128,
                                                   impl="mosaic_gpu", interpret=True),
      "not a TPU": plan(q, cache, lengths, v_dim=128, impl="mosaic_tpu"),
      "S=600 is above 512": plan(q, jnp.zeros((1, 600, 128), jnp.bfloat16), lengths, v_dim=128,
                                 impl="mosaic_tpu", interpret=True),
      "v_dim=64 must be a multiple of 128 or Dk": plan(q, cache, lengths, v_dim=64,
                                                       impl="mosaic_tpu", interpret=True),
  }
  for reason, p in refusals.items():
    assert p.impl == "xla" and len(p.declined) == 1, p
    assert reason in p.declined[0][1], (reason, p.declined)


def _bad_call(**changes):
  q, cache = inputs(2, 1, 2, 16, 8, jnp.float32)
  args = dict(q=q, cache=cache, lengths=jnp.asarray([3, 4], jnp.int32), v_dim=4, scale=0.5,
              q_positions=None, impl=None)
  args.update(changes)
  return decode_attention(args.pop("q"), args.pop("cache"), args.pop("lengths"), **args)


BAD = {
    "q must be a floating \\[B, T, H, Dk\\]": dict(q=jnp.zeros((2, 2, 8))),
    "q must be a floating": dict(q=jnp.zeros((2, 1, 2, 8), jnp.int32)),
    "q must have B, T, H, Dk >= 1": dict(q=jnp.zeros((2, 0, 2, 8))),
    "cache must be a floating \\[B, S, Dk\\] = \\[2, S >= 1, 8\\]": dict(
        cache=jnp.zeros((2, 16, 6))),
    "cache must be": dict(cache=jnp.zeros((3, 16, 8))),
    "cache must be a floating": dict(cache=jnp.zeros((2, 16, 8), jnp.int32)),
    "lengths must be an integer \\[B\\]": dict(lengths=jnp.asarray([3.0, 4.0])),
    "lengths must be": dict(lengths=jnp.asarray([3], jnp.int32)),
    "v_dim must be an int in \\[1, Dk\\] = \\[1, 8\\]": dict(v_dim=9),
    "v_dim must be an int": dict(v_dim=4.0),
    "scale must be a positive finite float": dict(scale=0.0),
    "scale must be a positive": dict(scale=None),
    "q_positions must be None or an integer \\[B, T\\]": dict(q_positions=jnp.zeros((2, 2),
                                                                                    jnp.int32)),
    "impl must be None or one of": dict(impl="cuda"),
}


@pytest.mark.parametrize("match", BAD)
def test_bad_arguments(match):
  with pytest.raises(ValueError, match=match):
    _bad_call(**BAD[match])


# (B, T, H, S, Dk, v_dim): K3 at T = 1 and 8 new tokens, k3_small.
K3_SHAPES = [(1, 1, 64, 32768, 576, 512), (16, 8, 96, 4096, 576, 512),
             (4, 1, 8, 131072, 320, 256)]


@pytest.mark.parametrize("b, t, h, s, dk, dv", K3_SHAPES)
def test_mosaic_gpu_config_fits_and_kernel_lowers_for_hopper(monkeypatch, b, t, h, s, dk, dv):
  """At the K3 shapes the config fits shared memory and one wave of CTAs (or one split), and the
  kernel lowers for CUDA on CPU (the interpreter does not run its register-operand wgmma)."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "num_sms", lambda interpret: 132)
  cfg = mosaic_gpu.default_config(b, t, h, s, dk, 132)
  assert isinstance(cfg, mosaic_gpu.Config), cfg
  assert mosaic_gpu.smem_bytes(dk, cfg.stages, False) <= mosaic_gpu.SMEM_BYTES
  ctas = cfg.splits * b * mosaic_gpu.padded_rows(t, h) // mosaic_gpu.ROWS
  assert ctas <= 132 or cfg.splits == 1, cfg
  sd = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  fn = lambda q, c, l, p: mosaic_gpu.decode_attention(q, c, l, p, v_dim=dv, scale=dk ** -0.5)
  args = (sd(b, t, h, dk), sd(b, s, dk), sd(b, dtype=jnp.int32), sd(b, t, dtype=jnp.int32))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
