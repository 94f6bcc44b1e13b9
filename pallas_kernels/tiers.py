"""Tier order shared by the ops whose reference tier is "xla" (ragged_dot, top_k)."""


def order(impl: str | None, impls: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
  """Tiers to try for `impl`: `default` for None, else [impl, "xla"] (fail closed to XLA).

  Raises ValueError for an impl outside `impls`."""
  if impl is None:
    return default
  if impl not in impls:
    raise ValueError(f"impl must be None or one of {impls}, got {impl!r}")
  return (impl,) if impl == "xla" else (impl, "xla")
