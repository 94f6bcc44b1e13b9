"""The Mosaic GPU prebuild on a Hopper GPU (skipped elsewhere): every one-call program compiles,
and the step compiled alongside them computes what the plain compile's step does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_gpu_prebuild as prebuild
from pallas_kernels.ragged_dot import api as ragged_api
from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mgpu

pytestmark = pytest.mark.skipif(not ragged_mgpu.is_hopper(), reason="needs an NVIDIA Hopper GPU")


def test_prebuilt_step_equals_the_plain_step():
  def loss(x, w, gs):
    return sum(jnp.sum(ragged_api.ragged_dot(x * (i + 1), w, gs, impl="mosaic_gpu")
                       .astype(jnp.float32) ** 2) for i in range(3))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (1024, 512), jnp.bfloat16)
  w = jax.random.normal(kw, (8, 512, 256), jnp.bfloat16) / 16
  gs = jnp.array([200, 0, 56, 256, 128, 64, 192, 128], jnp.int32)

  lowered = step.trace(x, w, gs).lower()
  assert len(prebuild.kernels_of(lowered)) == 3  # forward gmm, d_lhs gmm, d_rhs tgmm
  compiled, report = prebuild.compile(lowered)
  assert report is not None and report.failed == () and report.built == 3, report
  # A fresh jit lowers afresh (other kernel names and hashes): XLA builds its kernels itself.
  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, gs)
  for got, ref in zip(jax.tree.leaves(compiled(x, w, gs)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
