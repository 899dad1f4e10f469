"""data.streaming: a dataset read from its prepared TFDS array_record files
by rows (`RecordImages`) instead of loaded whole. On a small folder dataset
prepared in tmp_path: the same examples, order and training numbers as the
in-memory load; a run reads each chunk's cohorts' rows and nothing more; what
cannot stream is refused with the setting and what to do."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
from PIL import Image
import pytest

from fedjax_dg import engine, models
from fedjax_dg.run import checks, config, experiment
from fedjax_dg.algorithms import central
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.data import (federated, images, partition, registry, sources,
                             streamed)
from fedjax_dg.engine.programs import programs
from fedjax_dg.engine.round import host_schedule
from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.optim import make_optimizer

DOMAINS = ("a", "b", "c")
CLASSES = ("x", "y", "z")
PER = 6      # images per (domain, class): 54 in all
SIZE = 8     # decoded size (the stored images have different sizes)
N = DOMAINS.__len__() * len(CLASSES) * PER


def _write_folder(root):
  """Random RGB PNGs (lossless, every image distinct) of mixed sizes."""
  rng = np.random.default_rng(0)
  for d_i, d in enumerate(DOMAINS):
    for c_i, c in enumerate(CLASSES):
      folder = os.path.join(root, d, c)
      os.makedirs(folder)
      for i in range(PER):
        h, w = 9 + (i + d_i) % 3, 10 + c_i
        rgb = rng.integers(0, 255, (h, w, 3), np.uint8)
        rgb[..., 0] = np.clip(rgb[..., 0] // 2 + 60 * c_i, 0, 255)  # learnable
        Image.fromarray(rgb).save(os.path.join(folder, f"{i}.png"))
  return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("streaming")
  root = _write_folder(str(tmp / "folder"))
  out = str(tmp / "data")
  assert f"{N} images" in sources.prepare("folder", data_dir=out,
                                          manual_dir=root,
                                          dataset_name="streamy")
  return out


def _load(data_dir, streaming, **kw):
  return sources.load("streamy", data_dir=data_dir, image_size=SIZE,
                      streaming=streaming, **kw)


def _all(x):
  """Every row of an array or of RecordImages (read)."""
  return x[np.arange(len(x))]


# ---------------------------------------------------------------------------
# The same examples.


@pytest.mark.parametrize("subset", [{}, dict(max_per_domain=10, seed=3)])
def test_streamed_load_gives_the_in_memory_examples_in_order(data_dir, subset,
                                                             monkeypatch):
  off = _load(data_dir, "off", **subset)
  on = _load(data_dir, "on", **subset)
  assert on.streamed and not off.streamed
  assert isinstance(on.images, images.RecordImages)
  assert on.images.shape == off.images.shape == (len(off.labels), SIZE, SIZE, 3)
  assert len(np.unique(off.images.reshape(len(off.labels), -1), axis=0)) == len(
      off.labels)  # distinct images: a wrong order cannot go unseen
  np.testing.assert_array_equal(_all(on.images), off.images)
  np.testing.assert_array_equal(on.labels, off.labels)
  np.testing.assert_array_equal(on.domains, off.domains)
  # Rows by int, slice and [a, b] array, repeated rows included.
  np.testing.assert_array_equal(on.images[5], off.images[5])
  np.testing.assert_array_equal(on.images[3:9:2], off.images[3:9:2])
  rows = np.array([[7, 2], [7, 0]])
  np.testing.assert_array_equal(on.images[rows], off.images[rows])
  assert on.channel_stats() == images.channel_stats(off.images)
  assert on.fingerprint() == off.fingerprint()  # a resume accepts either
  # Opened again: labels and domains from the records cache, no record read.
  monkeypatch.setattr(streamed, "plan", None)
  again = _load(data_dir, "on", **subset)
  np.testing.assert_array_equal(again.labels, off.labels)


def test_a_streamed_catalog_dataset_gives_its_in_memory_examples(
    tmp_path, monkeypatch):
  """TFDS catalog datasets (fake data sources, as in test_data_sources):
  several splits per domain, a seeded subset, the same examples."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from test_data_sources import FakeSource

  def fake_data_source(name, data_dir=None, decoders=None):
    rng = np.random.default_rng(registry.DOMAINNET_DOMAINS.index(
        name.split("/")[1]))
    split = lambda n: [{"image": rng.integers(0, 255, (6, 6, 3), np.uint8),
                        "label": int(rng.integers(3))} for _ in range(n)]
    names = [f"class{i}" for i in range(3)]
    return {"train": FakeSource(split(4), names),
            "test": FakeSource(split(3), names)}

  monkeypatch.setattr(tfds, "data_source", fake_data_source)
  for subset in ({}, dict(max_per_domain=5, seed=1)):
    kw = dict(data_dir=str(tmp_path), image_size=4, **subset)
    off = sources.load("domainnet", streaming="off", **kw)
    on = sources.load("domainnet", streaming="on", **kw)
    assert on.streamed and len(on.labels) == 6 * (5 if subset else 7)
    np.testing.assert_array_equal(_all(on.images), off.images)
    np.testing.assert_array_equal(on.labels, off.labels)
    np.testing.assert_array_equal(on.domains, off.domains)


