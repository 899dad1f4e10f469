"""The one-scan engine: agreement with a plain loop, resume, sharding, cohorts."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import synthetic_domains
from fedjax_dg import algorithms, engine, models
from fedjax_dg.report import plots, run_summary
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.algorithms import local_only
from fedjax_dg.client import objectives
from fedjax_dg.client.update import local_update
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.layout import client_mesh
from fedjax_dg.engine.round import make_round
from fedjax_dg.optim import make_optimizer

CFG = engine.EngineConfig(checkpoint_every=0.0,rounds=4, eval_every=2, epochs=1, batch_size=8,
                          client_mapping="map", progress=False, eval_batch_size=16)


def mlp(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean, std=fed.std)


# In numpy: eagerly, jnp compiled a program per op and leaf shape.
def leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64)
                                 - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                             strict=True))


@pytest.fixture(scope="module")
def adam(fed3):
  """(model, FedAvg with Adam), one pair for the module: `engine.run` keeps
  its compiled programs per algorithm and model object
  (engine.programs._programs), so the runs below compile each program once."""
  model = mlp(fed3)
  return model, fedavg(model, make_optimizer("adam", 1e-2),
                       objectives.cross_entropy(model))


@pytest.fixture(scope="module")
def adam_run(fed3, adam):
  """The CFG run of `adam` (client_mapping "map"), shared by the tests that
  compare other runs with it."""
  model, alg = adam
  return engine.run(alg, fed3, model, CFG)


def test_fedavg_round_equals_python_loop_over_clients(fed3, adam, adam_run):
  model, alg = adam
  opt = make_optimizer("adam", 1e-2)  # adam's (a fresh state per round)
  loss = objectives.cross_entropy(model)
  cfg = CFG
  got = adam_run

  # The FedJAX execution model: a Python loop over clients, one jitted update each.
  root = jax.random.key(cfg.seed)
  params = jax.jit(alg.init)(jax.random.fold_in(root, 2**31 - 1))[0].params
  upd = jax.jit(lambda p, x, y, n, k: local_update(
      loss, opt, p, x, y, n, k, batch_size=cfg.batch_size, epochs=cfg.epochs))
  for r in range(cfg.rounds):
    _, client_key, _ = jax.random.split(jax.random.fold_in(root, r), 3)
    trained, weights = [], []
    for i in range(fed3.num_clients):
      p_i, _ = upd(params, fed3.train.x[i], fed3.train.y[i], fed3.train.n[i],
                   jax.random.fold_in(client_key, i))
      trained.append(jax.tree.map(np.asarray, p_i))
      weights.append(float(fed3.train.n[i]))
    params = jax.tree.map(lambda *xs: sum(w * x for w, x in zip(weights, xs))
                          / sum(weights), *trained)
  assert max_diff(got.server.params, params) < 1e-5


def test_vmap_and_map_agree(fed3, adam, adam_run):
  model, alg = adam
  assert CFG.client_mapping == "map"
  b = engine.run(alg, fed3, model, dataclasses.replace(CFG, client_mapping="vmap"))
  assert max_diff(adam_run.server, b.server) < 1e-5


def test_resume_from_checkpoint_is_bit_exact(fed3, adam, adam_run, tmp_path):
  model, alg = adam
  full = adam_run
  ckpt = str(tmp_path / "ckpt")
  half = engine.run(alg, fed3, model, dataclasses.replace(CFG, rounds=2),
                    checkpoint_dir=ckpt)
  assert not leaves_equal(half.server, full.server)
  resumed = engine.run(alg, fed3, model, CFG, checkpoint_dir=ckpt)
  assert leaves_equal(resumed.server, full.server)
  assert [h["round"] for h in resumed.history] == [2, 4]
  assert resumed.history[0] == half.history[0]
  # Another algorithm's state (flat leaves of other shapes or another
  # structure) is never restored into this one.
  other = local_only.build(model, make_optimizer("adam", 1e-2),
                           objectives.cross_entropy(model), num_clients=3)
  with pytest.raises(ValueError, match="holds another state"):
    engine.run(other, fed3, model, CFG, checkpoint_dir=ckpt)


def test_cohort_and_persistent_client_state(fed3):
  """Partial participation: only the drawn clients train; the rest keep their state."""
  model = mlp(fed3)
  alg = local_only.build(model, make_optimizer("sgd", 0.1), objectives.cross_entropy(model),
                         num_clients=3)
  cfg = dataclasses.replace(CFG, rounds=1, eval_every=1, cohort_size=2)
  res = engine.run(alg, fed3, model, cfg)
  _, init_clients = jax.jit(alg.init)(
      jax.random.fold_in(jax.random.key(cfg.seed), 2**31 - 1))
  cohort = res.round_metrics["cohort"][0]
  assert len(set(cohort)) == 2
  for i in range(3):
    row = lambda t: jax.tree.map(lambda x: np.asarray(x)[i], t)
    changed = not leaves_equal(row(res.clients), row(init_clients))
    assert changed == (i in cohort), (i, cohort)
  # Different rounds draw different cohorts (with this seed), always of size 2.
  # (Chunks of one round, as above: the same compiled program.)
  many = engine.run(alg, fed3, model, dataclasses.replace(cfg, rounds=6))
  cohorts = [tuple(sorted(c)) for c in many.round_metrics["cohort"]]
  assert all(len(set(c)) == 2 for c in cohorts) and len(set(cohorts)) > 1


def test_no_id_validation_split_means_no_id_accuracy_not_zero(tmp_path):
  """val_fraction = 0 (clients train on their whole partition, HyperGenFL):
  the id evaluation is skipped, never reported as 0 %; reports show "-"."""
  ds = synthetic_domains()
  spec = partition.PartitionSpec(name="domain_split", num_clients=3, d=1, seed=0)
  fed = federated.build(ds, spec, target_domain=0, val_fraction=0.0, seed=0)
  assert int(np.asarray(fed.val.n).sum()) == 0
  model = mlp(fed)
  alg = fedavg(model, make_optimizer("adam", 1e-2), objectives.cross_entropy(model))
  res = engine.run(alg, fed, model, CFG)
  assert len(res.history) == 2
  for entry in res.history + [res.final]:
    assert "id_acc" not in entry and "id_acc_per_client" not in entry, entry
    assert 0.0 <= entry["ood_acc"] <= 1.0
  assert set(res.final["calibration"]) == {"ood"}
  results = dict(targets=["dom0"], algorithms=["fedavg"],
                 runs=[dict(algorithm="fedavg", target="dom0", final=res.final,
                            history=res.history)])
  header, rows = run_summary.table_rows(results)
  cells = dict(zip(header, rows[0]))
  assert cells["id dom0"] == cells["best id μ"] == "-"
  assert cells["ood dom0"] == f"{100 * res.final['ood_acc']:.1f}"
  with warnings.catch_warnings():  # no mean of an all-NaN curve, no empty legend
    warnings.simplefilter("error", RuntimeWarning)
    warnings.simplefilter("error", UserWarning)
    for name, plot in (("c.png", plots.learning_curves),
                       ("p.png", plots.confidence)):
      assert plot(dict(results, name="t", dataset="synthetic"),
                  str(tmp_path / name))
      assert (tmp_path / name).stat().st_size > 0


def test_client_without_validation_examples_is_left_out_of_the_id_mean(
    fed3, adam, adam_run):
  model, alg = adam
  full = adam_run
  n = np.asarray(fed3.val.n).copy()
  n[1] = 0
  part = engine.run(alg, dataclasses.replace(
      fed3, packed_val=federated.pack_padded(fed3.val.replace(n=n))), model,
                    CFG)
  assert leaves_equal(full.server, part.server)  # training does not see val
  want = full.final["id_acc_per_client"]
  got = part.final["id_acc_per_client"]
  assert got[1] is None and got[0] == want[0] and got[2] == want[2]
  assert part.final["id_acc"] == pytest.approx((want[0] + want[2]) / 2, abs=1e-12)


@pytest.mark.parametrize("field,value", [("rounds", 0), ("eval_every", 0),
                                         ("cohort_size", 9), ("client_mapping", "x"),
                                         ("batch_size", 0), ("placement", "x"),
                                         ("vmap_lanes", -1),
                                         ("host_gather", "x"),
                                         # epochs: every example, not rows
                                         ("host_gather", "rows")])
def test_invalid_settings_fail_before_compute(fed3, field, value):
  model = mlp(fed3)
  alg = fedavg(model, make_optimizer("sgd", 0.1), objectives.cross_entropy(model))
  with pytest.raises(ValueError, match=field):
    engine.run(alg, fed3, model, dataclasses.replace(CFG, **{field: value}))


SHARDED = textwrap.dedent("""
    import dataclasses, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from fedjax_dg import engine
    engine.use_cpu_devices({devices})  # before JAX runs
    from conftest import synthetic_federation
    from fedjax_dg import models
    from fedjax_dg.algorithms.fedavg import fedavg
    from fedjax_dg.algorithms import hfedf
    from fedjax_dg.algorithms import local_only
    from fedjax_dg.client import objectives
    from fedjax_dg.engine.programs import programs
    from fedjax_dg.optim import make_optimizer
    assert jax.device_count() == {devices}
    n = {clients}
    fed = synthetic_federation(num_clients=n, d=2, num_domains=5, per_domain=40)
    model = models.get_model("mlp", input_shape=fed.image_shape,
                             num_classes=fed.num_classes, mean=fed.mean, std=fed.std)
    cfg = engine.EngineConfig(rounds=2, eval_every=1, epochs=1, batch_size=8,
                              progress=False, eval_batch_size=8)
    loss = objectives.cross_entropy(model)
    opt = make_optimizer("adam", 1e-2)
    worst = 0.0
    algs = [fedavg(model, opt, loss), local_only.build(model, opt, loss, num_clients=n)]
    lanes = None  # the algorithm sharded with 2 lanes per device
    if {with_hfedf}:
      # FedSAM in FedAvg's place: FedAvg with SAM's optimizer, whose state is
      # rebuilt from constants in each step (SAM's count); Local-only's
      # clients in 2 lanes per device (client.lanes; one loop per client on
      # each device: FedSAM and hFedF); then a server step over the sharded
      # (and padded) cohort.
      from fedjax_dg.algorithms import fedsam
      algs = [fedsam.build(model, opt, loss), algs[1],
              hfedf.build(model, opt, loss, num_clients=n, ema_warmup=1)]
      lanes = algs[1]
    if {with_fedsdaf}:  # a frozen backbone, per-client adapters, GA's gaps
      from fedjax_dg import algorithms
      vit = models.get_model("vit_tiny", input_shape=fed.image_shape,
                             num_classes=fed.num_classes, mean=fed.mean,
                             std=fed.std, patch=4, dim=16, depth=1, heads=2,
                             mlp_dim=16)
      algs = [algorithms.create("fedsdaf", vit, optimizer=opt, hparams={{}},
                                num_clients=n)]
    for alg in algs:
      one = engine.run(alg, fed, model, dataclasses.replace(cfg, client_mapping="map"))
      auto = dataclasses.replace(cfg, client_mapping="auto",
                                 map_batch_size=2 if alg is lanes else 1)
      progs = programs(alg, model, auto, n)
      assert progs.layout.mapping == "shard", progs.layout
      print("MESH", progs.layout.mesh.size)
      many = engine.run(alg, fed, model, auto)
      # One compile per run: the second chunk reused the first one's program.
      assert progs.chunk._cache_size() == 1, progs.chunk._cache_size()
      # In numpy (eagerly, jnp compiled a program per leaf shape and op).
      f64 = lambda a: np.asarray(a, np.float64)  # GA's flags are bools
      d = max(float(np.max(np.abs(f64(a) - f64(b)))) for a, b in zip(
          jax.tree.leaves((one.server, one.clients)),
          jax.tree.leaves((many.server, many.clients)), strict=True))
      worst = max(worst, d)
      assert (one.final["id_acc_per_client"]
              == many.final["id_acc_per_client"])
    print("MAXDIFF", worst)
