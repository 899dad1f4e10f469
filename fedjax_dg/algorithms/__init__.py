"""Algorithms by name: one module per algorithm, picked by name (big_vision style).

`fedjax_dg.algorithms.<name>` is algorithm `<name>`. It exports

    build(model, optimizer, loss, *, <hyperparameters with defaults>) -> Algorithm
    DISPLAY_NAME        its name in the papers' tables
    PAPER               optional: dict(title=, authors=, venue=, year=) of the
                        paper it implements (the docs' algorithm pages and
                        the README's table are generated or checked from it)
    CLIENT              optional: its clients' optimizer defaults ({"lr": ...}),
                        overriding the run's `client` settings
    NEEDS_SERVER_DATA   optional (False): it trains on the server's split
    NEEDS_DOMAINS       optional (False): its objective reads each training
                        example's domain (`Batch.d`, an index into the
                        federation's `domain_names`): the registry sets
                        `ClientSide.domains` and the engine carries the
                        domains with the examples; every other algorithm's
                        programs take no domain array
    FEDERATED           optional (True): False for Central / Local-only (no
                        arrows against FedAvg in the tables)
    MODELS              optional (any): the `model.name`s it runs on, e.g.
                        FedSDAF's ("vit_b16", "vit_tiny"); a run on another
                        model is refused before any data is read
    TRACED              optional (()): float hyperparameters that are
                        arguments of the compiled programs (`recipe`), not
                        constants: `build` must accept tracers for them (its
                        checks skip them, `tree.is_concrete`); a grid over
                        them then shares one compile
    STATIC_CLIENT_LR    optional (False): the clients' learning rate is a
                        constant of the programs (`build` needs its value)
    VARIANTS            optional: {name: (display name, hyperparameter
                        overrides)}, more algorithm names built by this module
    ABLATIONS           optional ({}): {hyperparameter: label} of the switches
                        whose False names an ablation: a run of the module's
                        own name with `<key>=False` is displayed "<display
                        name> w/o <label>" (several joined by " & ") and the
                        report's ablation table compares it with the full
                        algorithm (hFedF's Table 3)
    ABLATION_TABLE      optional ("Ablations"): the paper's name of that table
                        (its title, and lower case without spaces its file)
    uses_data(hparams)  optional: whether `build` derives something from every
                        client's data (then its Algorithm is built per
                        federation, and a streamed federation is refused)
    prepare(model, data=, seed=, **hparams)
                        optional: what `build` derives from the data and
                        seed, as arrays, which `build(prepared=...)` takes
                        instead of `data`: they are then the recipe's values
                        (`recipe`), and runs of other seeds and data share
                        one program
    diagnose(round_metrics)
                        optional: warnings (sentences) about a finished run
                        whose numbers do not mean what its name says (e.g. a
                        HyperGenFL hypernetwork that went dead: FedAvg)

`build` may also take `loss` (omit it when the algorithm builds its own
objective) and the run's context `num_clients`, `data` (the FederatedData),
`seed` and `name`: the registry passes those it names. Its other keyword
arguments, with their defaults, ARE the algorithm's config section
(`config.base_config`): the defaults are written once, in the signature.

`Spec` is the only reader of these exports. The registry takes resolved
values (`build(name, model, hyperparameters=, client=, num_clients=, data=,
seed=)`); `fedjax_dg.run.assemble` resolves them from a config.

A new algorithm is one new module here; docs/extending.md walks through one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from types import ModuleType
from typing import Any, Mapping

import numpy as np

from fedjax_dg.algorithms.base import (Algorithm, ClientContext, ClientData,
                                       ClientResult, Recipe, ServerState)
from fedjax_dg.client import objectives
from fedjax_dg.client.update import RunProgress
from fedjax_dg.errors import ConfigError, NeedsDataError
from fedjax_dg.optim import make_optimizer, with_schedule

# Arguments of `build` the registry supplies (never config keys).
CONTEXT = ("model", "optimizer", "loss", "num_clients", "data", "seed", "name",
           "prepared")
# The client optimizer's settings (`cfg.client`; per algorithm `CLIENT` and
# `cfg.<section>.client`).
CLIENT_KEYS = ("optimizer", "lr", "weight_decay", "momentum", "schedule")
_NOT_ALGORITHMS = ("base",)
# The report's row order (hFedF's tables, then HyperGenFL's): a display
# preference only; a module's variants follow it, an algorithm not listed
# follows the listed ones in first-seen order.
TABLE_ORDER = ("central", "local_only", "fedavg", "fedprox", "pfedhn", "fedsr",
               "fedgma", "moon", "fedsam", "fedlaw", "feddf", "fedbe",
               "hypergenfl", "hfedf")
# The baseline every federated algorithm is compared with in the report's
# tables (the arrows).
REFERENCE = "fedavg"


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the registry knows of one algorithm name."""
  name: str
  module: ModuleType
  display_name: str
  overrides: Mapping[str, Any]  # hyperparameters fixed by a variant

  @property
  def section(self) -> str:
    """Its config section (the module's name)."""
    return self.module.__name__.rsplit(".", 1)[1]

  @property
  def paper(self) -> dict[str, Any]:
    """The module's `PAPER` (title, authors, venue, year); {} for none
    (Central, Local-only)."""
    return dict(getattr(self.module, "PAPER", {}))

  @property
  def models(self) -> tuple[str, ...]:
    """The `model.name`s it runs on (the module's `MODELS`); () = any."""
    return tuple(getattr(self.module, "MODELS", ()))

  @property
  def needs_server_data(self) -> bool:
    return bool(getattr(self.module, "NEEDS_SERVER_DATA", False))

  @property
  def needs_domains(self) -> bool:
    """Whether its objective reads `Batch.d` (the module's
    `NEEDS_DOMAINS`)."""
    return bool(getattr(self.module, "NEEDS_DOMAINS", False))

  @property
  def federated(self) -> bool:
    return bool(getattr(self.module, "FEDERATED", True))

  @property
  def traced(self) -> tuple[str, ...]:
    """The hyperparameters its recipes take as values (`TRACED`)."""
    return tuple(getattr(self.module, "TRACED", ()))

  @property
  def prepares(self) -> bool:
    """Whether its data-built parts can be values (the module's
    `prepare`)."""
    return hasattr(self.module, "prepare")

  def batchable(self, hparams: Mapping[str, Any]) -> bool:
    """Whether runs on other data can share its programs: it derives
    nothing from its data, or what it derives (style pools, embeddings, the
    server's split) is `prepare`'s values."""
    return not self.uses_data(hparams) or self.prepares

  @property
  def static_client_lr(self) -> bool:
    return bool(getattr(self.module, "STATIC_CLIENT_LR", False))

  @property
  def variants(self) -> tuple[str, ...]:
    """The algorithm names its module's `VARIANTS` add, in their order."""
    return tuple(getattr(self.module, "VARIANTS", {}))

  @property
  def ablations(self) -> dict[str, str]:
    """{hyperparameter: label} of the module's `ABLATIONS` ({}: none)."""
    return dict(getattr(self.module, "ABLATIONS", {}))

  @property
  def ablation_table(self) -> str:
    """The paper's name of its ablation table (`ABLATION_TABLE`)."""
    return str(getattr(self.module, "ABLATION_TABLE", "Ablations"))

  @property
  def table_rank(self) -> tuple[int, int]:
    """Its place among the report's rows: its section's in `TABLE_ORDER`,
    then the module's own name before its variants. Every algorithm of an
    unlisted section ranks the same (after the listed ones)."""
    if self.section not in TABLE_ORDER:
      return (len(TABLE_ORDER), 0)
    own = 0 if self.name == self.section else 1 + self.variants.index(self.name)
    return (TABLE_ORDER.index(self.section), own)

  def diagnose(self, round_metrics: Mapping[str, list]) -> list[str]:
    fn = getattr(self.module, "diagnose", None)
    return [f"{self.name}: {w}" for w in fn(round_metrics)] if fn else []

  def uses_data(self, hparams: Mapping[str, Any]) -> bool:
    return self.needs_server_data or self.reads_client_data(hparams)

  def reads_client_data(self, hparams: Mapping[str, Any]) -> bool:
    """Whether `build` reads every client's examples (the module's
    `uses_data`: FedCCRL's and CCST's style pools, ELCFS's amplitude bank,
    hFedF's autoencoder embeddings)."""
    fn = getattr(self.module, "uses_data", None)
    return bool(fn({**hparams, **self.overrides})) if fn else False


