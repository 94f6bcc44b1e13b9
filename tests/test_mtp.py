"""Multi-Token Prediction (k3jax.mtp) against a direct computation of DeepSeek-V3's MTP formula."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config, data, mtp
from k3jax import model as model_lib

TINY = "experiments/configs/k3_tiny.py"
B, T = 2, 12


def _cfg():
  """k3_tiny with a one-layer backbone (gated MLA, dense FFN) to keep compilation short."""
  return config.load(TINY, {"model.num_layers": 1, "model.full_attn_layers": (1,),
                            "model.attn_res_block_size": 0}).model


@pytest.fixture(scope="module")
def setup():
  """A tiny K3 model, its MTP layer (random norm gains), and a packed batch with 2 documents."""
  cfg = _cfg()
  model = model_lib.K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
  layer = mtp.MTP(cfg, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for norm in (layer.enorm, layer.hnorm, layer.norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
  seg = np.array([[1] * 5 + [2] * 8, [1] * 10 + [0] * 3], np.int32)
  pos = np.array([list(range(5)) + list(range(8)), list(range(10)) + [0, 0, 0]], np.int32)
  batch = data.shift_packed_batch({"tokens": tokens, "tokens_segment_ids": seg,
                                   "tokens_positions": pos})
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  return cfg, model, layer, batch, seg, tokens


def _forward(model, layer, batch):
  h, _, _ = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"])
  return layer(h, model.embed(batch["targets"]), batch["segment_ids"], batch["positions"]), h


@pytest.fixture(scope="module")
def outputs(setup):
  """One jitted forward + backward of the MTP loss through the backbone: (loss, extras, grads)."""
  _, model, layer, batch, _, _ = setup
  gdef_m, params_m, rest_m = nnx.split(model, nnx.Param, ...)
  gdef_l, params_l, rest_l = nnx.split(layer, nnx.Param, ...)

  def loss_fn(pm, pl):
    m, lyr = nnx.merge(gdef_m, pm, rest_m), nnx.merge(gdef_l, pl, rest_l)
    (hidden, aux), h = _forward(m, lyr, batch)
    t2, m2 = mtp.shift_targets(batch["targets"], batch["segment_ids"], batch["loss_mask"])
    loss, n = mtp.mtp_head_loss(hidden, m.lm_head["kernel"][...].astype(m.dtype), t2, m2)
    return loss, {"hidden": hidden, "aux": aux, "h": h, "n": n}

  (loss, extras), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(
      params_m, params_l)
  return loss, extras, grads


def test_parameter_paths_and_shapes(setup, outputs):
  cfg, _, layer, _, _, _ = setup
  _, extras, _ = outputs
  d = cfg.hidden_size
  flat = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
  assert flat["enorm.scale"] == (d,) and flat["hnorm.scale"] == (d,) and flat["norm.scale"] == (d,)
  assert flat["eh_proj.kernel"] == (2 * d, d)
  assert "layer.self_attn.q_b_proj.kernel" in flat and "layer.self_attn.g_proj.kernel" in flat
  assert flat["layer.block_sparse_moe.experts.w1"][0] == cfg.moe.num_experts
  assert not any("res_proj" in k or "embed" in k.split(".")[0] or "lm_head" in k for k in flat)
  hidden, aux = extras["hidden"], extras["aux"]
  assert hidden.shape == (B, T, d)
  assert aux["mla_max_logit"].shape == (cfg.mla.num_heads,)
  assert aux["moe"]["loads"].shape == (cfg.moe.num_experts,)


def test_targets_and_mask_stay_inside_documents(setup):
  *_, batch, seg, tokens = setup
  targets2, mask2 = mtp.shift_targets(batch["targets"], batch["segment_ids"], batch["loss_mask"])
  want = np.zeros((B, T), np.float32)
  for b in range(B):
    for i in range(T):  # t_i, t_{i+1}, t_{i+2} of the [T + 1] row, one non-padding document
      if i + 2 <= T and seg[b, i] == seg[b, i + 1] == seg[b, i + 2] != 0:
        want[b, i] = 1.0
        assert int(targets2[b, i]) == tokens[b, i + 2]
  np.testing.assert_array_equal(np.asarray(mask2), want)
  assert want[0, 3] == 0 and want[0, 2] == 1 and want[0, 10] == 1 and want[0, 11] == 0


def test_documents_do_not_see_each_other(setup):
  """Changing document 2's inputs leaves document 1's MTP hidden states unchanged."""
  cfg, model, layer, batch, _, _ = setup
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(B, T, cfg.hidden_size)), jnp.float32)
  e = jnp.asarray(rng.normal(size=(B, T, cfg.hidden_size)), jnp.float32)
  y, _ = layer(h, e, batch["segment_ids"], batch["positions"])
  in_doc2 = (batch["segment_ids"] != 1)[..., None]
  y2, _ = layer(jnp.where(in_doc2, 3.0 * h, h), jnp.where(in_doc2, -e, e),
                batch["segment_ids"], batch["positions"])
  doc1 = np.asarray(batch["segment_ids"]) == 1
  np.testing.assert_allclose(np.asarray(y2)[doc1], np.asarray(y)[doc1], rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(y2)[~doc1], np.asarray(y)[~doc1])


def _rms(x, g, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def test_loss_matches_direct_computation(setup, outputs):
  cfg, model, layer, batch, seg, tokens = setup
  loss, extras, _ = outputs
  h, n = extras["h"], extras["n"]

  f64 = lambda a: np.asarray(a, np.float64)
  eps = cfg.rms_norm_eps
  emb = f64(model.embed_tokens["embedding"][...])[tokens[:, 1:T + 1]]  # Emb(t_{i+1})
  x = np.concatenate([_rms(emb, f64(layer.enorm.scale[...]), eps),
                      _rms(f64(h), f64(layer.hnorm.scale[...]), eps)], axis=-1)
  x = x @ f64(layer.eh_proj["kernel"][...])
  o, _, _ = model_lib.residual_layer(layer.layer, jnp.asarray(x, jnp.float32),
                                   batch["segment_ids"], batch["positions"])
  logits = _rms(f64(o), f64(layer.norm.scale[...]), eps) @ f64(model.lm_head["kernel"][...])
  lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  total, count = 0.0, 0
  for b in range(B):
    for i in range(T - 1):
      if seg[b, i] == seg[b, i + 1] == seg[b, i + 2] != 0:
        total += lse[b, i] - logits[b, i, tokens[b, i + 2]]
        count += 1
  assert int(n) == count == 17
  np.testing.assert_allclose(float(loss), total / count, rtol=2e-5)


def test_gradients_reach_mtp_and_shared_parameters(outputs):
  _, _, (gm, gl) = outputs
  norm = lambda v: float(jnp.linalg.norm(v[...]))
  for path in (("eh_proj", "kernel"), ("enorm", "scale"), ("hnorm", "scale"), ("norm", "scale"),
               ("layer", "self_attn", "q_b_proj", "kernel"),
               ("layer", "self_attn", "o_proj", "kernel"),
               ("layer", "block_sparse_moe", "experts", "w1"),
               ("layer", "block_sparse_moe", "gate", "kernel")):
    node = gl
    for k in path:
      node = node[k]
    assert norm(node) > 0, path
  assert norm(gm["lm_head"]["kernel"]) > 0
  assert norm(gm["embed_tokens"]["embedding"]) > 0
  assert norm(gm["layers"][0]["self_attn"]["q_b_proj"]["kernel"]) > 0  # through h


def test_block_config_and_bad_inputs(setup):
  cfg, model, layer, batch, _, _ = setup
  c = mtp.block_config(cfg)
  assert (c.num_layers, tuple(c.full_attn_layers), c.attn_res_block_size,
          c.first_k_dense_replace) == (1, (1,), 0, 0)
  assert cfg.full_attn_layers == (1,) and cfg.first_k_dense_replace == 1  # unchanged
  assert layer.layer.kind == "mla" and layer.layer.is_moe and not layer.layer.attn_res
  h = jnp.zeros((B, T, cfg.hidden_size))
  with pytest.raises(ValueError, match="next_token_embeddings"):
    layer(h, h[:, :-1], batch["segment_ids"], batch["positions"])
  with pytest.raises(ValueError, match="h must be"):
    layer(h[..., :-1], h[..., :-1], batch["segment_ids"], batch["positions"])
  with pytest.raises(ValueError, match="loss_mask"):
    mtp.shift_targets(batch["targets"], batch["segment_ids"], batch["loss_mask"][:, :-1])
