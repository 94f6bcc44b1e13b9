"""Stable LatentMoE (report §2.3, Eq. 11-12; k3_techniques.md §4).

  s = sigmoid(x W_r)                       fp32, on the full-width x
  T = argtop_k(s + b);  p_j = s_j / sum_{r in T} s_r * routed_scaling_factor
  z = x W_down                             d -> l
  u = sum_{j in T} p_j * W2_j[SiTU(W1_j z, W3_j z)]
  y = Shared(x) + RMSNorm(u) W_up          l -> d

The bias b (`e_score_correction_bias`) only selects experts, never weights them, and is set by
Quantile Balancing (`k3jax.quantile_balancing`) after each optimizer step. Dispatch is dropless:
token copies are sorted by expert and run through grouped matmuls (`jax.lax.ragged_dot`); on
Hopper GPUs the gather, the W1/W3 matmul and SiTU run as one kernel (`fused_gate_up`).

MX formats (k3_techniques.md §7, `k3jax.mx`): with `qat`, the routed experts' W1/W3/W2 are
fake-quantized to MXFP4 (blocks of 32 along each expert's input dim) where the layer reads
them, and their inputs z and h to MXFP8 E4M3 (blocks of 32 along the reduction axis) in
`grouped_experts`, with straight-through gradients; the router, Quantile Balancing, the shared
experts and the latent projections see unquantized values. With `expert_format="mxfp4"` the
routed experts are held packed in the K3 checkpoint layout (`PackedWeight`) and run through
`pallas_kernels.mxfp4_matmul` (inference).
"""
import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import k3jax  # noqa: F401  (turns off eager sharding before parameters are created)
from k3jax import mx, norms, params
from k3jax import quantile_balancing as qb
from k3jax import situ as situ_lib
from pallas_kernels import expert_sort
from pallas_kernels.expert_sort import xla as expert_sort_xla
from pallas_kernels import decode_matmul
from pallas_kernels import moe_gate_up
from pallas_kernels import mxfp4_matmul
from pallas_kernels import moe_route

RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
BIAS_METHODS = ("quantile", "quantile_exact", "sign", "none")
EXPERT_FORMATS = ("float", "mxfp4")
EXPERT_WEIGHTS = ("w1", "w3", "w2")
DECODE_EXPERTS = ("sorted", "gathered", "all")


class MoEBias(nnx.Variable):
  """The router's selection bias [E] (fp32). Not an `nnx.Param`: optimizers never see it."""


class PackedExperts(nnx.Variable):
  """A routed expert weight's packed MXFP4 bytes or E8M0 scales (uint8, K3 checkpoint layout;
  `expert_format="mxfp4"`). Not an `nnx.Param`: nothing trains them."""


class PackedWeight(NamedTuple):
  """The routed experts' weight in the K3 checkpoint layout (`k3jax.mx.pack_k3`): packed uint8
  [E, out, in/2] (two E2M1 codes a byte) and scale uint8 [E, out, in/32] (E8M0)."""
  packed: jax.Array
  scale: jax.Array


ExpertWeight = jax.Array | PackedWeight


def expert_shape(w: ExpertWeight) -> tuple[int, int, int]:
  """[E, in, out] of an expert weight: a float [E, in, out] or a `PackedWeight`."""
  if isinstance(w, PackedWeight):
    num_experts, out, half_in = w.packed.shape
    return num_experts, 2 * half_in, out
  return tuple(w.shape)


def expert_input(a: jax.Array, qat: bool) -> jax.Array:
  """An expert GEMM's input a [M, K]: with `qat`, MXFP8 (E4M3) fake-quantized in blocks of 32
  along K (k3_techniques.md §7, straight-through gradient); else a unchanged."""
  return mx.fake_quantize(a, "mxfp8", axis=-1) if qat else a


def expert_matmul(x: jax.Array, w: ExpertWeight, group_sizes: jax.Array,
                  ragged_dot: RaggedDot = jax.lax.ragged_dot) -> jax.Array:
  """x [M, K] (rows grouped by expert, `group_sizes` [E]) times each row's expert -> [M, N]:
  a float w [E, K, N] through `ragged_dot`; a `PackedWeight` ([E, N, K/2]) through
  `pallas_kernels.mxfp4_matmul.mxfp4_ragged_dot`, in x's dtype."""
  if isinstance(w, PackedWeight):
    return mxfp4_matmul.mxfp4_ragged_dot(x, w.packed, w.scale, group_sizes,
                                         preferred_element_type=x.dtype)
  return ragged_dot(x, w, group_sizes)


