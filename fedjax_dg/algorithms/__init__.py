"""One small file per algorithm; `build` wires one from a config."""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm, ClientResult
from fedjax_dg.client import objectives
from fedjax_dg.optim import make_optimizer

ALGORITHMS = ("fedavg", "central", "local_only", "hfedf")


def client_optimizer(cfg, name: str):
  """The clients' optimizer: `cfg.client` with `cfg.<name>.client` overrides."""
  c = dict(cfg.client)
  section = cfg.get(name)
  if section is not None and "client" in section:
    c.update(dict(section.client))
  return make_optimizer(c["optimizer"], c["lr"], c["weight_decay"], c["momentum"])


def build(name: str, model, num_clients: int, cfg, data=None) -> Algorithm:
  """Builds algorithm `name` for `model` and `num_clients` clients from `cfg`.

  `data` (the run's FederatedData) is for algorithms that derive something from
  the clients' data before training (e.g. fixed data-conditioned embeddings).
  """
  del data  # no algorithm of this registry needs it yet
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; allowed: {ALGORITHMS}")
  opt = client_optimizer(cfg, name)
  loss = objectives.cross_entropy(model)
  if name == "fedavg":
    from fedjax_dg.algorithms.fedavg import fedavg
    return fedavg(model, opt, loss)
  if name == "central":
    from fedjax_dg.algorithms.fedavg import central
    return central(model, opt, loss)
  if name == "local_only":
    from fedjax_dg.algorithms.local_only import local_only
    return local_only(model, opt, loss, num_clients=num_clients)
  from fedjax_dg.algorithms.hfedf import hfedf
  h = {k: v for k, v in dict(cfg.hfedf).items() if k != "client"}
  return hfedf(model, opt, loss, num_clients=num_clients, **h)


__all__ = ["Algorithm", "ClientResult", "ALGORITHMS", "build", "client_optimizer"]
