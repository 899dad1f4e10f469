"""FedSAM (Qu et al. 2022; Caldarola et al. 2022): FedAvg with SAM as the local optimizer.

    client i, each local step on batch b:
        e  = rho g / |g|,  g = grad L_b(w)       (adaptive: rho T^2 g / |T g|)
        w <- w - lr * (grad L_b(w + e) + wd * w)   the base optimizer (SGD in the
                                                   papers) at w, gradient at w + e
    server : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

Everything but the client optimizer is FedAvg; the SAM step is `client.sam.sam`
wrapped around the run's client optimizer. rho = 0 is FedAvg. The papers' base
optimizer is SGD (Caldarola et al.: lr 1e-2, weight decay 4e-4); here the run's
`client` optimizer.
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.sam import sam

DISPLAY_NAME = "FedSam"
PAPER = dict(
    title="Generalized Federated Learning via Sharpness Aware Minimization",
    authors="Qu et al.", venue="ICML", year=2022)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("eta", "rho")


def build(model, optimizer, loss, *,
          rho: float = 0.05,       # SAM radius: Foret et al.'s default
                                   # (Caldarola et al.'s CIFAR scripts: 0.5)
          adaptive: bool = False,  # True: ASAM (Kwon et al. 2021), FedASAM
          eta: float = 0.01,       # ASAM's T_w = |w| + eta (ASAM ref. code)
          ) -> Algorithm:
  """FedSAM with base client `optimizer`, radius `rho` (adaptive: ASAM's eta)."""
  return fedavg(model, sam(optimizer, rho, adaptive=adaptive, eta=eta), loss,
                name="fedsam")