def route(x: jax.Array, router_kernel: jax.Array, bias: jax.Array, top_k: int,
          routed_scaling_factor: float, norm_topk_prob: bool, *, return_cutoffs: bool = False,
          logits: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """Sigmoid top-k router with a selection-only bias (Eq. 13).

  x [N, d], router_kernel [d, E], bias [E] -> (weights [N, k] fp32, experts [N, k] int32,
  scores [N, E] fp32). Weights come from the unbiased scores, renormalised over the selected
  experts (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`. `return_cutoffs`
  appends QB's token cutoffs alpha [N] fp32, the (k+1)-th largest s + b (§2.3.3), from the
  same top-(k+1) as the selection (one top-k of [N, E] instead of two; needs k < E). The
  selection and weights are `pallas_kernels.moe_route.route` (its top-k
  `pallas_kernels.top_k`: on GPUs a Pallas kernel, in place of XLA's sort). `logits`: x's
  router logits [N, E] fp32 where the caller formed them (`LatentMoE.prepare_decode`'s merged
  product), else `router_logits(x, router_kernel)`.
  """
  if x.ndim != 2 or router_kernel.ndim != 2 or x.shape[1] != router_kernel.shape[0]:
    raise ValueError(f"x must be [N, d] and router_kernel [d, E], got {x.shape} and "
                     f"{router_kernel.shape}")
  num_experts = router_kernel.shape[1]
  if bias.shape != (num_experts,):
    raise ValueError(f"bias must have shape ({num_experts},), got {bias.shape}")
  top = num_experts - 1 if return_cutoffs else num_experts
  if not 1 <= top_k <= top:
    raise ValueError(f"top_k must be in [1, {top}]{' with return_cutoffs' * return_cutoffs}, "
                     f"got {top_k}")
  if logits is None:
    logits = router_logits(x, router_kernel)
  return moe_route.route(logits, bias, top_k, scale=routed_scaling_factor,
                         normalize=norm_topk_prob, cutoffs=return_cutoffs)


def _split3(a: jax.Array) -> jax.Array:
  """fp32 a [..., n] -> bf16 [3, ..., n] with hi + mid + lo == a to fp32 precision.

  hi and mid are truncations (their bits end at a bf16 boundary, so they are bf16 values
  whatever converts XLA elides), lo the bf16 rounding of the rest.
  """
  def truncate(v):
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
  a = a.astype(jnp.float32)
  hi = truncate(a)
  mid = truncate(a - hi)
  return jnp.stack([hi, mid, a - hi - mid]).astype(jnp.bfloat16)


def _bf16_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def router_logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """Router logits x [N, d] @ kernel [d, E] in fp32 (Eq. 13).

  bf16 x: kernel = hi + mid + lo in bf16 (`_split3`) and one bf16 matmul [N, d] x [d, 3E]
  with fp32 accumulation forms the three products exactly, as a HIGHEST fp32 matmul would,
  at bf16 tensor-core speed (H200, k3_small's 16384 x 1024 x 64: 15 us of device time
  against 62 us for XLA's fp32 HIGHEST matmul). A bf16 kernel (a bf16-served model) needs no
  split: its products are exact in one bf16 matmul with fp32 accumulation (in a decode loop
  the split's three copies of the kernel cost a kernel launch a layer every step). The VJP
  splits the same way:
  dkernel = x^T [g_hi | g_mid | g_lo] (exact products), dx from the bf16x3 products
  g_hi k_hi + g_hi k_mid + g_mid k_hi (dx is rounded to bf16). Other dtypes run fp32 HIGHEST
  matmuls.
  """
  if x.dtype != jnp.bfloat16:
    return jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  if kernel.dtype == jnp.bfloat16:
    return _bf16_dot(x, kernel)
  parts = _split3(kernel)
  out = _bf16_dot(x, jnp.concatenate(list(parts), axis=1)).reshape(x.shape[0], 3, -1)
  return out[:, 2] + out[:, 1] + out[:, 0]


def _router_logits_fwd(x, kernel):
  return router_logits(x, kernel), (x, kernel)


def _router_logits_bwd(res, g):
  x, kernel = res
  if x.dtype != jnp.bfloat16:
    hi = jax.lax.Precision.HIGHEST
    dx = jnp.dot(g, kernel.astype(jnp.float32).T, precision=hi)
    dk = jnp.dot(x.astype(jnp.float32).T, g, precision=hi)
    return dx.astype(x.dtype), dk.astype(kernel.dtype)
  gp, kp = _split3(g), _split3(kernel)
  dk = _bf16_dot(x.T, jnp.concatenate(list(gp), axis=1)).reshape(x.shape[1], 3, -1)
  dx = _bf16_dot(jnp.concatenate([gp[0], gp[0], gp[1]], axis=1),
                 jnp.concatenate([kp[0], kp[1], kp[0]], axis=1).T)
  return dx.astype(x.dtype), (dk[:, 2] + dk[:, 1] + dk[:, 0]).astype(kernel.dtype)


router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)


def routed_experts(z: jax.Array, weights: jax.Array, experts: jax.Array, w1: ExpertWeight,
                   w3: ExpertWeight, w2: ExpertWeight, beta1: float, beta2: float,
                   ragged_dot: RaggedDot = jax.lax.ragged_dot, gate_up_impl: str | None = "xla",
                   gate_up_train: str = "kernel", interpret: bool = False,
                   qat: bool = False) -> jax.Array:
  """Dropless routed SiTU-GLU experts: u = sum_j p_j * W2_j[SiTU(W1_j z, W3_j z)] (Eq. 11).

  z [N, l], weights [N, k], experts [N, k] int32, w1/w3 [E, l, m], w2 [E, m, l] (or each a
  `PackedWeight` in the checkpoint layout [E, out, in/2]) -> u [N, l]. The N*k token copies
  are stably sorted by expert and run through grouped matmuls;
  `ragged_dot(lhs [M, K], rhs [E, K, P], group_sizes [E] int32) -> [M, P]` can be replaced by a
  grouped-matmul kernel. The first product is `fused_gate_up` (gather + W1/W3 + SiTU in one
  kernel) when `pallas_kernels.moe_gate_up` picks a kernel tier for `gate_up_impl` (None: the
  platform default), else `dispatch` + `expert_ffn`; gate_up_train picks its backward
  (`GATE_UP_TRAIN`, see `fused_gate_up`). The routing weight is applied after W2
  (late routing weights); copies are un-permuted and summed over k in fp32 (no capacity, no
  drop). `dispatch` and `combine` are the permutations, with gather-only VJPs. qat: MXFP8
  expert inputs (`expert_input`).
  """
  n_tok, lat = z.shape
  s1, s3, s2 = (expert_shape(w) for w in (w1, w3, w2))
  num_experts = s1[0]
  if weights.shape != experts.shape or weights.shape[0] != n_tok:
    raise ValueError(f"weights {weights.shape} and experts {experts.shape} must both be "
                     f"[N, k] with N = {n_tok}")
  if s1[:2] != (num_experts, lat) or s3 != s1 or s2 != (num_experts, s1[2], lat):
    raise ValueError(f"expected w1, w3 [E, {lat}, m] and w2 [E, m, {lat}] ([E, in, out]), got "
                     f"{s1}, {s3}, {s2}")
  if gate_up_train not in GATE_UP_TRAIN:
    raise ValueError(f"gate_up_train must be one of {GATE_UP_TRAIN}, got {gate_up_train!r}")
  with jax.named_scope("moe_dispatch"):
    order, inverse, group_sizes = sort_by_expert(experts, num_experts)
  return grouped_experts(z, weights, order, inverse, group_sizes, w1, w3, w2, beta1, beta2,
                         ragged_dot, gate_up_impl, gate_up_train, interpret, qat=qat)


