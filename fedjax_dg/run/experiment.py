"""Runs a config: algorithms x held-out target domains, one engine run each.

Results go to a fresh run directory (never an earlier run's): `results.json`
(config, per-run history, final metrics), `metrics.jsonl` and TensorBoard event
files under `tb/` (written at every evaluation: `metrics_log`), `table.md`,
learning-curve PNGs and orbax checkpoints (so `fedjax-dg run --resume DIR`
continues an interrupted run). The pieces come from `assemble` (the config
resolved), `checks` (before anything is computed), `directory` (the files of
a run directory) and `disk` (the checkpoints' disk).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import numpy as np

from fedjax_dg import algorithms, distributed, engine
from fedjax_dg.errors import (ConfigError, DiskFull, StandInWarning, Stopped,
                              is_disk_full)
from fedjax_dg.report import metrics_log
from fedjax_dg.run import assemble, checks, directory, disk
from fedjax_dg.run.config import ConfigDict


def stand_ins(call, where: str, echo=None):
  """(call(), the `StandInWarning`s it raised as "where: message" strings):
  what `run` records in results.json's `warnings`. Each is also echoed
  (`echo`), never only a stderr line."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", StandInWarning)
    out = call()
  said = []
  for w in caught:
    if issubclass(w.category, StandInWarning):
      text = str(w.message)
      said.append(text if text.startswith(f"{where}:") else f"{where}: {text}")
    else:  # another warning: as it would have been shown
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  for line in said:
    if echo is not None:
      echo(f"WARNING: {line}")
  return out, said


def run(cfg: ConfigDict, run_dir: str | None = None, *, resume: bool = False,
        echo=print) -> dict:
  """Runs every (target domain, algorithm) of `cfg`; returns the results dict.

  `run_dir` (a sweep's cell, or `resume`: an earlier run to continue) is
  continued if it holds a run: only with the same settings and data. A run
  directory this call made is removed again when the run fails before
  leaving anything to continue (no finished run, no checkpoint).
  """
  cfg = assemble.resolve(cfg)
  checks.validate(cfg)
  if run_dir is None:
    directory.check_output_dir(cfg.output_dir)
  # Data, federations and engine settings are all checked before a run directory
  # is created or anything is computed.
  dataset = assemble.load_dataset(cfg)
  targets = assemble.target_domains(cfg, dataset.domain_names)
  feds, said = [], []
  for target in targets:
    fed, w = stand_ins(lambda t=target: assemble.federate(cfg, dataset, t),
                       f"target {target}")
    feds.append(fed)
    said += w
  ecfg = assemble.engine_config(cfg)
  for fed in feds:
    ecfg.validate(fed.num_clients)

  data = dict(dataset=dataset.name, images=int(len(dataset.images)),
              fingerprint=dataset.fingerprint())
  if resume and not os.path.isdir(run_dir or ""):
    raise ConfigError(f"--resume {run_dir}: no such run directory")
  resume = run_dir is not None and (
      resume or os.path.exists(os.path.join(run_dir, "config.json")))
  if resume:
    directory.check_resume(cfg, run_dir, data)
  # Several processes: process 0 names a new directory and alone writes the run
  # directory (checkpoints: every process, through orbax); every process has
  # read the directory before process 0 writes (the broadcast waits for all).
  main = distributed.is_main()
  echo = distributed.main_only(echo)
  run_dir = distributed.same_everywhere(
      run_dir or (directory.make_run_dir(cfg.output_dir, cfg.name) if main else ""))
  env, env_path = directory.environment(), os.path.join(run_dir, "environment.json")
  if resume and os.path.exists(env_path):
    with open(env_path) as f:
      warning = directory.environment_changes(json.load(f), env)
    if warning:
      echo(f"WARNING: {warning}")
  results = dict(name=cfg.name, run_dir=run_dir, dataset=dataset.name,
                 domains=list(dataset.domain_names), targets=[str(t) for t in targets],
                 algorithms=list(cfg.algorithms), environment=env, runs=[],
                 warnings=[], seconds=0.0)
  log = metrics_log.NoLog()
  try:
    if main:
      directory.write_start(run_dir, cfg, data, env, env_path)
    if resume and os.path.exists(os.path.join(run_dir, "results.json")):
      with open(os.path.join(run_dir, "results.json")) as f:
        before = json.load(f)
      results["runs"] = before["runs"]
      results["warnings"] = list(before.get("warnings", []))
      results["seconds"] = float(before.get("seconds") or 0.0)
    for line in said:
      echo(f"WARNING: {line}")
      if line not in results["warnings"]:
        results["warnings"].append(line)
    done = {(r["algorithm"], r["target"]) for r in results["runs"]}
    echo(f"run directory: {run_dir}" + (" (resuming)" if resume else ""))
    log = metrics_log.RunLog(run_dir) if main else metrics_log.NoLog()
    for r in results["runs"]:  # kept from results.json: their lines as well
      log.sync(r["algorithm"], r["target"], r["history"])
    _run_all(cfg, dataset, targets, feds, ecfg, run_dir, results, done, log,
             echo)
  except KeyboardInterrupt as e:  # says which directory --resume continues
    raise Stopped(run_dir) from e
  except DiskFull as e:  # the checkpointer's: names its folder
    e.run_dir = run_dir
    raise
  except Exception as e:
    if is_disk_full(e):  # results.json, metrics, features: one message
      raise DiskFull(
          f"writing into {run_dir} failed: no space left on device "
          f"({type(e).__name__}). Free space on that disk", run_dir) from None
    if main and not resume:
      log.close()
      directory.remove_if_empty(run_dir, echo)
    raise
  finally:  # a stopped run keeps its metrics up to its last evaluation
    log.close()
  return results


