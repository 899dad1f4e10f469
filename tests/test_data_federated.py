"""FederatedData: padding, counts, id-val split, target split, pooled, stats."""

import jax
import numpy as np
import pytest

from fedjax_dg.data import federated
from fedjax_dg.data.partition import PartitionSpec
from fedjax_dg.data.dataset import DomainDataset


def make_dataset(sizes=(40, 55, 30, 25), hw=(6, 5), ch=3, seed=0):
  rng = np.random.default_rng(seed)
  n = sum(sizes)
  return DomainDataset(
      name="toy",
      images=rng.integers(0, 256, (n,) + hw + (ch,), dtype=np.uint8),
      labels=rng.integers(0, 7, n).astype(np.int32),
      domains=np.concatenate([np.full(s, j, np.int32) for j, s in enumerate(sizes)]),
      domain_names=tuple(f"dom{j}" for j in range(len(sizes))),
      class_names=tuple(f"c{i}" for i in range(7)),
  )


def _real(arrays, c):
  n = int(arrays.n[c])
  return np.asarray(arrays.x[c, :n]), np.asarray(arrays.y[c, :n])


def test_build_padding_counts_and_splits():
  ds = make_dataset()
  fd = federated.build(ds, PartitionSpec(num_clients=5, d=2, seed=1),
                       target_domain="dom2", seed=4)
  assert fd.num_clients == 5 and fd.target_domain == "dom2"
  assert fd.source_domains == ("dom0", "dom1", "dom3")
  assert fd.train.x.dtype == np.uint8 and fd.train.y.dtype == np.int32
  assert fd.train.x.shape == (5, int(fd.train.n.max()), 6, 5, 3)
  assert fd.val.x.shape[:2] == (5, int(fd.val.n.max()))
  assert all(len(cd) == 2 and "dom2" not in cd for cd in fd.client_domains)
  seen = []
  for c in range(5):
    n_all = len(fd.train_indices[c]) + len(fd.val_indices[c])
    assert int(fd.val.n[c]) == max(1, round(0.1 * n_all))
    assert not set(fd.train_indices[c]) & set(fd.val_indices[c])
    for arrays, idx in ((fd.train, fd.train_indices[c]), (fd.val, fd.val_indices[c])):
      x, y = _real(arrays, c)
      np.testing.assert_array_equal(x, ds.images[idx])
      np.testing.assert_array_equal(y, ds.labels[idx])
      assert not arrays.x[c, len(idx):].any() and not arrays.y[c, len(idx):].any()
    seen += list(fd.train_indices[c]) + list(fd.val_indices[c])
  assert sorted(seen) == sorted(np.flatnonzero(ds.domains != 2))
  np.testing.assert_array_equal(fd.target_x, ds.images[ds.domains == 2])
  np.testing.assert_array_equal(fd.target_y, ds.labels[ds.domains == 2])


def test_mean_std_match_numpy():
  ds = make_dataset()
  fd = federated.build(ds, PartitionSpec("iid", num_clients=3), target_domain=0)
  train = np.concatenate([_real(fd.train, c)[0] for c in range(3)]) / 255.0
  np.testing.assert_allclose(fd.mean, train.mean((0, 1, 2)), rtol=1e-9)
  np.testing.assert_allclose(fd.std, train.std((0, 1, 2)), rtol=1e-9)
  assert len(fd.mean) == 3


def test_pooled_sums_counts_and_keeps_val():
  ds = make_dataset()
  fd = federated.build(ds, PartitionSpec("k_per_domain", k_per_domain=2), target_domain="dom1")
  assert fd.num_clients == 6
  pooled = fd.pooled()
  assert pooled.num_clients == 1
  assert int(pooled.train.n[0]) == int(fd.train.n.sum())
  assert pooled.train.x.shape[1] == int(fd.train.n.sum())
  assert pooled.packed_val is fd.packed_val
  assert pooled.packed_train.x is fd.packed_train.x  # no copy
  assert pooled.client_domains == (("dom0", "dom2", "dom3"),)
  x = np.concatenate([_real(fd.train, c)[0] for c in range(6)])
  np.testing.assert_array_equal(pooled.train.x[0], x)


def test_no_target_domain_dirichlet():
  ds = make_dataset(sizes=(150,), ch=1)
  spec = PartitionSpec("dirichlet", num_clients=4, alpha=0.5, min_partition_size=10)
  fd = federated.build(ds, spec, target_domain=None)
  assert fd.target_x.shape == (0, 6, 5, 1) and fd.target_y.shape == (0,)
  assert fd.target_domain is None and fd.source_domains == ("dom0",)
  assert int(fd.train.n.sum() + fd.val.n.sum()) == 150


