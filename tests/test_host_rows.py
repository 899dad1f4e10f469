"""train.host_gather="rows": with fixed local steps the "host" placement
gathers only the rows each cohort member's steps read, in read order
(`engine.round.step_rows`, `PackedClients.gather(rows=...)`), and gives
the numbers of the whole-client gather."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_domains, with_sizes
from fedjax_dg import algorithms, engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.algorithms import local_only
from fedjax_dg.client import objectives
from fedjax_dg.client.update import epoch_permutations, first_of_argsort
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.placement import resolve_gather
from fedjax_dg.engine.programs import programs
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

# Batch 8, 5 local steps = 40 rows a round: client 0 (54) takes part of one
# pass; 31 and 22 wrap into a second pass (a partial last batch each), 9 and
# 3 take 3 and 5 passes (3: one batch of 3 real rows and 5 masked per step).
SIZES = (54, 9, 31, 22, 3)
STEPS, B = 5, 8
CFG = engine.EngineConfig(rounds=2, eval_every=1, epochs=1, local_steps=STEPS,
                          batch_size=B, cohort_size=3, client_mapping="map",
                          placement="host", seed=5, progress=False,
                          eval_batch_size=16)


@pytest.fixture(scope="module")
def unequal():
  # No id-val or target split: evaluation (which the gather does not touch)
  # is empty, the runs are training.
  spec = partition.PartitionSpec(name="domain_split", d=1,
                                 num_clients=len(SIZES))
  fed = with_sizes(federated.build(
      synthetic_domains(num_domains=5, per_domain=60), spec,
      target_domain=None, val_fraction=0.0), SIZES)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=6)
  loss, opt = objectives.cross_entropy(model), make_optimizer("sgd", 0.1)
  algs = {"fedavg": fedavg(model, opt, loss),
          "local_only": local_only.build(model, opt, loss, num_clients=len(SIZES))}
  return fed, model, algs


def _gathers(monkeypatch):
  """Records the `rows` argument and the x shape of every gather of the
  training clients."""
  seen = []
  gather = federated.PackedClients.gather

  def spy(self, ids, rows=None):
    out = gather(self, ids, rows)
    seen.append((rows is not None, out.x.shape))
    return out

  monkeypatch.setattr(federated.PackedClients, "gather", spy)
  return seen


# ("fedavg", "map") slow: the rows' numbers equal the whole clients' with
# the sort shuffle in ("local_only", "vmap") and under one loop per client
# ("map") in test_feistel_gives_the_same_batches_on_every_path (FedAvg).
@pytest.mark.parametrize("name,mapping", [
    pytest.param("fedavg", "map", marks=pytest.mark.slow),
    ("local_only", "vmap")])
def test_rows_give_the_whole_client_numbers(unequal, name, mapping,
                                            monkeypatch):
  """FedAvg (one loop per client) and Local-only (per-client state,
  vmapped lanes): 2 rounds in chunks of 1, the whole-client gather against
  "auto" (which picks the rows: 40 < 60, the padded width), bit for bit:
  parameters, client state, round metrics. Each chunk holds [1, 3, 40]
  rows, not [1, 3, 60]."""
  fed, model, algs = unequal
  cfg = dataclasses.replace(CFG, client_mapping=mapping)
  seen = _gathers(monkeypatch)
  whole = engine.run(algs[name], fed, model,
                     dataclasses.replace(cfg, host_gather="clients"))
  width = fed.packed_train.width  # 60: the padded view's
  assert seen == [
      (False, (1, 3, width) + fed.image_shape)] * 2
  seen.clear()
  rows = engine.run(algs[name], fed, model, cfg)
  assert seen == [
      (True, (1, 3, STEPS * B) + fed.image_shape)] * 2
  for a, b in zip(jax.tree.leaves((whole.server, whole.clients)),
                  jax.tree.leaves((rows.server, rows.clients)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert whole.round_metrics == rows.round_metrics
  assert whole.history == rows.history and whole.final == rows.final


def _same(a, b) -> bool:
  return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(
      jax.tree.leaves((a.server, a.clients)),
      jax.tree.leaves((b.server, b.clients)), strict=True)) and (
          a.round_metrics == b.round_metrics)


def test_feistel_gives_the_same_batches_on_every_path(unequal):
  """train.shuffle="feistel": FedAvg's rows gathered on the host (its
  `feistel_rows` drawn by `step_rows`) and its whole clients on the host
  give the same numbers bit for bit; the rows read are not those of
  "sort" (the setting reaches the programs `run` uses), yet are each
  client's examples. The "device" placement and vmapped lanes: the slow
  test below."""
  fed, model, algs = unequal
  cfg = dataclasses.replace(CFG, shuffle="feistel")
  rows = engine.run(algs["fedavg"], fed, model, cfg)
  whole = engine.run(algs["fedavg"], fed, model,
                     dataclasses.replace(cfg, host_gather="clients"))
  assert _same(rows, whole)
  ids = np.asarray([[0, 1, 2, 3, 4]], np.int32)
  n = np.asarray(SIZES, np.int32)[ids]
  read = {s: np.asarray(programs(
      algs["fedavg"], model, dataclasses.replace(CFG, shuffle=s),
      len(SIZES)).step_rows(jax.random.key(0), np.asarray([3], np.int32),
                            ids, n, fed.packed_train.width))[0]
          for s in ("sort", "feistel")}
  assert not np.array_equal(read["sort"], read["feistel"])
  for c, size in enumerate(SIZES):  # 54: 40 distinct rows of one pass
    got = read["feistel"][c][:min(size, STEPS * B)]
    assert len(set(got.tolist())) == len(got) and got.max() < size


@pytest.mark.slow
def test_feistel_on_the_device_and_in_lanes(unequal):
  """train.shuffle="feistel" on the "device" placement (the permutation's
  rows drawn inside the round) equals the host's row gather, for FedAvg
  (a loop per client) and Local-only (vmapped lanes)."""
  fed, model, algs = unequal
  for name, mapping in (("fedavg", "map"), ("local_only", "vmap")):
    cfg = dataclasses.replace(CFG, shuffle="feistel", client_mapping=mapping)
    rows = engine.run(algs[name], fed, model, cfg)
    device = engine.run(algs[name], fed, model,
                        dataclasses.replace(cfg, placement="device"))
    assert _same(rows, device), name


def reference_rows(root_key, r, cid, n, n_max):
  """What client `cid` (n examples of n_max padded) reads in round r, step by
  step, as a plain loop: its epoch orders (the stable argsort of the same
  uniform draws, padding last), ceil(n / B) steps per pass, -1 for a masked
  position."""
  clients_key = jax.random.split(jax.random.fold_in(root_key, r), 3)[1]
  perm_key = jax.random.split(jax.random.fold_in(clients_key, cid))[0]
  u = np.array(jax.random.uniform(perm_key, (STEPS, n_max)))
  u[:, n:] = 2.0
  order = np.argsort(u, axis=-1, kind="stable")
  per_pass = -(-n // B)
  out = []
  for s in range(STEPS):
    epoch, first = divmod(s, per_pass)
    for j in range(first * B, first * B + B):
      out.append(int(order[epoch, j]) if j < n else -1)
  return out


def test_rows_gathered_are_the_rows_read(unequal):
  """`step_rows` of 2 rounds' cohorts, every client size once, are the rows
  a plain loop over the same draws reads; gathered, each position holds
  that client's example (images that spell their packed row) or zeros where
  the step masks it out."""
  fed, model, algs = unequal
  width = fed.packed_train.width
  root = jax.random.key(CFG.seed)
  progs = programs(algs["fedavg"], model, CFG, len(SIZES))
  ids = np.asarray([[0, 1, 2], [3, 4, 0]], np.int32)
  n = np.asarray(SIZES, np.int32)[ids]
  got = np.asarray(progs.step_rows(root, np.asarray([7, 8], np.int32), ids, n,
                                   width))
  assert got.shape == (2, 3, STEPS * B)
  total = int(sum(SIZES))
  label = np.arange(1, total + 1)  # a row's image: its packed row + 1
  packed = federated.PackedClients(
      x=np.stack([label // 256, label % 256], -1).astype(np.uint8),
      y=np.arange(total, dtype=np.int32), offsets=fed.packed_train.offsets)
  data = packed.gather(ids, got)
  assert data.x.shape == (2, 3, STEPS * B, 2)
  for i, r in enumerate((7, 8)):
    for j, c in enumerate(ids[i]):
      want = reference_rows(root, r, int(c), SIZES[c], width)
      read = got[i, j]
      real = np.asarray(want) >= 0
      np.testing.assert_array_equal(read[real], np.asarray(want)[real])
      assert np.all(read[~real] >= SIZES[c])  # masked: padding rows
      spelled = data.x[i, j, :, 0].astype(int) * 256 + data.x[i, j, :, 1] - 1
      start = fed.packed_train.offsets[c]
      np.testing.assert_array_equal(spelled[real],
                                    start + np.asarray(want)[real])
      assert np.all(data.x[i, j][~real] == 0) and np.all(data.y[i, j][~real]
                                                          == 0)


def test_first_of_argsort_is_the_stable_argsort_prefix():
  """The top-k orders equal the stable argsort's first k, ties (planted,
  and the draws' own at 20,000) and padding included; so do the fixed
  steps' permutations (`epoch_permutations(first=k)`) on both sides of
  `unit_argsort`'s plain-argsort threshold."""
  # One jitted program each (eagerly a program per op).
  @jax.jit
  def draws():
    u = jax.random.uniform(jax.random.key(1), (3, 300))
    u = jnp.where(jnp.arange(300) < jnp.asarray([[300], [120], [5]]), u, 2.0)
    u = u.at[:, 9].set(u[:, 2]).at[:, 40].set(u[:, 2]).at[0, 7].set(0.0)
    return u, [first_of_argsort(u, k) for k in (1, 40, 299)]

  u, firsts = draws()
  for k, got in zip((1, 40, 299), firsts):
    np.testing.assert_array_equal(
        got, np.argsort(np.asarray(u), -1, kind="stable")[:, :k])
  # The top-k permutations and the whole ones, of one width: one program.
  perms = jax.jit(lambda key, n, n_max: (
      epoch_permutations(key, n, n_max, 4, 128),
      epoch_permutations(key, n, n_max, 4, 0)), static_argnums=2)
  for n_max, n in ((300, 77), (20000, 19999)):
    first, whole = perms(jax.random.key(n_max), n, n_max)
    np.testing.assert_array_equal(first, np.asarray(whole)[:, :128])


