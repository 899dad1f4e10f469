"""What a run is asked to do: `EngineConfig` (the config's `train` section,
plus `seed`) and its validation, the allowed values of its choices, and what a
run gives back (`RunResult`).

Every other engine module reads its settings from here; nothing here knows how
they are carried out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_dg.client.update import SHUFFLES
from fedjax_dg.errors import ConfigError

PyTree = Any
MAPPINGS = ("auto", "vmap", "map", "shard")
PLACEMENTS = ("auto", "device", "host")
HOST_GATHERS = ("auto", "clients", "rows")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How a run is executed (the config's `train` section, plus `seed`)."""
  rounds: int = 200             # the hFedF papers' 200 rounds
  eval_every: int = 5
  epochs: int = 2
  local_steps: int = 0          # > 0: this many local steps instead of epochs
  batch_size: int = 64
  cohort_size: int = 0          # 0: every client every round
  client_mapping: str = "auto"
  map_batch_size: int = 1
  skip_idle_steps: bool = True  # a client's steps past its own count are not
                                # computed (False: computed and discarded)
  vmap_lanes: int = 0           # vmapped clients: lanes per device (0: auto,
                                # `layout.resolve_lanes`)
  placement: str = "auto"       # where client data and state live: "device"
                                # (the whole run), "host" (gathered per chunk
                                # of rounds), "auto"
                                # (`placement.resolve_placement`)
  host_gather: str = "auto"     # what "host" gathers per cohort member: its
                                # whole client ("clients") or only the rows
                                # its local steps read ("rows"); "auto"
                                # (`placement.resolve_gather`)
  shuffle: str = "sort"         # each pass's order of a client's examples:
                                # "sort" (uniform draws over its padded
                                # width, sorted) or "feistel" (a keyed
                                # permutation evaluated only at the
                                # positions the steps read; other numbers)
                                # (`client.update.local_training`)
  seed: int = 0
  eval_batch_size: int = 500
  ood_eval_max: int = 2000      # target examples scored between chunks (0: all)
  features_max: int = 0         # target examples whose features the final
                                # model keeps (RunResult.features; t-SNE plot)
  progress: bool = True
  checkpoints_to_keep: int = 1  # the latest checkpoints kept on disk while a
                                # run goes (orbax max_to_keep; with
                                # checkpoint_dir)
  checkpoint_every: float = 60.0  # seconds: a chunk's end writes the
                                # checkpoints when at least this long has
                                # passed since the last write (or since the
                                # run started); 0: after every chunk. An
                                # interruption loses at most this much
                                # training; a resume is exact either way

  def validate(self, num_clients: int | None) -> None:
    """Every setting; the cohort against `num_clients` (None: not known yet,
    before the data is read)."""
    checks = [
        ("rounds", self.rounds >= 1, "an integer >= 1"),
        ("eval_every", self.eval_every >= 1, "an integer >= 1"),
        ("epochs", self.epochs >= 1, "an integer >= 1"),
        ("local_steps", self.local_steps >= 0, "0 (use epochs) or an integer >= 1"),
        ("batch_size", self.batch_size >= 1, "an integer >= 1"),
        ("cohort_size", 0 <= self.cohort_size <= (num_clients or
                                                  self.cohort_size),
         "0 (all clients) or " + (f"1..{num_clients}" if num_clients
                                  else "a positive count")),
        ("client_mapping", self.client_mapping in MAPPINGS, f"one of {MAPPINGS}"),
        ("placement", self.placement in PLACEMENTS, f"one of {PLACEMENTS}"),
        ("host_gather", self.host_gather in HOST_GATHERS,
         f"one of {HOST_GATHERS}"),
        ("shuffle", self.shuffle in SHUFFLES,
         f"one of {SHUFFLES} (docs/scale.md, \"Permutation draws\")"),
        ("map_batch_size", self.map_batch_size >= 1, "an integer >= 1"),
        ("vmap_lanes", self.vmap_lanes >= 0,
         "0 (auto: from the clients' sizes) or an integer >= 1"),
        ("eval_batch_size", self.eval_batch_size >= 1, "an integer >= 1"),
        ("ood_eval_max", self.ood_eval_max >= 0, "0 (all) or a positive count"),
        ("features_max", self.features_max >= 0, "0 (none) or a positive count"),
        ("checkpoints_to_keep", self.checkpoints_to_keep >= 1,
         "an integer >= 1 (the latest checkpoints kept)"),
        ("checkpoint_every", self.checkpoint_every >= 0,
         "seconds >= 0 (0: a checkpoint after every chunk)"),
    ]
    if self.seed < 0:
      raise ConfigError(f"invalid setting seed={self.seed!r}: allowed values are "
                        "integers >= 0")
    for field, ok, allowed in checks:
      if not ok:
        raise ConfigError(f"invalid setting train.{field}={getattr(self, field)!r}: "
                         f"allowed values are {allowed}")
    if num_clients is not None and num_clients < 1:
      raise ConfigError("the federation has zero clients: check the partition "
                       "settings (num_clients / d)")


@dataclasses.dataclass
class RunResult:
  """One finished run (`runner.run`, `runner.run_batch`)."""
  algorithm: str
  server: PyTree
  clients: PyTree
  history: list[dict]            # one entry per evaluation (between chunks)
  round_metrics: dict[str, list] # per-round training metrics
  final: dict                    # last evaluation on the full target split
  seconds: float                 # wall time, every resumed part included
  # `features_max` target examples: {"features": [n, F], "labels": [n]} of
  # the evaluated model (`Model.features`); None when not asked for, without
  # a target split, or for a personalized algorithm (one model per client).
  features: dict | None = None


def eval_batch(cfg: EngineConfig, n: int) -> int:
  """The evaluation batch for `n` examples: `eval_batch_size`, at most `n`
  (at least 1)."""
  return max(1, min(cfg.eval_batch_size, n))
