"""Runs a config: algorithms x held-out target domains, one engine run each.

Results go to a fresh run directory (never an earlier run's): `results.json`
(config, per-run history, final metrics), `metrics.jsonl` and TensorBoard event
files under `tb/` (written at every evaluation: `metrics_log`), `table.md`,
learning-curve PNGs and orbax checkpoints (so `fedjax-dg run --resume DIR` continues an interrupted run).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import time
import warnings

import jax
import numpy as np

from fedjax_dg import algorithms, distributed, engine, metrics_log
from fedjax_dg import config as config_lib
from fedjax_dg.config import ConfigDict
from fedjax_dg.errors import (ConfigError, DiskFull, NeedsDataError,
                              StandInWarning, Stopped, is_disk_full)


def check_output_dir(root: str, field: str = "output_dir") -> None:
  """`root` (the config's `field`) can hold a new run directory: its nearest
  existing folder is a folder and writable; else a ConfigError naming the
  field and the path. Checked before any data is read."""
  path = os.path.abspath(root or ".")
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  fix = (f"set {field} to a writable folder" + (
      " (--set output_dir=...)" if field == "output_dir" else ""))
  if not os.path.isdir(probe):
    raise ConfigError(f"{field}={root!r}: {probe!r} is a file, not a folder, "
                      f"so no run directory can be made there: {fix}")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ConfigError(f"{field}={root!r}: {probe!r} is not writable (read-only "
                      f"or another user's): {fix}")


def make_run_dir(root: str, name: str, field: str = "output_dir") -> str:
  """A new directory `<root>/<name>-<timestamp>[-k]`; never reuses an existing
  one. A folder that cannot be made is a ConfigError naming `field` (the
  setting that chose `root`) and the path."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  base = os.path.join(root, f"{name}-{stamp}")
  path, k = base, 1
  while True:
    try:
      os.makedirs(path)
      return path
    except FileExistsError:
      if not os.path.isdir(path):
        check_output_dir(root, field)
      k += 1
      path = f"{base}-{k}"
    except OSError as e:
      if is_disk_full(e):
        raise DiskFull(f"cannot create the run directory {path!r}: the disk "
                       f"is full; free space or set {field} to another disk"
                       ) from None
      check_output_dir(root, field)  # names a file or read-only folder
      raise ConfigError(f"{field}={root!r}: cannot create the run directory "
                        f"{path!r} ({type(e).__name__}: {e}): set {field} to a "
                        "writable folder") from None


def engine_config(cfg: ConfigDict) -> engine.EngineConfig:
  train = {k: v for k, v in cfg.train.items() if k != "keep_checkpoints"}
  return engine.EngineConfig(seed=cfg.seed, **train)


def resolve(cfg: ConfigDict) -> ConfigDict:
  """A copy of `cfg` with its presets expanded (`scenario`, HyperGenFL Table 1)."""
  from fedjax_dg import presets
  cfg = cfg.copy_and_resolve_references()
  presets.resolve_scenario(cfg)
  return cfg


def validate(cfg: ConfigDict) -> None:
  """Checks settings that need no data, before any compute."""
  from fedjax_dg.data import lookup, registry, streamed
  from fedjax_dg import models
  cfg = resolve(cfg)
  algs = tuple(cfg.algorithms)
  if not algs:
    raise ConfigError("algorithms is empty: name at least one of "
                     f"{algorithms.available()}")
  for a in algs:
    if a not in algorithms.available():
      raise ConfigError(f"unknown algorithm {a!r} in algorithms; allowed: "
                       f"{algorithms.available()}")
  known = registry.available(cfg.data.data_dir or None)
  if not cfg.data.name:
    raise ConfigError(f"data.name is not set: name a dataset, one of {known}, "
                      "e.g. the NAME of your `fedjax-dg prepare folder "
                      "--manual-dir DIR --name NAME` (--set data.name=NAME)")
  if cfg.data.name not in known:
    raise ConfigError(f"unknown dataset data.name={cfg.data.name!r}; allowed: "
                      f"{known}. "
                      + lookup.where_to_find(cfg.data.name,
                                             cfg.data.data_dir or None))
  size = cfg.data.image_size
  if not isinstance(size, int) or isinstance(size, bool) or size < 1:
    raise ConfigError(
        f"data.image_size={size!r}: must be a positive side in "
        "pixels (every image is resized to image_size x image_size; there is "
        "no native-size setting: give the stored size, e.g. 28 for "
        "Fashion-MNIST)")
  if cfg.model.name not in models.available():
    raise ConfigError(f"unknown model model.name={cfg.model.name!r}; allowed: "
                     f"{models.available()}")
  models.check_weights(cfg.model.name, cfg.model.weights)
  model_fields(cfg)
  for a in algs:
    runs_on = getattr(algorithms.spec(a).module, "MODELS", None)
    if runs_on and cfg.model.name not in runs_on:
      raise ConfigError(f"{a} runs on model.name one of {runs_on}, not "
                        f"{cfg.model.name!r} (--set model.name={runs_on[-1]})")
  if cfg.data.normalization not in NORMALIZATIONS:
    raise ConfigError(f"data.normalization={cfg.data.normalization!r}: allowed "
                     f"{NORMALIZATIONS}")
  frac = cfg.data.server_fraction
  if not 0 <= frac < 1:
    raise ConfigError(f"data.server_fraction={frac!r}: allowed [0, 1) (the share "
                     "of the source examples held by the server; 0 = none)")
  needy = [a for a in algs if algorithms.needs_server_data(a)]
  if needy and frac == 0:
    raise ConfigError(
        f"{', '.join(needy)} train(s) on the server's split, but "
        "data.server_fraction=0 gives the server none: set data.server_fraction "
        "> 0 (e.g. --set data.server_fraction=0.02, FedLAW's proxy share)")
  if cfg.data.num_clients < 0:
    raise ConfigError(f"data.num_clients={cfg.data.num_clients}: allowed values "
                     "are 0 (one client per source domain) or a positive count")
  engine_config(cfg).validate(cfg.data.num_clients or None)
  if cfg.data.streaming not in streamed.STREAMING:
    raise ConfigError(f"data.streaming={cfg.data.streaming!r}: allowed "
                      f"{streamed.STREAMING} (auto: stream when the images would "
                      f"take more than {streamed.AUTO_STREAM_SHARE:.0%} of the "
                      "host's memory)")
  probes = check_algorithms(cfg)
  if cfg.data.streaming == "on":
    check_streaming(cfg, probes)


def check_algorithms(cfg: ConfigDict) -> dict:
  """Every algorithm's settings (its section, its clients' optimizer) checked
  before any data is read: each is built once on a tiny stand-in model (those
  that derive something from the data stop at it with NeedsDataError, their
  settings checked). Returns {name: the stand-in Algorithm, or None}."""
  from fedjax_dg import models
  probe = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2,
                           hidden=2)
  vit_probe = models.get_model("vit_tiny", input_shape=(4, 4, 1),
                               num_classes=2, patch=2, dim=8, depth=1,
                               heads=1, mlp_dim=8)
  n = cfg.data.num_clients or 4
  built = {}
  for name in cfg.algorithms:
    algorithms.client_optimizer(cfg, name)
    runs_on = getattr(algorithms.spec(name).module, "MODELS", ())
    on_vit = "vit_tiny" in runs_on or cfg.model.name.startswith("vit_")
    try:
      with warnings.catch_warnings():  # said once, by the run's own build
        warnings.simplefilter("ignore", StandInWarning)
        built[name] = algorithms.build(name, vit_probe if on_vit else probe,
                                       n, cfg)
    except NeedsDataError:
      built[name] = None
  return built


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


