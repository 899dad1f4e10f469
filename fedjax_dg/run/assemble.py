"""A config turned into what a run is made of, once: the engine's settings,
the dataset and its federations, the model, the algorithms.

The config stops here (`docs/architecture.md`): the engine, the algorithm
registry, the data and the models get resolved values from these functions,
never the config. Errors name the config fields that chose a value.
"""

from __future__ import annotations

import warnings

import jax

from fedjax_dg import algorithms, engine, models
from fedjax_dg.data import federated, partition, sources, splits, streamed
from fedjax_dg.errors import ConfigError, NeedsDataError, StandInWarning
from fedjax_dg.run import presets
from fedjax_dg.run.config import ConfigDict


def engine_config(cfg: ConfigDict) -> engine.EngineConfig:
  train = {k: v for k, v in cfg.train.items() if k != "keep_checkpoints"}
  return engine.EngineConfig(seed=cfg.seed, **train)


def hyperparameters(cfg: ConfigDict, name: str) -> dict:
  """Algorithm `name`'s hyperparameters: its config section without
  `client` (a variant's overrides are the registry's)."""
  section = dict(cfg[algorithms.spec(name).section])
  section.pop("client", None)
  return section


def client_settings(cfg: ConfigDict, name: str) -> dict:
  """Algorithm `name`'s clients' optimizer settings: `cfg.client` with the
  non-None fields of `cfg.<section>.client`; an error names both sections
  (the optimizer is made once here to check its names and values)."""
  section = algorithms.spec(name).section
  try:
    client = algorithms.client_settings(dict(cfg.client),
                                        dict(cfg[section].client))
    algorithms.client_optimizer(client)
  except ConfigError as e:
    raise ConfigError(f"{name}'s client optimizer (client.*, overridden by "
                      f"{section}.client.*): {e}") from None
  return client


def client_optimizer(cfg: ConfigDict, name: str):
  """The clients' optimizer of algorithm `name` (`client_settings`)."""
  return algorithms.client_optimizer(client_settings(cfg, name))


def algorithm(name: str, model, num_clients: int, cfg: ConfigDict,
              data=None) -> algorithms.Algorithm:
  """Algorithm `name` of a run config: its section's hyperparameters, its
  clients' optimizer, `cfg.seed` (`algorithms.build`). `data` (the run's
  FederatedData) is for algorithms that derive something from the clients'
  data before training."""
  return algorithms.build(name, model,
                          hyperparameters=hyperparameters(cfg, name),
                          client=client_settings(cfg, name),
                          num_clients=num_clients, data=data, seed=cfg.seed)


def recipe(name: str, model, num_clients: int, cfg: ConfigDict, data=None):
  """Algorithm `name` of a run config as a `Recipe` (`algorithms.recipe`):
  what its runs differ in (input normalization, learning rate, traced
  hyperparameters) is an argument of its programs."""
  return algorithms.recipe(name, model,
                           hyperparameters=hyperparameters(cfg, name),
                           client=client_settings(cfg, name),
                           num_clients=num_clients, data=data, seed=cfg.seed)


def recipe_key(name: str, model, num_clients: int, cfg: ConfigDict,
               data=None) -> tuple:
  """`recipe(...)`'s key, without building it (`algorithms.recipe_key`)."""
  return algorithms.recipe_key(name, model,
                               hyperparameters=hyperparameters(cfg, name),
                               client=client_settings(cfg, name),
                               num_clients=num_clients, data=data,
                               seed=cfg.seed)


def recipe_values(name: str, model, cfg: ConfigDict, data=None) -> dict:
  """A run's values of its recipe (`algorithms.recipe_values`; `data`: the
  run's FederatedData, for an algorithm that derives arrays from it)."""
  return algorithms.recipe_values(name, model,
                                  hyperparameters=hyperparameters(cfg, name),
                                  client=client_settings(cfg, name),
                                  data=data, seed=cfg.seed)


def batchable(name: str, cfg: ConfigDict) -> bool:
  """Whether algorithm `name`'s runs on other data (seeds, targets) can
  share its programs (`algorithms.Spec.batchable`)."""
  return algorithms.spec(name).batchable(hyperparameters(cfg, name))


def uses_data(name: str, cfg: ConfigDict) -> bool:
  """Whether algorithm `name` of this config derives something from the
  run's data (`algorithms.uses_data`)."""
  return algorithms.uses_data(name, hyperparameters(cfg, name))


def reads_client_data(name: str, cfg: ConfigDict) -> bool:
  """Whether algorithm `name` of this config reads every client's examples
  when built (`algorithms.reads_client_data`)."""
  return algorithms.reads_client_data(name, hyperparameters(cfg, name))


def resolve(cfg: ConfigDict) -> ConfigDict:
  """A copy of `cfg` with its presets expanded (`scenario`, HyperGenFL Table 1)."""
  cfg = cfg.copy_and_resolve_references()
  presets.resolve_scenario(cfg)
  return cfg


