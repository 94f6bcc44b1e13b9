"""Grouped matmul Mosaic GPU kernels on a Hopper GPU (skipped elsewhere) against fp32 per group.

Both kernel families ("ws": ours, "jax": JAX's ragged_dot_mgpu / transposed_ragged_dot_mgpu)
for the forward, d_lhs and d_rhs products, with empty and one-row groups, group starts off
the 8-row alignment and rows past sum(group_sizes); then the K3 expert shapes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_dot import mosaic_gpu
from pallas_kernels.ragged_dot import plan
from pallas_kernels.ragged_dot import ragged_dot

pytestmark = pytest.mark.skipif(not mosaic_gpu.is_hopper(), reason="needs an NVIDIA Hopper GPU")

BF16_TOL = 1e-2   # relative L2 error of bf16 outputs (fp32 accumulation): ~3e-3 expected
SIZES = (0, 1, 517, 1000, 3, 0, 1290, 61)     # sum 2872 of M = 2900: 28 padding rows
M, K, N = 2900, 512, 1024


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def make(m, k, n, sizes, seed=0):
  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
  return x, w, ct, jnp.asarray(sizes, jnp.int32)


def reference(x, w, ct, sizes):
  """out, d_lhs, d_rhs as a loop over groups with static row ranges (bf16 products, fp32
  sums); rows past sum(sizes) give zeros. Not XLA's ragged_dot: it expands to dense
  [G, M, N] products, ~30 GiB at the K3 shapes."""
  dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
  ends = np.cumsum(sizes)
  spans = [(e - s, e) for s, e in zip(sizes, ends)]
  pad = jnp.zeros((x.shape[0] - ends[-1], w.shape[2]), jnp.float32)
  out = jnp.concatenate([dot(x[s:e], w[g]) for g, (s, e) in enumerate(spans)] + [pad])
  d_lhs = jnp.concatenate([dot(ct[s:e], w[g].T) for g, (s, e) in enumerate(spans)]
                          + [jnp.zeros((pad.shape[0], x.shape[1]), jnp.float32)])
  d_rhs = jnp.stack([dot(x[s:e].T, ct[s:e]) for s, e in spans])
  return out, d_lhs, d_rhs


@pytest.fixture(scope="module")
def data():
  x, w, ct, gs = make(M, K, N, SIZES)
  return (x, w, ct, gs), jax.jit(reference, static_argnums=3)(x, w, ct, SIZES)


GMM_CONFIGS = [
    mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=3),
    mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, cluster_n=2),
    mosaic_gpu.GmmConfig(block_m=64, block_n=128, max_concurrent_steps=4, grid_minor_dim=1,
                         grid_tile_width=4),
    mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=4, kernel="jax"),
    mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=4, tile_pipeline=True,
                         epilogue_rows=64),
    mosaic_gpu.GmmConfig(block_m=64, block_n=128, max_concurrent_steps=2, grid_minor_dim=1,
                         grid_tile_width=4, tile_pipeline=True),
    mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, grid_minor_dim=1,
                         grid_tile_width=4, tile_pipeline=True),
]
TGMM_CONFIGS = [
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, cluster_n=2),
    mosaic_gpu.TgmmConfig(block_m=64, block_n=128, max_concurrent_steps=4, grid_minor_dim=0,
                          grid_tile_width=4),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=4, kernel="jax"),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, group_rows=True),
    mosaic_gpu.TgmmConfig(block_m=64, block_n=128, max_concurrent_steps=4, group_rows=True,
                          cluster_n=2),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, tile_pipeline=True),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, tile_pipeline=True,
                          boundary_blocks=True),
    mosaic_gpu.TgmmConfig(block_m=128, block_n=128, max_concurrent_steps=3, tile_pipeline=True,
                          group_rows=True, boundary_blocks=True, balance=True),
    mosaic_gpu.TgmmConfig(block_m=64, block_n=128, max_concurrent_steps=4, grid_minor_dim=0,
                          grid_tile_width=4, group_rows=True, tile_pipeline=True),
]


@pytest.mark.parametrize("cfg", GMM_CONFIGS, ids=str)
def test_gmm_forward_and_d_lhs(data, cfg):
  (x, w, ct, gs), (out_ref, dx_ref, _) = data
  out = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, config=cfg))(x, w, gs)
  dx = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True, config=cfg))(
      ct, w, gs)
  assert rel_err(out, out_ref) < BF16_TOL
  assert rel_err(dx, dx_ref) < BF16_TOL
  pad = slice(sum(SIZES), M)
  assert not np.any(np.asarray(out[pad], np.float32))
  assert not np.any(np.asarray(dx[pad], np.float32))


@pytest.mark.parametrize("cfg", TGMM_CONFIGS, ids=str)
def test_tgmm_d_rhs(data, cfg):
  (x, _, ct, gs), (_, _, dw_ref) = data
  dw = jax.jit(lambda a, b, c: mosaic_gpu.tgmm(a, b, c, config=cfg))(x, ct, gs)
  assert max(rel_err(dw[g], dw_ref[g]) for g in range(len(SIZES)) if SIZES[g]) < BF16_TOL
  assert not np.any(np.asarray(dw[jnp.asarray([0, 5])], np.float32)), "empty groups"


def test_fp32_output(data):
  (x, w, _, gs), (out_ref, _, _) = data
  out = jax.jit(lambda a, b, c: ragged_dot(a, b, c, preferred_element_type=jnp.float32))(
      x, w, gs)
  assert out.dtype == jnp.float32 and rel_err(out, out_ref) < 1e-5


def test_api_vjp(data):
  (x, w, ct, gs), refs = data
  assert plan(x, w, gs).forward == "mosaic_gpu"

  @jax.jit
  def fwd_bwd(a, b, c):
    out, vjp = jax.vjp(lambda u, v: ragged_dot(u, v, gs), a, b)
    return (out, *vjp(c))

  for got, want in zip(fwd_bwd(x, w, ct), refs):
    assert rel_err(got, want) < BF16_TOL


@pytest.mark.parametrize("g, m, k, n", [(32, 32768, 3584, 3072), (32, 32768, 3072, 3584),
                                        (8, 16384, 3584, 6144)])
def test_k3_expert_shapes(g, m, k, n):
  rng = np.random.default_rng(g + k)
  sizes = rng.multinomial(m, rng.dirichlet(np.ones(g)))
  x, w, ct, gs = make(m, k, n, tuple(int(s) for s in sizes), seed=1)
  p = plan(x, w, gs)
  assert (p.forward, p.d_lhs, p.d_rhs) == ("mosaic_gpu",) * 3, p.declined

  @jax.jit
  def fwd_bwd(a, b, c):
    out, vjp = jax.vjp(lambda u, v: ragged_dot(u, v, gs), a, b)
    return (out, *vjp(c))

  refs = jax.jit(reference, static_argnums=3)(x, w, ct, tuple(int(s) for s in sizes))
  for name, got, want in zip(("out", "d_lhs", "d_rhs"), fwd_bwd(x, w, ct), refs):
    assert rel_err(got, want) < BF16_TOL, name


def routed_sizes(batch: int, top_k: int, groups: int, seed: int) -> tuple[int, ...]:
  rng = np.random.default_rng(seed)
  picks = np.concatenate([rng.choice(groups, top_k, replace=False) for _ in range(batch)])
  return tuple(int(s) for s in np.bincount(picks, minlength=groups))


@pytest.mark.parametrize("g, k, n, batch, top_k", [
    (64, 512, 1024, 1, 8), (64, 512, 1024, 16, 8), (64, 512, 512, 16, 8),   # k3_small
    (16, 3584, 6144, 1, 16), (256, 3072, 3584, 16, 16)])                    # K3
def test_swapped_kernel_at_decode_shapes(g, k, n, batch, top_k):
  """The "swapped" gmm (forward and d_lhs layouts) at decoding shapes against the loop over
  groups; its transposed epilogue runs only here (the interpreter transposes with jnp)."""
  sizes = routed_sizes(batch, top_k, g, seed=k + batch)
  m = batch * top_k
  x, w, ct, gs = make(m, k, n, sizes, seed=2)
  cfg = mosaic_gpu.swapped_config(m, k, n, g, jnp.bfloat16, jnp.bfloat16)
  out_ref, dx_ref, _ = jax.jit(reference, static_argnums=3)(x, w, ct, sizes)
  out = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, config=cfg))(x, w, gs)
  dx = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True, config=cfg))(
      ct, w, gs)
  assert rel_err(out, out_ref) < BF16_TOL
  assert rel_err(dx, dx_ref) < BF16_TOL


@pytest.mark.parametrize("block_m, block_k", [(8, 64), (16, 128), (64, 128)])
def test_swapped_kernel_with_padding_rows_and_large_groups(data, block_m, block_k):
  """"swapped" on the uneven groups of the other tests (groups of 500+ rows in many tiles,
  empty and one-row groups, padding rows that must come out zero)."""
  (x, w, ct, gs), (out_ref, dx_ref, _) = data
  cfg = mosaic_gpu.GmmConfig(block_m=block_m, block_n=64, block_k=block_k,
                             max_concurrent_steps=4, kernel="swapped", tile_pipeline=True)
  out = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, config=cfg))(x, w, gs)
  dx = jax.jit(lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True, config=cfg))(
      ct, w, gs)
  assert rel_err(out, out_ref) < BF16_TOL and rel_err(dx, dx_ref) < BF16_TOL
  assert not np.any(np.asarray(out[sum(SIZES):], np.float32))
