"""Kimi K3 checkpoints in Hugging Face form (k3jax.hf, launch.convert).

The checkpoint under test is written here by a small writer of its own (numpy +
safetensors.numpy, every name spelled out from k3_hf_names.md) at k3_tiny's widths with 4 layers
(KDA, MLA, KDA, MLA; a dense first FFN, then Stable LatentMoE): bf16 tensors, the release's
float32 ones, routed experts as MXFP4 pairs, sharded over 3 files with an index. Loaded
parameters are compared with the HF tensors under transforms written out here, the MXFP4 decoder
from the spec's tables.
"""
import json
import os
import shlex
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from experiments.configs import k3_tiny
from k3jax import hf, mx, sharding
from launch import cli

V, D, L, I = 258, 64, 4, 128              # vocab, hidden, layers, dense intermediate
H, K, W = 2, 16, 4                        # KDA heads, head dim, conv width
N, QR, KR, DN, DR, DV = 2, 24, 16, 16, 8, 16  # MLA
E, TOPK, S, M, LAT = 8, 2, 2, 96, 32      # experts, top-k, shared, expert width, latent
FULL, BLOCK = (2, 4), 2                   # 1-based MLA layers, AttnRes block size
M_ = "language_model.model."
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
DROP = object()  # text_config(field=DROP): the field left out
FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def text_config(**changes):
  text = {
      "model_type": "kimi_linear", "architectures": ["KimiK3ForCausalLM"], "vocab_size": V,
      "hidden_size": D, "head_dim": D // N, "intermediate_size": I, "num_hidden_layers": L,
      "num_attention_heads": N, "num_key_value_heads": N, "hidden_act": "situ",
      "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "pad_token_id": 0,
      "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "rope_scaling": None,
      "tie_word_embeddings": False, "attention_dropout": 0.0,
      "max_position_embeddings": 1048576, "moe_intermediate_size": M, "moe_renormalize": True,
      "moe_router_activation_func": "sigmoid", "num_experts": E, "num_experts_per_token": TOPK,
      "num_shared_experts": S, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
      "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
      "topk_method": "noaux_tc", "routed_expert_hidden_size": LAT, "latent_moe_use_norm": True,
      "q_lora_rank": QR, "kv_lora_rank": KR, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR,
      "v_head_dim": DV, "mla_use_nope": True, "mla_use_output_gate": True,
      "linear_attn_config": {"head_dim": K, "num_heads": H, "short_conv_kernel_size": W,
                             "kda_layers": [1, 3], "full_attn_layers": list(FULL),
                             "use_full_rank_gate": True, "gate_lower_bound": -5.0},
      "kda_mode": "chunk", "situ_backend": "torch", "attn_res_block_size": BLOCK,
      "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
      "num_nextn_predict_layers": 0,
  }
  text.update(changes)
  text = {k: v for k, v in text.items() if v is not DROP}
  return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
          "text_config": text, "vision_config": {"patch_size": 14},
          "media_placeholder_token_id": 163605, "pad_token_id": 0}


