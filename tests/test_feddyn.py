"""FedDyn: rounds of the engine against a plain numpy FedDyn (Algorithm 1 in
the released code's variables; a cohort smaller than N, clients of unequal
size, both evaluated models), and the contract it proves: a client end of
round that reads no data, so the "host" placement gathers only the rows its
local steps read."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# `setup`: test_scaffold's fixture (3 clients of 54, 37, 21 examples, an MLP)
# and its numpy pieces (the MLP's gradient by hand, the engine's key schedule).
from test_scaffold import (CFG, LR, SIZES, _batches, _close, _cohort_and_keys,
                           _grad, _map, _np, setup)  # noqa: F401
from fedjax_dg import engine
from fedjax_dg.algorithms import feddyn
from fedjax_dg.client import objectives
from fedjax_dg.engine.placement import resolve_gather
from fedjax_dg.engine.round import make_round
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

ALPHA = 0.3  # large enough that the dynamic terms move the numbers


def _build(model, **kw):
  return feddyn.build(model, make_optimizer("sgd", LR),
                      objectives.cross_entropy(model), num_clients=len(SIZES),
                      alpha=kw.pop("alpha", ALPHA), **kw)


def numpy_feddyn(fed, theta, rounds, cfg, alpha, sizes=SIZES):
  """FedDyn as a Python loop over rounds, cohort and steps, with the
  engine's key schedule; per round (ids, theta, h_bar, average, [h_i])."""
  n_clients, m = len(sizes), cfg.cohort_size
  h = [_map(np.zeros_like, theta) for _ in range(n_clients)]
  h_bar = _map(np.zeros_like, theta)
  root = jax.random.key(cfg.seed)
  out = []
  for r in range(rounds):
    ids, client_keys = _cohort_and_keys(root, r, n_clients, m)
    ids = [int(i) for i in ids]
    trained = []
    for i in ids:
      xi, yi = np.asarray(fed.train.x[i]), np.asarray(fed.train.y[i])
      batches = _batches(client_keys[i], sizes[i], xi.shape[0],
                         cfg.batch_size, cfg.epochs)
      w = theta
      for idx, valid, active in zip(*map(np.asarray, batches)):
        if not active:
          continue
        g = _grad(fed, w, xi[idx[valid]], yi[idx[valid]])
        # d/dw [L + alpha <w, h_i> + alpha/2 |w - theta|^2]
        w = _map(lambda w0, g0, hi, t: w0 - LR * (g0 + alpha * hi
                                                  + alpha * (w0 - t)),
                 w, g, h[i], theta)
      trained.append(w)
    new_h = list(h)
    for i, w in zip(ids, trained):
      new_h[i] = _map(lambda hi, w0, t: hi + (w0 - t), h[i], w, theta)
    average = _map(lambda *ws: np.mean(ws, axis=0), *trained)
    h_bar = _map(lambda hb, t, *ws: hb + sum(w0 - t for w0 in ws) / n_clients,
                 h_bar, theta, *trained)
    theta = _map(lambda a, hb: a + hb, average, h_bar)
    h = new_h
    out.append((ids, theta, h_bar, average, h))
  return out


def test_rounds_equal_a_numpy_feddyn(setup):
  fed, model = setup
  alg = _build(model)
  round_fn = jax.jit(make_round(alg, CFG, len(SIZES)))
  root = jax.random.key(CFG.seed)
  carry = jax.jit(alg.init)(jax.random.fold_in(root, 2**31 - 1))
  train = jax.tree.map(jnp.asarray, fed.train)
  want = numpy_feddyn(fed, _np(carry[0].params), CFG.rounds, CFG, ALPHA)
  for r, (ids, theta, h_bar, average, h) in enumerate(want):
    before = carry[1]
    carry, metrics = round_fn(carry, jnp.int32(r), train, root, None)
    server, clients = carry
    assert sorted(np.asarray(metrics["cohort"]).tolist()) == sorted(ids)
    _close(server.params, theta, f"round {r} theta", atol=2e-5)
    _close(server.h, h_bar, f"round {r} h_bar", atol=2e-5)
    _close(server.average, average, f"round {r} average", atol=2e-5)
    for i in range(len(SIZES)):
      row = _map(lambda a: np.asarray(a)[i:i + 1], clients)
      if i in ids:
        _close(row, _map(lambda a: a[None], h[i]), f"round {r} h_{i}",
               atol=2e-5)
      else:  # absent from the cohort: its h_i is untouched
        assert all(np.array_equal(a, np.asarray(b)[i:i + 1]) for a, b in zip(
            jax.tree.leaves(row), jax.tree.leaves(before)))
    # h_bar is the mean of all N h_i.
    _close(server.h, _map(lambda a: np.mean(np.asarray(a), 0), clients),
           f"round {r} h_bar = mean h_i", atol=1e-6)
  assert float(optax.tree.norm(server.h)) > 1e-3
  # The evaluated model: the last cohort's average, or theta.
  _close(alg.server.eval_params(server, clients), average, "average")
  cloud = _build(model, evaluate="cloud")
  _close(cloud.server.eval_params(server, clients), theta, "cloud")


def test_the_end_of_round_reads_no_data_so_rows_can_be_gathered(setup):
  """The contract FedDyn proves: its `ClientEnd` declares it reads no
  examples and is given none (x, y None: a read would fail), so with fixed
  local steps on the host only the rows they read are gathered."""
  fed, model = setup
  alg = _build(model)
  assert alg.client.end is not None and not alg.client.end.reads_data
  cfg = dataclasses.replace(CFG, local_steps=2, placement="host")
  assert resolve_gather(cfg, alg, "host", 54).host_gather == "rows"
  rows = dataclasses.replace(cfg, host_gather="rows", eval_every=3)
  got = engine.run(alg, fed, model, rows)
  want = engine.run(alg, fed, model, dataclasses.replace(
      cfg, host_gather="clients", eval_every=3))
  for a, b in zip(jax.tree.leaves((got.server, got.clients)),
                  jax.tree.leaves((want.server, want.clients)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("hp,needle", [
    (dict(alpha=0.0), "feddyn.alpha"),
    (dict(evaluate="best"), "feddyn.evaluate"),
    (dict(clip_norm=-1.0), "feddyn.clip_norm"),
])
def test_bad_settings_name_the_field(setup, hp, needle):
  _, model = setup
  with pytest.raises(ConfigError, match=needle):
    _build(model, **hp)
