"""A whole run (`run`): chunks of `eval_every` rounds, each one jitted
`lax.scan` (`programs`), and between chunks (only there) the host's work:
the NaN guard (`check_finite`), evaluation, logging, the progress bar and an
orbax checkpoint (`checkpoint`). A run resumes from its latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.engine.checkpoint import Checkpointer
from fedjax_dg.engine.evaluation import ood_sets, target_features
from fedjax_dg.engine.layout import resolve_lanes
from fedjax_dg.engine.placement import (DeviceStore, HostStore, resolve_gather,
                                        resolve_placement)
from fedjax_dg.engine.programs import programs
from fedjax_dg.engine.settings import EngineConfig, RunResult
from fedjax_dg.errors import NonFiniteError


@jax.jit
def _finite_leaves(tree_) -> jax.Array:
  """[leaves] bool: every value of the leaf is finite (integer leaves are)."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                    else jnp.bool_(True) for x in jax.tree.leaves(tree_)])


LIKELY_CAUSES = ("a learning rate too large for the model (client.lr, the "
                 "algorithm's server_lr), a temperature of 0, or an input whose "
                 "normalization divides by ~0")


def check_finite(name: str, r0: int, metrics: dict[str, list], carry,
                 last_good: int | None, checkpoint_dir: str | None) -> None:
  """Stops a run whose chunk from round `r0` went non-finite (NonFiniteError):
  the first round whose training loss or a round metric is NaN / inf, or the
  server / client state leaf that is."""
  bad = []
  for key, values in metrics.items():
    arr = np.asarray(values, np.float64)
    rows = ~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1)
    if rows.any():
      label = "training loss" if key == "loss" else f"round metric {key!r}"
      bad.append((r0 + int(np.argmax(rows)), label))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(carry)[0]]
  finite = np.asarray(_finite_leaves(carry)) if paths else np.ones(0, bool)
  where = ("server state", "client state")
  for path, ok in zip(paths, finite):
    if not ok:
      part = where[int(path.startswith("[1]"))]
      bad.append((r0 + len(metrics.get("loss", [0])) - 1,
                  f"{part} {path[3:] or '(whole)'}"))
      break
  if not bad:
    return
  round_, what = min(bad)
  kept = (f" The last good checkpoint (round {last_good}) is kept in "
          f"{checkpoint_dir}." if last_good is not None else "")
  raise NonFiniteError(
      f"{name}: the {what} went non-finite (NaN / inf) by round {round_}; the run "
      f"is stopped.{kept} Likely: {LIKELY_CAUSES}.")


def metrics_to_host(metrics: dict) -> dict[str, list]:
  """A chunk's round metrics as host lists."""
  return {k: np.asarray(v).tolist() for k, v in metrics.items()}


