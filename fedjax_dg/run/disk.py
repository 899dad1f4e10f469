"""The disk a run's checkpoints take: the check before a run starts
(`check_disk`) and `fedjax-dg algorithms --config`'s table of checkpoint
sizes (`checkpoint_table`)."""

from __future__ import annotations

import os
import shutil

from fedjax_dg import algorithms, engine
from fedjax_dg.errors import ConfigError
from fedjax_dg.run import assemble, checks
from fedjax_dg.run.directory import MANIFEST
from fedjax_dg.run.config import ConfigDict


# Kept free beside the checkpoints: a run also writes results.json,
# metrics.jsonl, TensorBoard events and orbax's temporary files.
RESERVE = 2**26


def check_disk(name: str, alg, run_dir: str, echo, *, keep: int = 1,
               runs: int = 1) -> None:
  """Says how much disk the algorithm's checkpoints take, and refuses to start
  when the run directory's disk has less free than their peak plus `RESERVE`:
  `keep` per run (`train.checkpoints_to_keep`) and the one being written
  (`engine.checkpoints_held`); `runs` > 1 when finished runs keep theirs
  (`train.keep_checkpoints=True`: this algorithm's runs still to do). The
  refusal says what it reserves and why, and what to do where the run is (a
  sweep's cell: its --resume and --out; a run: output_dir)."""
  size = engine.checkpoint_bytes(alg)
  count = keep * (runs - 1) + engine.checkpoints_held(keep)
  need = count * size
  free = shutil.disk_usage(run_dir).free
  echo(f"{name}: checkpoints of {size / 2**20:.1f} MiB (at most {count} at a "
       f"time: {need / 2**20:.1f} MiB); {free / 2**30:.1f} GiB free")
  if free >= need + RESERVE:
    return
  parent = os.path.dirname(os.path.abspath(run_dir))
  sweep = parent if os.path.isfile(os.path.join(parent, MANIFEST)) else None
  fewer = (" with fewer checkpoints kept (--set train.checkpoints_to_keep=1;"
           " a batch of replicas keeps 2 each in any case)" if keep > 1 else "")
  todo = (f"free space on that disk, then continue with fedjax-dg sweep "
          f"--resume {sweep}; or start the sweep anew on a disk with room "
          f"(--out DIR there){fewer}" if sweep else
          "free space on that disk; or run again on a disk with room "
          f"(--set output_dir=DIR there){fewer}")
  raise ConfigError(
      f"{name}: its checkpoints need {mib(need)} MiB ({count} of "
      f"{mib(size)} MiB) plus {RESERVE // 2**20} MiB kept free for the "
      "run's other files (results.json, metrics.jsonl, TensorBoard events, "
      f"orbax's temporary files), {mib(need + RESERVE)} MiB in all, but only "
      f"{free // 2**20} MiB are free at {run_dir}: {todo}")


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
  cfg = assemble.resolve(cfg)
  checks.validate(cfg)
  dataset = assemble.load_dataset(cfg)
  target = assemble.target_domains(cfg, dataset.domain_names)[0]
  fed = assemble.federate(cfg, dataset, target)
  model = assemble.make_model(cfg, fed, *assemble.normalization(cfg, dataset, fed))
  with_server = None
  sizes = {}
  for name in names or cfg.algorithms:
    runs_on = algorithms.spec(name).models
    if runs_on and cfg.model.name not in runs_on:
      sizes[name] = f"runs on {' / '.join(runs_on)}"
      continue
    data = fed
    if algorithms.needs_server_data(name) and not fed.server_size:
      if with_server is None:
        other = cfg.copy_and_resolve_references()
        other.data.server_fraction = SIZE_SERVER_FRACTION
        with_server = assemble.federate(other, dataset, target)
      data = with_server
    alg = assemble.algorithm(name, model, data.num_clients, cfg, data=data)
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
