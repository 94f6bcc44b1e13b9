"""The fused KDA decode step: every tier against a written-out fp64 numpy oracle.

The triton tier runs in Pallas's interpreter on CPU (and must equal the xla tier to fp32
rounding); it is also lowered for an H200 on CPU (Triton IR built, not compiled); on a GPU it
is compiled, run, and checked to update the state and the conv tail in place in a loop.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_decode
from pallas_kernels.kda_decode import api
from pallas_kernels.kda_decode import triton

ON_GPU = jax.devices()[0].platform == "gpu"
L2_EPS, LB = 1e-6, -5.0


def inputs(seed, b, h, k, r, w=4, dtype=jnp.float32, lengths=None):
  rng = np.random.default_rng(seed)
  a = lambda *s, sd=1.0: jnp.asarray(sd * rng.standard_normal(s), jnp.float32)
  args = (a(b, kda_decode.proj_width(h, k, r)), a(b, w - 1, 3, h * k), a(w, 3, h * k, sd=0.5),
          a(r, h, k, sd=r ** -0.5), a(h, sd=0.5), a(h * k), 1 + a(k, sd=0.1),
          a(b, h, k, k, sd=0.1))
  args = tuple(x.astype(dtype) if i in (0, 1, 2, 3) else x for i, x in enumerate(args))
  return args + (None if lengths is None else jnp.asarray(lengths, jnp.int32),)


def oracle(proj, tail, cw, fb, a_log, dt_bias, o_norm, state, lengths, gate, eps=1e-5):
  """Row by row and head by head in fp64 numpy, from the formulas of report §2.1."""
  proj, tail, cw, fb, a_log, dt_bias, o_norm, state = (
      np.asarray(x, np.float64) for x in (proj, tail, cw, fb, a_log, dt_bias, o_norm, state))
  r, h, k = fb.shape
  b, hk = proj.shape[0], h * k
  shape = tail.shape                                   # [B, W-1, 3, HK]: q, k, v side by side
  tail, cw = tail.reshape(b, shape[1], 3 * hk), cw.reshape(shape[1] + 1, 3 * hk)
  o, new_tail, new_state = np.zeros((b, hk)), tail.copy(), state.copy()
  sig = lambda x: 1 / (1 + np.exp(-x))
  for i in range(b):
    real = lengths is None or int(lengths[i]) > 0
    xp = np.concatenate([tail[i], proj[i, None, :3 * hk]], 0)
    y = (xp * cw).sum(0)
    y = y * sig(y)
    if real:
      new_tail[i] = xp[1:]
    for j in range(h):
      sl = slice(j * k, (j + 1) * k)
      q, kk, v = y[sl], y[hk:][sl], y[2 * hk:][sl]
      q = q / np.sqrt((q * q).sum() + L2_EPS) * k ** -0.5
      kk = kk / np.sqrt((kk * kk).sum() + L2_EPS)
      f = proj[i, 4 * hk:4 * hk + r] @ fb[:, j, :] + dt_bias[sl]
      a = np.exp(a_log[j])
      g = LB * sig(a * f) if gate == "lower_bound" else -a * np.log1p(np.exp(f))
      beta = sig(proj[i, 4 * hk + r + j])
      if not real:
        g, beta = np.zeros(k), 0.0
      s = state[i, j] * np.exp(g)[:, None]
      s = s + beta * np.outer(kk, v - s.T @ kk)
      out = s.T @ q
      out = out / np.sqrt((out * out).mean() + eps) * o_norm * sig(proj[i, 3 * hk:][sl])
      o[i, sl], new_state[i, j] = out, s
  return o, new_tail.reshape(shape), new_state


def check(got, want, atol):
  for name, g, w in zip(("o", "conv_tail", "state"), got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("b,h,k,r,w,lengths", [
    (3, 2, 32, 32, 4, [1, 0, 5]), (2, 3, 32, 64, 2, None), (1, 1, 64, 32, 3, [0])])
def test_tiers_match_fp64_oracle(gate, impl, b, h, k, r, w, lengths):
  args = inputs(b * 10 + k, b, h, k, r, w, lengths=lengths)
  p = kda_decode.plan(args[0], args[1], args[3], impl=impl, interpret=True)
  assert p.impl == impl
  got = kda_decode.kda_decode_step(*args, gate=gate, impl=impl, interpret=True)
  check(got, oracle(*args, gate), atol=2e-5)
  if lengths is not None:   # padding rows keep their state and tail exactly
    pad = np.asarray(lengths) == 0
    np.testing.assert_array_equal(np.asarray(got[2])[pad], np.asarray(args[7])[pad])
    np.testing.assert_array_equal(np.asarray(got[1])[pad], np.asarray(args[1])[pad])


@pytest.mark.parametrize("config", [triton.Config(block=16, num_warps=4),
                                    *triton.CONFIGS.values()])
def test_triton_configs_match_fp64_oracle(config):
  """Every tile and warp choice of the triton tier (block 16 at K 32: two column blocks and
  two f_b slices) in the interpreter, padding rows included."""
  args = inputs(5, 3, 2, 32, 32, lengths=[1, 0, 5])
  assert triton.supports(args[0], args[1], f_b=args[3], interpret=True, config=config) is None
  got = triton.kda_decode_step(*args, gate="softplus", lower_bound=LB, scale=32 ** -0.5,
                               norm_eps=1e-5, interpret=True, config=config)
  check(got, oracle(*args, "softplus"), atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got[2])[1], np.asarray(args[7])[1])
  bad = triton.Config(block=24)
  assert "config.block a power of two" in triton.supports(args[0], args[1], f_b=args[3],
                                                          interpret=True, config=bad)


@pytest.mark.parametrize("gate,dtype", [("lower_bound", jnp.float32), ("softplus", jnp.bfloat16)])
def test_mosaic_tpu_tier_in_the_interpreter(gate, dtype):
  """The TPU kernel (K and R multiples of 128) in Pallas's interpreter against the oracle."""
  args = inputs(11, 3, 2, 128, 128, dtype=dtype, lengths=[1, 0, 5])
  p = kda_decode.plan(args[0], args[1], args[3], impl="mosaic_tpu", interpret=True)
  assert p.impl == "mosaic_tpu"
  got = kda_decode.kda_decode_step(*args, gate=gate, impl="mosaic_tpu", interpret=True)
  check(got, oracle(*args, gate), atol=2e-5 if dtype == jnp.float32 else 3e-2)
  np.testing.assert_array_equal(np.asarray(got[2])[1], np.asarray(args[7])[1])
  odd = inputs(0, 1, 1, 64, 128)
  p = kda_decode.plan(odd[0], odd[1], odd[3], impl="mosaic_tpu", interpret=True)
  assert p.impl == "xla" and "multiples of 128" in p.declined[0][1]


