"""The decode attention kernel (`pallas_kernels/decode_attention/mosaic_tpu.py`) compiled by libtpu
for v5e, v5p and v6e without a TPU (`k3jax.tpu_compile`), at the absorbed-MLA decode shapes.

K3: Dk = 576 (latent 512 + rope 64), v_dim = 512, H = 64 and 96, T = 1 and 8 (speculative
decoding); k3_small: Dk = 320, v_dim = 256, H = 8. Each program holds our kernel, found by name,
and no copy of the cache: the cache comes in row-major layout (XLA's default layout for a
[B, S, 576] bf16 parameter puts S minor, 576 being no multiple of 128, and a jit taking the cache
in it copies the cache into the kernel's layout on every call). `pytest -s` prints the kernel's
scoped VMEM against `mosaic_tpu.vmem_bytes`' estimate and the program's bytes.
Needs libtpu: `make test-tpu` (libtpu in .libtpu, outside .venv; JAX_PLATFORMS=cpu).
"""
import re

import pytest

pytest.importorskip("libtpu", reason="libtpu lives in .libtpu: `make test-tpu`")

import jax  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from k3jax import tpu_compile  # noqa: E402
from pallas_kernels.decode_attention import mosaic_tpu  # noqa: E402
from test_tpu_compile import device  # noqa: E402,F401  (one device of each topology, mesh set)

# (B, T, H, S, Dk, v_dim)
SHAPES = [(1, 1, 64, 32768, 576, 512), (4, 8, 96, 8192, 576, 512), (16, 1, 8, 4096, 320, 256)]
BF16, I32 = jnp.bfloat16, jnp.int32


@pytest.mark.parametrize("b, t, h, s, dk, dv", SHAPES)
def test_kernel_compiles_at_decode_shapes(device, b, t, h, s, dk, dv):
  fn = lambda q, cache, lengths, pos: mosaic_tpu.decode_attention(
      q, cache, lengths, pos, v_dim=dv, scale=dk ** -0.5)
  row_major = Format(Layout(major_to_minor=(0, 1, 2)), device)
  args = [jax.ShapeDtypeStruct((b, t, h, dk), BF16, sharding=device),
          jax.ShapeDtypeStruct((b, s, dk), BF16, sharding=row_major),
          jax.ShapeDtypeStruct((b,), I32, sharding=device),
          jax.ShapeDtypeStruct((b, t), I32, sharding=device)]
  assert mosaic_tpu.supports(*args[:3], v_dim=dv, interpret=True) is None
  compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  names = {m.split(".")[0] for m in
           re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", text)}
  assert names == {"decode_attention"}, names
  cache_values = [l for l in text.splitlines() if re.search(rf"= \w+\[{b},{s},{dk}\]", l)]
  assert len(cache_values) == 1 and "parameter(" in cache_values[0], cache_values
  line = next(l for l in text.splitlines() if "%decode_attention" in l and "tpu_custom_call" in l)
  vmem = re.search(r'"used_scoped_memory_configs":\[\{[^}]*"size":"(\d+)"', line)
  estimate = mosaic_tpu.vmem_bytes(mosaic_tpu.padded_rows(t, h), mosaic_tpu.block_size(s), dk,
                                   dv, 2)
  print(f"{device.mesh.devices.flat[0].device_kind} B={b} T={t} H={h} S={s}: kernel scoped VMEM "
        f"{int(vmem[1]) / 2 ** 20:.1f} MiB (estimate {estimate / 2 ** 20:.1f} MiB); "
        f"{tpu_compile.Memory.of(compiled)}")
  assert int(vmem[1]) <= mosaic_tpu.VMEM_LIMIT