@functools.lru_cache(maxsize=None)
def modules() -> tuple[str, ...]:
  """The algorithm modules (= config sections), in name order."""
  names = [m.name for m in pkgutil.iter_modules(__path__)
           if not m.name.startswith("_") and m.name not in _NOT_ALGORITHMS]
  return tuple(sorted(names))


def _module(name: str) -> ModuleType:
  return importlib.import_module(f"{__name__}.{name}")


@functools.lru_cache(maxsize=None)
def _specs() -> dict[str, Spec]:
  specs = {}
  for section in modules():
    module = _module(section)
    for attr in ("build", "DISPLAY_NAME"):
      if not hasattr(module, attr):
        raise TypeError(f"algorithm module {module.__name__} lacks {attr} "
                        "(algorithms/__init__.py lists what a module exports)")
    specs[section] = Spec(section, module, module.DISPLAY_NAME, {})
    for variant, (display, overrides) in getattr(module, "VARIANTS", {}).items():
      specs[variant] = Spec(variant, module, display, dict(overrides))
  return specs


def available() -> tuple[str, ...]:
  """Every algorithm name: the modules, then their variants."""
  return tuple(_specs())


def spec(name: str) -> Spec:
  specs = _specs()
  if name not in specs:
    raise ConfigError(f"unknown algorithm {name!r}; allowed: {tuple(specs)}")
  return specs[name]


