"""Tests for k3jax.generate and launch.generate."""
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax  # noqa: F401
from k3jax import checkpoint, config, data, generate, loop, train
from k3jax.model import K3ForCausalLM
from mesh_testing import run_on_devices

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TINY = os.path.join(_ROOT, "experiments", "configs", "k3_tiny.py")
# Layer 1 KDA + dense FFN, layer 2 gated MLA + LatentMoE, wired by Block AttnRes.
_SMALL = {"model.num_layers": 2, "model.full_attn_layers": (2,), "model.first_k_dense_replace": 1,
          "model.attn_res_block_size": 1, "model.moe.num_experts": 4}
_NEW = 5


@pytest.fixture(scope="module")
def tiny():
  cfg = config.load(_TINY, _SMALL)
  model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(0).integers(0, 256, (2, 4)).astype(np.int32)
  return model, prompt


@pytest.fixture(scope="module")
def greedy(tiny):
  model, prompt = tiny
  return generate.generate(model, prompt, max_new_tokens=_NEW)


# ------------------------------------------------------------------------- sample_logits


def _nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
  """Oracle: softmax(logits / T), keep the smallest top set with mass >= top_p, renormalise."""
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  order = np.argsort(-p)
  k = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
  out = np.zeros_like(p)
  out[order[:k]] = p[order[:k]] / p[order[:k]].sum()
  return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.7), (2.0, 0.7), (0.5, 1.0)])
def test_sampling_follows_the_nucleus(temperature, top_p):
  logits = np.log(np.array([0.04, 0.4, 0.1, 0.25, 0.06, 0.15]))
  want = _nucleus_probs(logits, temperature, top_p)
  n = 20000
  draws = np.asarray(generate.sample_logits(jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)),
                                            jax.random.key(7), temperature=temperature,
                                            top_p=top_p))
  freq = np.bincount(draws, minlength=logits.size) / n
  assert np.all(freq[want == 0] == 0), (freq, want)  # never outside the nucleus
  np.testing.assert_allclose(freq, want, atol=0.015)


def test_sample_logits_greedy_and_reproducible():
  logits = jax.random.normal(jax.random.key(0), (3, 50))
  np.testing.assert_array_equal(
      generate.sample_logits(logits, jax.random.key(1), temperature=0.0),
      np.argmax(np.asarray(logits), -1))
  a = generate.sample_logits(logits, jax.random.key(1), temperature=1.0, top_p=0.9)
  b = generate.sample_logits(logits, jax.random.key(1), temperature=1.0, top_p=0.9)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
      generate.sample_logits(logits, jax.random.key(1), temperature=1.0, top_p=1e-6),
      np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"), (dict(temperature=1.0, top_p=1.5), "top_p")])
def test_sample_logits_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    generate.sample_logits(jnp.zeros((1, 4)), jax.random.key(0), **kwargs)


def test_sample_logits_rejects_bad_logits():
  with pytest.raises(ValueError, match=r"logits must be a floating \[B, V\]"):
    generate.sample_logits(jnp.zeros((4,)), jax.random.key(0), temperature=1.0)


# ------------------------------------------------------------------------------ generate