def test_resolve_gather(unequal):
  """"auto" takes the rows on the host where the steps read fewer rows than
  the padded width and nothing else reads the client; "rows" where
  something does is a ConfigError naming the setting and the reason."""
  fed, model, algs = unequal
  alg = algs["fedavg"]
  resolve = lambda cfg, a=alg, pl="host", w=54: resolve_gather(
      cfg, a, pl, w).host_gather
  assert resolve(CFG) == "rows"
  assert resolve(CFG, w=40) == "clients"       # 5 x 8 rows: not fewer
  assert resolve(dataclasses.replace(CFG, host_gather="rows"), w=40) == "rows"
  assert resolve(CFG, pl="device") == "clients"
  assert resolve(dataclasses.replace(CFG, host_gather="clients")) == "clients"
  epochs = dataclasses.replace(CFG, local_steps=0)
  assert resolve(epochs) == "clients"
  scaffold = lambda variant: algorithms.create(
      "scaffold", model, optimizer=make_optimizer("sgd", 0.1),
      num_clients=len(SIZES), hparams=dict(variant=variant))
  # Option I's end of round reads the client's examples; option II's only
  # its step count (`ClientEnd.reads_data`).
  assert resolve(CFG, scaffold("I")) == "clients"
  assert resolve(CFG, scaffold("II")) == "rows"
  for cfg, a, why in ((epochs, alg, "local_steps=0"),
                      (CFG, scaffold("I"), "end of round reads")):
    with pytest.raises(ConfigError, match=f"host_gather='rows'.*{why}"):
      resolve(dataclasses.replace(cfg, host_gather="rows"), a)
  with pytest.raises(ConfigError, match="train.host_gather='row'"):
    dataclasses.replace(CFG, host_gather="row").validate(len(SIZES))
