"""V-REx (Krueger et al. 2021) on each client: FedAvg of the variance of the
risks of the client's own source domains.

    client i : min_w  mean_e R_e(w) + lambda_t * Var_e R_e(w)
               e: the domains present in the batch (`Batch.d`), R_e their
               mean cross-entropy (`objectives.vrex_terms`)
    lambda_t : t / anneal_steps for the client's first anneal_steps local
               steps (t counted over every round), then penalty_weight
               (`objectives.annealed_weight`), as IRM's
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

The released code's VREx is its IRM with another penalty, so it takes the
same two hyperparameters and keeps the same per-client count (the client
state, int32 [N]); it has no sweep of its own, and the defaults are its
IRM's (docs/faithfulness.md says where the penalty differs).
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import counting_steps, fedavg
from fedjax_dg.client import objectives
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "V-REx"
PAPER = dict(title="Out-of-Distribution Generalization via Risk Extrapolation "
                   "(REx)",
             authors="Krueger et al.", venue="ICML", year=2021)
NEEDS_DOMAINS = True
# A grid over the penalty weight shares one compile (`algorithms.recipe`).
TRACED = ("penalty_weight",)


def build(model, optimizer, *, num_clients: int,
          penalty_weight: float = 1000.0,  # hparam1: sweep/*/pacs/irm.json
                                           # (VREx has no sweep of its own)
          anneal_steps: int = 100,         # hparam2: the same file
          ) -> Algorithm:
  """V-REx over client `model`."""
  if is_concrete(penalty_weight) and penalty_weight < 0:
    raise ConfigError(f"vrex.penalty_weight={penalty_weight}: must be >= 0 "
                      "(0 is FedAvg on the mean of the domains' risks)")
  if anneal_steps < 0:
    raise ConfigError(f"vrex.anneal_steps={anneal_steps}: must be >= 0 (0: "
                      "the full weight from the first local step)")
  loss = objectives.domain_penalty(model, objectives.vrex_terms,
                                   penalty_weight, anneal_steps)
  return counting_steps(fedavg(model, optimizer, loss, name="vrex"),
                        num_clients)
