"""IRM (Arjovsky et al. 2019) on each client: FedAvg of an IRMv1 objective
over the client's own source domains.

    client i : min_w  mean_e R_e(w) + lambda_t * mean_e g_e^even g_e^odd
               e: the domains present in the batch (`Batch.d`), R_e their
               mean cross-entropy, g_e^{even,odd} the gradients of the
               even / odd halves' mean loss w.r.t. a dummy scale on the
               logits (`objectives.irm_terms`)
    lambda_t : t / anneal_steps for the client's first anneal_steps local
               steps (t counted over every round), then penalty_weight
               (`objectives.annealed_weight`)
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

A client's count t is its persistent state (int32 [N], the local steps of
its earlier rounds), as the released code's client object keeps its
`update_count` from round to round. Each example's domain reaches the
batch (`NEEDS_DOMAINS`); the batches are the engine's shuffled ones, not
the released code's group sampler (docs/faithfulness.md).
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import counting_steps, fedavg
from fedjax_dg.client import objectives
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "IRM"
PAPER = dict(title="Invariant Risk Minimization",
             authors="Arjovsky, Bottou, Gulrajani, Lopez-Paz",
             venue="arXiv 1907.02893", year=2019)
NEEDS_DOMAINS = True
# A grid over the penalty weight shares one compile (`algorithms.recipe`).
TRACED = ("penalty_weight",)


def build(model, optimizer, *, num_clients: int,
          penalty_weight: float = 1000.0,  # hparam1, sweep/*/pacs/irm.json
          anneal_steps: int = 100,         # hparam2, sweep/*/pacs/irm.json
          ) -> Algorithm:
  """IRM over client `model` (the released code's PACS values)."""
  if is_concrete(penalty_weight) and penalty_weight < 0:
    raise ConfigError(f"irm.penalty_weight={penalty_weight}: must be >= 0 "
                      "(0 is FedAvg on the mean of the domains' risks)")
  if anneal_steps < 0:
    raise ConfigError(f"irm.anneal_steps={anneal_steps}: must be >= 0 (0: "
                      "the full weight from the first local step)")
  loss = objectives.domain_penalty(model, objectives.irm_terms,
                                   penalty_weight, anneal_steps)
  return counting_steps(fedavg(model, optimizer, loss, name="irm"),
                        num_clients)
