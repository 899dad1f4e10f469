"""The tables of docs/results.md's FedCCRL Table 1 section, printed from the
three reports of its sweep (against FedAvg, FedCCRL and FedProx), so the
section is restated from the committed CSVs and Markdown, not retyped.

    python docs/results/table1_section.py REPORT_FEDAVG REPORT_FEDCCRL REPORT_FEDPROX

e.g. docs/results/styled_fmnist_table1_10seeds{,/vs_fedccrl,/vs_fedprox}.
Prints: the per-domain table (the held-out columns and id μ of
per_domain_d1.md, marks included), the differences table (μ_id and μ_ood
against FedAvg, μ_ood against FedProx and FedCCRL, final evaluation, 95 %
t intervals from each report's differences.csv), how far the best-over-rounds
differences are from the final ones, and the per-seed values behind each
difference against FedAvg and FedCCRL.
"""

from __future__ import annotations

import csv
import sys


def differences(report: str) -> dict:
  with open(f"{report}/differences.csv") as f:
    return {(r["variant"], r["evaluation"], r["metric"]): r
            for r in csv.DictReader(f)}


def interval(r) -> str:
  if r is None:
    return ""
  lo, hi = float(r["ci_low"]), float(r["ci_high"])
  mark = "↑" if lo > 0 else "↓" if hi < 0 else "≈"
  return f"{float(r['difference']):+.1f} [{lo:+.1f}, {hi:+.1f}] {mark}"


def per_domain(report: str) -> list[str]:
  """per_domain_d1.md's rows: algorithm, the ood columns, ood μ, id μ."""
  with open(f"{report}/per_domain_d1.md") as f:
    rows = [l.rstrip("\n") for l in f if l.startswith("| ")]  # no |---|
  head = [c.strip() for c in rows[0].strip("|").split("|")]
  keep = [0] + [i for i, c in enumerate(head) if c.startswith("ood")] + [
      head.index("id μ")]
  out = []
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    out.append("| " + " | ".join(cells[i] for i in keep) + " |")
  out.insert(1, "|---|" + "---:|" * (len(keep) - 1))
  return out


def main(fedavg: str, fedccrl: str, fedprox: str) -> None:
  rows = per_domain(fedavg)
  print("\n".join(rows), end="\n\n")
  da, dc, dp = differences(fedavg), differences(fedccrl), differences(fedprox)
  variants = [r.split("|")[1].strip() for r in rows[2:]]
  print("| algorithm | μ_id − FedAvg | μ_ood − FedAvg | μ_ood − FedProx | "
        "μ_ood − FedCCRL |\n|---|---:|---:|---:|---:|")
  for v in variants:
    v = v.strip("*")
    print(f"| {v} | {interval(da.get((v, 'final', 'id')))} | "
          f"{interval(da.get((v, 'final', 'ood')))} | "
          f"{interval(dp.get((v, 'final', 'ood')))} | "
          f"{interval(dc.get((v, 'final', 'ood')))} |")
  print("\nbest over rounds against final (against FedAvg):")
  for (v, ev, metric), r in da.items():
    if ev == "final" and (v, "best", metric) in da:
      gap = abs(float(r["difference"]) - float(da[v, "best", metric]["difference"]))
      print(f"  {v} μ_{metric}: final {interval(r)}, best "
            f"{interval(da[v, 'best', metric])}, apart {gap:.2f}")
  print("\nper seed, μ_ood (final):")
  for name, d in (("FedAvg", da), ("FedCCRL", dc)):
    for (v, ev, metric), r in d.items():
      if ev == "final" and metric == "ood":
        vals = [float(p.split(":")[1]) for p in r["per_seed"].split(";")]
        print(f"  {v} − {name}: " + ", ".join(f"{x:+.1f}" for x in vals)
              + f"  (range {min(vals):+.1f} to {max(vals):+.1f})")


if __name__ == "__main__":
  if len(sys.argv) != 4:
    sys.exit(__doc__)
  main(*sys.argv[1:])
