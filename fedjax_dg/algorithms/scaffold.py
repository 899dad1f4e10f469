"""SCAFFOLD (Karimireddy et al., ICML 2020): FedAvg with control variates that
correct the clients' drift.

Algorithm 1 (server model x, server control c, client controls c_i, local
lr eta_l, global lr eta_g, K local steps, cohort S of N clients):

    client i in S:  y_i <- x
                    K times: y_i <- y_i - eta_l (g_i(y_i) - c_i + c)
                    c_i+ <- g_i(x)                                 (option I)
                         or c_i - c + (x - y_i) / (K eta_l)         (option II)
                    send (y_i - x, c_i+ - c_i);  c_i <- c_i+
    server:         x <- x + eta_g * mean_S (y_i - x)
                    c <- c + |S| / N * mean_S (c_i+ - c_i)

Here: x and c are the server state (`ScaffoldState`); each c_i is a row of the
per-client state ([N, ...], zeros at init as c), gathered for the cohort and
given to its objective as `ctx.state` (c as `ctx.shared`). The correction
enters the local objective as <c - c_i, w - stop_gradient(w)>: its value is 0
(the reported loss is the plain one) and its gradient is exactly c - c_i, so
the client optimizer sees g_i(y) + c - c_i and plain SGD (`CLIENT`) takes
Algorithm 1's step. Its end of round (`ClientEnd`) measures c_i+ - c_i
after the local steps (K = the client's own step count, `ClientData.steps`;
option I is a full pass over its n examples at x, `grad_chunk` at a time),
adds it to the client's row and sends it to the server, which adds |S|/N
times its cohort mean to c. Option II reads no examples there (only K), so
the "host" placement may gather only the rows the local steps read. c stays the
mean of all N c_i (tested).

`correction="step"` adds -eta_l (c - c_i) to the client optimizer's step
on the plain gradient instead (`corrected_step`; NIID-Bench's and the
federated DG benchmark's code): the same step with plain SGD, but Adam or
momentum never rescale the correction.

eta_l in option II (and in the step correction) is the client optimizer's
step size, measured once from its first step (`step_size`): the learning
rate for SGD. With momentum or
Adam the local step is no longer eta_l times the corrected gradient and
option II's (x - y_i) / (K eta_l) only approximates the mean gradient (as in
NIID-Bench's and FL-bench's code, which divide by the nominal lr too);
option I does not depend on the optimizer.

Sign: the server *adds* the mean of y_i - x (the clients' steps), scaled by
eta_g = `server_lr`; eta_g = 1 is FedAvg's unweighted mean of the y_i.

The means over the cohort are unweighted as in the paper (and FL-bench's
code); `weighting="examples"` weights the model update by the clients' example
counts as NIID-Bench's code (and this library's FedAvg) do. The c update stays
|S|/N times the unweighted mean (both codes), so c remains the mean of the c_i.
docs/faithfulness.md, "SCAFFOLD".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       with_frozen)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.passes import sum_over_chunks
from fedjax_dg.client.update import Batch, RunProgress, SeesContext
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete
from fedjax_dg.models.vit_adapters import adapter_setting

DISPLAY_NAME = "SCAFFOLD"
PAPER = dict(
    title="SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
    authors="Karimireddy et al.", venue="ICML", year=2020)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("server_lr",)
# Algorithm 1's clients: plain SGD. lr 1e-2: NIID-Bench's default (the paper
# tunes it per experiment).
CLIENT = dict(optimizer="sgd", lr=1e-2, momentum=0.0, weight_decay=0.0)
OPTIONS = ("I", "II")
# Where c - c_i enters a local step: in the gradient the optimizer sees
# (FL-bench) or added to the optimizer's step (NIID-Bench, the federated DG
# benchmark's code).
CORRECTIONS = ("gradient", "step")
WEIGHTINGS = ("uniform", "examples")


class ScaffoldState(NamedTuple):
  params: dict   # x, the server model
  control: dict  # c, the server control variate (shaped like params)


def corrected(loss):
  """The local objective `loss` plus <c - c_i, w - stop_gradient(w)>: the same
  value, the gradient plus c - c_i (c = `ctx.shared`, c_i = `ctx.state`)."""

  def objective(params, batch: Batch, rng, ctx):
    shift = jax.lax.stop_gradient(optax.tree.sub(ctx.shared, ctx.state))
    zero = optax.tree.sub(params, jax.lax.stop_gradient(params))
    return loss(params, batch, rng, ctx) + optax.tree.vdot(shift, zero)

  return objective


class _ScheduledSeesContext(SeesContext, RunProgress):
  """A `corrected_step` of a `RunProgress` optimizer: takes both."""


def corrected_step(optimizer: optax.GradientTransformation, eta_l):
  """`optimizer` with -eta_l (c - c_i) added to each of its steps (c =
  `ctx.shared`, c_i = `ctx.state`): y <- y + step(g) - eta_l (c - c_i), the
  correction outside the optimizer, so Adam's scaling or momentum never
  act on it. With plain SGD the same step as `corrected`'s."""
  inner = optax.with_extra_args_support(optimizer)  # drops extras it lacks

  def update(grads, state, params=None, *, ctx, **extra):
    updates, state = inner.update(grads, state, params, **extra)
    shift = optax.tree.sub(ctx.shared, ctx.state)
    return optax.tree.add_scale(updates, -eta_l, shift), state

  kind = (_ScheduledSeesContext if isinstance(optimizer, RunProgress)
          else SeesContext)
  return kind(inner.init, update)


