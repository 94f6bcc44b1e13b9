"""The MoE router's selection and weights (report Eq. 13), and for decoding the token copies
sorted by expert in one call: xla and triton tiers."""
from pallas_kernels.moe_route.api import IMPLS
from pallas_kernels.moe_route.api import Plan
from pallas_kernels.moe_route.api import plan
from pallas_kernels.moe_route.api import route
from pallas_kernels.moe_route.api import route_and_sort
from pallas_kernels.moe_route.api import route_dense

__all__ = ["IMPLS", "Plan", "plan", "route", "route_and_sort", "route_dense"]