""")


@pytest.mark.parametrize("devices,clients,mesh", [
    pytest.param(8, 8, 8, marks=pytest.mark.slow), (2, 5, 2)])
def test_sharded_over_host_devices_matches_one_device(devices, clients, mesh):
  """8 clients on 8 devices (slow: the default 2-device case covers its
  algorithms, and more: a padded cohort, hFedF's server step, lanes); 5 on 2
  (the cohort padded to 6 inside the mapper), with FedSAM for FedAvg (FedAvg
  with SAM's optimizer: FedAvg's server, broadcast and evaluation, and SAM's
  state), Local-only's clients in 2 lanes per device (its plain sharded run
  dropped: one loop per client on each device runs for FedSAM and hFedF, the
  client state's scatter runs in lanes as without)."""
  tests = os.path.dirname(os.path.abspath(__file__))
  script = SHARDED.format(tests=tests, devices=devices, clients=clients,
                          with_hfedf=devices == 2, with_fedsdaf=False)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"MESH {mesh}" in out.stdout
  diff = float(out.stdout.split("MAXDIFF")[1])
  assert diff < 1e-5, diff


EVERY_ALGORITHM_SHARDED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from fedjax_dg import engine
    engine.use_cpu_devices(2)  # before JAX runs
    from conftest import every_algorithm_setup, model_for
    from fedjax_dg.run import assemble
    fed, cfg = every_algorithm_setup()
    for name in sys.argv[1:]:
      model = model_for(name, fed, hidden=8)
      alg = assemble.algorithm(name, model, 4, cfg, data=fed)
      leaves = []
      for mapping in ("map", "shard"):
        res = engine.run(alg, fed, model, engine.EngineConfig(
            rounds=2, eval_every=2, epochs=1, batch_size=8, progress=False,
            cohort_size=3, client_mapping=mapping))
        leaves.append([np.asarray(a, np.float64) for a in jax.tree.leaves(
            (res.server, res.clients)) if np.issubdtype(a.dtype, np.floating)])
      d = max(float(np.max(np.abs(a - b), initial=0.0))
              for a, b in zip(*leaves))
      print("DIFF", name, d, all(np.isfinite(a).all() for a in leaves[1]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("name", algorithms.available())
def test_every_algorithm_sharded_over_two_devices_matches_one_device(name):
  """Every registered algorithm, a cohort of 3 of 4 sharded over 2 devices
  (one padded slot), against the same run on one device: the same server and
  client state to 1e-4. (FedSAM crashed here until its step count, which
  optax's opaque SAM rebuilds from a constant, was kept varying over the
  client axis.) HyperGenFL to 5e-2: its hypernetwork's gradients are ~1e-9
  here and Adam rescales them to ~lr, so the float summation order alone
  moves it by ~1e-2 in two rounds (docs/faithfulness.md, "HyperGenFL").
  One subprocess per algorithm: all of them in one took 1,200 s and more on
  CI's AMD EPYC, and a test that long cannot fit the slow tests' CI budget
  (tests/slow_budget.py)."""
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run(
      [sys.executable, "-c", EVERY_ALGORITHM_SHARDED.format(tests=tests),
       name], capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.split() for line in out.stdout.splitlines()
          if line.startswith("DIFF")]
  assert [r[1] for r in rows] == [name]
  (_, _, diff, finite), = rows
  assert finite == "True", name
  assert float(diff) < (5e-2 if name == "hypergenfl" else 1e-4), (name, diff)


@pytest.mark.slow
def test_fedsdaf_sharded_over_host_devices_matches_one_device():
  """FedSDAF on a ViT (frozen backbone held once, per-client adapters, GA's
  gaps measured in a scan) over 2 devices equals one device."""
  tests = os.path.dirname(os.path.abspath(__file__))
  script = SHARDED.format(tests=tests, devices=2, clients=5, with_hfedf=False,
                          with_fedsdaf=True)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert float(out.stdout.split("MAXDIFF")[1]) < 1e-5


def test_client_statistics_trace_under_shard_map(fed3):
  """A client statistic computed in a scan (FedDG-GA's / FedSDAF's gap) traces
  with the clients sharded: its carry varies over the client axis."""
  from fedjax_dg.client.passes import slice_metrics
  model = mlp(fed3)
  params = model.init(jax.random.key(0))
  mesh = client_mesh(1)
  f = jax.shard_map(
      lambda x, y, n: jax.vmap(lambda a, b, c: jnp.stack(slice_metrics(
          model, params, a, b, c, 8, 4)))(x, y, n),
      mesh=mesh, in_specs=(P("clients"),) * 3, out_specs=P("clients"))
  got = np.asarray(jax.jit(f)(fed3.train.x, fed3.train.y, fed3.train.n))
  one = jax.jit(lambda x, y, n: jnp.stack(slice_metrics(  # eagerly: ~100 ops
      model, params, x, y, n, 8, 4)))
  for i in range(fed3.num_clients):
    want = one(fed3.train.x[i], fed3.train.y[i], fed3.train.n[i])
    np.testing.assert_allclose(got[i], np.asarray(want), rtol=1e-5)


def _shapes(jaxpr) -> set:
  """Shapes of every value in a jaxpr, sub-jaxprs (scan, map, cond) included."""
  out = set()
  for eqn in jaxpr.eqns:
    for v in list(eqn.invars) + list(eqn.outvars):
      if hasattr(getattr(v, "aval", None), "shape"):
        out.add(tuple(v.aval.shape))
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else (param,)):
        if hasattr(sub, "eqns"):
          out |= _shapes(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          out |= _shapes(sub.jaxpr)
  return out


@pytest.mark.parametrize("mapping", ["map", "vmap"])
def test_shared_frozen_parameters_are_held_once(fed3, mapping):
  """A frozen first layer: one copy for the cohort (never [m, ...]), the same
  training and evaluation as freezing it inside the full model."""
  from fedjax_dg.algorithms.base import ServerState, with_frozen
  model = mlp(fed3)
  opt = make_optimizer("adam", 1e-2)
  ce = objectives.cross_entropy(model)
  base = fedavg(model, opt, ce)

  def init(key):
    return ServerState({"fc2": model.init(key)["fc2"]}), None

  frozen_alg = base.replace(
      init=init, frozen=lambda key: {"fc1": model.init(key)["fc1"]},
      loss=lambda p, batch, rng, ctx: ce(with_frozen(ctx.frozen, p), batch, rng,
                                         ctx))
  # The independent computation: the whole model, fc1's updates set to zero.
  labels = lambda p: {k: "frozen" if k == "fc1" else "trained" for k in p}
  masked = base.replace(optimizer=optax.multi_transform(
      {"trained": opt, "frozen": optax.set_to_zero()}, labels))
  cfg = dataclasses.replace(CFG, client_mapping=mapping)
  a = engine.run(frozen_alg, fed3, model, cfg)
  b = engine.run(masked, fed3, model, cfg)
  assert max_diff(a.server.params["fc2"], b.server.params["fc2"]) < 1e-6
  assert a.final["id_acc_per_client"] == b.final["id_acc_per_client"]
  assert a.final["ood_acc"] == b.final["ood_acc"]
  # Held once: no value of the round program has the frozen kernel's shape
  # with a client axis (the full model's run does).
  kernel = model.init(jax.random.key(0))["fc1"]["kernel"].shape
  stacked = (fed3.num_clients,) + kernel

  def round_shapes(alg):
    round_fn = make_round(alg, cfg, fed3.num_clients)
    carry = jax.eval_shape(alg.init, jax.random.key(0))
    frozen = None if alg.frozen is None else alg.frozen(jax.random.key(0))
    train = jax.tree.map(jnp.asarray, fed3.train)
    return _shapes(jax.make_jaxpr(round_fn)(carry, jnp.int32(0), train,
                                            jax.random.key(1), frozen).jaxpr)

  assert stacked in round_shapes(masked)
  frozen_shapes = round_shapes(frozen_alg)
  assert stacked not in frozen_shapes
  assert kernel in frozen_shapes


def test_programs_are_cached_per_algorithm_and_forgotten_per_algorithm(
    fed3, adam, adam_run):
  """`programs` returns the same compiled programs for the same algorithm
  and model (adam_run compiled them); `forget_programs` drops exactly that
  algorithm's entries (another algorithm's stay), and a least-recently-used
  entry leaves a full cache first."""
  from fedjax_dg.engine import programs as P
  model, alg = adam
  other = fedavg(model, make_optimizer("sgd", 1e-2),
                 objectives.cross_entropy(model))
  mine = P.programs(alg, model, CFG, fed3.num_clients)
  assert P.programs(alg, model, CFG, fed3.num_clients) is mine
  theirs = P.programs(other, model, CFG, fed3.num_clients)
  assert P.forget_programs(alg) >= 1
  assert P.forget_programs(alg) == 0
  assert P.programs(other, model, CFG, fed3.num_clients) is theirs
  assert P.programs(alg, model, CFG, fed3.num_clients) is not mine
  assert P.forget_programs(other) == 1

  calls = []
  lru = P.per_algorithm_lru(maxsize=2)(lambda a, b: calls.append((a, b)) or b)
  lru("x", 1), lru("y", 2), lru("x", 1), lru("z", 3)  # ("y", 2) least recent
  assert lru.entries() == 2 and lru("x", 1) == 1 and len(calls) == 3
  lru("y", 2)
  assert len(calls) == 4
  P._CACHES.remove(lru)
