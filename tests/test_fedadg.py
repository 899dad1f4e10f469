"""FedADG: the local epoch in `ClientContext` (filled by `local_update`)."""

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.client.update import ClientContext, local_update


def test_local_update_gives_the_loss_the_epoch_of_each_step():
  """Loss <w, 1> (epoch + 1) with SGD lr 1: every step moves w by -(epoch + 1).
  n = 5 real rows of 8, batch 2: 3 steps per epoch (the padded steps are
  masked)."""
  loss = lambda p, batch, rng, ctx: (jnp.sum(p["w"]) * (ctx.epoch + 1)
                                     + 0.0 * jnp.sum(batch.mask))
  x, y = jnp.zeros((8, 2, 2, 1), jnp.uint8), jnp.zeros((8,), jnp.int32)
  ctx = ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=None)
  run = lambda **kw: local_update(loss, optax.sgd(1.0), {"w": jnp.zeros(())},
                                  x, y, jnp.int32(5), jax.random.key(0), ctx,
                                  batch_size=2, **kw)[0]["w"]
  assert float(run(epochs=3)) == -3 * (1 + 2 + 3)
  # Fixed steps: 7 steps = passes 0, 0, 0, 1, 1, 1, 2.
  assert float(run(epochs=1, steps=7)) == -(3 * 1 + 3 * 2 + 1 * 3)
  # A loss without a ClientContext still runs (ctx=None is passed through).
  plain = lambda p, batch, rng, ctx: jnp.sum(p["w"]) + 0.0 * jnp.sum(batch.mask)
  w, _ = local_update(plain, optax.sgd(1.0), {"w": jnp.zeros(())}, x, y,
                      jnp.int32(5), jax.random.key(0), None, batch_size=2,
                      epochs=2)
  assert float(w["w"]) == -6
