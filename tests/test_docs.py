"""The documentation says what the code does: the README's example runs, its
algorithm table is the registry's, and the generated reference pages
(docs/_ext/fedjax_dg_docs.py: config fields, algorithms, the CLI) list
everything the code has."""

import importlib.util
import os
import re
import sys

import pytest

from fedjax_dg import algorithms, cli
from fedjax_dg.data import lookup
from fedjax_dg.run import config

ROOT = os.path.join(os.path.dirname(__file__), "..")
_spec = importlib.util.spec_from_file_location(
    "fedjax_dg_docs", os.path.join(ROOT, "docs", "_ext", "fedjax_dg_docs.py"))
gen = importlib.util.module_from_spec(_spec)
sys.modules["fedjax_dg_docs"] = gen   # its dataclasses look their module up
_spec.loader.exec_module(gen)


def readme() -> str:
  return open(os.path.join(ROOT, "README.md")).read()


# ------------------------------------------------------------------ README

# The README's example at a size a test affords: these settings shrunk, the
# code otherwise as printed (each must be found, so an edited example fails
# here until the test follows it).
SHRINK = [('max_per_domain=500', 'max_per_domain=40'),
          ('"small_cnn"', '"mlp"'),
          ('rounds=20', 'rounds=2')]


@pytest.mark.skipif(not lookup.is_prepared("rotated_fashion_mnist"),
                    reason="needs the prepared offline benchmark (make data)")
def test_the_readmes_python_example_runs(capsys):
  (code,) = re.findall(r"```python\n(.*?)```", readme(), re.S)
  for old, new in SHRINK:
    assert code.count(old) == 1, old
    code = code.replace(old, new)
  namespace = {"__name__": "__main__"}
  exec(compile(code, "README.md", "exec"), namespace)
  final = namespace["result"].final
  printed = capsys.readouterr().out.split()
  assert [float(v) for v in printed[-2:]] == [final["id_acc"], final["ood_acc"]]
  assert 0.0 <= final["ood_acc"] <= 1.0
  assert namespace["fed"].num_clients == 5
  assert "0" not in namespace["fed"].client_domains[0]   # the held-out domain


def readme_algorithm_rows() -> list[list[str]]:
  table = readme()[readme().index("## Algorithms and their papers"):]
  table = table[:table.index("\n## ")]
  return [[c.strip() for c in l.strip().strip("|").split("|")]
          for l in table.splitlines() if l.startswith("| ") and "`" in l]


def test_the_readmes_algorithm_table_is_the_registrys():
  """Every algorithm module once, with its PAPER's title, venue and year."""
  rows = readme_algorithm_rows()
  names = [re.findall(r"`(\w+)`", r[1]) for r in rows]
  assert all(len(n) == 1 for n in names), names
  names = [n[0] for n in names]
  assert sorted(names) == sorted(algorithms.modules())
  for (_, _, title, venue), name in zip(rows, names):
    paper = algorithms.spec(name).paper
    if paper:
      assert title == paper["title"], name
      assert venue == f"{paper['venue']}, {paper['year']}", name
    else:
      assert not venue, name


def test_every_algorithm_module_names_its_paper_or_is_a_reference():
  for name in algorithms.modules():
    paper = algorithms.spec(name).paper
    if algorithms.spec(name).federated:
      assert set(paper) == {"title", "authors", "venue", "year"}, name
      assert isinstance(paper["year"], int) and paper["title"], name
    else:
      assert paper == {}, name   # Central, Local-only: no paper


# ------------------------------------------------------- generated reference


def table_keys(page: str) -> dict[str, str]:
  """{dotted field: its row} of the config page: each `## \\`section\\`` or
  `### \\`section\\`` heading prefixes the first cells of its table rows."""
  out, prefix = {}, ""
  for line in page.splitlines():
    head = re.match(r"^#{2,3} `(\w+)`", line)
    if head:
      prefix = head.group(1) + "."
    elif line.startswith("## Top level"):
      prefix = ""
    elif line.startswith("| `"):
      key = re.match(r"^\| `([^`]+)`", line).group(1)
      assert prefix + key not in out, prefix + key
      out[prefix + key] = line
  return out


def test_the_config_reference_lists_every_base_config_field():
  fields = config.flatten(config.base_config().to_dict())
  rows = table_keys(gen.config_page())
  assert set(rows) == set(fields)
  for key, row in rows.items():
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
    default = gen._fmt(fields[key]).replace("|", "\\|")
    assert re.fullmatch(re.escape(default) + r" \(.+\)", cells[1]), key
    assert cells[2] and not cells[2].startswith(". **Allowed"), (
        f"{key} has no meaning")


def test_the_config_reference_states_the_allowed_values_the_code_holds():
  rows = table_keys(gen.config_page())
  from fedjax_dg.engine.settings import MAPPINGS
  for value in MAPPINGS:
    assert f"`{value}`" in rows["train.client_mapping"]
  assert "an integer >= 1" in rows["train.rounds"]      # EngineConfig.validate
  assert "`feistel`" in rows["train.shuffle"]
  assert "`autoencoder`" in rows["hfedf.embeddings"]    # hfedf.EMBEDDINGS


def test_written_meanings_are_of_real_fields():
  fields = config.flatten(config.base_config().to_dict())
  assert set(gen.MEANINGS) <= set(fields)
  assert set(gen.ALLOWED) <= set(fields)


def test_comment_meanings_read_trailing_continued_and_block_comments():
  source = (
      "def build(a, *,\n"
      "          b: int = 1,   # the b\n"
      "                        # continued\n"
      "          # about c\n"
      "          c: str = 'x',\n"
      "          d=2, e=3,     # shared\n"
      "          f=4):\n"
      "  pass\n")
  got = gen.comment_meanings(source, last_line=7)
  assert got == {"b": "the b continued", "c": "about c", "d": "shared",
                 "e": "shared"}


def test_an_algorithm_page_per_module_with_its_paper_and_settings(tmp_path):
  gen.write_pages(str(tmp_path))
  for name in algorithms.modules():
    page = open(tmp_path / "algorithms" / f"{name}.md").read()
    paper = algorithms.spec(name).paper
    if paper:
      assert paper["title"] in page, name
    rows = {re.match(r"^\| `([^`]+)`", l).group(1)
            for l in page.splitlines() if l.startswith("| `")}
    want = set(algorithms.hyperparameters(name)) | {
        f"client.{k}" for k in algorithms.CLIENT_KEYS}
    assert rows == want, name
    for variant in algorithms.spec(name).variants:
      assert f"`{variant}`" in page
  index = open(tmp_path / "algorithms.md").read()
  for name in algorithms.modules():
    assert f"(algorithms/{name}.md)" in index


def test_the_cli_reference_lists_every_command_and_option():
  page = gen.cli_page()
  parser = cli.parser()
  for name, _, sub in gen._subcommands(parser):
    assert f"## `fedjax-dg {name}`" in page
    section = page.split(f"## `fedjax-dg {name}`")[1].split("\n## ")[0]
    for action in sub._actions:
      for option in action.option_strings:
        if option not in ("-h", "--help"):
          assert f"`{option}" in section, (name, option)
  assert {name for name, _, _ in gen._subcommands(parser)} == {
      "run", "demo", "prepare", "datasets", "algorithms", "partition",
      "doctor", "sweep", "report"}
