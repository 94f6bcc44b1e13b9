"""KDA (Kimi Delta Attention) op: `chunk_kda` (train/prefill) and `fused_recurrent_kda` (decode)."""
from pallas_kernels.kda.api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
