"""FedDG-GA (Zhang et al., CVPR 2023, "Federated Domain Generalization with
Generalization Adjustment"): FedAvg whose aggregation weights are moved each
round by the clients' generalization gaps (`server.ga`).

    client k : local training from theta^r -> theta_k^r          (as FedAvg)
               reports E_k(theta^r), E_k(theta_k^r) on a fixed slice of its
               training examples (evaluation mode)
    server   : G_k = E_k(theta^r) - E_k(theta_k^{r-1})  (the last local model)
               a   = GA(a, G, d^r),  d^r = (1 - r / R) d     (`server.ga`)
               theta^{r+1} = sum_k a_k theta_k^r  over the cohort

The paper and the released code (github.com/MediaBrain-SJTU/FedDG-GA) measure
E_k on each client's validation split; ClientData has none, so both metrics
are taken on the client's first `gap_examples` real training examples (the
rows are shuffled when the federation is built), the same rows every round.
E_k is the mean cross-entropy (`metric="loss"`, the default) or the accuracy
(`metric="acc"`, the code's scripts' default `--fair acc`). The weights start
uniform (1/N), not by client size. The run's length sets the step's decay
(`ClientResult.rounds`). Choices: docs/faithfulness.md, "FedDG-GA".

Round metrics, in cohort order: `ga_weights` (a_k after the round's
adjustment; the cohort's models are averaged with them renormalized over the
cohort), `ga_gaps` (G_k, 0 for a client without a previous local model) and
`ga_step` (d^r).
"""

from __future__ import annotations

import math
import numbers

from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       with_frozen)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.passes import slice_metrics
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import ga
from fedjax_dg.server.ga import GapMetrics, ga_server_update
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "FedDG-GA"
PAPER = dict(
    title="Federated Domain Generalization with Generalization Adjustment",
    authors="Zhang et al.", venue="CVPR", year=2023)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("step_size",)


def build(model, optimizer, loss, *, num_clients: int,
          step_size: float = 0.2,   # d (code `--step_size` 0.2)
          metric: str = "loss",     # loss | acc (code default `--fair acc`)
          center: bool = False,     # the paper's Eq. (10): centred gaps
          gap_examples: int = 64,   # examples of each client measured (0: all)
          gap_chunk: int = 64,      # examples per pass when measuring
          ) -> Algorithm:
  """FedDG-GA on `model`: FedAvg with GA aggregation weights."""
  if is_concrete(step_size) and not (
      isinstance(step_size, numbers.Real) and math.isfinite(step_size)
      and step_size >= 0):
    raise ConfigError(f"feddg_ga.step_size={step_size!r}: must be a finite "
                      "number >= 0 (0 keeps the weights uniform)")
  if metric not in ga.SIGNS:
    raise ConfigError(f"feddg_ga.metric={metric!r}: allowed "
                      f"{tuple(ga.SIGNS)}")
  if gap_examples < 0:
    raise ConfigError(f"feddg_ga.gap_examples={gap_examples!r}: must be >= 0 "
                      "(0: all of a client's examples)")
  if gap_chunk < 1:
    raise ConfigError(f"feddg_ga.gap_chunk={gap_chunk!r}: must be >= 1")
  aggregator = ga.ga_aggregation(num_clients, step_size=step_size,
                                 metric=metric, center=center)
  base = fedavg(model, optimizer, loss, aggregator=aggregator,
                name="feddg_ga")
  pick = 0 if metric == "loss" else 1

  def measure(frozen, params, data):
    return slice_metrics(model, with_frozen(frozen, params), data.x, data.y,
                         data.n, gap_examples, gap_chunk)[pick]

  def end(ctx, trained, data, key):  # message: E_k before and after
    del key
    return ctx.state, GapMetrics(received=measure(ctx.frozen, ctx.start, data),
                                 trained=measure(ctx.frozen, trained, data))

  def server_update(server, result: ClientResult, key):
    return ga_server_update(aggregator, server, result.params, result, key)

  return base.replace(end=ClientEnd(end, reads_data=True),
                      update=server_update)
