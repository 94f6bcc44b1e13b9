"""Tests for k3jax.quantile_balancing against numpy oracles (report §2.3.3, App. C-D)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import k3jax  # noqa: F401
from k3jax import quantile_balancing as qb

# Report Figure 5 setting: 8 tokens, 4 experts, top-1, q = 2. Top-1 loads are (4, 3, 1, 0).
FIG5_SCORES = np.array([
    [0.56, 0.92, 0.74, 0.65], [0.75, 0.13, 0.52, 0.08], [0.84, 0.51, 0.19, 0.65],
    [0.93, 0.66, 0.87, 0.05], [0.88, 0.46, 0.52, 0.40], [0.76, 0.18, 0.81, 0.12],
    [0.17, 0.88, 0.64, 0.81], [0.56, 0.93, 0.74, 0.68]], np.float32)


def np_loads(s, b, k):
  top = np.argsort(-(s.astype(np.float64) + b), axis=1, kind="stable")[:, :k]
  return np.bincount(top.ravel(), minlength=s.shape[1])


def np_required_bias(s, b, k):
  """r_ij = alpha_i - s_ij with alpha_i the (k+1)-th largest of s_i + b (float64 oracle)."""
  alpha = np.sort(s.astype(np.float64) + b, axis=1)[:, ::-1][:, k]
  return alpha[:, None] - s


def random_scores(m, n, seed, skew=0.0):
  rng = np.random.default_rng(seed)
  logits = 2.0 * rng.normal(size=(m, n)) + skew * np.linspace(1.0, -1.0, n)
  return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def test_figure5_example():
  b0 = np.zeros(4, np.float32)
  assert tuple(np_loads(FIG5_SCORES, b0, 1)) == (4, 3, 1, 0)
  b1 = np.asarray(qb.exact_update(jnp.asarray(FIG5_SCORES), jnp.asarray(b0), 1))
  assert abs(b1.mean()) < 1e-6
  assert tuple(np_loads(FIG5_SCORES, b1, 1)) == (2, 2, 2, 2)


def test_exact_targets_match_oracle_and_fixed_cutoff_count():
  m, n, k = 64, 8, 2
  q = m * k // n
  s = random_scores(m, n, 0, skew=3.0)
  b = np.random.default_rng(1).normal(size=n).astype(np.float32) * 0.1
  b_hat = np.asarray(qb.exact_targets(jnp.asarray(s), jnp.asarray(b), k))
  r = np_required_bias(s, b, k)
  np.testing.assert_allclose(b_hat, np.sort(r, axis=0)[q], atol=1e-6)
  # With the cutoffs fixed, q tokens satisfy s_ij + b_hat_j > alpha_i (QB step 3) up to ties:
  # a token whose (k+1)-th choice is j has r_ij = b_j exactly, so r_{:, j} has an atom at b_j.
  strict = np.sum(r < b_hat[None] - 1e-6, axis=0)
  weak = np.sum(r <= b_hat[None] + 1e-6, axis=0)
  assert (strict <= q).all() and (weak >= q + 1).all()
  at_atom = np.abs(np.sort(r, axis=0)[q] - b) < 1e-6
  assert 0 < at_atom.sum() < n
  assert (strict[~at_atom] == q).all()
  loads_before = np_loads(s, b, k)
  loads_after = np_loads(s, np.asarray(qb.exact_update(jnp.asarray(s), jnp.asarray(b), k)), k)
  assert loads_before.max() > 1.5 * q
  assert loads_after.max() < loads_before.max() and loads_after.min() > loads_before.min()


def test_exact_targets_non_integer_q_interpolates():
  m, n, k = 10, 4, 1  # q = 2.5: rank 3.5 between the 3rd and 4th largest margin
  s = random_scores(m, n, 2)
  b = np.zeros(n, np.float32)
  r_sorted = np.sort(np_required_bias(s, b, k), axis=0)
  b_hat = np.asarray(qb.exact_targets(jnp.asarray(s), jnp.asarray(b), k))
  np.testing.assert_allclose(b_hat, 0.5 * (r_sorted[2] + r_sorted[3]), atol=1e-6)


def test_exact_update_invariant_to_common_bias_offset():
  s = jnp.asarray(random_scores(32, 8, 3))
  b = jnp.asarray(np.random.default_rng(4).normal(size=8).astype(np.float32) * 0.1)
  np.testing.assert_allclose(qb.exact_update(s, b, 2), qb.exact_update(s, b + 0.7, 2),
                             atol=1e-6)


@pytest.fixture(scope="module")
def hist_case():
  m, n, k, bins = 2048, 8, 2, 1000
  s = random_scores(m, n, 5, skew=3.0)
  b = np.random.default_rng(6).normal(size=n).astype(np.float32) * 0.2
  counts, lo, hi = jax.jit(qb.histogram_counts, static_argnums=(2, 3))(
      jnp.asarray(s), jnp.asarray(b), k, bins)
  return m, n, k, bins, s, b, counts, lo, hi


def test_histogram_counts_match_numpy(hist_case):
  m, n, k, bins, s, b, counts, lo, hi = hist_case
  np.testing.assert_allclose([lo, hi], [b.min() - 1.0, b.max() + 1.0], atol=1e-6)
  r = np_required_bias(s, b, k)
  assert r.min() > lo and r.max() < hi
  edges = np.linspace(float(lo), float(hi), bins + 1)
  expected = np.stack([np.histogram(r[:, j], edges)[0] for j in range(n)])
  assert counts.shape == (n, bins) and counts.dtype == jnp.int32
  assert (np.asarray(counts).sum(axis=1) == m).all()
  # Values within float rounding of a bin edge may land in the neighbouring bin.
  assert np.abs(np.asarray(counts) - expected).sum() <= 4


def test_histogram_counts_take_given_cutoffs(hist_case):
  _, _, k, bins, s, b, counts, lo, hi = hist_case
  alpha = qb.token_cutoffs(jnp.asarray(s), jnp.asarray(b), k)
  given = qb.histogram_counts(jnp.asarray(s), jnp.asarray(b), k, bins, alpha)
  for got, want in zip(given, (counts, lo, hi)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="cutoffs"):
    qb.histogram_counts(jnp.asarray(s), jnp.asarray(b), k, bins, alpha[1:])


def test_histogram_estimate_within_one_bin_of_exact(hist_case):
  m, n, k, bins, s, b, counts, lo, hi = hist_case
  q = m * k // n
  width = float(hi - lo) / bins
  hist = np.asarray(qb.histogram_targets(counts, lo, hi, m, k))
  exact = np.asarray(qb.exact_targets(jnp.asarray(s), jnp.asarray(b), k))
  r_sorted = np.sort(np_required_bias(s, b, k), axis=0)
  np.testing.assert_allclose(exact, r_sorted[q], atol=1e-6)
  # Every bias in [q-th, (q+1)-th smallest r] gives exactly q tokens at fixed cutoffs; the
  # exact rule takes the upper end, the histogram lands within one bin of that interval.
  assert (hist >= r_sorted[q - 1] - width - 1e-6).all()
  assert (hist <= r_sorted[q] + width + 1e-6).all()
  gap = r_sorted[q] - r_sorted[q - 1]
  assert (np.abs(hist - exact) <= width + gap + 1e-6).all()
  upd_h = np.asarray(qb.histogram_update(counts, lo, hi, m, k))
  upd_e = np.asarray(qb.exact_update(jnp.asarray(s), jnp.asarray(b), k))
  assert np.abs(upd_h - upd_e).max() < 2 * (width + gap.max()) + 1e-6


def test_histogram_counts_add_across_shards(hist_case):
  m, n, k, bins, s, b, counts, lo, hi = hist_case
  hc = jax.jit(qb.histogram_counts, static_argnums=(2, 3))
  shards = [hc(jnp.asarray(part), jnp.asarray(b), k, bins) for part in np.split(s, 4)]
  summed = sum(c for c, _, _ in shards)
  for _, lo_i, hi_i in shards:
    assert lo_i == lo and hi_i == hi
  np.testing.assert_array_equal(summed, counts)
  np.testing.assert_array_equal(qb.histogram_update(summed, lo, hi, m, k),
                                qb.histogram_update(counts, lo, hi, m, k))


def test_sign_update_moves_toward_balance():
  loads = jnp.array([10, 2, 6, 6], jnp.int32)
  bias = jnp.zeros(4, jnp.float32)
  new = qb.sign_update(loads, bias, 0.01)
  np.testing.assert_allclose(new, [-0.01, 0.01, 0.0, 0.0])
  s = random_scores(256, 8, 7, skew=3.0)
  b = np.zeros(8, np.float32)
  before = np_loads(s, b, 2)
  for _ in range(50):
    b = np.asarray(qb.sign_update(jnp.asarray(np_loads(s, b, 2)), jnp.asarray(b), 0.01))
  after = np_loads(s, b, 2)
  assert after.max() < before.max() and after.min() > before.min()


def test_load_stats():
  st = qb.load_stats(jnp.array([4, 3, 1, 0]))
  np.testing.assert_allclose(st["max_over_mean"], 2.0)
  np.testing.assert_allclose(st["min_over_mean"], 0.0)
  np.testing.assert_allclose(st["cv"], np.std([4, 3, 1, 0]) / 2.0, rtol=1e-6)


def test_bad_arguments_raise():
  s = jnp.zeros((8, 4))
  with pytest.raises(ValueError, match="k must"):
    qb.exact_update(s, jnp.zeros(4), 4)
  with pytest.raises(ValueError, match="bias must"):
    qb.exact_update(s, jnp.zeros(3), 1)
  with pytest.raises(ValueError, match="num_bins"):
    qb.histogram_counts(s, jnp.zeros(4), 1, 0)
  with pytest.raises(ValueError, match="loads"):
    qb.sign_update(jnp.zeros(3), jnp.zeros(4), 0.1)
