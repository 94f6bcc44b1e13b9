"""Grouped matmul (MoE experts) on CPU: every tier against a float64 loop-over-groups oracle.

The kernel tiers run in their interpret modes: megablox through Pallas's HLO interpreter
(`interpret=True`), the Mosaic GPU kernels under `plgpu.InterpretGPUParams` (simulated SMEM,
warpgroups, barriers and TMA). Forward, d_lhs and d_rhs are checked with empty groups,
one-row groups, uneven sizes, group starts off the 8-row TMA alignment and rows past
sum(group_sizes) (which must come out exactly zero, as must their d_lhs rows).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_dot import mosaic_gpu
from pallas_kernels.ragged_dot import plan
from pallas_kernels.ragged_dot import plan_transposed
from pallas_kernels.ragged_dot import ragged_dot
from pallas_kernels.ragged_dot import transposed_ragged_dot

# bf16 inputs and outputs, fp32 accumulation: relative L2 error ~3e-3 from the final bf16
# rounding (2^-9 relative per element); 1e-2 leaves a factor 3, while a missing or misplaced
# row or tile gives O(1).
BF16_TOL = 1e-2
F32_TOL = 1e-5      # fp32 output of bf16 products: exact up to fp32 summation order
K, N = 128, 128
CASES = {
    # 13 padding rows; empty group; one-row group; M not a multiple of 8 or of the tiles
    "pad_rows": (203, (37, 0, 1, 101, 51)),
    # groups fill M; empty first and last groups; a one-row group at a tile boundary
    "full": (192, (0, 64, 1, 90, 37, 0)),
}


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def group_of_rows(sizes, m: int) -> np.ndarray:
  """Group index of each row, -1 past sum(sizes)."""
  gid = np.full(m, -1)
  ends = np.cumsum(sizes)
  for g, (s, e) in enumerate(zip(ends - np.asarray(sizes), ends)):
    gid[s:e] = g
  return gid


def oracle(x, w, ct, sizes):
  """float64 loop over rows: out[r] = x[r] w[g(r)], its d_lhs and d_rhs for cotangent ct."""
  x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
  gid = group_of_rows(sizes, x.shape[0])
  out = np.zeros((x.shape[0], w.shape[2]))
  dx = np.zeros_like(x)
  dw = np.zeros_like(w)
  for r, g in enumerate(gid):
    if g >= 0:
      out[r] = x[r] @ w[g]
      dx[r] = ct[r] @ w[g].T
      dw[g] += np.outer(x[r], ct[r])
  return out, dx, dw


def inputs(case: str, dtype=jnp.bfloat16, cases=CASES):
  m, sizes = cases[case]
  kx, kw, kc = jax.random.split(jax.random.key(len(sizes) + m), 3)
  x = jax.random.normal(kx, (m, K), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (len(sizes), K, N), jnp.float32).astype(dtype)
  ct = jax.random.normal(kc, (m, N), jnp.float32).astype(dtype)
  return x, w, ct, jnp.asarray(sizes, jnp.int32)


def fwd_bwd(impl: str, x, w, ct, gs, **kwargs):
  out, vjp = jax.vjp(lambda a, b: ragged_dot(a, b, gs, impl=impl, interpret=True, **kwargs),
                     x, w)
  return (out, *vjp(ct))


@pytest.mark.parametrize("impl, case", [
    ("xla", "pad_rows"), ("mosaic_gpu", "pad_rows"), ("mosaic_gpu", "full"),
    ("mosaic_tpu", "pad_rows"), ("mosaic_tpu", "full"),
])
def test_ragged_dot_forward_and_gradients(impl, case):
  x, w, ct, gs = inputs(case)
  p = plan(x, w, gs, impl=impl, interpret=True)
  assert (p.forward, p.d_lhs, p.d_rhs) == (impl,) * 3, p.declined
  got = fwd_bwd(impl, x, w, ct, gs)
  want = oracle(x, w, ct, CASES[case][1])
  for name, a, b in zip(("out", "d_lhs", "d_rhs"), got, want):
    assert a.dtype == jnp.bfloat16, name
    assert rel_err(a, b) < BF16_TOL, (name, rel_err(a, b))
  pad = group_of_rows(CASES[case][1], x.shape[0]) < 0
  assert not np.any(np.asarray(got[0], np.float32)[pad]), "rows past sum(group_sizes)"
  assert not np.any(np.asarray(got[1], np.float32)[pad]), "d_lhs rows past sum(group_sizes)"


@pytest.mark.parametrize("impl", ["mosaic_gpu", "mosaic_tpu"])
def test_fp32_output(impl):
  x, w, ct, gs = inputs("pad_rows")
  out = ragged_dot(x, w, gs, preferred_element_type=jnp.float32, impl=impl, interpret=True)
  assert out.dtype == jnp.float32
  assert rel_err(out, oracle(x, w, ct, CASES["pad_rows"][1])[0]) < F32_TOL


def test_jax_example_kernels_forward_and_d_lhs():
  """JAX's own ragged_dot_mgpu (config kernel="jax"), plain and with transpose_rhs."""
  x, w, ct, gs = inputs("pad_rows")
  cfg = mosaic_gpu.GmmConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2,
                             kernel="jax")
  out = mosaic_gpu.gmm(x, w, gs, interpret=True, config=cfg)
  d_lhs = mosaic_gpu.gmm(ct, w, gs, transpose_rhs=True, interpret=True, config=cfg)
  want_out, want_dx, _ = oracle(x, w, ct, CASES["pad_rows"][1])
  assert rel_err(out, want_out) < BF16_TOL
  assert rel_err(d_lhs, want_dx) < BF16_TOL


