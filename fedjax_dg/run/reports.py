"""`fedjax-dg report DIR [DIR...]`: the paper-shaped tables of a sweep or run
directory, or of several directories side by side.

It reads what the run side wrote (sweep.json, each cell's config.json and
results.json: `directory`), so it lives on that side; the tables, figures
and their formats are `fedjax_dg.report`'s. A sweep writes its report here
when it ends (`sweep.run_sweep`).
"""

from __future__ import annotations

import copy
import os

from fedjax_dg import algorithms
from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.report import comparisons, origin, plots, run_summary, tables
from fedjax_dg.report.records import (ablation_sections, ablation_table_name,
                                      display_name, finished, missing_run,
                                      records_from_cell)
from fedjax_dg.run import config as config_lib
from fedjax_dg.run import directory
from fedjax_dg.run.directory import MANIFEST, read_manifest

REPORT_DIR = "report"
DIFFERENCES = "differences"   # the table of paired differences with the reference


def _json_override(config: dict, item: str) -> None:
  """Applies one `key=value` cell override to a config's JSON (in place):
  the value parsed as `config.coerce` would, for the fields the report reads
  (seed, data.d, algorithms, hfedf switches, scenario)."""
  key, raw = item.split("=", 1)
  *path, leaf = key.strip().split(".")
  node = config
  for part in path:
    node = node.setdefault(part, {})
  old = node.get(leaf)
  if isinstance(old, str):
    node[leaf] = raw
  elif isinstance(old, list):
    node[leaf] = [v.strip() for v in raw.split(",")]
  else:
    node[leaf] = config_lib.coerce(raw, old)


def _cell_config(cell_dir: str, manifest: dict, cell: dict) -> dict:
  """A cell's config.json, or (a cell that never started) the sweep's base
  config with the cell's overrides."""
  path = os.path.join(cell_dir, "config.json")
  if os.path.isfile(path):
    return directory.read_json(path, "Restore it from a copy (fedjax-dg "
                               "wrote it when the run began)")
  config = copy.deepcopy(manifest.get("base_config") or {})
  for item in cell.get("overrides", ()):
    try:
      _json_override(config, item)
    except (ConfigError, ValueError):
      pass  # a field the report does not read
  return config


