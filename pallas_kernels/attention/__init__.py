"""Masked softmax attention for MLA training (report §2.1) with the per-head max logit for
QK-Clip (§2.5): reference, xla_blockwise, cudnn, mosaic_gpu and splash tiers."""
from pallas_kernels.attention.api import IMPLS
from pallas_kernels.attention.api import Plan
from pallas_kernels.attention.api import attention
from pallas_kernels.attention.api import default_impls
from pallas_kernels.attention.api import plan

__all__ = ["IMPLS", "Plan", "attention", "default_impls", "plan"]
