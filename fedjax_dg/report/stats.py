"""Paired differences against the reference algorithm, with a 95 % confidence
interval over seeds.

What is compared. A table's number is μ, the mean over the held-out target
domains. The targets are the protocol's fixed set (leave-one-domain-out over
every domain), not a sample of domains, so they are not a random unit. The
seeds are: a seed draws the partition of the source data among the clients,
the initialization and the batch order. One seed gives every algorithm of a
sweep cell the same partition, so an algorithm and the reference (FedAvg,
`algorithms.REFERENCE`, unless `fedjax-dg report --reference` names another)
are paired by seed, and the difference within a seed removes the variance
that the partition and the seed's data add to both.

Method. For each seed s, d_s = the mean over targets t of (x_st - r_st),
x the algorithm's accuracy and r the reference's on target t at seed s. The
estimate is mean(d) over the n seeds, its 95 % interval
mean(d) ± t_{0.975, n-1} · sd(d) / √n (sd with n - 1 in the denominator):
the paired Student-t interval on the seeds' target-means, the interval of
`scipy.stats.ttest_rel` on those values. With complete runs mean(d) is the
difference of the tables' two μ. A difference is significant when its
interval excludes zero.

Why t and not a percentile bootstrap. A sweep has 3 to 10 seeds. Resampling
n values cannot reach beyond their range and spreads like the plug-in sd
without the t quantile's allowance for estimating sd from n values, so the
percentile bootstrap under-covers: a 95 % percentile interval of the mean
of normal values covers the true mean ~73 % of the time at n = 3, ~84 % at
n = 5, ~90 % at n = 10 (2000 simulated samples each; the t interval: 94.9 %,
95.9 %, 95.0 %, within the simulation's error of 95 %; tests/test_stats.py,
test_t_interval_covers_95_percent_where_the_bootstrap_under_covers). The t
interval is exact when the d_s are normal and robust for means otherwise; each d_s is already an average over targets of accuracies
over thousands of images.

Missing pairs. A (seed, target) that only one side finished is left out:
d_s averages over the targets that both finished at seed s, a seed with no
such target drops out of n, and `unpaired` counts what was left out (the
tables mark the difference partial). With n < 2 there is no sd and no
interval: `low`, `high` and `excludes_zero` are None ("n<2" in the tables).

Everything here is numbers in, numbers out: values keyed by (seed, target),
in the values' own units (fractions in the records; the tables show points).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np
from scipy import special

CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Difference:
  """The paired difference algorithm − reference over seeds."""
  mean: float | None          # mean over seeds of d_s; None without a pair
  low: float | None           # the interval; None with n < 2
  high: float | None
  n: int                      # seeds with at least one paired target
  per_seed: dict[int, float]  # d_s, seed -> mean over its paired targets
  pairs: int = 0              # (seed, target) pairs behind per_seed
  unpaired: int = 0           # (seed, target) with one side's run only
  excludes_zero: bool | None = None   # significant; None with n < 2


def t_quantile(confidence: float, df: int) -> float:
  """The two-sided Student-t quantile t_{(1+confidence)/2, df}."""
  return float(special.stdtrit(df, (1 + confidence) / 2))


def seed_differences(values: Mapping[tuple[int, str], float],
                     reference: Mapping[tuple[int, str], float]
                     ) -> tuple[dict[int, float], int, int]:
  """(per_seed, pairs, unpaired): d_s = the mean over the targets that both
  `values` and `reference` ({(seed, target): value}) hold at seed s of their
  difference, in seed order; the pairs used and the keys of one side only."""
  paired = sorted(set(values) & set(reference))
  by_seed: dict[int, list[float]] = {}
  for seed, target in paired:
    by_seed.setdefault(seed, []).append(
        float(values[(seed, target)]) - float(reference[(seed, target)]))
  per_seed = {s: float(np.mean(d)) for s, d in by_seed.items()}
  unpaired = len(set(values) ^ set(reference))
  return per_seed, len(paired), unpaired


def interval(per_seed: Mapping[int, float],
             confidence: float = CONFIDENCE) -> tuple[float, float] | None:
  """The Student-t interval of the mean of the per-seed differences.

  Args:
    per_seed: {seed: d_s}, each seed's difference (e.g. `seed_differences`).
    confidence: the interval's coverage (0.95).

  Returns:
    (low, high) = mean(d) -/+ t((1 + confidence) / 2, n - 1) sd(d) / sqrt(n)
    over the n seeds; None with fewer than two seeds.
  """
  d = np.asarray(list(per_seed.values()), dtype=np.float64)
  n = len(d)
  if n < 2:
    return None
  half = t_quantile(confidence, n - 1) * float(np.std(d, ddof=1)) / math.sqrt(n)
  mean = float(np.mean(d))
  return mean - half, mean + half


def paired_difference(values: Mapping[tuple[int, str], float],
                      reference: Mapping[tuple[int, str], float],
                      confidence: float = CONFIDENCE) -> Difference:
  """The paired difference `values` − `reference` over seeds, with its
  interval (module docstring).

  Args:
    values: {(seed, target): accuracy} of the algorithm, one per finished
      run (seed and held-out target).
    reference: the same of the reference algorithm (FedAvg).
    confidence: the interval's coverage (0.95).

  Returns:
    A `Difference`: per seed d_s = the mean over the targets both sides
    hold of (value − reference); `mean` over the seeds, the Student-t
    interval `low` / `high` (None with fewer than two seeds), `n` seeds,
    `per_seed`, the `pairs` used, the `unpaired` keys of one side only, and
    `excludes_zero` (the ↑ / ↓ marks).

  Example::

    from fedjax_dg.report import stats
    algo = {(0, "0"): 0.52, (0, "30"): 0.71, (1, "0"): 0.50, (1, "30"): 0.69}
    ref = {(0, "0"): 0.50, (0, "30"): 0.70, (1, "0"): 0.49, (1, "30"): 0.69}
    d = stats.paired_difference(algo, ref)
    d.per_seed          # {0: 0.015, 1: 0.005}
    d.low, d.high       # the 95 % interval of their mean, 0.01
  """
  per_seed, pairs, unpaired = seed_differences(values, reference)
  if not per_seed:
    return Difference(None, None, None, 0, {}, 0, unpaired)
  mean = float(np.mean(list(per_seed.values())))
  bounds = interval(per_seed, confidence)
  if bounds is None:
    return Difference(mean, None, None, len(per_seed), per_seed, pairs, unpaired)
  low, high = bounds
  return Difference(mean, low, high, len(per_seed), per_seed, pairs, unpaired,
                    excludes_zero=bool(low > 0 or high < 0))
