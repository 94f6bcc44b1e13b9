"""Serving with k3jax.generate: padded batches of prompts of different lengths, buckets that
compile once, MLA decoding that reads only the filled cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax  # noqa: F401
from k3jax import config, generate
from k3jax.mla import GatedMLA
from k3jax.model import K3ForCausalLM

_TINY = "experiments/configs/k3_tiny.py"
# Layer 1 KDA + dense FFN, layer 2 MLA, then (KDA, MLA) x 2 scanned, with LatentMoE FFNs and
# Block AttnRes: padding has to stay out of the stacked caches of the scanned unit too.
_LAYERS = {"model.num_layers": 6, "model.full_attn_layers": (2, 4, 6),
           "model.first_k_dense_replace": 1, "model.attn_res_block_size": 2,
           "model.moe.num_experts": 4}
_LENGTHS = (3, 7, 5)
_NEW = 5


@pytest.fixture(scope="module")
def model():
  cfg = config.load(_TINY, _LAYERS)
  m = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(0), kernels=cfg.kernels)
  assert m.plan is not None and m.plan.units == 2
  return m


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).astype(np.int32) for n in lengths]


def _forward_logits(model, rows):
  """Oracle: the uncached forward (training path: chunked KDA, expanded MLA attention) of the
  rows right-padded to one length; causality keeps each row's logits its own."""
  width = max(r.size for r in rows)
  batch = np.stack([np.pad(r, (0, width - r.size), constant_values=7) for r in rows])
  return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(batch)))


# ------------------------------------------------------------------------------ the model


def test_padded_prefill_and_decode_equal_the_full_forward_fp32(model):
  """Prompts of lengths 3, 7, 5 right-padded to 8 with garbage (not zeros), prefilled with their
  lengths, then 5 greedy tokens decoded one a step: the logits at every real prompt position
  and every generated position equal the uncached forward's (fp32, tolerance 1e-4)."""
  prompts = _prompts(_LENGTHS)
  lengths = np.array(_LENGTHS, np.int32)
  padded = np.random.default_rng(1).integers(0, 256, (3, 8)).astype(np.int32)
  for i, p in enumerate(prompts):
    padded[i, :p.size] = p
  extend = nnx.jit(lambda m, t, c, n: m.extend(t, c, n))
  logits, cache = extend(model, jnp.asarray(padded), model.init_cache(3, 16), jnp.asarray(lengths))
  logits = np.asarray(logits)
  prefill = [logits[i, :n] for i, n in enumerate(_LENGTHS)]
  step = [logits[np.arange(3), lengths - 1]]
  new = []
  ones = jnp.ones((3,), jnp.int32)
  for _ in range(_NEW):
    tok = np.argmax(step[-1], -1).astype(np.int32)
    new.append(tok)
    out, cache = extend(model, jnp.asarray(tok[:, None]), cache, ones)
    step.append(np.asarray(out[:, 0]))
  np.testing.assert_array_equal(cache["index"], lengths + _NEW)
  rows = [np.concatenate([p, [t[i] for t in new]]) for i, p in enumerate(prompts)]
  want = _forward_logits(model, rows)
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_allclose(prefill[i], want[i, :n], rtol=1e-4, atol=1e-4)
    got = np.stack([s[i] for s in step])  # positions n-1 .. n-1+_NEW
    np.testing.assert_allclose(got, want[i, n - 1:n + _NEW], rtol=1e-4, atol=1e-4)


