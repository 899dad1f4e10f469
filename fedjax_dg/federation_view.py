"""`fedjax-dg partition`: the federation a run would build, without training:
per-client example counts by domain or by class, as a table and a plot (stacked
bars or a heatmap, like flwr-datasets' partition plots).

Counts are of each client's training split (its id-validation examples are held
apart; their count is the `val` column).
"""

from __future__ import annotations

import numpy as np

from fedjax_dg.errors import ConfigError
from fedjax_dg.report.plots import pyplot
from fedjax_dg.run import assemble, checks
from fedjax_dg.run import config as config_lib

BY = ("domains", "classes")
KINDS = ("bar", "heatmap")


def counts(fed, dataset, by: str) -> tuple[list[str], np.ndarray]:
  """(column names, int [clients, columns]): each client's training examples
  per class, or per domain (the source domains, from the examples' indices
  into `dataset`)."""
  if by not in BY:
    raise ConfigError(f"--by {by!r}: allowed {BY}")
  packed = fed.packed_train
  n = packed.n
  if by == "classes":
    table = np.stack([np.bincount(packed.y[a:b], minlength=fed.num_classes)
                      for a, b in zip(packed.offsets[:-1], packed.offsets[1:])])
    return list(fed.class_names), table
  if len(fed.train_indices) != len(n):
    raise ConfigError("this federation has no example indices (built by hand): "
                      "count it by classes (--by classes)")
  domains = np.asarray(dataset.domains)
  held = set(np.unique(np.concatenate(
      [domains[np.asarray(i)] for i in fed.train_indices])).tolist())
  # The source domains, and any other a client holds (few-shot target examples).
  cols = [d for d, name in enumerate(dataset.domain_names)
          if name in fed.source_domains or d in held]
  names = [dataset.domain_names[d] for d in cols]
  table = np.zeros((len(n), len(cols)), np.int64)
  for c, idx in enumerate(fed.train_indices):
    found, k = np.unique(domains[np.asarray(idx)], return_counts=True)
    table[c, [cols.index(int(d)) for d in found]] = k
  return names, table


def text_table(names: list[str], table: np.ndarray, val: np.ndarray) -> str:
  """Clients as rows, `names` then the training total `n` and `val` as columns."""
  heads = ["client"] + [str(s) for s in names] + ["n", "val"]
  rows = [[str(c)] + [str(int(v)) for v in row] + [str(int(row.sum())),
                                                   str(int(val[c]))]
          for c, row in enumerate(table)]
  rows.append(["total"] + [str(int(v)) for v in table.sum(0)]
              + [str(int(table.sum())), str(int(np.sum(val)))])
  widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
  fmt = lambda r: "  ".join(s.rjust(w) for s, w in zip(r, widths))
  return "\n".join([fmt(heads)] + [fmt(r) for r in rows])


def plot(panels: list[tuple[str, list[str], np.ndarray]], by: str, path: str,
         kind: str = "bar") -> str:
  """One panel per (title, names, table): stacked bars (a bar per client, a
  segment per domain / class) or a heatmap; written to `path`."""
  if kind not in KINDS:
    raise ConfigError(f"--plot-kind {kind!r}: allowed {KINDS}")
  plt = pyplot()
  clients = max(len(t) for _, _, t in panels)
  every = list(dict.fromkeys(n for _, names, _ in panels for n in names))
  # 0.35 inch per client up to 12 inches a panel; beyond 30 clients every
  # 10th is labelled (HyperGenFL's 100).
  fig, axes = plt.subplots(
      1, len(panels), squeeze=False, constrained_layout=True,
      figsize=(max(4.0, min(0.35 * clients, 12.0) + 2.5) * len(panels), 4.2))
  for ax, (title, names, table) in zip(axes[0], panels):
    x = np.arange(len(table))
    if kind == "bar":
      cmap = plt.get_cmap("tab20" if len(every) > 10 else "tab10")
      bottom = np.zeros(len(table))
      for k, name in enumerate(names):  # one colour per name in every panel
        ax.bar(x, table[:, k], bottom=bottom, label=str(name),
               color=cmap(every.index(name) % cmap.N), width=0.8)
        bottom += table[:, k]
      ax.set_ylabel("training examples")
      ax.legend(title=by[:-1] if by == "domains" else "class", fontsize=7,
                loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
      im = ax.imshow(table.T, aspect="auto", cmap="Greens")
      ax.set_yticks(range(len(names)), [str(s) for s in names], fontsize=7)
      ax.set_ylabel(by[:-1] if by == "domains" else "class")
      if table.size <= 400 and len(x) <= 30:
        for (c, k), v in np.ndenumerate(table):
          ax.text(c, k, str(int(v)), ha="center", va="center", fontsize=6)
      fig.colorbar(im, ax=ax, label="training examples")
    shown = x if len(x) <= 30 else x[::10]
    ax.set_xticks(shown, [str(c) for c in shown], fontsize=7)
    ax.set_xlabel("client")
    ax.set_title(title)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(args) -> int:
  """`fedjax-dg partition --config CFG [--set k=v] [--by] [--plot OUT.png]`."""
  if args.plot and not args.plot.lower().endswith(".png"):
    raise ConfigError(f"--plot {args.plot!r}: give a .png path")
  if args.plot_kind not in KINDS:
    raise ConfigError(f"--plot-kind {args.plot_kind!r}: allowed {KINDS}")
  cfg = config_lib.apply_overrides(config_lib.load(args.config), args.set)
  cfg = assemble.resolve(cfg)
  checks.validate(cfg)
  dataset = assemble.load_dataset(cfg)
  panels = []
  for target in assemble.target_domains(cfg, dataset.domain_names):
    fed = assemble.federate(cfg, dataset, target)
    names, table = counts(fed, dataset, args.by)
    title = f"target {target}" if target is not None else "no target"
    print(f"{title}: {fed.summary()}")
    print(text_table(names, table, fed.packed_val.n))
    print()
    panels.append((title, names, table))
  if args.plot:
    print(f"wrote {plot(panels, args.by, args.plot, args.plot_kind)}")
  return 0