def gathered_experts(z: jax.Array, weights: jax.Array, experts: jax.Array, w1: jax.Array,
                     w3: jax.Array, w2: jax.Array, beta1: float, beta2: float,
                     qat: bool = False) -> jax.Array:
  """`routed_experts` for few token copies (decoding): each copy's W1/W3/W2 gathered
  [N, k, in, out] and applied by batched matmuls, with no sort, permutation or grouped kernel
  (Eq. 11). It reads N*k expert weights, repeats included, where the sorted path reads each
  selected expert once: for N*k <= E. Float weights only; fp32 accumulation, each product
  rounded to z's dtype as the grouped matmuls' outputs are, combined over k in fp32."""
  z = expert_input(z, qat)
  dot = lambda a, spec, w: jnp.einsum(spec, a, jnp.take(w, experts, axis=0),
                                      preferred_element_type=jnp.float32).astype(z.dtype)
  h = situ_lib.situ(dot(z, "nl,nklm->nkm", w1), dot(z, "nl,nklm->nkm", w3), beta1, beta2)
  out = dot(expert_input(h.astype(z.dtype), qat), "nkm,nkml->nkl", w2)
  return jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32),
                    out.astype(jnp.float32)).astype(z.dtype)


def grouped_experts(z: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array,
                    group_sizes: jax.Array, w1: ExpertWeight, w3: ExpertWeight,
                    w2: ExpertWeight, beta1: float, beta2: float,
                    ragged_dot: RaggedDot = jax.lax.ragged_dot, gate_up_impl: str | None = "xla",
                    gate_up_train: str = "kernel", interpret: bool = False,
                    qat: bool = False) -> jax.Array:
  """`routed_experts` past the sort: the copies listed by `order` (grouped by expert,
  `group_sizes` [E] int32) through the experts, combined with `weights` (Eq. 11).

  z [N, l], weights [N, k], order / inverse [N*k] int32 -> u [N, l]. Copies in expert order
  past sum(group_sizes) belong to no expert and give zero rows (the expert-parallel receive
  buffer's padding, `k3jax.expert_parallel`). qat: z and h quantized by `expert_input`; z per
  token row before the gather (the same as after it), so the fused kernel gathers quantized
  rows. Packed weights without qat take `pallas_kernels.mxfp4_matmul.mxfp4_expert_ffn` (gather,
  W1 / W3, SiTU, W2 in one launch, then the combine) where its platform default is the kernel
  and gate_up_impl is None or "triton"; else `expert_products`, then `combine`.
  """
  top_k = weights.shape[1]
  z = expert_input(z, qat)
  if isinstance(w1, PackedWeight) and not qat and gate_up_impl in (None, "triton"):
    ws = (w1.packed, w1.scale, w3.packed, w3.scale, w2.packed, w2.scale)
    if mxfp4_matmul.plan_expert_ffn(z, weights, order, inverse, *ws, group_sizes,
                                    interpret=interpret).impl == "triton":
      with jax.named_scope("moe_experts"):
        u = mxfp4_matmul.mxfp4_expert_ffn(z, weights, order, inverse, *ws, group_sizes,
                                          beta1=beta1, beta2=beta2, impl="triton",
                                          interpret=interpret)
      return u.astype(z.dtype)
  out = expert_products(z, order, inverse, top_k, group_sizes, w1, w3, w2, beta1, beta2,
                        ragged_dot, gate_up_impl, gate_up_train, interpret, qat)
  with jax.named_scope("moe_combine"):
    return combine(out, weights, order, inverse).astype(z.dtype)


def expert_products(z: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int,
                    group_sizes: jax.Array, w1: ExpertWeight, w3: ExpertWeight,
                    w2: ExpertWeight, beta1: float, beta2: float,
                    ragged_dot: RaggedDot = jax.lax.ragged_dot, gate_up_impl: str | None = "xla",
                    gate_up_train: str = "kernel", interpret: bool = False,
                    qat: bool = False) -> jax.Array:
  """W2_e[SiTU(W1_e x, W3_e x)] of the copies in expert order, x = z[order // top_k]: z [N, l]
  (already through `expert_input`) -> [N*k, l], uncombined (Eq. 11). Packed weights take the
  fused MXFP4 gate/up kernel (`mxfp4_gate_up`: gather, W1 / W3 and SiTU in one launch) with
  gate_up_impl "triton", or None where its platform default is that kernel (Hopper); float
  weights the tier `pallas_kernels.moe_gate_up` plans for gate_up_impl; else `dispatch`, then
  `expert_ffn`."""
  packed = isinstance(w1, PackedWeight)
  if packed:
    fuse = gate_up_impl == "triton" or (gate_up_impl is None and mxfp4_matmul.plan_gate_up(
        z, order // top_k, w1.packed, w1.scale, w3.packed, w3.scale, group_sizes,
        interpret=interpret).impl == "triton")
    tier = "triton" if fuse else "xla"
  else:
    tier = moe_gate_up.plan(z, order, w1, w3, group_sizes, impl=gate_up_impl,
                            interpret=interpret).impl
  if tier == "xla":
    with jax.named_scope("moe_dispatch"):
      xs = dispatch(z, order, inverse, top_k)
    with jax.named_scope("moe_experts"):
      return expert_ffn(xs, w1, w3, w2, group_sizes, beta1, beta2, ragged_dot, qat)
  with jax.named_scope("moe_experts"):
    if packed:
      h = mxfp4_matmul.mxfp4_gate_up(z, order // top_k, w1.packed, w1.scale, w3.packed,
                                     w3.scale, group_sizes, beta1=beta1, beta2=beta2,
                                     impl="triton", interpret=interpret)
    else:
      spec = GateUpSpec(top_k, beta1, beta2, ragged_dot, tier, interpret, gate_up_train)
      h = fused_gate_up(z, order, inverse, w1, w3, group_sizes, spec)
    return expert_down(h, w2, group_sizes, ragged_dot, qat)


# The all-experts path computes E / k times the copies' products: at 64 rows an expert's
# products still cost less than reading its weights.
ALL_EXPERTS_MAX_TOKENS = 64


