"""Partition invariants over many seeds and settings (plain loops, no hypothesis)."""

import itertools
import warnings

import numpy as np
import pytest

from fedjax_dg.data import partition
from fedjax_dg.data.partition import PartitionSpec


def _domains(sizes):
  return np.concatenate([np.full(n, j) for j, n in enumerate(sizes)])


def _assert_disjoint(parts, allowed):
  allp = np.concatenate(parts)
  assert len(allp) == len(np.unique(allp)), "an example is used twice"
  assert set(allp.tolist()) <= set(np.asarray(allowed).tolist())


def test_leave_one_domain_out():
  domains = _domains([5, 7, 3])
  src, tgt = partition.leave_one_domain_out(domains, 1)
  assert set(domains[tgt]) == {1} and len(tgt) == 7
  assert 1 not in set(domains[src]) and len(src) == 8
  with pytest.raises(ValueError, match="target=4"):
    partition.leave_one_domain_out(domains, 4)


def test_domain_split_parts_follow_alg5():
  # N=2 clients, d=2, S=3 domains (the paper's Fig. 2b): a=1, b=1, largest gets 2.
  assert partition.domain_split_parts([10, 30, 20], 2, 2) == [1, 2, 1]
  assert partition.domain_split_parts([10, 30, 20], 4, 3) == [4, 4, 4]
  assert partition.domain_split_parts([5, 5, 5], 3, 2) == [2, 2, 2]
  assert partition.domain_split_parts([5, 9, 5, 9], 3, 3) == [2, 3, 2, 2]  # tie


def test_domain_split_exactly_d_domains_for_many_settings():
  rng = np.random.default_rng(0)
  checked = 0
  for s, n, seed in itertools.product(range(1, 7), range(1, 11), range(3)):
    sizes = rng.integers(40, 90, size=s)
    domains = _domains(sizes)
    source = np.arange(len(domains))
    for d in range(1, s + 1):
      if n * d < s:
        continue  # Leaves domains unused: tested separately.
      parts = partition.domain_split(domains, source, n, d, seed)
      assert len(parts) == n
      _assert_disjoint(parts, source)
      assert sum(len(p) for p in parts) == len(source)  # Every domain fully used.
      for p in parts:
        assert len(np.unique(domains[p])) == d
      checked += 1
  assert checked > 400


def test_domain_split_is_seeded_and_random_over_clients():
  domains = _domains([30, 40, 50])
  a = partition.domain_split(domains, np.arange(120), 4, 2, seed=1)
  b = partition.domain_split(domains, np.arange(120), 4, 2, seed=1)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  holdings = {
      tuple(tuple(sorted(set(domains[p]))) for p in
            partition.domain_split(domains, np.arange(120), 4, 2, seed=s))
      for s in range(20)
  }
  assert len(holdings) > 1  # The client order is permuted by the seed.


def test_domain_split_on_source_subset_and_parts_sizes():
  domains = _domains([20, 20, 20, 20])
  src, tgt = partition.leave_one_domain_out(domains, 2)
  parts = partition.domain_split(domains, src, 3, 1, seed=0)
  _assert_disjoint(parts, src)
  assert not set(np.concatenate(parts)) & set(tgt)
  assert sorted(len(p) for p in parts) == [20, 20, 20]


def test_domain_split_errors_and_unused_domains():
  domains = _domains([10, 10, 10])
  msg = "d=4 but there are only 3 source domains: allowed 1..3"
  with pytest.raises(ValueError, match=msg):
    partition.domain_split(domains, np.arange(30), 2, 4)
  with pytest.raises(ValueError, match="d=0"):
    partition.domain_split(domains, np.arange(30), 2, 0)
  with pytest.raises(ValueError, match="num_clients=0"):
    partition.domain_split(domains, np.arange(30), 0, 1)
  with pytest.raises(ValueError, match="has 10 examples but num_clients=30"):
    partition.domain_split(domains, np.arange(30), 30, 2)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    parts = partition.domain_split(_domains([10, 30, 20]), np.arange(60), 2, 1)
  assert "left unused" in str(w[0].message) and "[0]" in str(w[0].message)
  assert sorted(len(p) for p in parts) == [20, 30]