def test_auto_streams_beyond_a_quarter_of_host_memory(data_dir, monkeypatch):
  """image_size 7 has no npz cache: "auto" compares the decoded bytes
  N x 7 x 7 x 3 with AUTO_STREAM_SHARE of host_memory()."""
  need = N * 7 * 7 * 3
  assert streamed.AUTO_STREAM_SHARE == 0.25
  for memory, want in ((4 * need, False), (4 * need - 4, True)):
    monkeypatch.setattr(streamed, "host_memory", lambda m=memory: m)
    ds = sources.load("streamy", data_dir=data_dir, image_size=7,
                      streaming="auto")
    assert ds.streamed == want, memory
  with pytest.raises(ConfigError, match=r"data.streaming='yes'.*'auto', 'on', "
                     r"'off'"):
    _load(data_dir, "yes")


CFG_OVERRIDES = [
    "data.name=streamy", f"data.image_size={SIZE}", "data.targets=c",
    "data.num_clients=4", "data.val_fraction=0.25", "model.name=mlp",
    "algorithms=fedavg", "train.rounds=4",
    "train.eval_every=2", "train.epochs=1", "train.batch_size=4",
    "train.cohort_size=2", "train.progress=False", "train.eval_batch_size=8"]


def test_a_streamed_run_equals_the_in_memory_run(data_dir, tmp_path,
                                                 monkeypatch):
  """The whole experiment path (load, normalization, federation, engine):
  streamed (host placement, the target split scored in blocks of 8
  examples) gives the in-memory run's numbers (auto placement: "device")."""
  monkeypatch.setattr("fedjax_dg.engine.evaluation.OOD_BLOCK_BYTES",
                      8 * SIZE * SIZE * 3)
  runs = {}
  for streaming in ("off", "on"):
    cfg = config.apply_overrides(config.base_config(), CFG_OVERRIDES + [
        f"data.data_dir={data_dir}", f"data.streaming={streaming}",
        f"output_dir={tmp_path / streaming}"])
    runs[streaming] = experiment.run(cfg, echo=lambda *a: None)["runs"][0]
  off, on = runs["off"], runs["on"]
  assert [h["round"] for h in on["history"]] == [2, 4]
  for a, b in zip(off["history"], on["history"], strict=True):
    assert a.keys() == b.keys()
    for k in a:  # accuracies exactly; losses summed over blocks: rounding
      np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
      if "acc" in k:
        assert a[k] == b[k], k
  np.testing.assert_allclose(off["final"]["ood_acc"], on["final"]["ood_acc"])
  assert off["final"]["ood_acc"] == on["final"]["ood_acc"]


