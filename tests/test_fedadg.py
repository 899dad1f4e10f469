"""FedADG: the local epoch in `ClientContext` (filled by `local_update`) and
the networks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg import models
from fedjax_dg.client.update import ClientContext, local_update
from fedjax_dg.models.fedadg import FedADGNets

SIZES = dict(gen_hidden=12, rp_size=10, disc_hidden=9)


@pytest.fixture(scope="module")
def setup(fed3):
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=16)
  return fed3, model


# --------------------------------------------------------------------------
# ClientContext.epoch, filled by local_update.


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


# --------------------------------------------------------------------------
# The networks.


def test_networks_shapes_initialization_and_outputs(setup):
  fed, model = setup
  nets = FedADGNets(model, **SIZES)
  f, c = 16, fed.num_classes
  assert nets.feature_width == f and nets.noise_dim == f  # 0 -> F
  params = nets.init(jax.random.key(0))
  shapes = jax.tree.map(lambda a: a.shape, {k: params[k] for k in ("gen",
                                                                   "disc")})
  assert shapes == {
      "gen": {"fc1": {"kernel": (f + c, 12), "bias": (12,)},
              "fc2": {"kernel": (12, f), "bias": (f,)}},
      "disc": {"proj": {"kernel": (f + c, 10)},
               "fc1": {"kernel": (10, 9), "bias": (9,)},
               "fc2": {"kernel": (9, 1), "bias": (1,)}}}
  np.testing.assert_allclose(np.linalg.norm(params["disc"]["proj"]["kernel"]),
                             1.0, rtol=1e-5)
  # xavier_uniform(gain 0.5) on the generator's kernels.
  k = np.asarray(params["gen"]["fc1"]["kernel"])
  bound = 0.5 * np.sqrt(6.0 / sum(k.shape))
  assert np.abs(k).max() <= bound and np.abs(k).max() > 0.8 * bound

  y = jnp.arange(6) % c
  other = (y + 1) % c  # both networks must read the label
  linear_nets = FedADGNets(model, gen_relu=False, **SIZES)

  @jax.jit
  def outputs(p):
    u = nets.noise(jax.random.key(1), 6)
    r = nets.generate(p["gen"], u, y)
    return dict(u=u, r=r, linear=linear_nets.generate(p["gen"], u, y),
                r_other=nets.generate(p["gen"], u, other),
                d=nets.discriminate(p["disc"], r, y),
                d_other=nets.discriminate(p["disc"], r, other))

  o = jax.tree.map(np.asarray, outputs(params))
  assert o["u"].shape == (6, f) and o["u"].min() >= 0 and o["u"].max() < 1
  assert o["r"].shape == (6, f) and o["r"].min() >= 0
  np.testing.assert_allclose(o["r"], np.maximum(o["linear"], 0.0), rtol=1e-6)
  assert o["linear"].min() < 0
  assert o["d"].shape == (6,) and np.all((o["d"] > 0) & (o["d"] < 1))
  assert not np.allclose(o["r_other"], o["r"])
  assert not np.allclose(o["d_other"], o["d"])
  small = FedADGNets(model, noise_dim=5, **SIZES)
  assert jax.eval_shape(small.init, jax.random.key(0))["gen"]["fc1"][
      "kernel"].shape == (5 + c, 12)
