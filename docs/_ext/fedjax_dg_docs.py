"""The reference pages the code already knows, generated when the site builds.

* `config_page()`: every field of `fedjax_dg.run.config.base_config()` with its
  default, type, allowed values and meaning;
* `algorithm_pages()`: every algorithm of the registry (`fedjax_dg.algorithms`)
  with its paper, variants and settings (the `build` signature's defaults);
* `cli_page()`: every `fedjax-dg` command and option, from its argparse parser.

Meanings are read from the code's own comments: the trailing comment of a
`build` keyword or an `EngineConfig` field, the comment block above a
`base_config` entry, `DataConfig`'s docstring. `MEANINGS` holds the few
fields whose code has no comment yet. `setup()` makes this a Sphinx extension
that writes the pages into `docs/reference/generated/`, and copies the
colab/ notebooks into `docs/tutorials/`, before reading the sources (neither
folder is committed).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import re
import textwrap
import tokenize

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.dirname(HERE)
OUT = os.path.join(DOCS, "reference", "generated")

# Fields whose code carries no comment to read (the meaning written here
# instead). tests/test_docs_reference.py keeps every key a real field.
MEANINGS = {
    "name": "the experiment's name: the run directory is `<output_dir>/<name>-<time>`",
    "seed": "the root seed: data subsets, partitions, initialization, every draw of the run",
    "algorithms": "the algorithms to run, each on every held-out target (`fedjax-dg algorithms`)",
    "output_dir": "the folder that run and sweep directories are made in",
    "model.name": "the client model (`fedjax_dg.models.available()`)",
    "model.conv_impl": "how convolutions are computed (`models.layers`; `auto`: the fastest for the backend)",
    "train.rounds": "communication rounds",
    "train.eval_every": "rounds per chunk: evaluation, metrics and a checkpoint between chunks",
    "train.epochs": "local epochs per round (each client `epochs x ceil(n_i / batch_size)` steps)",
    "train.batch_size": "local batch size",
    "train.client_mapping": "how the cohort's clients are mapped: `vmap`, `lax.map`, or sharded over the devices; `auto`: shard with several devices, else vmap on accelerators and map on CPU",
    "train.map_batch_size": "under `lax.map`: clients packed per step (> 1: lanes of that width)",
    "train.eval_batch_size": "examples per evaluation batch",
    "train.progress": "show a progress bar",
    "train.keep_checkpoints": "keep a finished run's checkpoints",
    "client.optimizer": "the clients' optimizer (an algorithm section's `client` overrides it)",
    "client.lr": "the clients' learning rate",
    "client.weight_decay": "the clients' weight decay (PyTorch semantics, `optim.make_optimizer`)",
    "client.momentum": "SGD momentum",
    "client.schedule": "the learning rate over the run: `cosine` decays it over the run's local epochs, the optimizer state still fresh every round (`optim.cosine_over_run`)",
}
# Allowed values the code holds as constants (name -> where), for fields whose
# check is not a simple range of EngineConfig.validate.
ALLOWED = {
    "algorithms": ("fedjax_dg.algorithms", "available"),
    "scenario": ("fedjax_dg.run.presets", "SCENARIOS"),
    "data.name": ("fedjax_dg.data.registry", "available"),
    "data.partition": ("fedjax_dg.data.partition", "PARTITIONERS"),
    "data.normalization": ("fedjax_dg.run.assemble", "NORMALIZATIONS"),
    "data.streaming": ("fedjax_dg.data.streamed", "STREAMING"),
    "model.name": ("fedjax_dg.models", "available"),
    "model.conv_impl": ("fedjax_dg.models.layers", "CONV_IMPLS"),
    "model.dtype": ("fedjax_dg.models.layers", "DTYPES"),
    "train.client_mapping": ("fedjax_dg.engine.settings", "MAPPINGS"),
    "train.placement": ("fedjax_dg.engine.settings", "PLACEMENTS"),
    "train.host_gather": ("fedjax_dg.engine.settings", "HOST_GATHERS"),
    "train.shuffle": ("fedjax_dg.client.update", "SHUFFLES"),
    "client.optimizer": ("fedjax_dg.optim", "OPTIMIZERS"),
    "client.schedule": ("fedjax_dg.optim", "SCHEDULES"),
}
SECTIONS = ("data", "model", "train", "client")


# ------------------------------------------------------------ comments


def _code_lines(source: str):
  """{line: comment} of trailing and comment-only lines, and the set of
  comment-only lines, of `source`."""
  comments, only = {}, set()
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                          tokenize.DEDENT, tokenize.ENDMARKER):
      for line in range(tok.start[0], tok.end[0] + 1):
        code_lines.add(line)
  only = {l for l in comments if l not in code_lines}
  return comments, only


def comment_meanings(source: str, last_line: int | None = None) -> dict[str, str]:
  """{name: comment} for every `name=...` / `name: T = ...` of `source`: the
  comment on its line and the comment-only lines continuing it (indented to
  the comment), else the comment-only block right above the line. Names
  sharing a line share its comment."""
  comments, only = _code_lines(source)
  lines = source.splitlines()
  out = {}
  for i, text in enumerate(lines, start=1):
    if last_line is not None and i > last_line:
      break
    if i in only:
      continue
    names = re.findall(r"(?:^|[(,\s.])([A-Za-z_]\w*)\s*(?::\s*[\w\[\]., |]+?)?\s*=(?!=)",
                       text.split("#")[0])
    if not names:
      continue
    # A comment block right above, at the line's own indentation ...
    indent = len(text) - len(text.lstrip())
    j = i - 1
    block = []
    while j in only and comments[j][0] == indent:
      block.insert(0, comments[j][1])
      j -= 1
    # ... and the line's own comment with its continuation lines.
    own = []
    if i in comments:
      column, first = comments[i]
      own.append(first)
      j = i + 1
      while j in only and comments[j][0] >= column - 2:
        own.append(comments[j][1])
        j += 1
    block, own = " ".join(p for p in block if p), " ".join(p for p in own if p)
    meaning = f"{block} {own}" if block and own else block or own
    for name in names:
      if meaning and name not in out:
        out[name] = meaning
  return out


def docstring_attributes(doc: str) -> dict[str, str]:
  """{name: text} of a Google-style docstring's `Attributes:` section."""
  doc = inspect.cleandoc(doc or "")
  if "Attributes:" not in doc:
    return {}
  body = doc.split("Attributes:", 1)[1]
  out, name = {}, None
  for line in body.splitlines():
    m = re.match(r"^  (\w+): (.*)$", line)
    if m:
      name = m.group(1)
      out[name] = m.group(2).strip()
    elif name and line.startswith("    "):
      out[name] += " " + line.strip()
    elif line.strip() and not line.startswith(" "):
      break
  return out


