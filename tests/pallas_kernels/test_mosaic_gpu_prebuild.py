"""The prebuild programs carry exactly the step's Mosaic GPU calls (lowered for CUDA on any host).

XLA keys a built Mosaic GPU kernel by the call's `kernel_hash`: a prebuild program helps only if
its call has the step's hash and module byte for byte. On a GPU (tests/pallas_kernels/
test_mosaic_gpu_prebuild_gpu.py) the prebuilt step computes what the plain one does.
"""
import hashlib
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mosaic_gpu_prebuild as prebuild
from pallas_kernels.ragged_dot import api as ragged_api
from pallas_kernels.ragged_dot import mosaic_gpu as ragged_mgpu

sd = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
_ATTR = r'{name} = "((?:[^"\\]|\\.)*)"'


@pytest.fixture
def hopper(monkeypatch):
  monkeypatch.setattr(ragged_mgpu, "is_hopper", lambda: True)
  monkeypatch.setattr(ragged_mgpu, "_num_sms", lambda interpret: 132)


def _calls(text: str) -> list[tuple[str, str]]:
  """(kernel_hash, module) of each Mosaic GPU call in StableHLO text, as printed."""
  return list(zip(re.findall(_ATTR.format(name="kernel_hash"), text),
                  re.findall(_ATTR.format(name="module"), text)))


def _unescape(printed: str) -> bytes:
  r"""The bytes of an MLIR string attribute as printed (\\ for a backslash, \HH otherwise)."""
  out, i = bytearray(), 0
  while i < len(printed):
    if printed[i] != "\\":
      out += printed[i].encode("latin-1")
      i += 1
    elif printed[i + 1] == "\\":
      out.append(0x5C)
      i += 2
    else:
      out.append(int(printed[i + 1:i + 3], 16))
      i += 3
  return bytes(out)


def _step():
  """Three layers' grouped matmuls and their gradients: 6 calls of 2 distinct kernels."""
  def loss(x, w, gs):
    out = 0.0
    for i in range(3):
      out = out + jnp.sum(ragged_api.ragged_dot(x * (i + 1), w, gs, impl="mosaic_gpu")
                          .astype(jnp.float32))
    return out
  args = (sd(1024, 512), sd(8, 512, 256), sd(8, dtype=jnp.int32))
  return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",))


def test_kernels_of_finds_each_distinct_call_once(hopper):
  lowered = _step()
  hashes = {h for h, _ in _calls(lowered.as_text())}
  assert len(hashes) == 2
  kernels = prebuild.kernels_of(lowered)
  assert len(kernels) == 2
  assert {k.kernel_hash for k in kernels} == {_unescape(h) for h in hashes}
  for kernel in kernels:
    config = dict(kernel.config)
    assert hashlib.sha256(config["module"]).digest() == kernel.kernel_hash  # JAX's hash rule
    assert set(config) >= {"kernel_hash", "module", "use_custom_barrier"}


def test_build_program_carries_the_same_call(hopper):
  lowered = _step()
  step_calls = set(_calls(lowered.as_text()))
  for kernel in prebuild.kernels_of(lowered):
    text = prebuild.build_program(kernel).trace().lower(lowering_platforms=("cuda",)).as_text()
    (call,) = _calls(text)
    assert call in step_calls
    bools = re.findall(r"(use_custom_barrier|skip_device_barrier|uses_xla_collective_metadata)"
                       r" = (true|false)", text)
    assert dict(bools) == {k: str(v).lower() for k, v in kernel.config if isinstance(v, bool)}


def test_other_attributes_travel_in_their_printed_form():
  kernel = prebuild.Kernel((("kernel_hash", b"h" * 32), ("module", b"\x00ML\xef"),
                            ("flag", True), ("count", "3 : i32")))
  text = prebuild.build_program(kernel).trace().lower(lowering_platforms=("cuda",)).as_text()
  assert 'kernel_hash = "hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh"' in text
  assert 'module = "\\00ML\\EF"' in text
  assert "flag = true" in text and "count = 3 : i32" in text


def test_no_kernels_compiles_plainly():
  lowered = jax.jit(lambda x: x * 2).trace(sd(8, dtype=jnp.float32)).lower()
  assert prebuild.kernels_of(lowered) == ()
  compiled, report = prebuild.compile(lowered)
  assert report is None
  assert float(compiled(jnp.ones(8, jnp.float32))[3]) == 2.0


def test_report_names_what_was_left_to_xla():
  report = prebuild.Report(built=9, failed=(("ab12cd34", "RESOURCE_EXHAUSTED: out of memory"),),
                           seconds=4.25)
  assert str(report) == ("Mosaic GPU kernels prebuilt: 9 in 4.2 s; left to XLA: "
                         "ab12cd34: RESOURCE_EXHAUSTED: out of memory")
