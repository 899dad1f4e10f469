"""A report's tables made again from committed runs.csv files alone.

    python docs/results/derive.py OUT RUNS.csv [RUNS.csv ...]

docs/results.md quotes no number that a committed CSV does not hold. Some
sweeps kept only their runs.csv (the per-run long table) and not their
results.json files, or ran as two sweeps (seed 0, then seeds 1-2): their
means over seeds were in no CSV. This writes into OUT every table that
`fedjax-dg report` writes (`reports.report_tables`: per_domain_d*, summary,
table2, differences ...; .md and .csv), computed by the same code from the
runs those CSVs list (`records.records_from_runs_csv`), and derived.md
naming the input files. No figures: runs.csv holds no evaluation history.
Run it from the repository root (it imports this checkout's fedjax_dg).
"""

from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from fedjax_dg.report import records as records_lib  # noqa: E402
from fedjax_dg.report import tables  # noqa: E402
from fedjax_dg.run import reports  # noqa: E402


def derive(out: str, paths: list[str]) -> list[str]:
  """Writes OUT's tables from the runs of `paths`; returns the files written."""
  records = []
  for path in paths:
    with open(path) as f:
      records += records_lib.records_from_runs_csv(list(csv.DictReader(f)),
                                                   tables.LONG_FIELDS)
  os.makedirs(out, exist_ok=True)
  written = []
  for stem, table in reports.report_tables(records):
    for ext, text in (("md", table.markdown()), ("csv", table.csv())):
      written.append(os.path.join(out, f"{stem}.{ext}"))
      with open(written[-1], "w") as f:
        f.write(text)
  inputs = "\n".join(f"- `{os.path.relpath(p, out)}`" for p in paths)
  with open(os.path.join(out, "derived.md"), "w") as f:
    f.write(f"# Tables derived from runs.csv\n\n{len(records)} runs, read from:"
            f"\n\n{inputs}\n\nby `python docs/results/derive.py "
            f"{out} {' '.join(paths)}` (the tables of `fedjax-dg report`, "
            "computed by the same code; no figures).\n")
  return written + [os.path.join(out, "derived.md")]


if __name__ == "__main__":
  if len(sys.argv) < 3:
    sys.exit(__doc__)
  for path in derive(sys.argv[1], sys.argv[2:]):
    print(path)