def check_algorithms(cfg: ConfigDict) -> dict:
  """Every algorithm's settings (its section, its clients' optimizer) checked
  before any data is read: each is built once on a tiny stand-in model (those
  that derive something from the data stop at it with NeedsDataError, their
  settings checked). Returns {name: the stand-in Algorithm, or None}."""
  probe = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2,
                           hidden=2)
  vit_probe = models.get_model("vit_tiny", input_shape=(4, 4, 1),
                               num_classes=2, patch=2, dim=8, depth=1,
                               heads=1, mlp_dim=8)
  n = cfg.data.num_clients or 4
  built = {}
  for name in cfg.algorithms:
    client_settings(cfg, name)
    runs_on = algorithms.spec(name).models
    on_vit = "vit_tiny" in runs_on or cfg.model.name.startswith("vit_")
    try:
      with warnings.catch_warnings():  # said once, by the run's own build
        warnings.simplefilter("ignore", StandInWarning)
        built[name] = algorithm(name, vit_probe if on_vit else probe, n,
                                cfg)
    except NeedsDataError:
      built[name] = None
  return built


def check_streaming(cfg: ConfigDict, probes: dict | None = None) -> None:
  """A streamed run (data.streaming: examples read per chunk of rounds,
  never all at once) needs the "host" placement and algorithms that neither
  read every client's examples when built nor pool them (Central): else a
  ConfigError naming each. `probes`: `check_algorithms`' stand-ins."""
  probes = check_algorithms(cfg) if probes is None else probes
  why = []
  if cfg.train.placement == "device":
    why.append("train.placement='device' holds every client's examples on "
               "the device (use 'host' or 'auto')")
  readers = [a for a in cfg.algorithms if reads_client_data(a, cfg)]
  if readers:
    why.append(f"{', '.join(readers)} read(s) every client's examples when "
               "built (style pools, amplitude bank or autoencoder embeddings; "
               "leave them out)")
  pooled = [a for a, alg in probes.items() if alg is not None and alg.client.pooled]
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
  d = cfg.data
  dataset = sources.load(d.name, image_size=d.image_size,
                         data_dir=d.data_dir or None,
                         manual_dir=d.manual_dir or None,
                         max_per_domain=d.max_per_domain or None, seed=cfg.seed,
                         streaming=d.streaming)
  if dataset.streamed:
    check_streaming(cfg)
  check_normalization(cfg, dataset.image_shape[-1])
  return dataset


def check_normalization(cfg: ConfigDict, channels: int) -> None:
  """`data.normalization='imagenet'` (ImageNet's RGB constants) needs images
  of 3 channels: else a ConfigError naming the field, checked when the data
  are loaded, before any run or sweep directory is made."""
  if cfg.data.normalization == "imagenet" and channels != 3:
    raise ConfigError(
        f"data.normalization='imagenet' needs RGB images, but data.name="
        f"{cfg.data.name!r} has {channels} channel(s): use 'dataset' or "
        "'train'")


def federate(cfg: ConfigDict, dataset, target):
  """The FederatedData of one held-out `target`; errors name the config fields."""
  d = cfg.data
  n_sources = dataset.num_domains - (target is not None)
  per_domain = partition.ALIASES.get(d.partition, d.partition) == "k_per_domain"
  try:
    spec = partition.PartitionSpec(
        name=d.partition,
        num_clients=d.num_clients or (None if per_domain else n_sources),
        d=d.d,
        k_per_domain=None if (per_domain and d.num_clients) else d.k_per_domain,
        alpha=d.alpha, min_partition_size=d.min_partition_size, lam=d.lam,
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

  "dataset": statistics of every image the run loads, the same for every target
  domain (like DomainBed's fixed per-dataset constants; no labels used): all of
  the dataset's, so every run of an experiment shares one compiled program --
  except under `data.max_per_domain`, where they are those of the seed's
  subsample, so each seed compiles its own (and its runs batch apart,
  run/batches.py; docs/faithfulness.md, "Input normalization"). "train": statistics
  of this federation's training images only (recompiles per target domain).
  "imagenet": ImageNet's constants (torchvision's), which ImageNet-pretrained
  weights (`model.weights`) expect; RGB datasets only.
  """
  if cfg.data.normalization == "train":
    return fed.mean, fed.std
  if cfg.data.normalization == "imagenet":
    check_normalization(cfg, fed.image_shape[-1])
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


def model_dtype(cfg: ConfigDict) -> str:
  """`model.dtype`, checked: "float32" or "bfloat16", "auto" resolved for
  this process's backend (`models.layers.auto_dtype`); a ConfigError naming
  the field and the allowed values otherwise."""
  if cfg.model.dtype == "auto":
    return models.layers.auto_dtype(jax.default_backend())[0]
  models.layers.compute_dtype(cfg.model.dtype)
  return cfg.model.dtype


def make_model(cfg: ConfigDict, fed, mean, std):
  return models.get_model(cfg.model.name, input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=mean, std=std,
                          conv_impl=cfg.model.conv_impl,
                          weights=cfg.model.weights,
                          skip_head=cfg.model.skip_head,
                          dtype=model_dtype(cfg), **model_fields(cfg))
