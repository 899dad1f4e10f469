"""Unequal clients: every client mapping gives the numbers of today's masked
scan (same permutations, keys and steps), and computes only the steps the
clients really take (one loop per client under `lax.map`, packed lanes under
vmap: `client.lanes`)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_federation, with_sizes
from fedjax_dg import algorithms, engine, models
from fedjax_dg.client.lanes import packed_update, schedule
from fedjax_dg.client.update import (ClientContext, local_training,
                                     local_update, unit_argsort)
from fedjax_dg.engine.layout import resolve_lanes
from fedjax_dg.engine.round import make_round
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

SIZES = (54, 9, 31, 22)  # batch 8, 2 epochs: 14, 4, 8, 6 local steps
CFG = engine.EngineConfig(rounds=2, eval_every=2, epochs=2, batch_size=8,
                          cohort_size=3, client_mapping="map", seed=3,
                          progress=False, eval_batch_size=16)


@pytest.fixture(scope="module")
def unequal():
  fed = with_sizes(synthetic_federation(num_clients=4), SIZES)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=6)
  return fed, model


def test_unit_argsort_is_argsort():
  """The one-key sort equals the stable argsort, ties (within an index block
  and across blocks) and padding included, up to and past the widest tie
  window (plain argsort there); it relies on uniform draws being multiples
  of 2^-23."""
  def case(n_max):
    """(draws with ties and padding, on the 2^-23 grid, their unit_argsort):
    one jitted program per width (eagerly a program per op and width)."""
    u = jax.random.uniform(jax.random.key(n_max), (3, n_max))
    exact = jnp.all(u * 2.0**23 == jnp.floor(u * 2.0**23))
    n = np.asarray([[n_max], [n_max // 2], [0]])
    u = jnp.where(jnp.arange(n_max) < n, u, 2.0)
    if n_max > 8:
      u = u.at[:, 3].set(u[:, 7]).at[:, 1].set(u[:, -1]).at[1, 2].set(0.0)
    return u, exact, unit_argsort(u)

  for n_max in (1, 257, 5000, 20000):
    u, exact, got = jax.jit(case, static_argnums=0)(n_max)
    assert bool(exact)
    np.testing.assert_array_equal(got, np.argsort(np.asarray(u), -1,
                                                  kind="stable"))


def test_schedule_is_longest_first_packing():
  work = np.asarray([3, 14, 0, 4, 8, 6, 1, 9], np.int32)
  lanes = 3
  lane, offset, loads = map(np.asarray, schedule(jnp.asarray(work), lanes))
  # An independent longest-processing-time-first loop.
  want_loads, want = [0] * lanes, {}
  for i in sorted(range(len(work)), key=lambda i: -work[i]):
    w = int(np.argmin(want_loads))
    want[i] = (w, want_loads[w])
    want_loads[w] += work[i]
  assert {i: (lane[i], offset[i]) for i in range(len(work))} == want
  np.testing.assert_array_equal(loads, want_loads)
  for w in range(lanes):  # a lane's clients run back to back, never overlap
    spans = sorted((offset[i], offset[i] + work[i]) for i in range(len(work))
                   if lane[i] == w and work[i])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("shuffle", ["sort", "feistel"])
def test_packed_lanes_equal_each_client_alone(shuffle):
  """Clients packed into 1 and 3 lanes (one of them without examples)
  give exactly `local_update`'s parameters and mean loss, with a context
  (id, start) that reaches the objective per client; under either
  train.shuffle."""
  rng = np.random.default_rng(0)
  n = np.asarray([13, 0, 5, 29, 8], np.int32)
  g, n_max, bs = len(n), 32, 4
  x = rng.integers(0, 255, (g, n_max, 2, 2, 1)).astype(np.uint8)
  y = rng.integers(0, 3, (g, n_max)).astype(np.int32)
  start = {"w": jnp.asarray(rng.normal(size=(g, 4, 3)), jnp.float32)}
  keys = jax.random.split(jax.random.key(1), g)

  def loss(p, batch, rng_, ctx):
    logits = (batch.x.reshape(batch.x.shape[0], -1) / 255.0) @ p["w"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    drift = jnp.sum((p["w"] - ctx.start["w"]) ** 2) * (1.0 + ctx.id)
    noise = 1e-3 * jax.random.normal(rng_)  # the step key matters
    return jnp.sum(ce * batch.mask) / jnp.sum(batch.mask) + drift + noise

  opt = optax.adam(0.05)
  ctx = lambda i, s: ClientContext(id=i, round=0, start=s)
  alone = jax.jit(lambda p, x, y, n, k, i: local_update(
      loss, opt, p, x, y, n, k, ctx(i, p), batch_size=bs, epochs=2,
      shuffle=shuffle))
  want = [alone(jax.tree.map(lambda a: a[i], start), x[i], y[i], n[i],
                keys[i], i) for i in range(g)]
  training = local_training(loss, opt, n_max=n_max, batch_size=bs, epochs=2,
                            shuffle=shuffle)
  # One lane (clients back to back) and three; feistel's permutations reach
  # the lanes as sort's do, shown at three lanes (one compile less).
  for lanes in (1, 3) if shuffle == "sort" else (3,):
    got, losses = jax.jit(lambda s: packed_update(
        training, lanes, s, lambda c, idx: (jnp.asarray(x)[c, idx],
                                            jnp.asarray(y)[c, idx]),
        jnp.asarray(n), keys, (jnp.arange(g), s), lambda r: ctx(*r)))(start)
    for i in range(g):
      np.testing.assert_allclose(got["w"][i], want[i][0]["w"], rtol=1e-6,
                                 atol=1e-6, err_msg=f"lanes {lanes} client {i}")
      np.testing.assert_allclose(losses[i], want[i][1], rtol=1e-6)
    np.testing.assert_array_equal(got["w"][1], start["w"][1])  # no examples


VARIANTS = {  # name: EngineConfig fields over CFG
    "map masked": dict(skip_idle_steps=False),
    "map": dict(),                     # one loop per client (the CPU default)
    "vmap masked": dict(client_mapping="vmap", skip_idle_steps=False),
    "vmap lanes auto": dict(client_mapping="vmap"),
    "vmap 1 lane": dict(client_mapping="vmap", vmap_lanes=1),
    "map 2 lanes": dict(map_batch_size=2),
}


def _rounds(alg, fed, cfg):
  """CFG.rounds rounds of `make_round`: (final carry, losses, cohorts, local
  steps computed: the objective's calls, per client)."""
  if cfg.vmap_lanes == 0:
    cfg = resolve_lanes(cfg, alg, fed.train.n)
  calls = []

  def counted(p, batch, rng, ctx):
    jax.debug.callback(lambda _: calls.append(1), ctx.id)  # per client
    return alg.client.loss(p, batch, rng, ctx)

  counting = alg.replace(loss=counted)
  round_fn = jax.jit(make_round(counting, cfg, len(SIZES)))
  root = jax.random.key(cfg.seed)
  carry = alg.init(jax.random.fold_in(root, 2**31 - 1))
  train = jax.tree.map(jnp.asarray, fed.train)
  losses, cohorts = [], []
  for r in range(cfg.rounds):
    carry, metrics = round_fn(carry, jnp.int32(r), train, root, None)
    losses.append(float(metrics["loss"]))
    cohorts.append(np.asarray(metrics["cohort"]).tolist())
  jax.effects_barrier()
  return carry, losses, cohorts, len(calls)


def _same_numbers(alg, fed, names):
  """Every variant `names` against the masked scan under `lax.map` (what
  `train.skip_idle_steps=False` runs; one loop per client equals it to float
  rounding: bit for bit with SGD, rounding apart (6e-9) with Adam and FedProx, where
  XLA fuses the while loop's body otherwise); returns {variant: local steps
  computed}, the cohorts of every round."""
  runs = {k: _rounds(alg, fed, dataclasses.replace(CFG, **VARIANTS[k]))
          for k in ("map masked", *names)}
  ref, ref_losses, ref_cohorts, _ = runs["map masked"]
  if "map" in runs:
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(runs["map"][0])):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  for k, (got, losses, cohorts, _) in runs.items():
    assert cohorts == ref_cohorts, k
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=k)
  return {k: run[3] for k, run in runs.items()}, ref_cohorts


