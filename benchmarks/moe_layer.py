r"""The Stable LatentMoE layer at k3_small shapes: where its time goes.

Times, in one process on the same inputs:
- the whole layer forward (and forward+backward), returning its aux as training does, with
  each kernel choice of `--impls`: "default" (the platform's defaults: on Hopper our Mosaic GPU
  grouped matmuls and the fused gather + W1/W3 + SiTU kernel `pallas_kernels.moe_gate_up`,
  which also writes SiTU's partials for the backward), "fused_fwd" (the same forward, but
  training differentiates the unfused path: `gate_up_train="unfused"`), "unfused" (the default
  grouped matmuls, dispatch gather and SiTU apart), "xla" (`jax.lax.ragged_dot`, unfused);
- routing + permutations (router, top-k, QB's histogram, `sort_by_expert`, `dispatch` and
  `combine`, as in the layer) without the expert matmuls; `routing_fused` is the same without
  `dispatch`, whose gather the fused kernel does inside its matmul; `*_fwd+bwd` adds their
  VJPs (training). Its parts: `--profile_dir`
  and `trace_summary --by_hlo_op` (alone, each part is shorter than JAX's dispatch of a call,
  which a wall-clock timing would measure);
- on a GPU or TPU, the device time of routing and of the layer's forward and
  forward+backward (`*_device`, `common.device_ms`), whose ratios are the issue's share (with
  `routing_fused` for the forward where the fused kernel runs);
- the experts' SiTU on the gate and up products (`elementwise_*`: as written, in a
  sigmoid-only form, and an add of the same bytes);
- the layer's grouped matmuls alone per tier (`latent_moe.expert_ffn`), and a dense bf16
  matmul of the same FLOPs (the ceiling).
`python3 -m benchmarks.moe_layer --out=$OUT/moe.json [--impls=default,xla]`.
"""
import functools
import os

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from benchmarks import common
from k3jax import config as config_lib
from k3jax import latent_moe
from k3jax import quantile_balancing as qb
from k3jax import situ as situ_lib
from pallas_kernels import moe_gate_up
from pallas_kernels import ragged_dot as grouped_matmul

_OUT = flags.DEFINE_string("out", "benchmarks/results/moe_h200.json", "Records (JSON list).")
_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens in the batch (B*T).")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "",
                                   "If set, XLA profiler traces of one forward and one "
                                   "forward+backward per tier (<dir>/<impl>) and of the routing "
                                   "alone (<dir>/routing), after their timing.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/k3_small.py", "Config file.")
_IMPLS = flags.DEFINE_list("impls", ["default", "unfused", "xla"],
                           "Kernel choices: default (platform defaults), fused_fwd (defaults, "
                           "but training differentiates the unfused path: "
                           "gate_up_train='unfused'), "
                           "unfused (default grouped matmuls, no fused gate/up kernel) or an "
                           "impl name of pallas_kernels.ragged_dot (unfused).")


def ragged_dot_of(impl: str):
  """`jax.lax.ragged_dot`-like callable of the named choice."""
  return functools.partial(grouped_matmul.ragged_dot,
                           impl=None if impl in ("default", "fused_fwd", "unfused") else impl)


def gate_up_of(impl: str) -> str | None:
  """`LatentMoE(gate_up_impl=...)` of the named choice: the platform default or unfused."""
  return None if impl in ("default", "fused_fwd") else "xla"


