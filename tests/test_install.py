"""Install paths: the accelerator extras pin the locked jax, the README shows
them after `make demo` / `make test`, and the Colab install cell has no
placeholder and installs from the repository it sits in."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def locked(name):
  text = open(os.path.join(ROOT, "requirements.lock")).read()
  (version,) = re.findall(rf"^{re.escape(name)}==(\S+)$", text, re.M | re.I)
  return version


def test_accelerator_extras_pin_the_locked_jax():
  extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))[
      "project"]["optional-dependencies"]
  jax = locked("jax")
  assert extras["cuda12"] == [f"jax[cuda12]=={jax}"]
  assert extras["tpu"] == [f"jax[tpu]=={jax}"]
  assert locked("jaxlib") == jax
  deps = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))[
      "project"]["dependencies"]
  assert any(d.lower().startswith("tensorboardx") for d in deps)
  assert locked("tensorboardX")


def test_readme_shows_make_first_then_the_accelerator_install():
  readme = open(os.path.join(ROOT, "README.md")).read()
  first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
  assert [l.split("#")[0].strip() for l in first] == ["make demo", "make test"]
  section = readme[readme.index("### Install on a GPU / TPU"):]
  for text in ('pip install -e ".[cuda12]"', 'pip install -e ".[tpu]"',
               "fedjax-dg doctor"):
    assert text in section


def install_cell():
  nb = json.load(open(os.path.join(ROOT, "colab", "quickstart.ipynb")))
  return next("".join(c["source"]) for c in nb["cells"]
              if c["cell_type"] == "code")


def test_colab_install_cell_has_no_placeholder():
  code = install_cell()
  assert "<repository-url>" not in code and "pip" in code
  assert not any(l.lstrip().startswith(("!", "%")) for l in code.splitlines())


@pytest.fixture
def not_installed(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "fedjax_dg" else real(name, *a)))
  calls = []
  monkeypatch.setattr(subprocess, "check_call", calls.append)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the cell prepends root
  return calls


def test_colab_install_cell_installs_this_checkout(not_installed, monkeypatch):
  monkeypatch.chdir(os.path.join(ROOT, "colab"))
  ns = {"__name__": "__main__"}
  exec(compile(install_cell(), "cell", "exec"), ns)
  ((*pip, target),) = not_installed
  assert pip[1:] == ["-m", "pip", "install", "-q", "-e"]
  assert target.removesuffix("[cuda12]") == os.path.abspath(ROOT)


def test_colab_install_cell_outside_the_repository_says_what_to_do(
    not_installed, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RuntimeError, match="not inside its repository"):
    exec(compile(install_cell(), "cell", "exec"), {"__name__": "__main__"})
  assert not not_installed


def make_dry_run(tmp_path, target: str, nvidia_smi: int | None) -> list[str]:
  """`make -n -B TARGET` (what it would run from scratch) with a fake
  `nvidia-smi` exiting `nvidia_smi` on PATH, or none (None)."""
  fake = tmp_path / "bin"
  fake.mkdir(exist_ok=True)
  if nvidia_smi is not None:
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\nexit {nvidia_smi}\n")
    (fake / "nvidia-smi").chmod(0o755)
  real = [d for d in os.environ["PATH"].split(os.pathsep)
          if not os.path.exists(os.path.join(d, "nvidia-smi"))]
  venv = str(tmp_path / "venv")
  out = subprocess.run(
      ["make", "-n", "-B", "-C", ROOT, "--no-print-directory", target,
       f"VENV={venv}", "PYTHON=python3"],
      env=dict(os.environ, PATH=os.pathsep.join([str(fake)] + real)),
      capture_output=True, text=True, check=True).stdout
  return out.replace(venv, "V").splitlines()


CPU_SETUP = ["python3 -m venv V",
             "python3 tools/install.py V/bin/python -q -r requirements.lock",
             "python3 tools/install.py V/bin/python -q --no-deps -e .",
             "V/bin/python -m compileall -q -j 0 fedjax_dg >/dev/null"]


@pytest.mark.parametrize("nvidia_smi", [None, 9], ids=["absent", "failing"])
def test_make_setup_without_a_working_gpu_is_the_cpu_install(tmp_path,
                                                             nvidia_smi):
  assert make_dry_run(tmp_path, "setup", nvidia_smi) == CPU_SETUP + [
      "touch V/.installed-stamp"]


def test_make_setup_and_demo_with_a_gpu_install_the_cuda12_extra(tmp_path):
  gpu = CPU_SETUP + ['V/bin/python -m pip install -q -e ".[cuda12]"',
                     "touch V/.installed-stamp-cuda12"]
  assert make_dry_run(tmp_path, "setup", 0) == gpu
  demo = make_dry_run(tmp_path, "demo", 0)
  assert demo[:len(gpu)] == gpu
  assert demo[-1] == "V/bin/python -m fedjax_dg.cli demo"


def _slug(heading: str) -> str:
  """GitHub's anchor of a markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_readme_links_resolve_to_files_and_headings():
  readme = open(os.path.join(ROOT, "README.md")).read()
  links = re.findall(r"\]\(([^)\s]+)\)", readme)
  local = [l for l in links if not l.startswith("http")]
  assert len(local) >= 8
  for link in local:
    path, _, anchor = link.partition("#")
    target = os.path.join(ROOT, path) if path else os.path.join(ROOT, "README.md")
    assert os.path.exists(target), link
    if anchor:
      headings = re.findall(r"^#+ (.+)$", open(target).read(), re.M)
      assert anchor in {_slug(h) for h in headings}, link