def test_mla_decode_reads_only_the_filled_cache(model):
  """NaN in every latent slot from 8192 on (past the xla tier's first block of 8192 positions)
  leaves a 5-token prefill and two decode steps unchanged; the written-out reference tier,
  which reads the whole cache as the old decode did, turns them to NaN."""
  prompt = jnp.asarray(_prompts((5,))[0][None])
  extend = nnx.jit(lambda m, t, c: m.extend(t, c))

  def poison(cache):
    def one(path, x):
      if getattr(path[-1], "key", None) != "latent":
        return x
      return x.at[..., 8192:, :].set(jnp.nan)  # [B, S, C], or [U, B, S, C] for a scanned unit
    return jax.tree_util.tree_map_with_path(one, cache)

  outs = []
  for cache in (model.init_cache(1, 16384), poison(model.init_cache(1, 16384))):
    logits, cache = extend(model, prompt, cache)
    steps = [logits[:, -1]]
    for _ in range(2):
      logits, cache = extend(model, jnp.argmax(steps[-1], -1)[:, None].astype(jnp.int32), cache)
      steps.append(logits[:, 0])
    outs.append(np.asarray(jnp.stack(steps)))
  assert np.all(np.isfinite(outs[1]))
  np.testing.assert_array_equal(outs[1], outs[0])
  # The contrast, on one gated MLA layer: the reference tier reads the poisoned slots.
  kw = dict(num_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, use_output_gate=True, lora_norm_eps=1e-6)
  x = jax.random.normal(jax.random.key(0), (1, 1, 64))
  cache = jnp.zeros((1, 16384, 24)).at[:, :5].set(jax.random.normal(jax.random.key(1), (1, 5, 24)))
  cache = cache.at[:, 8192:].set(jnp.nan)
  args = (x, cache, jnp.array([5], jnp.int32), jnp.array([[4]], jnp.int32))
  filled = GatedMLA(64, **kw, rngs=nnx.Rngs(0)).decode(*args)
  whole = GatedMLA(64, **kw, rngs=nnx.Rngs(0), decode_attention_impl="reference").decode(*args)
  assert np.all(np.isfinite(filled)) and np.all(np.isnan(whole))


@pytest.mark.parametrize("q_lora_rank, gate", [(24, True), (0, False)])
def test_mla_prepared_decode_inputs_equal_the_separate_products(q_lora_rank, gate):
  """A bf16 gated MLA layer's cached-call inputs from `prepare_decode`'s weights (W_q_a or the
  absorbed W_q, W_kv_a and W_g side by side; W_UK folded into the query's weight) equal the
  separate products (the absorbed query in fp32, the latents, the gate's z) to bf16 rounding,
  and decode the same; an fp32 layer prepares nothing."""
  kw = dict(num_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, use_output_gate=gate, lora_norm_eps=1e-6)
  x = jax.random.normal(jax.random.key(2), (3, 2, 64)).astype(jnp.bfloat16)
  layer = GatedMLA(64, **kw, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  cache = jax.random.normal(jax.random.key(3), (3, 8, 24)).astype(jnp.bfloat16)
  args = (cache, jnp.array([3, 5, 8], jnp.int32), jnp.array([[1, 2], [3, 4], [6, 7]], jnp.int32))
  want = layer.decode_inputs(x)
  want_y = layer.decode(x, *args)
  layer.prepare_decode()
  w_x, w_qb = layer.prepared_decode_weights
  assert w_x.shape == (64, (q_lora_rank or 2 * 24) + 24 + (2 * 16 if gate else 0))
  assert (w_qb is None) == (not q_lora_rank)
  got = layer.decode_inputs(x)
  assert want[0].shape == (3, 2, 2, 24) and want[0].dtype == jnp.float32
  assert (got[2] is None) == (not gate)
  for g, w in zip(got, want):
    if w is not None:
      assert g.shape == w.shape
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=2 ** -7, atol=2 ** -7 * float(jnp.abs(w).max()))
  y = layer.decode(x, *args, inputs=(got[0], got[2]))
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32),
                             rtol=2 ** -6, atol=2 ** -6 * float(jnp.abs(want_y).max()))
  fp32 = GatedMLA(64, **kw, rngs=nnx.Rngs(0))
  fp32.prepare_decode()
  assert fp32.prepared_decode_weights is None


# ------------------------------------------------------------------------------ generate


def test_padded_batch_generates_what_each_prompt_does_alone(model):
  """Greedy, fp32: a batch of prompts of lengths 3, 7, 5 (padded to the bucket of 8) gives
  each row the tokens its prompt gives alone, and each new token is the uncached forward's
  argmax."""
  prompts = _prompts(_LENGTHS, seed=2)
  buckets = generate.Buckets(min_prompt=8, cache_sizes=(16,))
  batch = generate.generate(model, prompts, max_new_tokens=_NEW, buckets=buckets)
  assert [r.size for r in batch] == [n + _NEW for n in _LENGTHS]
  for p, row in zip(prompts, batch):
    alone = generate.generate(model, [p], max_new_tokens=_NEW, buckets=buckets)[0]
    np.testing.assert_array_equal(row, alone)
    np.testing.assert_array_equal(row[:p.size], p)
  want = _forward_logits(model, batch)
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_array_equal(np.argmax(want[i, n - 1:n - 1 + _NEW], -1), batch[i][n:])


