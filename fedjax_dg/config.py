"""Experiment configuration: ml_collections ConfigDicts, `--set key=value` overrides.

An experiment file (`experiments/<name>.py`) defines `get_config()` returning a
ConfigDict built on `base_config()`. Every field has a type; overriding it with a
value of another type, or a key that does not exist, is an error naming the key.
"""

from __future__ import annotations

import ast
import importlib.util
import os

import ml_collections

ConfigDict = ml_collections.ConfigDict


class ConfigError(ValueError):
  """A bad setting: names the key, the value and what is allowed."""


def base_config() -> ConfigDict:
  c = ConfigDict()
  c.name = "experiment"
  c.seed = 0
  c.algorithms = ("hfedf", "fedavg")
  c.output_dir = "runs"
  # A HyperGenFL Table 1 scenario ("standard" | "advanced" | "extreme"; "" =
  # none): sets data.num_clients, train.cohort_size and data.alpha (only those;
  # presets.resolve_scenario), so a sweep can grid over it: --grid
  # scenario=standard,advanced,extreme. Giving one of the three fields another
  # value as well is an error.
  c.scenario = ""

  c.data = ConfigDict(dict(
      name="rotated_fashion_mnist",
      image_size=32,
      max_per_domain=0,        # 0: every example; else a seeded subset per domain
      targets="all",           # "all" | "none" | comma-separated domain names
      partition="domain_split",  # domain_split (hFedF Alg. 5) | k_per_domain | iid | dirichlet
      num_clients=0,           # 0: the number of source domains (the hFedF papers)
      d=1,                     # source domains per client (domain_split)
      k_per_domain=1,          # clients per domain (k_per_domain)
      alpha=0.5,               # Dirichlet concentration (dirichlet)
      min_partition_size=1,
      few_shot_k=0,            # target-domain images injected per client
      val_fraction=0.1,        # each client's id-validation share
      # Share of the source examples held by the server (carved out before the
      # client partition, stratified by domain and label): the unlabeled
      # transfer set of FedDF / FedBE, the labeled proxy set of FedLAW
      # (FedLAW ref. code: 0.02). 0: none (every other algorithm).
      server_fraction=0.0,
      normalization="dataset",  # input stats: "dataset" (all images) | "train"
      data_dir="",             # TFDS data dir ("" = $FEDJAX_DG_DATA_DIR or ~/.cache)
      manual_dir="",           # folder with manually downloaded data
  ))
  c.model = ConfigDict(dict(name="inception_cnn", conv_impl="auto"))
  c.train = ConfigDict(dict(
      rounds=200, eval_every=5, epochs=2, local_steps=0, batch_size=64,
      cohort_size=0,
      client_mapping="auto", map_batch_size=1, eval_batch_size=500,
      ood_eval_max=2000, progress=True,
      keep_checkpoints=False,  # False: a finished run's checkpoint is deleted
  ))
  # The clients' optimizer; an algorithm section's `client` dict overrides fields.
  c.client = ConfigDict(dict(optimizer="adam", lr=1e-3, weight_decay=1e-4,
                             momentum=0.0))

  c.fedavg = ConfigDict(dict(client=ConfigDict()))
  c.central = ConfigDict(dict(client=ConfigDict()))
  c.local_only = ConfigDict(dict(client=ConfigDict()))
  c.hfedf = ConfigDict(dict(
      embed_dim=0,             # 0: floor(1 + N/4) (pFedHN's rule, the paper)
      hidden=50, n_hidden=3,   # Table 8
      head_init="client_init",  # client_init | default (see docs/faithfulness.md)
      server_optimizer="adam", server_lr=1e-3, server_weight_decay=1e-5,
      server_clip_norm=0.0,
      gradalign=True, temperature=1.0, norm_batch_size=1,
      gradalign_granularity="model",  # model (the paper) | tensor (per theta tensor)
      ema=True, ema_decay=0.95, ema_warmup=5,
      learn_embeddings=True,   # "learned" embeddings only; False: fixed N(0,1)
      embeddings="learned",    # learned | random (Table 7) | autoencoder (Table 6)
      # Autoencoder embeddings (App. C.2; the paper gives no training settings):
      # Adam lr, epochs and batch size over each client's first 100 images.
      autoencoder_images=100, autoencoder_epochs=50, autoencoder_lr=1e-3,
      autoencoder_batch_size=20,
      client=ConfigDict(dict(weight_decay=1e-3)),
  ))
  # Baselines. Defaults: the reference code, or Table 10's PACS column where the
  # hFedF paper tuned a value (Office-Home / VLCS values in the comments).
  c.fedprox = ConfigDict(dict(
      mu=1e-2,                 # "L2 regularizer": 1e-2 PACS / OH / VLCS
      client=ConfigDict(dict(lr=1e-3, weight_decay=1e-4)),  # all three datasets
  ))
  c.pfedhn = ConfigDict(dict(
      embed_dim=0,             # 0: floor(1 + N/4), the reference code's rule
      hidden=100, n_hidden=3,  # reference code
      head_init="client_init",  # as hFedF (docs/faithfulness.md); "default"
      server_optimizer="sgd", server_momentum=0.9, server_clip_norm=50.0,
      server_lr=1e-2,          # 1e-2 PACS, 1e-3 OH / VLCS (ref. code: 1e-2)
      server_weight_decay=1e-3,  # 1e-3 PACS, 1e-4 OH / VLCS (ref. code: 1e-3)
      embed_weight_decay=False,  # the reference code decays them (faithfulness.md)
      local_steps=0,           # 0: train.epochs (hFedF protocol); 50: ref. code
      client_clip_norm=0.0,    # 50 in the reference code's inner loop
      # Table 10: lr 1e-3 all; wd 1e-5 PACS, 1e-4 OH / VLCS. Reference code:
      # optimizer="sgd", lr=5e-3, momentum=0.9, weight_decay=5e-5.
      client=ConfigDict(dict(optimizer="adam", lr=1e-3, weight_decay=1e-5,
                             momentum=0.0)),
  ))
  c.fedsr = ConfigDict(dict(
      z_dim=0,                 # 0: the model's feature width (ref.: 512 = ResNet-18's)
      l2r_coeff=1e-2,          # ref. code; Table 10: 1e-1 PACS / OH, 1e-2 VLCS
      cmi_coeff=5e-4,          # ref. code (not tuned in Table 10)
      client=ConfigDict(dict(lr=1e-3, weight_decay=1e-5)),  # wd 1e-4 OH / VLCS
  ))
  c.fedgma = ConfigDict(dict(
      threshold=0.7,           # mask threshold tau: 0.7 PACS, 0.3 OH, 0.5 VLCS
      step_size=1.0,           # server step eta: 1 PACS, 1e-2 OH / VLCS
      client=ConfigDict(dict(lr=1e-3, weight_decay=1e-4)),  # all three datasets
  ))
  # HyperGenFL's baselines (not in the hFedF tables): the reference code's
  # defaults; the client optimizer is the run's (`client`), as for FedAvg.
  c.moon = ConfigDict(dict(
      mu=1.0,                  # ref. code default; paper: 5 CIFAR-10, 1 CIFAR-100 /
                               # Tiny-ImageNet; HyperGenFL sets 0.01
      temperature=0.5,         # paper, ref. code and HyperGenFL
      proj_dim=256,            # projection head output (ref. code --out_dim)
      prev_init="initial",     # initial | global: a client's previous model before
                               # it has trained (docs/faithfulness.md)
      # Ref. code: optimizer="sgd", lr=1e-2, momentum=0.9, weight_decay=1e-5.
      client=ConfigDict(),
  ))
  c.fedsam = ConfigDict(dict(
      rho=0.05,                # SAM radius: Foret et al.'s default (Caldarola et
                               # al.'s CIFAR scripts: 0.5 / ASAM 0.5 with eta 0)
      adaptive=False,          # True: ASAM (Kwon et al. 2021), FedASAM (Caldarola)
      eta=0.01,                # ASAM's T_w = |w| + eta (ASAM ref. code default)
      # The papers' base optimizer is SGD (Caldarola: lr 1e-2, weight decay 4e-4).
      client=ConfigDict(),
  ))
  # Server-data baselines (HyperGenFL's Tables 2-5): they need
  # data.server_fraction > 0. Server steps: `steps` if > 0, else `epochs`
  # passes over the server split in batches of `batch_size`.
  c.feddf = ConfigDict(dict(
      epochs=20, steps=0,      # FedLAW ref. code's FedDF: 20 server epochs
                               # (FedDF: up to 1e4 steps with early stopping)
      batch_size=128,          # FedLAW ref. code (validate_batchsize)
      lr=1e-3, cosine=True,    # FedDF Sec. 4: Adam 1e-3, cosine annealing
      temperature=1.0,         # FedDF Eq. 1 (KL of plain softmaxes)
      eval_chunk=256,          # images per forward pass of the teachers
      client=ConfigDict(),
  ))
  c.fedbe = ConfigDict(dict(
      num_samples=10,          # ref. code num_sample_teacher
      sampler="gaussian",      # gaussian (paper's main) | dirichlet
      var_scale=1.0,           # std multiplier of the samples (paper: 1; the
                               # ref. code's 0.1 acts on normalized deltas)
      dirichlet_alpha=1.0,     # ref. code's Dir(1) (sampler="dirichlet")
      include_mean=True, include_clients=True,  # paper: {mean, clients, samples}
      epochs=20, steps=0,      # ref. code server_ep
      batch_size=128,          # ref. code server_bs
      lr=1e-3, momentum=0.9, weight_decay=1e-5,  # ref. code ServerUpdate.set_opt
      swa=True,                # ref. code use_SWA (FedBE's main results)
      swa_start=0.3,           # share of the steps before SWA (ref.: 500 steps
                               # of ~1580 on CIFAR-10)
      swa_freq=25,             # ref. code: a snapshot every 25 steps
      sharpen_temperature=1.0,  # 1: mean softmax (paper); ref. code's temp: 0.5
      eval_chunk=256,
      client=ConfigDict(),
  ))
  c.fedlaw = ConfigDict(dict(
      epochs=20, steps=0,      # ref. code server_epochs
      batch_size=128,          # ref. code validate_batchsize
      lr=1e-2,                 # ref. code: 1e-2 CIFAR-10, 5e-3 otherwise
      b1=0.5, b2=0.999,        # ref. code's Adam betas
      lambda_init="size",      # size (ref. code: log data shares) | uniform
      client=ConfigDict(),
  ))
  # HyperGenFL (Chen et al., CIKM '25; docs/faithfulness.md "HyperGenFL").
  c.hypergenfl = ConfigDict(dict(
      embed_dim=128,           # Sec. 4.1 (= the attention width); Tables 7-8: 64-256
      embeddings="ones",       # ones (Alg. 1, Sec. 5.1) | onehot (fixed, d = N) |
                               # random (N(0, 1), learned): Table 6
      num_heads=4,             # not given; must divide d (and N for onehot, 1/2/4
                               # are the values that fit 128 and Table 6's 100)
      attention_layers=1,      # residual MHA blocks (Sec. 5.2; Tables 7-8: 1-3)
      lam=1e-3,                # lambda of Eq. 5: "a small positive constant",
                               # no value given
      granularity="module",    # one weight per module (kernel + bias, Eq. 3's
                               # "layer") | tensor (per parameter tensor)
      loss="default",          # server loss (Table 9): default (Eq. 10-17) |
                               # mse | logcosh
      order="update_first",    # aggregate with the updated hypernetwork
                               # (Alg. 1) | aggregate_first
      server_optimizer="adamw",  # Sec. 4.1: AdamW
      server_lr=1e-2,          # Sec. 4.1: "learning rate for the hypernetwork 0.01"
      server_weight_decay=1e-5,  # Sec. 4.1
      # Clients: the run's optimizer (`client`). Sec. 4.1's "AdamW lr 0.01,
      # weight decay 1e-5 for the HG-FL" may also describe the clients; batch
      # size 32 and 10 local epochs are engine settings (train.*).
      client=ConfigDict(),
  ))
  return c


