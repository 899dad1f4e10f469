"""Evaluation metrics against plain numpy computations."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg import evaluate


def test_scores_calibration_bins_and_ece_match_numpy():
  rng = np.random.default_rng(0)
  n, classes, bs = 37, 4, 8
  logits = rng.normal(size=(n, classes)) * 2.0
  y = rng.integers(0, classes, n).astype(np.int32)
  ids = np.arange(n, dtype=np.int32)
  # The "model" looks its logits up by example id.
  apply_fn = lambda params, x: params[x]
  xp, yp, mask = evaluate.pad_to_multiple(ids, y, bs)
  s = jax.jit(lambda p, x, yy, m: evaluate.scores(apply_fn, p, x, yy, m, bs))(
      jnp.asarray(logits, jnp.float32), jnp.asarray(xp), jnp.asarray(yp),
      jnp.asarray(mask))

  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  pred, conf = p.argmax(1), p.max(1)
  hit = pred == y
  assert int(s.correct) == hit.sum() and int(s.count) == n
  np.testing.assert_allclose(s.nll, -np.log(p[np.arange(n), y]).sum(), rtol=1e-5)
  B = evaluate.CONFIDENCE_BINS
  b = np.minimum((conf * B).astype(int), B - 1)
  ece = 0.0
  for k in range(B):
    sel = b == k
    np.testing.assert_allclose(s.bins[0, k], sel.sum())
    np.testing.assert_allclose(s.bins[2, k], hit[sel].sum())
    if sel.any():
      ece += sel.sum() / n * abs(hit[sel].mean() - conf[sel].mean())
  np.testing.assert_allclose(evaluate.expected_calibration_error(s.bins), ece,
                             rtol=1e-4)
  summary = evaluate.calibration_summary(s.bins)
  assert sum(summary["hist_correct"]) == hit.sum()
  assert sum(summary["hist_incorrect"]) == n - hit.sum()


def test_weight_divergence_matches_pairwise_loop():
  rng = np.random.default_rng(1)
  params = {"a": {"kernel": rng.normal(size=(4, 3, 2))}, "b": rng.normal(size=(4, 5))}
  got = evaluate.weight_divergence(params)
  for name, w in (("a/kernel", params["a"]["kernel"]), ("b", params["b"])):
    w = w.reshape(4, -1)
    pairs = [np.linalg.norm(w[i] - w[j]) for i in range(4) for j in range(i + 1, 4)]
    want = np.mean(pairs) / np.mean(np.linalg.norm(w, axis=1))
    np.testing.assert_allclose(got[name], want, rtol=1e-10)
  same = {"w": np.ones((3, 2))}
  assert evaluate.weight_divergence(same)["w"] == 0.0
