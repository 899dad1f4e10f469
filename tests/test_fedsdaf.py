"""FedSDAF: the BKD objective's per-player gradients against separately written
losses, the alternating (Gauss-Seidel) step against a hand-written two-step
SGD, where each kind of parameter lives (frozen backbone held once, A_di and
the head aggregated, A_dw per client), the ablation switches and the settings'
errors."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY_VIT, synthetic_federation, with_sizes
from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.run import checks
from fedjax_dg.algorithms import fedsdaf
from fedjax_dg.algorithms.base import ClientResult, with_frozen
from fedjax_dg.client.update import Batch, ClientContext, local_update
from fedjax_dg.run.config import base_config
from fedjax_dg.engine.round import make_round
from fedjax_dg.errors import ConfigError
from fedjax_dg.models import vit_adapters
from fedjax_dg.server import ga

N = 3
# One block (TINY_VIT has two): every parameter kind (backbone, A_di, A_dw,
# fusion, head) at half the compile time; the ViT's blocks are chained and
# checked against numpy in tests/test_vit.py.
VIT = dict(TINY_VIT, depth=1)
# Settings that shape no parameter (the objective's, the gap's, the
# aggregator's): tests that vary only these share one initialization
# (`_setup`).
LOSS_ONLY = ("alpha", "kl", "gap_examples", "bkd_order", "aggregation")


@pytest.fixture(scope="module")
def fed():
  return synthetic_federation(num_clients=N)


def _vit(fed):
  return models.get_model("vit_tiny", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, **VIT)


def _alg(fed, **hp):
  return algorithms.create("fedsdaf", _vit(fed),
                           optimizer=optax.sgd(0.1), hparams=hp,
                           num_clients=N)


_INITS = {}


def _setup(fed, **hp):
  """(alg, server, clients, frozen) from key 0. The parameters (a compile
  or two each) are computed once per setting that shapes them (`LOSS_ONLY` ones
  share them); `aggregation="fedavg"` (a stateless weighted mean) gets its
  empty server-transform state."""
  alg = _alg(fed, **hp)
  key = jax.random.key(0)
  shaping = tuple(sorted((k, v) for k, v in hp.items() if k not in LOSS_ONLY))
  if (id(fed), shaping) not in _INITS:
    default = _alg(fed, **dict(shaping))
    # `frozen` eagerly: its one program is the run model's jitted init
    # (`Model.init`), which test_backbone_frozen_held_once_adapters_where_
    # they_belong then calls again without compiling it a second time.
    _INITS[id(fed), shaping] = (fed, *jax.jit(default.init)(key),
                                default.frozen(key))
  _, server, clients, frozen = _INITS[id(fed), shaping]
  opt = jax.eval_shape(alg.init, key)[0].opt
  if hp.get("aggregation", "ga") != "ga":
    assert opt == optax.EmptyState()
    server = server._replace(opt=opt)
  return alg, server, clients, frozen


def _batch(fed, n=6):
  x = np.asarray(fed.train.x[0, :n])
  y = np.asarray(fed.train.y[0, :n])
  mask = np.ones(n, np.float32)
  mask[-1] = 0.0  # a padded row: takes no part
  return Batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))


def _moved(params, seed=5):
  """`params` plus N(0, 0.2^2) noise (numpy: no compile per leaf shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: np.asarray(
      a + 0.2 * rng.normal(size=a.shape), np.float32), params)


def _ctx(frozen, start):
  return ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=start,
                       frozen=frozen)


# ----------------------------------------------------------- the objective