def full_gradient(loss, params, x, y, n, key, ctx, chunk: int):
  """g_i(params): the gradient of the mean of `loss` over a client's `n` real
  examples (x: [n_max, ...]), `chunk` examples at a time. `loss` is a masked
  mean over its batch, so each chunk's gradient is weighted by its count."""
  grad = jax.grad(loss)

  def chunk_grad(i, batch):
    g = grad(params, batch, jax.random.fold_in(key, i), ctx)
    return optax.tree.scale(jnp.sum(batch.mask), g)

  total = sum_over_chunks(chunk_grad, optax.tree.zeros_like(params), x, y, n,
                          chunk)
  return optax.tree.scale(1.0 / jnp.maximum(n, 1), total)


def on_frozen(loss):
  """`loss` of the model's whole parameters as an objective of the trained
  ones: the shared-frozen entries (`ctx.frozen`) merged in."""

  def objective(params, batch: Batch, rng, ctx):
    return loss(with_frozen(ctx.frozen, params), batch, rng, ctx)

  return objective


def step_size(optimizer: optax.GradientTransformation):
  """eta_l as the optimizer's first step on a unit gradient at parameters 0:
  the learning rate for SGD (neither momentum nor PyTorch-style weight decay
  acts on that step), lr / (1 + 1e-8) for Adam. A float, or a traced scalar
  where the learning rate is one (a recipe's value)."""
  with jax.ensure_compile_time_eval():
    zero = jnp.zeros(())
    extra = {"progress": 0.0} if isinstance(optimizer, RunProgress) else {}
    update, _ = optimizer.update(jnp.ones(()), optimizer.init(zero), zero,
                                 **extra)
    return float(-update) if is_concrete(update) else -update


