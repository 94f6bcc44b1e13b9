"""MXFP4-weight x bf16-activation matmul and its grouped (MoE expert) form on the K3
checkpoint's packed weights (k3_techniques.md §7): reference, mosaic_gpu and mosaic_tpu tiers."""
from pallas_kernels.mxfp4_matmul.api import EXPERT_FFN_IMPLS
from pallas_kernels.mxfp4_matmul.api import GATE_UP_IMPLS
from pallas_kernels.mxfp4_matmul.api import IMPLS
from pallas_kernels.mxfp4_matmul.api import Plan
from pallas_kernels.mxfp4_matmul.api import default_impls
from pallas_kernels.mxfp4_matmul.api import mxfp4_expert_ffn
from pallas_kernels.mxfp4_matmul.api import mxfp4_gate_up
from pallas_kernels.mxfp4_matmul.api import mxfp4_matmul
from pallas_kernels.mxfp4_matmul.api import mxfp4_ragged_dot
from pallas_kernels.mxfp4_matmul.api import plan
from pallas_kernels.mxfp4_matmul.api import plan_expert_ffn
from pallas_kernels.mxfp4_matmul.api import plan_gate_up
from pallas_kernels.mxfp4_matmul.api import plan_ragged_dot

__all__ = ["EXPERT_FFN_IMPLS", "GATE_UP_IMPLS", "IMPLS", "Plan", "default_impls",
           "mxfp4_expert_ffn", "mxfp4_gate_up", "mxfp4_matmul", "mxfp4_ragged_dot", "plan",
           "plan_expert_ffn", "plan_gate_up", "plan_ragged_dot"]
