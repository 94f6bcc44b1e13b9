"""One KDA layer's decode step fused (conv tail, gates, recurrence, gated output norm)."""
from pallas_kernels.kda_decode.api import IMPLS, plan, kda_decode_step, proj_width

__all__ = ["IMPLS", "kda_decode_step", "plan", "proj_width"]