def _player_losses(alg, frozen, glob, local, batch, alpha, direction):
  """The two players' losses written separately: each a function of its own
  parameters only, the other player's values and predictions fixed."""
  module, model = alg.model.module, alg.model
  x = model.normalize(batch.x)
  m = batch.mask
  mean = lambda v: jnp.sum(v * m) / jnp.sum(m)
  logp = jax.nn.log_softmax

  def logits(g, l, path):
    return module.apply({"params": {**frozen, **g, **l}}, x, path=path)

  def kl(p, q):  # KL(softmax p || softmax q)
    return jnp.sum(jnp.exp(logp(p)) * (logp(p) - logp(q)), -1)

  def ce(z):
    return -jnp.take_along_axis(logp(z), batch.y[:, None], 1)[:, 0]

  def di_loss(g):
    z_dw_fixed = logits(glob, local, "kia")  # a constant of g
    z = logits(g, local, "di")
    d = kl(z_dw_fixed, z) if direction == "forward" else kl(z, z_dw_fixed)
    return mean(ce(z) + alpha * d)

  def dw_loss(l):
    z_di_fixed = logits(glob, local, "di")  # a constant of l
    z = logits(glob, l, "kia")
    d = kl(z_di_fixed, z) if direction == "forward" else kl(z, z_di_fixed)
    return mean(ce(z) + alpha * d)

  return di_loss, dw_loss


@pytest.mark.parametrize("alpha,direction", [(1.0, "forward"),
                                             (0.7, "reverse")])
def test_bkd_gradient_blocks_are_each_players_own(fed, alpha, direction):
  alg, server, clients, frozen = _setup(fed, alpha=alpha, kl=direction)
  glob = _moved(server.params)
  local = _moved(jax.tree.map(lambda a: np.asarray(a)[0], clients), seed=6)
  batch = _batch(fed)
  value, grads = jax.jit(jax.value_and_grad(alg.client.loss))(
      {**glob, **local}, batch, jax.random.key(0), _ctx(frozen, None))
  di_loss, dw_loss = _player_losses(alg, frozen, glob, local, batch, alpha,
                                    direction)

  @jax.jit
  def reference(g, l):
    (v_di, g_di), (v_dw, g_dw) = (jax.value_and_grad(di_loss)(g),
                                  jax.value_and_grad(dw_loss)(l))
    return v_di + v_dw, {**g_di, **g_dw}

  want_value, want = reference(glob, local)
  assert set(grads) == {"adi", "head", "adw", "fuse"}
  for k in grads:
    for g, w in zip(jax.tree.leaves(grads[k]), jax.tree.leaves(want[k])):
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=k)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)


def test_kl_div_matches_numpy():
  rng = np.random.default_rng(0)
  p, q = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
  sp = np.exp(p) / np.exp(p).sum(-1, keepdims=True)
  sq = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
  want = (sp * np.log(sp / sq)).sum(-1)
  np.testing.assert_allclose(fedsdaf.kl_div(jnp.asarray(p), jnp.asarray(q)),
                             want, rtol=1e-5)


# ------------------------------------------------------- alternating steps


