"""The Mosaic GPU access patterns that the KDA intra-VJP kernel's one code path relies on.

Two warpgroups run the same code; each takes the 32-column slabs wg, wg + 2 of a [64, 128]
tile (slab index traced from the warpgroup index) and its own rows of stacked scratch. Each
pattern is checked against numpy: loads and GMEM stores at traced columns, tensor-core products
with traced operands (plain, transposed, stacked), and column-layout loads. Reductions over rows
(axis 0) are absent on purpose: with both warpgroups reducing at once, warpgroup 0's sums came
out wrong on the H200 (JAX 0.11.2: `_reduce_lowering_rule` in jax/_src/pallas/mosaic_gpu/
lowering.py takes the module's one `scratch_view` for a cross-warp reduction of a tiled layout,
with no guard against several Pallas threads; it refuses them for the strided layout), which is
why the kernel forms its column sums on the tensor cores.

On CPU the kernel runs in the Mosaic GPU interpreter and is lowered for CUDA; with
K3JAX_KDA_TEST_ON_DEVICE=1 it runs compiled on the GPU.
"""
import os

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import mosaic_gpu as fwd

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
C, K, W = 64, 128, 32
F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("load", "bf16 store", "A @ B[:, slab]", "A^T @ B[:, slab]", "A @ stacked[wg]",
         "column-layout row", "A^T @ stacked[wg, 1, bottom]", "A @ stacked[wg, 1, top]",
         "stacked[wg] @ B[:, slab]")

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def _body(x_ref, g_ref, m_ref, *refs):
  outs, (x_s, g_s, m_s, st, st2, st3, bar, sync) = refs[:len(NAMES)], refs[len(NAMES):]
  wg = lax.axis_index("wg")

  @pl.when(wg == 0)
  def _():
    for src, dst in ((x_ref, x_s), (g_ref, g_s), (m_ref, m_s)):
      plgpu.copy_gmem_to_smem(src, dst, bar)
  plgpu.barrier_wait(bar)
  half, bottom, top = (C, W), pl.ds(W, W), pl.ds(0, W)

  def mm(a, b):
    def scoped(acc):
      plgpu.wgmma(acc, a, b)
      return acc[...]
    return pl.run_scoped(scoped, plgpu.ACC(half, F32))

  for i in range(K // W // 2):
    cols = pl.ds(pl.multiple_of((wg + 2 * i) * W, W), W)
    x = fwd._load(x_s.at[:, cols]).astype(F32)
    mine, mine2, mine3 = st.at[wg], st2.at[wg], st3.at[wg]
    mine[...] = (3.0 * x).astype(BF16)
    mine2.at[1][...] = (5.0 * x).astype(BF16)
    mine3[...] = fwd._load(m_s)
    plgpu.commit_smem()
    values = (x, (2.0 * x).astype(BF16), mm(m_s, x_s.at[:, cols]), mm(m_s.T, x_s.at[:, cols]),
              mm(m_s, mine),
              fwd._cols(fwd._load(g_s.at[15, cols], fwd._COL), half) + fwd._load(g_s.at[:, cols]),
              mm(m_s.at[bottom].T, mine2.at[1, bottom]), mm(m_s.at[:, top], mine2.at[1, top]),
              mm(mine3, x_s.at[:, cols]))
    for out, value in zip(outs, values):
      out.at[:, cols][...] = value
  plgpu.commit_smem()
  plgpu.barrier_arrive(sync)
  plgpu.barrier_wait(sync)


def _call(interpret):
  sds = lambda d=F32: jax.ShapeDtypeStruct((C, K), d)
  op = fwd._operand
  return plgpu.kernel(
      _body, out_type=tuple(sds(BF16) if n == "bf16 store" else sds() for n in NAMES),
      scratch_types=[op((C, K)), plgpu.SMEM((C, K), F32), op((C, C)), op((2, C, W)),
                     op((2, 2, C, W)), op((2, C, C)), plgpu.Barrier(num_arrivals=3),
                     plgpu.Barrier(num_arrivals=2)],
      grid=(1,), grid_names=("n",), num_threads=2, thread_name="wg",
      interpret=interpret, compiler_params=fwd._PARAMS)


def _inputs():
  rng = np.random.default_rng(0)
  x, g, m = (rng.standard_normal(s).astype(np.float32) for s in ((C, K), (C, K), (C, C)))
  return jnp.asarray(x, BF16), jnp.asarray(g), jnp.asarray(m, BF16)


def test_warpgroup_indexed_patterns_match_numpy():
  xb, g, mb = _inputs()
  x, m, g = (np.asarray(a, np.float32) for a in (xb, mb, g))
  interpret = False if ON_DEVICE else plgpu.InterpretGPUParams()
  outs = jax.jit(_call(interpret))(xb, g, mb)
  slabs = lambda f: np.concatenate([f(x[:, s * W:(s + 1) * W]) for s in range(K // W)], 1)
  want = (x, 2 * x, m @ x, m.T @ x, m @ (3 * x), g[15][None, :] + g,
          slabs(lambda xs: m[W:].T @ (5 * xs[W:])), slabs(lambda xs: m[:, :W] @ (5 * xs[:W])),
          m @ x)
  for name, got, w in zip(NAMES, outs, want):
    got = np.asarray(got, np.float32)
    # bf16 operands from fp32 products (3x, 5x) round once: <= 2^-8 of the largest entry.
    np.testing.assert_allclose(got, w, atol=4e-3 * np.abs(w).max(), rtol=0, err_msg=name)


def test_lowers_for_hopper():
  xb, g, mb = _inputs()
  text = jax.jit(_call(False)).trace(xb, g, mb).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
