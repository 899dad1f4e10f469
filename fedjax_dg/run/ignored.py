"""No ignored setting: a value given for a field that another setting
overrides is refused before anything is computed, naming the field that wins
and what to set instead (a sweep's rows are labelled by their grid values, so
a value that never took effect would label a run that did not use it).

What wins over what (`winners`):

* `client.<key>` (the run's client optimizer) loses to an algorithm's own
  `<section>.client.<key>` where that is not None: its module's `CLIENT`
  default (FedProx's lr 1e-3) or a value the config set.
* `<section>.<key>` loses, for a variant of that section, to the value the
  variant fixes (`hfedf_no_gradalign` fixes `hfedf.gradalign=False`).
* `<section>.*` of an algorithm no run uses reaches nothing.
* `train.epochs` loses to `train.local_steps` > 0, and for pFedHN to
  `pfedhn.local_steps` > 0 (fixed local steps instead of epochs), as
  `train.local_steps` does.
* `data.d`, `data.k_per_domain`, `data.alpha`, `data.min_partition_size`
  reach only the partitioners that read them (`partition.FIELDS`);
  `data.k_per_domain` loses to a client count (`data.num_clients` > 0).
* (`scenario` against the fields it fixes is `presets.resolve_scenario`'s.)

`check` refuses every value given on the command line (`--set`, `--grid`:
`given`) that an algorithm of the run does not train with, and, whatever set
them (an experiment file, Python), run-wide client fields that a module's
`CLIENT` default silently overrides (a per-algorithm value the config sets
itself, as the presets do, is its choice). Refused rather than applied: a
module's `CLIENT` is its paper's setting, and which of two values a user
meant is theirs to say (docs/faithfulness.md, "Settings that do not take
effect").
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from fedjax_dg import algorithms
from fedjax_dg.data import partition
from fedjax_dg.errors import ConfigError
from fedjax_dg.run import assemble
from fedjax_dg.run.config import ConfigDict, explicit, lookup

EVERY = "every run"
PARTITION_FIELDS = sorted({f for fields in partition.FIELDS.values()
                           for f in fields} - {"num_clients"})


@dataclasses.dataclass(frozen=True)
class Winner:
  """A setting that wins over a given one for `who` (an algorithm or
  `EVERY`): `field` (with its value), why it holds it, what to do."""
  who: str
  field: str
  origin: str
  fix: str


def _section_local_steps(cfg: ConfigDict, name: str) -> int:
  section = algorithms.spec(name).section
  return int(cfg[section].get("local_steps", 0) or 0)


def winners(cfg: ConfigDict, key: str) -> list[Winner]:
  """The settings of `cfg` (resolved: `assemble.resolve`) that win over
  `key`'s value for some algorithm of the run (module docstring)."""
  head, _, leaf = key.partition(".")
  names = list(cfg.algorithms)
  out = []
  if head == "client" and leaf in algorithms.CLIENT_KEYS:
    value = cfg.client[leaf]
    for name in names:
      section = algorithms.spec(name).section
      own = cfg[section].client[leaf]
      if own is None or own == value:
        continue
      origin = ("set in the config" if leaf in explicit(cfg[section].client)
                else f"its module's default: CLIENT in "
                f"fedjax_dg/algorithms/{section}.py")
      out.append(Winner(
          name, f"{section}.client.{leaf}={own!r}", origin,
          f"set {section}.client.{leaf} for {name} (or {section}.client."
          f"{leaf}=None: client.{leaf} then applies to {name} too)"))
  elif head in algorithms.modules() and not leaf.startswith("client."):
    for name in names:
      spec = algorithms.spec(name)
      if (spec.section == head and leaf in spec.overrides
          and spec.overrides[leaf] != cfg[head][leaf]):
        out.append(Winner(
            name, name, f"the variant fixes {key}={spec.overrides[leaf]!r}",
            f"vary {key} on {head} itself (algorithms={head}), or leave "
            f"{name} out"))
  elif key in ("train.epochs", "train.local_steps"):
    if key == "train.epochs" and cfg.train.local_steps:
      out.append(Winner(
          EVERY, f"train.local_steps={cfg.train.local_steps}",
          "that many local steps per round, whatever the epochs",
          "set train.local_steps=0 to train by epochs, or vary "
          "train.local_steps instead"))
    for name in names:
      steps = _section_local_steps(cfg, name)
      if steps:
        section = algorithms.spec(name).section
        out.append(Winner(
            name, f"{section}.local_steps={steps}",
            f"{name}'s own fixed local steps, instead of the engine's",
            f"set {section}.local_steps=0 ({key} then applies to {name})"))
  elif head == "data" and leaf in PARTITION_FIELDS:
    name = partition.ALIASES.get(cfg.data.partition, cfg.data.partition)
    reads = partition.FIELDS.get(name, ())
    if leaf not in reads:
      users = [p for p, fields in partition.FIELDS.items() if leaf in fields]
      out.append(Winner(
          EVERY, f"data.partition={cfg.data.partition!r}",
          "it reads " + ", ".join(f"data.{f}" for f in reads) + " only",
          f"drop {key}, or use a partition that reads it "
          f"(data.partition={' / '.join(users)})"))
    elif leaf == "k_per_domain" and cfg.data.num_clients:
      out.append(Winner(
          EVERY, f"data.num_clients={cfg.data.num_clients}",
          "a client count wins: k = num_clients / source domains",
          "set data.num_clients=0 to give k_per_domain"))
  return out