def check_streaming(cfg: ConfigDict, probes: dict | None = None) -> None:
  """A streamed run (data.streaming: examples read per chunk of rounds,
  never all at once) needs the "host" placement and algorithms that neither
  read every client's examples when built nor pool them (Central): else a
  ConfigError naming each. `probes`: `check_algorithms`' stand-ins."""
  from fedjax_dg.data import streamed
  probes = check_algorithms(cfg) if probes is None else probes
  why = []
  if cfg.train.placement == "device":
    why.append("train.placement='device' holds every client's examples on "
               "the device (use 'host' or 'auto')")
  readers = [a for a in cfg.algorithms if algorithms.reads_client_data(a, cfg)]
  if readers:
    why.append(f"{', '.join(readers)} read(s) every client's examples when "
               "built (style pools, amplitude bank or autoencoder embeddings; "
               "leave them out)")
  pooled = [a for a, alg in probes.items() if alg is not None and alg.pooled]
  if pooled:
    why.append(f"{', '.join(pooled)} train(s) one client holding every "
               "example (leave it out)")
  if why:
    raise ConfigError(
        f"the data are streamed (data.streaming={cfg.data.streaming!r}"
        + (": the images would take more than "
           f"{streamed.AUTO_STREAM_SHARE:.0%} of the host's memory"
           if cfg.data.streaming == "auto" else "") + "), but "
        + "; ".join(why) + ". Or load the data in memory "
        "(data.streaming='off') if they fit")


