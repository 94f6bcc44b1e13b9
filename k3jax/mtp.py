"""Multi-Token Prediction, one depth (DeepSeek-V3 §2.2; K3 [TR] §4.1.4, k3_techniques.md §8).

K3 pretrains "1 MTP layer, mirroring a backbone block". Position i combines the backbone's
hidden h_i with the embedding of the next token t_{i+1} and predicts t_{i+2}:

  h'_i = W_eh [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]      W_eh: [2d, d], embedding first
  o_i  = Block(h')                                           one gated-MLA decoder layer
  logits_i = RMSNorm(o_i) W_head                             the main model's LM head (shared)

h is the hidden the LM head sees (after the backbone's final `norm`), as vLLM's DeepSeek MTP
reads it. The embedding table and the LM head belong to the main model and are not owned here.
The block is `k3jax.model.DecoderLayer` built from `block_config`: a gated MLA token mixer, the
config's FFN (Stable LatentMoE when it has experts) and the backbone's plain pre-norm residual
step (`k3jax.model.residual_layer`, no AttnRes).
Loss: L = L_main + lambda * CE(logits_i, t_{i+2}) (`model.mtp_loss_weight`, DeepSeek-V3: 0.3).
"""
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import k3jax  # noqa: F401  (turns off eager sharding before parameters are created)
from k3jax import config as config_lib
from k3jax import losses
from k3jax import model as model_lib
from k3jax import params
from k3jax.norms import RMSNorm


def block_config(model_cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The model config of the MTP block: one gated-MLA layer, MoE FFN, pre-norm residual."""
  c = model_cfg.copy_and_resolve_references()
  c.num_layers = 1
  c.full_attn_layers = (1,)
  c.kda_layers = ()
  c.attn_res_block_size = 0
  c.first_k_dense_replace = 0
  return c


class MTP(nnx.Module):
  """One MTP depth; parameter paths `enorm`, `hnorm`, `eh_proj`, `layer`, `norm`."""

  def __init__(self, model_cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs,
               kernels: ml_collections.ConfigDict | None = None):
    d, eps = model_cfg.hidden_size, model_cfg.rms_norm_eps
    self.hidden_size = d
    self.dtype = config_lib.dtype(model_cfg.dtype)
    self.enorm = RMSNorm(d, eps, rngs=rngs)
    self.hnorm = RMSNorm(d, eps, rngs=rngs)
    self.eh_proj = nnx.Dict(kernel=params.param(
        rngs, params.fan_in_init((0,)), (2 * d, d), ("mtp_concat", "embed"),
        config_lib.dtype(model_cfg.param_dtype)))
    self.layer = model_lib.DecoderLayer(block_config(model_cfg), 0, rngs=rngs,
                                        kernels=kernels)
    self.norm = RMSNorm(d, eps, rngs=rngs)
    self.remat = model_cfg.remat

  def __call__(self, h: jax.Array, next_token_embeddings: jax.Array, segment_ids: jax.Array,
               positions: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """h [B, T, d] (backbone, after its final norm), Emb(t_{i+1}) [B, T, d], segment ids and
    positions [B, T] of the inputs -> (normed MTP hidden [B, T, d], aux of the block)."""
    if h.ndim != 3 or h.shape[-1] != self.hidden_size:
      raise ValueError(f"h must be [B, T, {self.hidden_size}], got {h.shape}")
    if next_token_embeddings.shape != h.shape:
      raise ValueError(f"next_token_embeddings must have the shape of h {h.shape}, got "
                       f"{next_token_embeddings.shape}")
    if segment_ids.shape != h.shape[:2] or positions.shape != h.shape[:2]:
      raise ValueError(f"segment_ids and positions must be [B, T] = {h.shape[:2]}, got "
                       f"{segment_ids.shape} and {positions.shape}")
    with jax.named_scope("mtp"):
      e = self.enorm(next_token_embeddings.astype(self.dtype))
      x = jnp.concatenate([e, self.hnorm(h.astype(self.dtype))], axis=-1)
      x = x @ self.eh_proj["kernel"][...].astype(self.dtype)
      fn = model_lib.remat(model_lib.residual_layer, self.remat)
      x, aux, _ = fn(self.layer, x, segment_ids, positions)
      return self.norm(x), aux


def shift_targets(targets: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Depth-1 MTP targets from a next-token batch (`k3jax.data.shift_packed_batch`).

  targets [B, T] = t_{i+1}, segment_ids [B, T] of t_i, loss_mask [B, T] (1 iff t_{i+1} is in
  t_i's non-padding document) -> (targets2 [B, T] = t_{i+2}, mask2 [B, T] float32).
  mask2_i = [seg(t_{i+1}) == seg(t_i)] * loss_mask_{i+1}: t_i, t_{i+1} and t_{i+2} lie in one
  document; mask2 is 0 at i = T - 1, whose t_{i+2} lies beyond the row.
  """
  if targets.ndim != 2 or segment_ids.shape != targets.shape or loss_mask.shape != targets.shape:
    raise ValueError(f"targets, segment_ids and loss_mask must all be [B, T], got "
                     f"{targets.shape}, {segment_ids.shape}, {loss_mask.shape}")
  b = targets.shape[0]
  targets2 = jnp.concatenate([targets[:, 1:], jnp.zeros((b, 1), targets.dtype)], axis=1)
  same = (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)
  mask2 = jnp.concatenate([same * loss_mask[:, 1:].astype(jnp.float32),
                           jnp.zeros((b, 1), jnp.float32)], axis=1)
  return targets2, mask2


def mtp_head_loss(hidden: jax.Array, lm_head: jax.Array, targets2: jax.Array, mask2: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Mean CE of t_{i+2} over mask2 > 0 (fp32) through the shared head lm_head [d, V] (in the
  model's dtype), blockwise without [B, T, V] logits (`k3jax.losses`). Returns (loss, n)."""
  with jax.named_scope("mtp_loss"):
    return losses.lm_head_cross_entropy(hidden, lm_head, targets2, mask2)
