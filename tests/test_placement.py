"""train.placement: "host" (packed data and client state on the host, a chunk's
cohorts gathered for the devices) gives the numbers of "device" (everything on
the device for the whole run), bit for bit, resumed or not."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import every_algorithm_setup, model_for, synthetic_federation
from fedjax_dg import algorithms, engine, evaluate, models
from fedjax_dg.algorithms import central
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.algorithms import local_only
from fedjax_dg.algorithms import scaffold
from fedjax_dg.client import objectives
from fedjax_dg.engine.evaluation import divergence_ids
from fedjax_dg.engine.placement import (AUTO_DEVICE_SHARE,
                                        device_placement_bytes,
                                        resolve_placement)
from fedjax_dg.optim import make_optimizer
from fedjax_dg.run import assemble

N = 6
# A cohort of 2 of 6 over chunks of 2 rounds: a chunk's table holds at most 4
# of the 6 clients' state rows. Checkpoints after every chunk.
CFG = engine.EngineConfig(checkpoint_every=0.0, rounds=4, eval_every=2,
                          epochs=1, batch_size=8, cohort_size=2,
                          client_mapping="map", progress=False,
                          eval_batch_size=16)


@pytest.fixture(scope="module")
def setup():
  fed = synthetic_federation(num_clients=N, d=1, num_domains=4, per_domain=30)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=8)
  loss, opt = objectives.cross_entropy(model), make_optimizer("sgd", 0.1)
  algs = {"fedavg": fedavg(model, opt, loss),
          "local_only": local_only.build(model, opt, loss, num_clients=N),
          "scaffold": scaffold.build(model, opt, loss, num_clients=N)}
  return fed, model, algs


def assert_same_run(a, b):
  for x, y in zip(jax.tree.leaves((a.server, a.clients)),
                  jax.tree.leaves((b.server, b.clients)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert a.round_metrics == b.round_metrics
  assert a.history == b.history
  assert a.final == b.final


# FedAvg slow: a global model on the host equals the device's in
# tests/test_streaming.py::test_a_streamed_run_equals_the_in_memory_run
# (FedAvg, a cohort, chunks of 2 rounds) and test_host_placement_pooled_central
# below; the host's resume here with client state ("local_only", "scaffold"),
# FedAvg's resume on the device in tests/test_engine.py::
# test_resume_from_checkpoint_is_bit_exact.
@pytest.mark.parametrize("name", [pytest.param("fedavg", marks=pytest.mark.slow),
                                  "local_only", "scaffold"])
def test_host_placement_equals_device_resumed_midway(setup, name, tmp_path):
  """FedAvg; Local-only (a model per client: per-client state, personalized
  evaluation); SCAFFOLD (per-client control variates updated by
  its client.end). The host run stops after 2 rounds and resumes from its
  checkpoint; every client state row, metric and evaluation is the device
  run's."""
  fed, model, algs = setup
  alg = algs[name]
  device = engine.run(alg, fed, model, dataclasses.replace(CFG,
                                                           placement="device"))
  host = dataclasses.replace(CFG, placement="host")
  ckpt = str(tmp_path / "ckpt")
  half = engine.run(alg, fed, model, dataclasses.replace(host, rounds=2),
                    checkpoint_dir=ckpt)
  assert os.listdir(ckpt)  # the resume below starts from round 2
  resumed = engine.run(alg, fed, model, host, checkpoint_dir=ckpt)
  assert [h["round"] for h in resumed.history] == [2, 4]
  assert resumed.history[0] == half.history[0] == device.history[0]
  assert_same_run(device, resumed)
  if name != "fedavg":  # the client state stays numpy on the host
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(resumed.clients))


def test_weight_divergence_over_a_sample_of_clients(setup, monkeypatch):
  """Past DIVERGENCE_CLIENTS clients the final weight divergence compares a
  seeded sample's pairs, the same clients in both placements."""
  fed, model, algs = setup
  monkeypatch.setattr("fedjax_dg.engine.evaluation.DIVERGENCE_CLIENTS", 4)
  pick = divergence_ids(N)
  assert len(pick) == 4 and list(pick) == sorted(set(pick))
  for placement in ("device", "host"):
    res = engine.run(algs["local_only"], fed, model,
                     dataclasses.replace(CFG, rounds=2, placement=placement))
    want = evaluate.weight_divergence(jax.tree.map(
        lambda a: np.asarray(a)[pick], res.clients))
    assert res.final["weight_divergence"] == want


def test_host_placement_pooled_central(setup):
  """Central (one pooled "client" holding every example, per-client id-val):
  the same numbers on the host."""
  fed, model, algs = setup
  alg = central.build(model, make_optimizer("sgd", 0.1), objectives.cross_entropy(model))
  cfg = dataclasses.replace(CFG, rounds=2)
  assert_same_run(engine.run(alg, fed, model, dataclasses.replace(
      cfg, placement="device")), engine.run(alg, fed, model, dataclasses.replace(
          cfg, placement="host")))


def test_host_placement_never_builds_the_padded_view(setup):
  """The padded [N, N_max] view is built on first use only: a host run of a
  fresh federation never asks for it."""
  _, model, algs = setup
  fed = synthetic_federation(num_clients=N, d=1, num_domains=4, per_domain=30)
  engine.run(algs["local_only"], fed, model,
             dataclasses.replace(CFG, rounds=2, placement="host"))
  assert "train" not in vars(fed) and "val" not in vars(fed)
  fed.train  # pylint: disable=pointless-statement
  assert "train" in vars(fed)  # the check above would see it