def target_domains(cfg: ConfigDict, domain_names) -> list:
  from fedjax_dg.data import splits
  spec = cfg.data.targets
  if spec == "all":
    # Datasets whose domains are official splits (fashion_mnist: train / test):
    # "all" means the evaluation split only, never training on the test set.
    split = splits.eval_split(cfg.data.name)
    return [split] if split is not None else list(domain_names)
  if spec in ("none", ""):
    return [None]
  names = [s.strip() for s in str(spec).split(",")]
  for n in names:
    if n not in domain_names:
      raise ConfigError(f"data.targets names unknown domain {n!r}; allowed: "
                       f"{list(domain_names)}, 'all' or 'none'")
  return names


def load_dataset(cfg: ConfigDict):
  """The dataset of `cfg.data`, in memory or streamed (`data.streaming`;
  streamed: `check_streaming`)."""
  from fedjax_dg.data import sources
  d = cfg.data
  dataset = sources.load(d.name, image_size=d.image_size,
                         data_dir=d.data_dir or None,
                         manual_dir=d.manual_dir or None,
                         max_per_domain=d.max_per_domain or None, seed=cfg.seed,
                         streaming=d.streaming)
  if dataset.streamed:
    check_streaming(cfg)
  return dataset


def federate(cfg: ConfigDict, dataset, target):
  """The FederatedData of one held-out `target`; errors name the config fields."""
  from fedjax_dg.data import federated, partition
  d = cfg.data
  n_sources = dataset.num_domains - (target is not None)
  per_domain = partition.ALIASES.get(d.partition, d.partition) == "k_per_domain"
  try:
    spec = partition.PartitionSpec(
        name=d.partition,
        num_clients=d.num_clients or (None if per_domain else n_sources),
        d=d.d,
        k_per_domain=None if (per_domain and d.num_clients) else d.k_per_domain,
        alpha=d.alpha, min_partition_size=d.min_partition_size,
        few_shot_k=d.few_shot_k, seed=cfg.seed)
    return federated.build(dataset, spec, target_domain=target,
                           val_fraction=d.val_fraction, seed=cfg.seed,
                           server_fraction=d.server_fraction)
  except ConfigError as e:
    raise ConfigError(
        f"{e} [config: data.partition={d.partition!r}, data.num_clients="
        f"{d.num_clients} (0 = one per source domain), data.d={d.d}, "
        f"data.k_per_domain={d.k_per_domain}, data.max_per_domain="
        f"{d.max_per_domain}, held-out target {target!r}]") from e


NORMALIZATIONS = ("dataset", "train", "imagenet")
# torchvision's ImageNet input statistics, in [0, 1] units.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalization(cfg: ConfigDict, dataset, fed) -> tuple[tuple, tuple]:
  """Per-channel (mean, std) for the model's input normalization.

  "dataset": statistics of all the dataset's images, the same for every target
  domain and seed (like DomainBed's fixed per-dataset constants; no labels used),
  so every run of an experiment reuses one compiled program. "train": statistics
  of this federation's training images only (recompiles per target domain).
  "imagenet": ImageNet's constants (torchvision's), which ImageNet-pretrained
  weights (`model.weights`) expect; RGB datasets only.
  """
  if cfg.data.normalization == "train":
    return fed.mean, fed.std
  if cfg.data.normalization == "imagenet":
    ch = fed.image_shape[-1]
    if ch != 3:
      raise ConfigError(
          f"data.normalization='imagenet' needs RGB images, but data.name="
          f"{cfg.data.name!r} has {ch} channel(s): use 'dataset' or 'train'")
    return IMAGENET_MEAN, IMAGENET_STD
  return dataset.channel_stats()