def _run_all(cfg, dataset, targets, feds, ecfg, run_dir, results, done, log,
             echo) -> None:
  """`run`'s loop over (target, algorithm), after every check and with the run
  directory made; fills `results` and writes results.json after each run.

  results.json's `seconds` is the wall time of every part of the run (an
  interrupted run and its resumes), `seconds_this_part` that of this call
  alone. Each part counts up to its last write of results.json: after every
  finished run, at the end and at Ctrl-C (a killed process loses the time
  since its last write; each run's own `seconds` also counts its parts, up
  to its last checkpoint: `engine.run`)."""
  t0, before = time.perf_counter(), results["seconds"]
  main = distributed.is_main()

  def write():
    results["seconds_this_part"] = time.perf_counter() - t0
    results["seconds"] = before + results["seconds_this_part"]
    if main:
      directory.write_results(run_dir, results)

  try:
    _run_each(cfg, dataset, targets, feds, ecfg, run_dir, results, done, log,
              echo, write)
  except KeyboardInterrupt:  # the time so far counts in the total
    write()
    raise
  write()


def _run_each(cfg, dataset, targets, feds, ecfg, run_dir, results, done, log,
              echo, write) -> None:
  """`_run_all`'s loop; `write()` after each finished run."""
  main = distributed.is_main()
  # One model and one Algorithm object per client count: runs with equal shapes
  # (other target domains, seeds) reuse the same traced and compiled programs.
  model, built = None, {}
  for i, (target, fed) in enumerate(zip(targets, feds)):
    if model is None:
      model = assemble.make_model(cfg, fed, *assemble.normalization(cfg, dataset, fed))
    elif cfg.data.normalization == "train":
      model = assemble.make_model(cfg, fed, fed.mean, fed.std)
    holding = " | ".join("+".join(str(d) for d in c)
                         for c in fed.client_domains[:12])
    echo(f"target {target}: {fed.num_clients} clients (domains {holding}"
         f"{' | ...' if fed.num_clients > 12 else ''}), "
         f"{int(np.sum(fed.packed_train.n))} training examples"
         + (f", server split {fed.server_size}" if fed.server_size else ""))
    for name in cfg.algorithms:
      if (name, str(target)) in done:
        echo(f"{name} / {target}: already finished, kept from results.json")
        continue
      key = (name, fed.num_clients, model,
             id(fed) if assemble.uses_data(name, cfg) else None)
      if key not in built:
        built[key], said = stand_ins(
            lambda: assemble.algorithm(name, model, fed.num_clients, cfg,
                                       data=fed), name, echo)
        results["warnings"] += [w for w in said if w not in results["warnings"]]
        # Finished runs keep their checkpoints (keep_checkpoints): every run
        # of this algorithm still to do adds its own.
        later = [t for t in targets[i:] if (name, str(t)) not in done]
        disk.check_disk(name, built[key], run_dir, echo,
                   keep=ecfg.checkpoints_to_keep,
                   runs=len(later) if cfg.train.keep_checkpoints else 1)
      alg = built[key]
      ckpt = os.path.join(run_dir, "checkpoints", f"{name}--{target}")
      res = engine.run(alg, fed, model, ecfg, checkpoint_dir=ckpt,
                       on_eval=log.callback(name, target))
      log.sync(name, target, res.history)
      distributed.barrier("fedjax_dg: checkpoints closed")
      if main and not cfg.train.keep_checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
      if main and res.features is not None:
        directory.save_features(run_dir, name, target, res.features)
      warnings_ = algorithms.spec(name).diagnose(res.round_metrics)
      for w in warnings_:
        echo(f"WARNING ({target}): {w}")
      results["runs"].append(dict(
          algorithm=name, target=str(target), seconds=res.seconds,
          warnings=warnings_,
          server_examples=fed.server_size,
          final=res.final, history=res.history,
          round_metrics={k: v for k, v in res.round_metrics.items()
                         if k != "cohort"}))
      write()


