"""A K3-shaped model that trains on 2 CPU cores in a few minutes (byte-level default corpus)."""
from experiments.configs import base


def get_config():
  c = base.get_base_config()
  c.name = "k3_tiny"
  m = c.model
  m.vocab_size = 258
  m.hidden_size = 64
  m.num_layers = 8
  m.full_attn_layers = (4, 8)
  m.dense_intermediate_size = 128
  m.attn_res_block_size = 3
  m.dtype = "float32"
  m.remat = "none"
  m.kda.num_heads = 2
  m.kda.head_dim = 16
  m.mla.num_heads = 2
  m.mla.q_lora_rank = 24
  m.mla.kv_lora_rank = 16
  m.mla.qk_nope_head_dim = 16
  m.mla.qk_rope_head_dim = 8
  m.mla.v_head_dim = 16
  m.moe.num_experts = 8
  m.moe.num_experts_per_tok = 2
  m.moe.n_shared_experts = 2
  m.moe.moe_intermediate_size = 96
  m.moe.latent_size = 32
  m.moe.qb_num_bins = 200
  t = c.train
  t.steps = 300
  t.global_batch_size = 8
  t.seq_len = 128
  t.learning_rate = 3e-3
  t.log_every = 10
  t.checkpoint_every = 50
  c.data.default_num_docs = 4000
  return c
