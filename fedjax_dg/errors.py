"""The errors a user can fix: the `fedjax-dg` command prints them without a
traceback (any other exception is a bug and shows its traceback).

Low in the import graph (imports nothing of the project), so every layer
raises them.
"""

import errno


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


class DiskFull(ConfigError):
  """A write into a run (or sweep) directory failed for want of space (ENOSPC,
  also when orbax wraps it): names the directory; the CLI adds the command
  that continues the run once space is freed (`run_dir`, set by
  `experiment.run`; a resume is exact from the last complete checkpoint)."""

  def __init__(self, message: str, run_dir: str | None = None):
    super().__init__(message)
    self.run_dir = run_dir


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` or an exception it was raised from / during is an
  OSError ENOSPC (orbax and the asynchronous writers wrap it in their own
  errors; some keep only the message)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, DiskFull) or (
        isinstance(error, OSError) and error.errno == errno.ENOSPC):
      return True
    if "No space left on device" in str(error) or "ENOSPC" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


class StandInWarning(UserWarning):
  """Something of the protocol was replaced by a stand-in that makes the
  numbers meaningless or different from the paper's: random weights where a
  pretrained network belongs (CCST's AdaIN, a frozen ViT backbone), source
  domains left out of a partition. `experiment.run` records each in
  results.json's `warnings` and table.md, not only on stderr."""


class CheckpointWarning(UserWarning):
  """A run's checkpoint could not be read (damaged: a process killed while
  writing it, a full disk): the run resumed from an older one or started
  over. Only that run is affected; `experiment.run` records the warning in
  results.json's `warnings`."""
