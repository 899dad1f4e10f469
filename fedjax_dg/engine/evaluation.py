"""How a run is scored between chunks and at its end: id-validation accuracy
per client, accuracy on the held-out target domain, calibration, weight
divergence and the algorithm's extras (`make_eval`), the target examples
scored (`ood_sets`, `OOD_BLOCK_BYTES`), the clients of the weight divergence
(`divergence_ids`) and the final model's target features
(`target_features`).

The "device" placement scores every client at once; the "host" placement a
block of clients at a time, reading their state rows and examples from the
host (`placement.EvalBlocks`): the same numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg import evaluate
from fedjax_dg.algorithms.base import Algorithm, Recipe, with_frozen
from fedjax_dg.engine.placement import EvalBlocks, pad_clients, take_rows
from fedjax_dg.engine.settings import EngineConfig, eval_batch

# A streamed target split (data.streaming) is scored in blocks of at most
# this many bytes of images, read at each evaluation; an in-memory one (or a
# streamed one that fits in one block) is read and placed once.
OOD_BLOCK_BYTES = 1 << 28
# The final weight divergence of personalized models (all client pairs, an
# [n, n] Gram matrix per tensor) over at most this many clients: a seeded
# sample of them in larger federations.
DIVERGENCE_CLIENTS = 1000


class OodSet:
  """Target examples `rows` of (x, y) to score, in blocks of at most `block`
  examples, each padded to a multiple of `batch` (`evaluate.pad_to_multiple`)
  and placed as (x, y, mask) device arrays. One block is read and placed
  once; more (a streamed target split, `OOD_BLOCK_BYTES`) are read at each
  iteration, and their scores add up (`make_eval`)."""

  def __init__(self, x, y, rows, batch: int, block: int):
    self.x, self.y, self.rows, self.batch = x, y, rows, batch
    self.starts = range(0, len(rows), block)
    self.block = block
    # One block: read once (`host`, numpy) and placed at the first use.
    self.host = self._read(rows) if len(self.starts) == 1 else None
    self._placed = None

  @property
  def kept(self):
    """[the one block's (x, y, mask) on the device], or None (blocks)."""
    if self.host is None:
      return None
    if self._placed is None:
      self._placed = [tuple(jax.device_put(self.host))]
    return self._placed

  def _read(self, rows):
    """(x, y int32, mask float32) numpy arrays: placed without a compiled
    conversion."""
    x, y, mask = evaluate.pad_to_multiple(self.x[rows], self.y[rows],
                                          self.batch)
    return np.asarray(x), np.asarray(y, np.int32), np.asarray(mask, np.float32)

  def __iter__(self):
    if self.kept is not None:
      return iter(self.kept)
    return (tuple(jax.device_put(self._read(self.rows[s:s + self.block])))
            for s in self.starts)


def ood_sets(data, cfg: EngineConfig):
  """(every target example, the `ood_eval_max` scored between chunks) as
  `OodSet`; (None, None) without a target split."""
  tx, ty = data.target_x, np.asarray(data.target_y)
  n = len(ty)
  if n == 0:
    return None, None
  block = n
  if data.target_streamed:
    per_block = OOD_BLOCK_BYTES // max(1, int(np.prod(tx.shape[1:])))
    batch = eval_batch(cfg, n)
    block = max(batch, per_block // batch * batch)
  full = OodSet(tx, ty, np.arange(n), eval_batch(cfg, n), block)
  if cfg.ood_eval_max and n > cfg.ood_eval_max:
    pick = np.random.default_rng(cfg.seed).choice(n, cfg.ood_eval_max,
                                                  replace=False)
    return full, OodSet(tx, ty, pick, eval_batch(cfg, cfg.ood_eval_max), block)
  return full, full


def divergence_ids(num_clients: int) -> np.ndarray:
  """The clients the final weight divergence is measured over: all of them,
  or a seeded sample of DIVERGENCE_CLIENTS (sorted)."""
  if num_clients <= DIVERGENCE_CLIENTS:
    return np.arange(num_clients)
  return np.sort(np.random.default_rng(0).choice(
      num_clients, DIVERGENCE_CLIENTS, replace=False))


def client_scores(alg: Algorithm, model, frozen, params, val, ood, bs_val,
                  bs_ood) -> dict:
  """Device scores of the evaluated `params` (one global model, or stacked
  [N, ...] where `alg` is personalized): "id" on the padded id-validation
  arrays `val` ([N, V, ...] x, y, mask), "ood" on the target block `ood`
  (x, y, mask); a None input leaves its key out. Traceable (the engine
  jits it, alone or mapped over replicas)."""
  # One copy of the frozen parameters, merged per model inside the maps.
  apply_fn = lambda p, x: model.apply(with_frozen(frozen, p), x, train=False)
  stacked, shared = (params, None) if alg.server.personalized else (None, params)
  out = {}
  if val is not None:
    vx, vy, vm = val
    out["id"] = evaluate.per_client_scores(apply_fn, stacked, shared, vx, vy, vm,
                                           bs_val)
  if ood is not None:
    ox, oy, om = ood
    if alg.server.personalized:
      out["ood"] = evaluate.models_on_shared_data(apply_fn, params, ox, oy, om,
                                                  bs_ood)
    else:
      out["ood"] = evaluate.scores(apply_fn, params, ox, oy, om, bs_ood)
  return out


def carry_scores(alg: Algorithm, model, carry, frozen, arrays, bs_val,
                 bs_ood) -> dict:
  """`client_scores` of a scan carry (server, client state) with
  `arrays` = (val, ood)."""
  server, clients = carry
  return client_scores(alg, model, frozen,
                       alg.server.eval_params(server, clients), *arrays,
                       bs_val, bs_ood)


def summary(alg: Algorithm, s: dict, details: bool, personal, extras) -> dict:
  """The evaluation's dict from host scores `s` (`client_scores`, on the
  host); `personal()` the evaluated models of `divergence_ids(N)` (weight
  divergence), `extras()` the algorithm's (host values), both read only
  with `details`. A client without id-validation examples is None in
  id_acc_per_client and left out of id_acc (the mean over clients)."""
  out = {}
  if "id" in s:
    count = np.asarray(s["id"].count)
    id_acc = np.asarray(s["id"].correct) / np.maximum(count, 1)
    out.update(id_acc=float(np.mean(id_acc[count > 0])),
               id_acc_per_client=[float(a) if c > 0 else None
                                  for a, c in zip(id_acc, count)])
  if "ood" in s:
    ood_acc = np.atleast_1d(s["ood"].correct / np.maximum(s["ood"].count, 1))
    out.update(ood_acc=float(np.mean(ood_acc)), ood_acc_per_client=ood_acc.tolist())
  if details:  # calibration over all clients' predictions, divergence, extras
    bins = lambda b: np.asarray(b).reshape(-1, *np.asarray(b).shape[-2:]).sum(0)
    out["calibration"] = {k: evaluate.calibration_summary(bins(v.bins))
                          for k, v in s.items()}
    if alg.server.personalized:
      out["weight_divergence"] = evaluate.weight_divergence(personal())
    out["extras"] = jax.tree.map(lambda a: np.asarray(a).tolist(), extras())
  return out


def make_eval(recipe: Recipe, eval_batch_size: int):
  """Returns (eval, eval_blocks), each -> dict of host floats/lists
  (`summary`), of the algorithm and model `recipe.make(values)`.

  eval(carry, frozen, val, ood, details=False, values=None): every client
  at once (the "device" placement; `val` the padded [N, V, ...] arrays).
  eval_blocks((server, host client state), frozen, EvalBlocks, ood,
  details=False, values=None): the same numbers, clients a block at a time
  (the "host" placement: no [N, ...] device array). `val` / `ood` None:
  that evaluation is skipped and its keys are absent.
  """
  alg, make = recipe.alg, recipe.make
  eval_params = jax.jit(lambda server, clients, values:
                        make(values)[0].server.eval_params(server, clients))
  eval_rows = jax.jit(lambda server, rows, ids, values:
                      make(values)[0].eval_rows(server, rows, ids))
  scores = jax.jit(lambda carry, frozen, arrays, values, bs_val, bs_ood:
                   carry_scores(*make(values), carry, frozen, arrays, bs_val,
                                bs_ood), static_argnums=(4, 5))

  @functools.partial(jax.jit, static_argnums=(6, 7))
  def block_scores(server, rows, ids, frozen, arrays, values, bs_val, bs_ood):
    alg_, model = make(values)
    params = (alg_.eval_rows(server, rows, ids) if alg_.server.personalized
              else alg_.server.eval_params(server, None))
    return client_scores(alg_, model, frozen, params, *arrays, bs_val, bs_ood)

  batch = lambda arrays, axis: (None if arrays is None else
                                min(eval_batch_size, arrays[0].shape[axis]))

  def over_blocks(score, val, ood):
    """score(val, ood block, ood batch) -> host scores, over every block of
    `ood` (an `OodSet`, or None): val scored with the first, the blocks' "ood"
    scores added up."""
    blocks = iter(ood) if ood is not None else iter(())
    bs_ood = None if ood is None else ood.batch
    s = score(val, next(blocks, None), bs_ood)
    for block in blocks:
      s["ood"] = jax.tree.map(np.add, s["ood"], score(None, block, bs_ood)["ood"])
    return s

  extras = jax.jit(lambda server, clients, values:
                   make(values)[0].server.extras(server, clients))

  def extras_of(server, clients, values):
    return lambda: jax.device_get(extras(server, clients, values))

  def run_eval(carry, frozen, val, ood, details=False, values=None):
    s = over_blocks(lambda v, o, bs: jax.device_get(scores(
        carry, frozen, (v, o), values, batch(v, 1), bs)), val, ood)
    server, clients = carry

    def personal():
      models = jax.device_get(eval_params(server, clients, values))
      pick = divergence_ids(jax.tree.leaves(models)[0].shape[0])
      return jax.tree.map(lambda a: a[pick], models)

    return summary(alg, s, details, personal,
                   extras_of(server, clients, values))

  def blocks_of(num_clients, size):
    """The ids of each block, the last padded to `size` with the last id."""
    for start in range(0, num_clients, size):
      yield np.minimum(np.arange(start, start + size), num_clients - 1)

  def run_eval_blocks(state, frozen, blocks: EvalBlocks, ood, details=False,
                      values=None):
    server, clients = state
    per_client_ood = ood if alg.server.personalized else None
    parts = []
    if blocks.val is not None or per_client_ood is not None:
      for ids in blocks_of(blocks.num_clients, blocks.size):
        val = (None if blocks.val is None else tuple(map(jnp.asarray, pad_clients(
            blocks.val.gather(ids), blocks.multiple))))
        rows = jax.device_put(take_rows(clients, ids))
        parts.append(over_blocks(lambda v, o, bs: jax.device_get(block_scores(
            server, rows, jnp.asarray(ids), frozen, (v, o), values,
            batch(v, 1), bs)), val, per_client_ood))
    n = blocks.num_clients
    s = jax.tree.map(lambda *a: np.concatenate(a)[:n], *parts) if parts else {}
    if ood is not None and not alg.server.personalized:
      s["ood"] = over_blocks(lambda v, o, bs: jax.device_get(scores(
          (server, None), frozen, (v, o), values, None, bs)), None, ood)["ood"]

    def personal():
      pick = divergence_ids(n)
      got = [jax.device_get(eval_rows(server, jax.device_put(
          take_rows(clients, pick[ids])), jnp.asarray(pick[ids]), values))
             for ids in blocks_of(len(pick), blocks.size)]
      return jax.tree.map(lambda *a: np.concatenate(a)[:len(pick)], *got)

    return summary(alg, s, details, personal,
                   extras_of(server, clients, values))

  return run_eval, run_eval_blocks


def feature_pick(data, cfg: EngineConfig):
  """(x, y, n, batch) of the `cfg.features_max` target examples whose
  features a run keeps (a seeded pick, padded to a multiple of the batch),
  or None: none asked for, or no target split."""
  tx, ty = data.target_x, np.asarray(data.target_y)  # tx: read at `pick`
  if cfg.features_max == 0 or tx.shape[0] == 0:
    return None
  n = min(cfg.features_max, tx.shape[0])
  pick = np.sort(np.random.default_rng(cfg.seed).choice(tx.shape[0], n,
                                                        replace=False))
  batch = eval_batch(cfg, n)
  x, y, _ = evaluate.pad_to_multiple(tx[pick], ty[pick], batch)
  return x, y, n, batch


def features_of(alg: Algorithm, model, carry, frozen, x, batch: int):
  """[n, F] features of examples `x` ([n, ...], n a multiple of `batch`)
  under the evaluated (global) model of `carry`. Traceable."""
  server, clients = carry
  params = with_frozen(frozen, alg.server.eval_params(server, clients))
  xb = x.reshape((-1, batch) + x.shape[1:])
  return jax.lax.map(lambda b: model.features(params, b), xb).reshape(
      x.shape[0], -1)


def target_features(recipe: Recipe, carry, frozen, data, cfg: EngineConfig,
                    values=None) -> dict | None:
  """Features of up to `cfg.features_max` target examples (a seeded pick) under
  the evaluated model: `RunResult.features` (None for a personalized
  algorithm: one model per client)."""
  picked = (None if recipe.alg.server.personalized
            else feature_pick(data, cfg))
  if picked is None:
    return None
  x, y, n, batch = picked
  feats = np.asarray(_features(recipe, carry, frozen, jnp.asarray(x), values,
                               batch))[:n]
  return dict(features=feats.astype(np.float32), labels=np.asarray(y[:n]))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _features(recipe, carry, frozen, x, values, batch):
  return features_of(*recipe.make(values), carry, frozen, x, batch)
