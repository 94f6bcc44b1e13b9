"""Tier order and choice shared by the ops whose reference tier is "xla" (ragged_dot, top_k,
moe_gate_up, expert_sort), and the addressing limit every Pallas Triton tier declines by."""
import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu_triton


@dataclasses.dataclass(frozen=True)
class Plan:
  """The tier that runs one call and the (tier, reason) of each tier that declined it."""
  impl: str
  declined: tuple[tuple[str, str], ...]
  interpret: bool


def order(impl: str | None, impls: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
  """Tiers to try for `impl`: `default` for None, else [impl, "xla"] (fail closed to XLA).

  Raises ValueError for an impl outside `impls`."""
  if impl is None:
    return default
  if impl not in impls:
    raise ValueError(f"impl must be None or one of {impls}, got {impl!r}")
  return (impl,) if impl == "xla" else (impl, "xla")


def first_supported(names: tuple[str, ...], reason_of: Callable[[str], str | None],
                    interpret: bool) -> Plan:
  """The Plan of the first tier in `names` whose `reason_of(name)` is None (the last one, xla,
  takes every valid call)."""
  declined = []
  for name in names:
    reason = reason_of(name)
    if reason is None:
      return Plan(name, tuple(declined), interpret)
    declined.append((name, reason))
  raise AssertionError("the xla tier takes every call")


def triton_offsets_reason(**arrays) -> str | None:
  """Why a Pallas Triton kernel (jax 0.11.2) would address one of `arrays` (arrays or
  ShapeDtypeStructs, by name) wrongly, or None.

  Its lowering computes element offsets in 32 bits for an array of up to 2^32 bytes and in 64
  bits above, and Triton sign-extends 32-bit offsets: an array of more than 2^31 and at most
  2^32 bytes is read at wrapped addresses past its first 2 GiB (the MXFP4 grouped kernel's
  lowered module: i32 offsets for 256 experts of K3's gate/up, 2.8 GB, i64 for 896; on the
  H200 that call's output was 75% off the reference)."""
  for name, a in arrays.items():
    nbytes = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
    if 2 ** 31 < nbytes <= 2 ** 32:
      return (f"{name} holds {nbytes} bytes, in (2 GiB, 4 GiB]: Pallas Triton's 32-bit "
              f"offsets, sign-extended, would wrap past 2 GiB")
  return None


def gpu_compute_capability() -> int:
  """The default device's (or the abstract mesh's, when lowering ahead of time for one) NVIDIA
  compute capability, e.g. 90 for Hopper; 0 if it is not an NVIDIA GPU."""
  if not plgpu_triton.is_gpu_device():
    return 0
  try:
    return plgpu_triton.get_gpu_info().compute_capability
  except ValueError:
    return 0
