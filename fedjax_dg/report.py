"""Paper-style tables and learning-curve plots from a run's results dict."""

from __future__ import annotations

import os

import numpy as np


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


def plot_curves(results: dict, path: str) -> str:
  """id / ood accuracy and training loss vs round, per algorithm (mean over targets)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metrics = [("id_acc", "id accuracy"), ("ood_acc", "ood accuracy"),
             ("train_loss", "training loss")]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
  for alg in results["algorithms"]:
    runs = [r for r in results["runs"] if r["algorithm"] == alg and r["history"]]
    if not runs:
      continue
    for ax, (key, label) in zip(axes, metrics):
      curves = [[h.get(key, np.nan) for h in r["history"]] for r in runs]
      n = min(len(c) for c in curves)
      rounds = [h["round"] for h in runs[0]["history"][:n]]
      stack = np.array([c[:n] for c in curves], dtype=float)
      line, = ax.plot(rounds, np.nanmean(stack, 0), label=alg, lw=2)
      for c in stack:
        ax.plot(rounds, c, color=line.get_color(), alpha=0.2, lw=1)
      ax.set_xlabel("round")
      ax.set_ylabel(label)
  axes[0].legend()
  fig.suptitle(f"{results['name']}: {results['dataset']}, mean over held-out "
               "domains (thin: each domain)")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write_all(results: dict, run_dir: str) -> list[str]:
  paths = []
  md = os.path.join(run_dir, "table.md")
  with open(md, "w") as f:
    f.write(f"# {results['name']} ({results['dataset']})\n\n")
    f.write("Final accuracy (%) per held-out target domain; id = each client's "
            "model on its own held-out source split, ood = on the unseen domain.\n\n")
    f.write(markdown_table(results) + "\n")
  paths.append(md)
  paths.append(plot_curves(results, os.path.join(run_dir, "curves.png")))
  return paths