def load_records(sweep_dir: str) -> tuple[dict, list[dict]]:
  """(manifest, records) of a sweep directory, or of a single run directory
  (one `fedjax-dg run` output, read as a one-cell sweep).

  Every run the directory planned that has not finished (a target of a
  stopped run, every run of a pending / failed cell: a seed or grid point)
  is a `missing` record (`missing_run`): the tables mark what it
  leaves partial, and `manifest["missing"]` lists it as {cell: (status,
  [(algorithm, target)])}; cells are "complete" in `manifest["complete"]`.
  `manifest["origins"]`: every results.json read (their `source`, `data`
  and `environment`: `origin.provenance_lines`).
  """
  if not os.path.isdir(sweep_dir):
    raise DataError(f"{sweep_dir}: no such folder (give a sweep directory, "
                    "with its sweep.json, or a run directory, with its "
                    "results.json)")
  if os.path.isfile(os.path.join(sweep_dir, MANIFEST)):
    manifest = read_manifest(sweep_dir)
  elif os.path.isfile(os.path.join(sweep_dir, "results.json")):
    manifest = dict(name=os.path.basename(os.path.normpath(sweep_dir)), cells=[
        dict(name=".", settings={}, status="done")])
  else:
    raise DataError(f"{sweep_dir} holds neither {MANIFEST} (a sweep) nor "
                            "results.json (a run)")
  records, loaded, unstarted = [], [], []
  for cell in manifest["cells"]:
    cell_dir = os.path.normpath(os.path.join(sweep_dir, cell["name"]))
    name = os.path.basename(cell_dir) if cell["name"] == "." else cell["name"]
    config = _cell_config(cell_dir, manifest, cell)
    path = os.path.join(cell_dir, "results.json")
    if not os.path.isfile(path):
      unstarted.append((cell, name, config))
      continue
    results = directory.read_json(path, directory.REDO_RESULTS + ", then "
                                  "report again")
    loaded.append((cell, name, config, results))
    manifest.setdefault("origins", []).append(results)
    if results.get("warnings"):
      manifest.setdefault("warnings", {})[name] = list(results["warnings"])
    manifest.setdefault("dataset", results.get("dataset"))
    held = manifest.setdefault("targets", [])
    held += [str(t) for t in results.get("targets", ()) if str(t) not in held]
  held = manifest.get("targets", [])
  missing, complete = {}, []
  for cell, name, config, results in loaded:
    done = {(r["algorithm"], str(r["target"])) for r in results["runs"]}
    planned = [(a, str(t)) for a in results.get("algorithms", ())
               for t in results.get("targets", ())]
    absent = [p for p in planned if p not in done]
    for r in results.get("stopped", ()):
      manifest.setdefault("stopped", {})[name, r["algorithm"],
                                         str(r["target"])] = r["error"]
    if absent:  # a run directory's own status is unknown: stopped or running
      missing[name] = (cell.get("status", "?") if cell["name"] != "."
                       else "unfinished", absent)
    elif cell.get("status") == "done" or cell["name"] == ".":
      complete.append(name)
    records += records_from_cell(
        name, cell["settings"], config,
        dict(results, runs=results["runs"]
             + [missing_run(a, t) for a, t in absent]))
  if loaded:  # a cell that never wrote results.json: every run it plans
    for cell, name, config in unstarted:
      absent = [(a, t) for a in config.get("algorithms", ()) for t in held]
      missing[name] = (cell.get("status", "?"), absent)
      records += records_from_cell(
          name, cell["settings"], config,
          dict(runs=[missing_run(a, t) for a, t in absent]))
  manifest["missing"], manifest["complete"] = missing, complete
  manifest.setdefault("origins", [])
  return manifest, records


def diverged_lines(records: list[dict]) -> list[str]:
  """report.md's paragraph on the finished runs that diverged
  (`records.diverged`), one line each; [] when none did."""
  blown = [r for r in finished(records) if r.get("diverged")]
  if not blown:
    return []
  return (["", f"**{tables.DIVERGED} DIVERGED: {len(blown)} run(s) ended with "
           "a training loss far above a uniform guess's**: reported as they "
           f"ran, every value they enter is marked {tables.DIVERGED} and never "
           "bold:", ""]
          + [f"- `{r['cell']}` {display_name(r['algorithm'])} / target "
             f"{r['target']}: {r['diverged']}" for r in blown])


def missing_lines(manifest: dict) -> list[str]:
  """One line per cell with unfinished runs: its status and which
  algorithms / targets (a whole cell: its seed and grid point); a run
  stopped as non-finite with its reason, on a line of its own."""
  lines = []
  stopped = manifest.get("stopped", {})
  for name, (status, absent) in manifest.get("missing", {}).items():
    per = {}
    for a, t in absent:
      per.setdefault(a, []).append(t)
    what = "; ".join(f"{a}: targets {', '.join(ts)}" for a, ts in per.items())
    lines.append(f"- `{name}` ({status}): {len(absent)} run(s) missing: "
                 + (what or "none planned known"))
    lines += [f"  - {a} / {t} was stopped: {stopped[name, a, t]}"
              for a, t in absent if (name, a, t) in stopped]
  return lines


def resumable(manifest: dict) -> bool:
  """Whether a resume can finish a missing run: one that is not a
  non-finite stop (which a resume repeats)."""
  stopped = manifest.get("stopped", {})
  return any((name, a, t) not in stopped
             for name, (_, absent) in manifest.get("missing", {}).items()
             for a, t in absent)


