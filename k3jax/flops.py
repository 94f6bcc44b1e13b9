"""Parameter counts and model FLOPs, from the real parameter shapes (`jax.eval_shape`).

Active parameters follow the report's convention (k3_techniques.md §1): the LM head counts, the
input embedding does not, and each MoE layer activates top-k of its routed experts.
"""
import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3jax import config as config_lib
from k3jax import mtp as mtp_lib
from k3jax import muon
from k3jax.model import K3ForCausalLM


@dataclasses.dataclass(frozen=True)
class ParamCount:
  total: int
  active: int
  embedding: int
  routed_experts: int
  mtp: int
  mtp_active: int = 0   # the MTP depths' parameters with top-k of their routed experts


def abstract_model(model_cfg: ml_collections.ConfigDict, model_cls=None):
  """The model with ShapeDtypeStruct parameters: nothing is allocated."""
  cls = model_cls or K3ForCausalLM
  return nnx.eval_shape(lambda: cls(model_cfg, rngs=nnx.Rngs(0)))


def count_params(model_cfg: ml_collections.ConfigDict) -> ParamCount:
  """Total and active parameter counts of the text model (MTP reported separately)."""
  model = abstract_model(model_cfg)
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  total = embedding = routed = mtp = mtp_routed = 0
  for path, var in flat:
    n = 1
    for s in var.shape:
      n *= s
    keys = [str(p) for p in path]
    if keys[0] == "mtp":
      mtp += n
      mtp_routed += n if "experts" in keys else 0
      continue
    total += n
    if keys[0] == "embed_tokens":
      embedding += n
    if "experts" in keys:
      routed += n
  e = model_cfg.moe
  top_k = lambda r: r * e.num_experts_per_tok // e.num_experts if e.num_experts else 0
  active = total - embedding - routed + top_k(routed)
  return ParamCount(total=total, active=active, embedding=embedding, routed_experts=routed, mtp=mtp,
                    mtp_active=mtp - mtp_routed + top_k(mtp_routed))


def attention_flops_per_token(model_cfg: ml_collections.ConfigDict, seq_len: int) -> float:
  """Forward FLOPs per token of the token mixers beyond their projections.

  MLA (causal): 2 * H * (dn + dr + dv) * T / 2. KDA (Kimi Linear Eq. 13, chunk C = 64):
  (6 d^2 + 3 C d + C^2) per head per token minus the projections already counted.
  """
  kinds = config_lib.layer_types(model_cfg)
  a, k = model_cfg.mla, model_cfg.kda
  mla = 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * seq_len / 2
  c, d = 64, k.head_dim
  kda = k.num_heads * (6 * d * d + 3 * c * d + c * c)
  return kinds.count("mla") * mla + kinds.count("kda") * kda


def train_flops_per_token(model_cfg: ml_collections.ConfigDict, seq_len: int,
                          counts: ParamCount | None = None) -> float:
  """6 * active params + 3 * attention forward FLOPs, per trained token.

  `counts` (from `count_params`) saves tracing the model again when the caller has them.
  """
  active = (counts or count_params(model_cfg)).active
  return 6 * active + 3 * attention_flops_per_token(model_cfg, seq_len)


NS_STEPS = 5


def ns_flops(blocks: int, m: int, n: int, steps: int = NS_STEPS) -> float:
  """FLOPs of `steps` Newton-Schulz iterations on `blocks` [m, n] blocks (m <= n): per step
  2 m^2 n for A = X X^T, 2 m^3 for A A and 2 m^2 n for the product with X."""
  return blocks * steps * (4 * m * m * n + 2 * m ** 3)


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """The matmul FLOPs of one training step (remat's recomputation aside), by what the MFU
  counts and what it leaves out."""
  model: float          # the MFU's: `train_flops_per_token` x tokens
  mtp: float            # the MTP layer forward + backward, its LM head included
  newton_schulz: float  # Muon's NS5 on every Muon block

  @property
  def total(self) -> float:
    return self.model + self.mtp + self.newton_schulz


def step_flops(model_cfg: ml_collections.ConfigDict, seq_len: int, tokens: int,
               counts: ParamCount | None = None, muon_mode: str | None = "per_head",
               ns_steps: int = NS_STEPS) -> StepFlops:
  """`StepFlops` of a step of `tokens` trained tokens.

  MTP (report §4.1.4; `k3jax.mtp`): per depth 6 x its active parameters (top-k of its routed
  experts) + 3 x its gated-MLA layer's attention + 6 d V for the LM head it shares.
  Newton-Schulz: `ns_flops` of the blocks `muon.block_groups(..., mode=muon_mode)` finds, once
  a step; none for `muon_mode=None` (AdamW alone).
  """
  counts = counts or count_params(model_cfg)
  mtp_fpt = 0.0
  if counts.mtp:
    per_depth = (3 * attention_flops_per_token(mtp_lib.block_config(model_cfg), seq_len)
                 + 6 * model_cfg.hidden_size * model_cfg.vocab_size)
    mtp_fpt = 6 * counts.mtp_active + per_depth * model_cfg.mtp_num_layers
  groups = {}
  if muon_mode:
    params = nnx.to_pure_dict(nnx.state(abstract_model(model_cfg), nnx.Param))
    groups = muon.block_groups(params, mode=muon_mode)
  ns = sum(ns_flops(b, m, n, ns_steps) for (_, m, n), b in groups.items())
  return StepFlops(model=train_flops_per_token(model_cfg, seq_len, counts) * tokens,
                   mtp=mtp_fpt * tokens, newton_schulz=float(ns))


_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "TPU v5p": 459e12,
              "TPU v5 lite": 197e12, "TPU v6 lite": 918e12, "TPU v4": 275e12}


def peak_flops_per_device() -> tuple[float, str]:
  """(peak FLOP/s, source): a spec-sheet dense bf16 figure, or a measured matmul on CPU."""
  kind = jax.devices()[0].device_kind
  for name, peak in _PEAK_BF16.items():
    if name in kind:
      return peak, f"{kind} spec"
  x = jnp.ones((1024, 1024), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(10):
    y = f(x)
  y.block_until_ready()
  return 10 * 2 * 1024 ** 3 / (time.perf_counter() - t0), f"{kind} measured fp32 matmul"
