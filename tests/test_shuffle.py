"""train.shuffle="feistel": each pass's order is a keyed Feistel permutation
of the client's examples, evaluated only at the positions the steps read
(`client.update.feistel_permutation`, `feistel_rows`)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_dg import engine
from fedjax_dg.run import assemble, config, directory
from fedjax_dg.client.update import (FEISTEL_ROUNDS, feistel_permutation,
                                     local_training)
from fedjax_dg.errors import ConfigError

# One compile for every (keys, n, positions) of one shape: n is traced.
_orders = jax.jit(jax.vmap(feistel_permutation, (0, None, None)))


def _keys(seed: int, count: int) -> jax.Array:
  return jax.random.bits(jax.random.key(seed), (count, FEISTEL_ROUNDS),
                         jnp.uint32)


def test_each_order_is_a_permutation_of_the_valid_positions():
  """For n = 0, 1, 2, powers of two and their neighbours up to 1,030 (one
  compile: n is traced) and 4 keys each: positions 0..n-1 map onto 0..n-1
  exactly once, positions n.. (padding, and past any width) to themselves,
  and the order of the first k positions is the whole order's prefix (the
  bits come from n, not from how many positions are asked)."""
  pos = jnp.arange(1040, dtype=jnp.int32)
  sizes = {0, 1, 2, 3, 5, 6, 1000, 1030} | {
      2**k + d for k in range(1, 11) for d in (-1, 0, 1)}
  for n in sorted(sizes):
    keys = _keys(n, 4)
    got = np.asarray(_orders(keys, n, pos))
    prefix = np.asarray(_orders(keys, n, pos[:16]))
    for order in got:
      np.testing.assert_array_equal(np.sort(order[:n]), np.arange(n))
      np.testing.assert_array_equal(order[n:], np.arange(n, len(pos)))
    np.testing.assert_array_equal(prefix, got[:, :16])
    if n > 6:  # the keys matter: 4 different orders (of n! >= 5,040)
      assert len({tuple(o[:n]) for o in got}) == 4, n


def test_a_large_domain_is_a_permutation():
  """n = 2^18 + 1: the widest walk (a 2^20 domain, 4n, for n just over
  2^18)."""
  n = 2**18 + 1
  got = np.asarray(feistel_permutation(_keys(7, 1)[0], jnp.int32(n),
                                       jnp.arange(n, dtype=jnp.int32)))
  np.testing.assert_array_equal(np.bincount(got, minlength=n), 1)


@pytest.mark.parametrize("n", [5, 6, 12])
def test_every_position_takes_every_value_equally_often(n):
  """Over 2,000 keys, the counts of each (position, value) pair against
  2,000 / n: the chi-square statistic (df (n - 1)^2) stays below df + 6
  sqrt(2 df) (p ~ 1e-5). A round function that ignores its key (planted
  by hand: the same order for every key) gives ~2,000 (n - 1), and one
  round instead of 6 fails as well."""
  keys = 2000
  got = np.asarray(_orders(_keys(100 + n, keys), n,
                           jnp.arange(n, dtype=jnp.int32)))
  counts = np.stack([np.bincount(got[:, p], minlength=n) for p in range(n)])
  expected = keys / n
  chi2 = ((counts - expected) ** 2 / expected).sum()
  df = (n - 1) ** 2
  assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, counts)


@pytest.mark.parametrize("epochs,steps", [(2, 0), (1, 4), (1, 9)])
def test_local_training_reads_each_example_once_per_pass(epochs, steps):
  """`LocalTraining.rows` under "feistel", clients of 0, 1, 7, 8, 13 and 32
  examples (padded to 32, batch 4): pass e's ceil(n / B) batches read each
  of the n examples once, in the order `feistel_permutation` gives with
  the round keys bits(fold_in(perm key, e)) (an independent loop); a masked
  position reads its own row, clipped to the width. Fixed steps: 4 steps
  (part of one pass for the largest), 9 steps (several passes for the
  smaller clients)."""
  n_max, bs = 32, 4
  lt = local_training(lambda *a: 0.0, None, n_max=n_max, batch_size=bs,
                      epochs=epochs, steps=steps, shuffle="feistel")
  rows = jax.jit(lt.rows)
  for n in (0, 1, 7, 8, 13, 32):
    key = jax.random.key(n)
    got = np.asarray(rows(jnp.int32(n), key)).reshape(lt.padded_steps, bs)
    perm_key = jax.random.split(key)[0]
    passes = steps or epochs
    per_pass = max(-(-n // bs), 1)
    orders = np.asarray(_orders(jax.vmap(lambda e: jax.random.bits(
        jax.random.fold_in(perm_key, e), (FEISTEL_ROUNDS,), jnp.uint32))(
            jnp.arange(passes)), n, jnp.arange(n_max)))
    for s in range(lt.padded_steps):
      e, b = divmod(s, per_pass)
      order = orders[min(e, passes - 1)]
      pos = b * bs + np.arange(bs)
      want = [order[p] if p < n else min(p, n_max - 1) for p in pos]
      np.testing.assert_array_equal(got[s], want, err_msg=f"n {n} step {s}")
    taken = min(lt.padded_steps, passes * per_pass) if n else 0
    for e in range(taken // per_pass):  # the whole passes: every example once
      batch = got[e * per_pass:(e + 1) * per_pass].reshape(-1)[:n]
      np.testing.assert_array_equal(np.sort(batch), np.arange(n))


def test_a_bad_value_is_a_config_error_naming_the_field():
  with pytest.raises(ConfigError, match=r"train.shuffle='random': allowed "
                     r"values are one of \('sort', 'feistel'\)"):
    engine.EngineConfig(shuffle="random").validate(3)
  engine.EngineConfig(shuffle="feistel").validate(3)
  with pytest.raises(ValueError, match="shuffle='x'"):
    local_training(lambda *a: 0.0, None, n_max=4, batch_size=2, epochs=1,
                   shuffle="x")


def test_the_setting_is_in_the_config_and_a_resume_with_another_is_refused(
    tmp_path):
  """train.shuffle comes from EngineConfig (default "sort"), reaches the
  engine's config, shapes the programs' key, and a run directory written
  with "sort" is not continued with "feistel"."""
  base = config.base_config()
  assert base.train.shuffle == "sort"
  feistel = config.apply_overrides(config.base_config(),
                                   ["train.shuffle=feistel"])
  assert assemble.engine_config(feistel).shuffle == "feistel"
  (tmp_path / "config.json").write_text(base.to_json())
  directory.check_resume(base, str(tmp_path), {})
  with pytest.raises(ConfigError, match="train.shuffle: 'sort' -> 'feistel'"):
    directory.check_resume(feistel, str(tmp_path), {})
  assert json.loads(feistel.to_json())["train"]["shuffle"] == "feistel"