def _lanes_steps(work, lanes):
  return lanes * int(np.max(schedule(jnp.asarray(work), lanes)[2]))


def test_scaffold_same_numbers_only_real_steps(unequal):
  """SCAFFOLD (client.end, per-client control variates; a cohort of 3 of 4
  clients of 14, 4, 8, 6 local steps): one loop of its own steps per client
  (the CPU path, `skip_idle_steps`) equals the masked scan to float rounding,
  lanes under vmap to float tolerance. Steps computed: masked, the padded count per
  client; one loop per client, its own; W lanes, W x the longest lane."""
  fed, model = unequal
  alg = algorithms.create("scaffold", model, optimizer=make_optimizer(
      "sgd", 0.1), num_clients=len(SIZES), hparams=dict(variant="II"))
  computed, cohorts = _same_numbers(alg, fed, ("map", "vmap lanes auto"))
  work = np.asarray([2 * math.ceil(s / 8) for s in SIZES])
  padded = 2 * math.ceil(fed.train.x.shape[1] / 8)
  assert computed["map masked"] == CFG.rounds * 3 * padded
  assert computed["map"] == sum(work[c].sum() for c in cohorts)
  lanes = resolve_lanes(dataclasses.replace(
      CFG, **VARIANTS["vmap lanes auto"]), alg, fed.train.n).vmap_lanes
  assert lanes == 2 and computed["vmap lanes auto"] == sum(
      _lanes_steps(work[c], lanes) for c in cohorts)