def test_auto_placement_rule(setup, monkeypatch):
  """"auto": the device while the padded data and the carry take at most
  AUTO_DEVICE_SHARE of one device's memory, else the host."""
  fed, _, algs = setup
  alg = algs["local_only"]
  need = device_placement_bytes(alg, fed.packed_train, fed.packed_val)
  padded = sum(np.asarray(a).nbytes for a in
               jax.tree.leaves((fed.train.x, fed.train.y, fed.val.x, fed.val.y)))
  assert need == padded + engine.checkpoint_bytes(alg)
  share = AUTO_DEVICE_SHARE
  for capacity, want in ((need / share, "device"), (need / share - 1, "host")):
    monkeypatch.setattr("fedjax_dg.engine.placement.device_capacity",
                        lambda c=capacity: c)
    assert resolve_placement("auto", alg, fed.packed_train,
                             fed.packed_val) == want
  assert resolve_placement("device", alg, fed.packed_train,
                           fed.packed_val) == "device"


SHARDED = textwrap.dedent("""
    import dataclasses, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from fedjax_dg import engine
    engine.use_cpu_devices(2)  # before JAX runs
    from conftest import synthetic_federation
    from fedjax_dg import evaluate, models
    from fedjax_dg.algorithms import local_only
    from fedjax_dg.client import objectives
    from fedjax_dg.engine.placement import resolve_gather
    from fedjax_dg.engine.programs import programs
    from fedjax_dg.optim import make_optimizer
    fed = synthetic_federation(num_clients=5, d=2, num_domains=5, per_domain=30)
    model = models.get_model("mlp", input_shape=fed.image_shape, hidden=8,
                             num_classes=fed.num_classes, mean=fed.mean,
                             std=fed.std)
    alg = local_only.build(model, make_optimizer("sgd", 0.1),
                           objectives.cross_entropy(model), num_clients=5)
    cfg = engine.EngineConfig(rounds=2, eval_every=1, epochs=1, batch_size=8,
                              cohort_size=4, progress=False, eval_batch_size=8)
    assert programs(alg, model, cfg, 5).layout.mesh.size == 2
    # Epochs, and 2 fixed local steps (the host gathers the rows they read).
    steps = dataclasses.replace(cfg, local_steps=2)
    assert resolve_gather(steps, alg, "host", fed.packed_train.width
                          ).host_gather == "rows"
    for c in (cfg, steps):
      runs = [engine.run(alg, fed, model, dataclasses.replace(c, placement=p))
              for p in ("device", "host")]
      for a, b in zip(*[jax.tree.leaves((r.server, r.clients)) for r in runs]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      assert runs[0].history == runs[1].history
    print("SAME")
""")


@pytest.mark.slow
def test_host_placement_on_a_client_mesh():
  """2 devices, a cohort of 4 of 5 sharded over them (each round's gathered
  cohort placed sharded, the state table replicated): the device run's
  numbers, with epochs and with fixed local steps (the rows they read
  gathered on the host)."""
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run([sys.executable, "-c", SHARDED.format(tests=tests)],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "SAME" in out.stdout


@pytest.fixture(scope="module")
def every():
  return every_algorithm_setup()


@pytest.mark.slow
@pytest.mark.parametrize("name", algorithms.available())
def test_every_algorithm_same_numbers_on_every_placement_and_mapping(every,
                                                                    name):
  """Every registered algorithm, a cohort of 3 of 4, 2 rounds: the "host"
  placement (epochs; 2 fixed local steps, the host's row gather) gives the
  "device" placement's state bit for bit; vmapped clients (one per lane,
  and 2 lanes) give lax.map's to 1e-4 (HyperGenFL to 5e-2: its
  hypernetwork moves with the float summation order, docs/faithfulness.md,
  "HyperGenFL"; measured 3e-3)."""
  fed, cfg = every
  # Each algorithm compiles its own 6 runs' programs, never reused by the
  # next: dropped here, so the worker's memory does not grow with the
  # number of algorithms run before this one.
  jax.clear_caches()
  model = model_for(name, fed, hidden=8)
  alg = assemble.algorithm(name, model, 4, cfg, data=fed)
  base = dataclasses.replace(CFG, rounds=2, eval_every=1, cohort_size=3)
  state = lambda c: [np.asarray(a) for a in jax.tree.leaves(
      (lambda r: (r.server, r.clients))(engine.run(alg, fed, model, c)))]
  mapped = state(base)
  for steps in (0, 2):
    device = (mapped if steps == 0
              else state(dataclasses.replace(base, local_steps=steps)))
    host = state(dataclasses.replace(base, local_steps=steps,
                                     placement="host"))
    for a, b in zip(device, host, strict=True):
      np.testing.assert_array_equal(a, b)
  for kw in (dict(client_mapping="vmap"),
             dict(client_mapping="vmap", vmap_lanes=2)):
    for a, b in zip(mapped, state(dataclasses.replace(base, **kw)),
                    strict=True):
      np.testing.assert_allclose(np.asarray(a, np.float64),
                                 np.asarray(b, np.float64),
                                 atol=5e-2 if name == "hypergenfl" else 1e-4)
