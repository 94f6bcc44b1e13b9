"""One `jax.custom_vjp` for the KDA kernel tiers (Mosaic GPU, Mosaic TPU).

A kernel tier supplies `forward(q, k, v, g, beta, h0, segment_ids, options) -> (o, S_T)` and
a dict of backwards `name -> fn(q, k, v, g, beta, h0, segment_ids, d_o, d_S, options, saved)`
returning (dq, dk, dv, dg, dbeta, dh0); `options` is a hashable tuple of static arguments:
(scale, normalize_qk, ..., backward's name). A tier may also supply `forward_saving`, the
forward returning ((o, S_T), saved) with values of its own that its backward reuses instead
of recomputing them (kept as residuals); `saved` is None without it. With normalize_qk the
forward L2-normalises q and k itself (fla's `use_qk_l2norm_in_kernel`); the backwards then
run on the normalised q, k (recomputed by XLA, and options[1] cleared for them) and the norm's
VJP is applied after them, except the backwards named in `normalizing`, which take the raw
q, k with options[1] set and do both themselves.
Every tier also gets "chunked": the VJP of the chunked JAX tier (`chunked.chunk_kda`, bounded
gate), exact in fp32.
"""
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.kda import chunked
from pallas_kernels.kda import reference


def chunked_backward(q, k, v, g, beta, h0, segment_ids, d_o, d_s, options, saved, *,
                     gate_bound: float) -> tuple[jax.Array, ...]:
  """Gradients of (o, S_T) through the chunked tier (it recomputes its own per-chunk states)."""
  del saved
  def f(q, k, v, g, beta, h0):
    o, s = chunked.chunk_kda(q, k, v, g, beta, scale=options[0], initial_state=h0,
                             segment_ids=segment_ids, gate_bound=gate_bound)
    return o, s.astype(jnp.float32)

  _, vjp = jax.vjp(f, q, k, v, g, beta, h0)
  return vjp((d_o, d_s))


def kernel_op(forward: Callable, backwards: dict[str, Callable], gate_bound: float,
              forward_saving: Callable | None = None,
              normalizing: tuple[str, ...] = ()) -> Callable:
  """op(q, k, v, g, beta, h0, segment_ids, options) -> (o, S_T) with the named backward."""
  backwards = dict(backwards, chunked=functools.partial(chunked_backward, gate_bound=gate_bound))

  @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
  def op(q, k, v, g, beta, h0, segment_ids, options):
    return forward(q, k, v, g, beta, h0, segment_ids, options)

  def op_fwd(q, k, v, g, beta, h0, segment_ids, options):
    args = (q, k, v, g, beta, h0, segment_ids)
    if forward_saving is None:
      return forward(*args, options), (*args, None)
    out, saved = forward_saving(*args, options)
    return out, (*args, saved)

  def op_bwd(options, res, cot):
    *res, saved = res
    q, k, *rest = res
    in_xla = options[1] and options[-1] not in normalizing
    if in_xla:
      options = (options[0], False, *options[2:])
      (q, k), norm_vjp = jax.vjp(lambda a, b: (reference.l2_normalize(a),
                                               reference.l2_normalize(b)), q, k)
    grads = backwards[options[-1]](q, k, *rest, *cot, options, saved)
    if in_xla:
      grads = (*norm_vjp(tuple(grads[:2])), *grads[2:])
    return (*grads, None)

  op.defvjp(op_fwd, op_bwd)
  return op
