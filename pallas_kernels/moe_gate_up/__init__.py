"""The MoE experts' first product, gather + grouped [W1 | W3] matmul + SiTU-GLU, with xla and
triton (Pallas on the Triton backend) tiers."""
from pallas_kernels.moe_gate_up.api import IMPLS
from pallas_kernels.moe_gate_up.api import Plan
from pallas_kernels.moe_gate_up.api import default_impls
from pallas_kernels.moe_gate_up.api import gate_up
from pallas_kernels.moe_gate_up.api import plan

__all__ = ["IMPLS", "Plan", "default_impls", "gate_up", "plan"]
