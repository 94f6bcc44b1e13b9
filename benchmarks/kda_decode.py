r"""One KDA layer's decode step on one GPU: `pallas_kernels.kda_decode` tiers vs fla's chain.

The step after the layer's input projections and before its output projection (report §2.1):
conv over the cached tail, SiLU, L2 norms, gate, beta, the delta rule, gated output RMSNorm.
Ours: the triton tier (one kernel) and the xla tier, device time per call from an XLA profiler
trace over three copies of the state cycled (`common.device_ms_cycling`: no call finds its
state in L2). fla (fla-core): `causal_conv1d_update` (SiLU) on [q | k | v], the f_a f_b
product (a torch matmul), `fused_recurrent_kda(..., use_qk_l2norm_in_kernel=True,
use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound)`, `rms_norm_gated`
(sigmoid), timed as a CUDA graph of those calls over three state copies
(`triton.testing.do_bench_cudagraph`, so host launches are not counted for either side). The
floor: the bytes a step must move (state read and written, the conv tail read and written,
proj, f_b, o) at the copy rate measured in the run. Each record holds our o's relative L2
distance from fla's.
`python3 -m benchmarks.kda_decode --out=$OUT/kda_decode_h200.json`
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from pallas_kernels import kda_decode
from pallas_kernels.kda_decode import triton as kda_decode_triton

_OUT = flags.DEFINE_string("out", "benchmarks/results/kda_decode_h200.json",
                           "Records (JSON list).")
_SHAPES = flags.DEFINE_list("shapes", ["16x8", "1x8", "16x96", "1x96"],
                            "BxH (K = R = 128, conv width 4): k3_small's 8 heads, K3's 96.")
_TRITON_CONFIGS = flags.DEFINE_list(
    "triton_configs", [], "Entries of pallas_kernels.kda_decode.triton.CONFIGS to time beside "
    "the tiers' defaults (rows \"triton:<name>\", the default's among them), e.g. tile_w8.")
KEY_FIELDS = ("op", "impl", "shape", "device")
K, R, W, LB, EPS = 128, 128, 4, -5.0, 1e-5
COPIES = 3


def make_inputs(b: int, h: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  a = lambda *s, sd=1.0: (sd * rng.standard_normal(s)).astype(np.float32)
  return dict(proj=a(b, kda_decode.proj_width(h, K, R)), tail=a(b, W - 1, 3, h * K),
              conv=a(W, 3, h * K, sd=0.5), f_b=a(R, h, K, sd=R ** -0.5), a_log=a(h, sd=0.5),
              dt_bias=a(h * K), o_norm=1 + a(K, sd=0.1), state=a(b, h, K, K, sd=0.1))


def floor_bytes(b: int, h: int) -> int:
  hk = h * K
  return (2 * b * h * K * K * 4 + 2 * b * (W - 1) * 3 * hk * 2
          + b * kda_decode.proj_width(h, K, R) * 2 + R * hk * 2 + b * hk * 2)


def run_ours(x, impl):
  """impl: a tier of the op, or "triton:<name>" for an entry of the triton tier's CONFIGS."""
  bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
  fixed = (bf("proj"), bf("conv"), bf("f_b"), jnp.asarray(x["a_log"]),
           jnp.asarray(x["dt_bias"]), jnp.asarray(x["o_norm"]))
  kw = dict(gate="lower_bound", lower_bound=LB, norm_eps=EPS)
  if impl.startswith("triton:"):
    config = kda_decode_triton.CONFIGS[impl.split(":")[1]]
    step = lambda *a: kda_decode_triton.kda_decode_step(
        *a, None, scale=K ** -0.5, config=config, **kw)
  else:
    step = lambda *a: kda_decode.kda_decode_step(*a, impl=impl, **kw)
  fn = jax.jit(lambda tail, state: step(fixed[0], tail, fixed[1], fixed[2], *fixed[3:], state))
  sets = [(bf("tail"), jnp.asarray(x["state"]) + i) for i in range(COPIES)]
  o = np.asarray(fn(bf("tail"), jnp.asarray(x["state"]))[0].astype(jnp.float32))
  return common.device_ms_cycling(fn, sets) * 1e3, o