def test_bf16_projections():
  """bf16 proj, tail, conv and f_b (a bf16 model's decode): the tiers agree with each other
  and the oracle of the same bf16 inputs to bf16's output rounding."""
  args = inputs(7, 4, 2, 128, 128, dtype=jnp.bfloat16, lengths=[3, 1, 0, 2])
  want = oracle(*args, "lower_bound")
  got = {impl: kda_decode.kda_decode_step(*args, impl=impl, interpret=True)
         for impl in ("xla", "triton")}
  for impl, out in got.items():
    assert out[0].dtype == out[1].dtype == jnp.bfloat16 and out[2].dtype == jnp.float32, impl
    check(out, want, atol=3e-2)
  check(got["triton"], [np.asarray(x, np.float64) for x in got["xla"]], atol=1e-2)


def test_default_and_declines(monkeypatch):
  args = inputs(0, 2, 2, 32, 32)
  assert kda_decode.plan(args[0], args[1], args[3]).impl == ("triton" if ON_GPU else "xla")
  monkeypatch.setattr(api, "TRITON_IS_DEFAULT", False)
  assert kda_decode.plan(args[0], args[1], args[3]).impl == "xla"
  wide = inputs(0, 1, 1, 256, 16)
  p = kda_decode.plan(wide[0], wide[1], wide[3], impl="triton", interpret=True)
  assert p.impl == "xla" and "K a power of two" in p.declined[0][1]
  odd = inputs(0, 1, 1, 32, 24)
  p = kda_decode.plan(odd[0], odd[1], odd[3], impl="triton", interpret=True)
  assert p.impl == "xla" and "R a power of two" in p.declined[0][1]
  got = kda_decode.kda_decode_step(*wide, impl="triton", interpret=True)
  check(got, oracle(*wide, "lower_bound"), atol=2e-5)