def hyperparameters(section: str) -> dict[str, Any]:
  """The keyword arguments of `<section>.build` with their defaults: the
  algorithm's config section (without `client`)."""
  params = inspect.signature(_module(section).build).parameters
  out = {}
  for p in params.values():
    if p.name in CONTEXT or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
      continue
    if p.default is p.empty:
      raise TypeError(f"{section}.build: hyperparameter {p.name!r} needs a "
                      "default (it is the config's)")
    out[p.name] = p.default
  return out


def client_defaults(section: str) -> dict[str, Any]:
  """The module's `CLIENT` overrides of the run's client optimizer settings;
  None where the run's `client` value applies."""
  own = dict(getattr(_module(section), "CLIENT", {}))
  unknown = set(own) - set(CLIENT_KEYS)
  if unknown:
    raise TypeError(f"{section}.CLIENT has unknown keys {sorted(unknown)}; "
                    f"allowed: {CLIENT_KEYS}")
  return {k: own.get(k) for k in CLIENT_KEYS}


def client_settings(client: Mapping[str, Any],
                    overrides: Mapping[str, Any]) -> dict[str, Any]:
  """The run's `client` settings with an algorithm section's non-None
  `client` overrides; an override of another type than the run's value is an
  error naming the key."""
  out = dict(client)
  for key, value in overrides.items():
    if value is None:
      continue
    want = type(client[key])
    if want is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, want):
      raise ConfigError(f"client override {key}={value!r}: expected "
                       f"{want.__name__} like the run's client.{key}="
                       f"{client[key]!r}")
    out[key] = value
  return out


def client_optimizer(client: Mapping[str, Any]):
  """The clients' optimizer of resolved client settings (`CLIENT_KEYS`: the
  run's with an algorithm's overrides, `client_settings`)."""
  return with_schedule(make_optimizer(client["optimizer"], client["lr"],
                                      client["weight_decay"],
                                      client["momentum"]), client["schedule"])