# ------------------------------------------------------------ the config


@dataclasses.dataclass
class Field:
  key: str
  default: object
  type: str
  allowed: str
  meaning: str


def _typename(value) -> str:
  if value is None:
    return "any (None)"
  if isinstance(value, tuple):
    inner = sorted({type(v).__name__ for v in value}) or ["str"]
    return f"tuple of {' / '.join(inner)}"
  return type(value).__name__


def _allowed_constant(key: str) -> str:
  import importlib
  where = ALLOWED.get(key)
  if where is None:
    return ""
  value = getattr(importlib.import_module(where[0]), where[1])
  if callable(value):
    value = value()
  values = list(value)
  text = ", ".join(f"`{v}`" for v in values)
  if key == "algorithms":
    return "a tuple of algorithm names ([Algorithms](algorithms.md))"
  if key == "scenario":
    return f'`""` (none), {text}'
  return text


def _train_ranges() -> dict[str, str]:
  """The allowed values `EngineConfig.validate` states for each int field, read
  off the error it raises for a value below its range."""
  from fedjax_dg.engine.settings import EngineConfig
  from fedjax_dg.errors import ConfigError
  out = {}
  for f in dataclasses.fields(EngineConfig):
    if type(f.default) is not int:
      continue
    try:
      EngineConfig(**{f.name: -1}).validate(None)
    except ConfigError as e:
      m = re.search(r"allowed values are (.*)$", str(e))
      if m:
        out[f.name] = m.group(1)
  return out


