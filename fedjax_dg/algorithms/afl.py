"""AFL (Mohri, Sivek & Suresh 2019), as the federated DG benchmark's
`AFLServer` / `AFLClient`: FedAvg of a lambda-weighted mixture of the
source domains' risks, lambda moved by projected gradient ascent.

    client i : min_w  sum_g lambda_g L_g(w)
               g: the domains present in the batch (`Batch.d`), L_g their
               mean cross-entropy (`mixture_risk`); and, beside training,
               per domain the summed loss and count of the examples it
               trained on under the model it received (`ctx.start`,
               evaluation mode: `DomainLosses`)
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i          (as FedAvg)
               lambda <- Proj_simplex(lambda + lambda_lr * M),
               M_g = (sum over the cohort of g's summed losses)
                     / (its count), 0 for a domain the cohort lacks
               (`ascent_step`, `simplex_projection`)

lambda lives on the simplex over the domains the server has met in a
cohort's data (`seen`): it is uniform over them when they first appear
(the released code: uniform over the domains of the training set), and 0
elsewhere. The released code measures M with the newly aggregated model
over the cohort's data after aggregation; the engine hands the server no
client data, so each client measures the model it received while it
trains (docs/faithfulness.md, "AFL and Fish").

Each round a client trains the pair {"model": global model, "stats": its
`DomainLosses`, zeros}: the model with the run's client optimizer, the
statistics by `objectives.carried` (an SGD step of learning rate 1 adds
the batch's sums), as GroupDRO's weights ride.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm, ClientResult
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.update import Batch
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import weighted_mean
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "AFL"
PAPER = dict(title="Agnostic Federated Learning",
             authors="Mohri, Sivek, Suresh", venue="ICML", year=2019)
NEEDS_DOMAINS = True
# A grid over lambda's step size shares one compile (`algorithms.recipe`).
TRACED = ("lambda_lr",)


class AFLState(NamedTuple):
  """The server state: FedAvg's, the mixture weights and their support."""
  params: dict
  opt: optax.OptState
  lam: jax.Array   # [D] float32: lambda, on the simplex over `seen`
  seen: jax.Array  # [D] float32: 1 for the domains met in a cohort's data


class DomainLosses(NamedTuple):
  """A client's per-domain loss of the model it received, over the examples
  it trained on this round (each as often as it was read)."""
  loss: jax.Array   # [D] float32: summed cross-entropy per domain index
  count: jax.Array  # [D] float32: examples per domain index


def simplex_projection(v: jax.Array, support: jax.Array) -> jax.Array:
  """The Euclidean projection of v [D] onto the probability simplex over
  the entries where `support` is 1 (0 elsewhere; all 0 for an empty
  support): w = max(v - theta, 0) with theta = (sum_{j<=rho} u_j - 1) /
  (rho + 1), u the supported entries sorted in decreasing order and rho
  the last j with u_j > (sum_{k<=j} u_k - 1) / (j + 1) (Duchi et al. 2008;
  the released code's `euclidean_proj_simplex`)."""
  on = support > 0
  k = jnp.sum(on)
  u = -jnp.sort(-jnp.where(on, v, -jnp.inf))
  j = jnp.arange(v.shape[0])
  u = jnp.where(j < k, u, 0.0)
  cssv = jnp.cumsum(u)
  ok = (j < k) & (u > (cssv - 1.0) / (j + 1))
  rho = jnp.max(jnp.where(ok, j, 0))
  theta = (cssv[rho] - 1.0) / (rho + 1)
  return jnp.where(on, jnp.maximum(v - theta, 0.0), 0.0)


def mixture_risk(ce: jax.Array, d: jax.Array, mask: jax.Array,
                 lam: jax.Array) -> jax.Array:
  """sum_g lambda_g L_g over the domains g present in the batch, L_g the
  mean of `ce` [B] over the batch's real examples of domain g (the
  released `AFLClient.step`)."""
  means, _ = objectives.domain_means(ce, d, mask, lam.shape[0])
  return jnp.sum(lam * means)


def client_weights(lam: jax.Array, seen: jax.Array) -> jax.Array:
  """The mixture the clients train with: lambda on the domains the server
  has met; a domain it has not met yet weighs 1 / max(#met, 1) (before the
  first round, every domain 1)."""
  fresh = 1.0 / jnp.maximum(jnp.sum(seen), 1.0)
  return jnp.where(seen > 0, lam, fresh)


