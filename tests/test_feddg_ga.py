"""FedDG-GA: the generalization adjustment against plain-Python loops written
from the released code (`utils/weight_adjust.py`) and the paper's Eq. (10),
the aggregator's bookkeeping over rounds and cohorts against a Python
simulation of the protocol, the gap a client measures against a direct
computation, and the algorithm end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.algorithms import feddg_ga
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client.update import ClientContext, ClientData
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import ga
from fedjax_dg.run import assemble


# ----------------------------------------------------------------- references

def code_refine(weight_dict, before, after, step_size, fair_metric="loss"):
  """`refine_weight_dict_by_GA` of the released code, for K clients (the code
  hard-codes K = 3 as `1./3.`), plus the guard it lacks (max |gap| = 0)."""
  signal = {"acc": -1.0, "loss": 1.0}[fair_metric]
  gaps = [after[k] - before[k] for k in before]
  top = max(abs(g) for g in gaps)
  if top == 0:
    return dict(weight_dict)
  step = step_size / len(weight_dict)
  out = {}
  for i, k in enumerate(weight_dict):
    out[k] = weight_dict[k] + signal * gaps[i] / top * step
  for k in out:
    out[k] = min(max(out[k], 0.0), 1.0)
  total = sum(out.values())
  return {k: v / total for k, v in out.items()}


def paper_refine(weights, gaps, step):
  """Eq. (10) (FedSDAF's Appendix A.1): centred gaps over the largest centred
  gap, times d^r / K; clip to [0, 1], renormalize."""
  mu = sum(gaps) / len(gaps)
  top = max(g - mu for g in gaps)
  if top <= 0:
    return list(weights)
  new = [min(max(w + (g - mu) / top * step / len(weights), 0.0), 1.0)
         for w, g in zip(weights, gaps)]
  return [w / sum(new) for w in new]


# ----------------------------------------------- generalization_adjustment

_adjust = jax.jit(ga.generalization_adjustment,
                  static_argnames=("sign", "center"))


@pytest.mark.parametrize("metric", ["loss", "acc"])
def test_adjustment_follows_the_code_over_rounds(metric):
  """Seven rounds on K = 5 clients with the run's decaying step: a round of
  equal metrics (the zero-gap guard) and a step large enough that weights clip
  at 0 (d = 2: moves up to 0.4 against weights near 0.2)."""
  rng = np.random.default_rng(0)
  k, rounds, d = 5, 7, 2.0
  names = [f"site{i}" for i in range(k)]
  ref = {s: 1.0 / k for s in names}
  w = jnp.full((k,), 1.0 / k, jnp.float32)
  clipped = False
  for r in range(rounds):
    before = rng.uniform(0.5, 2.0, k)
    after = before if r == 2 else before + rng.normal(0, 0.3, k)
    step = float(ga.step_at(d, r / rounds))
    ref = code_refine(ref, dict(zip(names, before)), dict(zip(names, after)),
                      step, metric)
    w = _adjust(w, jnp.asarray(after - before, jnp.float32), step,
                sign=ga.SIGNS[metric])
    np.testing.assert_allclose(np.asarray(w), [ref[s] for s in names],
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(w)))
    clipped |= bool(np.any(np.asarray(w) == 0.0))
  assert clipped  # the clip at 0 was exercised
  assert abs(float(jnp.sum(w)) - 1.0) < 1e-5


def test_zero_gaps_change_nothing_and_give_no_nan():
  w = jnp.asarray([0.1, 0.6, 0.3])
  np.testing.assert_array_equal(_adjust(w, jnp.zeros(3), 0.2), w)
  np.testing.assert_array_equal(_adjust(w, jnp.full(3, 0.7), 0.2,
                                        center=True), w)  # all equal
  # No valid gap at all (a cohort's first round).
  np.testing.assert_array_equal(
      ga.generalization_adjustment(w, jnp.ones(3), 0.2, jnp.zeros(3, bool)), w)


def test_centred_adjustment_is_the_papers_equation():
  rng = np.random.default_rng(1)
  k = 4
  ref, w = [1.0 / k] * k, jnp.full((k,), 1.0 / k)
  for r in range(5):
    gaps = rng.normal(0, 1.0, k)
    ref = paper_refine(ref, list(gaps), 0.8 * (1 - r / 5))
    w = _adjust(w, jnp.asarray(gaps, jnp.float32), 0.8 * (1 - r / 5),
                center=True)
    np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-5, atol=1e-6)


def test_only_valid_clients_move():
  """Clients without a gap keep their weight up to the common renormalization;
  the valid ones move as the code's update over them alone, scaled by the
  mass they held (K stays the number of weights)."""
  w = np.array([0.1, 0.2, 0.3, 0.4])
  gaps = np.array([0.5, -9.0, 1.0, 9.0])  # the invalid gaps are ignored
  valid = np.array([True, False, True, False])
  got = np.asarray(ga.generalization_adjustment(
      jnp.asarray(w), jnp.asarray(gaps), 0.4, jnp.asarray(valid)))
  moved = w + np.where(valid, gaps / 1.0, 0.0) * 0.4 / 4  # max |valid gap| = 1
  np.testing.assert_allclose(got, moved / moved.sum(), rtol=1e-6)


def test_sign_the_client_the_global_model_fits_worst_gains_weight():
  w = jnp.full((3,), 1.0 / 3)
  loss_gaps = jnp.asarray([0.1, 0.5, 0.2])  # global loss - local loss
  new = _adjust(w, loss_gaps, 0.2, sign=ga.SIGNS["loss"])
  assert int(jnp.argmax(new)) == 1 and int(jnp.argmin(new)) == 0
  acc_gaps = jnp.asarray([-0.05, -0.4, -0.1])  # global acc - local acc
  new = _adjust(w, acc_gaps, 0.2, sign=ga.SIGNS["acc"])
  assert int(jnp.argmax(new)) == 1 and int(jnp.argmin(new)) == 0


# -------------------------------------------------------- the aggregator

def test_aggregator_over_rounds_and_cohorts_matches_the_protocol():
  """N = 5 clients, cohorts of 3 drawn at random over 6 rounds: the gap uses
  the metric of the client's own last local model (stored when it trained,
  possibly rounds ago), clients without one do not move, the step decays as
  d (1 - r / R), and the cohort's models are averaged with its weights
  renormalized over the cohort."""
  rng = np.random.default_rng(2)
  n, m, rounds, d = 5, 3, 6, 0.6
  t = ga.ga_aggregation(n, step_size=d, metric="loss")
  update = jax.jit(t.update)
  params = {"a": jnp.zeros((2, 3))}
  state = t.init(params)
  ref_w, ref_before = np.full(n, 1.0 / n), {}
  for r in range(rounds):
    ids = rng.choice(n, m, replace=False)
    received, trained = rng.uniform(0, 2, m), rng.uniform(0, 2, m)
    models_ = {"a": jnp.asarray(rng.normal(size=(m, 2, 3)), jnp.float32)}
    out, state = update(models_, state, params, ids=jnp.asarray(ids),
                        received=jnp.asarray(received, jnp.float32),
                        trained=jnp.asarray(trained, jnp.float32),
                        progress=r / rounds, weights=jnp.ones(m),
                        key=jax.random.key(0))
    # The reference: a Python loop over the cohort.
    gaps, valid = np.zeros(n), np.zeros(n, bool)
    for i, c in enumerate(ids):
      if c in ref_before:
        gaps[c], valid[c] = received[i] - ref_before[c], True
    step = d * (1 - r / rounds)
    if valid.any() and np.abs(gaps).max() > 0:
      moved = np.clip(ref_w + gaps / np.abs(gaps).max() * step / n, 0, 1)
      ref_w = moved / moved.sum()
    for i, c in enumerate(ids):
      ref_before[c] = trained[i]
    np.testing.assert_allclose(np.asarray(state.weights), ref_w, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.gaps), gaps, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(float(state.step), step, rtol=1e-6)
    a = ref_w[ids] / ref_w[ids].sum()
    want = sum(a[i] * np.asarray(models_["a"][i]) for i in range(m))
    np.testing.assert_allclose(np.asarray(out["a"]), want, rtol=1e-5,
                               atol=1e-6)
  assert np.asarray(state.seen).all() and not np.allclose(ref_w, 1.0 / n)


# ------------------------------------------------- the gap a client measures

@pytest.fixture(scope="module")
def setup(fed3):
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=16)
  return fed3, model


def _direct(model, params, x, y):
  """(mean cross-entropy, accuracy) of `params` on x, y: one jitted program
  (eagerly: one per op and batch size)."""
  @jax.jit
  def run(params):
    logits = model.apply(params, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.mean(ce), jnp.mean(jnp.argmax(logits, -1) == y)
  return tuple(float(v) for v in run(params))


@pytest.mark.parametrize("metric,examples,n_real", [
    ("loss", 20, 50),   # the first 20 of 50 real rows, chunks of 7
    ("acc", 20, 50),
    ("loss", 40, 13),   # fewer real rows than asked: padding never counts
    ("loss", 0, 50)])   # 0: all real rows
def test_client_end_measures_both_models_on_the_fixed_slice(setup, metric,
                                                            examples, n_real):
  fed, model = setup
  alg = feddg_ga.build(model, optax.sgd(0.1), None, num_clients=3,
                       metric=metric, gap_examples=examples, gap_chunk=7)
  x, y = np.asarray(fed.train.x[1]), np.array(fed.train.y[1])
  y[n_real:] = 0  # padding rows hold real-looking labels
  start, trained = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  ctx = ClientContext(id=1, round=2, start=start)
  _, aux = jax.jit(alg.client.end.fn)(ctx, trained, ClientData(x, y, n_real),
                                     jax.random.key(0))
  k = n_real if examples == 0 else min(examples, n_real)
  pick = 0 if metric == "loss" else 1
  np.testing.assert_allclose(float(aux.received),
                             _direct(model, start, x[:k], y[:k])[pick],
                             rtol=1e-5)
  np.testing.assert_allclose(float(aux.trained),
                             _direct(model, trained, x[:k], y[:k])[pick],
                             rtol=1e-5)


def test_server_update_gap_is_received_minus_the_last_trained(setup):
  _, model = setup
  alg = feddg_ga.build(model, optax.sgd(0.1), None, num_clients=3)
  server, _ = alg.init(jax.random.key(0))
  stacked = tree.broadcast(server.params, 3)
  ids = jnp.arange(3)

  def result(r, received, trained):
    return ClientResult(ids=ids, round=jnp.asarray(r), start=stacked,
                        params=stacked, num_examples=jnp.full(3, 10),
                        loss=jnp.zeros(3), rounds=4,
                        message=ga.GapMetrics(jnp.asarray(received),
                                              jnp.asarray(trained)))

  server, m0 = alg.server.update(server, result(0, [1.0, 1.0, 1.0],
                                                [0.2, 0.4, 0.3]), None)
  np.testing.assert_allclose(m0["ga_weights"], [1 / 3] * 3)  # no gap yet
  server, m1 = alg.server.update(server, result(1, [0.7, 0.5, 0.4],
                                                [0.1, 0.1, 0.1]), None)
  np.testing.assert_allclose(m1["ga_gaps"], [0.5, 0.1, 0.1], rtol=1e-6)
  np.testing.assert_allclose(float(m1["ga_step"]), 0.2 * 0.75)
  want = np.array([1 / 3 + 0.15 / 3, 1 / 3 + 0.03 / 3, 1 / 3 + 0.03 / 3])
  np.testing.assert_allclose(m1["ga_weights"], want / want.sum(), rtol=1e-5)


# ------------------------------------------------------------- end to end

def _replay(metrics):
  """The weights again from the reported gaps and steps, round by round."""
  g, s = (np.asarray(metrics[k]) for k in ("ga_gaps", "ga_step"))
  w = np.full(g.shape[1], 1.0 / g.shape[1])
  for r in range(g.shape[0]):
    if np.abs(g[r]).max() > 0:
      moved = np.clip(w + g[r] / np.abs(g[r]).max() * s[r] / w.size, 0, 1)
      w = moved / moved.sum()
    np.testing.assert_allclose(np.asarray(metrics["ga_weights"])[r], w,
                               rtol=1e-5, atol=1e-6)
  return w


def test_feddg_ga_learns_and_differs_from_fedavg_only_through_its_weights(
    setup):
  fed, model = setup
  assert len(set(np.asarray(fed.train.n))) == 1  # FedAvg's weights: uniform
  cfg = base_config()
  cfg.client.lr = 1e-2
  run_cfg = engine.EngineConfig(rounds=4, eval_every=4, epochs=1, batch_size=16,
                                client_mapping="map", progress=False)
  build = lambda name: assemble.algorithm(name, model, fed.num_clients, cfg)
  got = engine.run(build("feddg_ga"), fed, model, run_cfg)
  np.testing.assert_allclose(np.asarray(got.round_metrics["ga_step"]),
                             0.2 * (1 - np.arange(4) / 4), rtol=1e-6)
  w = _replay(got.round_metrics)
  assert np.ptp(w) > 1e-3  # the gaps differ, so do the weights
  loss = np.asarray(got.round_metrics["loss"])
  assert loss[-1] < loss[0] and got.final["id_acc"] > 0.5  # 3 classes
  cfg.feddg_ga.step_size = 0.0  # uniform weights: FedAvg on equal clients
  flat = engine.run(build("feddg_ga"), fed, model, run_cfg)
  avg = engine.run(build("fedavg"), fed, model, run_cfg)
  for a, b, c in zip(jax.tree.leaves(flat.server.params),
                     jax.tree.leaves(avg.server.params),
                     jax.tree.leaves(got.server.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not all(np.allclose(a, c, atol=1e-6) for a, c in zip(
      jax.tree.leaves(avg.server.params), jax.tree.leaves(got.server.params)))


@pytest.mark.parametrize("hp,needle", [
    (dict(step_size=-0.1), "feddg_ga.step_size"),
    (dict(step_size=float("nan")), "feddg_ga.step_size"),
    (dict(metric="f1"), "feddg_ga.metric"),
    (dict(gap_examples=-1), "feddg_ga.gap_examples"),
    (dict(gap_chunk=0), "feddg_ga.gap_chunk")])
def test_bad_settings_name_the_field(setup, hp, needle):
  _, model = setup
  with pytest.raises(ConfigError, match=needle):
    feddg_ga.build(model, optax.sgd(0.1), None, num_clients=3, **hp)
