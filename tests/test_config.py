"""Config validation: every named config loads; bad fields fail with the field named."""
import json

import pytest

from k3jax import config

CONFIGS = ["k3_tiny", "k3_small", "k3_full", "kimi_linear_48b"]


@pytest.mark.parametrize("name", CONFIGS)
def test_named_configs_validate(name):
  cfg = config.load(f"experiments/configs/{name}.py")
  assert cfg.name == name


def test_k3_full_is_the_released_config():
  m = config.load("experiments/configs/k3_full.py").model
  kinds = config.layer_types(m)
  assert (m.num_layers, m.hidden_size, m.vocab_size) == (93, 7168, 163840)
  assert [i + 1 for i, k in enumerate(kinds) if k == "mla"] == list(range(4, 93, 4)) + [93]
  assert kinds.count("kda") == 69
  assert (m.kda.num_heads, m.kda.head_dim, m.mla.num_heads) == (96, 128, 96)
  assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim,
          m.mla.qk_rope_head_dim, m.mla.v_head_dim) == (1536, 512, 128, 64, 128)
  assert (m.moe.num_experts, m.moe.num_experts_per_tok, m.moe.n_shared_experts,
          m.moe.moe_intermediate_size, m.moe.latent_size) == (896, 16, 2, 3072, 3584)
  assert m.dense_intermediate_size == 33792 and m.attn_res_block_size == 12
  assert m.kda.gate == "lower_bound" and m.kda.gate_lower_bound == -5.0


def test_kimi_linear_pattern():
  m = config.load("experiments/configs/kimi_linear_48b.py").model
  kinds = config.layer_types(m)
  assert [i + 1 for i, k in enumerate(kinds) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]


@pytest.mark.parametrize("overrides, field", [
    ({"model.full_attn_layers": (4, 9)}, "model.full_attn_layers"),
    ({"model.full_attn_layers": (8, 4)}, "model.full_attn_layers"),
    ({"model.kda_layers": (1, 2, 3)}, "model.kda_layers"),
    ({"model.kda.gate": "relu"}, "model.kda.gate"),
    ({"model.moe.balancing": "aux_loss"}, "model.moe.balancing"),
    ({"model.moe.num_experts_per_tok": 9}, "model.moe.num_experts_per_tok"),
    ({"model.hidden_size": 0}, "model.hidden_size"),
    ({"train.optimizer": "sgd"}, "train.optimizer"),
    ({"train.steps": 1}, "train.steps"),
    ({"train.warmup_frac": 1.0}, "train.warmup_frac"),
    ({"train.final_lr_frac": -0.1}, "train.final_lr_frac"),
    ({"data.source": "web"}, "data.source"),
    ({"mesh.expert": 3}, "mesh.expert"),
    ({"mesh.logical_axis_rules": (("heads", ("expert",)),), "mesh.expert": 4,
      "model.kda.num_heads": 6}, "model.kda.num_heads"),
    ({"mesh.logical_axis_rules": (("exp", ("tensor",)),)}, "mesh.logical_axis_rules"),
])
def test_bad_field_is_named(overrides, field):
  with pytest.raises(config.ConfigError) as e:
    config.load("experiments/configs/k3_tiny.py", overrides)
  assert e.value.field == field
  assert f"`{field}`" in str(e.value)


def test_unknown_key_is_named():
  cfg = config.load("experiments/configs/k3_tiny.py")
  cfg.model.unlock()
  cfg.model.num_heads = 4
  with pytest.raises(config.ConfigError, match="model.num_heads.*unknown field"):
    config.validate(cfg)
  with pytest.raises(config.ConfigError, match="model.nonexistent"):
    config.load("experiments/configs/k3_tiny.py", {"model.nonexistent": 1})


def test_unknown_field_lists_names_and_a_close_match():
  with pytest.raises(config.ConfigError) as e:
    config.check_field("model.hiden_size")
  assert e.value.field == "model.hiden_size"
  assert "'hidden_size'" in str(e.value) and "did you mean `model.hidden_size`?" in str(e.value)
  with pytest.raises(config.ConfigError, match="`train.zzz`: unknown field; allowed names here: "
                     r"\['adam_b1'") as e:
    config.check_field("train.zzz")
  assert "did you mean" not in str(e.value)
  with pytest.raises(config.ConfigError, match="`model.hidden_size`: is a value"):
    config.check_field("model.hidden_size.x")
  config.check_field("model.kda.gate")


def test_paths_with_the_generated_corpus_is_an_error():
  with pytest.raises(config.ConfigError, match="`data.paths`: .*data.source='default'"):
    config.load("experiments/configs/k3_tiny.py", {"data.paths": ("a.bin",)})


def test_json_round_trip():
  cfg = config.load("experiments/configs/k3_full.py")
  again = config.from_json(cfg.to_json())
  assert again == cfg


def test_json_from_an_older_schema_takes_defaults_and_rejects_unknown_keys():
  cfg = config.load("experiments/configs/k3_tiny.py")
  saved = json.loads(cfg.to_json())
  del saved["train"]["grad_accum_steps"]
  again = config.from_json(json.dumps(saved))
  assert again.train.grad_accum_steps == 1 and again.model.hidden_size == cfg.model.hidden_size
  saved["model"]["bogus"] = 1
  with pytest.raises(config.ConfigError, match="model.bogus"):
    config.from_json(json.dumps(saved))
