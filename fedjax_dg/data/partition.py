"""How examples are split among clients (numpy, seeded; the config's names).

The partitioners follow flwr-datasets' recipes (`DirichletPartitioner` and
friends), with the config's names (`num_clients` for flwr's `num_partitions`,
`k_per_domain`), so an error names the setting a user gives.

Every partitioner takes index arrays into a `DomainDataset` (plus its `domains` or
`labels` array) and returns one int64 index array per client, each client's
indices in seeded-random order. Nothing is shared: every example lands in at most
one partition. Invalid settings raise `ValueError` naming the setting, its value
and the allowed values, before any work is done.

* `leave_one_domain_out`: (source, target) indices for one unseen target domain.
* `domain_split` (hFedF Algorithm 5, alias "hfedf"): every client holds exactly
  `d` source domains.
* `k_clients_per_domain`: each source domain split into `k_per_domain` clients.
* `iid`: uniform random split.
* `dirichlet`: flwr-datasets `DirichletPartitioner` label skew.
* `heterogeneous`: the federated DG benchmark's split (Bai, Bagchi and
  Inouye, ICLR 2024): any number of clients, each source domain's examples
  dealt with the balancing parameter `lam` (1: every client the same domain
  mixture; 0: each client its main domain only, or whole domains when there
  are fewer clients than domains).
* `few_shot_target`: `k` target-domain examples per client, injected into training.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from fedjax_dg.data.settings import DataConfig
from fedjax_dg.errors import ConfigError, StandInWarning

PARTITIONERS = ("domain_split", "k_per_domain", "iid", "dirichlet",
                "heterogeneous")
# The settings each partitioner reads (besides few_shot_k and the seed):
# another partitioner's (`d` for iid) change nothing.
FIELDS = {
    "domain_split": ("num_clients", "d"),
    "k_per_domain": ("k_per_domain", "num_clients"),
    "iid": ("num_clients",),
    "dirichlet": ("num_clients", "alpha", "min_partition_size"),
    "heterogeneous": ("num_clients", "lam"),
}
ALIASES = {"hfedf": "domain_split", "k_clients_per_domain": "k_per_domain"}


def _as_indices(indices: Any) -> np.ndarray:
  return np.asarray(indices, dtype=np.int64).reshape(-1)


def _shuffled_parts(
    rng: np.random.Generator, parts: Sequence[np.ndarray]
) -> list[np.ndarray]:
  return [rng.permutation(np.asarray(p, np.int64)) for p in parts]


def _check_int(field: str, value: Any, low: int, high: int | None = None,
               why: str = "") -> None:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  ok = ok and value >= low and (high is None or value <= high)
  if not ok:
    allowed = f"{low}..{high}" if high is not None else f">= {low}"
    raise ConfigError(f"{field}={value!r}{why}: allowed {allowed} (an int)")


def _check_lam(field: str, value: Any) -> None:
  ok = (isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0)
  if not ok:
    raise ConfigError(f"{field}={value!r}: allowed a float in 0..1 (1: every "
                      "client the same domain mixture; 0: each client its "
                      "own domain)")


def leave_one_domain_out(
    domains: np.ndarray, target: int
) -> tuple[np.ndarray, np.ndarray]:
  """(source indices, target indices): the target domain is held out entirely."""
  domains = np.asarray(domains)
  present = np.unique(domains)
  if target not in present:
    raise ConfigError(
        f"target={target!r} is not a domain of the data: allowed {present.tolist()}"
    )
  return np.flatnonzero(domains != target), np.flatnonzero(domains == target)


def domain_split_parts(
    sizes: Sequence[int], num_clients: int, d: int
) -> list[int]:
  """hFedF Alg. 5 part counts: a = floor(N d / S) per domain, +1 for the b largest.

  b = (N d) mod S; ties among equally large domains go to the earlier domain.
  The counts sum to N d. When N d < S, a = 0 and the S - N d smallest domains get
  no part (they are left unused).
  """
  s = len(sizes)
  a, b = divmod(num_clients * d, s)
  largest = np.argsort(-np.asarray(sizes), kind="stable")[:b]
  return [a + 1 if j in largest else a for j in range(s)]


def domain_split(
    domains: np.ndarray,
    indices: np.ndarray,
    num_clients: int,
    d: int,
    seed: int = 0,
) -> list[np.ndarray]:
  """hFedF Algorithm 5: every client holds (a part of) exactly `d` source domains.

  Each source domain j (ascending domain id) is split randomly into p_j equal parts
  (`domain_split_parts`). The parts, laid out domain after domain, form a sequence
  of N d parts; then d rounds, in each of which every client in turn takes the
  first remaining part (Alg. 5's inner loop). The client order is a seeded
  permutation ("the partitions are randomly distributed among the clients").

  Why exactly d distinct domains: client t gets sequence positions t, t + N, ...,
  t + (d - 1) N. A domain occupies p_j <= N consecutive positions (p_j <= a + 1
  and a + 1 <= N whenever b > 0, since then a < N d / S <= N; p_j = a <= N
  otherwise), so positions N apart never fall in the same domain.
  """
  indices = _as_indices(indices)
  dom = np.asarray(domains)[indices]
  source = np.unique(dom)
  s = len(source)
  _check_int("num_clients", num_clients, 1)
  if s == 0:
    raise ConfigError("domain_split: no source examples to split")
  _check_int("d", d, 1, s, f" but there are only {s} source domains")
  per_domain = [indices[dom == j] for j in source]
  counts = domain_split_parts([len(p) for p in per_domain], num_clients, d)
  for j, (p, c) in zip(source, zip(per_domain, counts)):
    if len(p) < c:
      raise ConfigError(
          f"domain_split: source domain {int(j)} has {len(p)} examples but "
          f"num_clients={num_clients}, d={d} split it into {c} parts; "
          "lower num_clients or d"
      )
  unused = [int(j) for j, c in zip(source, counts) if c == 0]
  if unused:
    warnings.warn(
        f"domain_split: num_clients * d = {num_clients * d} < {s} source "
        f"domains, so the smallest domains {unused} are left unused",
        StandInWarning, stacklevel=2,
    )
  rng = np.random.default_rng(seed)
  sequence = []
  for p, c in zip(per_domain, counts):
    if c:
      sequence.extend(np.array_split(rng.permutation(p), c))
  order = rng.permutation(num_clients)
  clients: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
  for r in range(d):
    for turn, client in enumerate(order):
      clients[client].append(sequence[r * num_clients + turn])
  return _shuffled_parts(rng, [np.concatenate(c) for c in clients])


def k_clients_per_domain(
    domains: np.ndarray, indices: np.ndarray, k_per_domain: int, seed: int = 0
) -> list[np.ndarray]:
  """Each source domain (ascending id) split randomly into `k_per_domain`
  equal clients."""
  indices = _as_indices(indices)
  k = k_per_domain
  _check_int("k_per_domain", k, 1)
  dom = np.asarray(domains)[indices]
  rng = np.random.default_rng(seed)
  clients = []
  for j in np.unique(dom):
    members = indices[dom == j]
    if len(members) < k:
      raise ConfigError(
          f"k_per_domain: source domain {int(j)} has {len(members)} examples, "
          f"fewer than k_per_domain={k} clients; lower k_per_domain"
      )
    clients.extend(np.array_split(rng.permutation(members), k))
  return _shuffled_parts(rng, clients)


def iid(indices: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
  """Uniform random split into `num_clients` near-equal parts."""
  indices = _as_indices(indices)
  _check_int("num_clients", num_clients, 1, max(len(indices), 1),
             f" with {len(indices)} examples")
  rng = np.random.default_rng(seed)
  return list(np.array_split(rng.permutation(indices), num_clients))


def dirichlet(
    labels: np.ndarray,
    indices: np.ndarray,
    num_clients: int,
    alpha: float | Sequence[float],
    min_partition_size: int = DataConfig.min_partition_size,
    seed: int = 0,
    max_tries: int = 100,
) -> list[np.ndarray]:
  """flwr-datasets `DirichletPartitioner` (no self-balancing).

  For every class, proportions ~ Dir(alpha) over the partitions split that class's
  (shuffled) examples at `floor(cumsum(p) * n_c)`; the whole draw is repeated until
  every partition holds at least `min_partition_size` examples (default:
  `DataConfig`'s, 1; flwr's is 10, docs/data.md "Data defaults").
  """
  indices = _as_indices(indices)
  _check_int("num_clients", num_clients, 1)
  _check_int("min_partition_size", min_partition_size, 0,
             len(indices) // num_clients,
             f" with {len(indices)} examples in {num_clients} partitions")
  _check_int("max_tries", max_tries, 1)
  alphas = np.asarray(alpha, np.float64)
  if (alphas.ndim > 1 or (alphas.ndim == 1 and len(alphas) != num_clients)
      or not np.all(alphas > 0)):
    raise ConfigError(
        f"alpha={alpha!r}: allowed a positive float, or one per partition "
        f"({num_clients} positive floats)"
    )
  alphas = np.broadcast_to(alphas, (num_clients,))
  lab = np.asarray(labels)[indices]
  by_class = [indices[lab == c] for c in np.unique(lab)]
  rng = np.random.default_rng(seed)
  smallest = 0
  for _ in range(max_tries):
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for members in by_class:
      members = rng.permutation(members)
      cuts = (np.cumsum(rng.dirichlet(alphas)) * len(members)).astype(int)[:-1]
      for p, chunk in zip(parts, np.split(members, cuts)):
        p.append(chunk)
    sizes = [sum(len(c) for c in p) for p in parts]
    smallest = min(sizes)
    if smallest >= min_partition_size:
      return _shuffled_parts(rng, [np.concatenate(p) for p in parts])
  raise ConfigError(
      f"dirichlet: after max_tries={max_tries} draws with alpha={alpha} some "
      f"partition still had fewer than min_partition_size={min_partition_size} "
      f"examples (best draw: smallest partition {smallest}); raise alpha, lower "
      "min_partition_size or num_clients, or raise max_tries"
  )


def main_clients_per_domain(sizes: Sequence[int], num_clients: int) -> np.ndarray:
  """How many clients take each domain as their main one (`heterogeneous`,
  `num_clients` >= the non-empty domains): one each, then one more at a time
  to the domain with the most examples per main client (the first on a tie),
  until every client has a main domain; an empty domain gets none."""
  sizes = np.asarray(sizes, np.float64)
  main = (sizes > 0).astype(np.int64)
  while main.sum() < num_clients:
    per = np.divide(sizes, main, out=np.zeros_like(sizes), where=main > 0)
    main[int(np.argmax(per))] += 1
  return main


def heterogeneous_counts(sizes: Sequence[int], num_clients: int,
                         lam: float) -> np.ndarray:
  """[clients, domains] example counts of `heterogeneous` (the released
  benchmark code's `NonIIDSplitter`, `iid` = `lam`, but for where the
  floors' remainders go), domains in the order of `sizes`.

  With at least as many clients as non-empty domains, client i has a main
  domain m(i) (`main_clients_per_domain`: the clients of domain 0 first)
  and takes n_j ((1 - lam) [j = m(i)] / s_j + lam / C) of domain j (n_j its
  examples, s_j its main clients, C the clients). With fewer clients, the
  heterogeneous end deals whole domains, the largest first, each to the
  client holding the fewest examples so far (the first on a tie), and the
  counts are lam n_j / C + (1 - lam) times that. Either way the counts are
  floored and what a domain lost to the floors goes one example each to
  the clients whose counts of it lost the most, on a tie to those holding
  the fewest examples so far (then the first): every example is dealt
  once, at lam = 0 no client gets an example of a domain it has no share
  of, and at lam = 1 the clients' sizes differ by at most one. (The
  released code gives those examples to clients 0, 1, ... whatever their
  shares: at lam = 0 a few examples of other domains on the first
  clients, with many clients the later ones smaller or empty;
  docs/faithfulness.md.)
  """
  n = np.asarray(sizes, np.int64)
  c, lam = int(num_clients), float(lam)
  if int(np.sum(n > 0)) <= c:
    main = main_clients_per_domain(n, c)
    owner = np.repeat(np.arange(len(n)), main)  # m(i), client by client
    share = np.divide(1.0, main, out=np.zeros(len(n)), where=main > 0)
    onehot = np.eye(len(n))[owner]
    exact = n * (share * onehot * (1 - lam) + (1 / c) * lam)
  else:
    whole = np.zeros((c, len(n)))
    for j in np.argsort(n, kind="stable")[::-1]:
      whole[int(np.argmin(whole.sum(axis=1))), j] = n[j]
    exact = lam * np.broadcast_to(n / c, whole.shape) + (1 - lam) * whole
  counts = np.floor(exact).astype(np.int64)
  frac = np.round(exact - counts, 9)  # equal shares compare equal
  for j, short in enumerate(n - counts.sum(axis=0)):
    order = np.lexsort((np.arange(c), counts.sum(axis=1), -frac[:, j]))
    counts[order[:short], j] += 1
  return counts


def heterogeneous(domains: np.ndarray, indices: np.ndarray, num_clients: int,
                  lam: float, seed: int = 0) -> list[np.ndarray]:
  """The federated DG benchmark's split (Bai, Bagchi and Inouye, 2024):
  `num_clients` clients, fewer or more than the source domains, each
  domain's examples dealt by `heterogeneous_counts` (`lam` 1: every
  client the same mixture of the domains; 0: the most heterogeneous split,
  one domain per client where there are enough clients), from a seeded
  shuffle of each domain (ascending domain id), client after client."""
  indices = _as_indices(indices)
  _check_int("num_clients", num_clients, 1, max(len(indices), 1),
             f" with {len(indices)} examples")
  _check_lam("lam", lam)
  dom = np.asarray(domains)[indices]
  rng = np.random.default_rng(seed)
  per_domain = [rng.permutation(indices[dom == j]) for j in np.unique(dom)]
  counts = heterogeneous_counts([len(p) for p in per_domain], num_clients, lam)
  cuts = np.cumsum(counts, axis=0)[:-1]
  dealt = [np.split(p, cuts[:, j]) for j, p in enumerate(per_domain)]
  return _shuffled_parts(rng, [np.concatenate([d[i] for d in dealt])
                               for i in range(num_clients)])


def few_shot_target(
    target_indices: np.ndarray, num_clients: int, k: int, seed: int = 0
) -> tuple[list[np.ndarray], np.ndarray]:
  """(k random target examples per client, the remaining target examples)."""
  target_indices = _as_indices(target_indices)
  _check_int("num_clients", num_clients, 1)
  _check_int("few_shot_k", k, 0, len(target_indices) // num_clients,
             f" with {len(target_indices)} target examples for "
             f"{num_clients} clients")
  perm = np.random.default_rng(seed).permutation(target_indices)
  shots = [perm[i * k:(i + 1) * k] for i in range(num_clients)]
  return shots, np.sort(perm[num_clients * k:])


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
  """How to split the source examples among clients.

  The settings and their defaults are the config's `data` section's
  (`settings.DataConfig`: `partition` there is `name` here), but for
  `num_clients` and `k_per_domain`, which have no default here (None: not
  given); the config's 0 / 1 are resolved by `run.assemble.federate`.

  Attributes:
    name: "domain_split" (alias "hfedf"), "k_per_domain", "iid" or "dirichlet".
    num_clients: number of clients (for k_per_domain: k x source domains).
    d: source domains per client (domain_split).
    k_per_domain: clients per source domain (k_per_domain).
    alpha: Dirichlet concentration (dirichlet).
    min_partition_size: smallest allowed partition (dirichlet).
    few_shot_k: target-domain examples injected into each client's training data.
    seed: seed of the split.

  Invalid settings raise a ConfigError naming the field, the value and the
  allowed values, before any split is made.

  Example::

    from fedjax_dg.data import federated, partition
    spec = partition.PartitionSpec("domain_split", num_clients=10, d=2)
    fed = federated.build(ds, spec, target_domain="0")   # 10 clients,
                                                         # 2 domains each
  """

  name: str = DataConfig.partition
  num_clients: int | None = None
  d: int = DataConfig.d
  k_per_domain: int | None = None
  alpha: float = DataConfig.alpha
  min_partition_size: int = DataConfig.min_partition_size
  lam: float = DataConfig.lam
  few_shot_k: int = DataConfig.few_shot_k
  seed: int = 0

  def __post_init__(self):
    name = ALIASES.get(self.name, self.name)
    if name not in PARTITIONERS:
      raise ConfigError(
          f"PartitionSpec.name={self.name!r}: allowed "
          f"{', '.join(PARTITIONERS + tuple(ALIASES))}"
      )
    object.__setattr__(self, "name", name)
    if name == "k_per_domain":
      if self.k_per_domain is None and self.num_clients is None:
        raise ConfigError(
            "PartitionSpec.k_per_domain is required for name='k_per_domain' "
            "(clients per source domain, an int >= 1); or give num_clients"
        )
    elif self.num_clients is None:
      raise ConfigError(
          f"PartitionSpec.num_clients is required for name={name!r}: allowed "
          ">= 1 (an int)"
      )
    if self.num_clients is not None:
      _check_int("PartitionSpec.num_clients", self.num_clients, 1)
    if self.k_per_domain is not None:
      _check_int("PartitionSpec.k_per_domain", self.k_per_domain, 1)
    _check_int("PartitionSpec.d", self.d, 1)
    _check_int("PartitionSpec.min_partition_size", self.min_partition_size, 0)
    _check_int("PartitionSpec.few_shot_k", self.few_shot_k, 0)
    _check_int("PartitionSpec.seed", self.seed, 0)
    _check_lam("PartitionSpec.lam", self.lam)
    if not np.all(np.asarray(self.alpha, np.float64) > 0):
      raise ConfigError(
          f"PartitionSpec.alpha={self.alpha!r}: allowed a positive float"
      )

  def describe(self) -> str:
    """The name and the settings that matter for it, e.g. for error messages."""
    relevant = FIELDS[self.name] + (
        ("few_shot_k",) if self.few_shot_k else ()) + ("seed",)
    fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in relevant)
    return f"PartitionSpec(name={self.name!r}, {fields})"

  def total_clients(self, num_source_domains: int) -> int:
    """How many clients this spec yields for `num_source_domains` domains."""
    if self.name == "k_per_domain":
      return self.clients_per_domain(num_source_domains) * num_source_domains
    return int(self.num_clients)

  def clients_per_domain(self, num_source_domains: int) -> int:
    """k for k_per_domain: `k_per_domain`, or `num_clients /
    num_source_domains`."""
    if self.k_per_domain is not None:
      if (self.num_clients is not None
          and self.num_clients != self.k_per_domain * num_source_domains):
        raise ConfigError(
            f"PartitionSpec.num_clients={self.num_clients} disagrees with "
            f"k_per_domain={self.k_per_domain} x {num_source_domains} source "
            "domains; give only k_per_domain"
        )
      return self.k_per_domain
    if self.num_clients % num_source_domains:
      raise ConfigError(
          f"PartitionSpec.num_clients={self.num_clients} for k_per_domain "
          f"must be a multiple of the {num_source_domains} source domains; or "
          "give k_per_domain"
      )
    return self.num_clients // num_source_domains

  def validate(self, num_source_domains: int) -> None:
    """Checks the settings that depend on the data, before any split is made."""
    if num_source_domains < 1:
      raise ConfigError("there are no source domains to split among clients")
    if self.name == "domain_split":
      _check_int("PartitionSpec.d", self.d, 1, num_source_domains,
                 f" but there are only {num_source_domains} source domains")
    if self.name == "k_per_domain":
      self.clients_per_domain(num_source_domains)


def as_spec(spec: PartitionSpec | Mapping[str, Any] | None = None,
            **kwargs: Any) -> PartitionSpec:
  """A PartitionSpec from a spec, a mapping (e.g. a config dict) or keywords."""
  if isinstance(spec, PartitionSpec):
    return dataclasses.replace(spec, **kwargs) if kwargs else spec
  fields = dict(spec or {}, **kwargs)
  allowed = [f.name for f in dataclasses.fields(PartitionSpec)]
  unknown = sorted(set(fields) - set(allowed))
  if unknown:
    raise ConfigError(
        f"unknown partition settings {unknown}: allowed {', '.join(allowed)}"
    )
  return PartitionSpec(**fields)


def make_partition(
    spec: PartitionSpec | Mapping[str, Any] | None = None,
    *,
    domains: np.ndarray,
    labels: np.ndarray,
    indices: np.ndarray,
    **kwargs: Any,
) -> list[np.ndarray]:
  """Splits the source examples among clients as `spec` says.

  Args:
    spec: a `PartitionSpec`, a mapping of its fields, or None (then
      `kwargs` are its fields).
    domains: int [N], every example's domain (all of the dataset's).
    labels: int [N], every example's label (the Dirichlet split reads them).
    indices: int [M], the source examples to split (indices into
      `domains` / `labels`; the held-out target's are not among them).
    **kwargs: `PartitionSpec` fields, when `spec` is None.

  Returns:
    One int64 index array per client (indices into the dataset, in random
    order); every source example is used at most once.
  """
  spec = as_spec(spec, **kwargs)
  indices = _as_indices(indices)
  spec.validate(len(np.unique(np.asarray(domains)[indices])))
  if spec.name == "domain_split":
    return domain_split(domains, indices, spec.num_clients, spec.d, spec.seed)
  if spec.name == "k_per_domain":
    k = spec.clients_per_domain(len(np.unique(np.asarray(domains)[indices])))
    return k_clients_per_domain(domains, indices, k, spec.seed)
  if spec.name == "iid":
    return iid(indices, spec.num_clients, spec.seed)
  if spec.name == "heterogeneous":
    return heterogeneous(domains, indices, spec.num_clients, spec.lam,
                         spec.seed)
  return dirichlet(labels, indices, spec.num_clients, spec.alpha,
                   spec.min_partition_size, spec.seed)