def _meanings() -> dict[str, str]:
  """Every field's meaning the code states, keyed as in `flatten`."""
  from fedjax_dg.data.settings import DataConfig
  from fedjax_dg.engine.settings import EngineConfig
  from fedjax_dg.run import config
  out = {}
  base = comment_meanings(inspect.getsource(config.base_config))
  for key in ("scenario",):
    if key in base:
      out[key] = base[key]
  model = comment_meanings(inspect.getsource(config.base_config))
  for key in ("weights", "skip_head", "dtype"):
    if key in model:
      out[f"model.{key}"] = model[key]
  if "vit" in model:
    for sub in ("patch", "dim", "depth", "heads", "mlp_dim"):
      out[f"model.vit.{sub}"] = f"`{sub}`: {model['vit']}"
  for key, text in comment_meanings(inspect.getsource(EngineConfig)).items():
    out[f"train.{key}"] = text
  for key, text in comment_meanings(inspect.getsource(config.train_defaults)).items():
    out.setdefault(f"train.{key}", text)
  for key, text in docstring_attributes(DataConfig.__doc__).items():
    out[f"data.{key}"] = text
  return out


def algorithm_meanings(section: str) -> dict[str, str]:
  """{hyperparameter: comment} of `<section>.build`'s signature."""
  from fedjax_dg import algorithms
  module = algorithms.spec(section).module
  source = textwrap.dedent(inspect.getsource(module.build))
  body = ast.parse(source).body[0].body[0].lineno  # the signature ends above
  return comment_meanings(source, last_line=body - 1)


def _fmt(value) -> str:
  if isinstance(value, str):
    return f'`"{value}"`'
  if isinstance(value, tuple):
    return "`" + ",".join(str(v) for v in value) + "`"
  return f"`{value!r}`"


def fields() -> list[Field]:
  """Every field of `base_config()` (the order `flatten` gives), with its
  default, type, allowed values and meaning."""
  from fedjax_dg import algorithms
  from fedjax_dg.run import config
  flat = config.flatten(config.base_config().to_dict())
  meanings = dict(_meanings())
  for key, text in MEANINGS.items():  # the written meaning, then the comment
    meanings[key] = f"{text} ({meanings[key]})" if key in meanings else text
  ranges = _train_ranges()
  sections = set(algorithms.modules())
  per_section = {s: algorithm_meanings(s) for s in sections}
  out = []
  for key, default in flat.items():
    head, _, leaf = key.partition(".")
    allowed = _allowed_constant(key)
    if head == "train" and leaf in ranges and not allowed:
      allowed = ranges[leaf]
    meaning = meanings.get(key, "")
    if head in sections:
      if leaf.startswith("client."):
        sub = leaf.split(".", 1)[1]
        meaning = (f"this algorithm's `client.{sub}` (None: the run's "
                   f"`client.{sub}`)")
        allowed = _allowed_constant(f"client.{sub}")
        if default is None:  # the run's value's type
          out.append(Field(key, default, _typename(flat[f"client.{sub}"]),
                           allowed, meaning))
          continue
      else:
        meaning = per_section[head].get(leaf, "")
        allowed = allowed or _algorithm_allowed(head, leaf, default)
    out.append(Field(key, default, _typename(default), allowed, meaning))
  return out


def _algorithm_allowed(section: str, name: str, default) -> str:
  """Allowed values of a string hyperparameter: the one tuple of strings of
  its module that holds the default, where there is exactly one."""
  if not isinstance(default, str) or not default:
    return ""
  from fedjax_dg import algorithms
  module = algorithms.spec(section).module
  found = {tuple(v) for k, v in vars(module).items()
           if k.isupper() and isinstance(v, tuple) and v
           and all(isinstance(x, str) for x in v) and default in v}
  if len(found) != 1:
    return ""
  return ", ".join(f"`{v}`" for v in found.pop())


def _cell(text: str) -> str:
  """Text for a table cell: pipes escaped, and outside code spans `<` too
  (experiments/<file>.py is not an HTML tag)."""
  parts = str(text).replace("\n", " ").split("`")
  for i in range(0, len(parts), 2):
    parts[i] = parts[i].replace("<", "&lt;")
  return "`".join(parts).replace("|", "\\|")


def _table(rows: list[Field], strip: str = "") -> list[str]:
  """field | default (type) | meaning, then the allowed values."""
  lines = ["| field | default (type) | meaning; allowed values |",
           "|---|---|---|"]
  for f in rows:
    name = f.key[len(strip):] if strip and f.key.startswith(strip) else f.key
    meaning = f.meaning.rstrip(".")
    if f.allowed:
      meaning += f". **Allowed:** {f.allowed}"
    lines.append(f"| `{name}` | {_cell(_fmt(f.default))} ({_cell(f.type)}) | "
                 f"{_cell(meaning)} |")
  return lines


