"""Paper-style tables of a run's results dict, and its figures (`plots`)."""

from __future__ import annotations

import os

import numpy as np

from fedjax_dg import plots


def _cell(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  mean = 100 * float(np.mean(values))
  if len(values) == 1:
    return f"{mean:.1f}"
  return f"{mean:.1f} ± {100 * float(np.std(values)):.1f}"


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
  """Header and rows: id accuracy per held-out domain + mean, then ood likewise."""
  targets = results["targets"]
  header = (["algorithm"] + [f"id {t}" for t in targets] + ["id μ"]
            + [f"ood {t}" for t in targets] + ["ood μ"])
  rows = []
  for alg in results["algorithms"]:
    runs = {r["target"]: r for r in results["runs"] if r["algorithm"] == alg}
    ids = [runs[t]["final"]["id_acc"] if t in runs else None for t in targets]
    oods = [runs[t]["final"].get("ood_acc") if t in runs else None for t in targets]
    rows.append([alg] + [_cell([v]) for v in ids] + [_cell(ids)]
                + [_cell([v]) for v in oods] + [_cell(oods)])
  return header, rows


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
  return "\n".join(["| algorithm | ECE id | ECE ood |", "|---|---:|---:|"] + lines)


def write_all(results: dict, run_dir: str) -> list[str]:
  paths = []
  md = os.path.join(run_dir, "table.md")
  with open(md, "w") as f:
    f.write(f"# {results['name']} ({results['dataset']})\n\n")
    f.write("Final accuracy (%) per held-out target domain; id = each client's "
            "model on its own held-out source split, ood = on the unseen domain.\n\n")
    f.write(markdown_table(results) + "\n")
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