def test_k_clients_per_domain():
  domains = _domains([9, 12, 7])
  for k, seed in itertools.product(range(1, 8), range(3)):
    parts = partition.k_clients_per_domain(domains, np.arange(28), k, seed)
    assert len(parts) == 3 * k
    _assert_disjoint(parts, np.arange(28))
    for j in range(3):
      members = parts[j * k:(j + 1) * k]
      assert all(set(domains[p]) == {j} for p in members)
      sizes = [len(p) for p in members]
      assert max(sizes) - min(sizes) <= 1
  with pytest.raises(ValueError, match="fewer than k_per_domain=8"):
    partition.k_clients_per_domain(domains, np.arange(28), 8, 0)


def test_iid():
  for n, seed in itertools.product([1, 3, 10], range(3)):
    parts = partition.iid(np.arange(5, 105), n, seed)
    _assert_disjoint(parts, np.arange(5, 105))
    assert sum(len(p) for p in parts) == 100
  with pytest.raises(ValueError, match="num_clients=11 with 10 examples"):
    partition.iid(np.arange(10), 11)


def test_dirichlet_min_size_and_skew_decreases_with_alpha():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, size=4000)
  idx = np.arange(4000)
  distances = []
  for alpha in (0.05, 0.5, 5.0, 100.0):
    parts = partition.dirichlet(labels, idx, 10, alpha, min_partition_size=20, seed=3)
    _assert_disjoint(parts, idx)
    assert sum(len(p) for p in parts) == 4000
    assert min(len(p) for p in parts) >= 20
    # Mean total-variation distance of client label histograms from uniform.
    tv = [0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - 0.1).sum()
          for p in parts]
    distances.append(np.mean(tv))
  assert all(a > b for a, b in zip(distances, distances[1:])), distances
  assert distances[-1] < 0.1 and distances[0] > 0.5


def test_dirichlet_errors():
  labels = np.repeat(np.arange(5), 20)
  with pytest.raises(ValueError, match="alpha=0.001 .*min_partition_size=19"):
    partition.dirichlet(labels, np.arange(100), 5, 0.001, min_partition_size=19,
                        seed=0, max_tries=5)
  with pytest.raises(ValueError, match="min_partition_size=30 with 100 examples"):
    partition.dirichlet(labels, np.arange(100), 5, 1.0, min_partition_size=30)
  with pytest.raises(ValueError, match="alpha"):
    partition.dirichlet(labels, np.arange(100), 5, -1.0)
  with pytest.raises(ValueError, match="alpha"):
    partition.dirichlet(labels, np.arange(100), 5, [1.0, 2.0])


def test_few_shot_target():
  target = np.arange(100, 150)
  shots, rest = partition.few_shot_target(target, 4, 5, seed=2)
  assert [len(s) for s in shots] == [5] * 4 and len(rest) == 30
  _assert_disjoint(shots + [rest], target)
  assert len(np.concatenate(shots + [rest])) == 50
  shots0, rest0 = partition.few_shot_target(target, 4, 0)
  assert all(len(s) == 0 for s in shots0) and len(rest0) == 50
  with pytest.raises(ValueError, match="few_shot_k=13 with 50 target examples"):
    partition.few_shot_target(target, 4, 13)


def test_partition_spec_validation():
  assert PartitionSpec("hfedf", num_clients=3).name == "domain_split"
  msg = "name='ring': allowed domain_split, k_per_domain, iid, dirichlet"
  with pytest.raises(ValueError, match=msg):
    PartitionSpec("ring", num_clients=3)
  with pytest.raises(ValueError, match="num_clients is required"):
    PartitionSpec("iid")
  with pytest.raises(ValueError, match="num_clients=0"):
    PartitionSpec("iid", num_clients=0)
  with pytest.raises(ValueError, match="alpha=0"):
    PartitionSpec("dirichlet", num_clients=3, alpha=0)
  with pytest.raises(ValueError, match="PartitionSpec.k_per_domain is required"):
    PartitionSpec("k_per_domain")
  with pytest.raises(ValueError, match="d=5 but there are only 3 source domains"):
    PartitionSpec(num_clients=3, d=5).validate(3)
  with pytest.raises(ValueError, match="multiple of the 3 source domains"):
    PartitionSpec("k_per_domain", num_clients=4).validate(3)
  with pytest.raises(ValueError, match="unknown partition settings \\['clients'\\]"):
    partition.as_spec({"name": "iid", "clients": 3})
  assert partition.as_spec({"name": "iid"}, num_clients=2).num_clients == 2


