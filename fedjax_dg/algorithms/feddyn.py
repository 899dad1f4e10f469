"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic
Regularization"): each client's objective is corrected by a linear term built
from its own past updates, so the clients' optima line up with the global one.

Algorithm 1 (server model theta, N clients, cohort P, alpha > 0), in the
released code's variables (github.com/alpemreacar/FedDyn): h_i = the sum of
client i's past updates, -grad L_i(theta_i) / alpha in the paper (zeros at
init):

    client i in P:  theta_i = argmin_w  L_i(w) + alpha <w, h_i>
                                        + alpha/2 |w - theta|^2    (local steps)
                    h_i <- h_i + (theta_i - theta)                  (its end of round)
    server:         avg   = mean_P theta_i                          (unweighted)
                    h_bar <- h_bar + (1/N) sum_P (theta_i - theta)  (= mean_N h_i)
                    theta <- avg + h_bar

`h_i` is the client's row of the per-client state (given to its objective as
`ctx.state`; theta as `ctx.start`); its end of round (`ClientEnd`) reads no
examples, only the model it started from and the one it trained, so the
"host" placement may gather only the rows its local steps read. `h_bar` and
the last cohort's average live in the server state (`FedDynState`).

Evaluated model (`evaluate`): "average", the mean of the last cohort's
models (the released code's reported accuracy, its `avg_model`), or "cloud",
theta (what the next cohort receives). The code scales alpha per client by
mean_j n_j / n_i (equal for equal clients) and clips the local gradients of
the loss and linear term at norm 10; here alpha is the paper's one value and
`clip_norm` (0: off) clips the whole objective's gradient. docs/faithfulness.md,
"FedDyn".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm, ClientEnd, ClientResult
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "FedDyn"
PAPER = dict(
    title="Federated Learning Based on Dynamic Regularization",
    authors="Acar et al.", venue="ICLR", year=2021)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("alpha",)
# The released code's CIFAR-10 script: SGD lr 0.1, weight decay 1e-3.
CLIENT = dict(optimizer="sgd", lr=0.1, weight_decay=1e-3, momentum=0.0)
EVALUATE = ("average", "cloud")


class FedDynState(NamedTuple):
  params: dict   # theta, the model the next cohort starts from
  h: dict        # h_bar, the mean over all N clients of their h_i
  average: dict  # the mean of the last cohort's trained models


def dynamic(loss, alpha: float):
  """The local objective `loss` + alpha <w, h_i> + alpha/2 |w - theta|^2
  (h_i = `ctx.state`, theta = `ctx.start`)."""

  def objective(params, batch, rng, ctx):
    linear = optax.tree.vdot(params, ctx.state)
    sq = optax.tree.norm(optax.tree.sub(params, ctx.start), squared=True)
    return loss(params, batch, rng, ctx) + alpha * linear + 0.5 * alpha * sq

  return objective


def build(model, optimizer, loss, *, num_clients: int,
          alpha: float = 1e-2,      # the released code's alpha_coef
          evaluate: str = "average",  # average | cloud (module docstring)
          clip_norm: float = 0.0,   # > 0: clip each local gradient's norm
          ) -> Algorithm:
  """FedDyn of `model` with local objective `loss` (module docstring)."""
  if is_concrete(alpha) and not alpha > 0:
    raise ConfigError(f"feddyn.alpha={alpha!r}: must be > 0 (the dynamic "
                      "regularizer's weight; the released code uses 1e-2)")
  if evaluate not in EVALUATE:
    raise ConfigError(f"feddyn.evaluate={evaluate!r}: allowed {EVALUATE}")
  if clip_norm < 0:
    raise ConfigError(f"feddyn.clip_norm={clip_norm!r}: must be >= 0 "
                      "(0: no clipping; the released code clips at 10)")
  if clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
  base = fedavg(model, optimizer, dynamic(loss, alpha), name="feddyn")

  def client_init(key, ids):
    """h_i = 0."""
    return jax.tree.map(lambda a: jnp.zeros(ids.shape + a.shape, a.dtype),
                        jax.eval_shape(model.init, key))

  def init(key):
    params = model.init(key)
    return (FedDynState(params, optax.tree.zeros_like(params), params),
            client_init(key, jnp.arange(num_clients)))

  def end(ctx, trained, data, key):
    """h_i + (theta_i - theta); nothing sent but the trained model."""
    del data, key
    return optax.tree.add(ctx.state, optax.tree.sub(trained, ctx.start)), None

  def server_update(server, result: ClientResult, key):
    del key
    m = result.ids.shape[0]
    average = tree.weighted_sum(result.params, jnp.full((m,), 1.0 / m))
    step = tree.weighted_sum(optax.tree.sub(result.params, result.start),
                             jnp.full((m,), 1.0 / num_clients))
    h = optax.tree.add(server.h, step)
    return FedDynState(optax.tree.add(average, h), h, average), {
        "feddyn_h_norm": optax.tree.norm(h)}

  def eval_params(server, clients):
    del clients
    return server.average if evaluate == "average" else server.params

  return base.replace(init=init, update=server_update,
                      end=ClientEnd(end, reads_data=False),
                      init_rows=client_init, eval_params=eval_params)
