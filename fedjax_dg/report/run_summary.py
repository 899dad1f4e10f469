"""Paper-style tables of a run's results dict, and its figures (`plots`).

`table.md` holds the full table (per held-out target: final and best over
rounds, id and ood); a terminal gets `terminal_summary` instead (at most 100
columns: per algorithm its μ with the spread over targets, then per-domain
tables wrapped to the width). A μ over fewer targets than the run holds
(a run still missing) is marked `PARTIAL` there and in table.md, never shown
as a complete mean; the stand-ins the run used (results.json's `warnings`:
random weights where pretrained ones belong...) are printed with both.
"""

from __future__ import annotations

import os

import numpy as np

from fedjax_dg.report import origin, plots
from fedjax_dg.data.splits import eval_label


# Marks a mean over fewer held-out targets than the run has (`missing_runs`).
PARTIAL = "†"
# Marks a value of a run that diverged (results.json's `diverged`).
DIVERGED = "‡"
WIDTH = 100  # terminal columns of `terminal_summary`


def _cell(values, blown: bool = False) -> str:
  """Mean ± std (over targets) in percent; `PARTIAL` when some, not all, of
  `values` are missing (None): a mean over fewer targets than expected;
  `DIVERGED` when a run behind them diverged (`blown`)."""
  present = [v for v in values if v is not None]
  if not present:
    return "-"
  mean = 100 * float(np.mean(present))
  mark = (PARTIAL if len(present) < len(values) else "") + (
      DIVERGED if blown else "")
  if len(present) == 1:
    return f"{mean:.1f}{mark}"
  return f"{mean:.1f} ± {100 * float(np.std(present)):.1f}{mark}"


def missing_runs(results: dict) -> list[tuple[str, str]]:
  """(algorithm, target) of every run the results' config asks for that
  results.json does not hold (a run stopped or failed part way)."""
  done = {(r["algorithm"], str(r["target"])) for r in results["runs"]}
  return [(a, str(t)) for a in results["algorithms"] for t in results["targets"]
          if (a, str(t)) not in done]


def diverged_text(results: dict) -> str:
  """'' or one line per run that diverged (results.json's `diverged`)."""
  return "\n".join(f"{DIVERGED} DIVERGED: {r['algorithm']} / {r['target']}: "
                   f"{r['diverged']}" for r in results["runs"]
                   if r.get("diverged"))


def missing_text(results: dict) -> str:
  """'' or one line naming the runs results.json lacks, per algorithm."""
  missing = missing_runs(results)
  if not missing:
    return ""
  per = {}
  for a, t in missing:
    per.setdefault(a, []).append(t)
  total = len(results["algorithms"]) * len(results["targets"])
  return (f"{PARTIAL} PARTIAL: {len(missing)} of {total} runs missing ("
          + "; ".join(f"{a}: targets {', '.join(ts)}" for a, ts in per.items())
          + f"); a mean marked {PARTIAL} is over the finished targets only")


def best_over_rounds(run: dict, key: str) -> tuple[float | None, int | None]:
  """(highest `key` over the run's evaluation history, its earliest round);
  the final evaluation when there is no history."""
  points = [(h[key], h["round"]) for h in run.get("history") or []
            if h.get(key) is not None]
  if not points:
    final = run.get("final") or {}
    return final.get(key), final.get("round")
  value = max(v for v, _ in points)
  return value, min(r for v, r in points if v == value)


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
  """Header and rows: per held-out target, final accuracy and the best over
  evaluation rounds side by side (HyperGenFL reports the best), id then ood /
  test, each with its mean over targets (μ)."""
  targets = results["targets"]
  lab = eval_label(targets)
  header = ["algorithm"]
  for m in ("id", lab):
    header += ([f"{m} {t}" for t in targets] + [f"{m} μ"]
               + [f"best {m} {t}" for t in targets] + [f"best {m} μ"])
  rows = []
  for alg in results["algorithms"]:
    runs = {r["target"]: r for r in results["runs"] if r["algorithm"] == alg}
    blown = [bool(runs[t].get("diverged")) if t in runs else False
             for t in targets]
    row = [alg]
    for key in ("id_acc", "ood_acc"):
      final = [runs[t]["final"].get(key) if t in runs else None for t in targets]
      best = [best_over_rounds(runs[t], key)[0] if t in runs else None
              for t in targets]
      row += ([_cell([v], b) for v, b in zip(final, blown)]
              + [_cell(final, any(blown))]
              + [_cell([v], b) for v, b in zip(best, blown)]
              + [_cell(best, any(blown))])
    rows.append(row)
  return header, rows


