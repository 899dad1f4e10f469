"""Deep CORAL (Sun & Saenko 2016) on each client: FedAvg of the
cross-entropy plus the distance between the feature means and covariances
of the client's own source domains.

    client i : min_w  CE(w) + penalty_weight * mean_{a<b}
                      [mean (mu_a - mu_b)^2 + mean (C_a - C_b)^2]
               a, b: the domains present in the batch (`Batch.d`), mu, C
               the mean and covariance of their examples' features
               (`model.features`; `objectives.coral_penalty`)
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

The batches are the engine's shuffled ones, not the released code's group
sampler (docs/faithfulness.md).
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "CORAL"
PAPER = dict(title="Deep CORAL: Correlation Alignment for Deep Domain "
                   "Adaptation",
             authors="Sun, Saenko", venue="ECCV Workshops", year=2016)
NEEDS_DOMAINS = True
# A grid over the penalty weight shares one compile (`algorithms.recipe`).
TRACED = ("penalty_weight",)


def build(model, optimizer, *,
          penalty_weight: float = 1.0,  # hparam1, sweep/*/pacs/coral.json
          ) -> Algorithm:
  """Deep CORAL over client `model`."""
  if is_concrete(penalty_weight) and penalty_weight < 0:
    raise ConfigError(f"coral.penalty_weight={penalty_weight}: must be >= 0 "
                      "(0 is FedAvg)")
  loss = objectives.feature_alignment(model, objectives.coral_penalty,
                                      penalty_weight)
  return fedavg(model, optimizer, loss, name="coral")
