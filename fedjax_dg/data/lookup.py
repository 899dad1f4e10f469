"""Finding a dataset by name: its registry entry, whether it is prepared, and
where else to look when it is not there.
"""

from __future__ import annotations

import os
import shlex

from fedjax_dg.data.locations import (ENV_DATA_DIR, data_dir_candidates,
                                      data_dir_default, data_dir_line,
                                      data_dir_origin)
from fedjax_dg.data.provenance import prepare_command, recorded_source
from fedjax_dg.data.registry import (BUILT_IN, CatalogEntry, OwnEntry,
                                     available, prepared_dir, user_datasets)
from fedjax_dg.errors import ConfigError


def lookup(name: str,
           data_dir: str | None = None) -> OwnEntry | CatalogEntry:
  """The registry entry of `name`: a built-in dataset, or a folder dataset
  prepared in `data_dir`; an unknown name is a ConfigError saying where it
  was looked for (`where_to_find`)."""
  if name in BUILT_IN:
    return BUILT_IN[name]
  own = user_datasets(data_dir)
  if name not in own:
    raise ConfigError(
        f"unknown dataset name {name!r}; available: "
        f"{', '.join(available(data_dir))}. {where_to_find(name, data_dir)}")
  return own[name]


def where_to_find(name: str, data_dir: str | None = None) -> str:
  """Where a dataset `name` was looked for (the data directory and the rule
  that chose it) and what to do: a folder dataset of that name prepared in
  another data directory (e.g. `~/.cache/...` before the checkout's `.data/`
  existed) is named, with its folder; else how to prepare one."""
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  given = os.path.realpath(data_dir) != os.path.realpath(data_dir_default())
  origin = "given: data.data_dir" if given else data_dir_origin()
  text = f"Looked in the data directory {data_dir} ({origin})"
  here = (f"{ENV_DATA_DIR}={shlex.quote(data_dir)} " if given else "")
  for other in dict.fromkeys(data_dir_candidates()):
    if os.path.realpath(other) == os.path.realpath(data_dir):
      continue
    entry = user_datasets(other).get(name)
    if entry is None:
      continue
    folder = (recorded_source(entry, other) or {}).get("path") or "DIR"
    return (f"{text}; a folder dataset {name!r} is prepared in another data "
            f"directory, {other} (from {folder}): run with --set "
            f"data.data_dir={shlex.quote(other)} (or set {ENV_DATA_DIR}="
            f"{shlex.quote(other)}), or prepare it here: {here}"
            f"{prepare_command(name, entry, folder)}")
  return (f"{text}; a folder of your own: {here}fedjax-dg prepare folder "
          f"--manual-dir DIR --name {name}")


def describe_available(data_dir: str | None = None) -> str:
  """One line per dataset: name, kind, domains, prepared or not (for
  `fedjax-dg datasets`)."""
  lines = [data_dir_line(data_dir)]
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  for name in available(data_dir):
    entry = lookup(name, data_dir)
    ready = is_prepared(name, data_dir)
    if isinstance(entry, OwnEntry):
      kind = "your folder" if entry.builder == "Folder" else "own builder"
      domains = (f", domains {list(entry.domains)}" if entry.domains else "")
    else:
      kind, domains = "TFDS catalog", f", domains {list(entry.configs)}"
    state = {True: "prepared", False: "not prepared",
             None: "downloaded by TFDS on first use"}[ready]
    lines.append(f"  {name:24s} {kind}{domains}: {state}")
  return "\n".join(lines)


def is_prepared(name: str, data_dir: str | None = None) -> bool | None:
  """Whether `name` (one of the project's own builders or a prepared folder)
  is prepared in `data_dir`; None for a TFDS catalog dataset (downloaded by
  TFDS on first use)."""
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  entry = lookup(name, data_dir)
  if not isinstance(entry, OwnEntry):
    return None
  return os.path.exists(os.path.join(prepared_dir(entry, data_dir),
                                     "dataset_info.json"))
