"""Figures of a run directory's results (the hFedF paper's analyses).

Every function takes the results dict written by `experiment.run` and a path,
draws with matplotlib's Agg backend and returns the path, or None when the results
hold nothing to draw (e.g. no hFedF run for the GradAlign figure).
"""

from __future__ import annotations

import os

import numpy as np

from fedjax_dg.data.splits import eval_label
from fedjax_dg.report import tables
from fedjax_dg.report.records import curves


def pyplot():
  """matplotlib.pyplot for figures drawn into files: the Agg backend (no
  window), except inside a Jupyter / Colab kernel, whose inline backend stays
  so that the notebook's own figures still show (ours are closed once saved)."""
  import sys
  import matplotlib
  if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def show(*paths: str | None, width: float = 11.0) -> None:
  """Draws saved PNG files in a notebook (the figures `run_summary.write_all` or
  `federation_view.plot` wrote), one figure each, `width` inches wide; None
  (a figure that had nothing to draw) is skipped."""
  plt = pyplot()
  for path in paths:
    if path is None:
      continue
    image = plt.imread(path)
    fig, ax = plt.subplots(figsize=(width, width * image.shape[0] / image.shape[1]))
    ax.imshow(image)
    ax.set_axis_off()
    fig.subplots_adjust(0, 0, 1, 1)
    plt.show()
    plt.close(fig)


def _runs(results: dict, algorithm: str | None = None) -> list[dict]:
  return [r for r in results["runs"]
          if algorithm is None or r["algorithm"] == algorithm]