def run_fla(x, b, h):
  import torch
  import triton
  from fla.modules.causal_conv1d.ops import causal_conv1d_update
  from fla.modules.norm.fused_norm_gate import rms_norm_gated
  from fla.ops.kda import fused_recurrent_kda
  t = lambda a, dt=torch.bfloat16: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", dt)
  hk = h * K
  proj = t(x["proj"])
  conv_w = t(x["conv"].reshape(W, 3 * hk).T)                          # [D, W]
  f_b = t(x["f_b"].reshape(R, hk))
  a_log, dt_bias, o_norm = (t(x[n], torch.float32) for n in ("a_log", "dt_bias", "o_norm"))
  # fla's layer projects q, k, v, z, f_a and beta separately: each its own contiguous tensor
  x_conv = proj[:, None, :3 * hk].contiguous()                        # [B, 1, 3HK]
  z = proj[:, 3 * hk:4 * hk].reshape(b * h, K).contiguous()
  f_a = proj[:, 4 * hk:4 * hk + R].contiguous()
  beta = proj[:, 4 * hk + R:].reshape(b, 1, h).contiguous()
  caches = []
  for i in range(COPIES):      # fla's conv cache [B, D, W]: slots 1..W-1 the last W-1 inputs
    tail = x["tail"].reshape(b, W - 1, 3 * hk)
    full = np.concatenate([np.zeros_like(tail[:, :1]), tail], 1).transpose(0, 2, 1)
    caches.append(t(full))
  states = [t(x["state"] + i, torch.float32) for i in range(COPIES)]
  turn = itertools.count()

  def step():
    i = next(turn) % COPIES
    y, _ = causal_conv1d_update(x_conv, caches[i], weight=conv_w, activation="silu")
    q, k, v = (a.reshape(b, 1, h, K) for a in y[:, 0].split(hk, dim=-1))
    g = (f_a @ f_b).reshape(b, 1, h, K)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias,
                               initial_state=states[i], output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    return rms_norm_gated(o.reshape(b * h, K), z, o_norm, None, activation="sigmoid", eps=EPS)

  with torch.no_grad():
    o = step().float().reshape(b, hk).cpu().numpy()
    ms = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")
  return ms * 1e3, o


def main(argv):
  del argv
  if unknown := set(_TRITON_CONFIGS.value) - set(kda_decode_triton.CONFIGS):
    raise app.UsageError(f"--triton_configs: unknown {sorted(unknown)}, choose from "
                         f"{sorted(kda_decode_triton.CONFIGS)}")
  copy = common.copy_tbps()
  print(f"device {common.device_name()}: copy {copy:.2f} TB/s")
  records = []
  for shape in _SHAPES.value:
    b, h = (int(v) for v in shape.split("x"))
    x = make_inputs(b, h, seed=b * 1000 + h)
    floor_us = floor_bytes(b, h) / copy / 1e6
    results = {"fla": run_fla(x, b, h)}
    default = "triton:" + kda_decode_triton.config_name(kda_decode_triton.DEFAULT)
    for impl in (default, "xla", *(f"triton:{c}" for c in _TRITON_CONFIGS.value)):
      results[impl] = run_ours(x, impl)
    ref = results["fla"][1]
    for impl, (us, o) in results.items():
      err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
      print(f"B={b:<3d} H={h:<3d} {impl:>14s} {us:8.1f} us  floor {floor_us:6.1f} us "
            f"({floor_us / us:5.1%})  rel L2 vs fla {err:.1e}")
      records.append(dict(op="kda_decode_step", impl=impl, shape=dict(B=b, H=h, K=K, R=R, W=W),
                          device_us=round(us, 2), floor_us=round(floor_us, 2),
                          floor_fraction=round(floor_us / us, 3), rel_l2_vs_fla=err,
                          timing="cuda_graph" if impl == "fla" else "profiler",
                          copy_tbps=round(copy, 3), device=common.device_name(),
                          date=common.today(), commit=common.code_commit(),
                          versions=common.versions()))
  common.merge_records(_OUT.value, records, KEY_FIELDS)


if __name__ == "__main__":
  app.run(main)