def dense_weights(weights: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
  """weights / experts [N, k] -> p [N, E] fp32: p_ne = weights[n, j] where experts[n, j] = e,
  else 0 (`moe_route.route_dense` forms it from the logits)."""
  return jnp.sum(jnp.where(experts[:, :, None] == jnp.arange(num_experts),
                           weights[:, :, None].astype(jnp.float32), 0.0), axis=1)


def all_experts(z: jax.Array, dense: jax.Array, w1: ExpertWeight, w3: ExpertWeight,
                w2: ExpertWeight, beta1: float, beta2: float,
                ragged_dot: RaggedDot = jax.lax.ragged_dot, gate_up_impl: str | None = "xla",
                interpret: bool = False, qat: bool = False) -> jax.Array:
  """`routed_experts` with every expert applied to every token (decoding, where N tokens'
  N*k copies touch most experts): u = sum_e p_ne W2_e[SiTU(W1_e z_n, W3_e z_n)] (Eq. 11 over
  all e, p_ne = 0 where token n did not pick expert e).

  z [N, l], dense p [N, E] (`dense_weights`, `moe_route.route_dense`) -> u [N, l]. The E*N
  products run as E groups of N rows through `expert_products` (the copies' order is a
  constant: no sort, no permutation), then one weighted sum over experts in fp32. It reads
  every expert once where the sorted path reads the touched ones (at k3_small's B 16, k 8 of
  64: 88% of them) and computes E / k times the copies. Unselected experts' outputs are
  multiplied by 0: finite for finite weights."""
  n_tok, lat = z.shape
  num_experts = expert_shape(w1)[0]
  if dense.shape != (n_tok, num_experts):
    raise ValueError(f"dense must be [N, E] = [{n_tok}, {num_experts}], got {dense.shape}")
  pos = jnp.arange(n_tok * num_experts, dtype=jnp.int32)
  order = (pos % n_tok) * num_experts + pos // n_tok        # copy n E + e at position e N + n
  inverse = (pos % num_experts) * n_tok + pos // num_experts
  group_sizes = jnp.full((num_experts,), n_tok, jnp.int32)
  out = expert_products(expert_input(z, qat), order, inverse, num_experts, group_sizes, w1, w3,
                        w2, beta1, beta2, ragged_dot, gate_up_impl, "kernel", interpret, qat)
  with jax.named_scope("moe_combine"):
    u = jnp.sum(dense.astype(jnp.float32).T[:, :, None]
                * out.reshape(num_experts, n_tok, lat).astype(jnp.float32), axis=0)
  return u.astype(z.dtype)


GATE_UP_TRAIN = ("unfused", "kernel")


@dataclasses.dataclass(frozen=True)
class GateUpSpec:
  """The static arguments of `fused_gate_up`: the kernel tier, the grouped matmul of the
  backward (and of the unfused forward), and how it trains (one of GATE_UP_TRAIN)."""
  top_k: int
  beta1: float
  beta2: float
  ragged_dot: RaggedDot
  impl: str
  interpret: bool
  train: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def fused_gate_up(z: jax.Array, order: jax.Array, inverse: jax.Array, w1: jax.Array,
                  w3: jax.Array, group_sizes: jax.Array, spec: GateUpSpec) -> jax.Array:
  """h [N*k, m] = SiTU(xs W1_e, xs W3_e) for the copies xs = dispatch(z, order, ...) in expert
  order (Eq. 11), by `pallas_kernels.moe_gate_up`: the copies are gathered inside the kernel,
  never written.

  Under differentiation, spec.train = "kernel" (the default): the kernel also writes SiTU's
  partial derivatives [dh/d gate | dh/d up], and the backward is one multiply (d [gate | up]),
  a regather of the copies and the grouped matmul's VJP, with no transcendentals. On the H200
  at k3_small the layer's forward+backward took 2.88 ms this way against 3.06 ms with
  spec.train = "unfused", which runs the unfused path forward (`dispatch`, then
  `expert_gate_up`) and its VJP (benchmarks/results/moe_h200.json, run 17).
  """
  return moe_gate_up.gate_up(z, order // spec.top_k, w1, w3, group_sizes, beta1=spec.beta1,
                             beta2=spec.beta2, impl=spec.impl, interpret=spec.interpret)


def _fused_gate_up_fwd(z, order, inverse, w1, w3, group_sizes, spec):
  if spec.train == "kernel":
    h, partials = moe_gate_up.gate_up(
        z, order // spec.top_k, w1, w3, group_sizes, beta1=spec.beta1, beta2=spec.beta2,
        return_situ_grads=True, impl=spec.impl, interpret=spec.interpret)
    return h, (z, order, inverse, w1, w3, group_sizes, partials)

  def unfused(z, w1, w3):
    xs = dispatch(z, order, inverse, spec.top_k)
    return expert_gate_up(xs, w1, w3, group_sizes, spec.beta1, spec.beta2, spec.ragged_dot)
  return jax.vjp(unfused, z, w1, w3)


def _fused_gate_up_bwd(spec, res, d_h):
  if spec.train == "unfused":
    d_z, d_w1, d_w3 = res(d_h)
    return d_z, None, None, d_w1, d_w3, None
  z, order, inverse, w1, w3, group_sizes, partials = res
  d_h2 = jnp.concatenate([d_h, d_h], axis=1).astype(jnp.float32)
  d_gate_up = (partials.astype(jnp.float32) * d_h2).astype(partials.dtype)

  def gate_up_product(z, w1, w3):
    xs = dispatch(z, order, inverse, spec.top_k)
    return spec.ragged_dot(xs, jnp.concatenate([w1, w3], axis=2), group_sizes)
  _, product_vjp = jax.vjp(gate_up_product, z, w1, w3)
  d_z, d_w1, d_w3 = product_vjp(d_gate_up)
  return d_z, None, None, d_w1, d_w3, None


fused_gate_up.defvjp(_fused_gate_up_fwd, _fused_gate_up_bwd)


def expert_gate_up(xs: jax.Array, w1: ExpertWeight, w3: ExpertWeight, group_sizes: jax.Array,
                   beta1: float, beta2: float,
                   ragged_dot: RaggedDot = jax.lax.ragged_dot) -> jax.Array:
  """SiTU(xs W1, xs W3) on rows grouped by expert: xs [M, l] -> h [M, m] (Eq. 11). Float W1
  and W3 run as one grouped matmul on [W1 | W3]; packed ones as two (a concatenation of the
  packed experts would copy them on every call, or, hoisted out of the decode loop by XLA,
  hold them twice: 9.9 GB a layer for K3's 896)."""
  if isinstance(w1, PackedWeight):
    gate_up = jnp.concatenate([expert_matmul(xs, w, group_sizes) for w in (w1, w3)], axis=1)
  else:
    gate_up = expert_matmul(xs, jnp.concatenate([w1, w3], axis=2), group_sizes, ragged_dot)
  return situ_lib.situ_gate_up(gate_up, beta1, beta2)


def expert_down(h: jax.Array, w2: ExpertWeight, group_sizes: jax.Array,
                ragged_dot: RaggedDot = jax.lax.ragged_dot, qat: bool = False) -> jax.Array:
  """W2 on rows grouped by expert: h [M, m] -> [M, l] (Eq. 11), its input by `expert_input`."""
  return expert_matmul(expert_input(h, qat), w2, group_sizes, ragged_dot)


def expert_ffn(xs: jax.Array, w1: ExpertWeight, w3: ExpertWeight, w2: ExpertWeight,
               group_sizes: jax.Array, beta1: float, beta2: float,
               ragged_dot: RaggedDot = jax.lax.ragged_dot, qat: bool = False) -> jax.Array:
  """The experts' SiTU-GLU on rows grouped by expert: xs [M, l] -> [M, l] (Eq. 11); qat
  quantizes h (xs is the caller's: `grouped_experts` quantizes z)."""
  h = expert_gate_up(xs, w1, w3, group_sizes, beta1, beta2, ragged_dot)
  return expert_down(h, w2, group_sizes, ragged_dot, qat)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, ...]:
  """experts [N, k] -> (order, inverse [N*k] int32, group_sizes [E] int32).

  `order` lists the N*k token copies (n k + j) grouped by expert, stably; `inverse` undoes it.
  `pallas_kernels.expert_sort` at its platform default tier.
  """
  return expert_sort.sort_by_expert(experts, num_experts)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
  """Copies per expert [E] int32 of experts [N, k] (`pallas_kernels.expert_sort.xla`)."""
  return expert_sort_xla.expert_counts(experts, num_experts)


