"""Installs the locked requirements into a virtual environment (`make setup`).

    python tools/install.py VENV_PYTHON -r requirements.lock ...

With uv (installed into the environment first, from the same package indexes
pip uses) when this machine's pip configuration is one uv can follow: its
index, extra indexes, find-links folders and constraints files are passed on
as uv's options, and its certificate file as SSL_CERT_FILE. uv downloads and
installs in parallel, and compiles the bytecode up front as pip does
(`--compile-bytecode`): where PYTHONDONTWRITEBYTECODE is set Python would
otherwise compile every module it imports, in every process, from source (a
process importing the library and JAX started in 4.0 s instead of 1.7 s on a
2-core Intel Xeon). Faster than pip, which takes 60-120 s for the lock on a
2-core machine. With pip where uv cannot be installed, where pip's
configuration holds a setting this script does not know how to pass on (a
proxy, a trusted host, ...), or where uv fails: pip then installs exactly what
it installed before, so a machine uv does not suit is never left half set up.
"""

import os
import subprocess
import sys

UV = "uv==0.13.9"
# pip settings -> uv options (each may hold several space-separated values).
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraints"}
# Passed on as uv's environment (SSL_CERT_FILE).
CERT = "cert"
# Settings that change nothing uv resolves or downloads.
HARMLESS = {"default-timeout", "timeout", "disable-pip-version-check",
            "no-cache-dir", "progress-bar", "quiet", "no-input",
            "root-user-action"}


def parse_config_list(text: str) -> dict[str, str]:
  """{name: value} of `pip config list`'s output, where pip's precedence
  decides between two lines of one name: a PIP_* variable (`:env:.name`)
  over the `[install]` section over `[global]`."""
  rank = {":env:": 2, "install": 1}
  settings, ranks = {}, {}
  for line in text.splitlines():
    key, sep, value = line.partition("=")
    if not sep:
      continue
    section, _, name = key.strip().partition(".")
    if rank.get(section, 0) >= ranks.get(name, -1):
      settings[name], ranks[name] = value.strip().strip("'\""), rank.get(section, 0)
  return settings


def pip_settings(python: str) -> dict[str, str]:
  """This machine's pip settings (`pip config list`: every file and PIP_*
  variable)."""
  return parse_config_list(subprocess.run(
      [python, "-m", "pip", "config", "list"], check=True,
      capture_output=True, text=True).stdout)


def uv_command(python: str, settings: dict[str, str], args: list[str]):
  """(uv's command, its environment), or None when pip's configuration has a
  setting uv would not follow."""
  unknown = set(settings) - set(OPTIONS) - {CERT} - HARMLESS
  if unknown:
    print(f"tools/install.py: pip's configuration sets {sorted(unknown)}, which"
          " this script does not pass on to uv; installing with pip")
    return None
  # pip takes the best match over all its indexes; uv, by default, only the
  # first index that has the package.
  cmd = [os.path.join(os.path.dirname(python), "uv"), "pip", "install",
         "--python", python, "--index-strategy", "unsafe-best-match",
         "--compile-bytecode"]
  for name, option in OPTIONS.items():
    for value in settings.get(name, "").split():
      cmd += [option, value]
  env = dict(os.environ)
  if CERT in settings:
    env["SSL_CERT_FILE"] = settings[CERT]
  return cmd + args, env


def main(argv: list[str]) -> int:
  python, args = argv[0], argv[1:]
  settings = pip_settings(python)
  planned = uv_command(python, settings, args)
  if planned is not None:
    got_uv = subprocess.run([python, "-m", "pip", "install", "-q", UV]).returncode == 0
    if got_uv and subprocess.run(planned[0], env=planned[1]).returncode == 0:
      return 0
    print("tools/install.py: uv could not install; installing with pip")
  return subprocess.run([python, "-m", "pip", "install", *args]).returncode


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
