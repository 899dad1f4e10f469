"""Paper-style tables of a run's results dict, and its figures (`plots`)."""

from __future__ import annotations

import os

import numpy as np

from fedjax_dg import plots
from fedjax_dg.data.sources import eval_label


def _cell(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  mean = 100 * float(np.mean(values))
  if len(values) == 1:
    return f"{mean:.1f}"
  return f"{mean:.1f} ± {100 * float(np.std(values)):.1f}"


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
    row = [alg]
    for key in ("id_acc", "ood_acc"):
      final = [runs[t]["final"].get(key) if t in runs else None for t in targets]
      best = [best_over_rounds(runs[t], key)[0] if t in runs else None
              for t in targets]
      row += ([_cell([v]) for v in final] + [_cell(final)]
              + [_cell([v]) for v in best] + [_cell(best)])
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
  """The runs' warnings (`algorithms.Spec.diagnose`), one line each with its
  target; empty when there are none."""
  return "\n".join(f"WARNING ({r['target']}): {w}" for r in results["runs"]
                   for w in r.get("warnings", []))


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
    f.write(markdown_table(results) + "\n")
    if warnings_text(results):
      f.write("\n" + "\n\n".join(f"**{w}**" for w in
                                   warnings_text(results).splitlines()) + "\n")
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
