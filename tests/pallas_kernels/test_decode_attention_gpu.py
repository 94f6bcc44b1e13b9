"""The decode attention op's Mosaic GPU kernel on a Hopper GPU (skipped elsewhere) against the
reference, at the absorbed-MLA decode shapes.

K3: Dk = 576, v_dim = 512, H = 8, 64 and 96, T = 1, 4 and 8 new tokens, S from 4k to 128k, B up
to 16; k3_small's latent: Dk = 320, v_dim = 256. Ragged lengths per batch (S, S / 8 + 13, 1, 0,
777, 64, ...), and NaN in every cache block past each row's filled blocks: the kernel must never
load them (0 times NaN would reach the output). What the CPU tests cannot run: the wgmma with P
from registers and an initialised accumulator, the TMA pipeline across warpgroups, the
approximate exp2. The plan must pick mosaic_gpu, so a silent fall-through fails. The xla tier,
the GPU's fallback, at one K3 shape too.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention import mosaic_gpu
from pallas_kernels.decode_attention import plan
from pallas_kernels.decode_attention import reference

pytestmark = pytest.mark.skipif(not mosaic_gpu.is_hopper(), reason="needs an NVIDIA Hopper GPU")

TOL = 2e-2          # max |error| / max |o| of the bf16 output: bf16 P and rounding, ~4e-3 expected
SCALE = 192 ** -0.5
# (B, T, H, S, Dk, v_dim)
SHAPES = [(1, 1, 64, 32768, 576, 512), (4, 1, 8, 4096, 576, 512), (2, 8, 96, 4096, 576, 512),
          (16, 4, 64, 8192, 576, 512), (8, 1, 8, 8192, 320, 256), (1, 1, 8, 131072, 576, 512)]


def ragged_lengths(b: int, s: int) -> np.ndarray:
  pattern = [s, s // 8 + 13, 1, 0, 777, 64, s - 1, 4097]
  return np.asarray([min(pattern[i % len(pattern)], s) for i in range(b)], np.int32)


def inputs(b, t, h, s, dk, seed=0):
  ks = jax.random.split(jax.random.key(seed), 2)
  q = jax.random.normal(ks[0], (b, t, h, dk), jnp.bfloat16)
  cache = jax.random.normal(ks[1], (b, s, dk), jnp.bfloat16)
  return q, cache


def nan_past_filled_blocks(cache, lengths):
  """NaN from each row's first cache block past its length on (blocks of BLOCK_KV)."""
  block = mosaic_gpu.BLOCK_KV
  ends = jnp.asarray(-(-lengths // block) * block)
  slots = jnp.arange(cache.shape[1])[None, :, None]
  return jnp.where(slots >= ends[:, None, None], jnp.nan, cache).astype(cache.dtype)


def check(o, want):
  o = np.asarray(o.astype(jnp.float32))
  want = np.asarray(want)
  assert not np.isnan(o).any()
  err = float(np.abs(o - want).max() / max(np.abs(want).max(), 1e-30))
  assert err < TOL, err


@pytest.mark.parametrize("b, t, h, s, dk, dv", SHAPES)
def test_kernel_against_reference(b, t, h, s, dk, dv):
  q, cache = inputs(b, t, h, s, dk)
  lengths_np = ragged_lengths(b, s)
  lengths = jnp.asarray(lengths_np)
  assert plan(q, cache, lengths, v_dim=dv, impl="mosaic_gpu").impl == "mosaic_gpu"
  o = jax.jit(lambda q, c, l: decode_attention(q, c, l, v_dim=dv, scale=SCALE,
                                               impl="mosaic_gpu"))(
      q, nan_past_filled_blocks(cache, lengths_np), lengths)
  assert o.shape == (b, t, h, dv) and o.dtype == jnp.bfloat16
  pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
  want = jax.jit(lambda q, c, l, p: reference.decode_attention(q, c, l, p, v_dim=dv,
                                                               scale=SCALE))(q, cache, lengths, pos)
  check(o, want)
  empty = lengths_np == 0
  assert not np.asarray(o.astype(jnp.float32))[empty].any()


def test_kernel_with_explicit_positions():
  """Speculative decoding: T = 4 tokens at arbitrary positions (one below 0: o = 0)."""
  b, t, h, s, dk, dv = 3, 4, 64, 8192, 576, 512
  q, cache = inputs(b, t, h, s, dk, seed=1)
  lengths = jnp.asarray([8192, 3000, 70], jnp.int32)
  pos = jnp.asarray([[8191, 100, 4096, 0], [2999, 2998, 64, -1], [69, 69, 5, 63]], jnp.int32)
  o = decode_attention(q, cache, lengths, v_dim=dv, scale=SCALE, q_positions=pos,
                       impl="mosaic_gpu")
  check(o, reference.decode_attention(q, cache, lengths, pos, v_dim=dv, scale=SCALE))
  assert not np.asarray(o.astype(jnp.float32))[1, 3].any()


def test_xla_tier_on_gpu():
  b, t, h, s, dk, dv = 2, 2, 64, 32768, 576, 512
  q, cache = inputs(b, t, h, s, dk, seed=2)
  lengths = jnp.asarray([32768, 5000], jnp.int32)
  o = decode_attention(q, cache, lengths, v_dim=dv, scale=SCALE, impl="xla")
  pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
  check(o, reference.decode_attention(q, cache, lengths, pos, v_dim=dv, scale=SCALE))