def test_make_partition_dispatch():
  domains = _domains([20, 30, 25])
  labels = np.arange(75) % 5
  src = np.flatnonzero(domains != 0)
  kw = dict(domains=domains, labels=labels, indices=src)
  assert len(partition.make_partition(PartitionSpec(num_clients=4, d=2), **kw)) == 4
  assert len(partition.make_partition({"name": "k_per_domain", "k_per_domain": 3}, **kw)) == 6
  assert len(partition.make_partition(name="k_per_domain", num_clients=4, **kw)) == 4
  assert len(partition.make_partition(name="iid", num_clients=5, **kw)) == 5
  parts = partition.make_partition(name="dirichlet", num_clients=3, alpha=1.0,
                                   min_partition_size=5, **kw)
  _assert_disjoint(parts, src)
  with pytest.raises(ValueError, match="d=3 but there are only 2 source domains"):
    partition.make_partition(name="hfedf", num_clients=4, d=3, **kw)


def test_make_partition_hands_its_dirichlet_settings_on():
  """make_partition's "dirichlet" is dirichlet() with the spec's alpha,
  min_partition_size and seed: the same parts as the direct call, for an
  alpha far from the 0.5 default either way (100: near-uniform labels,
  0.05: one or two classes per client), and other parts than the default's.
  Pins that spec.alpha reaches dirichlet()."""
  labels = np.arange(600) % 6
  domains = np.zeros(600, int)
  idx = np.arange(600)
  for alpha in (100.0, 0.05):
    got = partition.make_partition(name="dirichlet", num_clients=4,
                                   alpha=alpha, min_partition_size=12, seed=7,
                                   domains=domains, labels=labels, indices=idx)
    want = partition.dirichlet(labels, idx, 4, alpha, min_partition_size=12,
                               seed=7)
    default = partition.dirichlet(labels, idx, 4, 0.5, min_partition_size=12,
                                  seed=7)
    assert len(got) == 4
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
    assert any(len(g) != len(d) or (g != d).any() for g, d in zip(got, default))
  # The label skew follows alpha: near-uniform at 100, skewed at 0.05.
  tv = lambda a: _label_tv_from_global(labels, partition.make_partition(
      name="dirichlet", num_clients=4, alpha=a, min_partition_size=12,
      seed=7, domains=domains, labels=labels, indices=idx), 6)
  assert tv(100.0) < 0.15 < 0.5 < tv(0.05)


def _label_tv_from_global(labels, parts, num_classes):
  """Mean total-variation distance of client label distributions from the global."""
  glob = np.bincount(labels, minlength=num_classes) / len(labels)
  return float(np.mean([
      0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - glob)
      .sum() for p in parts]))