def config_page() -> str:
  from fedjax_dg import algorithms
  every = fields()
  top = [f for f in every if "." not in f.key]
  lines = [
      "# Config fields",
      "",
      "Generated from `fedjax_dg.run.config.base_config()` when this site was",
      "built: every field, its default, its type, the values it allows and what",
      "it means. The config is locked: an unknown key in an experiment file or",
      "a `--set` is an error naming the closest valid key, and a value of",
      "another type is refused. Set a field in an experiment file",
      "(`c.train.rounds = 50`) or on the command line",
      "(`--set train.rounds=50`).",
      "",
      "An algorithm's section is its `build` signature's keyword defaults",
      "(one page each under [Algorithms](algorithms.md)); its `client`",
      "sub-section overrides the run's `client` settings for that algorithm",
      "only (None: the run's value).",
      "",
      "## Top level",
      "",
      *_table(top),
  ]
  for section in SECTIONS:
    rows = [f for f in every if f.key.startswith(section + ".")]
    lines += ["", f"## `{section}`", "", *_table(rows, section + ".")]
  lines += ["", "## Algorithm sections", ""]
  for section in algorithms.modules():
    rows = [f for f in every if f.key.startswith(section + ".")]
    name = algorithms.spec(section).display_name
    lines += [f"### `{section}` ({name})", "",
              f"[The algorithm's page](algorithms/{section}.md).", "",
              *_table(rows, section + "."), ""]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------ algorithms


def _paper(spec) -> dict:
  return spec.paper


def _paper_line(paper: dict) -> str:
  if not paper:
    return ""
  parts = [f"*{paper['title']}*"]
  if paper.get("authors"):
    parts.append(paper["authors"])
  parts += [str(p) for p in (paper.get("venue"), paper.get("year")) if p]
  return ", ".join(parts)


def _docstring_markdown(doc: str) -> str:
  """A module docstring as markdown: its indented blocks as code."""
  doc = inspect.cleandoc(doc or "")
  out, block = [], []
  for line in doc.splitlines() + [""]:
    if line.startswith("    ") or (block and not line.strip()):
      block.append(line[4:] if line.startswith("    ") else "")
      continue
    if block:
      while block and not block[-1].strip():
        block.pop()
      if block:
        out += ["", "```text", *block, "```", ""]
      block = []
    out.append(line)
  return "\n".join(out).strip()


def algorithm_page(section: str) -> str:
  from fedjax_dg import algorithms
  spec = algorithms.spec(section)
  paper = _paper(spec)
  rows = [f for f in fields() if f.key.startswith(section + ".")]
  lines = [f"# {spec.display_name} (`{section}`)", ""]
  if paper:
    lines += [f"**Paper:** {_paper_line(paper)}.", ""]
  facts = []
  variants = spec.variants
  if variants:
    facts.append("**Variants** (algorithm names of their own): " + "; ".join(
        f"`{v}` ({algorithms.spec(v).display_name}: " + ", ".join(
            f"`{k}={val!r}`" for k, val in algorithms.spec(v).overrides.items())
        + ")" for v in variants))
  if spec.models:
    facts.append("**Runs on** `model.name` " + " / ".join(
        f"`{m}`" for m in spec.models) + " only.")
  if spec.needs_server_data:
    facts.append("**Needs** a server split: `data.server_fraction > 0`.")
  if not spec.federated:
    facts.append("**Not federated** (a reference: no marks against FedAvg "
                 "in the reports).")
  if spec.traced:
    facts.append("**Traced** (arguments of its compiled programs: runs that "
                 "differ only in them, e.g. a `--grid` over them, share one "
                 "compile): " + ", ".join(f"`{section}.{k}`"
                                          for k in spec.traced) + ".")
  if spec.ablations:
    facts.append(f"**Ablations** ({spec.ablation_table}): " + ", ".join(
        f"`{section}.{k}=False` is \"w/o {v}\"" for k, v in
        spec.ablations.items()) + ".")
  for fact in facts:
    lines += [f"* {fact}"]
  if facts:
    lines.append("")
  lines += [f"Source: `fedjax_dg/algorithms/{section}.py`. Run it with "
            f"`--set algorithms={section}` (settings: "
            f"`--set {section}.<field>=<value>`).", "",
            "## What it does", "",
            _docstring_markdown(spec.module.__doc__), "",
            "## Settings", "",
            f"The `{section}` config section: `build`'s keyword defaults.", "",
            *_table(rows, section + "."), ""]
  return "\n".join(lines) + "\n"


