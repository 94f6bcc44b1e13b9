"""The full schema of a k3jax experiment: every field, with its default.

Named configs (k3_tiny.py, k3_small.py, k3_full.py, kimi_linear_48b.py) start from
`get_base_config()` and change values only; `k3jax.config.validate` rejects any key that
is not here.
"""
import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "base"

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 163840
  m.hidden_size = 7168
  m.num_layers = 93
  # 1-based indices, as in the HF config's linear_attn_config.
  m.full_attn_layers = tuple(range(4, 93, 4)) + (93,)
  m.kda_layers = ()  # empty: every layer not in full_attn_layers
  m.rms_norm_eps = 1e-5
  m.first_k_dense_replace = 1
  m.dense_intermediate_size = 33792
  m.situ_beta1 = 4.0
  m.situ_beta2 = 25.0
  m.attn_res_block_size = 12  # 0: a plain pre-norm residual stream (Kimi Linear)
  m.mtp_num_layers = 1
  m.mtp_loss_weight = 0.3
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat = "full"  # none | full | save_dots | save_mixer_out | offload (model.REMAT_POLICIES)
  m.scan_layers = True  # scan the repeating unit of layers (model.scan_plan); False: unrolled

  k = m.kda = ml_collections.ConfigDict()
  k.num_heads = 96
  k.head_dim = 128
  k.short_conv_kernel_size = 4
  k.gate = "lower_bound"  # lower_bound (K3) | softplus (Kimi Linear)
  k.gate_lower_bound = -5.0
  k.use_full_rank_gate = True

  a = m.mla = ml_collections.ConfigDict()
  a.num_heads = 96
  a.q_lora_rank = 1536  # 0: a direct q projection (Kimi Linear)
  a.kv_lora_rank = 512
  a.qk_nope_head_dim = 128
  a.qk_rope_head_dim = 64
  a.v_head_dim = 128
  a.use_output_gate = True
  a.lora_norm_eps = 1e-6

  e = m.moe = ml_collections.ConfigDict()
  e.num_experts = 896  # 0: every layer past first_k_dense_replace is a dense SiTU-GLU
  e.num_experts_per_tok = 16
  e.n_shared_experts = 2
  e.moe_intermediate_size = 3072
  e.latent_size = 3584  # 0: no latent projection (plain DeepSeek-style MoE)
  e.routed_scaling_factor = 1.0
  e.norm_topk_prob = True
  e.balancing = "quantile"  # quantile | quantile_exact | sign | none
  e.qb_num_bins = 1000
  e.bias_update_rate = 1e-3  # sign update only
  # Expert parallelism (k3jax.expert_parallel) under a mesh with mesh.expert > 1: auto | off
  e.expert_parallel = "auto"
  # Receive-buffer rows per device = factor * tokens per device * top-k (rounded up to 8);
  # copies past it are dropped and reported (moe/ep_dropped_copies; the loop stops)
  e.ep_capacity_factor = 2.0
  e.ep_all_to_all = "auto"  # auto (ragged on GPU/TPU, padded on CPU) | ragged | padded
  # QAT (k3jax.mx): routed-expert weights fake-quantized to MXFP4, their inputs to MXFP8
  e.qat = False
  # Routed experts as float params, or "mxfp4": packed in the K3 checkpoint layout (inference)
  e.expert_format = "float"

  kn = c.kernels = ml_collections.ConfigDict()
  kn.kda_impl = ""  # "": best available for the platform
  kn.ragged_dot_impl = ""
  # MoE gather + W1/W3 + SiTU: "" best available, "xla" unfused; packed (MXFP4) experts fuse
  # through mxfp4_gate_up with "triton", or "" on Hopper
  kn.gate_up_impl = ""
  # Its training: "kernel" (also writes SiTU's partials), or "unfused" forward + VJP
  kn.gate_up_train = "kernel"
  kn.attention_impl = ""  # MLA training attention (pallas_kernels.attention): "" best available
  # Absorbed-MLA decoding over the filled latent cache (pallas_kernels.decode_attention)
  kn.decode_attention_impl = ""  # "": the platform default
  # A KDA layer's decode step (pallas_kernels.kda_decode): "" the platform default, "xla",
  # "triton" (GPU), "mosaic_tpu" (TPU, by name only)
  kn.kda_decode_impl = ""
  # Routed experts of prefill / decode calls: "sorted" (as in training), "gathered" (tokens x
  # top-k <= experts: each copy's expert weights gathered; no sort, no grouped kernel) or "all"
  # (sorted, but where tokens x top-k >= 2 x experts and tokens <= 64, every expert on every
  # token, weighted by 0 where unselected: no sort, no permutation; k3_small's decode at B 16
  # 2.78-2.80 ms a token against sorted's 2.92, H100, 2026-12-07)
  kn.moe_decode_experts = "all"
  kn.xla_triton_gemm = False  # XLA's own GEMMs: cuBLAS (False) or its Triton GEMM fusions (True)
  # The step's Mosaic GPU kernels built on a thread pool while XLA compiles the step
  # (pallas_kernels.mosaic_gpu_prebuild); False: XLA builds them one after another
  kn.prebuild_mosaic_gpu = True

  t = c.train = ml_collections.ConfigDict()
  t.steps = 1000
  t.global_batch_size = 8
  t.grad_accum_steps = 1  # micro-batches per optimizer step (global_batch_size is split)
  t.seq_len = 1024
  t.optimizer = "muon"  # muon (per-head, report §2.5) | muon_whole | adamw
  t.muon_ns_dtype = "bfloat16"  # Newton-Schulz iterations in bfloat16 (Muon's own) or float32
  t.muon_ns_fold = False  # NS5 with each step's scalars in its products' scales (muon.py)
  t.muon_ns_stack = True  # equal blocks of several leaves in one NS batch; False: per leaf
  t.learning_rate = 3e-4
  t.warmup_frac = 0.01
  t.final_lr_frac = 0.1
  t.weight_decay = 0.1
  t.adam_b1 = 0.9
  t.adam_b2 = 0.95
  t.grad_clip = 1.0
  t.qk_clip_tau = 100.0  # 0: off
  t.seed = 0
  t.log_every = 10
  t.checkpoint_every = 100
  t.keep_checkpoints = 3

  d = c.data = ml_collections.ConfigDict()
  d.source = "default"  # default | memmap | array_record
  d.paths = ()
  d.default_num_docs = 20000
  d.num_workers = 0

  ms = c.mesh = ml_collections.ConfigDict()
  ms.data = -1  # -1: all devices not used by the other axes
  ms.pipeline = 1
  ms.expert = 1
  ms.context = 1
  # logical axis -> mesh axes; a logical name not listed is replicated. A parameter's dims take
  # their mesh axes in order, each mesh axis once. FSDP (ZeRO-3): the names mapped to `data`
  # give every matrix one dim split over `data` (d, the MoE latent, the MLA ranks, or a
  # head dim); a dim `data` does not divide stays whole (k3jax.sharding.param_spec).
  ms.logical_axis_rules = (
      ("activation_batch", ("data", "expert")),
      ("activation_length", ("context",)),
      ("exp", ("expert",)),
      ("layers", ("pipeline",)),
      ("embed", ("data",)),
      ("latent", ("data",)),
      ("q_lora", ("data",)),
      ("kv_lora", ("data",)),
      ("kv", ("data",)),
  )
  return c
