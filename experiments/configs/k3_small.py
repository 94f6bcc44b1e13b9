"""A K3-shaped model for one H200 (1.0B total, 0.36B active parameters), T = 8192."""
from experiments.configs import base


def get_config():
  c = base.get_base_config()
  c.name = "k3_small"
  m = c.model
  m.hidden_size = 1024
  m.num_layers = 12
  m.full_attn_layers = (4, 8, 12)
  m.dense_intermediate_size = 4096
  m.attn_res_block_size = 4
  # Unrolled: 12 layers compile as fast as the scanned form and train 4-23% faster on an H200
  # (BENCHMARKS.md, train step). A pipeline mesh needs the scan (scale_out sets it).
  m.scan_layers = False
  # The fastest remat that fits at this config's batch (8): save_dots 766.5 ms a step against
  # full's 793.5 (H200, 2026-12-03); `none` needs 175 GiB there, and is the fastest at B 2.
  m.remat = "save_dots"
  m.kda.num_heads = 8
  m.kda.head_dim = 128
  m.mla.num_heads = 8
  m.mla.q_lora_rank = 384
  m.mla.kv_lora_rank = 256
  m.mla.qk_nope_head_dim = 128
  m.mla.qk_rope_head_dim = 64
  m.mla.v_head_dim = 128
  m.moe.num_experts = 64
  m.moe.num_experts_per_tok = 8
  m.moe.n_shared_experts = 2
  m.moe.moe_intermediate_size = 512
  m.moe.latent_size = 512
  c.train.global_batch_size = 8
  c.train.seq_len = 8192
  c.train.steps = 2000
  c.train.learning_rate = 1e-3
  return c
