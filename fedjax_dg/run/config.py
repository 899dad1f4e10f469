"""Experiment configuration: locked ml_collections ConfigDicts, `--set key=value`.

An experiment file (`experiments/<name>.py`) defines `get_config()` returning a
ConfigDict built on `base_config()`. The config is locked: setting a key that
does not exist (`c.train.round = 3`, `--set train.round=3`) is an error naming the
closest valid key, and every field keeps its type.

One source of defaults: the algorithm sections are the keyword defaults of each
algorithm module's `build` (`algorithms.hyperparameters`), their `client`
sub-sections the module's `CLIENT` (None = the run's `client` value), and
`train` is `engine.EngineConfig`'s fields, `data` is `data.settings.DataConfig`'s.
Only what has no other home (model, the run's client optimizer) is written
here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import re
import traceback

import ml_collections

from fedjax_dg import algorithms, engine
from fedjax_dg.data.settings import data_defaults
from fedjax_dg.errors import ConfigError

ConfigDict = ml_collections.ConfigDict


class Config(ConfigDict):
  """A ConfigDict that remembers which of its fields were set once it was
  locked (`explicit`): `base_config` locks its sections when built, so every
  value an experiment file, the Python API or `--set` gives is recorded, even
  one equal to the default. Copies (`copy_and_resolve_references`, deepcopy,
  pickle) keep the record."""

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    if self.is_locked:
      self.__dict__.setdefault("_explicit", set()).add(key)

  def copy_and_resolve_references(self, visit_map=None):
    out = super().copy_and_resolve_references(visit_map)
    out.__dict__["_explicit"] = set(explicit(self))
    return out

  def __setstate__(self, state):
    super().__setstate__(state)
    self.__dict__["_explicit"] = set(state.get("_explicit", ()))


def explicit(node: ConfigDict) -> frozenset:
  """The keys of `node` set after `base_config` built it (`Config`); none for
  a plain ConfigDict."""
  return frozenset(node.__dict__.get("_explicit", ()))



def train_defaults() -> dict:
  """`train`: the engine's settings (`EngineConfig` but `seed`, a top-level key)
  and what happens to a finished run's checkpoints."""
  fields = {f.name: f.default for f in dataclasses.fields(engine.EngineConfig)
            if f.name != "seed"}
  return dict(fields, keep_checkpoints=False)  # False: deleted when finished


def algorithm_section(section: str) -> ConfigDict:
  """Algorithm `section`'s hyperparameters (its `build` defaults) and `client`
  overrides of the run's client optimizer (None: the run's value)."""
  return Config(dict(algorithms.hyperparameters(section),
                     client=Config(algorithms.client_defaults(section))))


def base_config() -> ConfigDict:
  """Every field with its default, locked: from here on, what is set is
  recorded as given (`Config`, `explicit`)."""
  c = Config()
  c.name = "experiment"
  c.seed = 0
  c.algorithms = ("hfedf", "fedavg")
  c.output_dir = "runs"
  # A HyperGenFL Table 1 scenario ("standard" | "advanced" | "extreme"; "" =
  # none): sets data.num_clients, train.cohort_size and data.alpha (only those;
  # presets.resolve_scenario), so a sweep can grid over it: --grid
  # scenario=standard,advanced,extreme. Giving one of the three fields another
  # value as well is an error, even the default's (`explicit`).
  c.scenario = ""

  c.data = Config(data_defaults())  # data.settings.DataConfig's fields
  c.model = Config(dict(
      name="inception_cnn",
      conv_impl="auto",
      weights="",              # pretrained file (.pth / .safetensors; ViTs also .npz)
      skip_head=False,         # with weights: the last Linear starts fresh (other classes)
      # Compute dtype of every client model: "float32" | "bfloat16" |
      # "auto" (bfloat16 on a GPU / TPU, float32 on a CPU; printed at start);
      # any other: ConfigError. bfloat16: activations, matmuls and convolutions
      # in bfloat16 (accelerators); parameters and optimizer state stay
      # float32, norm statistics, softmax, logits and losses float32.
      # Hypernetworks and auxiliary nets (hFedF's autoencoder, CCST's AdaIN)
      # stay float32. docs/models.md, "Mixed precision".
      dtype="float32",
      # ViT sizes (vit_b16 / vit_tiny only; 0: the released size's own).
      vit=Config(dict(patch=0, dim=0, depth=0, heads=0, mlp_dim=0)),
  ))
  c.train = Config(train_defaults())
  # The clients' optimizer; an algorithm section's `client` overrides fields.
  # schedule: "constant" or "cosine" (over the run's local epochs, the
  # optimizer state still fresh every round: `optim.cosine_over_run`).
  c.client = Config(dict(optimizer="adam", lr=1e-3, weight_decay=1e-4,
                         momentum=0.0, schedule="constant"))
  for section in algorithms.modules():
    c[section] = algorithm_section(section)
  c.lock()
  return c