def test_two_cta_clusters():
  """cluster_n=2: CTA pairs on neighbouring N tiles share the lhs tile by TMA multicast."""
  m, sizes = CASES["pad_rows"]
  kx, kw, kc = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (m, K), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (len(sizes), K, 2 * N), jnp.float32).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (m, 2 * N), jnp.float32).astype(jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  gmm_cfg = mosaic_gpu.GmmConfig(block_m=64, block_n=64, max_concurrent_steps=2, cluster_n=2)
  tgmm_cfg = mosaic_gpu.TgmmConfig(block_m=64, block_n=64, max_concurrent_steps=2,
                                   cluster_n=2)
  got = (mosaic_gpu.gmm(x, w, gs, interpret=True, config=gmm_cfg),
         mosaic_gpu.gmm(ct, w, gs, transpose_rhs=True, interpret=True,
                        config=dataclasses.replace(gmm_cfg, cluster_n=1)),
         mosaic_gpu.tgmm(x, ct, gs, interpret=True, config=tgmm_cfg))
  for name, a, b in zip(("out", "d_lhs", "d_rhs"), got, oracle(x, w, ct, sizes)):
    assert rel_err(a, b) < BF16_TOL, (name, rel_err(a, b))


def check_tgmm_per_group(x, w, ct, gs, sizes, cfg):
  """tgmm with `cfg` in the interpreter against the fp64 oracle, group by group; empty groups
  give exact zeros."""
  d_rhs = mosaic_gpu.tgmm(x, ct, gs, interpret=True, config=cfg)
  want = oracle(x, w, ct, sizes)[2]
  for g, size in enumerate(sizes):
    if size:
      assert rel_err(d_rhs[g], want[g]) < BF16_TOL, g
    else:
      assert not np.any(np.asarray(d_rhs[g], np.float32)), f"empty group {g}"


# Group starts of "group_rows": pad_rows 0, 37, 37, 38, 139 (row blocks from 0, 32, 32, 32,
# 136: off the 8-row grid, on it, and one-row groups); full 0, 0, 64, 65, 155, 192.
@pytest.mark.parametrize("case", sorted(CASES))
def test_tgmm_group_rows(case):
  """group_rows: each group's row blocks start at its first row rounded down to 8, so the
  blocks of one group overlap the previous group's (masked) and run past M (TMA zero fill)."""
  x, w, ct, gs = inputs(case)
  cfg = mosaic_gpu.TgmmConfig(block_m=64, block_n=64, max_concurrent_steps=2, group_rows=True)
  check_tgmm_per_group(x, w, ct, gs, CASES[case][1], cfg)
  jax_cfg = dataclasses.replace(cfg, kernel="jax")
  assert "'ws' kernel" in mosaic_gpu.supports_tgmm(x, ct, gs, interpret=True, config=jax_cfg)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group_rows,boundary_blocks,balance",
                         [(False, False, False), (True, False, False), (False, True, False),
                          (True, True, True)])