def best_rounds(results: dict) -> list[str]:
  """Lines "alg / target: best <label> x.x at round r of R (final y.y)"."""
  lab = eval_label(results["targets"])
  lines = []
  for r in results["runs"]:
    best, rnd = best_over_rounds(r, "ood_acc")
    if best is None:
      continue
    final = r["final"].get("ood_acc")
    last = (r.get("final") or {}).get("round")
    lines.append(f"{r['algorithm']} / {r['target']}: best {lab} "
                 f"{100 * best:.1f} at round {rnd}"
                 + (f" of {last}" if last is not None else "")
                 + ("" if final is None else f" (final {100 * final:.1f})"))
  return lines


def markdown_table(results: dict) -> str:
  header, rows = table_rows(results)
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def text_table(results: dict) -> str:
  header, rows = table_rows(results)
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  fmt = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                            for i, (x, w) in enumerate(zip(r, widths)))
  rule = "-" * len(fmt(header))
  return "\n".join([fmt(header), rule] + [fmt(r) for r in rows])


def warnings_text(results: dict) -> str:
  """The run's stand-ins (results.json's `warnings`: random weights where
  pretrained ones belong, domains left out...) and the runs' warnings
  (`algorithms.Spec.diagnose`, with their target), one line each; empty
  when there are none."""
  return "\n".join([f"WARNING: {w}" for w in results.get("warnings", [])]
                   + [f"WARNING ({r['target']}): {w}" for r in results["runs"]
                      for w in r.get("warnings", [])])