def test_bf16_greedy_run_follows_the_full_forward_argmax():
  """bf16 activations: 6 greedy tokens of a padded batch are the argmax of the uncached bf16
  forward at every generated position. The model has no routed experts
  (model.moe.num_experts = 0): the cached and uncached paths round differently, and a routed
  model could then send a token to another expert (a routing flip) and move its logits far."""
  cfg = config.load(_TINY, {**_LAYERS, "model.moe.num_experts": 0, "model.dtype": "bfloat16"})
  bf16 = K3ForCausalLM(cfg.model, rngs=nnx.Rngs(3), kernels=cfg.kernels)
  prompts = _prompts((4, 9), seed=4)
  rows = generate.generate(bf16, prompts, max_new_tokens=6,
                           buckets=generate.Buckets(min_prompt=8, cache_sizes=(32,)))
  want = _forward_logits(bf16, rows)
  for i, p in enumerate(prompts):
    np.testing.assert_array_equal(np.argmax(want[i, p.size - 1:p.size + 5], -1), rows[i][p.size:])


def test_buckets_compile_each_program_once(model):
  """jax.monitoring's backend-compile events over five batches with different prompt lengths,
  max_new_tokens and sampling settings: one prefill program per (prompt bucket, cache bucket),
  one decode program per cache bucket, nothing else."""
  buckets = generate.Buckets(min_prompt=4, cache_sizes=(24, 40))  # sizes no other test uses
  compiled = []

  def listen(event, _, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(kwargs.get("fun_name"))

  runs = [  # (lengths, max_new_tokens, sampling) -> the programs it compiles
      (((3, 5, 2), 4, {}), ["jit(_prefill)", "jit(_decode)"]),  # P 8, S 24
      (((6, 1, 8), 10, dict(temperature=0.7, top_p=0.9, seed=3, eos_id=5)), []),  # P 8, S 24
      (((2, 3, 4), 12, {}), ["jit(_prefill)"]),  # P 4, S 24
      (((7, 7, 7), 30, {}), ["jit(_prefill)", "jit(_decode)"]),  # P 8, S 40
      (((1, 2, 3), 20, dict(temperature=1.0, seed=9)), []),  # P 4, S 24
  ]
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for (lengths, new, kwargs), want in runs:
      compiled.clear()
      out = generate.generate(model, _prompts(lengths, seed=new), max_new_tokens=new,
                              buckets=buckets, **kwargs)
      assert compiled == want, (lengths, new, compiled)
      assert all(r.size <= n + new for r, n in zip(out, lengths))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


# ----------------------------------------------------------------------- shapes and errors


def test_bucket_shapes():
  b = generate.Buckets(min_prompt=16, cache_sizes=(64, 256))
  assert [b.prompt_len(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
  assert b.shape(2, 5, 10) == (2, 16, 64)       # max(16, 5 + 9) slots
  assert b.shape(2, 40, 30) == (2, 64, 256)     # 40 + 29 = 69 > 64
  assert b.shape(1, 200, 100) == (1, 256, 512)  # 299 > 256: the next power of two
  assert generate.Buckets(min_prompt=5).prompt_len(3) == 5


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_prompt=0), "min_prompt"), (dict(cache_sizes=(64, 32)), "cache_sizes"),
    (dict(cache_sizes=()), "cache_sizes"), (dict(cache_sizes=(0, 8)), "cache_sizes")])
def test_buckets_reject_bad_fields(kwargs, match):
  with pytest.raises(ValueError, match=match):
    generate.Buckets(**kwargs)


@pytest.mark.parametrize("prompts,kwargs,match", [
    ([], {}, "at least one prompt"),
    ([np.array([1, 2]), np.array([], np.int32)], {}, r"prompt_tokens\[1\]"),
    ([np.array([1.0, 2.0])], {}, r"prompt_tokens\[0\]"),
    ([np.array([1, 300])], {}, "vocab_size"),
    ([np.array([1, 2, 3])], dict(cache_len=4), "cache_len must be an integer >= 16"),
    ([np.array([1, 2, 3])], dict(buckets=(16,)), "buckets")])
def test_generate_rejects_bad_prompts_and_shapes(model, prompts, kwargs, match):
  with pytest.raises(ValueError, match=match):
    generate.generate(model, prompts, **{"max_new_tokens": 4, **kwargs})


def test_hidden_states_rejects_lengths_without_a_cache(model):
  with pytest.raises(ValueError, match="lengths applies to a cached call"):
    model.hidden_states(jnp.zeros((1, 4), jnp.int32), lengths=jnp.array([2]))
