"""The MXFP4 matmul's Mosaic GPU kernel on a Hopper GPU (skipped elsewhere) against the reference.

First what the CPU tests cannot run: the kernel's inline Mosaic GPU loads (the packed bytes as
int4, the scale column) read every code and scale exactly (x = I), also with dequant="select"
(its subnormal intermediate needs the GPU's bf16 multiply; XLA:CPU flushes it), and a NaN scale
byte. Then
the K3 expert shapes (K, N) = (3584, 3072) and (3072, 3584) at M = 1, 16, 64 and 4096, dense
and grouped over 8 experts (uneven sizes, an empty expert, rows past the groups), fp32 output
against the reference (`k3jax.mx.unpack_k3` + XLA, bf16 operands, fp32 sums) and bf16 output.
The plan must pick mosaic_gpu when asked, so a silent fall-through fails. The Triton tier
(`triton.py`, few rows) likewise: every code and scale edge exactly with each dequantization
(split-K too; with MXFP8 x on the fp8 MMA too), large scales, overflow and NaN, the K3 shapes at
M = 1 and 16 dense and over 8 experts at M = 16 and 64, and every benchmark candidate config
(those with MXFP8 x against the reference's fp32 product of MXFP8-rounded x), the decode
candidates and default at k3_small's all-experts shape; its fused gate/up
kernel (gather, W1 / W3, SiTU) against the reference tier at k3_small's and K3's shapes.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mx
from mxfp4_testing import check_mxfp8_overflow_and_nan
from mxfp4_testing import dequantize
from mxfp4_testing import every_code
from mxfp4_testing import plant_overflow_and_nan
from mxfp4_testing import rel_err
from pallas_kernels.mxfp4_matmul import mosaic_gpu
from pallas_kernels.mxfp4_matmul import mxfp4_expert_ffn
from pallas_kernels.mxfp4_matmul import mxfp4_gate_up
from pallas_kernels.mxfp4_matmul import mxfp4_matmul
from pallas_kernels.mxfp4_matmul import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul import plan
from pallas_kernels.mxfp4_matmul import plan_expert_ffn
from pallas_kernels.mxfp4_matmul import plan_gate_up
from pallas_kernels.mxfp4_matmul import plan_ragged_dot
from pallas_kernels.mxfp4_matmul import reference
from pallas_kernels.mxfp4_matmul import triton

pytestmark = pytest.mark.skipif(not mosaic_gpu.is_hopper(), reason="needs an NVIDIA Hopper GPU")

BF16_TOL = 1e-2     # relative L2 of bf16 outputs (fp32 accumulation): ~3e-3 expected
F32_TOL = 1e-5      # fp32 outputs of the same bf16 products: summation order only
F8_TOL = 1e-4       # MXFP8 x on the fp8 MMA against its fp32 oracle: Hopper's fp8 wgmma may
                    # add a block's 32 products in less than fp32 (structural errors are >= 1e-2)
K3_SHAPES = ((3584, 3072), (3072, 3584))
SIZES = {1: (0, 0, 1, 0, 0, 0, 0, 0), 16: (3, 0, 5, 1, 2, 0, 4, 1),
         64: (10, 0, 7, 13, 1, 9, 20, 2), 4096: (700, 0, 513, 1000, 9, 1100, 400, 370)}


def make(m, k, n, groups, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  packed, scale = mx.pack_k3(0.02 * jax.random.normal(kw, (groups, n, k), jnp.float32))
  return x, packed, scale


@pytest.mark.parametrize("m", [512, 16])
def test_reads_every_code_and_scale_exactly(m):
  """x = rows of I: out = W^T, exact in fp32 (the decode tiles for m = 16)."""
  n, k = 256, 512
  packed, scale = every_code(n, k, seed=m)
  x = jnp.eye(m, k, dtype=jnp.bfloat16)
  out = mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), impl="mosaic_gpu",
                     preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), dequantize(packed, scale).T[:m])


@pytest.mark.parametrize("m", [512, 16])
def test_select_dequant_reads_every_code_and_scale_exactly(m):
  """dequant="select" (the benchmark's variant): x = rows of I, out = W^T exactly (every code in
  both nibbles, scales 100-150)."""
  n, k = 256, 512
  packed, scale = every_code(n, k, seed=m + 1)
  x = jnp.eye(m, k, dtype=jnp.bfloat16)
  cfg = mosaic_gpu.config(m, k, n, 1, jnp.float32, mosaic_gpu.num_sms(False))
  out = mosaic_gpu.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                          preferred_element_type=jnp.float32,
                          config=dataclasses.replace(cfg, dequant="select"))
  np.testing.assert_array_equal(np.asarray(out), dequantize(packed, scale).T[:m])


def test_nan_scale_gives_a_nan_column():
  n, k = 256, 512
  packed, scale = every_code(n, k, seed=3)
  scale[5, 3] = 255
  out = np.asarray(mxfp4_matmul(jnp.ones((16, k), jnp.bfloat16), jnp.asarray(packed),
                                jnp.asarray(scale), impl="mosaic_gpu",
                                preferred_element_type=jnp.float32))
  nan = np.zeros(out.shape, bool)
  nan[:, 5] = True
  np.testing.assert_array_equal(np.isnan(out), nan)


def check_matmul(impl: str, m: int, k: int, n: int, seed: int):
  """`impl`, which the plan must pick, against the reference at [m, k] x [n, k]^T, fp32 and bf16
  out."""
  x, packed, scale = make(m, k, n, 1, seed=seed)
  packed, scale = packed[0], scale[0]
  p = plan(x, packed, scale, impl=impl)
  assert p.impl == impl, p.declined
  ref = jax.jit(reference.matmul, static_argnames="preferred_element_type")(
      x, packed, scale, preferred_element_type=jnp.float32)
  fn = jax.jit(mxfp4_matmul, static_argnames=("impl", "preferred_element_type"))
  out = fn(x, packed, scale, impl=impl, preferred_element_type=jnp.float32)
  assert out.shape == (m, n) and rel_err(out, ref) < F32_TOL
  out = fn(x, packed, scale, impl=impl)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL


def check_ragged_dot(impl: str, m: int, k: int, n: int, seed: int):
  """`impl`, which the plan must pick, against the reference over 8 experts of SIZES[m] rows and
  5 rows past the groups (zeros in fp32 and bf16), fp32 and bf16 out."""
  sizes = SIZES[m]
  x, packed, scale = make(m + 5, k, n, len(sizes), seed=seed)
  gs = jnp.asarray(sizes, jnp.int32)
  p = plan_ragged_dot(x, packed, scale, gs, impl=impl)
  assert p.impl == impl, p.declined
  ref = jax.jit(reference.ragged_dot, static_argnames="preferred_element_type")(
      x, packed, scale, gs, preferred_element_type=jnp.float32)
  fn = jax.jit(mxfp4_ragged_dot, static_argnames=("impl", "preferred_element_type"))
  out = fn(x, packed, scale, gs, impl=impl, preferred_element_type=jnp.float32)
  assert rel_err(out, ref) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)
  out = fn(x, packed, scale, gs, impl=impl)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL
  np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes):], 0.0)


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
def test_matmul_k3_shapes(m, k, n):
  check_matmul("mosaic_gpu", m, k, n, seed=m + k)


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
def test_ragged_dot_k3_shapes_eight_experts(m, k, n):
  check_ragged_dot("mosaic_gpu", m, k, n, seed=m + n)


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [16, 4096])
def test_unpacked_tier_k3_shapes(m, k, n):
  """The unpacked tier (bf16 weight in HBM, then cuBLAS / the bf16 grouped GEMM's Mosaic GPU
  kernel) against the reference, dense and over 8 experts."""
  x, packed, scale = make(m + 5, k, n, 8, seed=m + 2 * n)
  gs = jnp.asarray(SIZES[m], jnp.int32)
  fn = jax.jit(mxfp4_ragged_dot, static_argnames=("impl", "preferred_element_type"))
  ref = jax.jit(reference.ragged_dot, static_argnames="preferred_element_type")(
      x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = fn(x, packed, scale, gs, impl="unpacked", preferred_element_type=jnp.float32)
  assert rel_err(out, ref) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(SIZES[m]):], 0.0)
  dense = jax.jit(mxfp4_matmul, static_argnames=("impl", "preferred_element_type"))
  ref = reference.matmul(x, packed[0], scale[0], preferred_element_type=jnp.float32)
  out = dense(x, packed[0], scale[0], impl="unpacked")
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL


def swapped(m, k, n, groups, out_dtype, **changes):
  """The default config at this shape with the operands swapped (x_rows: all of x's rows), and
  `changes`."""
  cfg = mosaic_gpu.config(m, k, n, groups, out_dtype, mosaic_gpu.num_sms(False))
  return dataclasses.replace(cfg, swap=True, x_rows=cfg.x_rows or -(-m // 8) * 8, **changes)


SWAPPED_VARIANTS = {"shift": dict(dequant="shift"), "ptx": dict(dequant="ptx"),
                    "ptx_overlap": dict(dequant="ptx", overlap=True)}


@pytest.mark.parametrize("variant", SWAPPED_VARIANTS)
@pytest.mark.parametrize("m", [1, 16])
def test_swapped_reads_every_code_and_scale_exactly(m, variant):
  """swap (the dequantized tile as wgmma's register operand, the tile stored transposed by
  inline Mosaic GPU): x = rows of I, out = W^T exactly; "ptx" (x's columns permuted to its
  tile's order; also with `overlap`) with every code and the scale edges too (0: subnormal
  products), and a NaN scale byte: a NaN column (0 x NaN in x = I's zeros), the others exact."""
  n, k = 256, 512
  packed, scale = every_code(n, k, seed=m + 2)
  x = jnp.eye(m, k, dtype=jnp.bfloat16)
  run = lambda p, s: np.asarray(mosaic_gpu.matmul(
      x, jnp.asarray(p), jnp.asarray(s), preferred_element_type=jnp.float32,
      config=swapped(m, k, n, 1, jnp.float32, **SWAPPED_VARIANTS[variant])))
  np.testing.assert_array_equal(run(packed, scale), dequantize(packed, scale).T[:m])
  if variant != "shift":
    scale = edge_scales(n, k)
    scale[7, 2] = 255
    out, want = run(packed, scale), dequantize(packed, scale).T[:m]
    assert np.isnan(out[:, 7]).all()
    np.testing.assert_array_equal(np.delete(out, 7, axis=1), np.delete(want, 7, axis=1))


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("changes", [*SWAPPED_VARIANTS.values(), dict(dequant="ptx", split_k=2)],
                         ids=[*SWAPPED_VARIANTS, "ptx_split2"])
def test_swapped_k3_shapes(m, k, n, changes):
  """swap at the K3 shapes, dense (fp32 from split K, and bf16) and, where all rows fit one
  tile, over 8 experts (an empty expert, rows past the groups)."""
  x, packed, scale = make(m, k, n, 1, seed=m + k + 1)
  ref = reference.matmul(x, packed[0], scale[0], preferred_element_type=jnp.float32)
  for out_dtype, tol in ((jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)):
    out = jax.jit(lambda a, p, s, dt=out_dtype: mosaic_gpu.matmul(
        a, p, s, preferred_element_type=dt, config=swapped(m, k, n, 1, dt, **changes)))(
            x, packed[0], scale[0])
    assert out.dtype == out_dtype and rel_err(out, ref) < tol
  if m + 5 > mosaic_gpu.SMALL_M:
    return
  sizes = SIZES[m]
  x, packed, scale = make(m + 5, k, n, len(sizes), seed=m + n + 1)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = reference.ragged_dot(x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = jax.jit(lambda a, p, s, g: mosaic_gpu.ragged_dot(
      a, p, s, g, preferred_element_type=jnp.float32,
      config=swapped(m + 5, k, n, 8, jnp.float32, **changes)))(x, packed, scale, gs)
  assert rel_err(out, ref) < F32_TOL
  np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)


# ------------------------------------------------------------------------------------------
# The Triton tier (`triton.py`): Pallas on the Triton backend, for few rows
# ------------------------------------------------------------------------------------------

def edge_scales(n: int, k: int) -> np.ndarray:
  """Scale bytes [n, k/32] cycling through the E8M0 edges that keep every weight finite: 0
  (2^-127, subnormal products), 1, 2, 126-128, large ones up to 252 (6 * 2^125)."""
  edges = np.array([0, 1, 2, 3, 64, 126, 127, 128, 200, 251, 252], np.uint8)
  return edges[(np.arange(n)[:, None] + np.arange(k // 32)[None, :]) % len(edges)]


VARIANTS = {"mma": {}, "split_k": dict(split_k=4),
            "fma": dict(fma=True, block_m=2, block_n=4, num_warps=2),
            "mxfp8": dict(act="mxfp8"), "mxfp8_wgmma": dict(act="mxfp8", block_n=64, swap=True)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dequant", triton.DEQUANTS)
def test_triton_reads_every_code_and_scale_exactly(dequant, variant):
  """x = I [K, K]: out = W^T exactly for every code in both nibbles and the scale edges (values
  below 2^-126 too: the GPU keeps subnormals), with each dequantization, on the MMA and on the
  CUDA cores (fma: the scale applied to each block's sum), and with x in MXFP8 on the fp8 MMA
  (x = I is exact in E4M3; 2^(s - 127) applied after the MMA, 2^-127 kept). With split-K (4
  programs' fp32 atomic adds, one of them nonzero per output) exactly too, but for the values
  below 2^-126: the GPU's fp32 atomic add flushes subnormals to zero."""
  n, k = 64, 512
  packed, _ = every_code(n, k, seed=5)
  scale = edge_scales(n, k)
  cfg = triton.Config(block_k=128, dequant=dequant, **VARIANTS[variant])
  out = triton.matmul(jnp.eye(k, dtype=jnp.bfloat16), jnp.asarray(packed), jnp.asarray(scale),
                      preferred_element_type=jnp.float32, config=cfg)
  want = dequantize(packed, scale).T.astype(np.float32)
  if variant == "split_k":
    assert (np.abs(want[want != 0]) < 2.0 ** -126).any()
    want = np.where(np.abs(want) < 2.0 ** -126, np.float32(0), want)
  np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("dequant", triton.DEQUANTS)
def test_triton_large_scales_overflow_and_nan(dequant):
  """Scales 253 / 254 with codes up to 1.5 (finite: exact), a lone 6 * 2^127 weight (+inf in
  its column, by x's sign), a lone -6 * 2^126 (-inf) and a NaN scale (a NaN column)."""
  n, k = 64, 512
  rng = np.random.default_rng(7)
  packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8) & 0xBB   # |value| <= 1.5
  scale = np.where(rng.random((n, k // 32)) < 0.5, 253, 254).astype(np.uint8)
  cfg = dataclasses.replace(triton.Config(), dequant=dequant)
  run = lambda x, p, s: np.asarray(triton.matmul(
      x, jnp.asarray(p), jnp.asarray(s), preferred_element_type=jnp.float32, config=cfg))
  np.testing.assert_array_equal(run(jnp.eye(k, dtype=jnp.bfloat16), packed, scale),
                                dequantize(packed, scale).T.astype(np.float32))
  packed[:3], scale[3:] = 0, rng.integers(100, 151, (n - 3, k // 32))
  packed[0, 5], scale[0, 0] = 0x07, 254      # element 10: 6 * 2^127 -> +inf
  packed[1, 9], scale[1, 0] = 0xF0, 253      # element 19: -6 * 2^126 -> -inf
  scale[2, 4] = 255                          # NaN
  x = jax.random.normal(jax.random.key(3), (16, k), jnp.float32).astype(jnp.bfloat16)
  out = run(x, packed, scale)
  sign = np.sign(np.asarray(x, np.float32))
  np.testing.assert_array_equal(out[:, 0], sign[:, 10] * np.inf)
  np.testing.assert_array_equal(out[:, 1], -sign[:, 19] * np.inf)
  assert np.isnan(out[:, 2]).all() and np.isfinite(out[:, 3:]).all()


@pytest.mark.parametrize("variant", [dict(dequant="exp"),
                                     dict(dequant="ptx", block_n=64, swap=True)])
def test_triton_mxfp8_overflow_and_nan(variant):
  """MXFP8 x (on mma.sync, and swapped on wgmma): a weight past fp32's range (6 * 2^127,
  -6 * 2^126) is never formed, its column is x's E4M3 value times it rounded once (inf only
  where that overflows); a NaN scale byte gives a NaN column, an inf in x a NaN row."""
  n, k = 64, 512
  rng = np.random.default_rng(8)
  packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
  scale = rng.integers(100, 151, (n, k // 32)).astype(np.uint8)
  scale[:3] = 127
  plant_overflow_and_nan(packed, scale)
  x = jax.random.normal(jax.random.key(4), (16, k), jnp.float32).astype(jnp.bfloat16)
  x = x.at[15, 300].set(jnp.inf)
  out = np.asarray(triton.matmul(x, jnp.asarray(packed), jnp.asarray(scale),
                                 preferred_element_type=jnp.float32,
                                 config=triton.Config(act="mxfp8", **variant)))
  x8 = np.asarray(mx.dequantize(*mx.quantize(x, "mxfp8")), np.float64)
  check_mxfp8_overflow_and_nan(out, x8, rows=15)


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [1, 16])
def test_triton_matmul_k3_shapes(m, k, n):
  check_matmul("triton", m, k, n, seed=m + k + 2)


@pytest.mark.parametrize("k, n", K3_SHAPES)
@pytest.mark.parametrize("m", [16, 64])
def test_triton_ragged_dot_k3_shapes_eight_experts(m, k, n):
  check_ragged_dot("triton", m, k, n, seed=m + n + 2)


@pytest.mark.parametrize("name", list(triton.CONFIGS))
def test_triton_every_candidate_config(name):
  """Each benchmark candidate (`triton.CONFIGS`, block_k fitted to K) at (K, N) = (3584, 3072),
  16 rows dense and grouped over 8 experts (an empty expert, rows past the groups); a config
  with MXFP8 x against the reference's fp32 product of MXFP8-rounded x."""
  k, n, m = 3584, 3072, 16
  cfg = triton.fit(triton.CONFIGS[name], k)
  x, packed, scale = make(m + 5, k, n, 8, seed=len(name))
  fp8 = cfg.act == "mxfp8"
  ref_x = mx.dequantize(*mx.quantize(x, "mxfp8")) if fp8 else x
  ref = reference.matmul(ref_x[:m], packed[0], scale[0], preferred_element_type=jnp.float32)
  out = jax.jit(lambda a, p, s: triton.matmul(a, p, s, preferred_element_type=jnp.float32,
                                              config=cfg))(x[:m], packed[0], scale[0])
  assert rel_err(out, ref) < (F8_TOL if fp8 else F32_TOL), (cfg, rel_err(out, ref))
  gs = jnp.asarray(SIZES[m], jnp.int32)
  ref = reference.ragged_dot(ref_x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = jax.jit(lambda a, p, s, g: triton.ragged_dot(a, p, s, g, config=cfg))(
      x, packed, scale, gs)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL, cfg
  np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(SIZES[m]):], 0.0)


@pytest.mark.parametrize("name", [None, *triton.DECODE_CONFIGS])
def test_triton_decode_configs_all_experts_shape(name):
  """The default (n64_k64_w2 here: `triton.SHORT_K`) and each decode candidate
  (`triton.DECODE_CONFIGS`) at k3_small's all-experts W2 shape: 16 rows on each of 64 experts
  but one empty and one of 9, K = N = 512, 3 rows past the groups; fp32 out against the
  reference (bf16 for a config with MXFP8 x, against MXFP8-rounded x)."""
  k = n = 512
  sizes = [16] * 64
  sizes[5], sizes[40] = 0, 9
  m = sum(sizes)
  if name is None:
    assert triton.default_config(m, k, n, True) == triton.DECODE_CONFIGS["n64_k64_w2"]
  cfg = None if name is None else triton.fit(triton.DECODE_CONFIGS[name], k)
  x, packed, scale = make(m + 3, k, n, len(sizes), seed=m)
  fp8 = cfg is not None and cfg.act == "mxfp8"
  ref_x = mx.dequantize(*mx.quantize(x, "mxfp8")) if fp8 else x
  gs = jnp.asarray(sizes, jnp.int32)
  ref = reference.ragged_dot(ref_x, packed, scale, gs, preferred_element_type=jnp.float32)
  out = jax.jit(lambda a, p, s, g: triton.ragged_dot(
      a, p, s, g, config=cfg, preferred_element_type=jnp.float32))(x, packed, scale, gs)
  assert rel_err(out, ref) < (F8_TOL if fp8 else F32_TOL), (cfg, rel_err(out, ref))
  np.testing.assert_array_equal(np.asarray(out)[m:], 0.0)


@pytest.mark.parametrize("k, f, m", [(512, 512, 16), (3584, 3072, 16), (3584, 3072, 64)])
def test_triton_gate_up(k, f, m):
  """The fused MXFP4 gate/up kernel (`triton.gate_up`: each row's token gathered, W1 and W3
  dequantized and dotted, SiTU with tanh.approx) against the reference tier (gather, two
  fp32 products, `k3jax.situ`) over 8 experts of SIZES[m] rows (repeated and unused tokens, an
  empty expert) and 5 rows past the groups (zeros); through the API, which must pick it, by
  name and by default."""
  sizes, n = SIZES[m], 12
  x, p1, s1 = make(n, k, f, len(sizes), seed=k + m)
  _, p3, s3 = make(n, k, f, len(sizes), seed=k + m + 1)
  rows = jax.random.randint(jax.random.key(m), (m + 5,), 0, n - 1, jnp.int32)
  gs = jnp.asarray(sizes, jnp.int32)
  for impl in ("triton", None):
    assert plan_gate_up(x, rows, p1, s1, p3, s3, gs, impl=impl).impl == "triton", impl
  fn = jax.jit(mxfp4_gate_up, static_argnames=("beta1", "beta2", "impl"))
  ref = fn(x, rows, p1, s1, p3, s3, gs, beta1=4.0, beta2=2.0, impl="reference")
  out = fn(x, rows, p1, s1, p3, s3, gs, beta1=4.0, beta2=2.0, impl="triton")
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL, rel_err(out, ref)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes):], 0.0)


@pytest.mark.parametrize("config", [None, triton.Config(block_n=128, block_k=256,
                                                          dequant="ptx")])
@pytest.mark.parametrize("n, top_k, g, k, f, d", [(16, 8, 64, 512, 512, 512),
                                                  (4, 16, 32, 3584, 3072, 3584)])
def test_triton_expert_ffn(config, n, top_k, g, k, f, d):
  """The packed experts whole in one kernel (`triton.expert_ffn`: gather, W1 / W3, SiTU with
  tanh.approx, W2 by hidden blocks, then the combine) against the reference tier at
  k3_small's decode shape (16 tokens, top-8 of 64 experts) and K3's expert shapes (top-16 of
  32 experts); the API picks it by name."""
  rng = np.random.default_rng(n + k)
  experts = np.stack([rng.choice(g, top_k, replace=False) for _ in range(n)])
  order = np.argsort(experts.reshape(-1), kind="stable")
  args = [jnp.asarray(rng.uniform(0.1, 1.0, (n, top_k)), jnp.float32),
          jnp.asarray(order, jnp.int32), jnp.asarray(np.argsort(order), jnp.int32)]
  x, p1, s1 = make(n, k, f, g, seed=k)
  _, p3, s3 = make(n, k, f, g, seed=k + 1)
  _, p2, s2 = make(n, f, d, g, seed=k + 2)
  gs = jnp.asarray(np.bincount(experts.reshape(-1), minlength=g), jnp.int32)
  args = (x, *args, p1, s1, p3, s3, p2, s2, gs)
  assert plan_expert_ffn(*args, impl="triton").impl == "triton"
  ref = jax.jit(functools.partial(mxfp4_expert_ffn, beta1=4.0, beta2=2.0, impl="reference"))(
      *args)
  out = jax.jit(functools.partial(triton.expert_ffn, beta1=4.0, beta2=2.0, config=config))(
      *args)
  assert out.dtype == jnp.float32 and rel_err(out, ref) < BF16_TOL, rel_err(out, ref)


@pytest.mark.large_memory
def test_ragged_dot_weights_between_2_and_4_gib():
  """65 experts of N 4096 x K 16384 (2.18 GB packed): the triton tier declines them (Pallas
  Triton's sign-extended 32-bit offsets would wrap past 2 GiB, `tiers.triton_offsets_reason`),
  and the tier the default plan runs instead matches the reference on the rows of the first
  and the last expert, whose bytes start past 2 GiB."""
  g, n, k = 65, 4096, 16384
  kx, kp, ks = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (16, k), jnp.float32).astype(jnp.bfloat16)
  packed = jax.random.bits(kp, (g, n, k // 2), jnp.uint8)
  scale = jax.random.randint(ks, (g, n, k // 32), 118, 127, jnp.int32).astype(jnp.uint8)
  gs = jnp.asarray([8] + [0] * (g - 2) + [8], jnp.int32)
  p = plan_ragged_dot(x, packed, scale, gs)
  assert "w_packed holds" in dict(p.declined)["triton"], p
  out = jax.jit(mxfp4_ragged_dot)(x, packed, scale, gs)
  for rows, e in ((slice(0, 8), 0), (slice(8, 16), g - 1)):
    ref = reference.matmul(x[rows], packed[e], scale[e], preferred_element_type=jnp.float32)
    assert rel_err(out[rows], ref) < BF16_TOL, (p.impl, e)
