"""One contract over every registered algorithm, by `jax.eval_shape` (seconds).

For each name of `algorithms.available()`, built from the registry on a tiny model:

* its module exports `build` and `DISPLAY_NAME`, and its config section is exactly
  `build`'s keyword defaults plus `client` (one source of defaults);
* the server state is typed (a NamedTuple, optax.EmptyState included) and the
  per-client state is None or a pytree with leading axis N;
* `client_start` gives [m, ...] parameters for a cohort of m;
* one engine round keeps the carry's structure, shapes and dtypes (it is the
  `lax.scan` carry) and reports the training loss and the cohort;
* `eval_params` is [N, ...] for personalized algorithms, one model otherwise;
* the "host" placement's pieces: `init_rows(key, ids)` equals rows `ids` of
  `init(key)`'s client state and `eval_rows` rows `ids` of `eval_params`
  (values, bit for bit); a global model's `eval_params` reads no client state.
"""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import every_algorithm_setup, model_for
from fedjax_dg import algorithms, engine, models
from fedjax_dg.run import assemble, config
from fedjax_dg.algorithms.base import with_frozen
from fedjax_dg.engine.round import make_round

N, M = 4, 3


@pytest.fixture(scope="module")
def setup():
  fed, cfg = every_algorithm_setup(N)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=8)
  return fed, model, cfg


def _typed(state) -> bool:
  return state is None or hasattr(state, "_fields")


def _rows_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _host_placement_rows(alg):
  """Rows built or evaluated for a block of ids are the rows of the whole."""
  key, ids = jax.random.key(3), jnp.array([2, 0, 2])
  server, clients = jax.eval_shape(alg.init, key)
  if not alg.server.personalized:
    params = jax.eval_shape(alg.server.eval_params, server, None)
    chex.assert_trees_all_equal_shapes(
        params, jax.eval_shape(alg.server.eval_params, server, clients))
  if clients is None and not alg.server.personalized:
    return

  @jax.jit   # one program; rows taken in numpy (eagerly: a gather per shape)
  def run(key):
    server, clients = alg.init(key)
    rows = alg.initial_rows(key, ids)
    evaluated = (alg.eval_rows(server, rows, ids),
                 alg.server.eval_params(server, clients)) if alg.server.personalized else None
    return clients, rows, evaluated

  clients, rows, evaluated = run(key)
  take = lambda t: jax.tree.map(lambda a: np.asarray(a)[np.asarray(ids)], t)
  _rows_equal(rows, take(clients))
  if alg.server.personalized:
    _rows_equal(evaluated[0], take(evaluated[1]))


# FedSDAF's ablation names build the same round with parts switched off
# (tests/test_fedsdaf.py checks their parameters): slow here.
SLOW = ("fedsdaf_no_bkd", "fedsdaf_no_mhsa")


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
    for n in algorithms.available()])
def test_algorithm_contract(setup, name):
  fed, _, cfg = setup
  model = model_for(name, fed, hidden=8)
  spec = algorithms.spec(name)
  assert spec.display_name and callable(spec.module.build)
  section = dict(config.base_config()[spec.section])
  assert set(section.pop("client").keys()) == set(algorithms.CLIENT_KEYS)
  assert section == algorithms.hyperparameters(spec.section)

  alg = assemble.algorithm(name, model, N, cfg, data=fed)
  assert alg.name == name
  server, clients = jax.eval_shape(alg.init, jax.random.key(0))
  assert _typed(server), type(server)
  if clients is not None:
    chex.assert_tree_shape_prefix(clients, (N,))
  ids = jnp.arange(M)
  rows = (None if clients is None
          else jax.eval_shape(lambda c: jax.tree.map(lambda a: a[:M], c), clients))
  start = jax.eval_shape(alg.client.start, server, rows, ids)
  chex.assert_tree_shape_prefix(start, (M,))

  cfg_engine = engine.EngineConfig(rounds=1, epochs=1, batch_size=4,
                                   cohort_size=0 if alg.client.pooled else M,
                                   client_mapping="map")
  n = 1 if alg.client.pooled else N
  # An objective that reads each example's domain trains on arrays that
  # carry them (`ClientSide.domains`; the runner hands them so).
  data = fed.with_domains() if alg.client.domains else fed
  train = data.pooled().train if alg.client.pooled else data.train
  round_fn = make_round(alg, cfg_engine, n)
  carry = jax.eval_shape(alg.init, jax.random.key(0))
  frozen = None if alg.frozen is None else jax.eval_shape(alg.frozen,
                                                          jax.random.key(0))
  new, metrics = jax.eval_shape(round_fn, carry, jnp.int32(0),
                                jax.tree.map(jnp.asarray, train),
                                jax.random.key(1), frozen)
  chex.assert_trees_all_equal_shapes_and_dtypes(new, carry)
  assert jax.tree.structure(new) == jax.tree.structure(carry)
  assert metrics["loss"].shape == () and metrics["cohort"].shape[0] in (M, 1)

  params = jax.eval_shape(alg.server.eval_params, *carry)
  # The evaluated model: the algorithm's own (FedSDAF's adapters) or the run's,
  # its parameters = the shared-frozen entries + the evaluated ones (frozen
  # networks of the objective only, CCST's AdaIN, are not the model's).
  target = jax.eval_shape((alg.model or model).init, jax.random.key(0))
  if alg.server.personalized:
    chex.assert_tree_shape_prefix(params, (N,))
    params = jax.eval_shape(lambda p: jax.tree.map(lambda a: a[0], p), params)
  merged = with_frozen(frozen, params)
  chex.assert_trees_all_equal_shapes({k: merged[k] for k in target if k in
                                      merged}, target)
  _host_placement_rows(alg)


def test_every_build_hyperparameter_has_a_default_and_no_context_clash():
  for section in algorithms.modules():
    build = algorithms.spec(section).module.build
    params = inspect.signature(build).parameters
    assert list(params)[:2] == ["model", "optimizer"], section
    for p in params.values():
      if p.name not in algorithms.CONTEXT:
        assert p.kind == p.KEYWORD_ONLY and p.default is not p.empty, (section,
                                                                       p.name)
