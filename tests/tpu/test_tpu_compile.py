"""TPU programs compiled by libtpu without a TPU (deviceless topologies, `k3jax.tpu_compile`).

Every Mosaic TPU tier (KDA forward and the state walks of its kernel backward, megablox gmm /
tgmm, splash attention forward and backward) compiled for v5e, v5p and v6e, each kernel found
by name in the compiled program; layer-reduced twins; `launch.plan --compile_for` on k3_tiny
cut to one MLA + MoE layer, and its errors.
Needs libtpu: `make test-tpu` (libtpu in .libtpu, outside .venv; JAX_PLATFORMS=cpu).
"""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="libtpu lives in .libtpu: `make test-tpu`")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from k3jax import config, model, tpu_compile  # noqa: E402
from pallas_kernels.attention import splash  # noqa: E402
from pallas_kernels.kda import chunked  # noqa: E402
from pallas_kernels.kda import mosaic_tpu as kda  # noqa: E402
from pallas_kernels.ragged_dot import mosaic_tpu as megablox  # noqa: E402

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
KINDS = {"v5e:2x2": "TPU v5 lite", "v5p:2x2x1": "TPU v5", "v6e:2x2": "TPU v6 lite"}
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


@pytest.fixture(scope="module", params=TOPOLOGIES)
def device(request):
  """One device of the topology, with its one-device mesh set (Mosaic reads the chip from it)."""
  devices = tpu_compile.topology(request.param)
  assert devices[0].device_kind == KINDS[request.param]
  mesh = Mesh(np.array(devices[:1]), ("x",))
  with jax.set_mesh(mesh):
    yield NamedSharding(mesh, PartitionSpec())


def _kernels(fn, sharding, *shapes_dtypes) -> set[str]:
  """Compiles fn for the device; returns the names of the Mosaic kernels in the program."""
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes_dtypes]
  text = jax.jit(fn).lower(*args).compile().as_text()
  return {m.split(".")[0] for m in
          re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", text)}


def test_kda_forward_and_backward_walks(device):
  """The forward kernel (bf16, packed documents) and the backward's two state walks (fp32; the
  rest of backward="kernel" is XLA)."""
  b, t, h, d = 1, 192, 2, 64
  n, c = t // chunked.CHUNK, chunked.CHUNK
  def kernels(q, k, v, g, beta, seg, w, u, kg, dec, h0, qd, aqk, do, dsf):
    return (kda.forward(q, k, v, g, beta, h0, seg, scale=d ** -0.5),
            kda.states_kernel(w, u, kg, dec, h0, False),
            kda.dstates_kernel(qd, w, kg, aqk, dec, do, dsf, False))
  tokens, state = ((b, h, n * c, d), F32), ((b, h, d, d), F32)
  names = _kernels(kernels, device, *[((b, t, h, d), BF16)] * 3, ((b, t, h, d), F32),
                   ((b, t, h), F32), ((b, t), I32), tokens, tokens, tokens,
                   ((b, h, n, d, 1), F32), state, tokens, ((b, h, n * c, c), F32), tokens, state)
  assert names == {"kda_chunk_fwd", "kda_states_tpu", "kda_dstates_tpu"}


def test_kda_forward_chunk128_head128_fp32(device):
  b, t, h, d = 1, 256, 1, 128
  fwd = lambda q, k, v, g, beta: kda.forward(q, k, v, g, beta, None, None, scale=d ** -0.5,
                                             chunk_size=128)
  assert _kernels(fwd, device, *[((b, t, h, d), F32)] * 4, ((b, t, h), F32)) == {"kda_chunk_fwd"}


def test_megablox_gmm_and_tgmm(device):
  m, k, n, g = 384, 256, 128, 4   # m: not a multiple of the 256-row tile (padded)
  sizes = ((g,), I32)
  assert _kernels(lambda x, w, s: megablox.gmm(x, w, s), device, ((m, k), BF16),
                  ((g, k, n), BF16), sizes) == {"gmm"}
  assert _kernels(lambda x, w, s: megablox.gmm(x, w, s, transpose_rhs=True), device,
                  ((m, n), BF16), ((g, k, n), BF16), sizes) == {"gmm"}
  assert _kernels(lambda x, y, s: megablox.tgmm(x, y, s, out_dtype=F32), device, ((m, k), BF16),
                  ((m, n), BF16), sizes) == {"tgmm"}


def test_splash_forward_and_backward(device):
  b, t, h, dk, dv = 1, 200, 2, 192, 128   # MLA's q/k head 128 + 64 rope, v 128; T padded to 256
  def loss(q, k, v, ids):
    f = lambda q, k, v: jnp.sum(splash.attention(q, k, v, ids, ids, causal=True,
                                                 scale=dk ** -0.5).astype(F32))
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  names = _kernels(loss, device, ((b, t, h, dk), BF16), ((b, t, h, dk), BF16),
                   ((b, t, h, dv), BF16), ((b, t), I32))
  assert {n.split("_segmented")[0] for n in names} == {
      "splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"}, names


def test_compiler_rejects_a_kernel_over_vmem(device):
  """The harness reaches Mosaic's own checks: 256 MiB of VMEM scratch fails at compile."""
  def body(x_ref, o_ref, scratch):
    scratch[...] = jnp.zeros_like(scratch) + x_ref[0, 0]
    o_ref[...] = scratch[:8, :128]
  fn = lambda x: pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((8, 128), F32),
                                scratch_shapes=[pltpu.VMEM((8192, 8192), F32)])(x)
  with pytest.raises(jax.errors.JaxRuntimeError, match="vmem"):
    _kernels(fn, device, ((8, 128), F32))


