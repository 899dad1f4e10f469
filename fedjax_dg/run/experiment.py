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

import contextlib
import dataclasses
import os
import shutil
import time
from typing import Callable

import jax
import numpy as np

from fedjax_dg import algorithms, distributed, engine, errors, models
from fedjax_dg.errors import (ConfigError, DiskFull, Stopped,
                              is_disk_full)
from fedjax_dg.report import metrics_log, records
from fedjax_dg.run import assemble, batches, checks, directory, provenance
from fedjax_dg.run.config import ConfigDict


@dataclasses.dataclass
class OpenRun:
  """A run directory opened for a config (`open_run`): every check passed,
  the directory written, the runs it already holds read back. `run` trains
  its runs one after another; a sweep's replica batches (`run.batches`)
  train runs of several open directories together and `record` each."""
  cfg: ConfigDict
  dataset: object
  targets: list
  feds: list
  ecfg: engine.EngineConfig
  run_dir: str
  results: dict
  done: set           # (algorithm, target) runs finished
  echo: Callable
  resume: bool
  log: object = dataclasses.field(default_factory=metrics_log.NoLog)
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  before: float = 0.0   # results.json's seconds when this part began
  # A sweep's replica batches (`run.batches`) train several cells in turn:
  # their wall time shared evenly among each batch's runs, charged to their
  # cells. None: this part's wall clock since the directory was opened.
  charged: float | None = None
  _models: dict = dataclasses.field(default_factory=dict)

  @property
  def main(self) -> bool:
    return distributed.is_main()

  def model(self, i: int):
    """The model of target `i`: one for every target (one compiled program
    for all of them) unless data.normalization='train'."""
    key = i if self.cfg.data.normalization == "train" else 0
    if key not in self._models:
      fed = self.feds[i]
      self._models[key] = assemble.make_model(
          self.cfg, fed, *assemble.normalization(self.cfg, self.dataset, fed))
    return self._models[key]

  def pending(self) -> list[tuple[int, str]]:
    """(target index, algorithm) of every run not finished yet, in order
    (a run stopped as non-finite is a result: not trained again)."""
    return [(i, name) for i, target in enumerate(self.targets)
            for name in self.cfg.algorithms
            if (name, str(target)) not in self.done
            and (name, str(target)) not in self.stopped()]

  def stopped(self) -> dict[tuple[str, str], str]:
    """{(algorithm, target): why} of the runs stopped as non-finite
    (results.json's `stopped`): deterministic, so a resume would repeat
    them; their settings must change."""
    return {(r["algorithm"], r["target"]): r["error"]
            for r in self.results.get("stopped", [])}

  def record_stopped(self, name: str, i: int, error: Exception) -> None:
    """Run `name` on target `i` went non-finite: said at once, kept in
    results.json's `stopped` (written) with its reason."""
    target = str(self.targets[i])
    if (name, target) not in self.stopped():
      self.results.setdefault("stopped", []).append(
          dict(algorithm=name, target=target, error=str(error)))
    self.write()

  def finished(self) -> list[tuple[int, str]]:
    """(target index, algorithm) of every run finished before."""
    return [(i, name) for i, target in enumerate(self.targets)
            for name in self.cfg.algorithms
            if (name, str(target)) in self.done]

  def checkpoint_dir(self, name: str, target) -> str:
    return os.path.join(self.run_dir, "checkpoints", f"{name}--{target}")

  def note(self, said: list[str]) -> None:
    """Stand-in warnings (already echoed) into results.json's `warnings`."""
    self.results["warnings"] += [w for w in said
                                 if w not in self.results["warnings"]]

  def write(self) -> None:
    """results.json, its `seconds` counting every part up to now (an
    interrupted run and its resumes; `seconds_this_part`: this call's, the
    time `charged` in a sweep's batches)."""
    self.results["seconds_this_part"] = (
        time.perf_counter() - self.t0 if self.charged is None else self.charged)
    self.results["seconds"] = self.before + self.results["seconds_this_part"]
    if self.main:
      directory.write_results(self.run_dir, self.results)

  def record(self, name: str, i: int, res: engine.RunResult,
             replicas: int = 1) -> None:
    """A finished run of algorithm `name` on target `i`: its log lines,
    features and diagnostics, its entry in results.json (written);
    `replicas`: the size of the batch it ran in (1: alone)."""
    target, fed = self.targets[i], self.feds[i]
    self.log.sync(name, target, res.history)
    distributed.barrier("fedjax_dg: checkpoints closed")
    if self.main and not self.cfg.train.keep_checkpoints:
      shutil.rmtree(self.checkpoint_dir(name, target), ignore_errors=True)
    if self.main and res.features is not None:
      directory.save_features(self.run_dir, name, target, res.features)
    warnings_ = algorithms.spec(name).diagnose(res.round_metrics)
    for w in warnings_:
      self.echo(f"WARNING ({target}): {w}")
    self.results["runs"].append(dict(
        algorithm=name, target=str(target), seconds=res.seconds,
        source=self.results["source"],   # the code it ran at: `provenance`
        warnings=warnings_, server_examples=fed.server_size,
        diverged=records.diverged(res.history, fed.num_classes),
        **({"replicas": replicas} if replicas > 1 else {}),
        final=res.final, history=res.history,
        round_metrics={k: v for k, v in res.round_metrics.items()
                       if k != "cohort"}))
    self.done.add((name, str(target)))
    self.write()

  @contextlib.contextmanager
  def guard(self):
    """Errors inside said as `run` says them: Ctrl-C -> `Stopped` (which
    directory `--resume` continues), a full disk -> `DiskFull`; a directory
    this call made is removed again when it holds nothing to continue."""
    try:
      yield
    except KeyboardInterrupt as e:
      raise Stopped(self.run_dir) from e
    except DiskFull as e:  # the checkpointer's: names its folder
      e.run_dir = self.run_dir
      raise
    except Exception as e:
      if is_disk_full(e):  # results.json, metrics, features: one message
        raise DiskFull(
            f"writing into {self.run_dir} failed: no space left on device "
            f"({type(e).__name__}). Free space on that disk",
            self.run_dir) from None
      if self.main and not self.resume:
        self.log.close()
        directory.remove_if_empty(self.run_dir, self.echo)
      raise


