"""x [M, K] @ w [K, N] for few rows (a decode step's dense projections): xla and triton
(Pallas on the Triton backend) tiers."""
from pallas_kernels.decode_matmul.api import IMPLS
from pallas_kernels.decode_matmul.api import Plan
from pallas_kernels.decode_matmul.api import default_impls
from pallas_kernels.decode_matmul.api import matmul
from pallas_kernels.decode_matmul.api import plan

__all__ = ["IMPLS", "Plan", "default_impls", "matmul", "plan"]