@pytest.mark.parametrize("index,shape,match", [
    (0, (2, 10), "proj must have shape"), (1, (2, 3, 96), "conv_tail must have shape"),
    (5, (3,), "dt_bias must have shape"), (7, (2, 2, 16, 8), "state must have shape"),
    (8, (3,), "lengths must have shape")])
def test_bad_shapes_name_the_argument(index, shape, match):
  args = list(inputs(0, 2, 2, 16, 16, lengths=[1, 1]))
  args[index] = jnp.zeros(shape, jnp.int32 if index == 8 else jnp.float32)
  with pytest.raises(ValueError, match=match):
    kda_decode.kda_decode_step(*args)


def test_bad_dtypes_name_the_argument():
  args = list(inputs(0, 2, 2, 16, 16, lengths=[1, 1]))
  with pytest.raises(ValueError, match="lengths must be an integer array"):
    kda_decode.kda_decode_step(*args[:8], args[8].astype(jnp.float32))
  with pytest.raises(ValueError, match="state must be a floating array"):
    kda_decode.kda_decode_step(*args[:7], args[7].astype(jnp.int32), args[8])


def test_bad_gate_and_impl():
  args = inputs(0, 1, 1, 16, 16)
  with pytest.raises(ValueError, match="gate must be one of"):
    kda_decode.kda_decode_step(*args, gate="sigmoid")
  with pytest.raises(ValueError, match="impl must be None or one of"):
    kda_decode.kda_decode_step(*args, impl="mosaic")


def test_lowers_for_h200_with_aliases():
  """Triton IR for an H200 on any host; the tail and the state (operands 1 and 7) alias
  outputs 1 and 2, so that a decode loop carrying them needs no copy."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  sds = [jax.ShapeDtypeStruct(a.shape, a.dtype)
         for a in inputs(0, 16, 8, 128, 128, dtype=jnp.bfloat16, lengths=[1] * 16)]
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda *a: triton.kda_decode_step(
        *a, gate="lower_bound", lower_bound=LB, scale=128 ** -0.5, norm_eps=1e-5)).trace(
            *sds).lower(lowering_platforms=("cuda",))
  (call,) = [line for line in lowered.as_text().splitlines() if "__gpu$xla.gpu.triton" in line]
  for out, operand in ((1, 1), (2, 7)):
    assert (f"output_tuple_indices = [{out}], operand_index = {operand}," in call), call[-400:]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("config", list(triton.CONFIGS))
@pytest.mark.parametrize("b,h,k,r,dtype", [(16, 8, 128, 128, jnp.bfloat16),
                                           (4, 96, 128, 128, jnp.bfloat16),
                                           (5, 3, 64, 32, jnp.float32)])
def test_compiled_on_gpu(config, b, h, k, r, dtype):
  """The compiled kernel (interpret=False), each config, against the fp64 oracle."""
  args = inputs(b + k, b, h, k, r, dtype=dtype, lengths=[i % 3 for i in range(b)])
  assert kda_decode.plan(args[0], args[1], args[3], impl="triton").impl == "triton"
  got = jax.jit(lambda *a: triton.kda_decode_step(
      *a, gate="lower_bound", lower_bound=LB, scale=k ** -0.5, norm_eps=1e-5,
      config=triton.CONFIGS[config]))(*args)
  check(got, oracle(*args, "lower_bound"), atol=3e-2 if dtype == jnp.bfloat16 else 5e-5)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("config", list(triton.CONFIGS))
def test_decode_loop_updates_state_and_tail_in_place(config, monkeypatch):
  """A loop carrying the state and the tail through the kernel (each config as the tier's
  default) copies neither."""
  monkeypatch.setattr(triton, "DEFAULT", triton.CONFIGS[config])
  args = inputs(3, 16, 8, 128, 128, dtype=jnp.bfloat16, lengths=[1] * 16)

  def loop(tail, state):
    def body(i, c):
      return kda_decode.kda_decode_step(args[0], c[0], *args[2:7], c[1], args[8],
                                        impl="triton")[1:]
    return jax.lax.fori_loop(0, 4, body, (tail, state))

  hlo = jax.jit(loop, donate_argnums=(0, 1)).lower(args[1], args[7]).compile().as_text()
  shapes = ("f32[16,8,128,128]", "bf16[16,3,3,1024]", "bf16[16,3,3072]")
  copies = [line for line in hlo.splitlines()
            if " copy(" in line and any(s in line for s in shapes)]
  assert not copies, copies[:3]