def test_personalized_models_score_the_streamed_target_in_blocks(
    data_dir, monkeypatch):
  """Local-only (a model per client: the target split scored per client
  block, `eval_blocks`) in blocks of 8 target examples: the in-memory run's
  per-client accuracies."""
  from fedjax_dg.algorithms import local_only
  monkeypatch.setattr("fedjax_dg.engine.evaluation.OOD_BLOCK_BYTES",
                      8 * SIZE * SIZE * 3)
  spec = partition.PartitionSpec(name="domain_split", num_clients=4, d=1)
  feds = [federated.build(_load(data_dir, s), spec, target_domain="c",
                          val_fraction=0.25) for s in ("off", "on")]
  model = models.get_model("mlp", input_shape=feds[0].image_shape,
                           num_classes=3, hidden=4)
  alg = local_only.build(model, make_optimizer("sgd", 0.1),
                         objectives.cross_entropy(model), num_clients=4)
  cfg = engine.EngineConfig(rounds=1, epochs=1, batch_size=4, cohort_size=2,
                            client_mapping="map", progress=False,
                            placement="host", eval_batch_size=4)
  off, on = (engine.run(alg, f, model, cfg) for f in feds)
  assert len(feds[1].target_y) > 2 * 8  # three blocks
  assert on.final["ood_acc"] == off.final["ood_acc"]
  for key in ("ood_acc_per_client", "id_acc_per_client"):
    assert on.final[key] == off.final[key], key
  assert len(set(off.final["ood_acc_per_client"])) > 1  # 4 models


# ---------------------------------------------------------------------------
# Only the cohorts' rows are read.


class CountingSource:
  """A random-access source that records which records each call reads."""

  def __init__(self, source):
    self.source, self.calls = source, []

  def __len__(self):
    return len(self.source)

  def __getitems__(self, indices):
    self.calls.append(frozenset(int(i) for i in indices))
    return self.source.__getitems__(indices)


@pytest.mark.parametrize("steps", [0, 1])
def test_a_run_reads_each_chunks_cohorts_rows_only(data_dir, monkeypatch,
                                                   steps):
  """6 clients, a cohort of 2 per round, chunks of 2 rounds: the training
  reads are exactly the records of each chunk's cohorts (from the engine's
  schedule), one read per chunk; id-val and target reads come in blocks;
  no read holds the whole dataset. With one fixed local step of 2 examples
  (the row gather, `train.host_gather`) only the records those steps read
  (`engine.round.step_rows`), fewer than the cohorts hold."""
  ds = _load(data_dir, "on")
  counting = CountingSource(ds.images.source)
  ds = dataclasses.replace(ds, images=images.RecordImages(
      counting, ds.images.records, channels=3, image_size=SIZE,
      image_shape=ds.images.shape[1:], name="streamy"))
  spec = partition.PartitionSpec(name="domain_split", num_clients=6, d=1)
  fed = federated.build(ds, spec, target_domain="c", val_fraction=0.25)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=8)
  monkeypatch.setattr("fedjax_dg.engine.evaluation.OOD_BLOCK_BYTES",
                      8 * SIZE * SIZE * 3)
  cfg = engine.EngineConfig(rounds=6, eval_every=2, epochs=1, batch_size=4,
                            cohort_size=2, client_mapping="map",
                            progress=False, eval_batch_size=4,
                            ood_eval_max=0)
  if steps:
    cfg = dataclasses.replace(cfg, local_steps=steps, batch_size=2)
  alg = fedavg(model, make_optimizer("sgd", 0.1),
               objectives.cross_entropy(model))
  counting.calls.clear()  # the statistics above read every record in blocks
  engine.run(alg, fed, model, cfg)

  def records(packed, clients):
    return frozenset(int(r) for c in clients for r in packed.x.records[
        packed.offsets[c]:packed.offsets[c + 1]])

  train_all = records(fed.packed_train, range(6))
  val_all = records(fed.packed_val, range(6))
  target_all = frozenset(fed.target_x.records.tolist())
  schedule = host_schedule(jax.random.key(cfg.seed), 0, cfg.rounds, 6, 2)
  want = [records(fed.packed_train, np.unique(schedule[r:r + 2]))
          for r in range(0, cfg.rounds, 2)]
  if steps:
    packed = fed.packed_train
    rows = programs(alg, model, dataclasses.replace(
        cfg, host_gather="rows"), 6).step_rows
    read = lambda r, ids: np.asarray(rows(
        jax.random.key(cfg.seed), np.arange(r, r + 2, dtype=np.int32), ids,
        packed.n[ids], packed.width)).reshape(-1, 2)
    cohorts = want
    want = [frozenset(int(packed.x.records[packed.offsets[c] + q])
                      for c, qs in zip(ids.ravel(), read(r, ids))
                      for q in qs if q < packed.n[c])
            for r, ids in ((r, schedule[r:r + 2]) for r in range(0, 6, 2))]
    assert all(w < c for w, c in zip(want, cohorts))
  train_reads = [c for c in counting.calls if c <= train_all]
  assert train_reads == want
  assert all(len(w) < len(train_all) for w in want)  # a cohort, not everyone
  others = [c for c in counting.calls if not c <= train_all]
  assert all(c <= val_all or c <= target_all for c in others)
  assert max(len(c) for c in others if c <= target_all) == 8  # OOD blocks
  assert max(map(len, counting.calls)) < len(ds.labels)


