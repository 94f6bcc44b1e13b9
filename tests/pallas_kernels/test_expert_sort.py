"""The copies' sort by expert: every tier against numpy's stable argsort and bincount.

The triton tier runs in Pallas's interpreter on CPU and must give the xla tier's outputs
exactly: decoding's 128 copies over 64 experts, one token's copies, E not a power of two,
every copy on one expert, a single expert; calls past its register budget fall through to xla.
It is also lowered for an H200 on CPU (Triton IR built, not compiled); on a GPU it is compiled
and run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import expert_sort
from pallas_kernels.expert_sort import api
from pallas_kernels.expert_sort import triton

ON_GPU = jax.devices()[0].platform == "gpu"


def assert_sorted(got, experts, num_experts):
  order, inverse, sizes = (np.asarray(a) for a in got)
  flat = np.asarray(experts).ravel()
  assert order.dtype == inverse.dtype == sizes.dtype == np.int32
  np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
  np.testing.assert_array_equal(order[inverse], np.arange(flat.size))
  np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=num_experts))


@pytest.mark.parametrize("n,k,e", [(16, 8, 64), (1, 8, 64), (5, 3, 9), (3, 2, 1), (32, 4, 16)])
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_tiers_match_stable_argsort(n, k, e, impl):
  rng = np.random.default_rng(n * 100 + e)
  experts = jnp.asarray(rng.integers(0, e, size=(n, k)), jnp.int32)
  p = expert_sort.plan(experts, e, impl=impl, interpret=True)
  assert p.impl == impl
  assert_sorted(expert_sort.sort_by_expert(experts, e, impl=impl, interpret=True), experts, e)


def test_all_copies_on_one_expert_and_falls_through():
  experts = jnp.full((16, 8), 5, jnp.int32)
  assert_sorted(triton.sort_by_expert(experts, 64, interpret=True), experts, 64)
  big = jnp.zeros((16, 8), jnp.int32)   # 128 copies over 256 experts: a 128 x 256 tile
  p = expert_sort.plan(big, 256, impl="triton", interpret=True)
  assert p.impl == "xla" and "exceed" in p.declined[0][1]
  assert_sorted(expert_sort.sort_by_expert(big, 256, impl="triton", interpret=True), big, 256)
  for flat_size, e in ((240, 9), (320, 9), (240, 300)):   # the xla tier's three key forms
    ex = jnp.asarray(np.random.default_rng(e).integers(0, e, size=(flat_size // 4, 4)),
                     jnp.int32)
    assert_sorted(expert_sort.sort_by_expert(ex, e, impl="xla"), ex, e)


def test_default_is_triton_on_a_gpu(monkeypatch):
  experts = jnp.zeros((2, 2), jnp.int32)
  assert expert_sort.plan(experts, 4).impl == ("triton" if ON_GPU else "xla")
  monkeypatch.setattr(api, "TRITON_IS_DEFAULT", False)
  assert expert_sort.plan(experts, 4).impl == "xla"


@pytest.mark.parametrize("experts,e,match", [
    (jnp.zeros((4,), jnp.int32), 4, "integer \\[N, k\\]"),
    (jnp.zeros((4, 2), jnp.float32), 4, "integer \\[N, k\\]"),
    (jnp.zeros((4, 2), jnp.int32), 0, "num_experts"),
])
def test_bad_arguments(experts, e, match):
  with pytest.raises(ValueError, match=match):
    expert_sort.sort_by_expert(experts, e)


def test_lowers_for_h200():
  """The kernel lowers to Triton IR for an H200 (power-of-two tensors, supported primitives)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda a: triton.sort_by_expert(a, 64)).trace(
        jax.ShapeDtypeStruct((16, 8), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,k,e", [(16, 8, 64), (1, 8, 64), (5, 3, 9), (64, 2, 64)])
def test_compiled_on_gpu(n, k, e):
  """The compiled kernel (interpret=False) against numpy on the same GPU."""
  experts = jax.random.randint(jax.random.key(n + e), (n, k), 0, e, jnp.int32)
  assert expert_sort.plan(experts, e, impl="triton").impl == "triton"
  assert_sorted(jax.jit(lambda a: triton.sort_by_expert(a, e))(experts), experts, e)