def _note(ax, text: str) -> None:
  """`text` across an empty panel (a split that was not evaluated)."""
  ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def learning_curves(results: dict, path: str) -> str | None:
  """id / ood accuracy and training loss per eval (mean over targets; thin: each)."""
  plt = pyplot()
  lab = eval_label(results.get("targets", ()))
  metrics = [("id_acc", "id accuracy"), ("ood_acc", f"{lab} accuracy"),
             ("train_loss", "training loss")]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
  for alg in results["algorithms"]:
    runs = [r for r in _runs(results, alg) if r["history"]]
    if not runs:
      continue
    for ax, (key, label) in zip(axes, metrics):
      curves = [[h.get(key, np.nan) for h in r["history"]] for r in runs]
      n = min(len(c) for c in curves)
      rounds = [h["round"] for h in runs[0]["history"][:n]]
      stack = np.array([c[:n] for c in curves], dtype=float)
      if np.isnan(stack).all():  # not evaluated (no id-validation / target split)
        continue
      line, = ax.plot(rounds, np.nanmean(stack, 0), label=alg, lw=2, marker=".")
      for c in stack:
        ax.plot(rounds, c, color=line.get_color(), alpha=0.2, lw=1)
      ax.set_xlabel("round")
      ax.set_ylabel(label)
      ax.xaxis.get_major_locator().set_params(integer=True)  # rounds
  drawn = [ax for ax in axes if ax.lines]
  if not drawn:
    plt.close(fig)
    return None
  drawn[0].legend()  # one legend: the first panel with curves
  for ax, (_, label) in zip(axes, metrics):
    if not ax.lines:
      _note(ax, f"{label}: not evaluated")
  fig.suptitle(f"{results['name']}: {results['dataset']}, mean over held-out "
               "domains (thin: each domain)")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def gradalign_weights(results: dict, path: str,
                      algorithm: str = "hfedf") -> str | None:
  """Fig. 5a (weights per client over rounds) and Fig. 7 (final weights)."""
  runs = [r for r in _runs(results, algorithm)
          if r.get("round_metrics", {}).get("gradalign_theta")]
  if not runs:
    return None
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(13, 4), constrained_layout=True,
                           gridspec_kw=dict(width_ratios=[3, 2]))
  for r in runs:
    w = np.asarray(r["round_metrics"]["gradalign_theta"])
    for i in range(w.shape[1]):
      axes[0].plot(np.arange(1, len(w) + 1), w[:, i], alpha=0.5, lw=1)
  axes[0].axhline(1.0 / w.shape[1], color="k", ls=":", lw=1, label="uniform")
  axes[0].set(xlabel="round", ylabel="GradAlign weight (theta)",
              title="per client and held-out domain")
  axes[0].legend()
  final = np.array([np.asarray(r["round_metrics"]["gradalign_theta"])[-1]
                    for r in runs])
  im = axes[1].imshow(final, cmap="Blues", aspect="auto")
  axes[1].set(xlabel="client", ylabel="held-out domain",
              yticks=range(len(runs)), yticklabels=[r["target"] for r in runs],
              title="final weights")
  fig.colorbar(im, ax=axes[1])
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def weight_divergence(results: dict, path: str) -> str | None:
  """Fig. 5b: per-layer divergence between client models, per personalized method."""
  per_alg = {}
  for r in results["runs"]:
    div = r["final"].get("weight_divergence")
    if div:
      per_alg.setdefault(r["algorithm"], []).append(div)
  if not per_alg:
    return None
  plt = pyplot()
  layers = list(next(iter(per_alg.values()))[0])
  fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(layers)), 4),
                         constrained_layout=True)
  width = 0.8 / len(per_alg)
  for k, (alg, divs) in enumerate(per_alg.items()):
    mean = [np.mean([d[l] for d in divs if l in d]) for l in layers]
    ax.bar(np.arange(len(layers)) + k * width, mean, width, label=alg)
  ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2)
  ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("mean pairwise ||w_i - w_j|| / mean ||w_i||")
  ax.set_title("weight divergence between client models (mean over held-out domains)")
  ax.legend()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def embeddings(results: dict, path: str, algorithm: str = "hfedf") -> str | None:
  """Fig. 6a: the learned client embeddings (first two coordinates / PCA)."""
  runs = [r for r in _runs(results, algorithm)
          if r["final"].get("extras", {}).get("embeddings")]
  if not runs:
    return None
  plt = pyplot()
  fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3),
                           constrained_layout=True, squeeze=False)
  for ax, r in zip(axes[0], runs):
    e = np.asarray(r["final"]["extras"]["embeddings"], float)
    if e.shape[1] == 1:
      xy = np.concatenate([e, np.zeros_like(e)], 1)
    elif e.shape[1] == 2:
      xy = e
    else:
      c = e - e.mean(0)
      xy = c @ np.linalg.svd(c, full_matrices=False)[2][:2].T
    ax.scatter(xy[:, 0], xy[:, 1], c=np.arange(len(e)), cmap="tab10", s=40)
    for i, (a, b) in enumerate(xy):
      ax.annotate(str(i), (a, b), fontsize=8)
    ax.set_title(f"held out: {r['target']}", fontsize=9)
    if e.shape[1] == 1:
      ax.set_yticks([])
  fig.suptitle(f"{algorithm} client embeddings")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def confidence(results: dict, path: str) -> str | None:
  """Fig. 6b: top-class probability of correct / incorrect predictions, id / ood."""
  algs = [a for a in results["algorithms"]
          if any(r["final"].get("calibration") for r in _runs(results, a))]
  if not algs:
    return None
  plt = pyplot()
  fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
  for alg in algs:
    for col, split in enumerate(("id", "ood")):
      cal = [r["final"]["calibration"][split] for r in _runs(results, alg)
             if split in r["final"].get("calibration", {})]
      if not cal:
        continue
      edges = np.asarray(cal[0]["bin_edges"])
      centers = (edges[:-1] + edges[1:]) / 2
      ece = np.mean([c["ece"] for c in cal])
      for row, key in enumerate(("hist_correct", "hist_incorrect")):
        h = np.sum([c[key] for c in cal], 0).astype(float)
        axes[row, col].plot(centers, h / max(h.sum(), 1), marker=".",
                            label=f"{alg} (ECE {ece:.3f})")
  for row, what in enumerate(("correct", "incorrect")):
    for col, split in enumerate(("id", eval_label(results.get("targets", ())))):
      axes[row, col].set(title=f"{what} predictions ({split})",
                         xlabel="predicted-class probability", ylabel="density")
      if axes[row, col].lines:
        axes[row, col].legend(fontsize=8)
      else:
        _note(axes[row, col], f"no {split} evaluation")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def tsne(results: dict, path: str, max_points: int = 1000) -> str | None:
  """FedCCRL Fig. 5: t-SNE of the target domain's features, one panel per
  algorithm (the first target with saved features; `train.features_max`),
  coloured by class."""
  run_dir = results.get("run_dir", "")
  found = {}
  for target in results.get("targets", ()):
    for alg in results["algorithms"]:
      f = os.path.join(run_dir, "features", f"{alg}--{target}.npz")
      if os.path.exists(f):
        found[alg] = f
    if found:
      break
  if not found:
    return None
  from sklearn.manifold import TSNE
  plt = pyplot()
  fig, axes = plt.subplots(1, len(found), figsize=(3.6 * len(found), 3.4),
                           constrained_layout=True, squeeze=False)
  for ax, (alg, f) in zip(axes[0], found.items()):
    with np.load(f) as z:
      feats, labels = z["features"][:max_points], z["labels"][:max_points]
    xy = TSNE(n_components=2, perplexity=float(min(30, len(feats) - 1)),
              init="pca", random_state=0).fit_transform(feats.astype(np.float64))
    ax.scatter(xy[:, 0], xy[:, 1], c=labels, cmap="tab10", s=6)
    ax.set_title(f"{alg} (held out: {target})", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
  fig.suptitle("t-SNE of target-domain features, coloured by class")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


ALL = {"curves.png": learning_curves, "gradalign.png": gradalign_weights,
       "weight_divergence.png": weight_divergence, "embeddings.png": embeddings,
       "confidence.png": confidence, "tsne.png": tsne}


def _panel_line(r: dict) -> tuple:
  """A sweep record's (panel, line name) in `sweep_curves`: its scenario and
  the variant without it (`row`); else its general grid settings (`extra`,
  e.g. "data.lam=0.1, data.num_clients=50") and the algorithm's name with
  its own settings only."""
  if r.get("scenario"):
    return f"scenario {r['scenario']}", r["row"]
  name, label, extra = r["variant"], r.get("label") or "", r.get("extra") or ""
  if label and name.endswith(f" [{label}]"):
    name = name[:-len(label) - 3]
  own = label[:-len(extra)].rstrip(", ") if extra and label.endswith(
      extra) else label
  return extra or None, name + (f" [{own}]" if own else "")


def sweep_curves(records: list[dict], path: str) -> str:
  """A sweep's curves (`fedjax-dg report`): id / ood accuracy vs round, mean
  over targets and seeds, per (variant, d); one row of panels per HyperGenFL
  scenario, or per point of the grid's general settings (lambda and C of the
  federated DG benchmark's grid: its methods' lines side by side within
  each). `records` are `tables` records."""
  plt = pyplot()
  panel_of = {r["variant"]: _panel_line(r) for r in records}
  panels = sorted({p for p, _ in panel_of.values()}, key=lambda p: (
      p is not None, tables.SCENARIO_ORDER.index(p[len("scenario "):])
      if p and p[len("scenario "):] in tables.SCENARIO_ORDER
      else len(tables.SCENARIO_ORDER), p or ""))
  fig, axes = plt.subplots(len(panels), 2, squeeze=False,
                           figsize=(14, 4.8 * len(panels)),
                           constrained_layout=True)
  lab = eval_label(r["target"] for r in records)
  ds = {r["d"] for r in records}
  for (ax_id, ax_ood), panel in zip(axes, panels):
    subset = [r for r in records if panel_of[r["variant"]][0] == panel]
    for ax, metric in ((ax_id, "id"), (ax_ood, "ood")):
      lines = curves(subset, metric)
      if len(lines) > 10:  # more lines than tab10 has colours
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
      for (variant, d), (rounds, mean) in lines.items():
        label = panel_of[variant][1] + (f", d={d}" if len(ds) > 1 or not
                                        panel else "")
        ax.plot(rounds, [100 * m for m in mean], label=label, lw=1.5)
      ax.set_xlabel("round")
      ax.set_ylabel(f"{metric if metric == 'id' else lab} accuracy (%)")
      ax.grid(alpha=0.3)
      if panel:
        ax.set_title(panel)
    handles, labels = ax_id.get_legend_handles_labels()
    if handles:
      ax_ood.legend(handles, labels, fontsize=7, loc="best",
                    ncol=1 + len(labels) // 12)
  fig.suptitle("evaluation history, mean over held-out targets and seeds")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def example_indices(labels: np.ndarray, domains: np.ndarray, num_domains: int,
                    num_classes: int, per_domain: int, seed: int = 0) -> np.ndarray:
  """[num_domains, per_domain] indices for `domain_examples`: row d, column j
  is a seeded-random example of domain d and class j % num_classes (-1 where
  the domain has none), so a column shows one class in every domain."""
  rng = np.random.default_rng(seed)
  out = np.full((num_domains, per_domain), -1, np.int64)
  for d in range(num_domains):
    for j in range(per_domain):
      pick = np.flatnonzero((domains == d) & (labels == j % num_classes))
      if len(pick):
        out[d, j] = rng.choice(pick)
  return out


def domain_examples(dataset, path: str, per_domain: int = 10,
                    seed: int = 0, scale: float = 0.9) -> str:
  """A grid of examples of a `DomainDataset`: one row per domain, one column
  per class (the first `per_domain` classes; a class repeats when there are
  fewer), `scale` inches per image."""
  plt = pyplot()
  idx = example_indices(dataset.labels, dataset.domains, dataset.num_domains,
                        dataset.num_classes, per_domain, seed)
  rows, cols = idx.shape
  fig, axes = plt.subplots(rows, cols, squeeze=False,
                           figsize=(scale * cols + 0.8, scale * rows + 0.5))
  for d, row in enumerate(axes):
    for j, ax in enumerate(row):
      ax.set_xticks([])
      ax.set_yticks([])
      if idx[d, j] >= 0:
        image = dataset.images[idx[d, j]]
        if image.shape[-1] == 1:
          ax.imshow(image[..., 0], cmap="gray", vmin=0, vmax=255)
        else:
          ax.imshow(image)
      if d == 0:
        ax.set_title(dataset.class_names[j % dataset.num_classes], fontsize=7)
      if j == 0:
        ax.set_ylabel(dataset.domain_names[d], fontsize=8)
  fig.suptitle(f"{dataset.name}: one example per domain (row) and class "
               "(column)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