def test_alternate_is_two_sgd_steps_in_turn(fed):
  """One local step = A_di / head step at p, then A_dw / fusion step at the
  moved A_di (hand-written with the separately written losses)."""
  lr = 0.05
  _, server, clients, frozen = _setup(fed)
  alg = algorithms.create("fedsdaf", _vit(fed), optimizer=optax.sgd(lr),
                          hparams={}, num_clients=N)
  glob = server.params
  local = jax.tree.map(lambda a: np.asarray(a)[0], clients)
  n = 5
  x, y = fed.train.x[0], fed.train.y[0]
  # One step over the client's first n rows (batch = n, one epoch); one
  # program (op by op, every op would compile on its own).
  trained = jax.jit(lambda p: local_update(
      alg.client.loss, alg.client.optimizer, p, x, y, jnp.int32(n), jax.random.key(1),
      _ctx(frozen, None), batch_size=n, epochs=1)[0])({**glob, **local})
  # The batch local_update drew: the n valid rows in some order; the losses
  # are means over the batch, so the order does not matter.
  batch = Batch(jnp.asarray(x[:n]), jnp.asarray(y[:n]), jnp.ones(n))
  di_loss, _ = _player_losses(alg, frozen, glob, local, batch, 1.0, "forward")
  sgd = lambda p, g: np.asarray(p) - lr * np.asarray(g)
  glob1 = jax.tree.map(sgd, glob, jax.jit(jax.grad(di_loss))(glob))
  _, dw_loss = _player_losses(alg, frozen, glob1, local, batch, 1.0, "forward")
  local1 = jax.tree.map(sgd, local, jax.jit(jax.grad(dw_loss))(local))
  want = {**glob1, **local1}
  for k in want:
    for g, w in zip(jax.tree.leaves(trained[k]), jax.tree.leaves(want[k])):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=k)
  # Joint order: the clients' optimizer is the plain one (one step of every
  # player on the gradient at p: test_bkd_gradient_blocks_are_each_players_
  # own pins that gradient), not the alternation: its update needs no
  # `grad_fn` and is -lr * g on every entry. (A joint local update,
  # compiled, in test_joint_order_steps_both_players_at_the_same_point.)
  joint = algorithms.create("fedsdaf", _vit(fed), optimizer=optax.sgd(lr),
                            hparams=dict(bkd_order="joint"), num_clients=N)
  p = {**glob, **local}
  g = _moved(p, seed=7)
  updates = jax.jit(lambda g, p: joint.client.optimizer.update(
      g, joint.client.optimizer.init(p), p)[0])(g, p)
  chex.assert_trees_all_close(updates, jax.tree.map(lambda a: -lr * a, g),
                              rtol=1e-6)


# Slow (~3 s: a second local update compiled): the joint order's optimizer
# (plain SGD on every entry) is checked in test_alternate_is_two_sgd_steps_
# in_turn, its gradient (every player's at the same point) in
# test_bkd_gradient_blocks_are_each_players_own.
@pytest.mark.slow
def test_joint_order_steps_both_players_at_the_same_point(fed):
  """bkd_order="joint": one local step moves A_di / head as the alternation's
  first step does, A_dw / fusion from p (not from the moved A_di)."""
  lr = 0.05
  _, server, clients, frozen = _setup(fed)
  glob = server.params
  local = jax.tree.map(lambda a: np.asarray(a)[0], clients)
  n = 5
  x, y = fed.train.x[0], fed.train.y[0]
  batch = Batch(jnp.asarray(x[:n]), jnp.asarray(y[:n]), jnp.ones(n))
  joint = algorithms.create("fedsdaf", _vit(fed), optimizer=optax.sgd(lr),
                            hparams=dict(bkd_order="joint"), num_clients=N)
  trained_j = jax.jit(lambda p: local_update(
      joint.client.loss, joint.client.optimizer, p, x, y, jnp.int32(n), jax.random.key(1),
      _ctx(frozen, None), batch_size=n, epochs=1)[0])({**glob, **local})
  di_loss, _ = _player_losses(joint, frozen, glob, local, batch, 1.0,
                              "forward")
  sgd = lambda p, g: np.asarray(p) - lr * np.asarray(g)
  glob1 = jax.tree.map(sgd, glob, jax.jit(jax.grad(di_loss))(glob))
  _, dw_loss = _player_losses(joint, frozen, glob1, local, batch, 1.0,
                              "forward")
  local1 = jax.tree.map(sgd, local, jax.jit(jax.grad(dw_loss))(local))
  np.testing.assert_allclose(jax.tree.leaves(trained_j["adi"])[0],
                             jax.tree.leaves(glob1["adi"])[0], rtol=1e-4,
                             atol=1e-6)
  assert not np.allclose(jax.tree.leaves(trained_j["adw"])[0],
                         jax.tree.leaves(local1["adw"])[0], atol=1e-7)


# ------------------------------------------------ where the parameters live


