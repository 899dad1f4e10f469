"""pFedHN (Shamsian et al. 2021): a hypernetwork generates each client's model.

    phi_i   = h(theta, v_i)                  client.start: generate each model
    local   : inner steps of the client      (reference code: 50 SGD steps)
    delta_i = phi_i - phi_i^trained          (old minus new, the reference code)
    g       = (1/m) sum_i J_i^T delta_i      one VJP of the batched generator
    theta, v <- SGD(momentum 0.9, weight decay on theta), global-norm clip 50

The reference code takes one server step per sampled client; here the whole cohort's
mean gradient is one step (`train.cohort_size=1` gives one client per step). No
GradAlign, no EMA: the hypernetwork server hFedF builds on
(`server.hypernetwork.hypernetwork_server`) without hFedF's two additions, with
the reference code's hypernetwork and server optimizer. Defaults are the
reference code's; see docs/faithfulness.md.
"""

from __future__ import annotations

from typing import NamedTuple

import optax

from fedjax_dg.algorithms.base import (Algorithm, ClientResult, ClientSide,
                                       ServerSide)
from fedjax_dg.errors import ConfigError
from fedjax_dg.server.hypernetwork import (HyperParams, HypernetworkState,
                                          hypernetwork_server)

DISPLAY_NAME = "pFedHN"
PAPER = dict(
    title="Personalized Federated Learning using Hypernetworks",
    authors="Shamsian et al.", venue="ICML", year=2021)
# Table 10: lr 1e-3 all; wd 1e-5 PACS, 1e-4 OH / VLCS. Reference code:
# optimizer="sgd", lr=5e-3, momentum=0.9, weight_decay=5e-5.
CLIENT = dict(optimizer="adam", lr=1e-3, weight_decay=1e-5, momentum=0.0)


class PFedHNState(NamedTuple):
  hp: HyperParams         # hypernetwork weights and the [N, e] embedding table
  opt: HypernetworkState  # the server optimizer's state


def build(model, optimizer, loss, *, num_clients: int,
          embed_dim: int = 0,        # 0: floor(1 + N/4), the reference code's rule
          hidden: int = 100,  # the hypernetwork MLP's width (reference code)
          n_hidden: int = 3,  # its hidden layers (reference code)
          head_init: str = "client_init",  # as hFedF (docs/faithfulness.md)
          server_optimizer: str = "sgd",  # the hypernetwork's optimizer
          server_momentum: float = 0.9,   # its momentum (reference code)
          server_clip_norm: float = 50.0,  # global-norm clip of its step
          server_lr: float = 1e-2,   # 1e-2 PACS, 1e-3 OH / VLCS (ref. code: 1e-2)
          server_weight_decay: float = 1e-3,  # 1e-3 PACS, 1e-4 OH / VLCS
          embed_weight_decay: bool = False,  # the ref. code decays them too
          local_steps: int = 0,      # 0: train.epochs (hFedF protocol); 50: ref.
          client_clip_norm: float = 0.0,  # 50 in the reference code's inner loop
          ) -> Algorithm:
  """pFedHN.

  Args:
    model, optimizer, loss: the client model, its optimizer and local objective.
    num_clients: N (one embedding row per client).
    embed_dim, hidden, n_hidden, head_init: the hypernetwork
      (`models.hypernetwork`); embed_dim 0 means floor(1 + N / 4).
    server_*: the hypernetwork optimizer; weight decay on the embeddings only
      with `embed_weight_decay`.
    local_steps: > 0: that many local steps per client (the reference code's
      `inner_steps`); 0: the engine's local epochs.
    client_clip_norm: > 0 clips each local gradient's global norm.
  """
  if local_steps < 0:
    raise ConfigError(f"pfedhn local_steps must be >= 0, got {local_steps}")
  if client_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(client_clip_norm),
                            optimizer)
  hn = hypernetwork_server(
      model, num_clients=num_clients, embed_dim=embed_dim, hidden=hidden,
      n_hidden=n_hidden, head_init=head_init, optimizer=server_optimizer,
      lr=server_lr, weight_decay=server_weight_decay,
      momentum=server_momentum, clip_norm=server_clip_norm,
      decay_embeddings=embed_weight_decay, align=False)

  def init(key):
    return PFedHNState(*hn.init(key)), None

  def client_start(server, rows, ids):
    del rows
    return hn.models(server.hp, ids)

  def server_update(server, result: ClientResult, key):
    del key
    return PFedHNState(*hn.step(server.hp, server.opt, result.start,
                                result.params, result.ids)), {}

  return Algorithm(
      name="pfedhn", init=init,
      client=ClientSide(start=client_start, loss=loss, optimizer=optimizer,
                        local_steps=local_steps),
      server=ServerSide(
          update=server_update,
          eval_params=lambda server, clients: hn.all_models(server.hp),
          personalized=True,
          eval_clients=lambda server, rows, ids: client_start(server, rows,
                                                              ids)))
