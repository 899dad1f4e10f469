"""FedBE (Chen & Chao 2021): Bayesian model ensemble, distilled on server images.

    client i : local training from w^t -> w_i                  (as FedAvg)
    mu       = sum_i p_i w_i                      p_i = n_i / sum_j n_j
    Sigma    = diag( sum_i p_i (w_i - mu)^2 )     per-coordinate variance
    w_s      ~ N(mu, var_scale^2 Sigma), s = 1..M   ("gaussian"), or
    w_s      = sum_i l_si w_i, l_s ~ Dir(alpha 1)    ("dirichlet")
    ensemble = {mu} + {w_i} + {w_s}                (mean, clients, samples)
    p(y|x)   = mean over the ensemble of softmax(f(x; w))   pseudo-labels
    student  = mu; `steps` SGD steps (momentum 0.9, lr 1e-3, wd 1e-5) on
               KL(p(.|x) || softmax(f(x; student))) over server batches,
               with SWA of the iterates
    w^{t+1}  = the SWA average

Pseudo-labels are computed once per round on every server image (as the
reference code's `record_teacher`); the ensemble is evaluated in evaluation
mode, the student trains in training mode. Samples are never stored together:
they are drawn and scored one at a time inside a `lax.scan`. Only the server
images are used (no labels). Choices and departures: docs/faithfulness.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer
from fedjax_dg.server import ServerTransform, distill

DISPLAY_NAME = "FedBE"
PAPER = dict(
    title=("FedBE: Making Bayesian Model Ensemble Applicable to Federated "
           "Learning"),
    authors="Chen, Chao", venue="ICLR", year=2021)
NEEDS_SERVER_DATA = True
SAMPLERS = ("gaussian", "dirichlet")


def gaussian_fit(stacked, weights):
  """(mean, variance) pytrees: p-weighted mean and per-coordinate variance."""
  p = weights / jnp.sum(weights)
  mean = tree.weighted_sum(stacked, p)
  var = jax.tree.map(
      lambda x, m: jnp.tensordot(p.astype(x.dtype), jnp.square(x - m), axes=1),
      stacked, mean)
  return mean, var


def gaussian_sample(key, mean, var, scale: float = 1.0):
  """One draw of N(mean, scale^2 diag(var)) (one normal key per leaf)."""
  leaves, treedef = jax.tree.flatten(mean)
  keys = jax.random.split(key, len(leaves))
  draws = [m + scale * jnp.sqrt(v) * jax.random.normal(k, m.shape, m.dtype)
           for m, v, k in zip(leaves, jax.tree.leaves(var), keys)]
  return jax.tree.unflatten(treedef, draws)


def dirichlet_sample(key, stacked, alpha: float = 1.0):
  """One convex combination sum_i l_i w_i with l ~ Dir(alpha 1_m)."""
  m = tree.leading_size(stacked)
  lam = jax.random.dirichlet(key, jnp.full((m,), alpha))
  return tree.weighted_sum(stacked, lam)


def sharpen(probs, temperature: float):
  """p^(1/T) renormalized (the reference code's `temp_sharpen`; T = 1: p)."""
  if temperature == 1.0:
    return probs
  q = jnp.maximum(probs ** (1.0 / temperature), 1e-8)
  return q / jnp.sum(q, axis=-1, keepdims=True)


def ensemble_probs(probs_of, mean, var, stacked, key, *, num_samples: int,
                   sampler: str = "gaussian", var_scale: float = 1.0,
                   dirichlet_alpha: float = 1.0, include_mean: bool = True,
                   include_clients: bool = True):
  """Mean of `probs_of(w)` over the ensemble {mean} + {clients} + {samples}.

  Sample s uses key `jax.random.split(key, num_samples)[s]`; samples are drawn
  and scored one at a time (a `lax.scan`), clients sequentially (`lax.map`).
  """
  total, count = 0.0, 0
  if include_mean:
    total, count = total + probs_of(mean), count + 1
  if include_clients:
    total = total + jnp.sum(jax.lax.map(probs_of, stacked), axis=0)
    count += tree.leading_size(stacked)
  if num_samples:
    def add(acc, k):
      if sampler == "gaussian":
        w = gaussian_sample(k, mean, var, var_scale)
      else:
        w = dirichlet_sample(k, stacked, dirichlet_alpha)
      return acc + probs_of(w), None
    shape = jax.eval_shape(probs_of, mean)
    samples, _ = jax.lax.scan(add, jnp.zeros(shape.shape, shape.dtype),
                              jax.random.split(key, num_samples))
    total, count = total + samples, count + num_samples
  return total / count


def bayesian_ensemble_distillation(model, server_x, optimizer, *, steps: int,
                                   batch_size: int, swa_start: int,
                                   swa_freq: int, sharpen_temperature: float,
                                   eval_chunk: int,
                                   **ensemble) -> ServerTransform:
  """Stacked trained models [m, ...] -> the SWA average of the student (extras
  `weights`, `key`): pseudo-labels of the ensemble (`ensemble_probs`) on
  `server_x`, distilled into the mean model; `DistillState`."""
  num = int(server_x.shape[0])
  eval_apply = lambda p, x: model.apply(p, x, train=False)
  probs_of = lambda p: jax.nn.softmax(
      distill.predict(eval_apply, p, server_x, eval_chunk), axis=-1)

  def update(updates, state, params=None, *, weights, key, **extra):
    del state, params, extra
    k_sample, k_train = jax.random.split(key)
    mean, var = gaussian_fit(updates, weights)
    probs = ensemble_probs(probs_of, mean, var, updates, k_sample, **ensemble)
    targets = sharpen(probs, sharpen_temperature)

    def objective(p, idx, mask, rng):
      out = model.apply(p, jnp.take(server_x, idx, axis=0), train=True, rng=rng)
      return distill.kl_to_teacher(out, jnp.take(targets, idx, axis=0), mask)

    res = distill.server_train(mean, objective, optimizer, key=k_train,
                               steps=steps, num=num, batch_size=batch_size,
                               swa_start=swa_start, swa_freq=swa_freq)
    return res.averaged, distill.DistillState(res.losses[0], res.losses[-1])

  return ServerTransform(distill.initial_distill_state, update)


def prepare(model=None, *, data, **unused) -> dict:
  """What `build` reads of the run's data, as arrays (the recipe's values,
  `algorithms.recipe`: runs of other seeds and targets then share one
  program): the server's split."""
  return distill.prepare_server(model, data=data, name="fedbe")


def build(model, optimizer, loss, *, data, prepared=None,
          num_samples: int = 10,      # ref. code num_sample_teacher
          sampler: str = "gaussian",  # gaussian (the paper's main) | dirichlet
          var_scale: float = 1.0,     # std multiplier of the samples (paper: 1;
                                      # the ref. code's 0.1 acts on normalized
                                      # deltas)
          dirichlet_alpha: float = 1.0,  # ref. code's Dir(1) (sampler="dirichlet")
          include_mean: bool = True,  # the ensemble holds the mean model
          include_clients: bool = True,  # and the client models (paper:
                                         # {mean, clients, samples})
          epochs: int = 20, steps: int = 0,  # ref. code server_ep
          batch_size: int = 128,      # ref. code server_bs
          lr: float = 1e-3,           # the server's distillation SGD
          momentum: float = 0.9,      # its momentum
          weight_decay: float = 1e-5,  # ref. code ServerUpdate.set_opt
          swa: bool = True,           # ref. code use_SWA (FedBE's main results)
          swa_start: float = 0.3,     # share of the steps before SWA (ref.: 500
                                      # steps of ~1580 on CIFAR-10)
          swa_freq: int = 25,         # ref. code: a snapshot every 25 steps
          sharpen_temperature: float = 1.0,  # 1: mean softmax (paper); ref.
                                             # code's temp: 0.5
          eval_chunk: int = 256,      # images per forward pass of the teachers
          ) -> Algorithm:
  """FedBE; `data` is the run's FederatedData (its `server_x`).

  Args:
    num_samples: M sampled models in the ensemble.
    sampler: "gaussian" (the paper's main variant) or "dirichlet".
    var_scale: standard-deviation multiplier of the Gaussian samples.
    include_mean, include_clients: the ensemble holds mu / the client models.
    epochs, steps, batch_size: server steps as in `distill.resolve_steps`.
    lr, momentum, weight_decay: the student's SGD (reference code).
    swa, swa_start, swa_freq: SWA from `swa_start` (a fraction of the steps)
      every `swa_freq` steps; the round's new global model is the average.
    sharpen_temperature: pseudo-labels p^(1/T) renormalized; 1 = none.
  """
  if sampler not in SAMPLERS:
    raise ConfigError(f"fedbe.sampler={sampler!r}: allowed {SAMPLERS}")
  if num_samples < 0 or not (num_samples or include_mean or include_clients):
    raise ConfigError("fedbe's ensemble is empty: set num_samples >= 1 or "
                     "include_mean / include_clients")
  if sharpen_temperature <= 0:
    raise ConfigError(f"fedbe.sharpen_temperature must be > 0, got "
                     f"{sharpen_temperature}")
  sx, _ = distill.require_server_data(data, "fedbe", prepared)
  num = int(sx.shape[0])
  bs = max(1, min(batch_size, num))
  n_steps = distill.resolve_steps(steps, epochs, num, bs)
  aggregator = bayesian_ensemble_distillation(
      model, sx, make_optimizer("sgd", lr, weight_decay, momentum),
      steps=n_steps, batch_size=bs,
      swa_start=distill.swa_start_step(swa_start, n_steps) if swa else -1,
      swa_freq=swa_freq, sharpen_temperature=sharpen_temperature,
      eval_chunk=eval_chunk, num_samples=num_samples, sampler=sampler,
      var_scale=var_scale, dirichlet_alpha=dirichlet_alpha,
      include_mean=include_mean, include_clients=include_clients)
  return fedavg(model, optimizer, loss, aggregator=aggregator,
                metrics=distill.distill_metrics, name="fedbe")
