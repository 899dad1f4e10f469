"""No silent wrong numbers: non-finite training stops, constant channels, strict
JSON, settings refused before any data is read."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_domains
from fedjax_dg import engine, models
from fedjax_dg.run import assemble, checks, config, directory, disk, experiment
from fedjax_dg.algorithms.base import ServerState
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.checkpoint import Checkpointer
from fedjax_dg.errors import ConfigError, NonFiniteError
from fedjax_dg.optim import make_optimizer

CFG = engine.EngineConfig(checkpoint_every=0.0,rounds=6, eval_every=2, epochs=1, batch_size=8,
                          client_mapping="map", progress=False, eval_batch_size=16)


def _mlp(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean, std=fed.std)


@pytest.fixture(scope="module")
def fedavg_mlp(fed3):
  """FedAvg on an MLP, one object: the tests running it share its compiled
  programs (the engine caches them per algorithm and model)."""
  model = _mlp(fed3)
  return fedavg(model, make_optimizer("adam", 1e-2),
                objectives.cross_entropy(model)), model


def test_nan_loss_stops_the_run_naming_round_and_keeping_the_last_checkpoint(
    fed3, tmp_path):
  model = _mlp(fed3)
  ce = objectives.cross_entropy(model)
  # The loss turns NaN from round 3 on (the second chunk of two rounds).
  loss = lambda p, b, rng, ctx: jnp.where(ctx.round >= 3, jnp.nan, ce(p, b, rng, ctx))
  alg = fedavg(model, make_optimizer("adam", 1e-2), ce).replace(loss=loss)
  ckpt = str(tmp_path / "ckpt")
  with pytest.raises(NonFiniteError) as e:
    engine.run(alg, fed3, model, CFG, checkpoint_dir=ckpt)
  msg = str(e.value)
  assert "fedavg" in msg and "training loss" in msg and "round 3" in msg, msg
  assert "round 2) is kept" in msg and "learning rate" in msg
  assert Checkpointer(ckpt).latest() == 2  # the bad chunk not saved


def test_non_finite_server_state_is_named(fed3):
  model = _mlp(fed3)
  base = fedavg(model, make_optimizer("adam", 1e-2),
                objectives.cross_entropy(model))

  def server_update(server, result, key):
    server, metrics = base.server.update(server, result, key)
    bad = {**server.params, "fc2": {**server.params["fc2"],
                                    "bias": server.params["fc2"]["bias"] / 0.0}}
    return ServerState(bad, server.opt), metrics

  alg = base.replace(update=server_update)
  with pytest.raises(NonFiniteError, match=r"fedavg: the server state \.params\["):
    engine.run(alg, fed3, model, CFG)


def test_a_constant_channel_normalizes_to_zero_not_nan():
  ds = synthetic_domains(num_domains=3, per_domain=30)
  rgb = np.concatenate([ds.images, ds.images,
                        np.full_like(ds.images, 77)], axis=-1)  # a constant channel
  ds = dataclasses.replace(ds, images=rgb)
  fed = federated.build(ds, partition.PartitionSpec(num_clients=2, seed=0),
                        target_domain=0)
  mean, std = fed.mean, fed.std
  assert std[2] == 1.0 and abs(mean[2] - 77 / 255) < 1e-9
  assert std[0] < 1.0
  model = _mlp(fed)
  x = model.normalize(jnp.asarray(rgb[:4]))
  assert np.all(np.isfinite(np.asarray(x))) and np.all(np.asarray(x[..., 2]) == 0)
  res = engine.run(fedavg(model, make_optimizer("adam", 1e-2),
                          objectives.cross_entropy(model)), fed, model,
                   dataclasses.replace(CFG, rounds=2))
  assert math.isfinite(res.history[-1]["train_loss"])
  with pytest.raises(ConfigError, match="std > 0"):
    models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2, std=0.0)


def test_results_json_is_strict(tmp_path):
  results = dict(runs=[dict(final=dict(ece=float("nan"), acc=0.5,
                                       hist=[1.0, float("inf")]))])
  directory.write_results(str(tmp_path), results)
  text = (tmp_path / "results.json").read_text()

  def refuse(token):
    raise AssertionError(f"non-strict JSON token {token}")

  loaded = json.loads(text, parse_constant=refuse)
  assert loaded["runs"][0]["final"] == dict(ece=None, acc=0.5, hist=[1.0, None])


def _validated(*overrides):
  cfg = config.apply_overrides(config.base_config(), list(overrides))
  checks.validate(cfg)  # no data is read


@pytest.mark.parametrize("overrides,needle", [
    (["hfedf.temperature=0.0"], "hfedf.temperature=0.0: GradAlign's softmax "
                               "temperature must be > 0 (1 = the paper)"),
    (["client.lr=0"], "client optimizer (client.*"),
    (["algorithms=fedprox", "fedprox.client.lr=-1.0"], "fedprox.client"),
    (["hfedf.ema_decay=1.5"], "ema decay must be in [0, 1]"),
    (["seed=-1"], "seed=-1"),
    (["train.cohort_size=-1"], "train.cohort_size=-1: allowed values are 0 "
                               "(all clients) or a positive count"),
    (["train.shuffle=random"], "train.shuffle='random': allowed values "
                               "are one of ('sort', 'feistel')"),
    (["moon.temperature=0.0", "algorithms=moon"], "MOON temperature"),
    (["hfedf.gradalign_over=both"], "hfedf.gradalign_over='both'"),
    (["hfedf.gradalign_over=joint", "hfedf.gradalign_granularity=tensor"],
     "needs hfedf.gradalign_granularity='model'"),
])
def test_bad_settings_are_refused_before_any_data(overrides, needle):
  with pytest.raises(ConfigError) as e:
    _validated(*overrides)
  assert needle in str(e.value), str(e.value)


def test_a_bool_is_not_an_int():
  with pytest.raises(ConfigError, match="train.rounds: expected int"):
    config.apply_overrides(config.base_config(), ["train.rounds=True"])
  with pytest.raises(ConfigError, match="hfedf.ema: expected bool"):
    config.apply_overrides(config.base_config(), ["hfedf.ema=1"])


def test_a_damaged_checkpoint_is_said_and_the_run_starts_over(fed3, fedavg_mlp,
                                                              tmp_path):
  """A checkpoint that cannot be read (every file of round 2 truncated, as a
  killed write or a full disk leaves it) is deleted and said in one
  CheckpointWarning naming its round and folder; the run starts over and
  ends as an uninterrupted run (not with the damaged state)."""
  import glob
  import os
  from fedjax_dg.errors import CheckpointWarning
  alg, model = fedavg_mlp
  ckpt = str(tmp_path / "ckpt")
  engine.run(alg, fed3, model, dataclasses.replace(CFG, rounds=2),
             checkpoint_dir=ckpt)
  for f in glob.glob(os.path.join(ckpt, "2", "**", "*"), recursive=True):
    if os.path.isfile(f) and os.path.getsize(f) > 64:
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3)
  with pytest.warns(CheckpointWarning,
                    match=r"round 2 in .*ckpt could not be read.*started over"):
    again = engine.run(alg, fed3, model, CFG, checkpoint_dir=ckpt)
  whole = engine.run(alg, fed3, model, CFG)
  assert again.history == whole.history
  for a, b in zip(jax.tree.leaves(again.server), jax.tree.leaves(whole.server)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_files_that_are_not_configs_are_named(tmp_path):
  js = tmp_path / "config.json"
  js.write_text("{}")
  with pytest.raises(ConfigError, match="a config is a Python file"):
    config.load(str(js))
  py = tmp_path / "exp.py"
  py.write_text("def get_config():\n  return {'train': {}}\n")
  with pytest.raises(ConfigError, match="get_config\\(\\) returned a dict"):
    config.load(str(py))


def test_an_unwritable_output_dir_is_named(monkeypatch):
  """A read-only output_dir (simulated: the suite may run as root, for whom
  permissions are not enforced) is a ConfigError naming the setting."""
  def refuse(path, *args, **kwargs):
    raise PermissionError(13, "Permission denied", path)

  monkeypatch.setattr(experiment.os, "makedirs", refuse)
  with pytest.raises(ConfigError, match="set output_dir to a writable folder"):
    directory.make_run_dir("/read-only/runs", "x")


def test_checkpoint_size_is_the_carry_and_a_full_disk_is_refused(fedavg_mlp,
                                                                 monkeypatch):
  import collections
  from fedjax_dg import tree
  alg, model = fedavg_mlp
  # FedAvg's carry: the model (float32) only.
  size = engine.checkpoint_bytes(alg)
  assert size == 4 * tree.num_params(
      model.init(__import__("jax").random.key(0)))
  lines = []
  disk.check_disk("fedavg", alg, "/", lines.append)
  assert "MiB" in lines[0] and "free" in lines[0] and "at most 2 at a time" in lines[0]
  # 3 kept + 1 being written; finished runs keeping theirs add 3 each.
  disk.check_disk("fedavg", alg, "/", lines.append, keep=3)
  assert f"at most 4 at a time: {4 * size / 2**20:.1f} MiB" in lines[1]
  disk.check_disk("fedavg", alg, "/", lines.append, keep=3, runs=2)
  assert "at most 7 at a time" in lines[2]
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(experiment.shutil, "disk_usage",
                      lambda path: usage(1, 1, 1000))
  with pytest.raises(ConfigError, match="checkpoints need .* MiB .* but only 0 MiB"):
    disk.check_disk("fedavg", alg, "/", lines.append)
  # The need grows with `keep`: free space for 2 checkpoints is not enough for 3.
  monkeypatch.setattr(experiment.shutil, "disk_usage",
                      lambda path: usage(1, 1, 2 * size + 2**26 + 1))
  disk.check_disk("fedavg", alg, "/", lines.append, keep=1)
  with pytest.raises(ConfigError, match="checkpoints_to_keep"):
    disk.check_disk("fedavg", alg, "/", lines.append, keep=2)


def test_checkpoints_to_keep_is_what_stays_and_the_peak_is_one_more(
    fed3, fedavg_mlp, tmp_path, monkeypatch):
  """orbax's max_to_keep = train.checkpoints_to_keep; while the next one is
  written, one more is on disk (engine.checkpoints_held, what check_disk
  asks for)."""
  import os
  alg, model = fedavg_mlp
  steps = lambda d: sorted(int(f) for f in os.listdir(d) if f.isdigit())
  peaks = []
  init = Checkpointer.__init__

  def counting_init(self, directory, keep=1):
    init(self, directory, keep)
    deleter = self.manager._checkpoint_deleter  # orbax deletes after writing
    delete = deleter.delete_steps

    def delete_steps(to_delete):
      peaks.append(len(steps(directory)))
      delete(to_delete)

    deleter.delete_steps = delete_steps

  monkeypatch.setattr(Checkpointer, "__init__", counting_init)
  for keep in (1, 2):
    ckpt = str(tmp_path / f"keep{keep}")
    cfg = dataclasses.replace(CFG, checkpoints_to_keep=keep)  # 3 chunks
    engine.run(alg, fed3, model, cfg, checkpoint_dir=ckpt)
    assert steps(ckpt) == [2, 4, 6][-keep:], keep
    assert max(peaks) == engine.checkpoints_held(keep) == keep + 1
    peaks.clear()
  with pytest.raises(ConfigError, match="train.checkpoints_to_keep=0"):
    dataclasses.replace(CFG, checkpoints_to_keep=0).validate(3)


def test_imagenet_normalization_gives_torchvision_constants_for_rgb_only():
  ds = synthetic_domains(num_domains=3, per_domain=30)
  grey = federated.build(ds, partition.PartitionSpec(num_clients=2, seed=0),
                         target_domain=0)
  rgb = federated.build(
      dataclasses.replace(ds, images=np.concatenate([ds.images] * 3, axis=-1)),
      partition.PartitionSpec(num_clients=2, seed=0), target_domain=0)
  cfg = config.base_config()
  cfg.data.normalization = "imagenet"
  mean, std = assemble.normalization(cfg, ds, rgb)
  np.testing.assert_allclose(mean, (0.485, 0.456, 0.406))
  np.testing.assert_allclose(std, (0.229, 0.224, 0.225))
  with pytest.raises(ConfigError, match="needs RGB images.*1 channel"):
    assemble.normalization(cfg, ds, grey)
  cfg.data.normalization = "dataset"  # the dataset's own statistics differ
  assert assemble.normalization(cfg, ds, grey)[0] != mean[:1]


def _documented_sizes() -> list[tuple[list[str], dict[str, list[str]]]]:
  """docs/reference/run-directory.md's checkpoint-size tables: (column heads,
  {algorithm: cells})."""
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "docs", "reference",
                      "run-directory.md")
  lines = open(path).read().splitlines()
  tables = []
  for i, line in enumerate(lines):
    if line.startswith("| MiB per checkpoint |"):
      heads = [c.strip() for c in line.strip("|").split("|")][1:]
      rows = {}
      for row in lines[i + 2:]:
        if not row.startswith("|"):
          break
        cells = [c.strip() for c in row.strip("|").split("|")]
        rows[cells[0].split()[0]] = cells[1:]
      tables.append((heads, rows))
  return tables


def _check_documented(path: str, names) -> None:
  import os
  cfg = config.load(os.path.join(os.path.dirname(__file__), "..", path))
  head, sizes = disk.checkpoint_sizes(cfg, names)
  (heads, rows), = [t for t in _documented_sizes() if head in t[0]]
  col = heads.index(head)
  for name in names:
    assert rows[name][col] == disk.mib(sizes[name]), (path, name)
  assert set(rows) >= set(names)


def test_documented_checkpoint_sizes_are_what_the_code_computes(capsys):
  """docs/reference/run-directory.md's first table lists every registered
  algorithm, and its numbers are `fedjax-dg algorithms --config ...`'s
  (recomputed here for the demo's rows that need no data-derived state; the
  Inception CNN's in the slow test); the ViT table is the command's output
  verbatim."""
  import os
  from fedjax_dg import algorithms, cli
  from fedjax_dg.data import lookup
  (_, rows), _ = _documented_sizes()
  assert list(rows) == list(algorithms.available())
  _check_documented("experiments/demo.py",
                    ("fedavg", "hfedf", "hfedf_no_ema", "pfedhn", "moon",
                     "local_only", "scaffold", "fedsdaf"))
  if lookup.is_prepared("styled_fashion_mnist"):  # fedsdaf_offline's data
    path = os.path.join(os.path.dirname(__file__), "..", "experiments",
                        "fedsdaf_offline.py")
    assert cli.main(["algorithms", "--config", path]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.count("\n") == 7  # its six algorithms
    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "reference",
                       "run-directory.md")
    assert printed in open(doc).read()


@pytest.mark.slow
def test_documented_checkpoint_sizes_of_the_paper_model():
  _check_documented("experiments/rfmnist_hfedf.py", ("fedavg", "hfedf"))


def test_a_checkpoint_keeps_the_history_of_its_round(tmp_path, monkeypatch):
  """The write is asynchronous: the meta orbax gets is a copy, so entries the
  engine appends after `save` (the next round's) never reach the checkpoint
  (they did: a resume then held that round twice)."""
  import orbax.checkpoint as ocp
  given = []
  real = ocp.args.JsonSave
  monkeypatch.setattr(ocp.args, "JsonSave",
                      lambda item: given.append(item) or real(item))
  ckpt = Checkpointer(str(tmp_path / "c"))
  history, metrics = [dict(round=1, id_acc=0.5)], dict(loss=[1.0])
  ckpt.save(1, [np.zeros(2)], dict(round=1, history=history,
                                    round_metrics=metrics))
  history.append(dict(round=2, id_acc=0.6))  # the next chunk, before the write
  metrics["loss"].append(0.5)
  ckpt.close()
  assert given[0]["history"] == [dict(round=1, id_acc=0.5)]
  assert given[0]["round_metrics"] == dict(loss=[1.0])
  _, meta = Checkpointer(str(tmp_path / "c")).restore(1, [np.zeros(2)])
  assert meta["history"] == [dict(round=1, id_acc=0.5)]