def take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
  """x[rows] for x [M, L], rows [R] int32 in range; rows of a 16-bit dtype move as 32-bit
  words, half as many gathered elements (dispatch's gather in the k3_small layer on the H200:
  56 against 87 us of device time). Not for gathers that XLA fuses into a reduction (combine,
  dispatch's VJP): the bitcast splits those fusions."""
  if x.dtype.itemsize != 2 or x.shape[1] % 2:
    return x[rows]
  words = jax.lax.bitcast_convert_type(x.reshape(x.shape[0], -1, 2), jnp.uint32)
  return jax.lax.bitcast_convert_type(words[rows], x.dtype).reshape(rows.shape[0], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch(z: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int) -> jax.Array:
  """Token copies in expert order: z [N, l] -> xs [N*k, l], xs[p] = z[order[p] // k].

  `order` sorts the N*k copies by expert and `inverse` undoes it. The VJP gathers instead of
  JAX's scatter-add: dz[n] = sum_j dxs[inverse[n k + j]].
  """
  return take_rows(z, order // top_k)


def _dispatch_fwd(z, order, inverse, top_k):
  return dispatch(z, order, inverse, top_k), inverse


def _dispatch_bwd(top_k, inverse, d_xs):
  d_z = jnp.sum(d_xs[inverse].reshape(-1, top_k, d_xs.shape[-1]).astype(jnp.float32), axis=1)
  return d_z.astype(d_xs.dtype), None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine(out: jax.Array, weights: jax.Array, order: jax.Array,
            inverse: jax.Array) -> jax.Array:
  """Weighted sum of each token's copies back in token order, fp32 (late routing weights).

  out [N*k, l] in expert order, weights [N, k] -> u [N, l], u[n] = sum_j weights[n, j]
  out[inverse[n k + j]]. The VJP gathers: dout[p] = weights.flat[order[p]] du[order[p] // k].
  """
  n_tok, top_k = weights.shape
  copies = out[inverse].reshape(n_tok, top_k, out.shape[-1])
  return jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32), copies,
                    preferred_element_type=jnp.float32)


def _combine_fwd(out, weights, order, inverse):
  return combine(out, weights, order, inverse), (out, weights, order, inverse)


def _combine_bwd(res, d_u):
  out, weights, order, inverse = res
  n_tok, top_k = weights.shape
  rows = order // top_k
  d_out = weights.reshape(-1)[order].astype(jnp.float32)[:, None] * d_u[rows]
  copies = out[inverse].reshape(n_tok, top_k, out.shape[-1])
  d_w = jnp.einsum("nl,nkl->nk", d_u, copies, preferred_element_type=jnp.float32)
  return d_out.astype(out.dtype), d_w.astype(weights.dtype), None, None


combine.defvjp(_combine_fwd, _combine_bwd)


def routing_stats(scores: jax.Array, experts: jax.Array, bias: jax.Array, cutoffs: jax.Array,
                  top_k: int, num_bins: int) -> dict[str, jax.Array]:
  """One batch's balancing statistics (§2.3.3, App. D): loads [E] int32, qb_counts [E, bins]
  int32, qb_lo, qb_hi, from scores [N, E], experts [N, k], bias [E] and the cutoffs [N] of
  `route`. Counts of shards or micro-batches routed with the same bias add (`merge_aux`)."""
  num_experts = scores.shape[1]
  counts, lo, hi = qb.histogram_counts(jax.lax.stop_gradient(scores), bias, top_k, num_bins,
                                       cutoffs)
  return dict(loads=expert_counts(experts, num_experts), qb_counts=counts, qb_lo=lo, qb_hi=hi)


