"""Kimi-Linear-48B-A3B (kda.md §6): softplus gate, low-rank output gate, no AttnRes, no q_lora."""
from experiments.configs import base


def get_config():
  c = base.get_base_config()
  c.name = "kimi_linear_48b"
  m = c.model
  m.hidden_size = 2304
  m.num_layers = 27
  m.full_attn_layers = (4, 8, 12, 16, 20, 24, 27)
  m.dense_intermediate_size = 9216
  m.attn_res_block_size = 0
  m.mtp_num_layers = 0
  m.kda.num_heads = 32
  m.kda.gate = "softplus"
  m.kda.use_full_rank_gate = False
  m.mla.num_heads = 32
  m.mla.q_lora_rank = 0
  m.mla.use_output_gate = False
  m.moe.num_experts = 256
  m.moe.num_experts_per_tok = 8
  m.moe.n_shared_experts = 1
  m.moe.moe_intermediate_size = 1024
  m.moe.latent_size = 0
  m.moe.routed_scaling_factor = 2.446
  return c