def describe() -> str:
  """One line per algorithm: name, display name, section, hyperparameters
  with their defaults (for `fedjax-dg algorithms`)."""
  lines = []
  for name in available():
    s = spec(name)
    facts = [f"section {s.section}"]
    if s.overrides:
      facts.append(", ".join(f"{k}={v!r}" for k, v in s.overrides.items()))
    if s.needs_server_data:
      facts.append("needs data.server_fraction > 0")
    if s.needs_domains:
      facts.append("reads each example's domain")
    lines.append(f"{name:20s} {s.display_name} ({'; '.join(facts)})")
    if s.name == s.section:
      hp = hyperparameters(s.section)
      if hp:
        lines.append("    " + ", ".join(f"{k}={v!r}" for k, v in hp.items()))
  return "\n".join(lines)


def needs_server_data(name: str) -> bool:
  """Whether algorithm `name` trains on the server's split
  (`FederatedData.server_x`, config `data.server_fraction` > 0)."""
  return spec(name).needs_server_data


def uses_data(name: str, hyperparameters: Mapping[str, Any]) -> bool:
  """Whether `build(name, ...)` with these hyperparameters (its section's)
  derives something from the run's data (then an Algorithm object cannot be
  shared between federations)."""
  return spec(name).uses_data(hyperparameters)


def reads_client_data(name: str, hyperparameters: Mapping[str, Any]) -> bool:
  """Whether `build(name, ...)` with these hyperparameters reads every
  client's training examples (the padded view), which a streamed federation
  never holds."""
  return spec(name).reads_client_data(hyperparameters)


def create(name: str, model, *, optimizer, hparams: Mapping[str, Any],
           num_clients: int, data=None, seed: int = 0,
           prepared=None) -> Algorithm:
  """Algorithm `name` from keyword hyperparameters (a variant's overrides on
  top) and the run's context; the local objective is cross-entropy unless the
  module builds its own."""
  s = spec(name)
  build_fn = s.module.build
  accepted = inspect.signature(build_fn).parameters
  context = dict(loss=objectives.cross_entropy(model), num_clients=num_clients,
                 data=data, seed=seed, name=name, prepared=prepared)
  kwargs = {k: v for k, v in context.items() if k in accepted
            and not (k == "prepared" and v is None)}
  if "name" in kwargs and s.name == s.section:
    del kwargs["name"]  # the module's own default name
  hp = {**dict(hparams), **s.overrides}
  unknown = set(hp) - set(hyperparameters(s.section))
  if unknown:
    raise ConfigError(f"{name}: unknown hyperparameters {sorted(unknown)}; "
                     f"allowed: {sorted(hyperparameters(s.section))}")
  alg = build_fn(model, optimizer, **kwargs, **hp)
  return alg.replace(domains=True) if s.needs_domains else alg


def build(name: str, model, *, hyperparameters: Mapping[str, Any],
          client: Mapping[str, Any], num_clients: int, data=None,
          seed: int = 0, prepared=None) -> Algorithm:
  """Algorithm `name` built from resolved values.

  `fedjax_dg.run.assemble.algorithm(name, model, num_clients, cfg)` resolves
  the same arguments from a config; call this one to build an algorithm
  without a config.

  Args:
    name: a registry name (`available()`), a module's or a variant's
      (`hfedf_no_ema`: its overrides are applied on top).
    model: the client model (`fedjax_dg.models.get_model`).
    hyperparameters: the algorithm section's settings, {name: value}; only
      the keys of `hyperparameters(spec(name).section)` are allowed, and any
      not given keep their `build` defaults.
    client: the clients' optimizer settings, all of `CLIENT_KEYS`
      (`optimizer`, `lr`, `weight_decay`, `momentum`, `schedule`);
      `client_settings(run's, spec's CLIENT overrides)` merges a module's
      own defaults in.
    num_clients: N, the federation's clients (the per-client state's
      leading axis).
    data: the run's `FederatedData`, for algorithms that derive something
      from the clients' data before training (`uses_data`) or train on the
      server's split; None otherwise.
    seed: seeds what `build` itself draws (e.g. hFedF's autoencoder).

  Returns:
    The `Algorithm`: `init(key) -> (server state, [N, ...] client state or
    None)`, its client side and server side, ready for `engine.run`.

  Raises:
    ConfigError: an unknown name or hyperparameter, a value out of range, a
      client schedule the algorithm cannot take.

  Example::

    import jax
    from fedjax_dg import algorithms, models
    model = models.get_model("mlp", input_shape=(16, 16, 1), num_classes=10)
    client = dict(optimizer="adam", lr=1e-3, weight_decay=1e-4,
                  momentum=0.0, schedule="constant")
    alg = algorithms.build("fedprox", model, hyperparameters={"mu": 0.01},
                           client=client, num_clients=5)
    server, clients = alg.init(jax.random.key(0))
  """
  optimizer = client_optimizer(client)
  alg = create(name, model, optimizer=optimizer, hparams=hyperparameters,
               num_clients=num_clients, data=data, seed=seed,
               prepared=prepared)
  if isinstance(optimizer, RunProgress) and not isinstance(alg.client.optimizer,
                                                           RunProgress):
    raise ConfigError(f"{name}: client.schedule='cosine' (or "
                      f"{spec(name).section}.client.schedule) is not supported: "
                      f"{name} wraps the client optimizer in a transform that "
                      "does not pass the run's progress on; use "
                      "schedule='constant'")
  return alg