def _auto_dtype_line(run_dir: str, resume: bool) -> str:
  """What `model.dtype="auto"` resolved to here, as the run prints it; a
  ConfigError when resuming a run it began as another dtype (begun on a
  backend where "auto" means another one)."""
  here = jax.default_backend()
  dtype, why = models.layers.auto_dtype(here)
  before = None
  if resume:
    before = (directory.read_started(run_dir)[1] or {}).get("backend")
  if before and models.layers.auto_dtype(before)[0] != dtype:
    raise ConfigError(
        f"--resume {run_dir}: model.dtype='auto' began as "
        f"{models.layers.auto_dtype(before)[0]} on {before} and would go on "
        f"as {dtype} on {here}: resume on a {before} backend, or start a new "
        "run")
  return f"model.dtype=auto: {dtype} ({why})"


def open_run(cfg: ConfigDict, run_dir: str | None = None, *,
             resume: bool = False, echo=print, dataset=None) -> OpenRun:
  """Checks `cfg` (data, federations, engine settings) and opens its run
  directory (`run_dir`, continued if it holds a run with the same settings
  and data, else a new one under `cfg.output_dir`). `dataset`: `cfg`'s
  dataset, already loaded (a sweep's cells share them)."""
  cfg = assemble.resolve(cfg)
  checks.validate(cfg)
  if run_dir is None:
    directory.check_output_dir(cfg.output_dir)
  # Data, federations and engine settings are all checked before a run directory
  # is created or anything is computed.
  dataset = dataset or assemble.load_dataset(cfg)
  targets = assemble.target_domains(cfg, dataset.domain_names)
  feds, said = [], []
  for target in targets:
    fed, w = batches.stand_ins(lambda t=target: assemble.federate(cfg, dataset, t),
                       f"target {target}")
    feds.append(fed)
    said += w
  ecfg = assemble.engine_config(cfg)
  for fed in feds:
    ecfg.validate(fed.num_clients)

  data = provenance.data_of(dataset)
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
  record = provenance.record(data)  # code, data and machine: results.json
  resumed = (provenance.resume_warnings(*directory.read_started(run_dir), record)
             if resume else [])
  for line in resumed:
    echo(f"WARNING: {line}")
  if cfg.model.dtype == "auto":
    echo(_auto_dtype_line(run_dir, resume))
  results = dict(name=cfg.name, run_dir=run_dir, dataset=dataset.name,
                 domains=list(dataset.domain_names), targets=[str(t) for t in targets],
                 algorithms=list(cfg.algorithms), **record, runs=[],
                 warnings=[], seconds=0.0)
  opened = OpenRun(cfg, dataset, targets, feds, ecfg, run_dir, results, set(),
                   echo, resume)
  with opened.guard():
    try:
      if main:
        directory.write_start(run_dir, cfg, record)
      if resume and os.path.exists(os.path.join(run_dir, "results.json")):
        before = directory.read_json(os.path.join(run_dir, "results.json"),
                                     directory.REDO_RESULTS)
        results["runs"] = before["runs"]
        results["stopped"] = list(before.get("stopped", []))
        results["warnings"] = list(before.get("warnings", []))
        results["seconds"] = opened.before = float(before.get("seconds") or 0.0)
      for line in said:
        echo(f"WARNING: {line}")
      opened.note(said + resumed)
      opened.done = {(r["algorithm"], r["target"]) for r in results["runs"]}
      echo(f"run directory: {run_dir}" + (" (resuming)" if resume else ""))
      opened.log = metrics_log.RunLog(run_dir) if main else metrics_log.NoLog()
      for r in results["runs"]:  # kept from results.json: their lines as well
        opened.log.sync(r["algorithm"], r["target"], r["history"])
    except BaseException:
      opened.log.close()
      raise
  return opened


