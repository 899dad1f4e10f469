"""Where a report's numbers came from, in words: the code, data and machine.

Every results.json records `source` (the fedjax_dg commit and whether its
tree was dirty), `data` (dataset, image count, fingerprint) and `environment`
(library versions, backend, devices, CPU), collected by `run.provenance`,
and each of its runs the `source` it ran at. A report (a run's table.md, a
sweep's report.md, a comparison) says them once in its header, so a number
copied out of it can be traced; runs recorded before this existed are said
to be "not recorded", never guessed.
"""

from __future__ import annotations

NOT_RECORDED = "not recorded"


def source_text(src: dict | None) -> str:
  """"<commit>" / "<commit> + uncommitted changes [<digest>]" / "unknown
  (installed package <version>)" / "not recorded" (a run older than the
  record)."""
  if not src or not src.get("commit"):
    return NOT_RECORDED
  if src.get("dirty"):
    return f"{src['commit']} + uncommitted changes {src.get('diff') or ''}".strip()
  return str(src["commit"])


def run_source(run: dict, source: dict | None = None) -> dict | None:
  """The source a run entry of results.json ran at: its own `source`, else
  `source` (its results.json's; None: not recorded)."""
  return run.get("source") or source


def data_text(data: dict | None) -> str:
  if not data:
    return NOT_RECORDED
  return (f"{data.get('dataset')}, {data.get('images')} images, fingerprint "
          f"{data.get('fingerprint')}")


def environment_text(env: dict | None) -> str:
  """One line: library versions, backend and devices, CPU model."""
  if not env:
    return NOT_RECORDED
  versions = ", ".join(f"{k} {env[k]}" for k in (
      "python", "jax", "jaxlib", "flax", "optax", "numpy") if env.get(k))
  devices = f"{env.get('devices')} x {env.get('device_kind') or env.get('backend')}"
  return (f"{versions}; backend {env.get('backend')}, {devices}, "
          f"{env.get('processes')} process(es)"
          + (f"; CPU {env['cpu']}" if env.get("cpu") else ""))


def _counted(texts: list[str], noun: str) -> str:
  """"x" when every entry says the same, else "x (n <noun>s); y (m ...)"."""
  counts: dict[str, int] = {}
  for t in texts:
    counts[t] = counts.get(t, 0) + 1
  if len(counts) == 1:
    return next(iter(counts))
  plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
  return "; ".join(f"{t} ({n} {noun if n == 1 else plural})"
                   for t, n in counts.items())


def provenance_lines(sources: list[dict | None], cells: list[dict]) -> list[str]:
  """Markdown lines for a report's header: the commit of every run
  (`sources`: one per run, `run_source`), the data and environment of
  every run directory (`cells`: results.json dicts)."""
  lines = ["**Provenance** (results.json `source`, `data`, `environment`):", ""]
  lines.append("- fedjax_dg commit: "
               + _counted([source_text(s) for s in sources], "run"))
  lines.append("- data: " + _counted([data_text(c.get("data")) for c in cells],
                                     "run directory"))
  lines.append("- environment: " + _counted(
      [environment_text(c.get("environment")) for c in cells], "run directory"))
  return lines