def report_tables(records: list[dict], ds=None,
                  reference: str = algorithms.REFERENCE
                  ) -> list[tuple[str, tables.Table]]:
  """(file stem, table) of every table the records support; differences
  with algorithm `reference` (a registry name)."""
  present = sorted({r["d"] for r in records})
  ds = list(ds) if ds else present
  missing = [d for d in ds if d not in present]
  if missing:
    raise ConfigError(f"--d {missing}: no finished run has those d; present: {present}")
  out = [("table2", tables.table2(records, reference=reference)),
         ("table2_best", tables.table2(records, "best", reference))]
  differences = comparisons.differences(records, reference)
  if differences.rows:   # some algorithm has the reference to face
    out.append((DIFFERENCES, differences))
  scenarios = tables.scenario_table(records)
  if scenarios is not None:
    out.insert(0, ("scenarios", scenarios))
  for section in ablation_sections(records):  # hFedF's Table 3
    table = tables.ablation_table(records, section)
    if table is not None:
      stem = ablation_table_name(section).lower().replace(" ", "")
      out.append((stem, table))
  out += [(f"per_domain_d{d}", tables.per_domain(records, d, reference=reference))
          for d in ds]
  out.append(("summary", tables.summary(records)))
  return out


def check_reference(sweep_dir: str, records: list[dict], reference: str) -> None:
  """A ConfigError unless `reference` is an algorithm of the registry with a
  finished run in `records` (`fedjax-dg report --reference`): a report
  asked to compare with it never goes without the comparisons."""
  try:
    algorithms.spec(reference)
  except ConfigError as e:
    raise ConfigError(f"--reference: {e}") from None
  there = sorted({r["algorithm"] for r in finished(records)})
  if reference not in there:
    raise ConfigError(
        f"--reference {reference}: no finished run of "
        f"{display_name(reference)} in {sweep_dir}; algorithms there: "
        + ", ".join(there))


def write_report(sweep_dir: str, out: str | None = None, ds=None,
                 reference: str | None = None) -> list[str]:
  """Writes report.md, one .md and .csv per table, paired.csv (the values
  behind the differences with the reference), runs.csv and curves.png.

  `reference`: the algorithm (registry name) every other is compared with,
  which must have a finished run here (`check_reference`); None (a sweep's
  own report): `algorithms.REFERENCE`, compared with where the directory
  has it."""
  manifest, records = load_records(sweep_dir)
  if not finished(records):
    raise ConfigError(f"{sweep_dir}: no finished run yet, nothing to report")
  if reference is None:
    reference = algorithms.REFERENCE
  else:
    check_reference(sweep_dir, records, reference)
  out = out or os.path.join(sweep_dir, REPORT_DIR)
  make_out(out)
  paths = []

  def write(name, text):
    path = os.path.join(out, name)
    with open(path, "w") as f:
      f.write(text)
    paths.append(path)

  parts = report_tables(records, ds, reference)
  for stem, table in parts:
    write(f"{stem}.md", table.markdown())
    write(f"{stem}.csv", table.csv())
  write("runs.csv", tables.long_table(records).csv())
  compared = any(stem == DIFFERENCES for stem, _ in parts)
  if compared:
    write("paired.csv", comparisons.paired(records, reference).csv())
  cells = manifest["cells"]
  done, absent = len(finished(records)), len(records) - len(
      finished(records))
  head = [f"# Sweep report: {manifest.get('name')} ({manifest.get('dataset')})", "",
          f"Directory `{os.path.abspath(sweep_dir)}`; "
          f"{len(manifest['complete'])}/{len(cells)} cells complete, {done} of "
          f"{done + absent} planned runs finished."]
  if manifest.get("config"):
    head.append(f"Config `{manifest['config']}`, --set {manifest.get('sets')}, "
                f"grid {manifest.get('grid')}, seeds {manifest.get('seeds')}.")
  head += [""] + provenance_lines(manifest, records)
  if manifest.get("warnings"):
    head += ["", "**Stand-ins and resumes: numbers that do not follow the "
             "protocol, or ran with more than one commit or environment** "
             "(each cell's results.json `warnings`):", ""]
    head += [f"- `{cell}`: {w}" for cell, ws in manifest["warnings"].items()
             for w in ws]
  if absent:
    head += ["", f"**{tables.PARTIAL} PARTIAL: {absent} planned run(s) have not "
             f"finished**; every value they leave partial is marked "
             f"{tables.PARTIAL} (a mean over the finished runs only). "
             "Missing:", ""] + missing_lines(manifest)
    if resumable(manifest):
      head += ["", "Continue with `fedjax-dg "
               + ("sweep" if os.path.isfile(os.path.join(sweep_dir, MANIFEST))
                  else "run") + f" --resume {sweep_dir}`, then report again."]
    if manifest.get("stopped"):
      head += ["", "A run stopped as non-finite is deterministic: a resume "
               "skips it (it would stop the same way); change its settings "
               "(e.g. a smaller learning rate) in a new sweep."]
  head += diverged_lines(records)
  head += ["", "id = each client's model on its own held-out 10 % source split "
           "(mean over clients); ood = on the unseen target domain. Final = the "
           "evaluation after the last round (the papers' protocol); best = the "
           "highest value of the evaluation history (every train.eval_every rounds; "
           "its ood uses at most train.ood_eval_max target images). Every number "
           "is computed from the cells' results.json; runs.csv lists each run."]
  if compared:
    head += ["", f"Differences with {display_name(reference)} are paired over "
             "seeds with a 95 % "
             "Student-t confidence interval (differences.md / .csv); paired.csv "
             "lists the per-(seed, target) values behind them."]
  head.append("")
  write("report.md", "\n".join(head + [t.markdown() for _, t in parts]))
  paths.append(plots.sweep_curves(records, os.path.join(out, "curves.png")))
  return paths


