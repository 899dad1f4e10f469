"""MMD (Li et al. 2018, as DomainBed's) on each client: FedAvg of the
cross-entropy plus the maximum mean discrepancy between the features of the
client's own source domains.

    client i : min_w  CE(w) + penalty_weight * mean_{a<b} MMD^2(h_a, h_b)
               a, b: the domains present in the batch (`Batch.d`), h their
               examples' features (`model.features`); Gaussian kernels of
               the released code's bandwidths (`objectives.mmd_penalty`)
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

DISPLAY_NAME = "MMD"
PAPER = dict(title="Domain Generalization with Adversarial Feature Learning",
             authors="Li, Pan, Wang, Kot", venue="CVPR", year=2018)
NEEDS_DOMAINS = True
# A grid over the penalty weight shares one compile (`algorithms.recipe`).
TRACED = ("penalty_weight",)


def build(model, optimizer, *,
          penalty_weight: float = 1.0,  # hparam1, sweep/*/pacs/mmd.json
          ) -> Algorithm:
  """MMD over client `model`."""
  if is_concrete(penalty_weight) and penalty_weight < 0:
    raise ConfigError(f"mmd.penalty_weight={penalty_weight}: must be >= 0 "
                      "(0 is FedAvg)")
  loss = objectives.feature_alignment(model, objectives.mmd_penalty,
                                      penalty_weight)
  return fedavg(model, optimizer, loss, name="mmd")
