"""benchmarks/_data.py: the synthetic federation of benchmarks/scale.py."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _data import client_sizes, synthetic_federation  # noqa: E402


@pytest.mark.parametrize("total,n,skew", [(1_000_000, 100, 0.3),
                                          (1_000_000, 10_000, 0.3),
                                          (60, 50, 1.0), (50, 50, 1.0), (1_000, 7, 0.0)])
def test_client_sizes_sum_and_floor(total, n, skew):
  sizes = client_sizes(total, n, skew, seed=3)
  assert sizes.shape == (n,) and sizes.sum() == total and sizes.min() >= 1
  np.testing.assert_array_equal(sizes, client_sizes(total, n, skew, seed=3))
  if skew == 0 or total == n:  # equal shares: sizes differ by at most one
    assert sizes.max() - sizes.min() <= 1
  else:
    assert not np.array_equal(sizes, client_sizes(total, n, skew, seed=4))


def test_client_sizes_follow_the_shares():
  # Largest remainder: each size is within 1 of 1 + its exact share.
  total, n, skew, seed = 10_000, 37, 0.8, 1
  share = np.random.default_rng([seed, n]).lognormal(0.0, skew, n)
  exact = 1 + share / share.sum() * (total - n)
  assert np.abs(client_sizes(total, n, skew, seed) - exact).max() < 1


def test_client_sizes_refuse_more_clients_than_examples():
  with pytest.raises(ValueError, match="num_clients=11"):
    client_sizes(10, 11)


def test_synthetic_federation_is_packed_and_shared():
  a, b = synthetic_federation(4, total=1_000), synthetic_federation(9, total=1_000)
  for fed, n in ((a, 4), (b, 9)):
    t = fed.packed_train
    assert fed.num_clients == n and t.x.shape == (1_000, 28, 28, 1)
    assert t.x.dtype == np.uint8 and len(t.y) == 1_000
    np.testing.assert_array_equal(np.diff(t.offsets), client_sizes(1_000, n))
    assert t.width == client_sizes(1_000, n).max()
    assert fed.packed_val.n.sum() == 0 and len(fed.target_y) == 0
  assert a.packed_train.x is b.packed_train.x  # one example array per process
  # A gathered client is its own packed rows, zero padded to the width.
  t = b.packed_train
  got = t.gather(np.array([5]))
  lo, hi = t.offsets[5], t.offsets[6]
  np.testing.assert_array_equal(got.x[0, :hi - lo], t.x[lo:hi])
  assert not got.x[0, hi - lo:].any() and got.n[0] == hi - lo