def main(argv):
  del argv
  cfg = config_lib.load(_CONFIG.value)
  m, e = cfg.model, cfg.model.moe
  d, n = m.hidden_size, _TOKENS.value
  def make_moe(impl):
    return latent_moe.LatentMoE(
        d, num_experts=e.num_experts, top_k=e.num_experts_per_tok,
        n_shared_experts=e.n_shared_experts, moe_intermediate_size=e.moe_intermediate_size,
        latent_size=e.latent_size, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16, ragged_dot=ragged_dot_of(impl), gate_up_impl=gate_up_of(impl),
        gate_up_train="unfused" if impl == "fused_fwd" else "kernel")
  moe = make_moe("xla")
  x = jax.random.normal(jax.random.key(1), (1, n, d), jnp.bfloat16)
  _, params, _ = nnx.split(moe, nnx.Param, ...)

  def layer_fns(impl):
    graph, _, rest = nnx.split(make_moe(impl), nnx.Param, ...)
    def layer(params, x):
      return nnx.merge(graph, params, rest)(x)
    def loss(params, x):
      y, aux = layer(params, x)
      return jnp.sum(y.astype(jnp.float32)), aux
    # Both return the layer's aux (QB's histogram, the loads) as training uses them, so XLA
    # cannot drop that work; value_and_grad computes the layer's output too (under jax.grad
    # alone XLA drops the last expert matmul's forward, whose output only feeds the loss).
    return jax.jit(layer), jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

  lat = e.latent_size or d
  w = moe.experts
  z = jax.random.normal(jax.random.key(2), (n, lat), jnp.bfloat16)
  weights, experts, _ = jax.jit(lambda xx: latent_moe.route(
      xx, moe.gate["kernel"][...], moe.gate["e_score_correction_bias"][...], e.num_experts_per_tok,
      1.0, True))(x[0])

  # With the fused kernel, combine reads the expert outputs: any [N k, l] array in memory.
  expert_out = jax.random.normal(jax.random.key(9), (n * e.num_experts_per_tok, lat),
                                 jnp.bfloat16)

  def routing_only(xx, zz, fused=False, router=None):
    bias = moe.gate["e_score_correction_bias"][...]
    router = moe.gate["kernel"][...] if router is None else router
    wts, ex, scores, cutoffs = latent_moe.route(
        xx, router, bias, e.num_experts_per_tok, 1.0, True, return_cutoffs=True)
    qb_stats = qb.histogram_counts(scores, bias, e.num_experts_per_tok, moe.qb_num_bins,
                                   cutoffs)
    order, inverse, _ = latent_moe.sort_by_expert(ex, e.num_experts)
    if fused:
      rows = expert_out
    else:
      rows = latent_moe.dispatch(zz, order, inverse, e.num_experts_per_tok)
    # The barrier keeps the dispatched copies in memory, as the expert matmuls do in the
    # layer; without it XLA fuses dispatch into combine's gather (z[order // k][inverse]).
    out = latent_moe.combine(jax.lax.optimization_barrier(rows), wts, order, inverse)
    return out.astype(zz.dtype), qb_stats

  mi = e.moe_intermediate_size
  act = jax.random.normal(jax.random.key(8), (n * e.num_experts_per_tok, 2 * mi), jnp.bfloat16)
  sigmoid_form = lambda y, b: b * (2 * jax.nn.sigmoid(2 * y / b) - 1)
  elementwise = {
      "situ": lambda a: situ_lib.situ(a[:, :mi], a[:, mi:], moe.beta1, moe.beta2),
      "situ_sigmoid_form": lambda a: (
          sigmoid_form(a[:, :mi].astype(jnp.float32), moe.beta1)
          * jax.nn.sigmoid(a[:, :mi].astype(jnp.float32))
          * sigmoid_form(a[:, mi:].astype(jnp.float32), moe.beta2)).astype(a.dtype),
      "add_same_bytes": lambda a: a[:, :mi] + a[:, mi:],
  }

  sizes = jnp.bincount(experts.reshape(-1), length=e.num_experts).astype(jnp.int32)
  rows = jax.random.normal(jax.random.key(3), (n * e.num_experts_per_tok, lat), jnp.bfloat16)

  def gemms(rr, w1, w3, w2, impl):
    return latent_moe.expert_ffn(rr, w1, w3, w2, sizes, moe.beta1, moe.beta2, ragged_dot_of(impl))

  gemm_flops = 2 * n * e.num_experts_per_tok * lat * mi * 3
  dense_a = jax.random.normal(jax.random.key(4), (n * e.num_experts_per_tok, lat), jnp.bfloat16)
  dense_b = jax.random.normal(jax.random.key(5), (lat, 3 * mi), jnp.bfloat16)
  timings, forwards, fwd_bwds = {}, {}, {}
  for impl in _IMPLS.value:
    fwd, fwd_bwd = layer_fns(impl)
    forwards[impl], fwd_bwds[impl] = fwd, fwd_bwd
    timings[f"layer_fwd_{impl}"] = common.time_jax(fwd, params, x)
    timings[f"layer_fwd+bwd_{impl}"] = common.time_jax(fwd_bwd, params, x)
    if _PROFILE_DIR.value:
      with jax.profiler.trace(os.path.join(_PROFILE_DIR.value, impl)):
        jax.block_until_ready((fwd(params, x), fwd_bwd(params, x)))
    timings[f"grouped_gemms_{impl}"] = common.time_jax(
        jax.jit(functools.partial(gemms, impl=impl)), rows, w["w1"][...], w["w3"][...],
        w["w2"][...])
  routing = jax.jit(routing_only)
  routing_fused = jax.jit(functools.partial(routing_only, fused=True))

  def routing_loss(xx, zz, router):
    out, qb_stats = routing_only(xx, zz, router=router)
    return jnp.sum(out.astype(jnp.float32)), qb_stats
  # Training's routing and permutations: their forward and their VJPs (router, combine,
  # dispatch). Every training path has them all; with gate_up_train="kernel" the dispatch
  # gather moves from the forward into the backward (the regather).
  routing_train = jax.jit(jax.value_and_grad(routing_loss, (0, 1, 2), has_aux=True))
  router = moe.gate["kernel"][...]
  timings["routing_and_permutation"] = common.time_jax(routing, x[0], z)
  timings["routing_and_permutation_fwd+bwd"] = common.time_jax(routing_train, x[0], z, router)
  if jax.devices()[0].platform != "cpu":
    # Device time (profiler trace), free of the host's dispatch: the share of the issue.
    timings["routing_and_permutation_device"] = common.device_ms(routing, x[0], z)
    timings["routing_fused_device"] = common.device_ms(routing_fused, x[0], z)
    timings["routing_and_permutation_fwd+bwd_device"] = common.device_ms(
        routing_train, x[0], z, router)
    for impl, fwd in forwards.items():
      timings[f"layer_fwd_{impl}_device"] = common.device_ms(fwd, params, x)
      timings[f"layer_fwd+bwd_{impl}_device"] = common.device_ms(fwd_bwds[impl], params, x)
  for name, fn in elementwise.items():
    timings["elementwise_" + name] = common.time_jax(jax.jit(fn), act)
  if _PROFILE_DIR.value:
    with jax.profiler.trace(os.path.join(_PROFILE_DIR.value, "routing")):
      jax.block_until_ready(routing(x[0], z))
  timings["dense_same_flops"] = common.time_jax(jax.jit(jnp.dot), dense_a, dense_b)
  device, date = common.device_name(), common.today()
  records = []
  for name, ms in timings.items():
    tf = gemm_flops / ms / 1e9 if name.startswith(("grouped_gemms", "dense")) else None
    records.append(dict(op="moe_layer", implementation=name, config=cfg.name, tokens=n,
                        median_ms=round(ms, 4), tflops=round(tf, 1) if tf else None,
                        dtype="bfloat16", device=device, date=date,
                        **{"pass": "fwd+bwd" if "bwd" in name else "fwd"}))
    print(f"{name:>26s} {ms:9.3f} ms" + (f" {tf:7.1f} TFLOP/s" if tf else ""))
  common.merge_records(_OUT.value, records, ("op", "implementation", "config", "tokens", "device"))
  for impl in _IMPLS.value:
    if f"layer_fwd_{impl}_device" in timings:
      copies = jax.ShapeDtypeStruct((n * e.num_experts_per_tok,), jnp.int32)
      fused = moe_gate_up.plan(z, copies, w["w1"][...], w["w3"][...], sizes,
                               impl=gate_up_of(impl)).impl != "xla"
      routing_ms = timings["routing_fused_device" if fused else "routing_and_permutation_device"]
      share = routing_ms / timings[f"layer_fwd_{impl}_device"]
      print(f"routing + permutations: {100 * share:.1f}% of the {impl} layer's forward "
            f"(device time{', dispatch fused into the gate/up kernel' if fused else ''})")
      share = (timings["routing_and_permutation_fwd+bwd_device"]
               / timings[f"layer_fwd+bwd_{impl}_device"])
      print(f"routing + permutations, forward and backward: {100 * share:.1f}% of the {impl} "
            "layer's forward+backward (device time)")


if __name__ == "__main__":
  app.run(main)
