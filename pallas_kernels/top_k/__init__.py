"""Row-wise top-k of the MoE router's scores (report Eq. 13, QB's cutoffs §2.3.3), with xla and
triton (Pallas on the Triton backend) tiers."""
from pallas_kernels.top_k.api import IMPLS
from pallas_kernels.top_k.api import Plan
from pallas_kernels.top_k.api import default_impls
from pallas_kernels.top_k.api import plan
from pallas_kernels.top_k.api import top_k

__all__ = ["IMPLS", "Plan", "default_impls", "plan", "top_k"]
