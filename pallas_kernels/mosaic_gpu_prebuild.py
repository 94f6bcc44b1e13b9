"""A lowered program's Mosaic GPU kernels built in parallel, before XLA compiles the program.

XLA builds each distinct Mosaic GPU kernel (its MLIR to PTX to a cubin, its host code JIT-linked)
while it compiles the program that calls it, one kernel after another on the one thread that
emits the program: on the H200, k3_small's train step builds 10 such kernels in 17.4 s of its
95 s cold compile (BENCHMARKS.md, "Train step"). The kernels land in a process-wide cache keyed
by the `kernel_hash` that JAX's lowering puts in each call's backend config (the SHA-256 of the
serialized kernel module), and XLA builds a kernel whose hash is there no more.

`compile(lowered)` reads the distinct Mosaic GPU calls of a lowered program, compiles for each a
program of that one call (the same backend config: the same hash and module) on a thread pool,
and meanwhile compiles `lowered` itself: the kernels are built on other threads while the main
compile runs its HLO passes (k3_small: the first 30 s), so its emission finds them built. These
one-call programs are compiled, never run. Where one fails, XLA builds that kernel itself, as
without the prebuild: the report says so, nothing else changes.
"""
import concurrent.futures
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax._src.interpreters import mlir  # custom_call, as JAX's Mosaic GPU lowering
from jax._src.lib.mlir import ir

TARGET = "mosaic_gpu_v2"  # JAX's Mosaic GPU custom call


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One distinct Mosaic GPU call: its backend config's attributes by name, as bytes (string
  attributes), bools, or else the attribute's printed form (str)."""
  config: tuple[tuple[str, bytes | bool | str], ...]

  @property
  def kernel_hash(self) -> bytes:
    return dict(self.config)["kernel_hash"]


@dataclasses.dataclass(frozen=True)
class Report:
  """What the prebuild did: kernels built, kernels that failed (hash prefix, error), and the
  seconds from its start to its last kernel built."""
  built: int
  failed: tuple[tuple[str, str], ...]
  seconds: float

  def __str__(self) -> str:
    text = f"Mosaic GPU kernels prebuilt: {self.built} in {self.seconds:.1f} s"
    if self.failed:
      text += "; left to XLA: " + "; ".join(f"{h}: {e}" for h, e in self.failed)
    return text


def kernels_of(lowered) -> tuple[Kernel, ...]:
  """The distinct Mosaic GPU calls of a `jax.stages.Lowered` with a typed-FFI backend config, in
  program order."""
  found: dict[bytes, Kernel] = {}

  def visit(op):
    if (op.name == "stablehlo.custom_call"
        and ir.StringAttr(op.attributes["call_target_name"]).value == TARGET
        and "mhlo.backend_config" in op.attributes):  # else XLA builds the kernel itself
      attrs = ir.DictAttr(op.attributes["mhlo.backend_config"])
      config = []
      for i in range(len(attrs)):
        named = attrs[i]
        if isinstance(named.attr, ir.StringAttr):
          config.append((named.name, named.attr.value_bytes))
        elif isinstance(named.attr, ir.BoolAttr):
          config.append((named.name, named.attr.value))
        else:
          config.append((named.name, str(named.attr)))
      kernel = Kernel(tuple(config))
      found.setdefault(kernel.kernel_hash, kernel)
    return ir.WalkResult.ADVANCE

  lowered.compiler_ir("stablehlo").operation.walk(visit)
  return tuple(found.values())


_build_p = jex_core.Primitive("mosaic_gpu_prebuild")
_build_p.def_abstract_eval(lambda *, kernel: jax.core.ShapedArray((1,), jnp.int8))


def _attribute(value: bytes | bool | str) -> ir.Attribute:
  if isinstance(value, bytes):
    return ir.StringAttr.get(value)
  if isinstance(value, bool):
    return ir.BoolAttr.get(value)
  return ir.Attribute.parse(value)


def _build_lowering(ctx, *, kernel: Kernel):
  del ctx
  config = {name: _attribute(value) for name, value in kernel.config}
  i8 = ir.RankedTensorType.get([1], ir.IntegerType.get_signless(8))
  return mlir.custom_call(TARGET, result_types=[i8],
                          operands=[], backend_config=config, api_version=4,
                          operand_layouts=[], result_layouts=[[0]]).results


mlir.register_lowering(_build_p, _build_lowering, platform="cuda")


def build_program(kernel: Kernel):
  """A program of the one call `kernel` (no operands: the kernel is built from its backend config
  alone; the program is compiled, never run)."""
  return jax.jit(lambda: _build_p.bind(kernel=kernel))


def _build(kernel: Kernel) -> float:
  build_program(kernel).lower().compile()
  return time.perf_counter()


def compile(lowered, *, prebuild: bool = True,  # pylint: disable=redefined-builtin
            max_workers: int | None = None, compiler_options: dict | None = None):
  """`lowered.compile(compiler_options)`, with its Mosaic GPU kernels built in parallel meanwhile
  (on a CUDA backend, when `prebuild`). Returns (compiled, Report or None)."""
  kernels = kernels_of(lowered) if prebuild and jax.default_backend() == "gpu" else ()
  if not kernels:
    return lowered.compile(compiler_options), None
  t0 = time.perf_counter()
  workers = max_workers or min(len(kernels), max(1, (os.cpu_count() or 2) - 1))
  with concurrent.futures.ThreadPoolExecutor(workers, "mosaic_gpu_prebuild") as pool:
    futures = [pool.submit(_build, k) for k in kernels]
    compiled = lowered.compile(compiler_options)
    failed, done = [], [t0]
    for kernel, future in zip(kernels, futures):
      if (error := future.exception()) is not None:
        first_line = (str(error) or type(error).__name__).splitlines()[0]
        failed.append((kernel.kernel_hash[:4].hex(), first_line[:200]))
      else:
        done.append(future.result())
  return compiled, Report(len(kernels) - len(failed), tuple(failed), max(done) - t0)