def test_twin_keeps_the_layer_pattern_with_fewer_units():
  cfg = config.load("experiments/configs/k3_full.py")
  kinds = model.layer_kinds(cfg.model)
  twin = tpu_compile.twin_config(cfg, 3)
  assert model.scan_plan(twin.model) == model.ScanPlan(start=4, period=4, units=3)
  assert model.layer_kinds(twin.model) == kinds[:16] + kinds[-1:]   # layers 0-15 and 92
  assert twin.model.full_attn_layers == (4, 8, 12, 16, 17)
  with pytest.raises(ValueError, match="2..22 scanned units"):
    tpu_compile.twin_config(cfg, 1)


def test_memory_extrapolates_linearly_in_units():
  m2 = tpu_compile.Memory(100, 90, 80, 40, 7)
  m3 = tpu_compile.Memory(150, 130, 120, 45, 8)
  assert m2.extrapolate(m3, 2, 3, 22) == tpu_compile.Memory(1100, 890, 880, 140, 8)
  assert m2.extrapolate(m3, 2, 3, 22).total == 1100 + 890 - 880 + 140
  # Temporaries that shrink between the twins are kept at the larger, not drawn below zero.
  shrink = tpu_compile.Memory(m3.arguments, m3.outputs, m3.aliased, m2.temporaries - 50, 8)
  assert m2.extrapolate(shrink, 2, 3, 22).temporaries == m2.temporaries
  assert not tpu_compile.Memory.temporaries_linear(m2, shrink)
  assert tpu_compile.Memory.temporaries_linear(m2, m3)


def _plan(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "launch.plan", "--config=experiments/configs/k3_tiny.py", *args]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _ints(text: str) -> dict[str, int]:
  return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+): (\d+)$", text, re.M)}


def test_plan_compile_for_a_small_slice():
  """k3_tiny cut to one MLA + MoE layer on v5e:2x2 (data 2 x expert 2): the compiled state
  arguments hold at least the planned state, and the donated state is aliased to the output."""
  proc = _plan("--compile_for=v5e:2x2", "--data=2", "--expert=2",
               "--config.model.num_layers=1", "--config.model.full_attn_layers=(1,)",
               "--config.model.first_k_dense_replace=0", "--config.model.attn_res_block_size=1",
               "--config.model.mtp_num_layers=0", "--config.train.optimizer=adamw",
               "--config.train.seq_len=64", "--config.train.global_batch_size=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  v = _ints(proc.stdout)
  assert "compile_for: v5e:2x2, 4 x TPU v5 lite" in proc.stdout
  state, batch = v["state_bytes_per_device"], v["compiled_batch_bytes_per_device"]
  assert batch == 4 * 64 * 4 * 5 // 4   # 5 [B, T] arrays of 4 bytes, B split over data x expert
  assert state + batch <= v["compiled_argument_bytes_per_device"] <= 4 * (state + batch)
  assert v["compiled_alias_bytes_per_device"] >= 0.99 * (
      v["compiled_argument_bytes_per_device"] - batch)
  assert v["compiled_total_bytes_per_device"] == (
      v["compiled_argument_bytes_per_device"] + v["compiled_output_bytes_per_device"]
      - v["compiled_alias_bytes_per_device"] + v["compiled_temp_bytes_per_device"])


@pytest.mark.parametrize("args, needles", [
    (("--compile_for=v5x:2x2", "--data=4"), ("--compile_for", "v5x:2x2")),
    (("--compile_for=v5e:2x2", "--data=2"), ("--compile_for=v5e:2x2", "--data=2", "4 devices")),
])
def test_plan_compile_for_errors(args, needles):
  proc = _plan(*args)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  for needle in needles:
    assert needle in proc.stderr, (needle, proc.stderr)