def same_clients(c: ConfigDict, **client) -> None:
  """Every algorithm's clients train with one optimizer setting: the run's
  `client` updated with `client`, each algorithm section's own `client`
  overrides cleared (None: the run's value)."""
  c.client.update(client)
  for section in algorithms.modules():
    for key in algorithms.CLIENT_KEYS:
      c[section].client[key] = None


def closest(name: str, options) -> str | None:
  """The valid key a mistyped `name` most likely meant: an initialism either
  way (learning_rate ~ lr, wd ~ weight_decay), else the most similar."""
  options = [str(o) for o in options]
  initials = lambda s: "".join(part[:1] for part in s.split("_"))
  for option in options:
    if name.lower() == option.lower() or initials(name) == option or (
        initials(option) == name):
      return option
  best = difflib.get_close_matches(name, options, n=1, cutoff=0.0)
  return best[0] if best else None


def _unknown(key: str, options, where: str = "") -> str:
  leaf = key.rsplit(".", 1)[-1]
  guess = closest(leaf, options)
  guess = (f"; did you mean {key[:len(key) - len(leaf)] + guess!r}?"
           if guess else "")
  return (f"unknown config key {key!r}{where}{guess} (known there: "
          f"{sorted(str(o) for o in options)})")


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"train.rounds": 200, ...} of a nested dict (a config's JSON)."""
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def drift(saved: dict, now: dict) -> list[str]:
  """"key: old -> new" for every field whose value differs between two
  configs' JSON (fields only one has, e.g. added to base_config since, are not
  drift)."""
  a, b = flatten(saved), flatten(now)
  return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(set(a) & set(b))
          if a[k] != b[k]]


def _stored(old, value):
  """A JSON value as the value of a field holding `old` (lists to tuples,
  ints to floats)."""
  if isinstance(old, tuple) and isinstance(value, list):
    return tuple(value)
  if (isinstance(old, float) and isinstance(value, int)
      and not isinstance(value, bool)):
    return float(value)
  return value


def explicit_keys(cfg: ConfigDict, prefix: str = "") -> list[str]:
  """The dotted keys of every field `explicit` records as set in `cfg`."""
  out = []
  for key in sorted(cfg.keys()):
    value = cfg[key]
    if isinstance(value, ConfigDict):
      out += explicit_keys(value, f"{prefix}{key}.")
    elif key in explicit(cfg):
      out.append(prefix + key)
  return out


def changed_keys(stored: dict) -> list[str]:
  """The dotted keys of a config's JSON whose value differs from
  `base_config`'s default (what an experiment file must have set)."""
  base, out = base_config(), []
  for key, value in flatten(stored).items():
    try:
      old = lookup(base, key)
    except ConfigError:
      continue
    if not isinstance(old, ConfigDict) and _stored(old, value) != old:
      out.append(key)
  return out


def _mark_explicit(cfg: ConfigDict, given: set, prefix: str = "") -> None:
  """`explicit` of every section of `cfg` set to the dotted keys `given`."""
  cfg.__dict__["_explicit"] = {k for k in cfg.keys()
                               if prefix + k in given}
  for key in cfg.keys():
    if isinstance(cfg[key], ConfigDict):
      _mark_explicit(cfg[key], given, f"{prefix}{key}.")


def from_json(stored: dict, given=None) -> ConfigDict:
  """The config of a run directory's config.json (a resolved config's JSON)
  as a locked config of `base_config`, JSON lists back to tuples: what
  `fedjax-dg run --resume DIR` runs when no --config is given. A key that
  `base_config` no longer has is skipped, as `drift` skips it. Every field
  counts as set (`explicit`), or, with `given` (dotted keys: a sweep's
  `explicit_keys`), only those: what its experiment file and --set set."""
  cfg = base_config()
  for key, value in flatten(stored).items():
    try:
      old = lookup(cfg, key)
    except ConfigError:
      continue
    if isinstance(old, ConfigDict):  # an empty section stored as {}
      continue
    value = _stored(old, value)
    try:
      cfg.update_from_flattened_dict({key: value})
    except TypeError as e:
      raise ConfigError(f"config.json: {key}={value!r} is not a value of "
                        f"{type(old).__name__} like {old!r} (written by "
                        "another fedjax_dg?): resume with --config") from e
  if given is not None:
    _mark_explicit(cfg, set(given))
  return cfg


