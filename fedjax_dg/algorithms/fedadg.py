"""FedADG (Zhang et al. 2021, "Federated Learning with Domain Generalization",
arXiv 2111.10487): each client aligns its features, class by class, to a
generated reference distribution through an adversarial game; FedAvg of the
networks on the server.

Per client (networks: `models.fedadg`; f = F(x), r = G(u, y), u ~ U(0, 1)):

    L_err  = CE(C(f), y)
    L_advf = mean (1 - D(f, y))^2         F fools D: features look "reference"
    L_advd = mean (1 - D(r, y))^2 + D(f, y)^2
                                          D: reference -> 1, features -> 0
    L_advg = mean D(r, y)^2               G fools D: the reference moves
                                          toward the features
    F, C minimise  alpha L_err + (1 - alpha) L_advf
    D minimises    L_advd                 (least-squares GAN, sigmoid output)
    G minimises    L_advg
    server         example-weighted FedAvg of F, C, G and D

The released code trains the three players one after another within each
batch (D, then F and C, then G), each with its own SGD. Here one local step
is one gradient of one combined objective over the pytree {"model", "gen",
"disc"} whose gradient, block by block, is each player's own gradient at the
same point (simultaneous play):

    J = alpha L_err + (1 - alpha) L_advf[sg D]
        + (L_advd[sg F, sg G] + L_advg[sg D]) - sg(same)

(`sg` = stop_gradient). J's value is the classifier's objective; the second
line adds gradients and no value. `tests/test_fedadg.py` checks each block
against separately differentiated player losses. D's and G's updates are the
optimizer's scaled by `adv_lr_scale` (the code: lr1 = 0.7 lr0); with
`train_generator=False` G never moves (the released VLCS code and its
re-implementations detach G's samples in G's own loss, so G stays at its
initialization). The first `ce_epochs` local epochs of every round train F
and C on L_err only (the code's E0 warm-up; `ClientContext.epoch`).
`local_discriminator=True` keeps each client's D in its persistent state and
averages F, C, G only, as the released code does. Choices and readings:
docs/faithfulness.md, "FedADG".
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.objectives import masked_mean
from fedjax_dg.client.update import RunProgress
from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers
from fedjax_dg.models.fedadg import FedADGNets
from fedjax_dg.server import weighted_mean

DISPLAY_NAME = "FedADG"
PAPER = dict(
    title="Federated Learning with Domain Generalization",
    authors="Zhang et al.", venue="arXiv 2111.10487", year=2021)
# The released code's clients (VLCS): SGD, momentum 0.9, lr0 1e-3 for F and C
# (lr1 = 7e-4 for G and D: `adv_lr_scale`), weight decay 1e-5.
CLIENT = dict(optimizer="sgd", lr=1e-3, momentum=0.9, weight_decay=1e-5)
PLAYERS = ("model", "gen", "disc")


def scale_players(optimizer: optax.GradientTransformation,
                  scales: dict) -> optax.GradientTransformation:
  """`optimizer` whose update of each top-level entry is multiplied by
  `scales[entry]` (1 where absent): a per-player learning rate for SGD / Adam
  (their updates are linear in the learning rate). Keeps the optimizer's kind
  (`RunProgress`, extra arguments)."""
  if all(s == 1.0 for s in scales.values()):
    return optimizer

  def update(updates, state, params=None, **extra):
    out, state = optimizer.update(updates, state, params, **extra)
    return {k: optax.tree.scale(scales.get(k, 1.0), v)
            for k, v in out.items()}, state

  if isinstance(optimizer, RunProgress):
    return RunProgress(optimizer.init, update)
  if isinstance(optimizer, optax.GradientTransformationExtraArgs):
    return optax.GradientTransformationExtraArgs(optimizer.init, update)
  return optax.GradientTransformation(
      optimizer.init, lambda u, s, p=None: update(u, s, p))


def player_losses(nets: FedADGNets, params, batch, rng, *,
                  train_generator: bool = True):
  """(L_err, L_advf, L_advd, L_advg) of one batch, with the stop-gradients
  that make each loss reach its own player only: L_err and L_advf see D
  frozen, L_advd sees F's and G's samples frozen, L_advg sees D frozen.
  Padded rows (mask 0) take no part. `rng` gives the dropout key and the
  generator's noise."""
  sg = jax.lax.stop_gradient
  model = nets.model
  k_drop, k_noise = jax.random.split(rng)
  theta, gen, disc = params["model"], params["gen"], params["disc"]
  y, mask = batch.y, batch.mask
  f = model.features(theta, batch.x, train=True, rng=k_drop)
  ce = optax.softmax_cross_entropy_with_integer_labels(model.head(theta, f), y)
  r = nets.generate(gen, nets.noise(k_noise, y.shape[0]), y)
  if not train_generator:
    r = sg(r)
  both = lambda a, b: jnp.concatenate([a, b], axis=0)
  yy = both(y, y)
  # D's view (its inputs frozen) and F's and G's view (D frozen): two calls.
  d_ref, d_feat = jnp.split(nets.discriminate(disc, both(sg(r), sg(f)), yy), 2)
  dz_feat, dz_ref = jnp.split(nets.discriminate(sg(disc), both(f, r), yy), 2)
  l_advf = masked_mean(jnp.square(1.0 - dz_feat), mask)
  l_advd = masked_mean(jnp.square(1.0 - d_ref) + jnp.square(d_feat), mask)
  l_advg = (masked_mean(jnp.square(dz_ref), mask) if train_generator
            else jnp.zeros(()))
  return masked_mean(ce, mask), l_advf, l_advd, l_advg


