"""Identical kernel calls (one per layer) lower to one kernel, on any host.

XLA builds each distinct Mosaic GPU kernel once, one after another, while it emits the program
(k3_small's train step: ~1 s a kernel). JAX's Mosaic GPU serialisation stamps every lowering
with a fresh name (`mosaic_gpu.dump_basename`), so each op's kernel entry point is a `jax.jit`
function: the calls of every layer share one lowering and one kernel hash (checked lowered for
CUDA). The Pallas Triton kernels' entry points are `jax.jit` functions too (checked in their
interpreter: one lowered function, called once per layer).
"""
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.decode_attention import mosaic_gpu as decode_mgpu
from pallas_kernels.moe_gate_up import triton as gate_up_triton
from pallas_kernels.mxfp4_matmul import mosaic_gpu as mxfp4_mgpu
from pallas_kernels.ragged_dot import api as ragged_api
from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mgpu
from pallas_kernels.top_k import triton as top_k_triton

BF16 = jnp.bfloat16
sd = lambda *shape, dtype=BF16: jax.ShapeDtypeStruct(shape, dtype)


def _kernel_hashes(fn, *args) -> list[str]:
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


def _layers(one, n: int = 3):
  """n calls of `one` on different values, each in its own name scope (as the model's layers)."""
  def fn(x, *rest):
    out = 0
    for i in range(n):
      with jax.named_scope(f"layer_{i}"):
        out = out + one(x * (i + 1), *rest)
    return out
  return fn


@pytest.fixture
def hopper(monkeypatch):
  for mod, sms in ((ragged_mgpu, "_num_sms"), (decode_mgpu, "num_sms"), (mxfp4_mgpu, "num_sms")):
    monkeypatch.setattr(mod, "is_hopper", lambda: True)
    monkeypatch.setattr(mod, sms, lambda interpret: 132)


def test_ragged_dot_forward_and_backward_kernels_are_shared(hopper):
  one = lambda x, w, gs: ragged_api.ragged_dot(x, w, gs, impl="mosaic_gpu")
  args = (sd(1024, 512), sd(8, 512, 256), sd(8, dtype=jnp.int32))
  assert len(set(_kernel_hashes(one, *args))) == 1
  assert len(set(_kernel_hashes(_layers(one), *args))) == 1

  grad = lambda f: jax.grad(lambda x, w, gs: jnp.sum(f(x, w, gs).astype(jnp.float32)),
                            argnums=(0, 1))
  assert len(set(_kernel_hashes(grad(one), *args))) == 2      # d_lhs (gmm), d_rhs (tgmm)
  assert len(set(_kernel_hashes(grad(_layers(one)), *args))) == 2


def test_decode_attention_kernel_is_shared(hopper):
  one = lambda q, c, l, p: decode_mgpu.decode_attention(q, c, l, p, v_dim=256, scale=0.06)
  args = (sd(2, 1, 8, 320), sd(2, 4096, 320), sd(2, dtype=jnp.int32), sd(2, 1, dtype=jnp.int32))
  assert len(set(_kernel_hashes(_layers(one), *args))) == 1


def test_mxfp4_matmul_kernel_is_shared(hopper):
  u8 = jnp.uint8
  one = lambda x, p, s: mxfp4_mgpu.matmul(x, p, s)
  args = (sd(16, 512), sd(256, 256, dtype=u8), sd(256, 16, dtype=u8))
  assert len(set(_kernel_hashes(_layers(one), *args))) == 1


def _one_lowering(fn, name: str, *args) -> None:
  """`name` lowered to one private function called by each of the three layers."""
  text = jax.jit(_layers(fn)).trace(*args).lower().as_text()
  assert len(re.findall(rf"func\.func private @{name}\b", text)) == 1, text[:2000]
  assert len(re.findall(rf"call @{name}\b", text)) == 3


def test_top_k_triton_lowering_is_shared():
  one = lambda x: top_k_triton.top_k(x, 4, interpret=True)[0]
  _one_lowering(one, "top_k", sd(64, 32, dtype=jnp.float32))


def test_gate_up_triton_lowering_is_shared():
  one = lambda x, rows, w1, w3, gs: gate_up_triton.gate_up(x, rows, w1, w3, gs, beta1=1.0,
                                                            beta2=1.0, interpret=True)
  args = (sd(16, 64), sd(32, dtype=jnp.int32), sd(4, 64, 64), sd(4, 64, 64),
          sd(4, dtype=jnp.int32))
  _one_lowering(one, "gate_up", *args)


def test_swapped_gmm_kernel_lowers_and_is_shared(hopper):
  """The "swapped" gmm (decode shapes) lowers for CUDA, its transposed epilogue (inline Mosaic
  GPU, which the interpreter does not run) included, both rhs layouts; one kernel per layout."""
  cfg = ragged_mgpu.swapped_config(128, 512, 1024, 64, BF16, BF16)
  for transpose_rhs, w in ((False, sd(64, 512, 1024)), (True, sd(64, 1024, 512))):
    one = lambda x, w, gs, t=transpose_rhs: ragged_mgpu.gmm(x, w, gs, transpose_rhs=t,
                                                           config=cfg)
    assert len(set(_kernel_hashes(_layers(one), sd(128, 512), w, sd(64, dtype=jnp.int32)))) == 1
