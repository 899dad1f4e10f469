"""The package's import graph: no cycles, imports point down, and between
packages only the arrows of ALLOWED (drawn in docs/architecture.md).

Every module of fedjax_dg/ is parsed (module- and function-level imports): an
edge A -> B for `import fedjax_dg.B`, `from fedjax_dg import B`, `from
fedjax_dg.B import x` and relative imports. A package's `__init__` is its own node.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PKG = os.path.join(ROOT, "fedjax_dg")


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
  out = {}
  for dirpath, _, files in os.walk(PKG):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        out[_module_name(path)] = path
  return out


def _resolve(name: str, known) -> str | None:
  """The longest known module prefix of a dotted name."""
  while name:
    if name in known:
      return name
    name = name.rpartition(".")[0]
  return None


def graph() -> dict[str, set[str]]:
  known = modules()
  edges = {m: set() for m in known}
  for mod, path in known.items():
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read(), path)):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = mod.split(".")
          anchor = parts if is_pkg else parts[:-1]
          anchor = anchor[:len(anchor) - (node.level - 1)]
          base = ".".join(anchor + ([base] if base else []))
        # `from pkg import sub`: the submodule if it is one, else pkg itself
        # (a name defined in pkg/__init__).
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                   for a in node.names]
      for t in targets:
        if t.startswith("fedjax_dg"):
          dep = _resolve(t, known)
          if dep and dep != mod:
            edges[mod].add(dep)
  return edges


def find_cycle(edges) -> list[str] | None:
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(edges[m]):
      if state.get(d) == "open":
        return stack[stack.index(d):] + [d]
      if d not in state:
        found = visit(d)
        if found:
          return found
    state[m] = "done"
    stack.pop()
    return None

  for m in sorted(edges):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_no_import_cycle():
  cycle = find_cycle(graph())
  assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
  edges = graph()
  edges["fedjax_dg.report.plots"] = (edges["fedjax_dg.report.plots"]
                                     | {"fedjax_dg.report.run_summary"})
  assert find_cycle(edges) is not None  # run_summary imports plots


LOW = ("fedjax_dg.server", "fedjax_dg.client", "fedjax_dg.models",
       "fedjax_dg.data", "fedjax_dg.tree", "fedjax_dg.distributed")
HIGH = ("fedjax_dg.run", "fedjax_dg.report", "fedjax_dg.cli",
        "fedjax_dg.engine", "fedjax_dg.algorithms")


def _under(mod, prefixes):
  return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_imports_point_down():
  for mod, deps in graph().items():
    if _under(mod, LOW):
      bad = [d for d in deps if _under(d, HIGH)]
      assert not bad, f"{mod} imports {bad}"
    if _under(mod, ("fedjax_dg.data",)):
      assert not [d for d in deps if _under(d, ("fedjax_dg.models",))], mod
    if _under(mod, ("fedjax_dg.models",)):
      assert not [d for d in deps if _under(d, ("fedjax_dg.data",))], mod


# The package-level arrows (docs/architecture.md, "Packages and the arrows
# between them", draws this dict): each fedjax_dg package or top-level module
# -> the ones it may import. `fedjax_dg` is the package's own __init__. Every
# package may import the bottom, `tree` and `errors`, which import nothing. A
# new arrow that points down goes here and into the diagram together.
BOTTOM = frozenset({"tree", "errors"})
ALLOWED = {
    "fedjax_dg": frozenset(),
    "tree": frozenset(),
    "errors": frozenset(),
    "evaluate": BOTTOM,
    "distributed": BOTTOM,
    "data": BOTTOM,
    "models": BOTTOM,
    "client": BOTTOM,
    "optim": BOTTOM | {"client"},
    "server": BOTTOM | {"models", "optim"},
    "algorithms": BOTTOM | {"client", "models", "optim", "server"},
    "engine": BOTTOM | {"algorithms", "client", "evaluate"},
    "report": BOTTOM | {"algorithms", "data"},
    "run": BOTTOM | {"algorithms", "data", "distributed", "engine", "models",
                     "report"},
    "doctor": BOTTOM | {"data", "engine"},
    "federation_view": BOTTOM | {"report", "run"},
    "cli": BOTTOM | {"algorithms", "data", "distributed", "doctor", "engine",
                     "federation_view", "report", "run"},
}


def package(mod: str) -> str:
  """The top-level package or module of a fedjax_dg module:
  fedjax_dg.engine.round -> engine, fedjax_dg.tree -> tree."""
  parts = mod.split(".")
  return parts[1] if len(parts) > 1 else parts[0]


def package_arrows(edges) -> dict[tuple[str, str], list[tuple[str, str]]]:
  """(package, package it imports) -> the module imports behind it, for every
  arrow between two packages of `edges` (a module graph)."""
  arrows = {}
  for mod, deps in edges.items():
    for dep in deps:
      a, b = package(mod), package(dep)
      if a != b:
        arrows.setdefault((a, b), []).append((mod, dep))
  return arrows


def forbidden_arrows(edges) -> list[str]:
  """Every package arrow of `edges` that ALLOWED does not hold, with the module
  imports behind it; a package missing from ALLOWED is named too."""
  out = [f"{p} is not in ALLOWED (tests/test_imports.py): place it in the "
         "diagram of docs/architecture.md and here"
         for p in sorted({package(m) for m in edges} - set(ALLOWED))]
  for (a, b), why in sorted(package_arrows(edges).items()):
    if a in ALLOWED and b not in ALLOWED[a]:
      out.append(f"{a} -> {b} ({', '.join(f'{m} imports {d}' for m, d in sorted(why))})")
  return out


def test_packages_import_only_the_allowed_arrows():
  bad = forbidden_arrows(graph())
  assert not bad, "package imports outside ALLOWED: " + "; ".join(bad)


def test_the_allowed_arrows_have_no_cycle():
  assert find_cycle({a: set(bs) for a, bs in ALLOWED.items()}) is None


def test_a_planted_forbidden_package_arrow_is_found():
  edges = graph()
  edges["fedjax_dg.engine.placement"] = (edges["fedjax_dg.engine.placement"]
                                         | {"fedjax_dg.data.images"})
  edges["fedjax_dg.client.update"] = (edges["fedjax_dg.client.update"]
                                      | {"fedjax_dg.tree"})  # allowed: down
  edges["fedjax_dg.newpkg.mod"] = {"fedjax_dg.tree"}
  bad = forbidden_arrows(edges)
  assert bad == [
      "newpkg is not in ALLOWED (tests/test_imports.py): place it in the "
      "diagram of docs/architecture.md and here",
      "engine -> data (fedjax_dg.engine.placement imports fedjax_dg.data.images)"]


def engine_data_imports(edges) -> list[tuple[str, str]]:
  """(engine module, data module) for every import of a `fedjax_dg.data*`
  module by a `fedjax_dg.engine*` module."""
  return sorted((mod, dep) for mod, deps in edges.items()
                if _under(mod, ("fedjax_dg.engine",))
                for dep in deps if _under(dep, ("fedjax_dg.data",)))


def test_the_engine_imports_no_data_module():
  """The engine asks the data objects what it needs to know about them
  (`PackedClients.streamed`, `FederatedData.target_streamed`)."""
  assert engine_data_imports(graph()) == []


def test_an_engine_import_of_a_data_module_is_found():
  edges = graph()
  assert "fedjax_dg.engine.placement" in edges  # the engine is a package
  edges["fedjax_dg.engine.placement"] = (edges["fedjax_dg.engine.placement"]
                                         | {"fedjax_dg.data.images"})
  assert engine_data_imports(edges) == [("fedjax_dg.engine.placement",
                                         "fedjax_dg.data.images")]


# The engine's modules, each importing only modules before it (docs: the
# package docstring of fedjax_dg/engine).
ENGINE_ORDER = ("settings", "checkpoint", "layout", "round", "placement",
                "evaluation", "programs", "feeds", "runner")


def engine_upward_imports(edges) -> list[tuple[str, str]]:
  rank = {f"fedjax_dg.engine.{m}": i for i, m in enumerate(ENGINE_ORDER)}
  return sorted((mod, dep) for mod, deps in edges.items() if mod in rank
                for dep in deps if _under(dep, ("fedjax_dg.engine",))
                and rank.get(dep, len(rank)) >= rank[mod])


def test_the_engine_modules_import_one_way():
  assert set(modules()) >= {f"fedjax_dg.engine.{m}" for m in ENGINE_ORDER}
  assert engine_upward_imports(graph()) == []
  edges = graph()  # planted: an upward import is found
  edges["fedjax_dg.engine.round"] = (edges["fedjax_dg.engine.round"]
                                     | {"fedjax_dg.engine.runner"})
  assert engine_upward_imports(edges) == [("fedjax_dg.engine.round",
                                           "fedjax_dg.engine.runner")]


ALGORITHMS = "fedjax_dg.algorithms"
# The FedAvg family's root: its members are `fedavg.fedavg` with another
# objective, optimizer, aggregator or state.
FAMILY_ROOT = "fedjax_dg.algorithms.fedavg"


def paper_imports(edges) -> list[tuple[str, str]]:
  """(module, algorithm module it imports) for every algorithm module
  (`fedjax_dg/algorithms/<name>.py`, not `base`) importing another one, the
  FedAvg root aside: what two papers share lives below them (client/,
  server/, models/, tree.py)."""
  papers = {m for m in edges if m.startswith(ALGORITHMS + ".")
            and m != f"{ALGORITHMS}.base"}
  return [(m, d) for m in sorted(papers) for d in sorted(edges[m])
          if d in papers and d != FAMILY_ROOT]


def test_no_algorithm_module_imports_another():
  found = paper_imports(graph())
  assert not found, "algorithm modules importing another: " + ", ".join(
      f"{m} -> {d}" for m, d in found)


def test_a_planted_paper_import_is_found():
  edges = graph()
  assert "fedjax_dg.algorithms.pfedhn" in edges
  edges["fedjax_dg.algorithms.pfedhn"] = (
      edges["fedjax_dg.algorithms.pfedhn"] | {"fedjax_dg.algorithms.hfedf",
                                              FAMILY_ROOT})
  found = paper_imports(edges)
  assert ("fedjax_dg.algorithms.pfedhn", "fedjax_dg.algorithms.hfedf") in found
  assert ("fedjax_dg.algorithms.pfedhn", FAMILY_ROOT) not in found


def test_packaged_configs_load_without_the_repository_folders(tmp_path):
  """`fedjax-dg demo`'s config is part of the package: importable from any
  directory with only the package on the path (no experiments/ folder)."""
  script = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.')];"
            "from fedjax_dg.run.configs import demo, rfmnist_hfedf, paper_protocol;"
            "c = demo.get_config(); print(c.name, c.model.name)")
  out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=""))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["demo", "small_cnn"]
  for mod, path in modules().items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        assert node.value.strip("/") != "experiments", (
            f"{mod} builds a path to the repository's experiments/ folder")
