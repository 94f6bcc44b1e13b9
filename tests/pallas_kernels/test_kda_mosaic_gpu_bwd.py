"""Mosaic GPU KDA backwards ("kernel", "kernel_intra") vs autodiff of the fp64 recurrence.

On CPU the kernels run in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`).
With K3JAX_KDA_TEST_ON_DEVICE=1 they are compiled for the (Hopper) GPU instead
and larger shapes are added.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import mosaic_gpu_bwd
from pallas_kernels.kda import reference
from kda_testing import outputs_and_grads, rel_err, segments

ON_DEVICE = os.environ.get("K3JAX_KDA_TEST_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
NAMES = ("q", "k", "v", "g", "beta")
# fla's bf16 gradient bounds (kda.md): 8e-3 for dq, dk, dv, dh0 and 2e-2 for dg, dbeta.
TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "g": 2e-2, "beta": 2e-2}

if ON_DEVICE and not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("K3JAX_KDA_TEST_ON_DEVICE=1 needs a GPU", allow_module_level=True)


def fp64_outputs_and_grads(x: dict, segment_ids, cot, normalize_qk: bool = False):
  """((o, S_T), gradients of <o, cot_o> + <S_T, cot_S>) of the fp64 token recurrence (after
  an fp64 L2 norm of q and k with `normalize_qk`)."""
  l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, -1, keepdims=True) + reference.L2_EPS)
  with jax.enable_x64(True):
    args = {n: jnp.asarray(np.asarray(x[n], np.float32), jnp.float64) for n in (*NAMES, "h0")}

    def f(a):
      q, k = (l2(a["q"]), l2(a["k"])) if normalize_qk else (a["q"], a["k"])
      return reference.recurrent_kda(q, k, a["v"], a["g"], a["beta"],
                                     scale=x["q"].shape[-1] ** -0.5,
                                     initial_state=a["h0"], segment_ids=segment_ids)

    out, vjp = jax.vjp(f, args)
    grads = vjp(tuple(jnp.asarray(np.asarray(c, np.float32), jnp.float64) for c in cot))[0]
    return jax.device_get(out), jax.device_get(grads)


BF16, F32 = jnp.bfloat16, jnp.float32
# Heads of the single-shape tests below: one in the interpreter (CASES cover two), two compiled.
HEADS = 1 if INTERPRET else 2
CASES = [
    (1, 64, 2, 64, 64, False, 64, BF16),     # one chunk, no segments
    (1, 130, 2, 128, 128, True, 64, BF16),   # padded T, segments, 2 value blocks, K = 128
    (1, 130, 2, 64, 128, True, 32, F32),     # fp32 inputs, K != V, 4 value blocks of 32
]
if ON_DEVICE:
  CASES += [(2, 1000, 4, 128, 128, True, 64, BF16), (1, 4096, 2, 128, 64, False, 32, BF16)]


@pytest.mark.parametrize("backward", ["kernel", "kernel_intra"])
@pytest.mark.parametrize("b, t, h, dk, dv, with_segments, block_v, dtype", CASES)
def test_kernel_backward_matches_fp64(b, t, h, dk, dv, with_segments, block_v, dtype, backward):
  x = reference.example_inputs(jax.random.key(t + dk + dv), b, t, h, dk, dv, gate="bounded",
                               with_initial_state=True)
  x = {n: (a.astype(dtype) if n in ("q", "k", "v") else a) for n, a in x.items()}
  sid = segments(t, b) if with_segments else None
  rng = np.random.default_rng(t)
  cot = (jnp.asarray(rng.standard_normal((b, t, h, dv)), dtype),
         jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32))

  _, grads = outputs_and_grads(mosaic_gpu.chunk_kda_mosaic_gpu, x, cot, segment_ids=sid,
                               interpret=INTERPRET, block_v=block_v, backward=backward)
  _, ref = fp64_outputs_and_grads(x, sid, cot)
  for name in (*NAMES, "h0"):
    assert grads[name].shape == x[name].shape and grads[name].dtype == x[name].dtype, name
    assert np.isfinite(np.asarray(grads[name], np.float32)).all(), name
    assert rel_err(grads[name], ref[name]) < TOL[name], name


def test_backward_argument_is_checked():
  x = reference.example_inputs(jax.random.key(0), 1, 8, 1, 64, 64, gate="bounded",
                               with_initial_state=False)
  with pytest.raises(ValueError, match="backward"):
    mosaic_gpu.chunk_kda_mosaic_gpu(*(x[n] for n in NAMES), interpret=True, backward="scan")


@pytest.mark.parametrize("backward", ["kernel", "kernel_intra"])
def test_l2_norm_in_kernel(backward):
  """use_qk_l2norm_in_kernel: raw q, k (not unit norm) normalised in the intra kernel; o, the
  final state and all gradients against the fp64 recurrence after an fp64 L2 norm."""
  b, t, h, d = 1, 130, HEADS, 128
  x = reference.example_inputs(jax.random.key(11), b, t, h, d, d, gate="bounded",
                               with_initial_state=True)
  x["q"], x["k"] = (3.0 * x["q"] + 0.5).astype(BF16), (0.2 * x["k"] - 0.1).astype(BF16)
  x["v"] = x["v"].astype(BF16)
  sid = segments(t, b)
  rng = np.random.default_rng(5)
  cot = (jnp.asarray(rng.standard_normal((b, t, h, d)), BF16),
         jnp.asarray(rng.standard_normal((b, h, d, d)), F32))

  (o, s), grads = outputs_and_grads(mosaic_gpu.chunk_kda_mosaic_gpu, x, cot, segment_ids=sid,
                                    interpret=INTERPRET, backward=backward,
                                    use_qk_l2norm_in_kernel=True)
  (o_ref, s_ref), ref = fp64_outputs_and_grads(x, sid, cot, normalize_qk=True)
  assert rel_err(o, o_ref) < 1.5e-2 and rel_err(s, s_ref) < 1.5e-2
  for name in (*NAMES, "h0"):
    assert rel_err(grads[name], ref[name]) < TOL[name], (name, rel_err(grads[name], ref[name]))


@pytest.mark.parametrize("backward", ["kernel", "kernel_intra"])
def test_strong_decay(backward):
  """g = -5 sigmoid(N(0, 1)), about -2.5 per token (benchmarks/kda.py's gate): dg is small
  next to the intra-chunk terms that cancel in it, the case that bf16 rounding hurts most."""
  b, t, h, d = 1, 256, HEADS, 128
  x = reference.example_inputs(jax.random.key(3), b, t, h, d, d, gate="bounded",
                               with_initial_state=True)
  x["g"] = -5.0 * jax.nn.sigmoid(jax.random.normal(jax.random.key(4), x["g"].shape))
  x["h0"] = jnp.zeros_like(x["h0"])
  x = {n: (a.astype(BF16) if n in ("q", "k", "v") else a) for n, a in x.items()}
  rng = np.random.default_rng(9)
  # Only the output's cotangent (a loss of o, as in training): a random final-state cotangent
  # or h0 would dominate dg and hide its error (8e-2 with the earlier rounding, 2e-2 allowed).
  cot = (jnp.asarray(rng.standard_normal((b, t, h, d)), BF16), jnp.zeros((b, h, d, d), F32))
  _, grads = outputs_and_grads(mosaic_gpu.chunk_kda_mosaic_gpu, x, cot, segment_ids=None,
                               interpret=INTERPRET, backward=backward)
  _, ref = fp64_outputs_and_grads(x, None, cot)
  for name in NAMES:
    assert rel_err(grads[name], ref[name]) < TOL[name], (name, rel_err(grads[name], ref[name]))


def test_saved_forward_outputs_give_the_recomputed_gradients():
  """The kernel backward reusing the forward's intra-kernel outputs, S_n and V_new (what
  backward="kernel_intra" does) gives the gradients of recomputing them: the same parts, and
  S_n, V_new that differ only in rounding (the forward forms V_new = M (beta V - K_d S), the
  backward's walk U - W S)."""
  b, t, h, d = 1, 130, HEADS, 128
  x = reference.example_inputs(jax.random.key(21), b, t, h, d, d, gate="bounded",
                               with_initial_state=True)
  args = (x["q"].astype(BF16), x["k"].astype(BF16), x["v"].astype(BF16), x["g"], x["beta"],
          x["h0"], segments(t, b))
  rng = np.random.default_rng(2)
  d_o = jnp.asarray(rng.standard_normal((b, t, h, d)), BF16)
  d_s = jnp.asarray(rng.standard_normal((b, h, d, d)), F32)
  kw = dict(scale=d ** -0.5, interpret=INTERPRET, block_v=64)
  *_, saved = mosaic_gpu.forward(*args, return_saved=True, **kw)
  again = mosaic_gpu_bwd.backward(*args, d_o, d_s, parts="kernel", **kw)
  reused = mosaic_gpu_bwd.backward(*args, d_o, d_s, parts="kernel", saved=saved, **kw)
  for name, a, r in zip((*NAMES, "h0"), again, reused):
    assert rel_err(r, a) < 5e-3, (name, rel_err(r, a))      # measured <= 1.9e-3 (dq)
  # and they are what the backward uses: a changed Q_d changes dS, hence dk and dh0; changed
  # states change dQ_d, hence dq; a changed V_new changes dK_g, hence dk
  changes = [(1, 5, saved._replace(parts=(2 * saved.parts[0], *saved.parts[1:]))),
             (0, None, saved._replace(states=2 * saved.states)),
             (1, None, saved._replace(v_new=2 * saved.v_new))]
  for i, j, bad in changes:
    changed = mosaic_gpu_bwd.backward(*args, d_o, d_s, parts="kernel", saved=bad, **kw)
    for idx in (i, j) if j is not None else (i,):
      assert not np.allclose(np.asarray(changed[idx], F32), np.asarray(again[idx], F32))


@pytest.mark.parametrize("backward", ["kernel", "kernel_intra"])
def test_forward_and_backward_lower_for_hopper(backward):
  """Mosaic GPU lowering (layouts, TMA boxes) of every kernel of jax.grad, for CUDA, on any host."""
  for t, dk, dv, dtype, seg in [(130, 128, 128, BF16, True), (64, 64, 128, F32, False)]:
    sds = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)

    def loss(q, k, v, g, beta, h0, sid, seg=seg):
      o, s = mosaic_gpu.chunk_kda_mosaic_gpu(q, k, v, g, beta, initial_state=h0,
                                             output_final_state=True,
                                             segment_ids=sid if seg else None,
                                             backward=backward, use_qk_l2norm_in_kernel=seg)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    args = (sds(1, t, 2, dk), sds(1, t, 2, dk), sds(1, t, 2, dv), sds(1, t, 2, dk, d=F32),
            sds(1, t, 2, d=F32), sds(1, 2, dk, dv, d=F32), sds(1, t, d=jnp.int32))
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 4 and "kda_dstates_mosaic_gpu" in text, backward