def load(path: str) -> ConfigDict:
  """Loads `get_config()` from an experiment file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path!r} does not exist (see experiments/)")
  spec = importlib.util.spec_from_file_location("_fedjax_dg_experiment", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} must define get_config() returning a ConfigDict")
  return module.get_config()


def _parse(value: str):
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def apply_overrides(config: ConfigDict, overrides: list[str]) -> ConfigDict:
  """Applies `key.sub=value` strings; values are Python literals or bare strings."""
  for item in overrides or ():
    if "=" not in item:
      raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    node, parts = config, key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
      if part not in node or not isinstance(node[part], ConfigDict):
        raise ConfigError(f"unknown config key {'.'.join(parts[:i + 1])!r}; "
                       f"known: {sorted(node.keys())}")
      node = node[part]
    leaf = parts[-1]
    if leaf not in node:
      raise ConfigError(f"unknown config key {key!r}; known at that level: "
                     f"{sorted(node.keys())}")
    value = _parse(raw)
    old = node[leaf]
    if isinstance(old, str):
      value = raw  # strings stay verbatim ("0", "0,15" are domain names)
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if isinstance(old, tuple) and isinstance(value, (list, str)):
      value = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    try:
      node[leaf] = value
    except TypeError as e:
      raise ConfigError(f"--set {key}: expected {type(old).__name__} like {old!r}, "
                      f"got {value!r}") from e
  return config
