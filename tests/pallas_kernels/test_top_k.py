"""Row-wise top-k (the router's selection, Eq. 13): every tier against `jax.lax.top_k`.

The triton tier runs in Pallas's interpreter on CPU (interpret=True) and must give lax.top_k's
values and indices exactly: random fp32 rows, E not a power of two, the K3 router's E = 896,
N not a multiple of the row block, heavy ties, -inf entries (rows with fewer than k finite
entries), +-0.0, bf16, k = E; the custom JVP's gradient equals lax.top_k's. The kernel is also
lowered for an H200 on CPU (Triton IR built, not compiled); on a GPU it is compiled and run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.top_k import Plan
from pallas_kernels.top_k import plan
from pallas_kernels.top_k import top_k
from pallas_kernels.top_k import triton

ON_GPU = jax.devices()[0].platform == "gpu"


def assert_same(got, x, k):
  """values and indices equal lax.top_k's bit for bit (values compared as raw bits)."""
  want_v, want_i = jax.lax.top_k(x, k)
  got_v, got_i = got
  assert got_v.dtype == x.dtype and got_i.dtype == jnp.int32
  assert got_v.shape == got_i.shape == (x.shape[0], k)
  np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
  bits = lambda v: np.asarray(v).view(f"uint{8 * v.dtype.itemsize}")
  np.testing.assert_array_equal(bits(got_v), bits(want_v))


def kernel(x, k, **kwargs):
  return triton.top_k(x, k, interpret=True, **kwargs)


@pytest.mark.parametrize("n,e,k,block_rows", [
    (300, 64, 8, None),     # default R = 16: 18 full blocks and a partial one
    (300, 64, 9, None),     # k not a power of two (k_pad = 16)
    (45, 7, 3, 8),          # E not a power of two; 5 full blocks and a partial one
    (45, 7, 7, None),       # k = E; one partial block of R = 128
    (21, 896, 16, None),    # the K3 router: R = 1, E_pad = 1024
])
def test_random_rows(n, e, k, block_rows):
  x = jax.random.normal(jax.random.key(n + e + k), (n, e), jnp.float32)
  assert_same(kernel(x, k, block_rows=block_rows), x, k)


def test_ties_inf_and_signed_zeros():
  """Values on 5 levels (many ties), constant rows, -inf entries with fewer than k finite
  entries per row, all -inf rows, +inf, and -0.0 next to +0.0 (-0.0 ranks lower)."""
  n, e, k = 40, 24, 9
  x = np.round(np.asarray(jax.random.normal(jax.random.key(1), (n, e))) * 1.5) / 2
  x[0] = 0.25
  x[1, ::3] = -0.0
  x[1, 1::3] = 0.0
  x[2:10] = np.where(np.arange(e) % 2 == 0, -np.inf, x[2:10])     # 12 finite entries
  x[10:20, 4:] = -np.inf                                            # 4 finite entries
  x[20] = -np.inf
  x[21, 5] = x[21, 17] = np.inf
  x[22:30, ::2] = -np.inf
  x[22:30, 1::2] = -0.0
  x = jnp.asarray(x, jnp.float32)
  assert_same(kernel(x, k, block_rows=16), x, k)


def test_bf16():
  """bf16 scores (ties from rounding are common at 64 columns) stay bf16."""
  x = jax.random.uniform(jax.random.key(2), (70, 64), jnp.float32).astype(jnp.bfloat16)
  assert_same(kernel(x, 9), x, 9)


def test_api_gradient_matches_lax():
  """The custom JVP's gradient (cotangent scattered to the picked columns) equals lax.top_k's,
  with ties and -inf entries; the forward is lax.top_k's too."""
  x = np.round(np.asarray(jax.random.normal(jax.random.key(3), (33, 12))) * 2) / 2
  x[5, 3:] = -np.inf
  x = jnp.asarray(x, jnp.float32)
  w = jax.random.normal(jax.random.key(4), (33, 5), jnp.float32)

  def loss(fn):
    def f(a):
      values = fn(a)[0]
      return jnp.sum(jnp.where(jnp.isfinite(values), values, 0.0) * w)
    return jax.jit(jax.value_and_grad(f))

  got = loss(lambda a: top_k(a, 5, impl="triton", interpret=True))
  want = loss(lambda a: jax.lax.top_k(a, 5))
  (got_l, got_g), (want_l, want_g) = got(x), want(x)
  np.testing.assert_array_equal(np.asarray(got_g), np.asarray(want_g))
  np.testing.assert_array_equal(np.asarray(got_l), np.asarray(want_l))
  assert np.count_nonzero(np.asarray(got_g)) > 33 * 3
  assert_same(top_k(x, 5, impl="triton", interpret=True), x, 5)