def run(alg: Algorithm, data, model, cfg: EngineConfig, *,
        checkpoint_dir: str | None = None,
        on_eval: Callable[[dict], None] | None = None) -> RunResult:
  """Runs `cfg.rounds` rounds of `alg` on `data` (a FederatedData).

  With `checkpoint_dir`, a checkpoint is written after every chunk (the latest
  `cfg.checkpoints_to_keep` stay) and the latest existing one is resumed from
  (same final parameters as an uninterrupted run).
  `cfg.placement` says where client data and state live
  (`placement.DeviceStore`, `placement.HostStore`); both give the same
  numbers.
  """
  train = data.pooled().packed_train if alg.client.pooled else data.packed_train
  if alg.client.pooled:  # one pooled "client" trains every round
    cfg = dataclasses.replace(cfg, cohort_size=0)
  num_clients = train.num_clients
  cfg.validate(num_clients)
  cfg = resolve_lanes(cfg, alg, train.n)
  placement = resolve_placement(cfg.placement, alg, train, data.packed_val)
  cfg = resolve_gather(cfg, alg, placement, train.width)
  model = alg.model or model
  root_key = jax.random.key(cfg.seed)
  progs = programs(alg, model, cfg, num_clients)
  run_chunk = progs.chunk
  ood_full, ood_sub = ood_sets(data, cfg)

  init_key = jax.random.fold_in(root_key, 2**31 - 1)
  frozen = progs.frozen(init_key)
  history: list[dict] = []
  round_metrics: dict[str, list] = {}
  r0 = 0
  ckpt = (Checkpointer(checkpoint_dir, cfg.checkpoints_to_keep)
          if checkpoint_dir else None)
  restored = None
  spent = 0.0  # seconds of the parts before a resume (the checkpoint's)
  if ckpt is not None and ckpt.latest() is not None:
    like = jax.eval_shape(alg.init, init_key)
    restored, meta = ckpt.restore(ckpt.latest(), like)
    r0, history, round_metrics = meta["round"], meta["history"], meta["round_metrics"]
    spent = float(meta.get("seconds", 0.0))
  if placement == "host":
    feed = HostStore(progs, train, data.packed_val, cfg, root_key, r0)
  else:
    feed = DeviceStore(progs,
                       data.pooled().train if alg.client.pooled else data.train,
                       data.val, cfg)
  state = feed.initial(init_key) if restored is None else feed.placed(restored)

  bar = progress_bar(cfg, alg.name, r0)
  t0 = time.perf_counter()
  failing = False
  try:
    while r0 < cfg.rounds:
      length = min(cfg.eval_every, cfg.rounds - r0)
      carry, inputs = feed.begin(state, r0, length)
      carry, metrics = run_chunk(carry, jnp.int32(r0), inputs, root_key,
                                 frozen, length, jnp.int32(cfg.rounds))
      feed.prefetch(r0 + length, min(cfg.eval_every, cfg.rounds - r0 - length))
      chunk_metrics = metrics_to_host(metrics)
      # Before anything is recorded or saved: the last good checkpoint stays.
      check_finite(alg.name, r0, chunk_metrics, carry,
                   ckpt.latest() if ckpt is not None else None, checkpoint_dir)
      state = feed.end(state, carry)
      r0 += length
      for k, v in chunk_metrics.items():
        round_metrics.setdefault(k, []).extend(v)
      train_loss = float(np.mean(round_metrics["loss"][-length:]))
      entry = dict(round=r0, train_loss=train_loss,
                   **feed.evaluate(state, frozen, ood_sub))
      history.append(entry)
      if on_eval is not None:
        on_eval(entry)
      if bar is not None:
        bar.update(length)
        bar.set_postfix({short: f"{entry[key]:.3f}" for short, key in
                         (("loss", "train_loss"), ("id", "id_acc"),
                          ("ood", "ood_acc")) if key in entry})
      if ckpt is not None:
        ckpt.save(r0, state, dict(round=r0, history=history,
                                  round_metrics=round_metrics,
                                  seconds=spent + time.perf_counter() - t0))
  except BaseException:
    failing = True
    raise
  finally:  # a stopped run still leaves complete checkpoints
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close(failing)
  final = dict(round=r0, **feed.evaluate(state, frozen, ood_full, details=True))
  server, clients = state
  feats = target_features(alg, model,
                          progs.layout.to_one_device(feed.on_device(state)),
                          progs.layout.to_one_device(frozen), data, cfg)
  return RunResult(alg.name, server, clients, history, round_metrics, final,
                   spent + time.perf_counter() - t0, feats)


def progress_bar(cfg: EngineConfig, desc: str, initial: int):
  """A tqdm bar over the run's rounds (None without `cfg.progress`, or
  off process 0)."""
  if not cfg.progress or jax.process_index() != 0:  # one bar: process 0's
    return None
  from tqdm.auto import tqdm
  return tqdm(total=cfg.rounds, initial=initial, desc=desc, unit="round",
              dynamic_ncols=True, leave=True)
