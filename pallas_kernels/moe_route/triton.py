"""Triton tier: a decode step's routing in one program (few tokens, few experts).

It loads the router logits [N, E] and the bias, and in registers: s = sigmoid(logits), the
IEEE total-order keys of s + b (`top_k.triton`'s: equal values go to the lower column, as
`lax.top_k`), k picks of the largest key per row (each pick's weight s read at its column),
the weights' normalisation and scale; then the N k copies' experts in copy order (p = n k + j,
a one-hot reduction over [M, N, k]) and `expert_sort.triton.counting_sort`. One launch where
the xla tier takes the top-k kernel, the weights' fusions and the sort (about five kernels a
MoE layer in a decode step). The default on GPUs once its GPU tests pass (`api`).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.expert_sort import triton as sort_triton
from pallas_kernels.top_k import triton as top_k_triton

MAX_ELEMENTS = 16384   # each of [N_pad, E_pad], [M_pad, N_pad, k_pad], [M_pad, M_pad] in registers
NUM_WARPS = 8


def is_gpu() -> bool:
  return plgpu_triton.is_gpu_device()


def supports(logits, top_k: int, *, interpret: bool = False) -> str | None:
  """None if the kernel routes logits [N, E] (an array or ShapeDtypeStruct), else why not."""
  if not interpret and not is_gpu():
    return f"needs a GPU or interpret=True, the default device is {jax.devices()[0].device_kind}"
  n, e = logits.shape
  n_pad, e_pad, k_pad = (pl.next_power_of_2(v) for v in (n, e, top_k))
  m_pad = pl.next_power_of_2(n * top_k)
  for what, size in ((f"logits [{n}, {e}]", n_pad * e_pad),
                     (f"{n * top_k} copies' one-hot", m_pad * n_pad * k_pad),
                     (f"{n * top_k} copies' pairs", m_pad * max(m_pad, e_pad))):
    if size > MAX_ELEMENTS:
      return f"{what}: {size} padded elements > {MAX_ELEMENTS} (one program's registers)"
  return None


def _kernel(logits_ref, bias_ref, w_ref, ex_ref, order_ref, inverse_ref, counts_ref, *,
            k: int, scale: float, normalize: bool):
  n, e = logits_ref.shape
  n_pad, e_pad, k_pad = (pl.next_power_of_2(v) for v in (n, e, k))
  m = n * k
  m_pad = pl.next_power_of_2(m)
  rows = jnp.arange(n_pad)[:, None]                  # [N, 1]
  cols = jnp.arange(e_pad)[None, :]                  # [1, E]
  slots = jnp.arange(k_pad)[None, :]                 # [1, k]
  logits = plgpu_triton.load(logits_ref.at[pl.ds(0, n_pad), pl.ds(0, e_pad)],
                             mask=(rows < n) & (cols < e), other=0.0).astype(jnp.float32)
  bias = plgpu_triton.load(bias_ref.at[pl.ds(0, e_pad)], mask=cols[0] < e, other=0.0)
  s = jax.nn.sigmoid(logits)
  key = top_k_triton.total_order_key(s + bias.astype(jnp.float32)[None, :])

  def pick(j, carry):
    taken, w, experts = carry
    top = jnp.max(jnp.where(taken, top_k_triton.KEY_MIN, key), axis=1, keepdims=True)
    idx = jnp.min(jnp.where(taken | (key != top), e_pad, cols), axis=1, keepdims=True)
    hit = cols == idx
    w_j = jnp.sum(jnp.where(hit, s, 0.0), axis=1, keepdims=True)
    return taken | hit, jnp.where(slots == j, w_j, w), jnp.where(slots == j, idx, experts)

  init = (jnp.broadcast_to(cols >= e, (n_pad, e_pad)), jnp.zeros((n_pad, k_pad), jnp.float32),
          jnp.zeros((n_pad, k_pad), jnp.int32))
  _, w, experts = jax.lax.fori_loop(0, k, pick, init)
  if normalize:
    w = w / (jnp.sum(w, axis=1, keepdims=True) + 1e-20)
  real = (rows < n) & (slots < k)
  out = (pl.ds(0, n_pad), pl.ds(0, k_pad))
  plgpu_triton.store(w_ref.at[out], w * scale, mask=real)
  plgpu_triton.store(ex_ref.at[out], experts, mask=real)
  p = jnp.arange(m_pad)
  copy = (rows * k + slots)[None] == p[:, None, None]                       # [M, N, k]
  ex = jnp.sum(jnp.sum(jnp.where(copy & real[None], experts[None], 0), axis=2), axis=1)
  ex = jnp.where(p < m, ex, e_pad)
  order, inverse, counts = sort_triton.counting_sort(ex, m, e_pad)
  plgpu_triton.store(order_ref.at[pl.ds(0, m_pad)], order, mask=p < m)
  plgpu_triton.store(inverse_ref.at[pl.ds(0, m_pad)], inverse, mask=p < m)
  plgpu_triton.store(counts_ref.at[pl.ds(0, e_pad)], counts, mask=cols[0] < e)


@functools.partial(jax.jit, static_argnames=("top_k", "scale", "normalize", "interpret"))
def route_and_sort(logits: jax.Array, bias: jax.Array, top_k: int, *, scale: float,
                   normalize: bool, interpret: bool = False) -> tuple[jax.Array, ...]:
  """`xla.route_and_sort` in one launch (the experts, order, inverse and counts equal its;
  the weights to fp32 rounding: the normalising sum's order differs)."""
  if reason := supports(logits, top_k, interpret=interpret):
    raise ValueError(f"the triton tier does not take this call: {reason}")
  n, e = logits.shape
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return pl.pallas_call(
      functools.partial(_kernel, k=top_k, scale=scale, normalize=normalize),
      out_shape=(jax.ShapeDtypeStruct((n, top_k), jnp.float32), i32(n, top_k),
                 i32(n * top_k), i32(n * top_k), i32(e)),
      grid=(1,),
      compiler_params=plgpu_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="moe_route",
  )(logits.astype(jnp.float32), bias.astype(jnp.float32))