def make_out(out: str) -> None:
  """The report's folder `out` (`--out`), made if missing; a path that is a
  file, or a folder that cannot be made, is a ConfigError naming it."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"report --out {out}: a file, not a folder; give a "
                      "folder for the report's files (made if missing)")
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"report --out {out}: cannot make that folder "
                      f"({type(e).__name__}: {e}); give a writable "
                      "folder") from None


def provenance_lines(manifest: dict, records: list[dict]) -> list[str]:
  """The report's provenance (`origin.provenance_lines`): the commit of every
  finished run, the data and environment of every run directory read."""
  return origin.provenance_lines(
      [r["source"] for r in finished(records)], manifest["origins"])


def column_labels(dirs: list[str]) -> list[str]:
  """One label per directory: its name, or its path below the directories'
  common folder where two names coincide."""
  paths = [os.path.abspath(d) for d in dirs]
  if len(set(paths)) < len(paths):
    raise ConfigError(f"report: a directory is given twice in {list(dirs)}")
  names = [os.path.basename(p) for p in paths]
  if len(set(names)) == len(names):
    return names
  root = os.path.commonpath(paths)
  return [os.path.relpath(p, root) for p in paths]


def check_comparable(labels: list[str], manifests: list[dict]) -> None:
  """One dataset and the same held-out targets in every directory, else a
  ConfigError naming each directory's."""
  seen = [(m.get("dataset"), sorted(m.get("targets", []))) for m in manifests]
  if len(set((d, tuple(t)) for d, t in seen)) > 1:
    held = "; ".join(f"{label}: {d}, targets {', '.join(t)}"
                     for label, (d, t) in zip(labels, seen))
    raise ConfigError(
        f"report: these runs are not comparable ({held}): one table needs one "
        "dataset and the same held-out targets in every directory; report "
        "them separately (fedjax-dg report DIR)")


COMPARED = (("comparison_ood", "ood_acc"), ("comparison_id", "id_acc"),
            ("comparison_ood_best", "best_ood_acc"))