def test_greedy_equals_full_forward_loop(tiny, greedy):
  """The dual cache end to end: the cached decode picks what the uncached forward picks."""
  model, prompt = tiny
  last_logits = nnx.jit(lambda m, x: m(x)[0][:, -1])
  seq = prompt
  for _ in range(_NEW):  # re-run the whole, growing sequence every step
    nxt = np.argmax(np.asarray(last_logits(model, jnp.asarray(seq))), -1).astype(np.int32)
    seq = np.concatenate([seq, nxt[:, None]], axis=1)
  assert greedy.shape == (2, 4 + _NEW) and greedy.dtype == np.int32
  np.testing.assert_array_equal(greedy, seq)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_loop_concatenates_no_weights(tiny, dtype):
  """The KDA layers' input projections and conv kernels (and in bf16 the MLA layers' W_x and
  absorbed W_qb, the MoE's W_in / W_out) are made once, before the while loop
  (`prepare_decode`), not in its body, where XLA on GPUs did not hoist them."""
  model, _ = tiny
  if dtype == "bfloat16":
    cfg = config.load(_TINY, {**_SMALL, "model.dtype": dtype, "model.param_dtype": dtype})
    model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  b = 2
  args = (graphdef, state, model.init_cache(b, 8), jnp.zeros((b,), jnp.int32),
          jax.random.key(0), jnp.float32(0), jnp.float32(1), jnp.int32(-1), jnp.int32(4))
  jaxpr = jax.make_jaxpr(lambda *a: generate._decode(*a, capacity=4), static_argnums=0)(*args)
  kda_layer = next(layer.self_attn for layer in model.layers if layer.kind == "kda")
  weights = {tuple(w.shape) for w in kda_layer.decode_weights()}
  if dtype == "bfloat16":
    mla = next(layer for layer in model.layers if layer.kind != "kda")
    a = mla.self_attn
    w_x, w_qb = a.decode_weights()
    weights |= {tuple(w.shape) for w in (w_x, *mla.block_sparse_moe.decode_weights())}
    weights.add((w_qb.shape[0], a.num_heads, a.kr + a.dr))   # made [r, H, kr + dr], flattened

  def walk(jx, in_loop):
    """(shape, inside the while body) of every concatenation or stack."""
    for e in jx.eqns:
      if e.primitive.name in ("concatenate", "stack"):
        yield tuple(e.outvars[0].aval.shape), in_loop
      for value in e.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            yield from walk(sub.jaxpr, in_loop or e.primitive.name == "while")
          elif isinstance(sub, jax.extend.core.Jaxpr):
            yield from walk(sub, in_loop or e.primitive.name == "while")

  found = set(walk(jaxpr.jaxpr, False))
  assert {(s, False) for s in weights} <= found
  assert not {(s, True) for s in weights} & found


@pytest.mark.parametrize("decode_experts, top_ks", [("all", 0), ("sorted", 1)])
def test_all_experts_decode_loop_runs_no_router_top_k(decode_experts, top_ks):
  """With every expert on every token (4 tokens' 8 copies >= 2 x 4 experts) the decode loop
  forms the routing weights by rank (`moe_route.route_dense`): XLA's compiled loop holds no
  top-k of the router (the statistics' one is dead there); the sorted path keeps its one."""
  cfg = config.load(_TINY, {**_SMALL, "kernels.moe_decode_experts": decode_experts})
  model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels)
  graphdef, state = nnx.split(model)
  b = 4
  args = (graphdef, state, model.init_cache(b, 8), jnp.zeros((b,), jnp.int32),
          jax.random.key(0), jnp.float32(0), jnp.float32(1), jnp.int32(-1), jnp.int32(4))
  hlo = generate._decode.lower(*args, capacity=4).compile().as_text()
  router = [line for line in hlo.splitlines() if 'custom_call_target="TopK"' in line]
  assert len(router) == top_ks, router    # (sampling's nucleus sorts; XLA:CPU's top-k op)


def test_scanned_layers_generate_what_unrolled_ones_do():
  """Layers 2-5 as a scanned unit (KDA, MLA) x 2: the stacked caches decode as the per-layer
  caches of the unrolled model do (same parameters)."""
  prompt = np.random.default_rng(1).integers(0, 256, (2, 3)).astype(np.int32)
  outs = []
  for scan in (True, False):
    cfg = config.load(_TINY, {**_SMALL, "model.num_layers": 6, "model.full_attn_layers": (2, 4, 6),
                              "model.scan_layers": scan})
    model = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0))
    assert (model.plan is not None) == scan
    if scan:
      cache = model.init_cache(2, 3 + _NEW)
      assert len(cache["layers"]) == 6 and cache["layers"][1]["latent"].shape == (2, 3 + _NEW, 24)
    outs.append(generate.generate(model, prompt, max_new_tokens=_NEW))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_top_p_tiny_is_greedy(tiny, greedy):
  model, prompt = tiny
  out = generate.generate(model, prompt, max_new_tokens=_NEW, temperature=1.0, top_p=1e-6,
                          seed=5)
  np.testing.assert_array_equal(out, greedy)


