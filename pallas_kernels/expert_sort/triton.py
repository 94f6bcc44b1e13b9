"""Triton tier: the copies' counting sort by expert in one program (decoding's few copies).

For M = N k copies and E experts, padded to powers of two (Triton tensors), one program holds:
  hit [M, E] = (expert[p] == e);  counts[e] = sum_p hit;  start[e] = sum_{e' < e} counts[e'];
  rank[p] = #{q < p : expert[q] = expert[p]};  inverse[p] = start[expert[p]] + rank[p];
  order[s] = the p with inverse[p] = s.
Stable by construction (rank counts the earlier copies of the same expert), so the outputs
equal the XLA tier's. One launch replaces the XLA tier's key fusion, sort, counts and scatter
(about five kernels a MoE layer in a decode step). The default on GPUs since its tests passed
on an H100 (2026-12-07; `api.TRITON_IS_DEFAULT`).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

MAX_PAIRS = 16384   # M_pad * max(M_pad, E_pad): the [M, M] and [M, E] tiles live in registers
NUM_WARPS = 8


def is_gpu() -> bool:
  return plgpu_triton.is_gpu_device()


def supports(experts, num_experts: int, *, interpret: bool = False) -> str | None:
  """None if the kernel sorts experts [N, k] (an array or ShapeDtypeStruct), else why not."""
  if not interpret and not is_gpu():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  m_pad = pl.next_power_of_2(max(1, experts.size))
  e_pad = pl.next_power_of_2(num_experts)
  if m_pad * max(m_pad, e_pad) > MAX_PAIRS:
    return (f"{experts.size} copies over {num_experts} experts: padded tiles of "
            f"{m_pad} x {max(m_pad, e_pad)} exceed {MAX_PAIRS} (one program's registers)")
  return None


def counting_sort(ex: jax.Array, m: int, e_pad: int) -> tuple[jax.Array, ...]:
  """The module docstring's sort in a program's registers: ex [M_pad] expert ids of the copies
  (copies p >= m carry e_pad) -> (order, inverse [M_pad], counts [E_pad]) int32; entries past
  m (order, inverse) and past E (counts) are not meaningful."""
  p = jnp.arange(ex.shape[0])
  cols = jnp.arange(e_pad)
  hit = (ex[:, None] == cols[None, :]).astype(jnp.int32)                     # [M, E]
  counts = jnp.sum(hit, axis=0)                                               # [E]
  start = jnp.sum(jnp.where(cols[:, None] < cols[None, :], counts[:, None], 0), axis=0)
  first = jnp.sum(hit * start[None, :], axis=1)                               # [M]
  earlier = (ex[None, :] == ex[:, None]) & (p[None, :] < p[:, None])          # [M(p), M(q)]
  inverse = first + jnp.sum(earlier.astype(jnp.int32), axis=1)
  order = jnp.sum(jnp.where((inverse[None, :] == p[:, None]) & (p[None, :] < m),
                            p[None, :], 0), axis=1)
  return order, inverse, counts


def _kernel(experts_ref, order_ref, inverse_ref, counts_ref, *, m: int, e: int):
  m_pad, e_pad = pl.next_power_of_2(m), pl.next_power_of_2(e)
  p = jnp.arange(m_pad)
  ex = plgpu_triton.load(experts_ref.at[pl.ds(0, m_pad)], mask=p < m, other=e_pad)
  order, inverse, counts = counting_sort(ex, m, e_pad)
  plgpu_triton.store(order_ref.at[pl.ds(0, m_pad)], order, mask=p < m)
  plgpu_triton.store(inverse_ref.at[pl.ds(0, m_pad)], inverse, mask=p < m)
  plgpu_triton.store(counts_ref.at[pl.ds(0, e_pad)], counts, mask=jnp.arange(e_pad) < e)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def sort_by_expert(experts: jax.Array, num_experts: int, *, interpret: bool = False
                   ) -> tuple[jax.Array, ...]:
  """experts [N, k] -> (order, inverse [N*k] int32, group_sizes [E] int32), the XLA tier's."""
  if reason := supports(experts, num_experts, interpret=interpret):
    raise ValueError(f"the triton tier does not take this call: {reason}")
  m = experts.size
  return pl.pallas_call(
      functools.partial(_kernel, m=m, e=num_experts),
      out_shape=(jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int32),
                 jax.ShapeDtypeStruct((num_experts,), jnp.int32)),
      grid=(1,),
      compiler_params=plgpu_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="expert_sort",
  )(experts.reshape(-1).astype(jnp.int32))