def takes_context(name: str, what: str) -> bool:
  """Whether algorithm `name`'s `build` takes context argument `what`
  ("seed", "data", ...)."""
  return what in inspect.signature(spec(name).module.build).parameters


def _traced(name: str, hp: Mapping[str, Any]) -> tuple[str, ...]:
  """The hyperparameters of `hp` its recipes take as values: the module's
  TRACED ones that are numbers (not bools) and that no variant fixes."""
  s = spec(name)
  return tuple(k for k in s.traced if k in hp and k not in s.overrides
               and isinstance(hp[k], (int, float)) and not isinstance(hp[k], bool))


# The parts of `recipe_key`, named (`fedjax_dg.run.batches.explain`).
RECIPE_KEY_PARTS = (
    "the recipe kind", "the algorithm", "the model's architecture",
    "the algorithm's hyperparameters (those not in its module's TRACED)",
    "the clients' optimizer (other than its learning rate)",
    "the number of clients", "which hyperparameters are traced",
    "whether the learning rate is traced", "the seed (its build reads it)",
    "its run's data (it is built from them)",
    "the size of the server's split (data.server_fraction)")


def recipe_key(name: str, model, *, hyperparameters: Mapping[str, Any],
               client: Mapping[str, Any], num_clients: int, data=None,
               seed: int = 0) -> tuple:
  """What `recipe(...)` with these arguments is cached and batched by
  (`RECIPE_KEY_PARTS`), computed without building it."""
  s = spec(name)
  hp = dict(hyperparameters)
  traced = _traced(name, hp)
  lr_traced = not s.static_client_lr
  static_hp = {k: v for k, v in hp.items() if k not in traced}
  static_client = {k: v for k, v in client.items()
                   if not (lr_traced and k == "lr")}
  prepared = s.uses_data(hp) and s.batchable(hp)  # data-built: values
  server = (int(getattr(data, "server_size", 0) or 0)
            if s.needs_server_data else None)  # its split's shape
  return ("registry", name, model.structure(),
          tuple(sorted((k, repr(v)) for k, v in static_hp.items())),
          tuple(sorted((k, repr(v)) for k, v in static_client.items())),
          int(num_clients), traced, lr_traced,
          int(seed) if takes_context(name, "seed") and not prepared else None,
          id(data) if (takes_context(name, "data") and s.uses_data(hp)
                       and not prepared) else None, server)


