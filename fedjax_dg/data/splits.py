"""Which domains are official splits, and what a held-out evaluation is called.

The label-skew benchmarks (fashion_mnist, cifar10 / cifar100, tiny_imagenet)
have their official splits as domains; holding one out is a test-set
evaluation ("test"), not an unseen domain ("ood"). Reports, tables and plots
name accuracies by these rules.
"""

from __future__ import annotations

from typing import Iterable

# Domain names that are a dataset's official splits: a target domain with one of
# these names is a test split (reported as "test" accuracy, not "ood").
SPLIT_DOMAINS = ("train", "test", "val", "validation")


# The held-out evaluation split of the datasets whose domains are official splits
# (the label-skew benchmarks): `data.targets` for a test-set evaluation.
EVAL_SPLITS = {"fashion_mnist": "test", "cifar10": "test", "cifar100": "test",
               "tiny_imagenet": "val"}


def eval_split(name: str) -> str | None:
  """The official evaluation split (a domain name) of `name`, or None if its
  domains are not splits (domain-generalization datasets)."""
  return EVAL_SPLITS.get(name)


def is_split_domain(domain: str | None) -> bool:
  """Whether a target domain name is an official split (test accuracy, not ood)."""
  return domain is not None and str(domain) in SPLIT_DOMAINS


def eval_label(targets: Iterable) -> str:
  """How to call the held-out evaluation of runs with these target domains:
  "test" when every one is an official split (label-skew benchmarks:
  fashion_mnist / cifar / tiny_imagenet with targets="test"), else "ood" (an
  unseen domain). Runs without a target (None, "None") do not count."""
  targets = [t for t in targets if t not in (None, "None")]
  return "test" if targets and all(is_split_domain(t) for t in targets) else "ood"