def build(model, optimizer, *,
          alpha: float = 0.85,         # L_err's weight; 1 - alpha on L_advf
                                       # (code 0.85; FedCCRL's re-impl. 0.55)
          ce_epochs: int = 0,          # first local epochs on L_err only (E0)
          adv_lr_scale: float = 0.7,   # G's and D's lr / F's and C's (lr1/lr0)
          train_generator: bool = True,    # False: G stays at its init
          local_discriminator: bool = False,  # True: D per client, not averaged
          noise_dim: int = 0,          # 0: the feature width (code: 2048)
          gen_hidden: int = 256,       # code: 4096
          rp_size: int = 256,          # code: 1024
          disc_hidden: int = 256,      # code: 1024
          label_scale: float = 0.6,    # the one-hot label's value (code)
          gen_relu: bool = True,       # ReLU on G's output (code)
          num_clients: int = 0,
          name: str = "fedadg") -> Algorithm:
  """FedADG on `model` (any model with `features` + `head`)."""
  checks = [(0.0 <= alpha <= 1.0, f"fedadg.alpha={alpha!r}: allowed [0, 1] "
                                  "(the weight of the classification loss)"),
            (ce_epochs >= 0, f"fedadg.ce_epochs={ce_epochs!r}: must be >= 0"),
            (adv_lr_scale > 0, f"fedadg.adv_lr_scale={adv_lr_scale!r}: must "
                               "be > 0"),
            (not local_discriminator or num_clients >= 1,
             "fedadg.local_discriminator=True keeps one discriminator per "
             "client: build(..., num_clients=N)")]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  nets = FedADGNets(model, noise_dim=noise_dim, gen_hidden=gen_hidden,
                    rp_size=rp_size, disc_hidden=disc_hidden,
                    label_scale=label_scale, gen_relu=gen_relu)

  def loss(params, batch, rng, ctx):
    ce, l_advf, l_advd, l_advg = player_losses(
        nets, params, batch, rng, train_generator=train_generator)
    others = l_advd + l_advg
    adversarial = (alpha * ce + (1.0 - alpha) * l_advf
                   + others - jax.lax.stop_gradient(others))
    if ce_epochs == 0:
      return adversarial
    return jnp.where(getattr(ctx, "epoch", 0) >= ce_epochs, adversarial, ce)

  scales = {"gen": adv_lr_scale if train_generator else 0.0,
            "disc": adv_lr_scale}
  base = fedavg(nets, scale_players(optimizer, scales), loss, name=name)
  aggregate = weighted_mean()

  def init_local(key):
    params = {k: v for k, v in nets.init(key).items() if k != "disc"}
    keys = jax.random.split(jax.random.fold_in(key, 1), num_clients)
    with layers.init_rng_mode():  # compiles in a fraction of the time
      rows = jax.vmap(nets.init_discriminator)(keys)  # one D per client
    return ServerState(params, aggregate.init(params)), rows

  def client_start_local(server, disc_rows, ids):
    return dict(tree.broadcast(server.params, ids.shape[0]), disc=disc_rows)

  def end_local(ctx, trained, data, key):  # its D is its state; no message
    del ctx, data, key
    return trained["disc"], None

  def server_update_local(server, result: ClientResult, key):
    del key
    shared = {k: v for k, v in result.params.items() if k != "disc"}
    params, opt = aggregate.update(shared, server.opt, server.params,
                                   weights=result.num_examples)
    return ServerState(params, opt), {}

  out = base.replace(eval_params=lambda server, clients: server.params["model"])
  if local_discriminator:
    out = out.replace(init=init_local, start=client_start_local,
                      end=ClientEnd(end_local, reads_data=False),
                      update=server_update_local)
  return out