def test_backbone_frozen_held_once_adapters_where_they_belong(fed):
  alg, server, clients, frozen = _setup(fed)
  assert set(frozen) == {"backbone"}
  assert set(server.params) == {"adi", "head"}
  assert set(clients) == {"adw", "fuse"}
  assert {a.shape[0] for a in jax.tree.leaves(clients)} == {N}
  # Every client its own domain-aware adapter (initialized independently).
  w = np.asarray(clients["adw"]["block_0"]["down"]["kernel"])
  assert not np.allclose(w[0], w[1])
  # The backbone is the run model's own initialization from the same key.
  full = alg.model.init(jax.random.key(0))
  for a, b in zip(jax.tree.leaves(frozen["backbone"]),
                  jax.tree.leaves(full["backbone"])):
    np.testing.assert_array_equal(a, b)


def _reporting(alg):
  """`alg` whose round metrics also carry what the engine handed the server:
  the cohort's start and trained parameters."""
  def server_update(server, result, key):
    new, metrics = alg.server.update(server, result, key)
    return new, dict(metrics, start=result.start, trained=result.params)
  return alg.replace(update=server_update)


def test_a_round_trains_adapters_keeps_others_and_aggregates_only_adi(fed):
  """A_dw and the fusion are private (never averaged): after an engine round
  each cohort client started from its OWN rows and keeps exactly what it
  trained, the others' rows are unchanged, and the server's A_di / head are
  the example-weighted mean of the cohort's trained ones. Unequal clients
  (20, 54, 37 examples) so the weights matter. Pins that the private rows
  are not averaged over the cohort (in `client.end` or `client.start`):
  rows that merely changed / stayed would not show it."""
  alg, server, clients, frozen = _setup(fed, aggregation="fedavg")
  sized = with_sizes(fed, [20, 54, 37])
  cfg = engine.EngineConfig(rounds=1, epochs=1, batch_size=8, cohort_size=2,
                            client_mapping="map")
  round_fn = jax.jit(make_round(_reporting(alg), cfg, N))
  train = jax.tree.map(jnp.asarray, sized.train)
  (new_server, new_clients), metrics = round_fn(
      (server, clients), jnp.int32(0), train, jax.random.key(1), frozen)
  # On the host from here (numpy rows: no per-slice compiles).
  server, clients, new_server, new_clients, metrics = jax.device_get(
      (server, clients, new_server, new_clients, metrics))
  cohort = metrics["cohort"]
  out = [i for i in range(N) if i not in cohort]
  row = lambda t, i: jax.tree.map(lambda a: a[i], t)
  local = lambda t: {k: t[k] for k in vit_adapters.LOCAL}
  starts = [row(metrics["start"], j) for j in range(len(cohort))]
  trained = [row(metrics["trained"], j) for j in range(len(cohort))]
  for i, start, t in zip(cohort, starts, trained):
    chex.assert_trees_all_equal(start, {**server.params, **row(clients, i)})
    chex.assert_trees_all_equal(row(new_clients, i), local(t))
    assert not np.allclose(t["adw"]["block_0"]["up"]["kernel"],
                           start["adw"]["block_0"]["up"]["kernel"])
  # The two trained private rows differ (an average would be one row).
  assert not np.allclose(trained[0]["adw"]["block_0"]["up"]["kernel"],
                         trained[1]["adw"]["block_0"]["up"]["kernel"])
  for i in out:
    chex.assert_trees_all_equal(row(new_clients, i), row(clients, i))
  assert set(new_server.params) == {"adi", "head"}
  n = np.asarray(sized.train.n)[cohort]
  assert n[0] != n[1]
  want = jax.tree.map(lambda a, b: (n[0] * a + n[1] * b) / n.sum(),
                      *[{k: t[k] for k in ("adi", "head")} for t in trained])
  chex.assert_trees_all_close(new_server.params, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(new_server.params["head"]["kernel"],
                         server.params["head"]["kernel"])


def test_fedavg_aggregation_is_the_example_weighted_mean_of_adi_and_head(fed):
  alg, server, clients, _ = _setup(fed, aggregation="fedavg")
  m = 3
  stacked = _moved({**tree.broadcast(server.params, m),
                    **jax.tree.map(lambda a: a[:m], clients)})
  w = jnp.array([1.0, 3.0, 2.0])
  res = ClientResult(ids=jnp.arange(m), round=jnp.int32(0), start=None,
                     params=stacked, num_examples=w, loss=jnp.zeros(m))
  new, _ = alg.server.update(server, res, jax.random.key(0))
  assert set(new.params) == {"adi", "head"}
  want = jax.tree.map(lambda a: np.tensordot(np.asarray(w) / 6.0,
                                             np.asarray(a), 1),
                      {k: stacked[k] for k in ("adi", "head")})
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ga_aggregation_reads_the_clients_gaps(fed):
  """GA (the default): the weights move against the clients' gaps."""
  alg, server, clients, frozen = _setup(fed)
  assert alg.client.end is not None and alg.client.end.reads_data
  m = 3
  stacked = _moved({**tree.broadcast(server.params, m),
                    **jax.tree.map(lambda a: a[:m], clients)})
  aux = ga.GapMetrics(received=jnp.array([1.0, 2.0, 3.0]),
                           trained=jnp.array([0.5, 0.5, 0.5]))
  res = ClientResult(ids=jnp.arange(m), round=jnp.int32(0), start=None,
                     params=stacked, num_examples=jnp.ones(m),
                     loss=jnp.zeros(m), message=aux, rounds=4)
  s1, _ = alg.server.update(server, res, jax.random.key(0))
  res2 = res._replace(round=jnp.int32(1), message=aux._replace(
      received=jnp.array([0.6, 0.5, 2.5])))
  _, metrics = alg.server.update(s1, res2, jax.random.key(0))
  gaps = np.asarray(metrics["ga_gaps"])
  np.testing.assert_allclose(gaps, [0.1, 0.0, 2.0], atol=1e-6)
  w = np.asarray(metrics["ga_weights"])
  assert np.argmax(w) == 2  # the largest loss gap gains weight


def test_gap_is_the_clients_model_loss_on_its_rows(fed):
  alg, server, clients, frozen = _setup(fed, gap_examples=7)
  start = {**server.params, **jax.tree.map(lambda a: np.asarray(a)[1], clients)}
  trained = _moved(start)
  data = jax.tree.map(lambda a: a[1], fed.train)
  from fedjax_dg.client.update import ClientData
  row, aux = jax.jit(alg.client.end.fn)(
      _ctx(frozen, start)._replace(state=jax.tree.map(
          lambda a: np.asarray(a)[1], clients)), trained,
      ClientData(data.x, data.y, data.n), jax.random.key(0))
  # Its row: the trained domain-aware adapters (two paths).
  for k in row:
    for a, b in zip(jax.tree.leaves(row[k]), jax.tree.leaves(trained[k])):
      np.testing.assert_array_equal(a, b)
  k = min(7, int(data.n))
  logits = jax.jit(alg.model.apply)(with_frozen(frozen, trained), data.x[:k])
  ce = optax.softmax_cross_entropy_with_integer_labels(np.asarray(logits),
                                                       data.y[:k])
  np.testing.assert_allclose(aux.trained, float(ce.mean()), rtol=1e-5)


# ---------------------------------------------------------------- ablations


@pytest.mark.parametrize("hp,server_keys,client_keys,personalized", [
    pytest.param(dict(fusion=False), {"adi", "head"}, {"adw"}, True,
                 marks=pytest.mark.slow),
    (dict(domain_aware=False), {"adi", "head"}, None, False),
    (dict(domain_aware=False, domain_invariant=False), {"head"}, None, False),
    (dict(train_head=False), {"adi"}, {"adw", "fuse"}, True),
])
def test_ablation_switches_shape_the_parameters(fed, hp, server_keys,
                                                client_keys, personalized):
  # Shapes only: traced (jax.eval_shape), never compiled.
  alg = _alg(fed, **hp)
  key = jax.random.key(0)
  server, clients = jax.eval_shape(alg.init, key)
  frozen = jax.eval_shape(alg.frozen, key)
  assert set(server.params) == server_keys
  assert (None if clients is None else set(clients)) == client_keys
  assert alg.server.personalized is personalized
  assert ("head" in frozen) is (not hp.get("train_head", True))
  x = fed.train.x[0, :4]

  def logits(key):
    p = alg.server.eval_params(*alg.init(key))
    if personalized:
      p = jax.tree.map(lambda a: a[0], p)
    return alg.model.apply(with_frozen(alg.frozen(key), p), x)

  assert jax.eval_shape(logits, key).shape == (4, fed.num_classes)


def test_alpha_zero_drops_distillation_only(fed):
  """alpha=0: each path its own cross-entropy (Table 4's "BKD off")."""
  alg, server, clients, frozen = _setup(fed, alpha=0.0)
  params = {**server.params, **jax.tree.map(lambda a: np.asarray(a)[0], clients)}
  batch = _batch(fed)

  @jax.jit
  def want(params):
    p = with_frozen(frozen, params)
    x = alg.model.normalize(batch.x)
    ce = lambda path: optax.softmax_cross_entropy_with_integer_labels(
        alg.model.module.apply({"params": p}, x, path=path), batch.y)
    m = batch.mask
    return (jnp.sum(ce("di") * m) + jnp.sum(ce("kia") * m)) / jnp.sum(m)

  got = jax.jit(alg.client.loss)(params, batch, None, _ctx(frozen, None))
  np.testing.assert_allclose(got, want(params), rtol=1e-5)


def test_fedavg_adapter_variant(fed):
  alg = algorithms.create("fedavg_adapter", _vit(fed), optimizer=optax.sgd(0.1),
                          hparams={}, num_clients=N)
  assert alg.name == "fedavg_adapter" and not alg.server.personalized
  assert alg.client.end is None
  assert alg.model.module.adapters == "di"


# ----------------------------------------------------------------- settings


@pytest.mark.parametrize("hp,match", [
    (dict(alpha=-1.0), "fedsdaf.alpha"),
    (dict(aggregation="mean"), "fedsdaf.aggregation"),
    (dict(bkd_order="gauss"), "fedsdaf.bkd_order"),
    (dict(kl="sym"), "fedsdaf.kl"),
    (dict(domain_invariant=False),
     r"domain_aware=True needs .* set both False for the head alone$"),
    (dict(metric="f1"), "fedsdaf.metric"),
    (dict(step_size=float("nan")), "fedsdaf.step_size"),
    (dict(gap_examples=-1), "fedsdaf.gap_examples"),
    (dict(adapter_init="ones"), "fedsdaf.adapter_init"),
])
def test_bad_settings_name_the_field(fed, hp, match):
  with pytest.raises(ConfigError, match=match):
    _alg(fed, **hp)


def test_non_vit_models_are_refused_before_any_data(fed):
  mlp = models.get_model("mlp", input_shape=fed.image_shape,
                         num_classes=fed.num_classes, hidden=4)
  with pytest.raises(ConfigError, match="runs on a ViT"):
    algorithms.create("fedsdaf", mlp, optimizer=optax.sgd(0.1), hparams={},
                      num_clients=N)
  cfg = base_config()
  cfg.algorithms = ("fedavg", "fedsdaf")
  with pytest.raises(ConfigError, match="fedsdaf runs on model.name"):
    checks.validate(cfg)
  cfg.model.name = "vit_tiny"
  cfg.model.vit.patch = 4
  checks.validate(cfg)
  cfg.model.name = "small_cnn"
  with pytest.raises(ConfigError, match="model.vit.patch is set"):
    checks.validate(cfg)


@pytest.mark.slow
def test_fedsdaf_learns_end_to_end(fed):
  alg = _alg(fed)
  res = engine.run(alg, fed, _vit(fed), engine.EngineConfig(
      rounds=4, epochs=2, batch_size=8, cohort_size=0, client_mapping="map",
      progress=False, seed=0))
  loss = res.round_metrics["loss"]
  assert loss[-1] < loss[0]
  assert res.final["id_acc"] > 0.6
  assert len(res.final["ood_acc_per_client"]) == N
