"""Sort of the MoE's token copies by expert: XLA reference and a Triton counting sort."""
from pallas_kernels.expert_sort.api import IMPLS, plan, sort_by_expert

__all__ = ["IMPLS", "plan", "sort_by_expert"]
