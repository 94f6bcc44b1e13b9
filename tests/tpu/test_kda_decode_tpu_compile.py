"""The fused KDA decode step's Mosaic TPU kernel (`pallas_kernels/kda_decode/mosaic_tpu.py`)
compiled by libtpu for v5e, v5p and v6e without a TPU (`k3jax.tpu_compile`), at k3_small's
(8 heads) and K3's (96 heads) decode shapes: the program holds our kernel, found by name, its
scoped VMEM within the limit, and, inside a loop that carries them, no copy of the state or the
conv tail in the loop's body (both are written in place; the entry may relayout the tail once). `pytest -s` prints the kernel's scoped VMEM against
`mosaic_tpu.vmem_bytes`' estimate.
Needs libtpu: `make test-tpu` (libtpu in .libtpu, outside .venv; JAX_PLATFORMS=cpu).
"""
import re

import pytest

pytest.importorskip("libtpu", reason="libtpu lives in .libtpu: `make test-tpu`")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import kda_decode  # noqa: E402
from pallas_kernels.kda_decode import mosaic_tpu  # noqa: E402
from test_tpu_compile import device  # noqa: E402,F401  (one device of each topology, mesh set)

K = R = 128
W = 4


@pytest.mark.parametrize("b, h", [(16, 8), (16, 96), (1, 8)])
def test_kernel_compiles_and_updates_in_place(device, b, h):
  sds = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
  fixed = [sds((b, kda_decode.proj_width(h, K, R))), sds((W, 3, h * K)), sds((R, h, K)),
           sds((h,), jnp.float32), sds((h * K,), jnp.float32), sds((K,), jnp.float32),
           sds((b,), jnp.int32)]
  carried = [sds((b, W - 1, 3, h * K)), sds((b, h, K, K), jnp.float32)]
  assert mosaic_tpu.supports(fixed[0], carried[0], f_b=fixed[2], interpret=True) is None

  def loop(proj, conv_w, f_b, a_log, dt_bias, o_norm, lengths, tail, state):
    def body(i, c):
      return mosaic_tpu.kda_decode_step(
          proj, c[0], conv_w, f_b, a_log, dt_bias, o_norm, c[1], lengths, gate="lower_bound",
          lower_bound=-5.0, scale=K ** -0.5, norm_eps=1e-5)[1:]
    return jax.lax.fori_loop(0, 4, body, (tail, state))

  compiled = jax.jit(loop, donate_argnums=(7, 8)).lower(*fixed, *carried).compile()
  text = compiled.as_text()
  names = {m.split(".")[0] for m in
           re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", text)}
  assert names == {"kda_decode_step"}, names
  shapes = (f"f32[{b},{h},{K},{K}]", f"bf16[{b},{W - 1},3,{h * K}]")
  body = text[text.index("\n%wide."):text.index("\nENTRY")]   # the loop's computations
  copies = [l for l in body.splitlines() if " copy(" in l and any(s in l for s in shapes)]
  assert not copies, copies[:2]
  line = next(l for l in text.splitlines() if "%kda_decode_step" in l and "tpu_custom_call" in l)
  vmem = re.search(r'"used_scoped_memory_configs":\[\{[^}]*"size":"(\d+)"', line)
  estimate = mosaic_tpu.vmem_bytes(b, K, R, W, 2)
  print(f"{device.mesh.devices.flat[0].device_kind} B={b} H={h}: kernel scoped VMEM "
        f"{int(vmem[1]) / 2 ** 20:.1f} MiB (estimate {estimate / 2 ** 20:.1f} MiB)")
  assert int(vmem[1]) <= mosaic_tpu.VMEM_LIMIT
