"""The scanned decoder (model.scan_layers) against the unrolled one, and the remat policies."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import k3jax  # noqa: F401
from k3jax import attn_res, config
from k3jax import model as model_lib

TINY = "experiments/configs/k3_tiny.py"
# 6 layers: layer 0 KDA + dense FFN, 1 MLA, 2-5 two scanned units of KDA + MLA.
_UNITS = {"model.num_layers": 6, "model.full_attn_layers": (2, 4, 6)}
CONFIGS = {
    # Unit of 1 (KDA + MoE) over layers 4-6; an AttnRes block starts at 6, inside the scan.
    "k3_tiny": {},
    "residual": {**_UNITS, "model.attn_res_block_size": 0},
    # Blocks of 3: one starts at layer 3 (unit 0, position 1), none in unit 1.
    "blocks_of_3": {**_UNITS, "model.attn_res_block_size": 3},
}
_B, _T = 2, 12


def _cfg(name: str, **overrides):
  return config.load(TINY, {**CONFIGS[name], **overrides})


def _loss(graphdef, params, rest, tokens):
  """Next-token CE of the logits; aux as returned by the model."""
  logits, aux = nnx.merge(graphdef, params, rest)(tokens)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return jnp.mean(ce), (logits, aux)


@functools.cache
def _run(name: str, scan: bool, remat: str = "none"):
  """(loss, logits, aux, grads) of the model built from seed 0 (same parameters either way)."""
  cfg = _cfg(name, **{"model.scan_layers": scan, "model.remat": remat})
  model = model_lib.K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  assert (model.plan is not None) == scan
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)  # as k3jax.train does
  tokens = jax.random.randint(jax.random.key(1), (_B, _T), 0, cfg.model.vocab_size)
  grad = jax.jit(jax.value_and_grad(functools.partial(_loss, graphdef), has_aux=True))
  (loss, (logits, aux)), grads = grad(params, rest, tokens)
  return loss, logits, aux, grads


def _assert_trees_close(got, want, rtol=1e-5, atol=1e-5):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
    scale = float(np.max(np.abs(w))) if np.size(w) else 0.0
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * max(scale, 1.0),
                               err_msg=jax.tree_util.keystr(path))


def test_scan_plans_of_the_named_configs():
  plan = lambda name: model_lib.scan_plan(config.load(f"experiments/configs/{name}.py").model)
  assert plan("k3_full") == model_lib.ScanPlan(start=4, period=4, units=22)  # 0-3, 92 unrolled
  assert plan("k3_small") == model_lib.ScanPlan(start=4, period=4, units=2)
  assert plan("k3_tiny") == model_lib.ScanPlan(start=4, period=1, units=3)
  assert plan("kimi_linear_48b") == model_lib.ScanPlan(start=2, period=4, units=6)
  # Nothing repeats: KDA + dense, MLA + MoE, KDA + MoE.
  none = config.load(TINY, {"model.num_layers": 3, "model.full_attn_layers": (2,)})
  assert model_lib.scan_plan(none.model) is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scanned_equals_unrolled(name):
  """Logits, loss, aux (MLA max logits, MoE loads and histograms) and gradients, fp32 (atol
  1e-5 x the largest magnitude of each leaf)."""
  loss, logits, aux, grads = _run(name, True)
  loss_u, logits_u, aux_u, grads_u = _run(name, False)
  np.testing.assert_allclose(loss, loss_u, rtol=1e-6)
  np.testing.assert_allclose(logits, logits_u, rtol=1e-5, atol=1e-5)
  assert sorted(aux) == list(range(len(aux))) == sorted(aux_u)
  _assert_trees_close(aux, aux_u)
  _assert_trees_close(grads, grads_u)


@pytest.mark.parametrize("remat,scan", [("full", True), ("save_dots", True),
                                        ("save_mixer_out", True), ("offload", True),
                                        ("save_mixer_out", False)])
def test_remat_policies_keep_loss_and_gradients(remat, scan):
  """The scanned unit body (and the unrolled layers) rematerialised as each policy says."""
  loss, _, _, grads = _run("blocks_of_3", False)
  loss_r, _, _, grads_r = _run("blocks_of_3", scan, remat)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  _assert_trees_close(grads_r, grads)


def test_remat_names_are_the_configs_choices():
  assert set(model_lib.REMAT_POLICIES) | {"none"} == set(config._CHOICES["model.remat"])
  with pytest.raises(config.ConfigError, match="model.remat"):
    config.load(TINY, {"model.remat": "dots"})
  with pytest.raises(ValueError, match="remat must be"):
    model_lib.remat(lambda x: x, "dots")


def test_masked_mix_equals_the_list_form():
  """attn_res_mix_masked over a half-filled buffer equals attn_res_mix over its list."""
  rng = np.random.default_rng(0)
  blocks = jnp.asarray(rng.normal(size=(4, 2, 3, 8)), jnp.float32)
  partial = jnp.asarray(rng.normal(size=(2, 3, 8)) * 5, jnp.float32)
  q, g = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(2))
  for count in range(5):
    filled = blocks.at[count:].set(0.0)
    got = attn_res.attn_res_mix_masked(filled, jnp.int32(count), partial, q, g, 1e-5)
    want = attn_res.attn_res_mix(list(blocks[:count]) + [partial], q, g, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(  # no completed block: the partial sum itself
      attn_res.attn_res_mix_masked(jnp.zeros_like(blocks), jnp.int32(0), partial, q, g, 1e-5),
      partial)


def test_push_block():
  blocks, partial = jnp.zeros((2, 1, 3)), jnp.ones((1, 3))
  b, n, p = attn_res.push_block(blocks, jnp.int32(1), partial, jnp.bool_(True))
  np.testing.assert_array_equal(b[1], partial)
  assert int(n) == 2 and not p.any()
  b2, n2, p2 = attn_res.push_block(b, n, partial + 1, jnp.bool_(False))
  np.testing.assert_array_equal(b2, b)
  assert int(n2) == 2
  np.testing.assert_array_equal(p2, partial + 1)


def test_named_scopes_in_the_lowered_step():
  cfg = _cfg("k3_tiny")
  model = model_lib.K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((1, 8), jnp.int32)
  text = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens)[0]).lower(state).as_text(
      debug_info=True)
  for scope in ("kda", "mla", "attn_res", "dense_ffn", "moe", "norm"):
    assert f"/{scope}/" in text, scope