def test_tgmm_tile_pipeline(case, group_rows, boundary_blocks, balance):
  """tgmm's tile_pipeline: one pipeline over all (tile, step) pairs of a simulated SM, whose
  slots and barrier phases run on across tiles of different groups (and empty groups); with
  boundary_blocks the first and last blocks of each group come masked from XLA (one-row
  groups: one block, both); with balance the groups go in order of falling steps, their
  tiles dealt serpentine over the simulated SMs."""
  x, w, ct, gs = inputs(case)
  cfg = mosaic_gpu.TgmmConfig(block_m=64, block_n=64, max_concurrent_steps=2,
                              group_rows=group_rows, tile_pipeline=True,
                              boundary_blocks=boundary_blocks, balance=balance)
  check_tgmm_per_group(x, w, ct, gs, CASES[case][1], cfg)
  clustered = dataclasses.replace(cfg, cluster_n=2)
  assert "cluster_n=1" in mosaic_gpu.supports_tgmm(x, ct, gs, interpret=True, config=clustered)
  per_tile = dataclasses.replace(cfg, tile_pipeline=False, boundary_blocks=True)
  assert "options of tile_pipeline" in mosaic_gpu.supports_tgmm(x, ct, gs, interpret=True,
                                                                config=per_tile)


@pytest.mark.parametrize("num_tiles", [32 * 336, 8 * 672, 64 * 16, 5])
def test_serpentine_deal_covers_every_tile_once_and_levels_the_load(num_tiles):
  """balance's deal: the serpentine positions of each CTA's tiles cover every tile once, and
  for tiles in order of falling cost (here the K3 shapes' and k3_small's tile counts per
  group with Dirichlet group sizes, steps + 3 per tile) the most loaded CTA holds less than
  with round robin, in group order or in the same order of falling cost."""
  ctas = 132
  counts = [int(mosaic_gpu.serpentine_count(num_tiles, c, ctas)) for c in range(ctas)]
  dealt = [np.asarray(mosaic_gpu.serpentine_tile(np.arange(n), c, ctas))
           for c, n in enumerate(counts)]
  assert sorted(np.concatenate(dealt).tolist()) == list(range(num_tiles))
  groups = {32 * 336: 32, 8 * 672: 8, 64 * 16: 64}.get(num_tiles)
  if groups is None:
    return
  sizes = np.random.default_rng(1).dirichlet(np.ones(groups)) * num_tiles * 4
  steps = np.ceil(sizes / 64) + 3
  cost = np.repeat(steps, num_tiles // groups)                  # group order
  by_cost = np.repeat(np.sort(steps)[::-1], num_tiles // groups)
  serpentine = max(by_cost[d].sum() for d in dealt)
  round_robin = max(cost[c::ctas].sum() for c in range(ctas))
  sorted_round_robin = max(by_cost[c::ctas].sum() for c in range(ctas))
  assert serpentine < min(round_robin, sorted_round_robin), (
      serpentine, round_robin, sorted_round_robin)


def check_gmm_products(x, w, ct, gs, sizes, cfg):
  """gmm's forward and d_lhs with `cfg` in the interpreter against the fp64 oracle; the rows
  past sum(sizes) are zero."""
  want_out, want_dx, _ = oracle(x, w, ct, sizes)
  out = mosaic_gpu.gmm(x, w, gs, interpret=True, config=cfg)
  d_lhs = mosaic_gpu.gmm(ct, w, gs, transpose_rhs=True, interpret=True, config=cfg)
  assert rel_err(out, want_out) < BF16_TOL
  assert rel_err(d_lhs, want_dx) < BF16_TOL
  assert not np.any(np.asarray(out[sum(sizes):], np.float32))


# 64-row tiles over the 2 simulated SMs: pad_rows 6 tiles (3 per SM: first, middle, last),
# full 5, three_tiles 3 (one SM runs a single tile, a whole pipeline).
PIPELINE_CASES = dict(CASES, three_tiles=(80, (40, 32, 8)))


@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
@pytest.mark.parametrize("epilogue_rows", [None, 16])
def test_tile_pipeline_and_epilogue_slices(case, epilogue_rows):
  """tile_pipeline: each simulated SM runs all its (tile, step) pairs as one pipeline;
  epilogue_rows stores each tile in row slices, which cut through partial tiles and group
  boundaries."""
  cfg = mosaic_gpu.GmmConfig(block_m=64, block_n=64, max_concurrent_steps=2,
                             tile_pipeline=True, epilogue_rows=epilogue_rows)
  check_gmm_products(*inputs(case, cases=PIPELINE_CASES), PIPELINE_CASES[case][1], cfg)


# Row tiles of 128 (from each group's start rounded down to 8; offset + rows per tile):
# pad_rows 37, 5 + 1, 6 + 101, 3 + 51 and the padding group 6 + 13; full 0 + 64, 0 + 1,
# 1 + 90, 3 + 37.
@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_pipeline_128_row_tiles(case):
  """gmm's tile_pipeline with 128-row tiles, three stages over two steps per tile (slots and
  barrier phases run on across tiles)."""
  cfg = mosaic_gpu.GmmConfig(block_m=128, block_n=64, max_concurrent_steps=3,
                             tile_pipeline=True)
  check_gmm_products(*inputs(case), CASES[case][1], cfg)


def test_tile_pipelines_with_an_idle_sm():
  """One tile for two simulated SMs: the second SM's pipeline has no tiles at all (gmm: one
  row tile of 128 and one N tile; tgmm: one group, one output tile)."""
  cases = {"one_tile": (128, (128,))}
  x, w, ct, gs = inputs("one_tile", cases=cases)
  gmm_cfg = mosaic_gpu.GmmConfig(block_m=128, block_n=64, max_concurrent_steps=2,
                                 tile_pipeline=True)
  tgmm_cfg = mosaic_gpu.TgmmConfig(block_m=64, block_n=128, max_concurrent_steps=2,
                                   group_rows=True, tile_pipeline=True, boundary_blocks=True,
                                   balance=True)
  got = (mosaic_gpu.gmm(x, w, gs, interpret=True, config=gmm_cfg),
         mosaic_gpu.tgmm(x, ct, gs, interpret=True, config=tgmm_cfg))
  want_out, _, want_dw = oracle(x, w, ct, cases["one_tile"][1])
  assert rel_err(got[0], want_out) < BF16_TOL
  assert rel_err(got[1], want_dw) < BF16_TOL


def test_tile_pipeline_config_errors():
  x, w, _, gs = inputs("full")
  clustered = mosaic_gpu.GmmConfig(block_m=64, block_n=64, tile_pipeline=True, cluster_n=2)
  two_n_tiles = jnp.concatenate([w, w], axis=-1)
  assert "without clusters" in mosaic_gpu.supports_gmm(x, two_n_tiles, gs, interpret=True,
                                                       config=clustered)
  odd = mosaic_gpu.GmmConfig(block_m=64, block_n=64, max_concurrent_steps=2, epilogue_rows=24)
  assert "epilogue_rows=24" in mosaic_gpu.supports_gmm(x, w, gs, interpret=True, config=odd)


def test_jax_example_transposed_kernel_has_no_interpret_mode():
  x, _, ct, gs = inputs("pad_rows")
  reason = mosaic_gpu.supports_tgmm(x, ct, gs, interpret=True,
                                    config=mosaic_gpu.TgmmConfig(block_m=64, block_n=64,
                                                                 kernel="jax"))
  assert "core_count" in reason


@pytest.mark.parametrize("impl", ["xla", "mosaic_gpu"])
def test_transposed_ragged_dot_and_gradients(impl):
  """out[g] = x_g^T ct_g and its gradients (both gmm products)."""
  x, w, ct, gs = inputs("pad_rows")
  sizes = CASES["pad_rows"][1]
  p = plan_transposed(x, ct, gs, impl=impl, interpret=True)
  assert (p.forward, p.d_lhs, p.d_rhs) == (impl,) * 3, p.declined
  out, vjp = jax.vjp(lambda a, b: transposed_ragged_dot(a, b, gs, impl=impl, interpret=True),
                     x, ct)
  d_x, d_ct = vjp(w)                     # cotangent [G, K, N]
  # out = the oracle's d_rhs; with cotangent w: d_x[r] = ct[r] w[g]^T, d_ct[r] = x[r] w[g].
  want_dct, want_dx, want_out = oracle(x, w, ct, sizes)
  for name, a, b in (("out", out, want_out), ("d_lhs", d_x, want_dx),
                     ("d_rhs", d_ct, want_dct)):
    assert rel_err(a, b) < BF16_TOL, (name, rel_err(a, b))
  assert not np.any(np.asarray(out, np.float32)[1]), "empty group"


def test_falls_through_with_reasons():
  x, w, ct, gs = inputs("pad_rows")
  on_cpu = plan(x, w, gs, impl="mosaic_gpu")
  assert (on_cpu.forward, on_cpu.d_lhs, on_cpu.d_rhs) == ("xla",) * 3
  assert all("not an NVIDIA Hopper GPU" in r for _, tier, r in on_cpu.declined)
  f32 = plan(x.astype(jnp.float32), w.astype(jnp.float32), gs, impl="mosaic_gpu",
             interpret=True)
  assert f32.forward == "xla" and "bf16" in f32.declined[0][2]
  odd_k = plan(x[:, :96], w[:, :96], gs, impl="mosaic_gpu", interpret=True)
  assert odd_k.forward == "xla" and "block_k" in odd_k.declined[0][2]
  got = ragged_dot(x[:, :96], w[:, :96], gs, impl="mosaic_gpu", interpret=True)
  want = oracle(x[:, :96], w[:, :96], ct, CASES["pad_rows"][1])[0]
  assert rel_err(got, want) < BF16_TOL


def test_bad_arguments():
  x, w, _, gs = inputs("pad_rows")
  with pytest.raises(ValueError, match="impl must be None or one of"):
    ragged_dot(x, w, gs, impl="cuda")
  with pytest.raises(ValueError, match="group_sizes must be an integer"):
    ragged_dot(x, w, gs.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"group_sizes must have shape \[G\] = \(5,\)"):
    ragged_dot(x, w, gs[:4])
  with pytest.raises(ValueError, match="rhs must be"):
    ragged_dot(x, w[:, :64], gs)
  with pytest.raises(ValueError, match="lhs must be a floating"):
    ragged_dot(x.astype(jnp.int32), w, gs)


@pytest.mark.parametrize("g, m, k, n", [(32, 32768, 3584, 3072), (32, 32768, 3072, 3584),
                                        (8, 16384, 3584, 6144)])
def test_heuristic_tiles_fit_k3_shapes(g, m, k, n):
  """The table gives a "ws" config within shared memory for all three products."""
  del g
  bf16 = jnp.bfloat16
  for cfg in (mosaic_gpu.gmm_config(m, k, n, bf16, bf16),
              mosaic_gpu.gmm_config(m, n, k, bf16, bf16)):
    assert isinstance(cfg, mosaic_gpu.GmmConfig), cfg
    assert mosaic_gpu.gmm_smem_bytes(cfg, bf16, bf16) <= mosaic_gpu.SMEM_BYTES
  cfg = mosaic_gpu.tgmm_config(m, k, n, bf16, bf16)
  assert isinstance(cfg, mosaic_gpu.TgmmConfig), cfg
  assert mosaic_gpu.tgmm_smem_bytes(cfg, bf16, bf16) <= mosaic_gpu.SMEM_BYTES


@pytest.mark.parametrize("g, m, k, n", [(32, 32768, 3584, 3072), (5, 203, 128, 128)])
def test_kernels_lower_for_hopper(monkeypatch, g, m, k, n):
  """Mosaic GPU lowering (layout inference, TMA tiling rules, SMEM allocation) runs on CPU:
  lower the forward, d_lhs and d_rhs kernels for CUDA without running them. Interpret mode
  does not check these rules (it ran M = 203 before the wrapper padded M to a multiple of 8;
  lowering refused it)."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "_num_sms", lambda interpret: 132)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  products = [
      (lambda a, b, c: mosaic_gpu.gmm(a, b, c), (s(m, k), s(g, k, n), gs)),
      (lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True), (s(m, n), s(g, k, n), gs)),
      (lambda a, b, c: mosaic_gpu.tgmm(a, b, c), (s(m, k), s(m, n), gs)),
  ]
  for fn, args in products:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_tile_pipeline_lowers_for_hopper(monkeypatch):
  """The pipelined-tiles gmm at the k3_small expert shape (K = 512: 8 steps of 64, 4 stages,
  which fit beside 64-row epilogue slices) lowers for CUDA, forward and d_lhs."""
  monkeypatch.setattr(mosaic_gpu, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_gpu, "_num_sms", lambda interpret: 132)
  g, m, k, n = 64, 131072, 512, 1024
  cfg = mosaic_gpu.GmmConfig(block_m=128, block_n=128, max_concurrent_steps=4,
                             grid_minor_dim=1, grid_tile_width=4, tile_pipeline=True,
                             epilogue_rows=64)
  bf16 = jnp.bfloat16
  assert mosaic_gpu.gmm_smem_bytes(cfg, bf16, bf16) <= mosaic_gpu.SMEM_BYTES
  s = lambda *shape: jax.ShapeDtypeStruct(shape, bf16)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  for fn, args in (
      (lambda a, b, c: mosaic_gpu.gmm(a, b, c, config=cfg), (s(m, k), s(g, k, n), gs)),
      (lambda a, b, c: mosaic_gpu.gmm(a, b, c, transpose_rhs=True, config=cfg),
       (s(m, n), s(g, k, n), gs))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# Decode shapes: few rows per group over many groups (B tokens x top-k copies), groups starting
# anywhere in an 8-row block; 8-row tiles split groups that cross a block boundary.
SWAPPED_CASES = {
    "decode_b1": (8, (0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0)),     # M below block_m
    "decode_b4": (32, (2, 0, 3, 1, 4, 0, 2, 2, 1, 3, 4, 0, 2, 1, 3, 4)),
    "pad_rows": CASES["pad_rows"],                                         # big groups too
}


@pytest.mark.parametrize("case", sorted(SWAPPED_CASES))
@pytest.mark.parametrize("block_m, block_k", [(8, 64), (16, 128)])
def test_swapped_kernel(case, block_m, block_k):
  """The "swapped" gmm (weights on wgmma's 64-row side, a group's rows on its N side; the tile
  stored transposed) for forward and d_lhs against the oracle, one pipeline over the tiles of
  each simulated SM with more tiles than stages."""
  cfg = mosaic_gpu.GmmConfig(block_m=block_m, block_n=64, block_k=block_k,
                             max_concurrent_steps=2, kernel="swapped", tile_pipeline=True)
  check_gmm_products(*inputs(case, cases=SWAPPED_CASES), SWAPPED_CASES[case][1], cfg)


def test_swapped_config():
  """swapped_config's row tiles hold a group of the average size wherever it starts; its
  configs pass the checks, and the checks name what a bad one gets wrong."""
  bf16 = jnp.bfloat16
  for (m, groups), block_m in {(8, 64): 8, (128, 64): 16, (512, 64): 16, (4096, 64): 64}.items():
    cfg = mosaic_gpu.swapped_config(m, 512, 1024, groups, bf16, bf16)
    assert (cfg.kernel, cfg.block_m, cfg.block_n) == ("swapped", block_m, 64)
    assert mosaic_gpu._check_gmm_config(cfg, m, 512, 1024, bf16, bf16) is None
  x, w, _, gs = inputs("decode_b4", cases=SWAPPED_CASES)
  good = mosaic_gpu.GmmConfig(block_m=8, block_n=64, kernel="swapped", tile_pipeline=True)
  for change, needle in (({"block_n": 128}, "block_n=64"), ({"block_m": 12}, "multiple of 8"),
                         ({"block_k": 96}, "multiple of 64"), ({"tile_pipeline": False},
                                                               "one pipeline")):
    bad = dataclasses.replace(good, **change)
    assert needle in mosaic_gpu.supports_gmm(x, w, gs, interpret=True, config=bad)
  assert "multiple of the CTA tile 128" in mosaic_gpu.supports_gmm(
      x, w[..., :64], gs, interpret=True, config=dataclasses.replace(good))
