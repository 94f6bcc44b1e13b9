"""x [M, K] @ w [K, N] for few rows: the triton tier (in Pallas's interpreter on CPU, compiled on
a GPU) and the xla tier against an fp64 numpy product; declines, argument errors, the lowering
for an H200 (one Triton kernel per config)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_matmul
from pallas_kernels.decode_matmul import triton

ON_GPU = triton.is_gpu()
SHAPES = [(16, 256, 128), (5, 512, 72), (1, 128, 200)]   # N 72 and 200: a partial block


def case(m, k, n, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (0.05 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
  return x, w, np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def rel(got, want):
  return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("name", list(triton.CONFIGS))
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_triton_tier_matches_fp64(name, m, k, n):
  """Every config, N a multiple of block_n or not: fp32 out to summation order, bf16 out to
  its rounding."""
  cfg = triton.CONFIGS[name]
  x, w, want = case(m, k, n, seed=m + k)
  p = decode_matmul.plan(x, w, impl="triton", interpret=not ON_GPU, config=cfg)
  assert p.impl == "triton", p.declined
  run = lambda dtype: jax.jit(lambda a, b: decode_matmul.matmul(
      a, b, impl="triton", interpret=not ON_GPU, config=cfg,
      preferred_element_type=dtype))(x, w)
  out = run(jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.float32 and rel(out, want) < 1e-6
  out = run(None)
  assert out.dtype == jnp.bfloat16 and rel(out, want) < 1e-2


def test_xla_tier_and_default():
  """impl=None is xla off the GPU (triton on one): `jnp.dot`'s result either way."""
  x, w, want = case(3, 64, 32)
  assert decode_matmul.plan(x, w).impl == ("triton" if ON_GPU else "xla")
  for impl in ("xla", None):
    out = decode_matmul.matmul(x, w, impl=impl, preferred_element_type=jnp.float32)
    assert rel(out, want) < 1e-6
  np.testing.assert_array_equal(decode_matmul.matmul(x, w, impl="xla"),
                                jnp.dot(x, w, preferred_element_type=jnp.float32
                                        ).astype(jnp.bfloat16))


def h200_mesh():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="cuda")
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


@pytest.mark.parametrize("k, n, impl, reason", [
    (1024, 4232, "triton", None),         # k3_small's KDA input product
    (1536, 1024, "triton", None),         # its MoE W_out
    (96, 64, "triton", None),             # block_k fitted to K: 32
    (1024, 163840, "xla", None),          # the LM head: above TRITON_DEFAULT_MAX_BYTES
    (40, 64, "xla", "K=40 must be a multiple of block_k=16"),
])
def test_default_on_a_gpu(k, n, impl, reason):
  """impl=None on an H200 (abstract): the kernel with its default config fitted to K, XLA for
  weights above the size where XLA's GEMM runs at the copy rate."""
  x, w = jax.ShapeDtypeStruct((16, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(h200_mesh()):
    p = decode_matmul.plan(x, w)
  assert p.impl == impl and (reason is None) == (not p.declined), p.declined
  if reason:
    assert reason in p.declined[0][1]


@pytest.mark.parametrize("shape, dtype, cfg, reason", [
    ((17, 64, 32), jnp.bfloat16, None, "M=17: the kernel takes 1 to 16 rows"),
    ((4, 64, 32), jnp.float32, None, "needs bfloat16 x and w"),
    ((4, 96, 32), jnp.bfloat16, triton.Config(), "K=96 must be a multiple of block_k=64"),
    ((4, 128, 32), jnp.bfloat16, triton.Config(split_k=4), "split_k=4 divides"),
    ((4, 64, 32), jnp.bfloat16, triton.Config(block_n=24), "block_n=24 must be a power of two"),
])
def test_triton_declines_and_falls_through(shape, dtype, cfg, reason):
  m, k, n = shape
  x, w = jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype)
  p = decode_matmul.plan(x, w, impl="triton", interpret=True, config=cfg)
  assert p.impl == "xla" and reason in p.declined[0][1], p.declined
  assert decode_matmul.matmul(x, w, impl="triton", interpret=True, config=cfg).shape == (m, n)


@pytest.mark.skipif(ON_GPU, reason="off the GPU only: the kernel needs interpret=True there")
def test_declines_without_a_gpu():
  x, w = jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.bfloat16)
  p = decode_matmul.plan(x, w, impl="triton")
  assert p.impl == "xla" and "needs an NVIDIA GPU" in p.declined[0][1]


@pytest.mark.parametrize("args, kw, match", [
    ((jnp.zeros((4,)), jnp.zeros((4, 2))), {}, r"x must be \[M, K\] and w \[K, N\]"),
    ((jnp.zeros((4, 3)), jnp.zeros((4, 2))), {}, r"x's K \(3\) must equal w's K \(4\)"),
    ((jnp.zeros((4, 4), jnp.int32), jnp.zeros((4, 2))), {}, "x must be floating"),
    ((jnp.zeros((4, 4)), jnp.zeros((4, 2))), dict(impl="cublas"), "impl must be"),
    ((jnp.zeros((4, 4)), jnp.zeros((4, 2))), dict(preferred_element_type=jnp.int32),
     "preferred_element_type must be floating"),
])
def test_bad_arguments(args, kw, match):
  with pytest.raises(ValueError, match=match):
    decode_matmul.matmul(*args, **kw)


def test_lowers_for_h200():
  """Each config lowers to one Triton kernel for an H200 at k3_small's KDA input product
  (M 16, K 1024, N 4232: a partial last column block)."""
  mesh = h200_mesh()
  x = jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024, 4232), jnp.bfloat16)
  for cfg in triton.CONFIGS.values():
    with jax.sharding.use_abstract_mesh(mesh):
      text = jax.jit(lambda a, b, cfg=cfg: triton.matmul(a, b, config=cfg)).trace(
          x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, cfg