def test_sampling_is_reproducible(tiny):
  model, prompt = tiny
  run = lambda seed: generate.generate(model, prompt, max_new_tokens=_NEW, temperature=1.0,
                                       top_p=0.95, seed=seed)
  a, b, c = run(3), run(3), run(4)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:, :4], prompt)
  assert not np.array_equal(a, c)


def test_eos_stops_a_row(tiny, greedy):
  model, prompt = tiny
  eos = int(greedy[0, 5])  # row 0's second new token
  out = generate.generate(model, prompt, max_new_tokens=_NEW, eos_id=eos)
  want = greedy.copy()
  for row in want:
    hits = np.flatnonzero(row[4:] == eos)
    if hits.size:
      row[4 + hits[0]:] = eos
  np.testing.assert_array_equal(out, want[:, :out.shape[1]])
  assert out.shape[1] == 4 + _NEW or np.all(out[:, -1] == eos)
  # Both rows finish when row 0 first emits eos: decoding stops there.
  first = 4 + int(np.flatnonzero(greedy[0, 4:] == eos)[0])
  both = generate.generate(model, prompt[[0, 0]], max_new_tokens=_NEW, eos_id=eos)
  np.testing.assert_array_equal(both, greedy[[0, 0], :first + 1])


def test_zero_new_tokens_returns_the_prompt(tiny):
  model, prompt = tiny
  np.testing.assert_array_equal(generate.generate(model, prompt, max_new_tokens=0), prompt)


@pytest.mark.parametrize("prompt,kwargs,match", [
    (np.zeros((4,), np.int32), {}, "prompt_tokens"),
    (np.zeros((1, 0), np.int32), {}, "prompt_tokens"),
    (np.full((1, 3), 258, np.int32), {}, "vocab_size"),
    (np.zeros((1, 3), np.int32), dict(max_new_tokens=-1), "max_new_tokens"),
    (np.zeros((1, 3), np.int32), dict(eos_id=258), "eos_id"),
    (np.zeros((1, 3), np.int32), dict(seed=-1), "seed"),
    (np.zeros((1, 3), np.int32), dict(top_p=2.0), "top_p")])
def test_generate_rejects_bad_arguments(tiny, prompt, kwargs, match):
  model, _ = tiny
  with pytest.raises(ValueError, match=match):
    generate.generate(model, prompt, **{"max_new_tokens": 2, **kwargs})


