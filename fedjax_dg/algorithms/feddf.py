"""FedDF (Lin et al. 2020): FedAvg, then ensemble distillation on server images.

    client i : local training from w^t -> w_i                  (as FedAvg)
    w        = sum_i p_i w_i                p_i = n_i / sum_j n_j  (the student)
    teacher  = softmax( (1/m) sum_i f(x; w_i) / T )            AvgLogits
    repeat `steps` times, batch x of unlabeled server images:
      w <- Adam step on T^2 KL(teacher(x) || softmax(f(x; w) / T))
    w^{t+1}  = w

The teachers are the cohort's locally trained models in evaluation mode, their
averaged logits computed once per round on every server image; the student
trains in training mode (dropout on), as the reference code's `model.train()`.
Adam (lr 1e-3, cosine annealing over the server steps, FedDF Sec. 4), a fresh
optimizer every round. Only the server images are used (no labels).
Choices and departures: docs/faithfulness.md ("Server-data baselines").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import ServerTransform, distill

DISPLAY_NAME = "FedDF"
PAPER = dict(
    title="Ensemble Distillation for Robust Model Fusion in Federated Learning",
    authors="Lin et al.", venue="NeurIPS", year=2020)
NEEDS_SERVER_DATA = True


def avg_logits_teacher(logits, temperature: float = 1.0):
  """[S, C] teacher probabilities softmax(mean_m logits[m] / T) (AvgLogits)."""
  return jax.nn.softmax(jnp.mean(logits, axis=0) / temperature, axis=-1)


def ensemble_distillation(model, server_x, optimizer, *, steps: int,
                          batch_size: int, temperature: float = 1.0,
                          eval_chunk: int = 256) -> ServerTransform:
  """Stacked trained models [m, ...] -> the distilled model (extras `weights`,
  `key`): the weighted mean, trained `steps` steps of `optimizer` toward the
  cohort's AvgLogits teacher on the images `server_x`; `DistillState`."""
  num = int(server_x.shape[0])
  eval_apply = lambda p, x: model.apply(p, x, train=False)

  def update(updates, state, params=None, *, weights, key, **extra):
    del state, params, extra
    student = tree.weighted_mean(updates, weights)
    logits = distill.predict_many(eval_apply, updates, server_x, eval_chunk)
    teacher = avg_logits_teacher(logits, temperature)

    def objective(p, idx, mask, rng):
      out = model.apply(p, jnp.take(server_x, idx, axis=0), train=True, rng=rng)
      return distill.kl_to_teacher(out, jnp.take(teacher, idx, axis=0), mask,
                                   temperature)

    res = distill.server_train(student, objective, optimizer, key=key,
                               steps=steps, num=num, batch_size=batch_size)
    return res.params, distill.DistillState(res.losses[0], res.losses[-1])

  return ServerTransform(distill.initial_distill_state, update)


def prepare(model=None, *, data, **unused) -> dict:
  """What `build` reads of the run's data, as arrays (the recipe's values,
  `algorithms.recipe`: runs of other seeds and targets then share one
  program): the server's split."""
  return distill.prepare_server(model, data=data, name="feddf")


def build(model, optimizer, loss, *, data, prepared=None,
          epochs: int = 20, steps: int = 0,  # FedLAW ref. code's FedDF: 20
                                             # server epochs (FedDF: up to 1e4
                                             # steps with early stopping)
          batch_size: int = 128,   # FedLAW ref. code (validate_batchsize)
          lr: float = 1e-3, cosine: bool = True,  # FedDF Sec. 4: Adam 1e-3,
                                                  # cosine annealing
          temperature: float = 1.0,  # FedDF Eq. 1 (KL of plain softmaxes)
          eval_chunk: int = 256,     # images per forward pass of the teachers
          ) -> Algorithm:
  """FedDF; `data` is the run's FederatedData (its `server_x`).

  Args:
    epochs, steps: server steps = `steps` if > 0, else `epochs` passes over
      the server images in batches of `batch_size`.
    lr, cosine: Adam's learning rate, cosine-annealed to 0 over the steps.
    temperature: T of both softmaxes (1: FedDF's Eq. 1, no temperature).
  """
  if temperature <= 0:
    raise ConfigError(f"feddf.temperature must be > 0, got {temperature}")
  sx, _ = distill.require_server_data(data, "feddf", prepared)
  num = int(sx.shape[0])
  bs = max(1, min(batch_size, num))
  n_steps = distill.resolve_steps(steps, epochs, num, bs)
  schedule = optax.cosine_decay_schedule(lr, n_steps) if cosine else lr
  aggregator = ensemble_distillation(model, sx, optax.adam(schedule),
                                     steps=n_steps, batch_size=bs,
                                     temperature=temperature,
                                     eval_chunk=eval_chunk)
  return fedavg(model, optimizer, loss, aggregator=aggregator,
                metrics=distill.distill_metrics, name="feddf")
