"""The domain labels the DG objectives read: each example's domain reaches
its batch (`Batch.d`) on both placements, only for an algorithm that asks
for it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_federation
from fedjax_dg import algorithms, engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.update import Batch
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

N, B = 3, 8
CFG = engine.EngineConfig(checkpoint_every=0.0, rounds=2, eval_every=1,
                          epochs=1, batch_size=B, client_mapping="map",
                          progress=False, eval_batch_size=16)


@pytest.fixture(scope="module")
def fed():
  # Each client holds two of the three source domains.
  return synthetic_federation(num_clients=N, d=2, num_domains=4,
                              per_domain=20)


def domain_statistic(params, batch: Batch, rng, ctx=None):
  """sum_b mask_b * (d_b + 1) * mean(x_b): the batch's domains tied to its
  images (a d that is not its example's changes the sum); params enter
  with weight 0 (a gradient of zeros, the model stays)."""
  del rng, ctx
  pixels = jnp.mean(batch.x.astype(jnp.float32), axis=(1, 2, 3))
  stat = jnp.sum(batch.mask * (batch.d + 1).astype(jnp.float32) * pixels)
  return stat + 0.0 * sum(jnp.sum(p) for p in jax.tree.leaves(params))


def expected_client_losses(fed) -> np.ndarray:
  """[N] each client's mean loss over one epoch of `domain_statistic`: the
  sum over its examples (each read once) over its ceil(n / B) steps."""
  t = fed.packed_train
  out = []
  for c in range(fed.num_clients):
    rows = slice(t.offsets[c], t.offsets[c + 1])
    pixels = t.x[rows].astype(np.float64).mean(axis=(1, 2, 3))
    total = np.sum((fed.train_domains[rows] + 1) * pixels)
    out.append(total / -(-int(t.n[c]) // B))
  return np.asarray(out)


def reading_domains(model):
  alg = fedavg(model, make_optimizer("sgd", 0.1), domain_statistic,
               metrics=lambda opt, result: {"client_loss": result.loss})
  return alg.replace(domains=True)


def mlp(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, hidden=4)


def test_the_federation_knows_each_training_examples_domain(fed):
  names = fed.domain_names
  t = fed.packed_train
  for c in range(fed.num_clients):
    held = {names[k] for k in fed.train_domains[t.offsets[c]:t.offsets[c + 1]]}
    assert held == set(fed.client_domains[c])
  assert len(fed.client_domains[0]) == 2  # the statistic sees two domains
  assert fed.train.d is None and fed.packed_train.d is None
  padded = fed.with_domains().train
  keep = np.arange(padded.x.shape[1])[None, :] < padded.n[:, None]
  np.testing.assert_array_equal(padded.d[keep], fed.train_domains)
  np.testing.assert_array_equal(padded.d[~keep], 0)
  pooled = fed.with_domains().pooled().train
  np.testing.assert_array_equal(pooled.d[0, :pooled.n[0]], fed.train_domains)


@pytest.mark.parametrize("placement,mapping", [("device", "map"),
                                               ("device", "vmap"),
                                               ("host", "map")])
def test_a_clients_batches_see_the_domains_of_their_examples(fed, placement,
                                                             mapping):
  model = mlp(fed)
  cfg = dataclasses.replace(CFG, placement=placement, client_mapping=mapping)
  result = engine.run(reading_domains(model), fed, model, cfg)
  got = np.asarray(result.round_metrics["client_loss"])
  want = expected_client_losses(fed)
  for r in range(cfg.rounds):
    np.testing.assert_allclose(got[r], want, rtol=1e-5)


def test_the_host_gathers_the_domains_of_the_rows_its_steps_read(fed):
  """Fixed local steps on the host gather only the rows the steps read
  (host_gather='rows'): the same statistic as the device's whole clients."""
  model = mlp(fed)
  cfg = dataclasses.replace(CFG, local_steps=2)
  alg = reading_domains(model)
  device = engine.run(alg, fed, model, dataclasses.replace(
      cfg, placement="device"))
  host = engine.run(alg, fed, model, dataclasses.replace(
      cfg, placement="host", host_gather="rows"))
  np.testing.assert_array_equal(np.asarray(host.round_metrics["client_loss"]),
                                np.asarray(device.round_metrics["client_loss"]))


def test_only_an_algorithm_that_asks_gets_the_domains(fed):
  client = dict(optimizer="sgd", lr=0.1, weight_decay=0.0, momentum=0.0,
                schedule="constant")
  model = mlp(fed)
  for name in ("fedavg", "fedprox", "fedsr"):
    alg = algorithms.build(name, model, hyperparameters={}, client=client,
                           num_clients=N)
    assert not alg.client.domains, name
  hand_built = dataclasses.replace(fed, train_domains=None)
  with pytest.raises(ConfigError, match="train_domains"):
    hand_built.with_domains()