def test_readme_algorithm_table_has_every_algorithm_systems_first():
  """The four systems first (the table's papers: tests/test_docs.py)."""
  from fedjax_dg import algorithms
  readme = open(os.path.join(ROOT, "README.md")).read()
  table = readme[readme.index("## Algorithms and their papers"):]
  table = table[:table.index("\n## ")]
  rows = [l for l in table.splitlines() if l.startswith("| ") and "`" in l]
  names = [n for l in rows for n in re.findall(r"`(\w+)`", l.split("|")[2])]
  assert names[:4] == ["hfedf", "hypergenfl", "fedccrl", "fedsdaf"]
  assert set(algorithms.modules()) <= set(names)
  assert set(names) <= set(algorithms.available())
  assert len(names) == len(set(names))


def _tools_install():
  """tools/install.py as a module (`make setup` runs it as a script)."""
  spec = importlib.util.spec_from_file_location(
      "tools_install", os.path.join(ROOT, "tools", "install.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


install = _tools_install()

# What `pip config list` prints on these machines, plus an [install] line.
LISTED = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/elsewhere'
global.index-url='https://mirror.example/simple'
install.index-url='https://install.example/simple'
"""


def test_pips_precedence_decides_between_scopes():
  got = install.parse_config_list(LISTED)
  assert got["cert"] == "/etc/ssl/certs/ca-certificates.crt"  # PIP_CERT wins
  assert got["find-links"] == "/opt/wheels"
  assert got["index-url"] == "https://install.example/simple"  # [install]
  assert got["extra-index-url"].split() == ["file:///opt/pypi/simple",
                                            "file:///opt/pypi-more/simple"]


def test_every_index_link_and_constraint_reaches_uv():
  cmd, env = install.uv_command("/v/bin/python", install.parse_config_list(
      LISTED), ["-r", "requirements.lock"])
  assert cmd[:5] == ["/v/bin/uv", "pip", "install", "--python", "/v/bin/python"]
  pairs = list(zip(cmd, cmd[1:]))
  for pair in [("--index-url", "https://install.example/simple"),
               ("--extra-index-url", "file:///opt/pypi/simple"),
               ("--extra-index-url", "file:///opt/pypi-more/simple"),
               ("--find-links", "/opt/wheels"),
               ("--constraints", "/etc/xdg/pip/constraints.txt"),
               # pip's best match over all indexes, not uv's first index
               ("--index-strategy", "unsafe-best-match")]:
    assert pair in pairs, pair
  assert cmd[-2:] == ["-r", "requirements.lock"]
  # Bytecode compiled at install, as pip does: not per process at import.
  assert "--compile-bytecode" in cmd
  assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"


def test_a_setting_uv_would_not_follow_means_pip(capsys):
  settings = install.parse_config_list(LISTED + "global.proxy='http://p:3128'\n")
  assert install.uv_command("/v/bin/python", settings, []) is None
  assert "proxy" in capsys.readouterr().out