def _refusal(key: str, value, flag: str, w: Winner) -> ConfigError:
  given = f"{flag} {key}={value!r}" if flag else f"{key}={value!r} is set, but it"
  if w.who == EVERY:
    return ConfigError(f"{given} changes no run: {w.field} ({w.origin}) wins "
                       f"over it. Instead: {w.fix}")
  return ConfigError(f"{given} does not reach {w.who}: {w.who} trains with "
                     f"{w.field} ({w.origin}), which wins over {key}. "
                     f"Instead: {w.fix}")


def given_keys(sets=(), grid_keys=()) -> dict[str, str]:
  """{key: "--set" / "--grid"} of what the command line sets: `sets` the
  `key=value` strings, `grid_keys` the grid's keys."""
  given = {item.split("=", 1)[0].strip(): "--set" for item in sets or ()}
  given.update({key: "--grid" for key in grid_keys})
  return given


def check(cfg: ConfigDict, given: Mapping[str, str] | None = None) -> None:
  """A ConfigError for the first given value that does not take effect:
  `given` maps each command-line key to its flag ("--set" / "--grid"),
  refused for any winner; run-wide client fields the config set are refused
  where a module's `CLIENT` default wins over them."""
  cfg = assemble.resolve(cfg)
  given = dict(given or {})
  for key, flag in given.items():
    ws = winners(cfg, key)
    if ws:
      raise _refusal(key, lookup(cfg, key), flag, ws[0])
  for leaf in sorted(explicit(cfg.client)):
    key = f"client.{leaf}"
    if key in given:
      continue
    for w in winners(cfg, key):
      if w.origin.startswith("its module's default"):
        raise _refusal(key, cfg.client[leaf], "", w)


def check_sections(given: Mapping[str, str],
                   used: Iterable[Iterable[str]]) -> None:
  """A ConfigError for a given key of an algorithm section that no run uses:
  `used` holds each config's (a sweep's cells') algorithms."""
  sections = {algorithms.spec(n).section for names in used for n in names}
  for key, flag in given.items():
    head = key.split(".", 1)[0]
    if head in algorithms.modules() and head not in sections:
      raise ConfigError(
          f"{flag} {key} changes no run: no algorithm of section {head} runs "
          f"(algorithms: {', '.join(sorted(sections))}). Add {head} (or one "
          f"of its variants) to algorithms, or drop {key}")
