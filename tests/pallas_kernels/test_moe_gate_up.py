"""The MoE's fused gather + grouped [W1 | W3] matmul + SiTU (`pallas_kernels.moe_gate_up`).

The triton tier runs in Pallas's interpreter on CPU against an fp64 oracle (gather, per-group
matmuls, SiTU in numpy), with empty and one-row groups, uneven sizes, rows past
sum(group_sizes), repeated and unsorted token indices, F and K below the default tiles, bf16 and
f16, and SiTU's partial derivatives (return_situ_grads) against central differences. It is
also lowered for an H200 on CPU (Triton IR built, not compiled); on a Hopper GPU it is
compiled and run (tanh.approx in the epilogue) at the k3_small expert shape.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_gate_up
from pallas_kernels.moe_gate_up import triton
from pallas_kernels.moe_gate_up import xla

B1, B2 = 4.0, 25.0
ON_HOPPER = triton.is_hopper()


def situ64(gate, up):
  """SiTU in fp64 numpy (k3jax.situ.situ)."""
  return B1 * np.tanh(gate / B1) / (1 + np.exp(-gate)) * B2 * np.tanh(up / B2)


def oracle(x, rows, w1, w3, sizes):
  """fp64 numpy: h and gate_up for each row of its group; rows past the groups give zeros."""
  x, w1, w3 = (np.asarray(a, np.float64) for a in (x, w1, w3))
  rows = np.asarray(rows)
  m, f = rows.shape[0], w1.shape[2]
  gu = np.zeros((m, 2 * f))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    end = min(start + int(size), m)
    a = x[rows[start:end]]
    gu[start:end] = np.concatenate([a @ w1[g], a @ w3[g]], axis=1)
    start = end
  return situ64(gu[:, :f], gu[:, f:]), gu


def partials_oracle(gu):
  """fp64 [dh/d gate | dh/d up] of h = SiTU(gate, up) by central differences (step 1e-6)."""
  f = gu.shape[1] // 2
  gate, up = gu[:, :f], gu[:, f:]
  eps = 1e-6
  return np.concatenate([(situ64(gate + eps, up) - situ64(gate - eps, up)) / (2 * eps),
                         (situ64(gate, up + eps) - situ64(gate, up - eps)) / (2 * eps)], axis=1)


def make(n, k, f, sizes, m=None, dtype=jnp.bfloat16, seed=0):
  kx, k1, k3, kr = jax.random.split(jax.random.key(seed), 4)
  m = int(sum(sizes)) if m is None else m
  x = jax.random.normal(kx, (n, k), jnp.float32).astype(dtype)
  w1 = (jax.random.normal(k1, (len(sizes), k, f), jnp.float32) / np.sqrt(k)).astype(dtype)
  w3 = (jax.random.normal(k3, (len(sizes), k, f), jnp.float32) * 4 / np.sqrt(k)).astype(dtype)
  rows = jax.random.randint(kr, (m,), 0, n, jnp.int32)
  return x, rows, w1, w3, jnp.asarray(sizes, jnp.int32)


def rel_err(x, ref) -> float:
  x = np.asarray(x, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check(out, ref, tol):
  h, gu = out
  h_ref, gu_ref = ref
  assert rel_err(h, h_ref) < tol and rel_err(gu, gu_ref) < tol


CASES = [
    # n, k, f, group sizes, m (rows; None = their sum), config
    (40, 64, 64, (0, 1, 17, 0, 30, 2), None, None),            # empty and one-row groups
    (40, 64, 64, (5, 0, 19, 3), 40, None),                      # 13 rows past the groups
    (33, 48, 48, (7, 26), None, None),                          # K, F below 64: 16-wide tiles
    (50, 128, 128, (70, 1, 29), None, triton.Config(block_m=32, block_n=32, block_k=32)),
    (50, 64, 64, (3, 61, 0, 36), 110, triton.Config(block_m=16, block_n=64, block_k=16)),
]


@pytest.mark.parametrize("n,k,f,sizes,m,config", CASES)
def test_interpret_matches_fp64(n, k, f, sizes, m, config):
  """h alone, and h with [dh/d gate | dh/d up] (return_situ_grads) against the fp64 oracle and
  central differences of SiTU on its products; the kernel in the interpreter and the xla tier.
  """
  x, rows, w1, w3, gs = make(n, k, f, sizes, m)
  h_ref, gu = oracle(x, rows, w1, w3, gs)
  ref = (h_ref, partials_oracle(gu))
  kw = dict(beta1=B1, beta2=B2, impl="triton", interpret=True, config=config)
  h = moe_gate_up.gate_up(x, rows, w1, w3, gs, **kw)
  assert h.dtype == x.dtype and h.shape == (rows.shape[0], f)
  assert rel_err(h, h_ref) < 1e-2
  out = moe_gate_up.gate_up(x, rows, w1, w3, gs, return_situ_grads=True, **kw)
  assert out[1].dtype == x.dtype and out[1].shape == (rows.shape[0], 2 * f)
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(h))
  check(out, ref, 1e-2)
  past = int(np.sum(sizes))
  assert not np.asarray(h[past:]).any() and not np.asarray(out[1][past:]).any()
  check(xla.gate_up(x, rows, w1, w3, gs, beta1=B1, beta2=B2, return_situ_grads=True), ref, 1e-2)


def test_float16():
  x, rows, w1, w3, gs = make(40, 64, 64, (0, 1, 17, 0, 30, 2), dtype=jnp.float16)
  h = moe_gate_up.gate_up(x, rows, w1, w3, gs, beta1=B1, beta2=B2, impl="triton",
                          interpret=True)
  assert h.dtype == jnp.float16
  assert rel_err(h, oracle(x, rows, w1, w3, gs)[0]) < 5e-3


def test_plan_and_fallback():
  x, rows, w1, w3, gs = make(20, 64, 64, (4, 16))
  assert moe_gate_up.plan(x, rows, w1, w3, gs, impl="triton", interpret=True).impl == "triton"
  p = moe_gate_up.plan(x, rows, w1, w3, gs, impl="triton")
  if not ON_HOPPER and jax.devices()[0].platform != "gpu":
    assert p.impl == "xla" and "needs a GPU" in p.declined[0][1]
  f32 = [a.astype(jnp.float32) for a in (x, w1, w3)]
  p = moe_gate_up.plan(f32[0], rows, f32[1], f32[2], gs, impl="triton", interpret=True)
  assert p.impl == "xla" and "bfloat16" in p.declined[0][1]
  x8, rows8, w18, w38, gs8 = make(20, 40, 64, (4, 16))
  p = moe_gate_up.plan(x8, rows8, w18, w38, gs8, impl="triton", interpret=True)
  assert p.impl == "xla" and "K=40" in p.declined[0][1]
  h = moe_gate_up.gate_up(x8, rows8, w18, w38, gs8, beta1=B1, beta2=B2, impl="triton",
                          interpret=True)           # falls through to xla
  assert rel_err(h, oracle(x8, rows8, w18, w38, gs8)[0]) < 1e-2
  bad = triton.Config(block_m=24)
  p = moe_gate_up.plan(x, rows, w1, w3, gs, impl="triton", interpret=True, config=bad)
  assert p.impl == "xla" and "power of two" in p.declined[0][1]
  # 384 experts of 1024 x 4096 bf16 (3 GiB): Pallas Triton's 32-bit offsets would wrap
  sds = jax.ShapeDtypeStruct
  big = sds((384, 1024, 4096), jnp.bfloat16)
  p = moe_gate_up.plan(sds((20, 1024), jnp.bfloat16), rows, big, big, sds((384,), jnp.int32),
                       impl="triton")
  assert p.impl == "xla" and "w1 holds" in p.declined[0][1]
  # 160,000 rows of F 4096: SiTU's partials [M, 2F] (2.6 GB) would wrap, the weights do not
  w = sds((8, 1024, 4096), jnp.bfloat16)
  p = moe_gate_up.plan(sds((20, 1024), jnp.bfloat16), sds((160_000,), jnp.int32), w, w,
                       sds((8,), jnp.int32), impl="triton")
  assert p.impl == "xla" and "partials holds" in p.declined[0][1]


def test_bad_arguments_raise():
  x, rows, w1, w3, gs = make(20, 64, 64, (4, 16))
  kw = dict(beta1=B1, beta2=B2)
  with pytest.raises(ValueError, match="impl must be"):
    moe_gate_up.gate_up(x, rows, w1, w3, gs, impl="cuda", **kw)
  with pytest.raises(ValueError, match="w1 and w3"):
    moe_gate_up.gate_up(x, rows, w1, w3[:, :32], gs, **kw)
  with pytest.raises(ValueError, match="rows must be an integer"):
    moe_gate_up.gate_up(x, rows.astype(jnp.float32), w1, w3, gs, **kw)
  with pytest.raises(ValueError, match="group_sizes"):
    moe_gate_up.gate_up(x, rows, w1, w3, gs[:1], **kw)
  with pytest.raises(ValueError, match="does not take"):
    triton.gate_up(x.astype(jnp.float32), rows, w1, w3, gs, interpret=True, **kw)


@pytest.mark.parametrize("situ_grads", [False, True])
def test_lowers_for_h200(situ_grads):
  """The kernel lowers to Triton IR for an H200 at the k3_small shape (tanh.approx included)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  s = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda *a: triton.gate_up(
        *a, beta1=B1, beta2=B2, return_situ_grads=situ_grads)).trace(
            s((16384, 512), bf16), s((131072,), jnp.int32), s((64, 512, 512), bf16),
            s((64, 512, 512), bf16), s((64,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
@pytest.mark.parametrize("n,k,f,sizes,m", [
    (2900, 512, 512, (0, 1, 517, 1000, 3, 0, 1290, 61), 2900),   # 28 rows past the groups
    pytest.param(16384, 512, 512, None, 131072,                   # k3_small: 64 experts
                 marks=pytest.mark.large_memory),
    (4096, 3584, 3072, (900, 0, 1, 3195), None),                  # K3's expert shape
])
def test_compiled_on_hopper(n, k, f, sizes, m):
  if sizes is None:
    sizes = tuple(np.bincount(np.random.default_rng(0).integers(0, 64, m), minlength=64))
  x, rows, w1, w3, gs = make(n, k, f, sizes, m)
  assert moe_gate_up.plan(x, rows, w1, w3, gs).impl == "triton"
  h = jax.jit(lambda *a: moe_gate_up.gate_up(*a, beta1=B1, beta2=B2))(x, rows, w1, w3, gs)
  assert rel_err(h, oracle(x, rows, w1, w3, gs)[0]) < 1e-2
  past = int(np.sum(sizes))
  assert not np.asarray(h[past:]).any()
  kw = dict(beta1=B1, beta2=B2, return_situ_grads=True)
  out = jax.jit(lambda *a: moe_gate_up.gate_up(*a, **kw))(x, rows, w1, w3, gs)
  ref = jax.jit(lambda *a: xla.gate_up(*a, **kw))(
      *[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in (x, rows, w1, w3, gs)])
  check(out, tuple(np.asarray(r, np.float64) for r in ref), 1e-2)