def build(model, optimizer, loss, *, num_clients: int,
          variant: str = "II",     # Algorithm 1's option: I (c_i+ = the
                                   # gradient at x) | II (from the local steps)
          server_lr: float = 1.0,  # eta_g (1: the mean of the clients' models)
          weighting: str = "uniform",  # the model update's mean: uniform (the
                                       # paper) | examples (by example counts)
          grad_chunk: int = 64,    # option I: examples per gradient pass
          correction: str = "gradient",  # c - c_i in the gradient the
                                   # optimizer sees | "step": added to its step
          adapters: bool = False,  # on a ViT: train only FedSDAF's A_di and
                                   # the head on the frozen backbone
          adapter_init: str = "",  # with adapters: "" or torch (PyTorch's
                                   # Linear init) | zero (up-projection 0)
          name: str = "scaffold") -> Algorithm:
  """SCAFFOLD of `model` with local objective `loss` (module docstring).
  `adapters`: on a ViT, only FedSDAF's domain-invariant adapter and the head
  train (and carry control variates) on the frozen backbone, FedAvg
  (Adapter)'s setting (the released FedSDAF code's "Scaffold optimizer"),
  the adapter initialized as `adapter_init` says ("" = "torch", PyTorch's
  Linear init; "zero": as `fedsdaf.adapter_init`; set without `adapters`:
  an error, never ignored)."""
  if adapter_init and not adapters:
    raise ConfigError(f"scaffold.adapter_init={adapter_init!r} is set but "
                      "scaffold.adapters=False (no adapter to initialize): "
                      "set scaffold.adapters=True on a ViT, or unset it")
  if variant not in OPTIONS:
    raise ConfigError(f"scaffold.variant={variant!r}: allowed {OPTIONS}"
                      " (Algorithm 1's options: I = c_i+ is the gradient at x, "
                      "II = from the local steps)")
  if is_concrete(server_lr) and not server_lr > 0:
    raise ConfigError(f"scaffold.server_lr={server_lr!r}: must be > 0 (eta_g; "
                      "1 = the mean of the clients' models)")
  if weighting not in WEIGHTINGS:
    raise ConfigError(f"scaffold.weighting={weighting!r}: allowed {WEIGHTINGS}")
  if grad_chunk < 1:
    raise ConfigError(f"scaffold.grad_chunk={grad_chunk!r}: must be >= 1")
  if correction not in CORRECTIONS:
    raise ConfigError(f"scaffold.correction={correction!r}: allowed "
                      f"{CORRECTIONS} (gradient: c - c_i added to the gradient "
                      "the client optimizer sees; step: -lr (c - c_i) added "
                      "to the optimizer's step)")
  eta_l = (step_size(optimizer)
           if variant == "II" or correction == "step" else 1.0)
  if is_concrete(eta_l) and not eta_l > 0:
    raise ConfigError(f"scaffold.variant={variant!r} with scaffold.correction="
                      f"{correction!r} needs a client optimizer whose first "
                      f"step descends (measured step size {eta_l})")
  frozen = None
  sample = model.init
  if adapters:
    model, frozen, sample = adapter_setting(model,
                                            who="scaffold.adapters=True",
                                            adapter_init=adapter_init or "torch")
    loss = on_frozen(objectives.cross_entropy(model))
  if correction == "step":
    base = fedavg(model, corrected_step(optimizer, eta_l), loss, name=name)
  else:
    base = fedavg(model, optimizer, corrected(loss), name=name)

  def client_init(key, ids):
    """c_i = 0."""
    return jax.tree.map(lambda a: jnp.zeros(ids.shape + a.shape, a.dtype),
                        jax.eval_shape(sample, key))

  def init(key):
    params = sample(key)
    zeros = optax.tree.zeros_like(params)
    return (ScaffoldState(params, zeros),
            client_init(key, jnp.arange(num_clients)))

  def end(ctx, trained, data_i, key):
    """Its new c_i = c_i+, and c_i+ - c_i as its message (0 for a client
    without examples: it took no step)."""
    x, c, c_i = ctx.start, ctx.shared, ctx.state
    if variant == "I":
      c_plus = full_gradient(loss, x, data_i.x, data_i.y, data_i.n, key, ctx,
                             grad_chunk)
    else:
      k = jnp.maximum(data_i.steps, 1).astype(jnp.float32)
      drift = optax.tree.scale(1.0 / (k * eta_l), optax.tree.sub(x, trained))
      c_plus = optax.tree.add(optax.tree.sub(c_i, c), drift)
    delta = optax.tree.sub(c_plus, c_i)
    delta = optax.tree.where(data_i.steps > 0, delta,
                             optax.tree.zeros_like(delta))
    return optax.tree.add(c_i, delta), delta

  def server_update(server, result: ClientResult, key):
    del key
    m = result.ids.shape[0]
    weights = (result.num_examples.astype(jnp.float32)
               if weighting == "examples" else jnp.ones((m,), jnp.float32))
    weights = weights / jnp.maximum(jnp.sum(weights), 1e-12)
    step = tree.weighted_sum(optax.tree.sub(result.params, result.start),
                             weights)
    params = optax.tree.add(server.params, optax.tree.scale(server_lr, step))
    # c + |S|/N * mean_S(delta) = c + sum_S(delta) / N.
    control = optax.tree.add(
        server.control, tree.weighted_sum(result.message,
                                          jnp.full((m,), 1.0 / num_clients)))
    return ScaffoldState(params, control), dict(
        scaffold_control_norm=optax.tree.norm(control))

  # Option II reads only the client's step count; option I its examples.
  return base.replace(
      init=init, update=server_update, shared=lambda server: server.control,
      end=ClientEnd(end, reads_data=variant == "I"), init_rows=client_init,
      frozen=frozen, model=model if adapters else None)
