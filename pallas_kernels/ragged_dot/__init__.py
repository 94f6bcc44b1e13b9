"""Grouped matmul for the MoE experts: `ragged_dot` (forward, d_lhs) and
`transposed_ragged_dot` (d_rhs), with xla / mosaic_gpu / mosaic_tpu tiers."""
from pallas_kernels.ragged_dot.api import IMPLS
from pallas_kernels.ragged_dot.api import Plan
from pallas_kernels.ragged_dot.api import default_impls
from pallas_kernels.ragged_dot.api import plan
from pallas_kernels.ragged_dot.api import plan_transposed
from pallas_kernels.ragged_dot.api import ragged_dot
from pallas_kernels.ragged_dot.api import transposed_ragged_dot

__all__ = ["IMPLS", "Plan", "default_impls", "plan", "plan_transposed", "ragged_dot",
           "transposed_ragged_dot"]
