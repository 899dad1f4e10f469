"""The two sides of `scale.py --flower`: one FedAvg run of fedjax_dg's engine,
or the same workload as a Flower simulation (Flower's Simulation Runtime:
`flwr.simulation.run_simulation`, Ray actors running the ClientApp).

Each side runs in its own process (`python benchmarks/_flower.py --worker
JSON`, `_worker.run_worker`) and reports the wall time of each round. Flower
comes from its own folder (`make bench` installs it there,
`pip install --target .venv/flwr`): its pins (protobuf < 7, packaging < 26,
rich < 15) conflict with requirements.lock, so only this process puts it on
`sys.path` (first, through PYTHONPATH).

The workload of both sides: the random federation of `scale.federation`
(N clients of `per_client` 28x28x1 images), a cohort of `cohort` clients per
round drawn by each side's own sampler, fedjax_dg's small CNN (`small_cnn`),
`epochs` local epochs of SGD (lr 1e-2) on shuffled batches of `batch` (the
last one masked), a weighted mean of the cohort's parameters. The Flower
client runs the same model with one `jax.jit`ted SGD step per batch in a
Python loop (as Flower's JAX examples do), so both sides compute the same
steps and differ in how they are orchestrated: the engine runs a round as one
compiled program; Flower dispatches each client to a Ray actor (one per core,
`client_resources.num_cpus = 1`) and ships the parameters both ways as
NumPy arrays.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np

LR = 1e-2
RESULT: dict = {}


@functools.lru_cache(maxsize=None)
def setup(num_clients: int, per_client: int, seed: int):
  """(packed training examples, model, jitted SGD step, parameter treedef),
  once per process (every Ray actor builds the same federation)."""
  import jax
  import jax.numpy as jnp
  import optax
  from fedjax_dg import models
  from scale import federation
  fed = federation(num_clients, per_client, seed)
  model = models.get_model("small_cnn", input_shape=fed.image_shape,
                           num_classes=10, mean=fed.mean, std=fed.std)

  @jax.jit
  def step(params, x, y, mask):
    def loss(p):
      ce = optax.softmax_cross_entropy_with_integer_labels(
          model.apply(p, x, train=True), y)
      return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)

  treedef = jax.tree.structure(model.init(jax.random.key(seed)))
  return fed.packed_train, model, step, treedef


def local_train(params, x, y, step, epochs: int, batch: int, rng):
  """`epochs` passes over the client's examples in shuffled batches of
  `batch`; the last batch of a pass is padded and masked."""
  n = len(y)
  for _ in range(epochs):
    order = rng.permutation(n)
    for lo in range(0, n, batch):
      idx = order[lo:lo + batch]
      pad = batch - len(idx)
      mask = np.concatenate([np.ones(len(idx), np.float32),
                             np.zeros(pad, np.float32)])
      idx = np.concatenate([idx, np.zeros(pad, idx.dtype)])
      params = step(params, x[idx], y[idx], mask)
  return params


def client_app():
  from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
  from flwr.clientapp import ClientApp
  app = ClientApp()

  @app.train()
  def train(msg: Message, context: Context) -> Message:
    import jax
    cfg = msg.content["config"]
    cid = int(context.node_config["partition-id"])
    packed, _, step, treedef = setup(int(context.node_config["num-partitions"]),
                                     int(cfg["per-client"]), int(cfg["seed"]))
    leaves = [jax.numpy.asarray(a)
              for a in msg.content["arrays"].to_numpy_ndarrays()]
    params = jax.tree.unflatten(treedef, leaves)
    lo, hi = packed.offsets[cid], packed.offsets[cid + 1]
    rng = np.random.default_rng([int(cfg["seed"]), int(cfg["round"]), cid])
    params = local_train(params, packed.x[lo:hi], packed.y[lo:hi], step,
                         int(cfg["epochs"]), int(cfg["batch"]), rng)
    out = [np.asarray(a) for a in jax.tree.leaves(params)]
    return Message(RecordDict({
        "arrays": ArrayRecord(out),
        "metrics": MetricRecord({"num-examples": int(hi - lo)})}), reply_to=msg)

  return app


def server_app(spec: dict):
  import jax
  from flwr.app import ArrayRecord, ConfigRecord, Context
  from flwr.serverapp import Grid, ServerApp
  from flwr.serverapp.strategy import FedAvg
  app = ServerApp()

  class Timed(FedAvg):
    """Stamps each round's start and tells the clients the round."""

    def configure_train(self, server_round, arrays, config, grid):
      RESULT.setdefault("stamps", []).append(time.perf_counter())
      config["round"] = server_round
      return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
      replies = list(replies)
      RESULT.setdefault("trained", []).append(
          sum(not r.has_error() for r in replies))
      return super().aggregate_train(server_round, replies)

  @app.main()
  def main(grid: Grid, context: Context) -> None:
    del context
    n, m = spec["clients"], spec["cohort"]
    _, model, _, _ = setup(n, spec["per_client"], spec["seed"])
    init = [np.asarray(a) for a in jax.tree.leaves(
        model.init(jax.random.key(spec["seed"])))]
    strategy = Timed(fraction_train=m / n, fraction_evaluate=0.0,
                     min_train_nodes=m, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(init),
                   num_rounds=spec["rounds"], train_config=ConfigRecord(dict(
                       epochs=spec["epochs"], batch=spec["batch"],
                       seed=spec["seed"], round=0,
                       **{"per-client": spec["per_client"]})))
    RESULT.setdefault("stamps", []).append(time.perf_counter())

  return app