def mxfp4_pair(rng, out, inp):
  """Random MXFP4 (weight_packed, weight_scale) whose every block holds a +-6 code, so its
  scale is the one the spec's floor rule gives back (a bit-exact re-pack)."""
  codes = rng.integers(0, 16, (out, inp)).astype(np.uint8)
  blocks = codes.reshape(out, inp // 32, 32)
  blocks[..., 5] = np.where(rng.random((out, inp // 32)) < 0.5, 7, 15)
  packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return packed, rng.integers(118, 132, (out, inp // 32)).astype(np.uint8)


def decode_mxfp4(packed, scale):
  """k3_hf_names.md: low nibble = even column, value = E2M1[nibble] * 2^(scale - 127)."""
  codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
  return E2M1[codes] * np.repeat(np.ldexp(1.0, scale.astype(np.int32) - 127), 32, axis=1)


def hf_tensors(seed=0):
  """Every tensor of the tiny K3 text model under its HF name (k3_hf_names.md)."""
  rng = np.random.default_rng(seed)
  t = {}

  def add(name, *shape, gain=False):
    x = rng.standard_normal(shape).astype(np.float32) * 0.3 + (1.0 if gain else 0.0)
    t[name] = x if name.endswith(FP32) else x.astype(ml_dtypes.bfloat16)

  add(M_ + "embed_tokens.weight", V, D)
  add("language_model.lm_head.weight", V, D)
  add(M_ + "norm.weight", D, gain=True)
  add(M_ + "output_attn_res_norm.weight", D, gain=True)
  add(M_ + "output_attn_res_proj.weight", 1, D)
  for i in range(L):
    p = f"{M_}layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                 "mlp_res_norm"):
      add(p + norm + ".weight", D, gain=True)
    add(p + "self_attention_res_proj.weight", 1, D)
    add(p + "mlp_res_proj.weight", 1, D)
    a = p + "self_attn."
    if i + 1 in FULL:
      add(a + "q_a_proj.weight", QR, D)
      add(a + "q_a_layernorm.weight", QR, gain=True)
      add(a + "q_b_proj.weight", N * (DN + DR), QR)
      add(a + "kv_a_proj_with_mqa.weight", KR + DR, D)
      add(a + "kv_a_layernorm.weight", KR, gain=True)
      add(a + "kv_b_proj.weight", N * (DN + DV), KR)
      add(a + "g_proj.weight", N * DV, D)
      add(a + "o_proj.weight", D, N * DV)
    else:
      for x in "qkv":
        add(a + f"{x}_proj.weight", H * K, D)
        add(a + f"{x}_conv1d.weight", H * K, 1, W)
      t[a + "A_log"] = np.zeros(128, np.float32)
      t[a + "A_log"][:H] = rng.standard_normal(H)
      add(a + "dt_bias", H * K)
      add(a + "f_a_proj.weight", K, D)
      add(a + "f_b_proj.weight", H * K, K)
      add(a + "b_proj.weight", H, D)
      add(a + "g_proj.weight", H * K, D)
      add(a + "o_norm.weight", K, gain=True)
      add(a + "o_proj.weight", D, H * K)
    if i == 0:
      add(p + "mlp.gate_proj.weight", I, D)
      add(p + "mlp.up_proj.weight", I, D)
      add(p + "mlp.down_proj.weight", D, I)
      continue
    b = p + "block_sparse_moe."
    add(b + "gate.weight", E, D)
    add(b + "gate.e_score_correction_bias", E)
    add(b + "routed_expert_down_proj.weight", LAT, D)
    add(b + "routed_expert_norm.weight", LAT, gain=True)
    add(b + "routed_expert_up_proj.weight", D, LAT)
    add(b + "shared_experts.gate_proj.weight", S * M, D)
    add(b + "shared_experts.up_proj.weight", S * M, D)
    add(b + "shared_experts.down_proj.weight", D, S * M)
    for e in range(E):
      for w, (out, inp) in (("w1", (M, LAT)), ("w2", (LAT, M)), ("w3", (M, LAT))):
        packed, scale = mxfp4_pair(rng, out, inp)
        t[f"{b}experts.{e}.{w}.weight_packed"] = packed
        t[f"{b}experts.{e}.{w}.weight_scale"] = scale
  return t


def write_hf(path, tensors, config, files=3):
  """config.json, `files` shards of the sorted names and the index."""
  os.makedirs(path)
  names = sorted(tensors)
  weight_map = {}
  for k, part in enumerate(np.array_split(np.arange(len(names)), files)):
    file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
    save_file({names[j]: tensors[names[j]] for j in part}, os.path.join(path, file),
              metadata={"format": "pt"})
    weight_map.update({names[j]: file for j in part})
  index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
           "weight_map": weight_map}
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return path


def read_hf(path):
  """{name: numpy array} of every tensor in a checkpoint directory (the test's reader)."""
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))
  out = {}
  for file in files:
    with safe_open(os.path.join(path, file), framework="np") as f:
      out.update({name: f.get_tensor(name) for name in f.keys()})
  return out


def assert_bit_identical(want, got):
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    assert got[name].shape == want[name].shape, name
    assert got[name].tobytes() == want[name].tobytes(), name


def expected_params(t):
  """k3jax path -> value, written out from k3_hf_names.md and WORKSPACE.md's conventions."""
  f = lambda name: np.asarray(t[name], np.float32)
  out = {"embed_tokens.embedding": f(M_ + "embed_tokens.weight"),
         "lm_head.kernel": f("language_model.lm_head.weight").T,
         "norm.scale": f(M_ + "norm.weight"),
         "output_attn_res_norm.scale": f(M_ + "output_attn_res_norm.weight"),
         "output_attn_res_proj.kernel": f(M_ + "output_attn_res_proj.weight")[0]}
  for i in range(L):
    p, q = f"{M_}layers.{i}.", f"layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                 "mlp_res_norm"):
      out[q + norm + ".scale"] = f(p + norm + ".weight")
    for proj in ("self_attention_res_proj", "mlp_res_proj"):
      out[q + proj + ".kernel"] = f(p + proj + ".weight")[0]
    a, b = p + "self_attn.", q + "self_attn."
    if i + 1 in FULL:
      out[b + "q_a_proj.kernel"] = f(a + "q_a_proj.weight").T
      out[b + "q_a_layernorm.scale"] = f(a + "q_a_layernorm.weight")
      out[b + "q_b_proj.kernel"] = f(a + "q_b_proj.weight").T.reshape(QR, N, DN + DR)
      out[b + "kv_a_proj_with_mqa.kernel"] = f(a + "kv_a_proj_with_mqa.weight").T
      out[b + "kv_a_layernorm.scale"] = f(a + "kv_a_layernorm.weight")
      out[b + "kv_b_proj.kernel"] = f(a + "kv_b_proj.weight").T.reshape(KR, N, DN + DV)
      out[b + "g_proj.kernel"] = f(a + "g_proj.weight").T.reshape(D, N, DV)
      out[b + "o_proj.kernel"] = f(a + "o_proj.weight").T.reshape(N, DV, D)
    else:
      for x in "qkv":
        out[b + f"{x}_proj.kernel"] = f(a + f"{x}_proj.weight").T.reshape(D, H, K)
        out[b + f"{x}_conv1d.kernel"] = f(a + f"{x}_conv1d.weight")[:, 0, :].T
      out[b + "A_log"] = f(a + "A_log")[:H]
      out[b + "dt_bias"] = f(a + "dt_bias")
      out[b + "f_a_proj.kernel"] = f(a + "f_a_proj.weight").T
      out[b + "f_b_proj.kernel"] = f(a + "f_b_proj.weight").T.reshape(K, H, K)
      out[b + "b_proj.kernel"] = f(a + "b_proj.weight").T
      out[b + "g_proj.kernel"] = f(a + "g_proj.weight").T.reshape(D, H, K)
      out[b + "o_norm.scale"] = f(a + "o_norm.weight")
      out[b + "o_proj.kernel"] = f(a + "o_proj.weight").T.reshape(H, K, D)
    if i == 0:
      for proj in ("gate_proj", "up_proj", "down_proj"):
        out[q + f"mlp.{proj}.kernel"] = f(p + f"mlp.{proj}.weight").T
      continue
    a, b = p + "block_sparse_moe.", q + "block_sparse_moe."
    out[b + "gate.kernel"] = f(a + "gate.weight").T
    out[b + "gate.e_score_correction_bias"] = f(a + "gate.e_score_correction_bias")
    out[b + "routed_expert_down_proj.kernel"] = f(a + "routed_expert_down_proj.weight").T
    out[b + "routed_expert_norm.scale"] = f(a + "routed_expert_norm.weight")
    out[b + "routed_expert_up_proj.kernel"] = f(a + "routed_expert_up_proj.weight").T
    for proj in ("gate_proj", "up_proj", "down_proj"):
      out[b + f"shared_experts.{proj}.kernel"] = f(a + f"shared_experts.{proj}.weight").T
    for w in ("w1", "w2", "w3"):
      out[b + f"experts.{w}"] = np.stack([
          decode_mxfp4(t[f"{a}experts.{e}.{w}.weight_packed"],
                       t[f"{a}experts.{e}.{w}.weight_scale"]).T for e in range(E)])
  return out


def flat_params(model):
  return {".".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def tensors():
  return hf_tensors()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tensors):
  return write_hf(str(tmp_path_factory.mktemp("hf") / "k3_tiny"), tensors, text_config())


@pytest.fixture(scope="module")
def loaded(hf_dir):
  return hf.load_checkpoint(hf_dir)


def test_loaded_parameters_are_the_hf_tensors_under_the_documented_transforms(loaded, tensors):
  cfg, model = loaded
  got, want = flat_params(model), expected_params(tensors)
  assert sorted(got) == sorted(want)
  for path, value in want.items():
    assert got[path].dtype == np.float32, path
    np.testing.assert_array_equal(got[path], value, err_msg=path)
  m = cfg.model
  assert (m.vocab_size, m.hidden_size, m.num_layers, m.full_attn_layers) == (V, D, L, FULL)
  assert (m.kda.num_heads, m.kda.head_dim, m.kda.gate, m.kda.gate_lower_bound) == (
      H, K, "lower_bound", -5.0)
  assert (m.mla.num_heads, m.mla.q_lora_rank, m.mla.qk_rope_head_dim) == (N, QR, DR)
  assert (m.moe.num_experts, m.moe.num_experts_per_tok, m.moe.latent_size) == (E, TOPK, LAT)
  assert m.mtp_num_layers == 0 and not hasattr(model, "mtp")


def test_round_trip_is_bit_identical(loaded, tensors, tmp_path):
  cfg, model = loaded
  out = str(tmp_path / "out")
  hf.save_checkpoint(cfg, model, out, max_shard_bytes=40_000)
  assert_bit_identical(tensors, read_hf(out))
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 3 and sorted(os.listdir(out)) == sorted(
      files + ["config.json", "model.safetensors.index.json"])
  assert index["metadata"]["total_size"] == sum(x.nbytes for x in tensors.values())
  for file in files:
    names = [n for n, f in index["weight_map"].items() if f == file]
    assert len(names) == 1 or sum(tensors[n].nbytes for n in names) <= 40_000, file
  with open(os.path.join(out, "config.json")) as f:
    text = json.load(f)["text_config"]
  for key, value in text_config()["text_config"].items():  # every field k3jax maps or checks
    if key not in hf.TEXT_IGNORED:
      assert text[key] == value, key


def test_bf16_experts_save_and_load_back(loaded, tmp_path):
  cfg, model = loaded
  out = str(tmp_path / "bf16")
  hf.save_checkpoint(cfg, model, out, experts="bf16")
  saved = read_hf(out)
  w1 = saved[f"{M_}layers.3.block_sparse_moe.experts.5.w1.weight"]
  assert w1.dtype == ml_dtypes.bfloat16 and w1.shape == (M, LAT)
  assert not any(name.endswith(("weight_packed", "weight_scale")) for name in saved)
  _, again = hf.load_checkpoint(out)
  got, want = flat_params(again), flat_params(model)
  for path in want:  # the MXFP4 values are exact in bfloat16
    np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_packed_experts_load_as_they_are(hf_dir, tensors, tmp_path):
  """model.moe.expert_format "mxfp4": the model holds each expert's weight_packed /
  weight_scale bytes stacked; they are written back unchanged, or unpacked as bf16."""
  base = k3_tiny.get_config()
  base.model.moe.expert_format = "mxfp4"
  cfg, model = hf.load_checkpoint(hf_dir, config=base)
  got = flat_params(model)
  assert "layers.1.block_sparse_moe.experts.w1" not in got
  for i in range(1, L):
    for w in ("w1", "w2", "w3"):
      for part in ("packed", "scale"):
        want = np.stack([tensors[f"{M_}layers.{i}.block_sparse_moe.experts.{e}.{w}.weight_{part}"]
                         for e in range(E)])
        x = got[f"layers.{i}.block_sparse_moe.experts.{w}_{part}"]
        assert x.dtype == np.uint8
        np.testing.assert_array_equal(x, want)
  out = str(tmp_path / "packed")
  hf.save_checkpoint(cfg, model, out, max_shard_bytes=60_000)
  assert_bit_identical(tensors, read_hf(out))
  bf16 = str(tmp_path / "bf16")
  hf.save_checkpoint(cfg, model, bf16, experts="bf16")
  saved = read_hf(bf16)
  a = f"{M_}layers.2.block_sparse_moe.experts.6.w2."
  np.testing.assert_array_equal(np.asarray(saved[a + "weight"], np.float32),
                                decode_mxfp4(tensors[a + "weight_packed"],
                                             tensors[a + "weight_scale"]))
  _, repacked = hf.load_checkpoint(bf16, config=base)  # bf16 experts packed at load
  again = flat_params(repacked)
  for path, value in got.items():
    np.testing.assert_array_equal(again[path], value, err_msg=path)


def test_mesh_placement_follows_the_logical_rules(hf_dir):
  base = k3_tiny.get_config()
  mesh = sharding.make_mesh(base.mesh)
  cfg, model = hf.load_checkpoint(hf_dir, mesh=mesh, config=base, dtype="bfloat16")
  rules = cfg.mesh.logical_axis_rules
  assert cfg.train.learning_rate == base.train.learning_rate
  for path, var in nnx.to_flat_state(nnx.state(model)):
    x = var.get_value()
    assert x.sharding == jax.sharding.NamedSharding(mesh, sharding.param_spec(
        var.get_metadata()["out_sharding"], x.shape, mesh, rules)), path
  assert model.layers[0].self_attn.q_proj["kernel"].get_value().dtype == jax.numpy.bfloat16
  assert model.layers[0].self_attn.A_log.get_value().dtype == np.float32


def test_mtp_off_or_freshly_initialised_and_written_as_deepseek_v3(hf_dir, tensors, tmp_path,
                                                                     caplog):
  cfg, model = hf.load_checkpoint(hf_dir, init_mtp=True, seed=3)
  assert "MTP layer is freshly initialised" in caplog.text
  assert cfg.model.mtp_num_layers == 1
  out = str(tmp_path / "mtp")
  hf.save_checkpoint(cfg, model, out)
  saved = read_hf(out)
  mtp = f"{M_}layers.{L}."
  for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "self_attn.q_b_proj.weight", "block_sparse_moe.experts.7.w2.weight_packed"):
    assert mtp + name in saved, name
  assert saved[mtp + "eh_proj.weight"].shape == (D, 2 * D)
  assert saved[mtp + "embed_tokens.weight"].tobytes() == tensors[
      M_ + "embed_tokens.weight"].tobytes()
  assert saved[mtp + "shared_head.head.weight"].tobytes() == tensors[
      "language_model.lm_head.weight"].tobytes()
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["text_config"]["num_nextn_predict_layers"] == 1
  fresh = flat_params(model)
  np.testing.assert_allclose(np.asarray(saved[mtp + "eh_proj.weight"], np.float32).T,
                             fresh["mtp.eh_proj.kernel"], rtol=2**-8)
  cfg2, model2 = hf.load_checkpoint(out)
  assert cfg2.model.mtp_num_layers == 1
  got = flat_params(model2)
  f = lambda name: np.asarray(saved[mtp + name], np.float32)
  np.testing.assert_array_equal(got["mtp.eh_proj.kernel"], f("eh_proj.weight").T)
  np.testing.assert_array_equal(got["mtp.norm.scale"], f("shared_head.norm.weight"))
  np.testing.assert_array_equal(got["mtp.layer.self_attn.o_proj.kernel"],
                                f("self_attn.o_proj.weight").T.reshape(N, DV, D))
  np.testing.assert_array_equal(
      got["mtp.layer.block_sparse_moe.experts.w2"][7],
      decode_mxfp4(saved[mtp + "block_sparse_moe.experts.7.w2.weight_packed"],
                   saved[mtp + "block_sparse_moe.experts.7.w2.weight_scale"]).T)
  again = str(tmp_path / "mtp_again")
  hf.save_checkpoint(cfg2, model2, again)
  assert_bit_identical(saved, read_hf(again))
  saved[mtp + "shared_head.head.weight"] = saved[mtp + "shared_head.head.weight"] * 2
  bad = write_hf(str(tmp_path / "mtp_bad"), saved, json.load(open(os.path.join(out,
                                                                               "config.json"))))
  with pytest.raises(hf.HFCheckpointError, match=r"layers\.4\.shared_head\.head\.weight .*differs"):
    hf.load_checkpoint(bad)


def test_no_mtp_weights_leave_mtp_off_with_a_warning(hf_dir, caplog):
  cfg, model = hf.load_checkpoint(hf_dir, config=k3_tiny.get_config())
  assert cfg.model.mtp_num_layers == 0 and not hasattr(model, "mtp")
  assert "has no MTP weights" in caplog.text and "no MTP layer" in caplog.text


def _variant(tmp_path, tensors, name, drop=(), change=None, **config_changes):
  t = {k: v for k, v in tensors.items() if k not in drop}
  t.update(change or {})
  return write_hf(str(tmp_path / name), t, text_config(**config_changes), files=2)


_LIN = text_config()["text_config"]["linear_attn_config"]


@pytest.mark.parametrize("variant,pattern", [
    (dict(drop=[f"{M_}layers.2.self_attn.o_proj.weight"]),
     r"missing tensor language_model\.model\.layers\.2\.self_attn\.o_proj\.weight"),
    (dict(drop=[f"{M_}layers.2.block_sparse_moe.experts.3.w2.weight_scale"]),
     r"missing tensor .*layers\.2\.block_sparse_moe\.experts\.3\.w2\.weight_scale"),
    (dict(change={f"{M_}layers.0.self_attn.q_proj.weight": np.zeros((33, D), ml_dtypes.bfloat16)}),
     r"tensor language_model\.model\.layers\.0\.self_attn\.q_proj\.weight in "
     r"model-0000\d-of-00002\.safetensors has shape \[33, 64\], expected \[32, 64\]"),
    (dict(change={f"{M_}layers.1.self_attn.rotary.weight": np.zeros(4, np.float32)}),
     r"unknown tensor language_model\.model\.layers\.1\.self_attn\.rotary\.weight"),
    (dict(change={f"{M_}layers.2.block_sparse_moe.experts.0.w1.weight_scale":
                  np.zeros((M, 1), np.float32)}),
     r"tensor .*layers\.2\.block_sparse_moe\.experts\.0\.w1\.weight_scale .* dtype F32"),
    (dict(moe_router_activation_func="softmax"),
     r"text_config\.moe_router_activation_func = 'softmax': k3jax only expresses 'sigmoid'"),
    (dict(shared_expert_gate=True),
     r"text_config\.shared_expert_gate = True is a field k3jax does not know"),
    (dict(kv_lora_rank=DROP), r"text_config\.kv_lora_rank is missing"),
    (dict(activation_situ_linear_beta=None),
     r"text_config\.activation_situ_linear_beta is null"),
    (dict(linear_attn_config={**_LIN, "kda_layers": [1, 2, 3]}),
     r"text_config\.linear_attn_config\.kda_layers = \[1, 2, 3\]"),
    (dict(num_nextn_predict_layers=2),
     r"text_config\.num_nextn_predict_layers = 2: k3jax has one MTP depth"),
], ids=["missing", "missing_scale", "shape", "unknown", "dtype", "router", "unknown_field",
        "missing_field", "null", "kda_layers", "mtp_depth"])
def test_bad_checkpoints_fail_naming_the_tensor_or_field(tensors, tmp_path, variant, pattern):
  path = _variant(tmp_path, tensors, "bad", **variant)
  with pytest.raises(hf.HFCheckpointError, match=pattern) as info:
    hf.load_checkpoint(path)
  assert "\n" not in str(info.value)


def test_vision_tensors_are_skipped_with_a_warning(tensors, tmp_path, caplog):
  path = _variant(tmp_path, tensors, "vlm", change={
      "vision_tower.patch_embed.weight": np.zeros((4, 4), ml_dtypes.bfloat16),
      "mm_projector.proj.weight": np.zeros((4, 4), ml_dtypes.bfloat16)})
  hf.load_checkpoint(path)
  assert "2 vision tensors" in caplog.text


def test_a_single_file_checkpoint_loads_and_a_missing_shard_is_named(tensors, loaded, tmp_path):
  single = tmp_path / "single"
  os.makedirs(single)
  save_file(tensors, str(single / "model.safetensors"))
  with open(single / "config.json", "w") as f:
    json.dump(text_config(), f)
  _, model = hf.load_checkpoint(str(single))
  got, want = flat_params(model), flat_params(loaded[1])
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=path)
  sharded = _variant(tmp_path, tensors, "sharded")
  os.remove(os.path.join(sharded, "model-00002-of-00002.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors \(listed in "):
    hf.load_checkpoint(sharded)


def test_a_failed_save_leaves_no_directory(loaded, tmp_path, monkeypatch):
  cfg, model = loaded
  out = tmp_path / "out"

  def broken(w):
    raise RuntimeError("disk full")
  monkeypatch.setattr(mx, "pack_k3", broken)
  with pytest.raises(RuntimeError, match="disk full"):
    hf.save_checkpoint(cfg, model, str(out), max_shard_bytes=40_000)
  assert os.listdir(tmp_path) == []
  os.makedirs(out)
  with pytest.raises(FileExistsError):
    hf.save_checkpoint(cfg, model, str(out))


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        timeout=timeout)


SMALL_RUN = ["--config.train.global_batch_size=2", "--config.train.seq_len=32",
             "--config.train.steps=2", "--config.train.log_every=1",
             "--config.data.default_num_docs=50"]


def test_convert_round_trip_through_a_workdir_that_fine_tunes(hf_dir, tensors, tmp_path):
  """HF -> workdir -> HF is bit-identical; the printed launch.train command fine-tunes the
  workdir from the converted weights (a fresh optimizer state at step 0)."""
  workdir, out = str(tmp_path / "run"), str(tmp_path / "back")
  proc = _run("launch.convert", f"--hf_dir={hf_dir}", f"--workdir={workdir}",
              "--config=experiments/configs/k3_tiny.py", *SMALL_RUN)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no MTP weights" in proc.stderr
  assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "hf_config.json"]
  command = next(line for line in proc.stdout.splitlines() if line.startswith("fine-tune: "))
  args = shlex.split(command[len("fine-tune: "):])
  assert args[:3] == ["python", "-m", "launch.train"] and set(SMALL_RUN) <= set(args)
  for override in ("--config.model.num_layers=4", "--config.model.full_attn_layers=(2, 4)",
                   "--config.model.attn_res_block_size=2", "--config.model.mtp_num_layers=0"):
    assert override in args, command
  proc = _run("launch.convert", f"--workdir={workdir}", f"--hf_out={out}",
              "--max_shard_bytes=100000")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert_bit_identical(tensors, read_hf(out))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f) == text_config()  # hf_config.json kept the fields k3jax does not hold
  proc = _run(*args[2:])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 0" in proc.stdout + proc.stderr
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)


def test_convert_errors_exit_2_and_write_nothing(tensors, tmp_path):
  bad = _variant(tmp_path, tensors, "bad", drop=[f"{M_}layers.2.self_attn.A_log"])
  workdir = str(tmp_path / "run")
  proc = _run("launch.convert", f"--hf_dir={bad}", f"--workdir={workdir}",
              "--config=experiments/configs/k3_tiny.py")
  assert proc.returncode == cli.EXIT_ERROR, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert f"missing tensor {M_}layers.2.self_attn.A_log" in proc.stderr
  assert sorted(os.listdir(tmp_path)) == ["bad"]
  proc = _run("launch.convert", f"--hf_dir={tmp_path / 'nowhere'}", f"--workdir={workdir}")
  assert proc.returncode == cli.EXIT_ERROR and "config.json not found" in proc.stderr
  proc = _run("launch.convert", f"--workdir={bad}")
  assert proc.returncode == cli.EXIT_ERROR and "give --hf_dir and --workdir" in proc.stderr
  assert sorted(os.listdir(tmp_path)) == ["bad"]
