"""Fish (Shi et al., ICLR 2022), as the federated DG benchmark's `Fish` client:
FedAvg of a local training whose every step is a Fish meta step over the
batch's domains.

    client i : per batch, from theta:
                 theta~ = theta; for each domain g present in the batch, in
                 increasing domain index: one step of the run's client
                 optimizer (a fresh state each batch) on L_g(theta~), g's
                 mean cross-entropy (`inner_steps`)
                 theta <- theta + meta_lr (theta~ - theta)
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

The engine takes one optimizer step per batch: the objective is the
batch's mean inner loss (not differentiated) plus `objectives.carried`(theta
+ meta_lr (theta~ - theta), theta), whose gradient is -meta_lr (theta~ -
theta), and the clients' optimizer is SGD of learning rate 1, so its step
is the meta update. theta~ is computed inside the objective from
stop_gradient(theta) (no second-order term). The number of domains in a
batch is not static: the inner loop is a scan over `max_groups` slots, the
k-th holding the k-th smallest domain index present, an empty slot leaving
theta~ and the inner optimizer's state as they are (`lax.cond`: skipped
where the clients are mapped one after another, computed and discarded
under a vmap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.update import Batch, match_varying
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "Fish"
PAPER = dict(title="Gradient Matching for Domain Generalization",
             authors="Shi, Seely, Torr, Siddharth, Hannun, Usunier, Synnaeve",
             venue="ICLR", year=2022)
NEEDS_DOMAINS = True
# A grid over the meta step shares one compile (`algorithms.recipe`).
TRACED = ("meta_lr",)


def present_domains(d: jax.Array, mask: jax.Array,
                    max_groups: int) -> jax.Array:
  """int32 [max_groups]: the domain indices present among the batch's real
  examples, in increasing order, then -1 (the released code's
  `split_into_groups`, whose `torch.unique` sorts). Domains past the
  `max_groups` smallest are left out."""
  valid = mask > 0
  # A real example's domain sorts by its index, padding last.
  keys = jnp.sort(jnp.where(valid, d, jnp.iinfo(jnp.int32).max))
  new = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
  new = new & (keys != jnp.iinfo(jnp.int32).max)
  order = jnp.cumsum(new) - 1  # the rank of each key's domain
  slots = jnp.full((max_groups,), -1, jnp.int32)
  return slots.at[jnp.where(new, order, max_groups)].set(
      keys.astype(jnp.int32), mode="drop")


def inner_steps(model, optimizer, params, batch: Batch, rng: jax.Array,
                max_groups: int) -> tuple:
  """(theta~, the mean over the domains present of their inner losses):
  from `params`, one step of `optimizer` (its state fresh) per domain
  present (`present_domains`), each on that domain's mean cross-entropy
  at the current inner parameters (train mode, one key per slot)."""
  groups = present_domains(batch.d, batch.mask, max_groups)

  def group_loss(p, g, key):
    logits = model.apply(p, batch.x, train=True, rng=key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    return objectives.masked_mean(ce, batch.mask * (batch.d == g))

  def step(carry, slot):
    g, key = slot

    def active(c):
      p, state = c
      value, grads = jax.value_and_grad(group_loss)(p, g, key)
      updates, state = optimizer.update(grads, state, p)
      return (optax.apply_updates(p, updates), state), value

    def idle(c):  # an empty slot: nothing computed under lax.map; its zero
      # varies over the mesh axes the active branch's loss does
      return c, match_varying(jnp.zeros((), jnp.float32), (c, batch, key))

    return jax.lax.cond(g >= 0, active, idle, carry)

  keys = jax.random.split(rng, max_groups)
  (inner, _), values = jax.lax.scan(step, (params, optimizer.init(params)),
                                    (groups, keys))
  count = jnp.maximum(jnp.sum(groups >= 0), 1)
  return inner, jnp.sum(values) / count


def fish_loss(model, optimizer, meta_lr, max_groups: int):
  """The surrogate objective: the batch's mean inner loss (a constant)
  plus `carried`(theta + meta_lr (theta~ - theta), theta)."""

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    fixed = jax.lax.stop_gradient(params)
    inner, value = inner_steps(model, optimizer, fixed, batch, rng,
                               max_groups)
    meta = jax.tree.map(lambda t, i: t + meta_lr * (i - t), fixed, inner)
    return jax.lax.stop_gradient(value) + objectives.carried(meta, params)

  return loss


def build(model, optimizer, *, data=None,
          meta_lr: float = 0.1,  # hparam1, sweep/random_seeds/pacs/fish.json
          max_groups: int = 6,   # inner steps per batch at most: a client's
                                 # domains must number at most this many
          ) -> Algorithm:
  """Fish over client `model`: `optimizer` (the run's client optimizer)
  takes the inner steps."""
  if is_concrete(meta_lr) and not 0 <= meta_lr:
    raise ConfigError(f"fish.meta_lr={meta_lr}: must be >= 0 (0 leaves the "
                      "model as received; 1 keeps the inner steps' model)")
  if max_groups < 1:
    raise ConfigError(f"fish.max_groups={max_groups}: must be >= 1")
  if data is not None:
    most = max((len(c) for c in data.client_domains), default=0)
    if most > max_groups:
      raise ConfigError(
          f"fish.max_groups={max_groups}: a client holds {most} domains; "
          f"set fish.max_groups >= {most}")
  return fedavg(model, optax.sgd(1.0),
                fish_loss(model, optimizer, meta_lr, max_groups), name="fish")
