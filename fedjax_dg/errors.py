"""The errors a user can fix: the `fedjax-dg` command prints them without a
traceback (any other exception is a bug and shows its traceback).

Low in the import graph (imports nothing), so every layer raises them.
"""


class ConfigError(ValueError):
  """A bad setting: names the key, the value and what is allowed."""


class DataError(ConfigError):
  """The data a setting points at is missing, unreadable or cannot be fetched:
  says where it was looked for and what to do."""


class NonFiniteError(ConfigError):
  """Training went non-finite (NaN / inf): names the algorithm, the round and
  the quantity, and the settings that usually cause it."""


class Stopped(KeyboardInterrupt):
  """Ctrl-C once a run (or sweep) directory exists: `run_dir`, what
  `--resume` continues (its finished runs and last checkpoints are kept)."""

  def __init__(self, run_dir: str):
    super().__init__(run_dir)
    self.run_dir = run_dir


class NeedsDataError(ConfigError):
  """An algorithm derives something from the run's data and was built without
  it. Raised after its settings are checked, so validation before any data is
  read builds it without data and takes this error as "settings valid"."""