def test_dispatch():
  x = jax.ShapeDtypeStruct((16384, 64), jnp.float32)
  assert plan(x, 8).impl == ("triton" if ON_GPU else "xla")
  assert plan(x, 8, impl="xla") == Plan("xla", (), False)
  assert plan(x, 8, impl="triton", interpret=True).impl == "triton"
  if not ON_GPU:
    p = plan(x, 8, impl="triton")
    assert p.impl == "xla" and "needs a GPU" in dict(p.declined)["triton"]
  wide = plan(jax.ShapeDtypeStruct((8, 2048), jnp.float32), 8, impl="triton", interpret=True)
  assert wide.impl == "xla" and "E = 2048 > 1024" in dict(wide.declined)["triton"]
  f64 = plan(jax.ShapeDtypeStruct((8, 64), jnp.float64), 8, impl="triton", interpret=True)
  assert f64.impl == "xla" and "float64" in dict(f64.declined)["triton"]
  empty = jnp.zeros((0, 64), jnp.float32)
  assert plan(empty, 8, impl="triton", interpret=True).impl == "xla"
  assert top_k(empty, 8, impl="triton", interpret=True)[1].shape == (0, 8)
  # the kernel tier's own gate, for calls the API would reject first
  sds = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt)
  assert "[N, E]" in triton.supports(sds(64), 8, interpret=True)
  assert "k = 65" in triton.supports(sds(4, 64), 65, interpret=True)
  assert "int32" in triton.supports(sds(4, 64, dt=jnp.int32), 8, interpret=True)
  assert triton.supports(sds(4, 1024), 1024, interpret=True) is None
  # 2^21 rows of 512 fp32 logits (4 GiB): Pallas Triton's 32-bit offsets would wrap
  assert "x holds" in triton.supports(sds(2 ** 21, 512), 8)


@pytest.mark.parametrize("x,k,match", [
    (jnp.zeros((64,)), 8, "x must be 2-D"),
    (jnp.zeros((2, 4, 64)), 8, "x must be 2-D"),
    (jnp.zeros((4, 64), jnp.int32), 8, "x must be a floating array"),
    (jnp.zeros((4, 64)), 0, r"k must be an int in \[1, E\] = \[1, 64\]"),
    (jnp.zeros((4, 64)), 65, r"k must be an int in \[1, E\]"),
    (jnp.zeros((4, 64)), 2.0, r"k must be an int"),
    (jnp.zeros((4, 64)), True, r"k must be an int"),
])
def test_bad_arguments(x, k, match):
  with pytest.raises(ValueError, match=match):
    top_k(x, k)


def test_bad_impl_and_tier_options():
  x = jnp.zeros((4, 64))
  with pytest.raises(ValueError, match=r"impl must be None or one of \('xla', 'triton'\)"):
    top_k(x, 8, impl="mosaic_gpu")
  with pytest.raises(ValueError, match="block_rows must be a power of two"):
    kernel(x, 8, block_rows=48)
  with pytest.raises(ValueError, match="the triton tier does not take this call"):
    kernel(jnp.zeros((4, 2048)), 8)


@pytest.mark.parametrize("n,e,k", [(16384, 64, 8), (16384, 896, 17)])
def test_lowers_for_h200(n, e, k):
  """The kernel lowers to Triton IR for an H200 (power-of-two tensors, supported primitives)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda a: triton.top_k(a, k)).trace(
        jax.ShapeDtypeStruct((n, e), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,e,k,dtype,ties", [
    (16384, 64, 8, jnp.float32, False),
    (16384, 64, 9, jnp.float32, True),
    (16384, 64, 8, jnp.bfloat16, False),
    (16384, 896, 16, jnp.float32, False),
    (16384, 896, 17, jnp.float32, True),
    (1000, 7, 3, jnp.float32, True),
])
def test_compiled_on_gpu(n, e, k, dtype, ties):
  """The compiled kernel (interpret=False) against lax.top_k on the same GPU; the ties cases
  round to 8 levels and set some entries to -inf."""
  x = jax.random.uniform(jax.random.key(e + k), (n, e), jnp.float32)
  if ties:
    x = jnp.where(x < 0.1, -jnp.inf, jnp.round(x * 8))
  x = x.astype(dtype)
  assert plan(x, k).impl == "triton"
  assert_same(jax.jit(lambda a: top_k(a, k))(x), x, k)