def ascent_step(lam: jax.Array, seen: jax.Array, stats: DomainLosses,
                lr) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(lambda', seen', M): the domains the cohort's data hold join the
  support at the uniform weight 1 / |seen'| (the ones already in keep
  theirs), lambda' = `simplex_projection`(lambda + lr M, seen'), M the
  per-domain mean loss of the cohort's summed statistics (`stats` [D]; 0
  where the cohort has no example, the released code's `nan_to_num`)."""
  grown = jnp.maximum(seen, (stats.count > 0).astype(jnp.float32))
  fresh = 1.0 / jnp.maximum(jnp.sum(grown), 1.0)
  start = jnp.where(seen > 0, lam, jnp.where(grown > 0, fresh, 0.0))
  mean = jnp.where(stats.count > 0,
                   stats.loss / jnp.maximum(stats.count, 1.0), 0.0)
  return simplex_projection(start + lr * mean, grown), grown, mean


def afl_loss(model, num_domains: int):
  """The local objective on params {"model", "stats"}: `mixture_risk` of
  the batch under the weights `ctx.shared` (`client_weights`), plus
  `carried`(stats + the batch's per-domain sums of the received model's
  cross-entropy, stats) of value 0."""

  def loss(params, batch: Batch, rng: jax.Array, ctx) -> jax.Array:
    logits = model.apply(params["model"], batch.x, train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    received = model.apply(ctx.start["model"], batch.x)
    ce0 = jax.lax.stop_gradient(
        optax.softmax_cross_entropy_with_integer_labels(received, batch.y))
    onehot = jax.nn.one_hot(batch.d, num_domains) * batch.mask[:, None]
    stats = params["stats"]
    new = DomainLosses(stats.loss + ce0 @ onehot,
                       stats.count + jnp.sum(onehot, axis=0))
    return (mixture_risk(ce, batch.d, batch.mask, ctx.shared)
            + objectives.carried(new, stats))

  return loss


def build(model, optimizer, *, data=None,
          lambda_lr: float = 0.1,  # hparam1, sweep/random_seeds/pacs/afl.json
          num_domains: int = 16,   # lambda's table size: every domain index
                                   # of the federation must be below it
          ) -> Algorithm:
  """AFL over client `model`."""
  if is_concrete(lambda_lr) and lambda_lr < 0:
    raise ConfigError(f"afl.lambda_lr={lambda_lr}: must be >= 0 (0 keeps "
                      "lambda uniform over the domains met)")
  if num_domains < 1:
    raise ConfigError(f"afl.num_domains={num_domains}: must be >= 1")
  if data is not None and len(data.domain_names) > num_domains:
    raise ConfigError(
        f"afl.num_domains={num_domains}: the federation has "
        f"{len(data.domain_names)} domains; set afl.num_domains >= "
        f"{len(data.domain_names)}")
  steps = optax.multi_transform(
      {"model": optimizer, "stats": optax.sgd(1.0)},
      lambda p: {k: jax.tree.map(lambda _: k, v) for k, v in p.items()})
  base = fedavg(model, steps, afl_loss(model, num_domains), name="afl")
  aggregate = weighted_mean()

  def init(key):
    server, _ = base.init(key)
    zeros = jnp.zeros((num_domains,), jnp.float32)
    return AFLState(server.params, server.opt, zeros, zeros), None

  def client_start(server, rows, ids):
    del rows
    m = ids.shape[0]
    zeros = jnp.zeros((m, num_domains), jnp.float32)
    return {"model": tree.broadcast(server.params, m),
            "stats": DomainLosses(zeros, zeros)}

  def server_update(server, result: ClientResult, key):
    del key
    params, opt = aggregate.update(result.params["model"], server.opt,
                                   weights=result.num_examples)
    stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), result.params["stats"])
    lam, seen, mean = ascent_step(server.lam, server.seen, stats, lambda_lr)
    return AFLState(params, opt, lam, seen), {"afl_lambda": lam,
                                              "afl_domain_loss": mean}

  return base.replace(
      init=init, start=client_start, update=server_update,
      shared=lambda server: client_weights(server.lam, server.seen))