def run_flower(spec: dict) -> list[float]:
  """Seconds of each round of a Flower simulation of `spec`."""
  try:
    from flwr.simulation import run_simulation
  except ImportError as e:
    raise SystemExit(
        f"Flower is not importable ({e}): run `make bench` (it installs "
        "flwr[simulation]==1.42.0 into .venv/flwr) and put .venv/flwr first "
        "on PYTHONPATH (scale.py --flower does)") from e
  run_simulation(
      server_app=server_app(spec), client_app=client_app(),
      num_supernodes=spec["clients"],
      backend_config={
          "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
          "init_args": {"num_cpus": spec["cores"],
                        "object_store_memory": 512 * 2**20}})
  stamps, trained = RESULT.get("stamps", []), RESULT.get("trained", [])
  if len(stamps) != spec["rounds"] + 1 or trained != [spec["cohort"]] * len(
      trained):
    raise SystemExit(f"the Flower simulation ran {len(stamps) - 1} of "
                     f"{spec['rounds']} rounds, clients trained per round: "
                     f"{trained} of {spec['cohort']} (see its log above)")
  return np.diff(stamps).tolist()


def run_engine(spec: dict) -> list[float]:
  """Seconds of each round of the engine on `spec` (placement "host", one
  round per chunk: each round's cohort gathered on the host, as Flower's
  clients read theirs)."""
  from fedjax_dg import engine
  from fedjax_dg.algorithms.fedavg import fedavg
  from fedjax_dg.client import objectives
  from fedjax_dg.optim import make_optimizer
  from scale import federation
  engine.use_cpu_devices()  # as `fedjax-dg` runs: one XLA device per core
  fed = federation(spec["clients"], spec["per_client"], spec["seed"])
  _, model, _, _ = setup(spec["clients"], spec["per_client"], spec["seed"])
  alg = fedavg(model, make_optimizer("sgd", LR), objectives.cross_entropy(model))
  cfg = engine.EngineConfig(
      rounds=spec["rounds"], eval_every=1, epochs=spec["epochs"],
      batch_size=spec["batch"], cohort_size=spec["cohort"], placement="host",
      seed=spec["seed"], progress=False)
  stamps = [time.perf_counter()]
  engine.run(alg, fed, model, cfg,
             on_eval=lambda entry: stamps.append(time.perf_counter()))
  return np.diff(stamps).tolist()


def worker(spec: dict) -> None:
  from _worker import emit
  import resource
  t0 = time.perf_counter()
  run = dict(engine=run_engine, flower=run_flower)[spec["side"]]
  round_s = run(spec)
  emit(dict(round_s=round_s, total_s=time.perf_counter() - t0,
            rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _flower  # the apps by reference, so Ray's actors import this module
  _flower.worker(json.loads(sys.argv[sys.argv.index("--worker") + 1]))