def run(cfg: ConfigDict, run_dir: str | None = None, *, resume: bool = False,
        echo=print, replicas: int = 1, mapping: str = "auto") -> dict:
  """Runs every (target domain, algorithm) of `cfg`; returns the results dict.

  The runs are trained as a sweep's are (`batches`): runs of one algorithm
  that share a program go `replicas` at a time (1: one after another; 0: as
  many as fit in memory; `mapping`: how a batch's replicas are mapped).
  `run_dir` (a sweep's cell, or `resume`: an earlier run to continue) is
  continued if it holds a run: only with the same settings and data. A run
  directory this call made is removed again when the run fails before
  leaving anything to continue (no finished run, no checkpoint). A run that
  failed (went non-finite, or raised) does not stop the others; the first
  failure is raised once they have all ended, every finished run recorded.
  """
  opened = open_run(cfg, run_dir, resume=resume, echo=echo)
  with opened.guard():
    try:
      _run_all(opened, replicas, mapping)
    finally:  # a stopped run keeps its metrics up to its last evaluation
      opened.log.close()
  return opened.results


def _run_all(opened: OpenRun, replicas: int = 1, mapping: str = "auto"
             ) -> None:
  """`run`'s runs in batches, after every check and with the run directory
  made; results.json after each run, at the end and at Ctrl-C (a killed
  process loses the time since its last write; each run's own `seconds`
  also counts its parts, up to its last checkpoint: `engine.run_batch`)."""
  failed: list = []
  try:
    for i in range(len(opened.targets)):
      opened.echo(describe_target(opened, i))
    for i, name in opened.finished():
      opened.echo(f"{name} / {opened.targets[i]}: already finished, kept "
                  "from results.json")
    planned, built = batches.plan([opened], replicas)
    batches.run(planned, built, [opened], echo=opened.echo, mapping=mapping,
                on_cell_done=lambda c, errors: failed.extend(errors))
  except KeyboardInterrupt:  # the time so far counts in the total
    opened.write()
    raise
  opened.write()
  if failed:
    raise failed[0][1]
  for (name, target), why in opened.stopped().items():  # earlier parts'
    raise errors.NonFiniteError(
        f"{why} (kept from results.json: a resume repeats a non-finite run; "
        "change its settings in a new run directory)")


def describe_target(opened: OpenRun, i: int) -> str:
  """One line: target `i`'s clients, their domains and examples."""
  fed = opened.feds[i]
  holding = " | ".join("+".join(str(d) for d in c)
                       for c in fed.client_domains[:12])
  return (f"target {opened.targets[i]}: {fed.num_clients} clients (domains "
          f"{holding}{' | ...' if fed.num_clients > 12 else ''}), "
          f"{int(np.sum(fed.packed_train.n))} training examples"
          + (f", server split {fed.server_size}" if fed.server_size else ""))