def test_dirichlet_label_skew_shrinks_as_beta_grows():
  """HyperGenFL's split: every example once, min size kept, skew falls with beta.

  Imbalanced global labels (so 'uniform' would be the wrong reference), a subset
  of the indices (only the train split is partitioned), three seeds averaged.
  """
  rng = np.random.default_rng(7)
  num_classes = 10
  weights = np.linspace(1.0, 3.0, num_classes)
  labels = rng.choice(num_classes, size=6000, p=weights / weights.sum())
  idx = np.sort(rng.choice(6000, 5000, replace=False))
  means = []
  for beta in (0.05, 0.5, 5.0, 50.0):
    tvs = []
    for seed in range(3):
      parts = partition.dirichlet(labels, idx, 10, beta, min_partition_size=10,
                                  seed=seed)
      assert len(parts) == 10
      np.testing.assert_array_equal(np.sort(np.concatenate(parts)), idx)
      assert min(len(p) for p in parts) >= 10
      tvs.append(_label_tv_from_global(labels, parts, num_classes))
    means.append(np.mean(tvs))
  assert all(a > b for a, b in zip(means, means[1:])), means
  assert means[0] > 0.6 and means[-1] < 0.1, means
  # Seeded: the same seed gives the same split.
  a = partition.dirichlet(labels, idx, 20, 0.5, min_partition_size=15, seed=4)
  b = partition.dirichlet(labels, idx, 20, 0.5, min_partition_size=15, seed=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("clients,beta", [(10, 0.5), (100, 0.25), (100, 0.1)])
def test_dirichlet_paper_scenarios_are_feasible(clients, beta):
  """Table 1's scenarios on a CIFAR-10-sized train split with min size 10."""
  labels = np.repeat(np.arange(10), 5000)
  parts = partition.dirichlet(labels, np.arange(50000), clients, beta,
                              min_partition_size=10, seed=0)
  assert len(parts) == clients and min(len(p) for p in parts) >= 10
  assert sum(len(p) for p in parts) == 50000


def _released_counts(sizes, num_shards, iid):
  """The released benchmark code's count matrix (FedDG_Benchmark,
  src/splitter.py, NonIIDSplitter.split), transcribed loop for loop with
  its names: the independent computation `heterogeneous_counts` is checked
  against."""
  num_examples_per_domain = np.asarray(sizes)
  num_domains = len(num_examples_per_domain)
  if sum(num_examples_per_domain > 0) <= num_shards:
    main_shards_per_domain = (num_examples_per_domain > 0).astype("int")
    while np.sum(main_shards_per_domain) < num_shards:
      ratio = np.divide(num_examples_per_domain.astype("float"),
                        main_shards_per_domain.astype("float"),
                        out=np.zeros_like(num_examples_per_domain.astype("float")),
                        where=main_shards_per_domain != 0)
      main_shards_per_domain[np.argmax(ratio)] += 1
    main_domain_per_shards = []
    for i, num_shard in enumerate(main_shards_per_domain):
      main_domain_per_shards += [i] * int(num_shard)
    main_ratio = np.array([1 / u if u != 0 else 0
                           for u in main_shards_per_domain])
    rows = []
    for main_domain in main_domain_per_shards:
      onehot = np.zeros(num_domains)
      onehot[main_domain] = 1
      rows.append(num_examples_per_domain * (main_ratio * onehot * (1 - iid)
                                             + 1 / num_shards * iid))
    exact = np.array(rows)
    floor = exact.astype(int)
    diff = np.rint(np.sum(exact - floor, axis=0)).astype(int)
    mask = np.zeros((num_shards, num_domains))
    for col in range(num_domains):
      mask[0:diff[col], col] = 1
    return np.rint(floor + mask).astype(int)
  hetero = np.zeros((num_shards, num_domains))
  # The released code sorts with numpy's default (unstable: its order of
  # equal domains varies with numpy's build and the CPU); stable here, as in
  # fedjax_dg (docs/faithfulness.md).
  for idx in np.argsort(num_examples_per_domain, kind="stable")[::-1]:
    hetero[np.argmin(np.sum(hetero, axis=1)), idx] = num_examples_per_domain[idx]
  homo = np.zeros((num_shards, num_domains))
  for shard in homo:
    shard += num_examples_per_domain / num_shards
  final = np.floor(homo * iid + hetero * (1 - iid)).astype("int")
  for i, diff in enumerate(num_examples_per_domain - np.sum(final, axis=0)):
    for d in range(int(diff)):
      final[d, i] += 1
  return final


def _random_settings(count, seed=0):
  """(domain sizes, clients, lam) over 1-6 domains of 20-400 examples,
  2-200 clients (fewer and more than the domains) and lam at both ends,
  the paper's 0.1 and anywhere between."""
  rng = np.random.default_rng(seed)
  for k in range(count):
    sizes = rng.integers(20, 400, size=rng.integers(1, 7))
    clients = int(rng.integers(2, 9) if k % 2 else rng.integers(2, 201))
    lam = float((0.0, 0.1, 1.0, rng.uniform())[k % 4])
    yield sizes, min(clients, int(sizes.sum())), lam


def test_heterogeneous_counts_are_the_released_codes_but_for_remainders():
  """Each count within one example of the released code's, each domain
  dealt whole by both; equal where no floor loses an example (the two
  differ only in which clients get a domain's remainder)."""
  equal = 0
  for sizes, clients, lam in _random_settings(400):
    got = partition.heterogeneous_counts(sizes, clients, lam)
    want = _released_counts(sizes, clients, lam)
    assert np.abs(got - want).max() <= 1, (sizes, clients, lam)
    np.testing.assert_array_equal(got.sum(axis=0), sizes)
    np.testing.assert_array_equal(want.sum(axis=0), sizes)
    equal += np.array_equal(got, want)
  assert 40 < equal < 400, equal  # both kinds of case were drawn
  # Two domains, 3 clients at lam = 0: domain 0 (100 examples) has two main
  # clients of 50; domain 1's 51 go to client 2. Exactly divisible: equal.
  np.testing.assert_array_equal(partition.heterogeneous_counts([100, 51], 3, 0.0),
                                [[50, 0], [50, 0], [0, 51]])
  # 101: one example over; here it goes to a main client of domain 0, the
  # released code's to client 0 as well.
  np.testing.assert_array_equal(partition.heterogeneous_counts([101, 51], 3, 0.0),
                                [[51, 0], [50, 0], [0, 51]])
  # Domain 1 with two main clients, 51 / 2: its extra example goes to one of
  # them (client 1), where the released code gives it to client 0, whose
  # main domain is domain 0.
  np.testing.assert_array_equal(partition.heterogeneous_counts([50, 51], 3, 0.0),
                                [[50, 0], [0, 26], [0, 25]])
  np.testing.assert_array_equal(_released_counts([50, 51], 3, 0.0),
                                [[50, 1], [0, 25], [0, 25]])


def test_heterogeneous_is_a_balanced_partition_at_every_lambda():
  """For random domain sizes, client counts (2-200) and lam: C clients,
  every source example exactly once, client i's examples of domain j the
  count's, within one example of lam's mixture; lam = 1: every client the
  domains' proportions; lam = 0: one domain per client (C >= domains) or
  each domain in one client (C < domains); the main clients spread so that
  moving one to another domain would not lower the most examples a main
  client holds (balanced sizes)."""
  for k, (sizes, clients, lam) in enumerate(_random_settings(120, seed=1)):
    domains = _domains(sizes) * 2 + 1  # non-contiguous ids
    source = np.flatnonzero(np.arange(len(domains)) % 7 != 3)  # a subset
    dom = domains[source]
    ids = np.unique(dom)
    n = np.array([np.sum(dom == j) for j in ids])
    if clients > len(source):
      continue
    parts = partition.heterogeneous(domains, source, clients, lam, seed=k)
    assert len(parts) == clients and min(map(len, parts)) >= 1
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), source)
    got = np.array([[np.sum(domains[p] == j) for j in ids] for p in parts])
    np.testing.assert_array_equal(
        got, partition.heterogeneous_counts(n, clients, lam))
    if clients >= len(ids):
      main = partition.main_clients_per_domain(n, clients)
      assert main.sum() == clients and main.min() >= 1
      per = n / main
      lower = [n[j] / (main[j] - 1) for j in range(len(n)) if main[j] > 1]
      assert per.max() <= min(lower, default=np.inf) + 1e-9, (n, main)
      owner = np.repeat(np.arange(len(n)), main)
      exact = n * ((1 - lam) * (owner[:, None] == np.arange(len(n))) / main
                   + lam / clients)
    else:
      whole = (got > 0) if lam == 0 else None
      exact = None
      if lam == 0:
        assert (whole.sum(axis=0) == 1).all(), got  # each domain whole
    if exact is not None:
      assert np.abs(got - exact).max() < 1 + 1e-9, (got, exact)
    if lam == 0 and clients >= len(ids):
      assert ((got > 0).sum(axis=1) == 1).all(), got
    if lam == 1:
      assert np.abs(got - n / clients).max() < 1 + 1e-9
      assert np.ptp(got.sum(axis=1)) <= 1, got.sum(axis=1)
    big = [p for p in parts if len(p) > 5]  # seeded-random order within
    assert not big or not all(np.all(np.diff(p) > 0) for p in big)