def update_bias(bias: jax.Array, aux: dict[str, jax.Array], *, method: str, top_k: int,
                rate: float = 0.0) -> jax.Array:
  """The bias for the next step from one step's (merged) `aux` (report §2.3.3).

  method: "quantile" (histogram estimator, App. D), "quantile_exact" (sort-based rule; needs
  aux["scores"], i.e. `LatentMoE(..., qb_keep_scores=True)`), "sign" (DeepSeek-V3 rule with
  step `rate`), or "none" (bias unchanged).
  """
  if method == "quantile":
    new = qb.histogram_update(aux["qb_counts"], aux["qb_lo"], aux["qb_hi"],
                              aux["num_tokens"], top_k)
  elif method == "quantile_exact":
    if "scores" not in aux:
      raise ValueError("method='quantile_exact' needs aux['scores']; build LatentMoE with "
                       "qb_keep_scores=True")
    new = qb.exact_update(aux["scores"], bias, top_k)
  elif method == "sign":
    new = qb.sign_update(aux["loads"], bias, rate)
  elif method == "none":
    new = bias
  else:
    raise ValueError(f"method must be one of {BIAS_METHODS}, got {method!r}")
  return new.astype(bias.dtype)


def merge_aux(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Combines the aux of two micro-batches (or shards) routed with the same bias.

  Counts add (and `ep_dropped`, the copies dropped by expert parallelism, if present);
  `qb_lo`/`qb_hi` depend only on the bias and are taken from `a`; `scores` (if kept) are
  concatenated along tokens.
  """
  counts = ("loads", "qb_counts", "num_tokens") + (("ep_dropped",) if "ep_dropped" in a else ())
  out = {key: a[key] + b[key] for key in counts}
  out["qb_lo"], out["qb_hi"] = a["qb_lo"], a["qb_hi"]
  if "scores" in a:
    out["scores"] = jnp.concatenate([a["scores"], b["scores"]], axis=0)
  return out


class LatentMoE(nnx.Module):
  """Stable LatentMoE block (HF: `block_sparse_moe`).

  latent_size == 0 or == dim gives a plain DeepSeek-style MoE (as in Kimi Linear 48B): the
  routed experts act on x directly, with no down/up projection and no routed RMSNorm, and
  their d-sized axis is named "embed" instead of "latent".
  The shared experts are one SiTU-GLU MLP of width n_shared_experts * moe_intermediate_size.
  ragged_dot: the grouped matmul; gate_up_impl: the tier of `pallas_kernels.moe_gate_up` for
  the fused gather + W1/W3 + SiTU ("xla": unfused; None: the platform's default; with packed
  experts "triton", or None on Hopper, fuses through `mxfp4_matmul.mxfp4_gate_up`);
  gate_up_train: how that kernel trains (`GATE_UP_TRAIN`, `fused_gate_up`).
  expert_parallel ("auto" | "off"): under a mesh with an `expert` axis of size > 1 (the
  abstract mesh of `jax.set_mesh`), "auto" routes and runs the experts through
  `k3jax.expert_parallel` (all-to-all over `expert`, receive buffers of
  ep_capacity_factor * tokens per device * top-k rows; ep_all_to_all: "auto" | "ragged" |
  "padded"); otherwise, and with "off", one device's computation as XLA partitions it.
  qat: MXFP4 weights and MXFP8 inputs of the routed experts, fake-quantized with
  straight-through gradients (module docstring); the parameters stay in param_dtype.
  expert_format ("float" | "mxfp4"): "mxfp4" holds the routed experts packed, as
  non-trained `PackedExperts` in the K3 checkpoint layout, named by the table
  `experts.{e}.{w}.weight_packed` / `.weight_scale` (HF, [out, in/2] / [out, in/32]) ->
  `experts.{w}_packed[e]` / `experts.{w}_scale[e]` for w in w1, w3, w2 (`k3jax.mx.pack_experts`
  makes them from a float model); their inputs are MXFP8-quantized when `qat` is set.
  decode_experts ("sorted" | "gathered" | "all"): the routed experts of a cached call
  (`__call__`'s `cached`): through the sort and grouped matmuls as in training; "gathered":
  `gathered_experts` where N*k <= E and the weights are float; "all": `all_experts` where
  N*k >= 2E (1 - e^-2 = 86% of the experts touched, expected) and N <= ALL_EXPERTS_MAX_TOKENS
  (K3's 896 experts at top-16 never: 112 tokens would be needed).
  """

  def __init__(self, dim: int, *, num_experts: int, top_k: int, n_shared_experts: int,
               moe_intermediate_size: int, latent_size: int,
               routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
               beta1: float = 4.0, beta2: float = 25.0, rms_norm_eps: float = 1e-5,
               qb_num_bins: int = 1000, qb_keep_scores: bool = False,
               ragged_dot: RaggedDot = jax.lax.ragged_dot, gate_up_impl: str | None = "xla",
               gate_up_train: str = "kernel", expert_parallel: str = "auto",
               ep_capacity_factor: float = 2.0, ep_all_to_all: str = "auto", qat: bool = False,
               expert_format: str = "float", decode_experts: str = "sorted",
               rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    if not 1 <= top_k < num_experts:
      raise ValueError(f"top_k must satisfy 1 <= top_k < num_experts = {num_experts} "
                       f"(Quantile Balancing takes top-(k+1)), got {top_k}")
    if latent_size < 0:
      raise ValueError(f"latent_size must be >= 0 (0 or dim: no latent projection), "
                       f"got {latent_size}")
    if n_shared_experts < 0:
      raise ValueError(f"n_shared_experts must be >= 0, got {n_shared_experts}")
    if not isinstance(qat, bool):
      raise ValueError(f"qat must be a bool, got {qat!r}")
    if expert_format not in EXPERT_FORMATS:
      raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    if decode_experts not in DECODE_EXPERTS:
      raise ValueError(f"decode_experts must be one of {DECODE_EXPERTS}, got "
                       f"{decode_experts!r}")
    self.num_experts, self.top_k = num_experts, top_k
    self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
    self.beta1, self.beta2 = beta1, beta2
    self.qb_num_bins, self.qb_keep_scores = qb_num_bins, qb_keep_scores
    self.ragged_dot, self.gate_up_impl = ragged_dot, gate_up_impl
    self.gate_up_train = gate_up_train
    self.expert_parallel, self.ep_capacity_factor = expert_parallel, ep_capacity_factor
    self.ep_all_to_all = ep_all_to_all
    self.qat, self.expert_format, self.decode_experts = qat, expert_format, decode_experts
    self.dtype = dtype
    self.prepared_decode_weights = nnx.data(None)   # `prepare_decode`'s, in a decode trace
    self.use_latent = latent_size not in (0, dim)
    lat = latent_size if self.use_latent else dim
    lat_axis = "latent" if self.use_latent else "embed"
    if (qat or expert_format == "mxfp4") and (lat % mx.BLOCK or moe_intermediate_size % mx.BLOCK):
      raise ValueError(f"qat and expert_format='mxfp4' take blocks of {mx.BLOCK} along the "
                       f"experts' input dims: the latent size {lat} and moe_intermediate_size "
                       f"{moe_intermediate_size} must be multiples of {mx.BLOCK}")
    init0 = params.fan_in_init((0,))
    init1 = params.fan_in_init((1,))

    self.gate = nnx.Dict(
        kernel=params.param(rngs, init0, (dim, num_experts), ("embed", "exp_router"),
                            param_dtype),
        e_score_correction_bias=MoEBias(jnp.zeros((num_experts,), jnp.float32),
                                        out_sharding=("exp_router",)))
    if self.use_latent:
      self.routed_expert_down_proj = nnx.Dict(kernel=params.param(
          rngs, init0, (dim, lat), ("embed", "latent"), param_dtype))
    if expert_format == "float":
      self.experts = nnx.Dict(
          w1=params.param(rngs, init1, (num_experts, lat, moe_intermediate_size),
                          ("exp", lat_axis, "mlp_moe"), param_dtype),
          w3=params.param(rngs, init1, (num_experts, lat, moe_intermediate_size),
                          ("exp", lat_axis, "mlp_moe"), param_dtype),
          w2=params.param(rngs, init1, (num_experts, moe_intermediate_size, lat),
                          ("exp", "mlp_moe", lat_axis), param_dtype))
    else:
      # [E, out, in / per_byte] (HF layout), out's logical axis name, out, in
      layouts = {"w1": ("mlp_moe", moe_intermediate_size, lat),
                 "w3": ("mlp_moe", moe_intermediate_size, lat),
                 "w2": (lat_axis, lat, moe_intermediate_size)}
      self.experts = nnx.Dict({
          f"{w}_{part}": PackedExperts(jnp.zeros((num_experts, out, fan_in // per_byte),
                                                 jnp.uint8), out_sharding=("exp", axis, None))
          for w, (axis, out, fan_in) in layouts.items()
          for part, per_byte in (("packed", 2), ("scale", mx.BLOCK))})
    if self.use_latent:
      self.routed_expert_norm = norms.RMSNorm(lat, rms_norm_eps, rngs=rngs, axis_name="latent")
      self.routed_expert_up_proj = nnx.Dict(kernel=params.param(
          rngs, init0, (lat, dim), ("latent", "embed"), param_dtype))
    if n_shared_experts > 0:
      self.shared_experts = situ_lib.SiTUGLU(
          dim, n_shared_experts * moe_intermediate_size, beta1=beta1, beta2=beta2,
          rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.has_shared = n_shared_experts > 0

  def __call__(self, x: jax.Array, cached: bool = False
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, d] -> (y [B, T, d], aux) with aux for the bias update and load statistics:
    loads [E] int32, qb_counts [E, bins] int32, qb_lo, qb_hi, num_tokens (and scores [N, E]
    when qb_keep_scores; ep_dropped on the expert-parallel path). cached: a prefill or decode
    call (`decode_experts` applies)."""
    from k3jax import expert_parallel  # imported here: expert_parallel imports this module
    bsz, seq, dim = x.shape
    xf = x.reshape(bsz * seq, dim)
    bias = self.gate["e_score_correction_bias"][...]
    ep = expert_parallel.enabled(self.expert_parallel, jax.sharding.get_abstract_mesh())
    # `prepare_decode`'s merged products: cached calls on bf16 inputs (the router's logits of
    # other inputs are fp32 products of x itself)
    prepared = (self.prepared_decode_weights
                if cached and not ep and x.dtype == jnp.bfloat16 else None)
    h = xf.astype(self.dtype)
    if prepared is not None:
      with jax.named_scope("moe_latent"):
        h, logits, shared_in = self._decode_inputs(xf, prepared[0])
    elif self.use_latent:
      with jax.named_scope("moe_latent"):
        h = h @ self.routed_expert_down_proj["kernel"][...].astype(self.dtype)
    w1, w3, w2 = (self.expert_weight(w) for w in EXPERT_WEIGHTS)
    if ep:
      u, aux = expert_parallel.routed_moe(
          x, h.reshape(bsz, seq, -1), self.gate["kernel"][...], bias, w1, w3, w2,
          top_k=self.top_k, routed_scaling_factor=self.routed_scaling_factor,
          norm_topk_prob=self.norm_topk_prob, beta1=self.beta1, beta2=self.beta2,
          qb_num_bins=self.qb_num_bins, keep_scores=self.qb_keep_scores,
          capacity_factor=self.ep_capacity_factor, all_to_all=self.ep_all_to_all,
          ragged_dot=self.ragged_dot, gate_up_impl=self.gate_up_impl,
          gate_up_train=self.gate_up_train, qat=self.qat)
      u = u.reshape(bsz * seq, -1)
      if self.qb_keep_scores:
        aux["scores"] = aux["scores"].reshape(bsz * seq, -1)
    else:
      with jax.named_scope("moe_routing"):
        if prepared is None:
          logits = router_logits(xf, self.gate["kernel"][...])
        weights, experts, scores, cutoffs = route(
            xf, self.gate["kernel"][...], bias, self.top_k, self.routed_scaling_factor,
            self.norm_topk_prob, return_cutoffs=True, logits=logits)
      copies = bsz * seq * self.top_k
      gathered = (cached and self.decode_experts == "gathered"
                  and self.expert_format == "float" and copies <= self.num_experts)
      every = (cached and self.decode_experts == "all" and copies >= 2 * self.num_experts
               and bsz * seq <= ALL_EXPERTS_MAX_TOKENS)
      if every:
        # The picks by rank, no top-k (the one above then feeds only the statistics, which a
        # decode step drops)
        with jax.named_scope("moe_routing"):
          dense = moe_route.route_dense(logits, bias, self.top_k,
                                        scale=self.routed_scaling_factor,
                                        normalize=self.norm_topk_prob)
        u = all_experts(h, dense, w1, w3, w2, self.beta1, self.beta2, self.ragged_dot,
                        self.gate_up_impl, qat=self.qat)
      elif cached and not gathered and moe_route.plan(logits, self.top_k).impl == "triton":
        # A decode step: routing and the sort in one kernel (the statistics above, unused
        # there, are left to dead-code elimination).
        with jax.named_scope("moe_routing"):
          weights, _, order, inverse, group_sizes = moe_route.route_and_sort(
              logits, bias, self.top_k, scale=self.routed_scaling_factor,
              normalize=self.norm_topk_prob)
        u = grouped_experts(h, weights, order, inverse, group_sizes, w1, w3, w2, self.beta1,
                            self.beta2, self.ragged_dot, self.gate_up_impl, self.gate_up_train,
                            qat=self.qat)
      elif gathered:
        with jax.named_scope("moe_experts"):
          u = gathered_experts(h, weights, experts, w1, w3, w2, self.beta1, self.beta2,
                               qat=self.qat)
      else:
        u = routed_experts(h, weights, experts, w1, w3, w2, self.beta1, self.beta2,
                           self.ragged_dot, self.gate_up_impl, self.gate_up_train, qat=self.qat)
      with jax.named_scope("moe_stats"):
        aux = routing_stats(scores, experts, bias, cutoffs, self.top_k, self.qb_num_bins)
      if self.qb_keep_scores:
        aux["scores"] = jax.lax.stop_gradient(scores)
    if prepared is not None:
      with jax.named_scope("moe_shared"):
        hs = situ_lib.situ(*shared_in, self.beta1, self.beta2)
      with jax.named_scope("moe_latent"):
        u = jnp.concatenate([self.routed_expert_norm(u).astype(self.dtype), hs], axis=1)
        u = decode_matmul.matmul(u, prepared[1])
    else:
      if self.use_latent:
        with jax.named_scope("moe_latent"):
          u = self.routed_expert_norm(u) @ self.routed_expert_up_proj["kernel"][...].astype(
              self.dtype)
      if self.has_shared:
        with jax.named_scope("moe_shared"):
          u = u + self.shared_experts(xf)
    aux["num_tokens"] = jnp.asarray(bsz * seq, jnp.int32)
    return u.reshape(bsz, seq, dim), aux

  def decode_weights(self) -> tuple[jax.Array, jax.Array] | None:
    """(W_in, W_out) in bf16 for a cached call's two dense products, or None where the layer
    has no latent projection or shared experts or computes in another dtype. W_in [d, l + pE +
    2S] puts every product of the layer's input side by side: W_down, the router kernel (p = 1
    part for a bf16 kernel, else its three bf16 parts, `router_logits`), the shared experts'
    gate and up; W_out [l + S, d] stacks the two products that write its output, W_up over the
    shared experts' down (their sum in one fp32 accumulation, then rounded once)."""
    if not (self.use_latent and self.has_shared and self.dtype == jnp.bfloat16):
      return None
    w = lambda p: p["kernel"][...].astype(self.dtype)
    kernel = self.gate["kernel"][...]
    router = [kernel] if self._router_parts() == 1 else list(_split3(kernel))
    shared = self.shared_experts
    w_in = jnp.concatenate([w(self.routed_expert_down_proj), *router, w(shared.gate_proj),
                            w(shared.up_proj)], axis=1)
    return w_in, jnp.concatenate([w(self.routed_expert_up_proj), w(shared.down_proj)], axis=0)

  def prepare_decode(self) -> None:
    """Computes `decode_weights` once for the cached calls that follow in the same trace (a
    decode loop calls it before its while loop: two GEMMs a layer in place of five)."""
    self.prepared_decode_weights = self.decode_weights()

  def _router_parts(self) -> int:
    """The router kernel's bf16 parts in W_in: 1 for a bf16 kernel, else 3 (`_split3`)."""
    return 1 if self.gate["kernel"].dtype == jnp.bfloat16 else 3

  def _decode_inputs(self, xf: jax.Array, w_in: jax.Array
                     ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """xf [N, d] through W_in (`decode_weights`): z [N, l] bf16, the router logits [N, E] fp32
    (as `router_logits` forms them) and the shared experts' (gate, up) [N, S] bf16."""
    lat = self.routed_expert_down_proj["kernel"].shape[1]
    num_e, parts = self.num_experts, self._router_parts()
    proj = decode_matmul.matmul(xf.astype(self.dtype), w_in, preferred_element_type=jnp.float32)
    logits = proj[:, lat:lat + parts * num_e].reshape(-1, parts, num_e)
    logits = sum(logits[:, i] for i in reversed(range(parts)))
    gate, up = jnp.split(proj[:, lat + parts * num_e:], 2, axis=1)
    bf = lambda a: a.astype(self.dtype)
    return bf(proj[:, :lat]), logits, (bf(gate), bf(up))

  def expert_weight(self, name: str) -> ExpertWeight:
    """Routed expert weight `name` (w1, w3 or w2) as the experts use it: a `PackedWeight`, or
    the float [E, in, out] in self.dtype, MXFP4 fake-quantized along `in` with `qat` (from the
    param_dtype values, so that it equals `k3jax.mx.pack_experts` of the same parameters)."""
    if self.expert_format == "mxfp4":
      return PackedWeight(self.experts[f"{name}_packed"][...], self.experts[f"{name}_scale"][...])
    w = self.experts[name][...]
    if self.qat:
      w = mx.fake_quantize(w, "mxfp4", axis=-2)
    return w.astype(self.dtype)