def compare(dirs: list[str], out: str | None = None) -> list[str]:
  """`fedjax-dg report DIR DIR...`: one comparison table per metric (rows =
  algorithms, columns = each directory's targets, mean ± std over seeds) as
  markdown and CSV, every run in runs.csv and the curves, labelled by
  directory; written to `out` (default: a new `compare-<time>` folder beside
  the first directory). Returns the paths, report.md first."""
  labels = column_labels(dirs)
  loaded = [load_records(d) for d in dirs]
  for d, (_, records) in zip(dirs, loaded):
    if not finished(records):
      raise ConfigError(f"{d}: no finished run yet, nothing to compare")
  check_comparable(labels, [m for m, _ in loaded])
  groups = [(label, records) for label, (_, records) in zip(labels, loaded)]
  if out:
    make_out(out)
  out = out or directory.make_run_dir(
      os.path.dirname(os.path.abspath(dirs[0])), "compare", field="--out")
  written = {}
  parts = [(stem, table) for stem, table in (
      (stem, tables.comparison(groups, metric)) for stem, metric in COMPARED)
      if table.rows]   # no id accuracy without an id split (val_fraction=0)
  for stem, table in parts:
    written[f"{stem}.md"] = table.markdown()
    written[f"{stem}.csv"] = table.csv()
  tagged = [dict(r, cell=f"{label}/{r['cell']}", variant=f"{r['variant']} "
                 f"({label})", row=f"{r['row']} ({label})")
            for label, records in groups for r in records]
  written["runs.csv"] = tables.long_table(tagged).csv()
  manifest = loaded[0][0]
  head = [f"# Comparison of {len(dirs)} runs ({manifest.get('dataset')}, "
          f"targets {', '.join(manifest.get('targets', []))})", ""]
  for label, d, (m, records) in zip(labels, dirs, loaded):
    done = len(finished(records))
    head.append(f"- `{label}`: `{os.path.abspath(d)}` ({m.get('name')}; "
                f"{done} runs)" + (
                    f"; {tables.PARTIAL} PARTIAL, {len(records) - done} "
                    "planned runs not finished:" if len(records) > done else ""))
    head += ["  " + line for line in missing_lines(m)]
    head += ["  " + line for line in diverged_lines(records) if line]
    head += [f"  - stand-in (`{cell}`): {w}"
             for cell, ws in m.get("warnings", {}).items() for w in ws]
    head += ["  " + line for line in provenance_lines(m, records)[2:]]
  written["report.md"] = "\n".join(head + [""] + [t.markdown() for _, t in parts])
  paths = []
  for name in ["report.md"] + [n for n in written if n != "report.md"]:
    paths.append(os.path.join(out, name))
    with open(paths[-1], "w") as f:
      f.write(written[name])
  paths.append(plots.sweep_curves(tagged, os.path.join(out, "curves.png")))
  return paths


def run_figures(run_dir: str) -> list[str]:
  """A single run directory's own table.md and figures
  (`run_summary.write_all`, what `fedjax-dg run` writes at its end), drawn
  from its results.json; [] for a sweep directory (its report draws
  them once for all cells)."""
  path = os.path.join(run_dir, "results.json")
  if os.path.isfile(os.path.join(run_dir, MANIFEST)) or not os.path.isfile(path):
    return []
  return run_summary.write_all(
      directory.read_json(path, directory.REDO_RESULTS), run_dir)


def main_report(args) -> int:
  if len(args.dirs) > 1:
    if args.d:
      raise ConfigError("--d selects the per-domain tables of one sweep "
                        "directory; a comparison of several has none")
    if args.reference:
      raise ConfigError("--reference selects what one sweep directory's "
                        "differences compare with; a comparison of several "
                        "has none")
    paths = compare(args.dirs, args.out)       # report.md first
    with open(paths[0]) as f:
      print(f.read())
  else:  # report.md's head (what finished, what is missing), first table
    # and the confidence intervals of the differences with the reference
    paths = write_report(args.dirs[0], args.out, args.d, args.reference)
    paths += run_figures(args.dirs[0])
    with open(next(p for p in paths if p.endswith("report.md"))) as f:
      text = f.read()
    second = text.find("\n### ", text.find("### ") + 1)
    print(text if second < 0 else text[:second])
    differences = next((p for p in paths
                        if os.path.basename(p) == f"{DIFFERENCES}.md"), None)
    if differences and second >= 0:
      with open(differences) as f:
        print(f.read())
  print("wrote " + ", ".join(paths))
  return 0