def _wrap_columns(label: str, names: list[str], rows: list[tuple[str, list]],
                  width: int) -> list[str]:
  """A text table (row label, then one column per name) split into blocks
  of columns so that no line is wider than `width`; each block repeats the
  row labels."""
  lab = min(max([len(label)] + [len(r) for r, _ in rows]), width // 3)
  widths = [max(len(n), max((len(c[i]) for _, c in rows), default=1))
            for i, n in enumerate(names)]
  blocks, start = [], 0
  while start < len(names):
    end, used = start, lab
    while end < len(names) and (end == start
                                or used + 2 + widths[end] <= width):
      used += 2 + widths[end]
      end += 1
    blocks.append(range(start, end))
    start = end
  lines = []
  for block in blocks:
    fmt = lambda first, cells: "  ".join(
        [first[:lab].ljust(lab)] + [cells[i].rjust(widths[i]) for i in block]
    ).rstrip()[:width]
    lines.append(fmt(label, names))
    lines += [fmt(r, cells) for r, cells in rows]
  return lines


def terminal_summary(results: dict, width: int = WIDTH) -> str:
  """What a terminal shows of a run (every line at most `width` columns):
  per algorithm id μ and ood μ (final evaluation) with the spread (std)
  over the held-out targets, then the per-domain final accuracies, wrapped
  to the width. The full table (best over rounds too) is table.md.

  Args:
    results: what `fedjax_dg.run.experiment.run` returns (a run directory's
      results.json).
    width: the terminal's columns.

  Returns:
    The summary's lines joined, as `fedjax-dg run` and `demo` print it.
  """
  targets = [str(t) for t in results["targets"]]
  lab = eval_label(targets)
  runs = {(r["algorithm"], str(r["target"])): r for r in results["runs"]}
  value = lambda a, t, key: ((runs[(a, t)].get("final") or {}).get(key)
                             if (a, t) in runs else None)
  blown = lambda a, t: bool((runs.get((a, t)) or {}).get("diverged"))
  name_w = min(max(len(a) for a in results["algorithms"]), width // 3)
  lines = [f"final accuracy (%), μ ± std over {len(targets)} held-out "
           f"target{'s' if len(targets) != 1 else ''}:"]
  for a in results["algorithms"]:
    any_blown = any(blown(a, t) for t in targets)
    cells = [f"{m} μ {_cell([value(a, t, key) for t in targets], any_blown)}"
             for m, key in (("id", "id_acc"), (lab, "ood_acc"))]
    lines.append(f"  {a[:name_w].ljust(name_w)}  " + "   ".join(
        c.ljust(20) for c in cells).rstrip())
  for m, key in ((lab, "ood_acc"), ("id", "id_acc")):
    rows = [(a, [_cell([value(a, t, key)], blown(a, t)) for t in targets])
            for a in results["algorithms"]]
    if all(c == "-" for _, cells in rows for c in cells):
      continue  # no id split (data.val_fraction=0)
    lines += ["", f"{m} accuracy (%) per held-out target (final):"]
    lines += _wrap_columns("algorithm", targets, rows, width)
  partial = missing_text(results)
  if partial:
    lines += [""] + _wrap_text(partial, width)
  for line in diverged_text(results).splitlines():
    lines += [""] + _wrap_text(line, width)
  return "\n".join(line[:width] for line in lines)


def _wrap_text(text: str, width: int) -> list[str]:
  import textwrap
  return textwrap.wrap(text, width, break_on_hyphens=False)


def calibration_table(results: dict) -> str:
  """Markdown: ECE of id and ood predictions per algorithm (mean over targets)."""
  lines = []
  for alg in results["algorithms"]:
    cal = [r["final"].get("calibration", {}) for r in results["runs"]
           if r["algorithm"] == alg]
    vals = [np.mean([c[s]["ece"] for c in cal if s in c]) if any(s in c for c in cal)
            else None for s in ("id", "ood")]
    if any(v is not None for v in vals):
      lines.append(f"| {alg} | " + " | ".join("-" if v is None else f"{v:.3f}"
                                             for v in vals) + " |")
  if not lines:
    return ""
  lab = eval_label(results["targets"])
  return "\n".join([f"| algorithm | ECE id | ECE {lab} |", "|---|---:|---:|"]
                   + lines)


def write_all(results: dict, run_dir: str) -> list[str]:
  """Writes a run's table.md and its figures into `run_dir`.

  Args:
    results: what `fedjax_dg.run.experiment.run` returns (a run directory's
      results.json).
    run_dir: the folder to write into (the run directory).

  Returns:
    The paths written: table.md (final and best over rounds per target, the
    provenance, the stand-ins), then every figure that applies
    (`plots.ALL`: curves.png, gradalign.png, ...).
  """
  paths = []
  md = os.path.join(run_dir, "table.md")
  with open(md, "w") as f:
    f.write(f"# {results['name']} ({results['dataset']})\n\n")
    lab = eval_label(results["targets"])
    where = ("the held-out official test split" if lab == "test"
             else "the unseen domain")
    f.write(f"Accuracy (%) per held-out target; id = each client's model on its "
            f"own held-out validation split, {lab} = on {where}. Final = the last "
            f"evaluation; best = the highest evaluation over rounds (the "
            f"HyperGenFL paper's reported number; optimistic: it picks the round "
            f"on the evaluation data).\n\n")
    f.write("\n".join(origin.provenance_lines(
        [origin.run_source(r, results.get("source")) for r in results["runs"]],
        [results])) + "\n\n")
    if results.get("warnings"):  # before the numbers they qualify
      f.write("**Stand-ins and resumes: these numbers do not follow the "
              "protocol, or ran with more than one commit or environment "
              "(results.json `warnings`):**\n\n"
              + "".join(f"- **{w}**\n" for w in results["warnings"]) + "\n")
    f.write(markdown_table(results) + "\n")
    if missing_text(results):
      f.write(f"\n**{missing_text(results)}**\n")
    for line in diverged_text(results).splitlines():
      f.write(f"\n**{line}**\n")
    diagnosed = [f"WARNING ({r['target']}): {w}" for r in results["runs"]
                 for w in r.get("warnings", [])]
    if diagnosed:
      f.write("\n" + "\n\n".join(f"**{w}**" for w in diagnosed) + "\n")
    lines = best_rounds(results)
    if lines:
      f.write("\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    ece = calibration_table(results)
    if ece:
      f.write("\nExpected calibration error (15 bins, mean over held-out domains; "
              "lower is better):\n\n" + ece + "\n")
  paths.append(md)
  for name, draw in plots.ALL.items():
    path = draw(results, os.path.join(run_dir, name))
    if path is not None:
      paths.append(path)
  return paths