def recipe_values(name: str, model, *, hyperparameters: Mapping[str, Any],
                  client: Mapping[str, Any], data=None, seed: int = 0) -> dict:
  """A run's values of its recipe (`recipe`): float32 arrays; and, for an
  algorithm built from its data with a `prepare`, what it derives from
  `data` and `seed` (`prepared`)."""
  s = spec(name)
  hp = dict(hyperparameters)
  values = dict(mean=np.asarray(model.mean, np.float32),
                std=np.asarray(model.std, np.float32),
                hp={k: np.float32(hp[k]) for k in _traced(name, hp)})
  if not s.static_client_lr:
    values["lr"] = np.float32(client["lr"])
  if s.uses_data(hp) and s.batchable(hp):
    if data is None:
      raise NeedsDataError(f"{name} derives arrays from the run's data: "
                           "recipe_values(..., data=fed)")
    values["prepared"] = s.module.prepare(model, data=data, seed=seed,
                                          **{**hp, **s.overrides})
  return values


def recipe(name: str, model, *, hyperparameters: Mapping[str, Any],
           client: Mapping[str, Any], num_clients: int, data=None,
           seed: int = 0) -> Recipe:
  """Algorithm `name` (the arguments of `build`) as a `Recipe`: what its
  runs may differ in without another compile is an argument of its
  programs, `Recipe.values` (`recipe_values`):

      mean, std   the model's input normalization (float32 [channels])
      lr          the clients' learning rate (not with STATIC_CLIENT_LR)
      hp          its module's TRACED float hyperparameters

  Everything else (the other hyperparameters and client settings, the
  model's architecture, the number of clients; the seed where `build`
  reads it, the data where it derives something from them) is the recipe's
  key (`recipe_key`): recipes with equal keys share their compiled
  programs. The template is built from the given values, so every check
  of `build` runs on them. An algorithm built from its run's data
  (`uses_data`) is a recipe without values (`Recipe.of`): its programs
  belong to that run.

  Example::

      rec = algorithms.recipe("fedprox", model, hyperparameters={"mu": 0.01},
                              client=client, num_clients=fed.num_clients)
      other = algorithms.recipe_values("fedprox", model,
                                       hyperparameters={"mu": 0.1},
                                       client=client)
      a, b = engine.run_batch(rec, [fed, fed], None, cfg, seeds=(0, 0),
                              values=[rec.values, other])
  """
  hp, client = dict(hyperparameters), dict(client)
  if not spec(name).batchable(hp):
    # Built from its run's data (numpy on concrete arrays): everything a
    # constant of its programs, as an Algorithm built by hand.
    return Recipe.of(build(name, model, hyperparameters=hp, client=client,
                           num_clients=num_clients, data=data, seed=seed),
                     model)
  key = recipe_key(name, model, hyperparameters=hp, client=client,
                   num_clients=num_clients, data=data, seed=seed)
  traced, lr_traced = key[6], key[7]
  static_hp = {k: v for k, v in hp.items() if k not in traced}
  static_client = {k: v for k, v in client.items()
                   if not (lr_traced and k == "lr")}
  base = model.structure()

  values = recipe_values(name, model, hyperparameters=hp, client=client,
                         data=data, seed=seed)
  prepared = "prepared" in values

  def make(v):
    m = base.normalized_by(v["mean"], v["std"])
    c = dict(static_client, **({"lr": v["lr"]} if lr_traced else {}))
    # Data-built parts come as values: no data, no seed in the build.
    alg = build(name, m, hyperparameters={**static_hp, **v["hp"]}, client=c,
                num_clients=num_clients, data=None if prepared else data,
                seed=0 if prepared else seed, prepared=v.get("prepared"))
    return alg, alg.model or m

  template = build(name, model, hyperparameters=hp, client=client,
                   num_clients=num_clients, data=data, seed=seed,
                   prepared=values.get("prepared"))
  return Recipe(key, make, values, template=(template, template.model or model))


__all__ = ["Algorithm", "ClientContext", "ClientData", "ClientResult",
           "REFERENCE", "ServerState", "Spec", "TABLE_ORDER", "available", "build", "client_defaults", "describe",
           "client_optimizer", "client_settings", "create", "hyperparameters",
           "modules", "needs_server_data", "reads_client_data", "recipe",
           "recipe_key", "recipe_values", "spec", "takes_context",
           "uses_data"]