# A process whose address space is capped below the dataset: 1,200 Fashion-
# MNIST-like images decoded at 512 x 512 (300 MiB). After a warm-up run
# (prepare, compile), the cap is set to what the process maps plus half the
# decoded dataset: the streamed load + a 2-round run finish, the in-memory
# load of the same data runs out of memory.
CAPPED = """
import resource, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_data_sources import write_fake_fashion_mnist
from fedjax_dg import engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.data import federated, partition, sources
from fedjax_dg.engine import evaluation
from fedjax_dg.optim import make_optimizer

tmp = {tmp!r}
write_fake_fashion_mnist(tmp + "/idx", n_train=1000, n_test=200)
kw = dict(data_dir=tmp + "/data", manual_dir=tmp + "/idx", image_size=512)
evaluation.OOD_BLOCK_BYTES = 1 << 24

def streamed_run():
  ds = sources.load("rotated_fashion_mnist", streaming="on", **kw)
  fed = federated.build(ds, partition.PartitionSpec(name="iid",
                                                    num_clients=10),
                        target_domain=0)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=10, mean=fed.mean, std=fed.std,
                           hidden=4)
  cfg = engine.EngineConfig(rounds=2, eval_every=1, epochs=1, batch_size=8,
                            cohort_size=1, client_mapping="map",
                            progress=False, eval_batch_size=8,
                            ood_eval_max=16)
  engine.run(fedavg(model, make_optimizer("sgd", 0.01),
                    objectives.cross_entropy(model)), fed, model, cfg)
  return ds.images.nbytes

decoded = streamed_run()
assert decoded == 1200 * 512 * 512, decoded
mapped = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
              if l.startswith("VmSize"))
cap = mapped + decoded // 2
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
streamed_run()
print("STREAMED OK", flush=True)
try:
  sources.load("rotated_fashion_mnist", streaming="off", **kw)
  print("IN-MEMORY OK")
except MemoryError:
  print("IN-MEMORY MemoryError")
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="RLIMIT_AS and /proc/self/status")
def test_streaming_runs_under_a_memory_cap_the_in_memory_load_exceeds(
    tmp_path):
  tests = os.path.dirname(os.path.abspath(__file__))
  script = CAPPED.format(root=os.path.dirname(tests), tests=tests,
                         tmp=str(tmp_path))
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "STREAMED OK" in out.stdout
  assert "IN-MEMORY MemoryError" in out.stdout, out.stdout


# ---------------------------------------------------------------------------
# What cannot stream.


def test_a_streamed_array_is_never_read_whole(data_dir):
  ds = _load(data_dir, "on")
  with pytest.raises(DataError, match=r"streamed.*data.streaming='off'"):
    np.asarray(ds.images)
  with pytest.raises(TypeError, match="indexed by rows"):
    ds.images[np.ones(3, bool)]
  spec = partition.PartitionSpec(name="domain_split", num_clients=2, d=1)
  fed = federated.build(ds, spec, target_domain="c")
  assert fed.streamed
  with pytest.raises(ConfigError, match=r"padded view.*train.placement='host'"):
    fed.train  # pylint: disable=pointless-statement


def test_the_engine_refuses_device_placement_and_pooled_training(data_dir):
  ds = _load(data_dir, "on")
  spec = partition.PartitionSpec(name="domain_split", num_clients=2, d=1)
  fed = federated.build(ds, spec, target_domain="c")
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, hidden=4)
  opt, loss = make_optimizer("sgd", 0.1), objectives.cross_entropy(model)
  cfg = engine.EngineConfig(rounds=1, batch_size=4, progress=False)
  with pytest.raises(ConfigError, match=r"train.placement='device'.*streamed"
                     r".*'host'.*data.streaming='off'"):
    engine.run(fedavg(model, opt, loss), fed, model,
               dataclasses.replace(cfg, placement="device"))
  with pytest.raises(ConfigError, match=r"central.*every training example.*"
                     r"data.streaming='off'"):
    engine.run(central.build(model, opt, loss), fed, model, cfg)


@pytest.mark.parametrize("overrides,named", [
    (["algorithms=fedccrl"], "fedccrl read"),
    (["algorithms=fedavg,ccst,elcfs"], "ccst, elcfs read"),
    (["algorithms=hfedf", "hfedf.embeddings=autoencoder"], "hfedf read"),
    (["algorithms=central"], "central train"),
    (["algorithms=fedavg", "train.placement=device"],
     "train.placement='device'"),
])
def test_settings_that_cannot_stream_are_refused_before_any_data(
    overrides, named):
  cfg = config.apply_overrides(config.base_config(), [
      "data.name=pacs", "data.streaming=on"] + overrides)
  with pytest.raises(ConfigError) as e:
    checks.validate(cfg)
  msg = str(e.value)
  assert "data.streaming='on'" in msg and named in msg, msg
  assert "data.streaming='off'" in msg
  ok = config.apply_overrides(config.base_config(), [
      "data.name=pacs", "data.streaming=on", "algorithms=fedavg,hfedf"])
  checks.validate(ok)  # hfedf's learned embeddings read no data


def test_a_streamed_federation_carries_the_domains_of_its_rows(data_dir):
  """The domains an objective reads (`with_domains`) of a streamed
  federation are the in-memory one's, gathered per cohort with the rows
  read from their records; an IRM run on the host (its clients of two
  domains) gives the in-memory run's numbers."""
  from fedjax_dg import algorithms
  spec = partition.PartitionSpec(name="domain_split", num_clients=2, d=2)
  feds = [federated.build(_load(data_dir, s), spec, target_domain="c",
                          val_fraction=0.25) for s in ("off", "on")]
  assert feds[1].streamed
  off, on = (f.with_domains().packed_train.gather(np.array([1, 0]))
             for f in feds)
  np.testing.assert_array_equal(on.d, off.d)
  np.testing.assert_array_equal(on.x, off.x)
  assert len(set(feds[0].train_domains.tolist())) == 2
  model = models.get_model("mlp", input_shape=feds[0].image_shape,
                           num_classes=3, hidden=4)
  client = dict(optimizer="sgd", lr=0.1, weight_decay=0.0, momentum=0.0,
                schedule="constant")
  alg = algorithms.build("irm", model, hyperparameters={"anneal_steps": 0,
                                                        "penalty_weight": 1.0},
                         client=client, num_clients=2)
  cfg = engine.EngineConfig(rounds=2, epochs=1, batch_size=4,
                            client_mapping="map", progress=False,
                            placement="host", eval_batch_size=4)
  runs = [engine.run(alg, f, model, cfg) for f in feds]
  assert runs[0].round_metrics["loss"] == runs[1].round_metrics["loss"]
  assert runs[0].final["ood_acc"] == runs[1].final["ood_acc"]