def test_few_shot_injects_exactly_k_target_examples():
  ds = make_dataset()
  spec = PartitionSpec(num_clients=3, d=1, few_shot_k=4, seed=2)
  fd = federated.build(ds, spec, target_domain="dom3")
  target_all = set(np.flatnonzero(ds.domains == 3))
  shots = []
  for c in range(3):
    mine = [i for i in fd.train_indices[c] if i in target_all]
    assert len(mine) == 4
    assert not set(fd.val_indices[c]) & target_all
    shots += mine
    assert "dom3" in fd.client_domains[c]
  assert len(set(shots)) == 12
  assert len(fd.target_y) == 25 - 12
  assert not set(shots) & set(fd.target_indices)
  with pytest.raises(ValueError, match="few_shot_k=4 needs a target_domain"):
    federated.build(ds, spec, target_domain=None)


def test_build_errors_are_explicit():
  ds = make_dataset()
  with pytest.raises(ValueError, match="target_domain='dom9' .*'dom0', 'dom1'"):
    federated.build(ds, PartitionSpec("iid", num_clients=2), target_domain="dom9")
  with pytest.raises(ValueError, match="d=4 but there are only 3 source domains"):
    federated.build(ds, PartitionSpec(num_clients=2, d=4), target_domain=0)
  with pytest.raises(ValueError, match="val_fraction"):
    federated.build(ds, {"name": "iid", "num_clients": 2}, target_domain=0,
                    val_fraction=1.0)
  tiny = make_dataset(sizes=(3, 3))
  msg = "client 0 has 1 example.*name='iid', num_clients=3, seed=0"
  with pytest.raises(ValueError, match=msg):
    federated.build(tiny, PartitionSpec("iid", num_clients=3), target_domain=1)
  with pytest.raises(ValueError, match="num_clients=4 with 3 examples"):
    federated.build(tiny, PartitionSpec("iid", num_clients=4), target_domain=1)


def test_client_arrays_is_a_pytree():
  ds = make_dataset()
  fd = federated.build(ds, PartitionSpec("iid", num_clients=2), target_domain=0,
                       val_fraction=0.0)
  assert int(fd.val.n.sum()) == 0 and fd.val.x.shape[:2] == (2, 0)
  leaves = jax.tree.leaves(fd.train)
  assert len(leaves) == 3
  total = jax.jit(lambda a: a.n.sum())(fd.train)
  assert int(total) == 55 + 30 + 25
  assert "2 clients" in fd.summary()


def test_packed_storage_has_no_padding_and_gathers_the_padded_view():
  """Packed: the examples back to back (the partition's order); `gather`
  (any id shape, repeats allowed) equals the padded view's rows, which equal
  a per-client loop over the indices."""
  ds = make_dataset()
  fd = federated.build(ds, PartitionSpec(num_clients=5, d=2, seed=1),
                       target_domain="dom2", seed=4)
  packed = fd.packed_train
  order = np.concatenate(fd.train_indices)
  np.testing.assert_array_equal(packed.x, ds.images[order])
  np.testing.assert_array_equal(packed.y, ds.labels[order])
  np.testing.assert_array_equal(packed.n, [len(p) for p in fd.train_indices])
  assert packed.width == max(len(p) for p in fd.train_indices)
  assert packed.nbytes() == len(order) * (6 * 5 * 3 + 4)
  assert packed.nbytes(padded=True) == 5 * packed.width * (6 * 5 * 3 + 4)
  ids = np.array([[3, 0], [3, 4]])
  got = packed.gather(ids)
  assert got.x.shape == (2, 2, packed.width, 6, 5, 3)
  for (i, j), c in np.ndenumerate(ids):
    np.testing.assert_array_equal(got.x[i, j], fd.train.x[c])
    np.testing.assert_array_equal(got.y[i, j], fd.train.y[c])
    assert got.n[i, j] == len(fd.train_indices[c])
  # Packing a padded view keeps its width (and so the engine's numbers).
  wide = federated.pack_padded(fd.train.replace(n=fd.train.n // 2))
  assert wide.width == packed.width and wide.n.sum() == (fd.train.n // 2).sum()
  np.testing.assert_array_equal(wide.padded().x[1, :3], fd.train.x[1, :3])
  assert not wide.padded().x[1, fd.train.n[1] // 2:].any()
  with pytest.raises(ValueError, match="width=2 is below"):
    federated.PackedClients(packed.x, packed.y, packed.offsets, width=2)
