"""Tier order and choice shared by the ops whose reference tier is "xla" (ragged_dot, top_k,
moe_gate_up)."""
import dataclasses
from typing import Callable


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
