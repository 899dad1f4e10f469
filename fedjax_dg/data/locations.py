"""Where prepared data live: the one data-directory rule of every entry point.

The command, Python and the notebooks all find prepared data the same way
(`data_dir_default`), and every message about a data directory says which rule
chose it (`data_dir_origin`), so a dataset prepared elsewhere is findable.
"""

from __future__ import annotations

import os

ENV_DATA_DIR = "FEDJAX_DG_DATA_DIR"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "fedjax_dg", "tfds")


def data_dir_default() -> str:
  """Where prepared data live, one rule for every entry point (the command,
  Python, the notebooks): `$FEDJAX_DG_DATA_DIR` if set; else the checkout's
  `.data/` when fedjax_dg runs from a checkout that has one (what `make demo`
  / `make test` prepare); else `~/.cache/fedjax_dg/tfds`."""
  if os.environ.get(ENV_DATA_DIR):
    return os.path.expanduser(os.environ[ENV_DATA_DIR])
  checkout = _checkout_data_dir()
  if os.path.isdir(checkout):
    return checkout
  return os.path.expanduser(DEFAULT_DATA_DIR)


def _checkout_data_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), ".data")


def data_dir_origin() -> str:
  """Which rule of `data_dir_default` chose the data directory."""
  if os.environ.get(ENV_DATA_DIR):
    return f"${ENV_DATA_DIR} is set"
  if os.path.isdir(_checkout_data_dir()):
    return f"the checkout's .data/ (no ${ENV_DATA_DIR})"
  return f"the default (no ${ENV_DATA_DIR}, no checkout .data/)"


def data_dir_line(data_dir: str | None = None) -> str:
  """"data directory: PATH (the rule that chose it)", as `fedjax-dg
  datasets` and `prepare` print it; `data_dir`: one given explicitly."""
  if data_dir:
    return f"data directory: {os.path.expanduser(data_dir)} (given)"
  return (f"data directory: {data_dir_default()} ({data_dir_origin()}; "
          "the rule: fedjax_dg.data.locations.data_dir_default)")


def data_dir_candidates() -> list[str]:
  """Every data directory `data_dir_default` picks in some setting:
  `$FEDJAX_DG_DATA_DIR` (if set), the checkout's `.data/`, the default."""
  env = os.environ.get(ENV_DATA_DIR)
  return ([os.path.expanduser(env)] if env else []) + [
      _checkout_data_dir(), os.path.expanduser(DEFAULT_DATA_DIR)]