# ----------------------------------------------------------------- load_model and launch


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A 2-step training run of a small k3_tiny with a checkpoint after each step."""
  cfg = config.load(_TINY, {**_SMALL, "train.steps": 2, "train.checkpoint_every": 1,
                            "train.global_batch_size": 2, "train.seq_len": 16,
                            "train.log_every": 1, "data.default_num_docs": 20})
  path = str(tmp_path_factory.mktemp("run"))
  loop.run(cfg, path)
  return path


def _pure(model):
  _, params, buffers = nnx.split(model, nnx.Param, ...)
  return nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_model_restores_the_saved_params(workdir):
  model, cfg, step = generate.load_model(workdir)
  assert step == 2 and cfg.train.steps == 2
  # Oracle: the training side's reader restores the whole train state and the data iterator.
  abstract = jax.eval_shape(lambda: train.init(cfg, cfg.train.seed)[1])
  it = data.make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                                batch_size=cfg.train.global_batch_size,
                                vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)
  ckpt = checkpoint.Checkpointer(workdir, every_n_steps=1, max_to_keep=3)
  saved_step, saved = ckpt.restore_latest(abstract, it)
  ckpt.close()
  assert saved_step == 2
  params, buffers = _pure(model)
  _assert_trees_equal(params, saved["params"])
  _assert_trees_equal(buffers, saved["buffers"])
  first, _, one = generate.load_model(workdir, step=1)
  assert one == 1
  assert any(not np.array_equal(x, y) for x, y in
             zip(jax.tree.leaves(_pure(first)[0]), jax.tree.leaves(params)))


def test_load_model_skips_an_unreadable_step(workdir, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  shutil.rmtree(os.path.join(copy, "checkpoints", "2", "state"))
  model, _, step = generate.load_model(copy)
  want, _, _ = generate.load_model(workdir, step=1)
  assert step == 1
  _assert_trees_equal(_pure(model), _pure(want))
  assert os.path.isdir(os.path.join(copy, "checkpoints", "2"))  # left where it was


def test_load_model_errors(workdir, tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    generate.load_model(str(tmp_path))
  shutil.copy(os.path.join(workdir, "config.json"), tmp_path / "config.json")
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    generate.load_model(str(tmp_path))
  os.makedirs(tmp_path / "checkpoints")
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    generate.load_model(str(tmp_path))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 7 has no checkpoint.*available steps: \[1, 2\]"):
    generate.load_model(workdir, step=7)


def test_launch_generate_prints_a_continuation(workdir):
  result = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--workdir={workdir}", "--prompt=count by 2",
       "--max_new_tokens=6", "--temperature=0"],
      cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0] == f"[k3_tiny, step 2, {workdir}]"
  assert lines[1] == "prompt: count by 2"
  assert lines[2].startswith("continuation: ")
  assert "read only" not in result.stderr and "Traceback" not in result.stderr


def test_load_model_packs_the_experts_on_request(workdir):
  """expert_format="mxfp4" on a float checkpoint: the routed experts are packed at load
  (`mx.pack_experts`) and the model's logits are those of the float model with its expert
  weights fake-quantized to MXFP4 (qat is off: the inputs stay unquantized)."""
  from k3jax import mx  # pylint: disable=import-outside-toplevel
  model, cfg, _ = generate.load_model(workdir)
  packed, packed_cfg, _ = generate.load_model(
      workdir, overrides={"model.moe.expert_format": "mxfp4"})
  assert packed_cfg.model.moe.expert_format == "mxfp4" and cfg.model.moe.expert_format == "float"
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  experts = params["layers"][1]["block_sparse_moe"]["experts"]
  for name in ("w1", "w3", "w2"):
    experts[name] = mx.fake_quantize(experts[name], "mxfp4", axis=-2)
  quantized = nnx.merge(graphdef, params, nnx.to_pure_dict(buffers))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 8)), jnp.int32)
  run = nnx.jit(lambda m, t: m(t)[0])
  np.testing.assert_allclose(run(packed, tokens), run(quantized, tokens), rtol=1e-5, atol=1e-5)
  with pytest.raises(config.ConfigError, match="model.moe.expert_format"):
    generate.load_model(workdir, overrides={"model.moe.expert_format": "fp4"})


def test_launch_generate_with_packed_experts(workdir):
  result = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--workdir={workdir}", "--prompt=count",
       "--max_new_tokens=4", "--temperature=0", "--config.model.moe.expert_format=mxfp4"],
      cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines()[2].startswith("continuation: ")


@pytest.fixture(scope="module")
def hf_dir(workdir, tmp_path_factory):
  """The workdir's model written as a Kimi K3 checkpoint directory (bf16 experts)."""
  from k3jax import hf  # pylint: disable=import-outside-toplevel
  model, cfg, _ = generate.load_model(workdir)
  path = str(tmp_path_factory.mktemp("hf") / "k3_tiny")
  hf.save_checkpoint(cfg, model, path, experts="bf16")
  return path


