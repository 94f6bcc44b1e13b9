"""Absorbed-MLA decode attention over the filled part of the latent cache (report §2.1):
reference, xla, mosaic_gpu and mosaic_tpu tiers."""
from pallas_kernels.decode_attention.api import IMPLS
from pallas_kernels.decode_attention.api import Plan
from pallas_kernels.decode_attention.api import decode_attention
from pallas_kernels.decode_attention.api import default_impls
from pallas_kernels.decode_attention.api import plan

__all__ = ["IMPLS", "Plan", "decode_attention", "default_impls", "plan"]