def test_heterogeneous_is_seeded_and_validated():
  domains = _domains([50, 80, 30])
  source = np.arange(len(domains))
  a = partition.heterogeneous(domains, source, 7, 0.1, seed=3)
  b = partition.heterogeneous(domains, source, 7, 0.1, seed=3)
  c = partition.heterogeneous(domains, source, 7, 0.1, seed=4)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(np.sort(x), np.sort(y)) for x, y in zip(a, c))
  for bad in (-0.1, 1.5, True, "0.1"):
    with pytest.raises(ValueError, match="lam="):
      partition.heterogeneous(domains, source, 7, bad)
    with pytest.raises(ValueError, match="lam="):
      PartitionSpec("heterogeneous", num_clients=7, lam=bad)
  with pytest.raises(ValueError, match="num_clients=161"):
    partition.heterogeneous(domains, source, 161, 0.5)
  spec = PartitionSpec("heterogeneous", num_clients=7, lam=1.0, seed=3)
  parts = partition.make_partition(spec, domains=domains, labels=domains,
                                   indices=source)
  np.testing.assert_array_equal(
      [[np.sum(domains[p] == j) for j in range(3)] for p in parts],
      partition.heterogeneous_counts([50, 80, 30], 7, 1.0))
  assert "lam=1.0" in spec.describe()
