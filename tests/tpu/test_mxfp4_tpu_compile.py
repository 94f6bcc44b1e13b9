"""The MXFP4 matmul kernels (`pallas_kernels/mxfp4_matmul/mosaic_tpu.py`) compiled by libtpu for
v5e, v5p and v6e without a TPU (`k3jax.tpu_compile`), at K3's routed-expert shapes.

(K, N) = (3584, 3072) for W1 / W3 (latent 3584 -> expert width 3072) and (3072, 3584) for W2;
M = 16 (decoding) and 4096 rows; ragged_dot over 8 experts. Each program holds our kernel,
found by name, and no [N, K] array: the weight reaches the kernel packed. `pytest -s` prints
each program's bytes per device (`memory_analysis()`) and the kernel's scoped VMEM.
Needs libtpu: `make test-tpu` (libtpu in .libtpu, outside .venv; JAX_PLATFORMS=cpu).
"""
import re

import pytest

pytest.importorskip("libtpu", reason="libtpu lives in .libtpu: `make test-tpu`")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from k3jax import tpu_compile  # noqa: E402
from pallas_kernels.mxfp4_matmul import mosaic_tpu  # noqa: E402
from test_tpu_compile import device  # noqa: E402,F401  (one device of each topology, mesh set)

EXPERT_SHAPES = ((3584, 3072), (3072, 3584))   # (K, N): W1 / W3, W2
EXPERTS = 8
BF16, F32, U8, I32 = jnp.bfloat16, jnp.float32, jnp.uint8, jnp.int32


def _compile(fn, sharding, *shapes_dtypes) -> tuple[set[str], str, tpu_compile.Memory]:
  """Compiles fn for the device: (names of its Mosaic kernels, program text, bytes)."""
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes_dtypes]
  compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  names = {m.split(".")[0] for m in
           re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", text)}
  return names, text, tpu_compile.Memory.of(compiled)


def _kind(sharding) -> str:
  return sharding.mesh.devices.flat[0].device_kind


def _check(label, names, text, memory, kernel: str, n: int, k: int) -> None:
  """Our kernel alone and no unpacked weight; prints the kernel's scoped VMEM and the program's
  bytes (XLA may also place whole operands in VMEM: v5e does with a 28 MiB x)."""
  assert names == {kernel}, names
  line = next(l for l in text.splitlines() if f"%{kernel}" in l and "tpu_custom_call" in l)
  vmem = re.search(r'"used_scoped_memory_configs":\[\{[^}]*"size":"(\d+)"', line)
  print(f"{label}: kernel scoped VMEM {int(vmem[1]) / 2 ** 20:.1f} MiB; {memory}")
  assert not re.search(rf"[\[,]{n},{k}\]", text), f"an unpacked [.., {n}, {k}] weight in {label}"


@pytest.mark.parametrize("k, n", EXPERT_SHAPES)
@pytest.mark.parametrize("m", [16, 4096])
def test_matmul_and_ragged_dot_at_expert_shapes(device, m, k, n):
  weight = (((n, k // 2), U8), ((n, k // mosaic_tpu.BLOCK), U8))
  label = f"{_kind(device)} M={m} K={k} N={n}"
  _check(f"matmul {label}", *_compile(mosaic_tpu.matmul, device, ((m, k), BF16), *weight),
         "mxfp4_matmul", n, k)
  experts = tuple(((EXPERTS, *shape), dtype) for shape, dtype in weight)
  _check(f"ragged_dot {label}",
         *_compile(mosaic_tpu.ragged_dot, device, ((m, k), BF16), *experts, ((EXPERTS,), I32)),
         "mxfp4_ragged_dot", n, k)


def test_fp32_activations_with_the_largest_tiles(device):
  """fp32 x and output at M = 4096: the tiles with the most VMEM that `tiles` picks fit."""
  m, (k, n) = 4096, EXPERT_SHAPES[0]
  assert mosaic_tpu.tiles(m, k, n, F32, F32) == (256, 512)
  program = _compile(mosaic_tpu.matmul, device, ((m, k), F32), ((n, k // 2), U8),
                     ((n, k // mosaic_tpu.BLOCK), U8))
  _check(f"matmul fp32 {_kind(device)}", *program, "mxfp4_matmul", n, k)