@pytest.mark.slow
@pytest.mark.parametrize("name,hparams", [
    ("fedavg", {}),
    ("fedprox", dict(mu=0.5)),
    ("scaffold", dict(variant="I")),
])
def test_every_mapping_same_numbers(unequal, name, hparams):
  fed, model = unequal
  alg = algorithms.create(name, model, optimizer=make_optimizer("adam", 0.01),
                          num_clients=len(SIZES), hparams=hparams)
  computed, cohorts = _same_numbers(alg, fed, tuple(VARIANTS))
  work = np.asarray([2 * math.ceil(s / 8) for s in SIZES])
  padded = 2 * math.ceil(fed.train.x.shape[1] / 8)
  assert computed["vmap masked"] == CFG.rounds * 3 * padded
  assert computed["vmap 1 lane"] == computed["map"]
  assert computed["map 2 lanes"] == sum(_lanes_steps(work[c], 2)
                                        for c in cohorts)


def test_auto_lanes_follow_the_clients_sizes(unequal):
  fed, model = unequal
  alg = algorithms.create("fedavg", model, optimizer=make_optimizer("sgd", 0.1),
                          num_clients=len(SIZES), hparams={})
  resolve = lambda n, **kw: resolve_lanes(dataclasses.replace(
      CFG, **{"client_mapping": "vmap", **kw}), alg, np.asarray(n)).vmap_lanes
  # ceil(g * mean / max) of the local steps (14, 4, 8, 6): g = the cohort.
  assert resolve(SIZES) == math.ceil(3 * 8 / 14) == 2
  assert resolve(SIZES, cohort_size=0) == math.ceil(4 * 8 / 14) == 3
  assert resolve([30, 30, 31, 32], cohort_size=0) == 4  # equal: one lane each
  assert resolve(SIZES, vmap_lanes=5) == 5               # set: kept
  assert resolve(SIZES, client_mapping="map") == 0       # not vmapped
  with pytest.raises(ConfigError, match="train.vmap_lanes=-1"):
    dataclasses.replace(CFG, vmap_lanes=-1).validate(4)