def test_launch_generate_batches_a_prompts_file_from_an_hf_dir(hf_dir, tmp_path):
  """Three prompts of different lengths in batches of 2 (the second padded with a one-token
  row): every prompt printed with its continuation, in file order, then the rates of the
  prompts' tokens and the new tokens, one compiled shape."""
  texts = ["count by 2", "17 + 25 =", "abc"]
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("\n".join(texts) + "\n", encoding="utf-8")
  result = subprocess.run(
      [sys.executable, "-m", "launch.generate", f"--hf_dir={hf_dir}", f"--prompts_file={prompts}",
       "--batch_size=2", "--max_new_tokens=4", "--temperature=0"],
      cwd=_ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0] == f"[base, {hf_dir}]"
  # A continuation may hold a newline byte: the lines are found by their prefixes.
  assert [line for line in lines if line.startswith("prompt: ")] == [f"prompt: {t}" for t in texts]
  assert sum(line.startswith("continuation: ") for line in lines) == 3
  prompt_tokens = sum(len(t.encode()) + 1 for t in texts)  # BOS + bytes
  assert re.fullmatch(
      rf"prefill: {prompt_tokens} tokens, [\d.]+ s, [\d.]+ tokens/s; decode: (\d+) tokens, "
      r"[\d.]+ s, [\d.]+ tokens/s; warm-up \(compiles\): [\d.]+ s for \(batch, prompt, "
      r"cache\) \[\(2, 16, 256\)\]", lines[-1]), lines[-1]
  assert int(re.search(r"decode: (\d+)", lines[-1]).group(1)) <= 3 * 3
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flags,message", [
    (["--workdir=w", "--hf_dir=h"], "error: give exactly one of --workdir"),
    (["--workdir=w", "--prompts_file=/nonexistent/prompts.txt"],
     "error: No such file or directory: /nonexistent/prompts.txt"),
    (["--hf_dir=h", "--prompt=a", "--prompts_file=p"], "error: --prompt and --prompts_file"),
    (["--workdir=w", "--cache_buckets=64,32"], "error: --cache_buckets must be increasing")])
def test_launch_generate_errors_are_one_line(flags, message):
  result = subprocess.run([sys.executable, "-m", "launch.generate", *flags], cwd=_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert lines[0].startswith(message) and lines[1:] == ["(--verbose shows the traceback)"], lines


_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from k3jax import generate, hf, sharding
workdir, hf_dir = sys.argv[1], sys.argv[2]
model, cfg, _ = generate.load_model(workdir)
mesh = sharding.make_mesh(cfg.mesh)
split, _, _ = generate.load_model(workdir, mesh=mesh)
_, from_hf = hf.load_checkpoint(hf_dir, mesh=mesh, config=cfg)
_, from_hf_one = hf.load_checkpoint(hf_dir, config=cfg)
prompts = [np.array([256, 99, 111, 117, 110, 116]), np.array([256, 49, 55])]
run = lambda m, **kw: [r.tolist() for r in generate.generate(
    m, prompts, max_new_tokens=5, buckets=generate.Buckets(min_prompt=8, cache_sizes=(16,)),
    **kw)]
on_mesh = dict(mesh=mesh, rules=cfg.mesh.logical_axis_rules)
emb = split.embed_tokens["embedding"].get_value()
print("RESULT" + json.dumps(dict(
    mesh=dict(mesh.shape), spec=str(emb.sharding.spec),
    shard=list(emb.addressable_shards[0].data.shape), one=run(model),
    split=run(split, **on_mesh), hf_one=run(from_hf_one), hf_split=run(from_hf, **on_mesh))))
"""


def test_generation_on_a_mesh_of_two_devices(workdir, hf_dir):
  """load_model and hf.load_checkpoint with a mesh of 2 CPU devices (data 2): the parameters
  are split by the config's rules and greedy generation under the mesh (a padded batch of 2)
  gives the tokens of the single-device model."""
  script = _MESH_SCRIPT.replace("sys.argv[1], sys.argv[2]", f"{workdir!r}, {hf_dir!r}")
  out = run_on_devices(script, devices=2)
  assert out["mesh"]["data"] == 2 and "data" in out["spec"] and out["shard"] == [258, 32]
  assert out["split"] == out["one"] and out["hf_split"] == out["hf_one"]
  assert [len(r) for r in out["one"]] == [6 + 5, 3 + 5]