def _from_ml_collections(error: Exception) -> bool:
  frames = traceback.extract_tb(error.__traceback__)
  return bool(frames) and "ml_collections" in frames[-1].filename


def _explain(error: Exception) -> str:
  """ml_collections' message about a locked config, as ours (key + closest)."""
  while isinstance(error, BaseException) and error.args:
    error = error.args[0]  # ml_collections nests its KeyError in the error
  text = str(error)
  added = re.search(r'Key "([^"]+)" does not exist.*Other fields present: '
                    r'"(\{.*\})"', text, re.S)
  if added:  # setting a key that does not exist: ml_collections lists the fields
    return _unknown(added.group(1), re.findall(r"'([A-Za-z_]\w*)':",
                                               added.group(2)))
  read = re.fullmatch(r"'?([^'\n]+)'?(?:\nDid you mean \"([^\"]+)\".*)?", text,
                      re.S)
  if read:  # reading a key that does not exist
    guess = f"; did you mean {read.group(2)!r}?" if read.group(2) else ""
    return f"unknown config key {read.group(1)!r}{guess}"
  return text


def load(path: str) -> ConfigDict:
  """Loads `get_config()` from an experiment file (an unknown key or a value
  of the wrong type set there is a ConfigError naming the file)."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist (see experiments/)")
  if not path.endswith(".py"):
    raise ConfigError(f"config file {path!r}: a config is a Python file defining "
                      "get_config() (see experiments/); to run a stored "
                      "config.json, resume its run directory (--resume DIR)")
  spec = importlib.util.spec_from_file_location("_fedjax_dg_experiment", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} must define get_config() returning a ConfigDict")
  try:
    cfg = module.get_config()
  except (AttributeError, KeyError, TypeError) as e:
    if _from_ml_collections(e):
      raise ConfigError(f"{path}: {_explain(e)}") from e
    raise
  if not isinstance(cfg, ConfigDict):
    raise ConfigError(f"{path}: get_config() returned a {type(cfg).__name__}; "
                      "return the ConfigDict of base_config() with your changes")
  return cfg


def _parse(value: str):
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def lookup(config: ConfigDict, key: str):
  """The value at dotted `key`; a ConfigError naming the first unknown part
  and the closest valid key."""
  node, parts = config, key.split(".")
  for i, part in enumerate(parts):
    if not isinstance(node, ConfigDict):
      raise ConfigError(f"unknown config key {key!r}: {'.'.join(parts[:i])!r} "
                        f"is a {type(node).__name__}, not a section")
    if part not in node:
      raise ConfigError(_unknown(".".join(parts[:i + 1]), node.keys(),
                                 f" in --set {key}" if i + 1 < len(parts) else ""))
    node = node[part]
  return node


def coerce(raw: str, old):
  """A `--set` string as a value of `old`'s type: strings stay verbatim ("0",
  "0,15" are domain names), ints widen to floats, comma lists become tuples;
  other values are Python literals (None-valued fields take any literal)."""
  if isinstance(old, str):
    return raw
  value = _parse(raw)
  if isinstance(value, bool) != isinstance(old, bool) and old is not None:
    raise ConfigError(f"expected {type(old).__name__} like {old!r}, got {raw!r}")
  if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(old, tuple) and isinstance(value, (list, str)):
    return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
  return value


def apply_overrides(config: ConfigDict, overrides: list[str]) -> ConfigDict:
  """Applies `key.sub=value` strings (`coerce`) through ml_collections'
  `update_from_flattened_dict`; unknown keys and wrong types are ConfigErrors."""
  for item in overrides or ():
    if "=" not in item:
      raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    key = key.strip()
    old = lookup(config, key)
    if isinstance(old, ConfigDict):
      raise ConfigError(f"--set {key}: {key!r} is a section; set one of its "
                        f"keys {sorted(old.keys())}")
    try:
      value = coerce(raw, old)
    except ConfigError as e:
      raise ConfigError(f"--set {key}: {e}") from None
    try:
      config.update_from_flattened_dict({key: value})
    except TypeError as e:
      raise ConfigError(f"--set {key}: expected {type(old).__name__} like "
                        f"{old!r}, got {value!r}") from e
  return config