def model_fields(cfg: ConfigDict) -> dict:
  """The module fields the config sets (`model.vit.*`, ViTs only: a value
  set for another model is an error, never ignored)."""
  fields = {k: int(v) for k, v in dict(cfg.model.vit).items() if v}
  bad = {k: v for k, v in fields.items() if v < 0}
  if bad:
    raise ConfigError(f"model.vit.{next(iter(bad))}={next(iter(bad.values()))}"
                      ": must be >= 0 (0: the released size's own)")
  if fields and not cfg.model.name.startswith("vit_"):
    raise ConfigError(f"model.vit.{next(iter(fields))} is set but model.name="
                      f"{cfg.model.name!r} is not a ViT: unset it or use "
                      "vit_b16 / vit_tiny")
  return fields


def make_model(cfg: ConfigDict, fed, mean, std):
  from fedjax_dg import models
  return models.get_model(cfg.model.name, input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=mean, std=std,
                          conv_impl=cfg.model.conv_impl,
                          weights=cfg.model.weights,
                          skip_head=cfg.model.skip_head, **model_fields(cfg))


def check_resume(cfg: ConfigDict, run_dir: str, data: dict) -> None:
  """A run directory is continued only with its own settings and data: the
  stored config.json and data.json must equal the requested ones (a
  ConfigError names the differing keys). Nothing is written before this."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"--resume {run_dir}: holds no config.json, so it is not "
                      "a run directory of fedjax-dg run")
  with open(path) as f:
    stored = json.load(f)
  changed = config_lib.drift(stored, json.loads(cfg.to_json()))
  if changed:
    raise ConfigError(
        f"{run_dir} was run with other settings ({'; '.join(changed)}): "
        f"continue it with its own (`fedjax-dg run --resume {run_dir}` alone "
        "reads its config.json), or start a new run for the new settings")
  path = os.path.join(run_dir, "data.json")
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
    if before != data:
      raise ConfigError(
          f"{run_dir} was run on other data ({before} -> {data}): the dataset "
          "changed since (another prepare, data_dir or manual_dir); start a "
          "new run")


def environment() -> dict:
  """What a run's numbers depend on beyond its config and data: the float
  summation order changes with the JAX version, the backend and the
  devices the cohort is sharded over (HyperGenFL's by up to ~1e-2,
  docs/faithfulness.md; the others' by ~1e-5). Written to
  `environment.json` beside config.json."""
  return dict(jax=jax.__version__, backend=jax.default_backend(),
              devices=jax.device_count(), processes=jax.process_count())


def environment_changes(before: dict, now: dict) -> str:
  """'' or a warning that a resumed run continues in another environment
  (`environment`): its numbers from here on are not bit for bit those of an
  uninterrupted run."""
  changed = [f"{k} {before.get(k)!r} -> {now[k]!r}" for k in now
             if before.get(k) != now[k]]
  if not changed:
    return ""
  return (f"resumed in another environment ({'; '.join(changed)}): the rounds "
          "from here on are not bit for bit those of an uninterrupted run "
          "(float summation order; HyperGenFL's by up to ~1e-2, "
          "docs/faithfulness.md). Resume where the run began for identical "
          "numbers")


def check_disk(name: str, alg, run_dir: str, echo, *, keep: int = 1,
               runs: int = 1) -> None:
  """Says how much disk the algorithm's checkpoints take, and refuses to start
  when the run directory's disk has less free than their peak: `keep` per run
  (`train.checkpoints_to_keep`) and the one being written
  (`engine.checkpoints_held`); `runs` > 1 when finished runs keep theirs
  (`train.keep_checkpoints=True`: this algorithm's runs still to do)."""
  size = engine.checkpoint_bytes(alg)
  count = keep * (runs - 1) + engine.checkpoints_held(keep)
  need = count * size
  free = shutil.disk_usage(run_dir).free
  echo(f"{name}: checkpoints of {size / 2**20:.1f} MiB (at most {count} at a "
       f"time: {need / 2**20:.1f} MiB); {free / 2**30:.1f} GiB free")
  if free < need + 2**26:
    raise ConfigError(
        f"{name}: its checkpoints need {need / 2**20:.0f} MiB ({count} of "
        f"{size / 2**20:.1f} MiB) but only {free / 2**20:.0f} MiB are free at "
        f"{run_dir}: free space, keep fewer (--set train.checkpoints_to_keep="
        "1) or set output_dir to another disk (--set output_dir=...)")


# The server's share for checkpoint_sizes of an algorithm that trains on it
# when the config gives it none (FedLAW's reference proxy share).
SIZE_SERVER_FRACTION = 0.02


def checkpoint_sizes(cfg: ConfigDict, names=None) -> tuple[str, dict]:
  """(a description of the setting, {name: bytes of one checkpoint}) of the
  algorithms `names` (default `cfg.algorithms`) on `cfg`'s model and
  federation of its first target domain; in place of the bytes, a string
  says why one cannot run there. An algorithm training on the server's split
  gets `SIZE_SERVER_FRACTION` of it where the config gives none (its
  checkpoint does not hold that split)."""
  cfg = resolve(cfg)
  validate(cfg)
  dataset = load_dataset(cfg)
  target = target_domains(cfg, dataset.domain_names)[0]
  fed = federate(cfg, dataset, target)
  model = make_model(cfg, fed, *normalization(cfg, dataset, fed))
  with_server = None
  sizes = {}
  for name in names or cfg.algorithms:
    runs_on = getattr(algorithms.spec(name).module, "MODELS", None)
    if runs_on and cfg.model.name not in runs_on:
      sizes[name] = f"runs on {' / '.join(runs_on)}"
      continue
    data = fed
    if algorithms.needs_server_data(name) and not fed.server_size:
      if with_server is None:
        other = cfg.copy_and_resolve_references()
        other.data.server_fraction = SIZE_SERVER_FRACTION
        with_server = federate(other, dataset, target)
      data = with_server
    alg = algorithms.build(name, model, data.num_clients, cfg, data=data)
    sizes[name] = engine.checkpoint_bytes(alg)
  shape = "x".join(str(v) for v in fed.image_shape)
  return (f"{cfg.name}: {cfg.model.name} {shape}, {fed.num_clients} clients, "
          f"{fed.num_classes} classes", sizes)


def mib(size) -> str:
  """A checkpoint_sizes entry as printed: MiB to 3 significant digits (whole
  MiB from 100 on), or the reason it has none."""
  if not isinstance(size, int):
    return str(size)
  value = size / 2**20
  return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def checkpoint_table(cfgs, names=None) -> str:
  """Markdown: MiB of one checkpoint of each algorithm (`names`, default the
  configs' own) on each config's model and federation (`checkpoint_sizes`),
  one column per config (`fedjax-dg algorithms --config ...`)."""
  names = list(names or dict.fromkeys(n for c in cfgs for n in c.algorithms))
  columns = [checkpoint_sizes(c, names) for c in cfgs]
  lines = ["| MiB per checkpoint | " + " | ".join(h for h, _ in columns) + " |",
           "|---|" + "---:|" * len(columns)]
  for name in names:
    cells = [mib(sizes[name]) for _, sizes in columns]
    lines.append(f"| {name} ({algorithms.spec(name).display_name}) | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def run(cfg: ConfigDict, run_dir: str | None = None, *, resume: bool = False,
        echo=print) -> dict:
  """Runs every (target domain, algorithm) of `cfg`; returns the results dict.

  `run_dir` (a sweep's cell, or `resume`: an earlier run to continue) is
  continued if it holds a run: only with the same settings and data. A run
  directory this call made is removed again when the run fails before
  leaving anything to continue (no finished run, no checkpoint).
  """
  cfg = resolve(cfg)
  validate(cfg)
  if run_dir is None:
    check_output_dir(cfg.output_dir)
  # Data, federations and engine settings are all checked before a run directory
  # is created or anything is computed.
  dataset = load_dataset(cfg)
  targets = target_domains(cfg, dataset.domain_names)
  feds, said = [], []
  for target in targets:
    fed, w = stand_ins(lambda t=target: federate(cfg, dataset, t),
                       f"target {target}")
    feds.append(fed)
    said += w
  ecfg = engine_config(cfg)
  for fed in feds:
    ecfg.validate(fed.num_clients)

  data = dict(dataset=dataset.name, images=int(len(dataset.images)),
              fingerprint=dataset.fingerprint())
  if resume and not os.path.isdir(run_dir or ""):
    raise ConfigError(f"--resume {run_dir}: no such run directory")
  resume = run_dir is not None and (
      resume or os.path.exists(os.path.join(run_dir, "config.json")))
  if resume:
    check_resume(cfg, run_dir, data)
  # Several processes: process 0 names a new directory and alone writes the run
  # directory (checkpoints: every process, through orbax); every process has
  # read the directory before process 0 writes (the broadcast waits for all).
  main = distributed.is_main()
  echo = distributed.main_only(echo)
  run_dir = distributed.same_everywhere(
      run_dir or (make_run_dir(cfg.output_dir, cfg.name) if main else ""))
  env, env_path = environment(), os.path.join(run_dir, "environment.json")
  if resume and os.path.exists(env_path):
    with open(env_path) as f:
      warning = environment_changes(json.load(f), env)
    if warning:
      echo(f"WARNING: {warning}")
  results = dict(name=cfg.name, run_dir=run_dir, dataset=dataset.name,
                 domains=list(dataset.domain_names), targets=[str(t) for t in targets],
                 algorithms=list(cfg.algorithms), environment=env, runs=[],
                 warnings=[], seconds=0.0)
  log = metrics_log.NoLog()
  try:
    if main:
      _write_start(run_dir, cfg, data, env, env_path)
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
      _remove_if_empty(run_dir, echo)
    raise
  finally:  # a stopped run keeps its metrics up to its last evaluation
    log.close()
  return results


def _write_start(run_dir, cfg, data, env, env_path) -> None:
  """The run directory's config.json, data.json and (where the run began)
  environment.json."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    f.write(cfg.to_json(indent=2))
  with open(os.path.join(run_dir, "data.json"), "w") as f:
    json.dump(data, f)
  if not os.path.exists(env_path):  # where the run began
    with open(env_path, "w") as f:
      json.dump(env, f)


def _remove_if_empty(run_dir: str, echo) -> None:
  """Removes a run directory made by a run that failed before leaving
  anything to continue or read: no results.json, no checkpoint file. Its
  config.json, data.json, environment.json and empty logs go with it."""
  if os.path.exists(os.path.join(run_dir, "results.json")):
    return
  for _, _, files in os.walk(os.path.join(run_dir, "checkpoints")):
    if files:
      return
  shutil.rmtree(run_dir, ignore_errors=True)
  echo(f"removed {run_dir}: the run failed before anything was computed")


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
      _write(run_dir, results)

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
      model = make_model(cfg, fed, *normalization(cfg, dataset, fed))
    elif cfg.data.normalization == "train":
      model = make_model(cfg, fed, fed.mean, fed.std)
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
             id(fed) if algorithms.uses_data(name, cfg) else None)
      if key not in built:
        built[key], said = stand_ins(
            lambda: algorithms.build(name, model, fed.num_clients, cfg,
                                     data=fed), name, echo)
        results["warnings"] += [w for w in said if w not in results["warnings"]]
        # Finished runs keep their checkpoints (keep_checkpoints): every run
        # of this algorithm still to do adds its own.
        later = [t for t in targets[i:] if (name, str(t)) not in done]
        check_disk(name, built[key], run_dir, echo,
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
        save_features(run_dir, name, target, res.features)
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


def features_path(run_dir: str, name: str, target) -> str:
  return os.path.join(run_dir, "features", f"{name}--{target}.npz")


def save_features(run_dir: str, name: str, target, features: dict) -> None:
  """A run's target-domain features (`train.features_max`), for `plots.tsne`."""
  path = features_path(run_dir, name, target)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez(path, **features)


def strict_json(value):
  """`value` with every NaN / inf float as None (null): strict JSON, which
  `json.dump` would otherwise write as bare NaN tokens."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v) for v in value]
  return value


def _write(run_dir: str, results: dict) -> None:
  tmp = os.path.join(run_dir, "results.json.tmp")
  with open(tmp, "w") as f:
    json.dump(strict_json(results), f, allow_nan=False)
  os.replace(tmp, os.path.join(run_dir, "results.json"))
