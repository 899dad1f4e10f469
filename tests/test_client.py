"""Local update: epoch semantics, masking of padded steps, agreement with a plain loop."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg.client import objectives
from fedjax_dg.client.update import (Batch, ClientContext, batch_at,
                                     epoch_permutations, local_update)


@pytest.mark.parametrize("n,n_max,bs,epochs", [(10, 10, 4, 2), (5, 23, 4, 3), (1, 7, 3, 1)])
def test_schedule_visits_every_valid_example_once_per_epoch(n, n_max, bs, epochs):
  total_steps = epochs * -(-n_max // bs)

  @jax.jit  # one program (op by op, every op of every step dispatched)
  def schedule(key, n):
    perms = epoch_permutations(key, n, n_max, epochs)
    return jax.vmap(lambda s: batch_at(s, perms, n, bs))(
        jnp.arange(total_steps))

  steps = [np.asarray(a) for a in schedule(jax.random.key(0), jnp.int32(n))]
  seen = [[] for _ in range(epochs)]
  active_steps = 0
  for s, (idx, valid, active) in enumerate(zip(*steps)):
    if bool(active):
      active_steps += 1
      e = s // -(-n // bs)
      seen[e].extend(np.asarray(idx)[np.asarray(valid)].tolist())
  assert active_steps == epochs * -(-n // bs)
  for e in range(epochs):
    assert sorted(seen[e]) == list(range(n))


class Linear:
  """A tiny 'model' (numerically independent of flax) for exact comparisons."""

  def apply(self, params, x, *, train=False, rng=None):
    x = x.reshape(x.shape[0], -1).astype(jnp.float32) / 255.0
    return x @ params["w"] + params["b"]


def test_local_update_matches_python_loop_and_ignores_padding():
  rng = np.random.default_rng(0)
  n, n_max, bs, epochs = 9, 16, 4, 2
  x = rng.integers(0, 255, (n_max, 2, 2, 1)).astype(np.uint8)
  y = rng.integers(0, 3, (n_max,)).astype(np.int32)
  x[n:] = 255  # garbage padding that must never be used
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            "b": jnp.zeros((3,), jnp.float32)}
  model = Linear()
  loss_fn = objectives.cross_entropy(model)
  opt = optax.sgd(0.5)
  key = jax.random.key(3)
  got, mean_loss = jax.jit(lambda p: local_update(
      loss_fn, opt, p, jnp.asarray(x), jnp.asarray(y), jnp.int32(n), key,
      batch_size=bs, epochs=epochs))(params)

  # Reference: an explicit Python loop over the same batches, no masking tricks.
  perm_key, _ = jax.random.split(key)
  perms = np.asarray(epoch_permutations(perm_key, jnp.int32(n), n_max, epochs))
  p = jax.tree.map(np.asarray, params)

  @jax.jit  # one program per batch size
  def value_and_grad(q, xb, yb):
    def ce(q):
      logits = model.apply(q, xb)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
          logits, yb))
    return jax.value_and_grad(ce)(q)

  losses = []
  for e in range(epochs):
    order = perms[e][:n]
    for j in range(0, n, bs):
      idx = order[j:j + bs]
      l, g = value_and_grad(p, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
      losses.append(float(l))
      p = jax.tree.map(lambda a, b: a - 0.5 * b, p, g)
  for k in p:
    np.testing.assert_allclose(got[k], p[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mean_loss, np.mean(losses), rtol=1e-5)


def test_fedprox_term_pulls_toward_start():
  base = lambda params, batch, rng, ctx: jnp.zeros(())
  loss = objectives.proximal(base, mu=2.0)
  start = {"w": jnp.ones((3,))}
  params = {"w": jnp.array([1.0, 2.0, 4.0])}
  batch = Batch(jnp.zeros((1, 1)), jnp.zeros((1,), jnp.int32), jnp.ones((1,)))
  ctx = ClientContext(id=0, round=0, start=start)
  np.testing.assert_allclose(loss(params, batch, None, ctx), 0.5 * 2.0 * (1 + 9))


def test_fixed_local_steps_mode_runs_exactly_that_many_steps():
  """steps > 0: every client takes `steps` steps whatever its size (pFedHN),
  in the masked scan and in a loop of the client's own count (`own_steps`,
  which `local_steps` sets)."""
  rng = np.random.default_rng(1)
  x = rng.integers(0, 255, (12, 2, 2, 1)).astype(np.uint8)
  y = rng.integers(0, 3, (12,)).astype(np.int32)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
  # A "loss" whose gradient is 1 for b[0]: SGD(lr=1) subtracts 1 per step taken.
  loss = lambda p, batch, rng, ctx: p["b"][0] + 0.0 * jnp.sum(batch.mask)
  for (n, steps), own in itertools.product(((12, 7), (3, 7), (5, 1)),
                                         (False, True)):
    got, _ = local_update(loss, optax.sgd(1.0), params, jnp.asarray(x),
                          jnp.asarray(y), jnp.int32(n), jax.random.key(0),
                          batch_size=4, epochs=2, steps=steps, own_steps=own)
    assert float(got["b"][0]) == -steps