def algorithms_index() -> str:
  from fedjax_dg import algorithms
  lines = ["# Algorithms", "",
           "Generated from the registry (`fedjax_dg.algorithms`): every",
           "algorithm module, its paper, and the names it adds (variants).",
           "`fedjax-dg algorithms` prints the same list with the settings.", "",
           "| name | algorithm | paper | variants |",
           "|---|---|---|---|"]
  for section in algorithms.modules():
    spec = algorithms.spec(section)
    paper = _paper(spec)
    venue = ", ".join(str(p) for p in (paper.get("venue"), paper.get("year"))
                      if p)
    title = paper.get("title", "")
    if not paper:  # a reference (Central, Local-only): what it is
      title = inspect.cleandoc(spec.module.__doc__ or "").split("\n")[0]
    lines.append(
        f"| [`{section}`](algorithms/{section}.md) | {_cell(spec.display_name)}"
        f" | {_cell(title + (f' ({venue})' if venue else ''))} | "
        + ", ".join(f"`{v}`" for v in spec.variants) + " |")
  lines += ["", "```{toctree}", ":hidden:", ""]
  lines += [f"algorithms/{s}" for s in algorithms.modules()]
  lines += ["```", ""]
  return "\n".join(lines)


# ------------------------------------------------------------ the CLI


def _subcommands(parser: argparse.ArgumentParser):
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      helps = {a.dest: a.help for a in action._choices_actions}
      for name, sub in action.choices.items():
        yield name, helps.get(name, ""), sub


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
  rows = ["| argument | what it sets | default |", "|---|---|---|"]
  for action in parser._actions:
    if isinstance(action, argparse._HelpAction):
      continue
    if action.option_strings:
      names = ", ".join(action.option_strings)
      if action.nargs != 0:
        names += " " + (action.metavar or action.dest.upper())
    else:
      names = action.metavar or action.dest
    text = (action.help or "").replace("%%", "%")
    if action.choices and not isinstance(action, argparse._SubParsersAction):
      text += " (one of: " + ", ".join(f"`{c}`" for c in action.choices) + ")"
    if isinstance(action, argparse._AppendAction):
      text += " (repeatable)"
    default = action.default
    shown = "" if default in (None, False, [], argparse.SUPPRESS) else f"`{default}`"
    rows.append(f"| `{names}` | {_cell(text)} | {shown} |")
  return rows


def cli_page() -> str:
  from fedjax_dg import cli
  parser = cli.parser()
  lines = ["# The `fedjax-dg` command", "",
           "Generated from the command's argparse parser (`fedjax_dg.cli.parser`).",
           "`fedjax-dg <command> --help` prints the same.", "",
           "```text", parser.format_usage().strip(), "```", ""]
  for name, help_text, sub in _subcommands(parser):
    lines += [f"## `fedjax-dg {name}`", "", (help_text or "").strip() + ".", "",
              "```text", sub.format_usage().strip(), "```", "",
              *_option_rows(sub), ""]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------ Sphinx


def write_pages(out: str = OUT) -> list[str]:
  """Writes every generated page under `out`; returns their paths."""
  from fedjax_dg import algorithms
  pages = {"config.md": config_page(), "cli.md": cli_page(),
           "algorithms.md": algorithms_index()}
  for section in algorithms.modules():
    pages[f"algorithms/{section}.md"] = algorithm_page(section)
  written = []
  for rel, text in pages.items():
    path = os.path.join(out, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    old = open(path).read() if os.path.exists(path) else None
    if old != text:  # unchanged pages keep their time: no rebuild
      with open(path, "w") as f:
        f.write(text)
    written.append(path)
  return written


def copy_notebooks(out: str = os.path.join(DOCS, "tutorials")) -> list[str]:
  """The colab/ notebooks copied beside the pages (`tutorials/`, not
  committed), so the site shows them and pages link them by path."""
  import shutil
  src = os.path.join(os.path.dirname(DOCS), "colab")
  os.makedirs(out, exist_ok=True)
  written = []
  for name in sorted(os.listdir(src)):
    if name.endswith(".ipynb"):
      path = os.path.join(out, name)
      if not os.path.exists(path) or open(path, "rb").read() != open(
          os.path.join(src, name), "rb").read():
        shutil.copyfile(os.path.join(src, name), path)
      written.append(path)
  return written


def _on_builder_inited(app):
  write_pages()
  copy_notebooks()


def setup(app):
  app.connect("builder-inited", _on_builder_inited)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
