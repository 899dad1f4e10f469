"""FedGMA (Tenison et al. 2022): FedAvg with gradient-masked averaging at the server.

    client i : local training from w^t -> w_i          (as FedAvg)
    delta_i  = w_i - w^t                               (new minus old)
    A        = |mean_i sign(delta_i)|, mask = 1 if A >= tau else A
    w^{t+1}  = w^t + eta * mask * sum_i p_i delta_i    p_i = n_i / sum_j n_j

FedAvg with the aggregator `server.gma.gradient_masked_averaging`. Round metric
`gma_unmasked`: the share of parameters the mask leaves undamped (A >= tau).
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.server.gma import gradient_masked_averaging

DISPLAY_NAME = "FedGMA"
PAPER = dict(
    title="Gradient Masked Averaging for Federated Learning",
    authors="Tenison et al.", venue="arXiv 2201.11986", year=2022)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("threshold", "step_size")
# Table 10's client settings, all three datasets.
CLIENT = dict(lr=1e-3, weight_decay=1e-4)


def build(model, optimizer, loss, *,
          threshold: float = 0.7,  # mask threshold tau (Table 10): 0.7 PACS,
                                   # 0.3 Office-Home, 0.5 VLCS
          step_size: float = 1.0,  # server step eta: 1 PACS, 1e-2 OH / VLCS
          ) -> Algorithm:
  return fedavg(model, optimizer, loss,
                aggregator=gradient_masked_averaging(threshold, step_size),
                metrics=lambda opt, result: {"gma_unmasked": opt.unmasked},
                name="fedgma")
