"""A sweep survives bad inputs and neighbours: one sweep per folder, no
ignored setting, diverged runs flagged, damaged files and bad settings said
in one message (docs/testing.md, "Sweep drills")."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import tiny_experiment
from fedjax_dg import cli
from fedjax_dg.run import lock


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("faults")
  path = d / "tiny.py"
  tiny_experiment(path, d / "runs", algorithms=("fedavg",), targets="0",
                  max_per_domain=20)
  return str(path), str(d)


def _holder(folder):
  """A second process that holds `folder`'s sweep lock until its stdin
  closes; returns once it says it holds it."""
  code = ("import sys\nfrom fedjax_dg.run import lock\n"
          f"lock.hold({str(folder)!r})\nprint('held', flush=True)\n"
          "sys.stdin.read()\n")
  proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "fedjax_dg.cli", *args],
                        capture_output=True, text=True, timeout=600)


def test_a_second_sweep_on_a_held_folder_is_refused(tiny, tmp_path):
  """Item 4: a sweep (new, or --resume) on a folder another process holds
  stops before it writes anything, naming the holder's process id and host;
  the lock goes with the holder's process (SIGKILL)."""
  path, _ = tiny
  out = tmp_path / "sw"
  out.mkdir()
  holder = _holder(out)
  try:
    new = _cli("sweep", "--config", path, "--out", str(out))
    assert new.returncode == 2, new.stderr
    want = f"process {holder.pid} on host {socket.gethostname()}"
    assert want in new.stderr and "in use by another sweep" in new.stderr
    assert "Traceback" not in new.stderr
    assert sorted(os.listdir(out)) == [lock.LOCK]       # nothing written
    # A --resume beside it: refused the same way, before it reads the config.
    with open(out / "sweep.json", "w") as f:
      json.dump(dict(config=path, sets=[], grid=[], seeds=[0], cells=[]), f)
    again = _cli("sweep", "--resume", str(out))
    assert again.returncode == 2 and want in again.stderr, again.stderr
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock.released(lock.hold)(str(out))     # free once its holder is gone


def test_a_held_folder_is_named_before_jax_starts_and_nothing_is_taken(
    tmp_path):
  """`lock.check_free` (what the CLI asks before it starts JAX): a folder
  another process holds raises `Busy` naming it, for a whole sweep and a
  part alike; a free folder, with or without a lock file, passes, and the
  probe keeps nothing (another process takes the lock at once)."""
  lock.check_free(str(tmp_path))                     # no lock file yet
  proc = _holder(tmp_path)
  try:
    for shared in (False, True):
      with pytest.raises(lock.Busy, match=f"process {proc.pid} on host"):
        lock.check_free(str(tmp_path), shared=shared)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  lock.check_free(str(tmp_path))                     # its holder is gone
  again = _holder(tmp_path)                          # the probe kept nothing
  again.stdin.close()
  assert again.wait() == 0


def test_the_lock_is_released_when_the_sweep_returns(tmp_path):
  """Item 4: a function under `lock.released` gives its locks back when it
  returns or raises, so the same process (or another) can take them again."""
  @lock.released
  def fails():
    lock.hold(str(tmp_path))
    raise RuntimeError("boom")

  with pytest.raises(RuntimeError):
    fails()
  proc = _holder(tmp_path)        # another process takes it at once
  proc.stdin.close()
  assert proc.wait() == 0
  with pytest.raises(lock.Busy):  # while one call holds it, a second is refused
    lock.released(lambda: (lock.hold(str(tmp_path)),
                           lock.hold(str(tmp_path))))()


def _no_run_figures(monkeypatch):
  from fedjax_dg.report import plots
  monkeypatch.setattr(plots, "ALL", {})


@pytest.fixture(scope="module")
def swept(tiny):
  """A finished tiny sweep (one cell: FedAvg on one target); tests damage
  copies of it (`_copy`)."""
  path, d = tiny
  out = os.path.join(d, "swept")
  with pytest.MonkeyPatch.context() as mp:
    _no_run_figures(mp)
    assert cli.main(["sweep", "--config", path, "--seeds", "0",
                     "--out", out]) == 0
  return out


def _copy(swept, tmp_path):
  import shutil
  out = str(tmp_path / "copy")
  shutil.copytree(swept, out)
  return out


def _cut(path):
  """`path` cut to half its bytes, as a copy that stopped part way."""
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])


@pytest.mark.parametrize("damaged", ["sweep.json", "seed=0/results.json"])
def test_a_damaged_sweep_file_is_one_message_naming_it(swept, tmp_path, capsys,
                                                       damaged):
  """Item 8: a truncated sweep.json or cell results.json gives, on `report`
  and on `sweep --resume`, one message naming the file and what to do (no
  JSONDecodeError traceback)."""
  out = _copy(swept, tmp_path)
  _cut(os.path.join(out, damaged))
  for args in (["report", out], ["sweep", "--resume", out]):
    capsys.readouterr()
    assert cli.main(args) == 2, args
    err = capsys.readouterr().err
    assert os.path.join(out, damaged) in err and "is damaged" in err, err
    assert ("Restore it from a copy" in err
            and ("delete it" in err) == damaged.endswith("results.json")), err


def test_report_names_a_missing_folder_and_an_out_that_is_a_file(
    swept, tmp_path, capsys):
  """Items 8 and 10: `report` on a folder that does not exist says so;
  `report --out FILE` says FILE is a file (no FileExistsError)."""
  assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
  assert "nowhere: no such folder" in capsys.readouterr().err
  assert cli.main(["sweep", "--resume", str(tmp_path / "nowhere")]) == 2
  assert "nowhere: no such folder" in capsys.readouterr().err
  afile = tmp_path / "report.txt"
  afile.write_text("mine")
  for args in (["report", swept, "--out", str(afile)],
               ["report", swept, swept + "/seed=0", "--out", str(afile)]):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"--out {afile}: a file, not a folder" in err, err
  assert afile.read_text() == "mine"


@pytest.mark.parametrize("args,needle", [
    (["--seeds", ""], "--seeds '' names no seed"),
    (["--seeds", "0,4294967296"], "seed=4294967296: allowed values are "
                                  "integers 0 .. 4294967295"),
    (["--seeds", str(2**63)], f"seed={2**63}: allowed"),
    (["--set", "data.normalization=imagenet"],
     "data.normalization='imagenet' needs RGB images"),
])
def test_bad_seeds_and_normalization_stop_at_dry_run(tiny, tmp_path, capsys,
                                                     args, needle):
  """Item 9: an empty --seeds (not the config's seed, silently), a seed
  JAX would fold onto another (>= 2**32: its keys keep 32 bits) or
  overflow on, and ImageNet's RGB normalization on grayscale data are
  refused by --dry-run, before any folder is made."""
  path, _ = tiny
  out = tmp_path / "never"
  assert cli.main(["sweep", "--config", path, "--out", str(out), "--dry-run"]
                  + args) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err, err
  assert not out.exists()


def test_a_sweep_failing_at_its_start_leaves_no_cell_running(
    tiny, swept, tmp_path, capsys, monkeypatch):
  """Item 9: a sweep that fails once its folder is made (here: planning
  its batches) leaves no cell "running": a new sweep that computed nothing
  is removed again, so the same --out starts afresh; a resumed one keeps
  its folder with the cell marked failed (with the error) for --resume."""
  from fedjax_dg.run import batches
  from fedjax_dg.errors import ConfigError

  def broken(*args, **kwargs):
    raise ConfigError("planned to fail")

  monkeypatch.setattr(batches, "plan", broken)
  path, _ = tiny
  out = str(tmp_path / "sw")
  assert cli.main(["sweep", "--config", path, "--out", out]) == 2
  assert "planned to fail" in capsys.readouterr().err
  assert sorted(os.listdir(out)) == [lock.LOCK]
  assert cli.main(["sweep", "--config", path, "--out", out, "--dry-run"]) == 0

  resumed = _copy(swept, tmp_path)
  manifest = json.load(open(os.path.join(resumed, "sweep.json")))
  manifest["cells"][0]["status"] = "running"
  with open(os.path.join(resumed, "sweep.json"), "w") as f:
    json.dump(manifest, f)
  os.remove(os.path.join(resumed, "seed=0", "results.json"))
  assert cli.main(["sweep", "--resume", resumed]) == 2
  (cell,) = json.load(open(os.path.join(resumed, "sweep.json")))["cells"]
  assert cell["status"] == "failed"
  assert cell["error"] == "ConfigError: planned to fail"


def test_a_bug_in_a_batch_leaves_its_traceback_in_the_cell(
    tiny, tmp_path, capsys, monkeypatch):
  """A batch failing with an error that is no ConfigError (a bug: its
  message does not say where) writes the traceback into the cell's
  error.txt and names that file; a config error writes none; the cell's
  file goes once a --resume finishes it."""
  from fedjax_dg import engine
  from fedjax_dg.errors import ConfigError
  real = engine.run_batch

  def planted_bug(*args, **kwargs):
    raise TypeError("unhashable type: 'planted'")

  monkeypatch.setattr(engine, "run_batch", planted_bug)
  path, _ = tiny
  out = str(tmp_path / "sw")
  assert cli.main(["sweep", "--config", path, "--out", out]) != 0
  error = os.path.join(out, "seed=0", "error.txt")
  said = capsys.readouterr()
  assert f"(traceback: {error})" in said.out + said.err
  text = open(error).read()
  assert "TypeError: unhashable type: 'planted'" in text
  assert "in planted_bug" in text  # where it was raised

  def config_error(*args, **kwargs):
    raise ConfigError("a bad setting")

  monkeypatch.setattr(engine, "run_batch", config_error)
  other = str(tmp_path / "sw2")
  assert cli.main(["sweep", "--config", path, "--out", other]) != 0
  assert not os.path.exists(os.path.join(other, "seed=0", "error.txt"))
  assert "traceback:" not in capsys.readouterr().out

  monkeypatch.setattr(engine, "run_batch", real)
  assert cli.main(["sweep", "--resume", out]) == 0
  assert not os.path.exists(error)


@pytest.mark.parametrize("sets,grid,needle", [
    (["algorithms=fedprox"], ["client.lr=0.001,1e9"],
     "--grid client.lr=1000000000.0 does not reach fedprox: fedprox trains "
     "with fedprox.client.lr=0.001 (its module's default: CLIENT in "
     "fedjax_dg/algorithms/fedprox.py), which wins over client.lr. Instead: "
     "set fedprox.client.lr for fedprox (or fedprox.client.lr=None"),
    (["algorithms=hfedf", "hfedf.client.weight_decay=0.001",
      "client.weight_decay=0.0"], [],
     "--set client.weight_decay=0.0 does not reach hfedf: hfedf trains with "
     "hfedf.client.weight_decay=0.001 (set in the config)"),
    (["algorithms=hfedf,hfedf_no_gradalign"], ["hfedf.gradalign=True,False"],
     "does not reach hfedf_no_gradalign: hfedf_no_gradalign trains with "
     "hfedf_no_gradalign (the variant fixes hfedf.gradalign=False)"),
    (["algorithms=fedavg"], ["fedprox.mu=0.01,0.1"],
     "--grid fedprox.mu changes no run: no algorithm of section fedprox runs"),
    (["train.local_steps=5"], ["train.epochs=1,2"],
     "--grid train.epochs=1 changes no run: train.local_steps=5"),
    (["algorithms=pfedhn", "pfedhn.local_steps=50", "train.epochs=3"], [],
     "--set train.epochs=3 does not reach pfedhn: pfedhn trains with "
     "pfedhn.local_steps=50"),
    ([], ["data.alpha=0.1,0.5"],
     "--grid data.alpha=0.1 changes no run: data.partition='domain_split' (it "
     "reads data.num_clients, data.d only)"),
    (["data.partition=k_per_domain", "data.num_clients=10"],
     ["data.k_per_domain=1,2"], "data.num_clients=10 (a client count wins"),
    (["data.partition=dirichlet"], ["data.lam=0.1,1.0"],
     "--grid data.lam=0.1 changes no run: data.partition='dirichlet' (it "
     "reads data.num_clients, data.alpha, data.min_partition_size only)"),
])
def test_an_ignored_setting_is_refused_naming_what_wins(tiny, sets, grid,
                                                        needle):
  """Item 5: a --set or --grid value that another setting overrides (an
  algorithm's own client optimizer, a variant's fixed switch, a section no
  algorithm runs, local steps over epochs, a partitioner that reads other
  fields) is refused when the sweep is planned, before any data is read,
  naming the field that wins and what to set instead."""
  from fedjax_dg.errors import ConfigError
  from fedjax_dg.run import sweep
  path, _ = tiny
  with pytest.raises(ConfigError) as e:
    sweep.plan(path, sets, sweep.parse_grid(grid))
  assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("sets,grid", [
    (["algorithms=fedavg,fedprox", "fedprox.client.lr=None"],
     ["client.lr=0.001,0.01"]),           # client.lr now reaches FedProx too
    (["algorithms=fedprox", "client.lr=0.01", "fedprox.client.lr=0.01"], []),
    ([], ["algorithms=fedavg|fedprox", "fedprox.mu=0.01,0.1"]),  # FedAvg's
    # rows drop fedprox.mu (records.split_settings): no row is mislabelled
    (["algorithms=hfedf,hfedf_no_ema"], ["hfedf.gradalign=True,False"]),
    (["data.partition=dirichlet"], ["data.alpha=0.1,0.5"]),
    (["data.partition=heterogeneous", "data.num_clients=8"],
     ["data.lam=0.0,0.1,1.0"]),
])
def test_a_setting_that_takes_effect_is_not_refused(tiny, sets, grid):
  """Item 5: what does reach every run it labels is planned as before."""
  from fedjax_dg.run import sweep
  path, _ = tiny
  assert sweep.plan(path, sets, sweep.parse_grid(grid)).cells


def test_an_ignored_setting_stops_run_and_sweep_before_any_folder(
    tiny, tmp_path, capsys):
  """Item 5, end to end: the issue's `--grid client.lr=0.001,1e9` on FedProx
  (two rows, one run) is refused by `sweep --dry-run`, and a `run --set`
  that FedProx's module default overrides by `run`, before any folder."""
  path, _ = tiny
  out = tmp_path / "never"
  assert cli.main(["sweep", "--config", path, "--set", "algorithms=fedprox",
                   "--grid", "client.lr=0.001,1e9", "--out", str(out),
                   "--dry-run"]) == 2
  assert "fedprox.client.lr=0.001" in capsys.readouterr().err
  assert cli.main(["run", "--config", path, "--set", "algorithms=fedavg,fedprox",
                   "--set", "client.lr=0.05",
                   "--set", f"output_dir={out}"]) == 2
  assert "does not reach fedprox" in capsys.readouterr().err
  assert not out.exists()


def test_a_config_whose_client_setting_a_module_default_overrides_is_refused():
  """Item 5: whatever sets it (an experiment file, Python), a run-wide
  client value that an algorithm's own CLIENT default silently overrides is
  refused by the validation; a per-algorithm value the config sets itself
  (as the presets do) is its choice. HyperGenFL's scenarios give every
  algorithm the run's client optimizer ("baselines modified accordingly"):
  FedProx's own lr 1e-3 / wd 1e-4 no longer win over AdamW 1e-2 / 1e-5."""
  from fedjax_dg.errors import ConfigError
  from fedjax_dg.run import assemble, checks, config, presets
  cfg = config.base_config()
  cfg.algorithms = ("fedavg", "fedprox")
  cfg.client.lr = 0.05
  with pytest.raises(ConfigError, match="client.lr=0.05 is set, but it does "
                     "not reach fedprox"):
    checks.validate(cfg)
  cfg.fedprox.client.lr = 0.01          # said for FedProx: its choice
  checks.validate(cfg)
  presets.apply(cfg, "vlcs")            # FedAvg 1e-4, FedProx 1e-3 (Table 10)
  checks.validate(cfg)
  cfg = config.base_config()
  cfg.algorithms = ("fedavg", "fedprox", "hypergenfl")
  presets.apply_scenario(cfg, "standard")
  checks.validate(cfg)
  assert {assemble.client_settings(cfg, a)["lr"] for a in cfg.algorithms} == {
      0.01}


@pytest.mark.parametrize("recorded", [True, False])
def test_a_sweep_whose_config_file_moved_resumes_from_its_manifest(
    swept, tmp_path, capsys, monkeypatch, recorded):
  """Item 10: `sweep --resume` of a sweep whose experiment file is gone runs
  the config sweep.json holds (the file's with the --set) and says so: the
  cells' configs are those the sweep started with, so its finished cell is
  kept (an older manifest, without the fields it set, too)."""
  from fedjax_dg.run import config, sweep
  _no_run_figures(monkeypatch)
  out = _copy(swept, tmp_path)
  path = os.path.join(out, "sweep.json")
  manifest = json.load(open(path))
  before = sweep.plan(manifest["config"], manifest["sets"], manifest["grid"],
                      manifest["seeds"], use_defaults=False)
  manifest["config"] = str(tmp_path / "moved.py")
  if not recorded:
    del manifest["explicit"]
  with open(path, "w") as f:
    json.dump(manifest, f)
  capsys.readouterr()
  assert cli.main(["sweep", "--resume", out]) == 0
  printed = capsys.readouterr().out
  assert f"{tmp_path / 'moved.py'} no longer exists: resuming with the config " \
         "sweep.json holds" in printed
  assert "finished earlier, skipped" in printed
  base = sweep._stored_base(manifest, lambda *a: None)
  after = sweep.plan(manifest["config"], manifest["sets"], manifest["grid"],
                     manifest["seeds"], use_defaults=False, base=base)
  assert [c.to_json() for c in after.configs] == [
      c.to_json() for c in before.configs]
  if recorded:
    assert [config.explicit_keys(c) for c in after.configs] == [
        config.explicit_keys(c) for c in before.configs]


def test_a_scenario_sweep_plans_again_from_its_stored_config():
  """Item 10: HyperGenFL's scenario grid planned from the stored config
  (what a resume without its file runs) gives the same cells: the fields
  the scenario fixes are not taken as set (which `resolve_scenario` would
  refuse as a conflict), with or without the manifest's record of what was
  set."""
  from fedjax_dg.run import config, sweep
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                      "experiments", "hypergenfl_table2.py")
  p = sweep.plan(path)
  stored = json.loads(p.base.to_json())
  for given in (config.explicit_keys(p.base), config.changed_keys(stored)):
    q = sweep.plan(path, p.sets, p.grid, p.seeds, use_defaults=False,
                   base=config.from_json(stored, given=given))
    assert [c.to_json() for c in q.configs] == [c.to_json() for c in p.configs]


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_wrong_fashion_mnist_dir_fails_at_once_without_a_download(
    tmp_path, monkeypatch, folder):
  """Item 10: a $FEDJAX_DG_FASHION_MNIST_DIR without the IDX files is said
  at once, naming the variable and what is missing; TFDS's download (offline:
  minutes of retries before its error) is not tried."""
  from fedjax_dg.data import sources
  from fedjax_dg.data.builders import fashion_mnist_base as fmb
  from fedjax_dg.errors import DataError
  calls = []
  monkeypatch.setattr(fmb, "read_tfds_catalog",
                      lambda data_dir: calls.append(data_dir))
  source = tmp_path / "idx"
  if folder == "empty":
    source.mkdir()
  monkeypatch.setenv("FEDJAX_DG_FASHION_MNIST_DIR", str(source))
  with pytest.raises(DataError) as e:
    sources.load("rotated_fashion_mnist", data_dir=str(tmp_path / "data"))
  msg = str(e.value)
  assert f"FEDJAX_DG_FASHION_MNIST_DIR={str(source)!r}" in msg
  assert ("does not exist" if folder == "missing"
          else "lacks train-images-idx3-ubyte.gz") in msg
  assert "No download was tried" in msg and not calls


@pytest.mark.parametrize("in_sweep", [False, True])
def test_the_space_check_says_what_it_reserves_and_what_applies(
    tmp_path, monkeypatch, in_sweep):
  """Item 3 (its message): refusing a run for want of disk says the
  checkpoints' need to 3 digits (never "need 0 MiB"), the 64 MiB it keeps
  free beside them and why, and what to do where the run is: a sweep's
  cell its --resume and --out (not output_dir, which --out replaces), a
  run output_dir; checkpoints_to_keep only where fewer can be kept."""
  import collections
  from fedjax_dg import models
  from fedjax_dg.errors import ConfigError
  from fedjax_dg.run import assemble, config, disk
  model = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2,
                           hidden=2)
  alg = assemble.algorithm("fedavg", model, 2, config.base_config())
  run_dir = tmp_path / "cell"
  run_dir.mkdir()
  if in_sweep:
    (tmp_path / "sweep.json").write_text("{}")
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(disk.shutil, "disk_usage",
                      lambda path: usage(1, 1, 30 * 2**20))
  with pytest.raises(ConfigError) as e:
    disk.check_disk("fedavg", alg, str(run_dir), lambda *a: None, keep=1)
  msg = str(e.value)
  assert "need 0 MiB" not in msg and "MiB (2 of 0.000" in msg, msg
  assert ("plus 64 MiB kept free for the run's other files (results.json, "
          "metrics.jsonl, TensorBoard events") in msg
  assert "but only 30 MiB are free" in msg
  assert ("sweep --resume" in msg and "--out DIR" in msg
          and "output_dir" not in msg) == in_sweep, msg
  assert ("--set output_dir=DIR" in msg) == (not in_sweep), msg
  assert "checkpoints_to_keep" not in msg
  with pytest.raises(ConfigError, match="checkpoints_to_keep=1"):
    disk.check_disk("fedavg", alg, str(run_dir), lambda *a: None, keep=3)


def test_the_divergence_rule_on_what_runs_look_like():
  """Item 6: the rule (`records.diverged`): a final training loss above 100 x
  ln(classes). Normal runs end below ln(C) (and start near it); blown-up
  ones at 1e12-1e31, often from their first round on, so the rule does not
  compare with the first round."""
  from fedjax_dg.report import records
  hist = lambda *losses: [dict(round=i + 1, train_loss=v)
                          for i, v in enumerate(losses)]
  assert records.diverged(hist(2.31, 1.2, 0.4), 10) is None
  assert records.diverged(hist(2.9, 3.5), 10) is None   # unstable, not blown
  assert records.diverged([], 10) is None
  why = records.diverged(hist(1.6e19, 1.1e20), 10)   # Adam lr 1e9 from round 1
  assert why.startswith("diverged: final training loss 1.1e+20 > 230 (100 x "
                        "ln 10"), why
  assert records.diverged(hist(4.1e3, 1.7e12), 10)   # SGD lr 500
  assert records.diverged(hist(0.7, 70.0), 2)         # 100 x ln 2 = 69.3


def test_a_diverged_run_is_marked_and_never_bold():
  """Item 6: in the tables a value over a diverged run carries DIVERGED
  ("‡"), its legend is in the notes, and it is never bold, even as the
  highest value of its column."""
  from fedjax_dg.report import records, tables
  def rec(algorithm, seed, ood, diverged=None):
    run = dict(algorithm=algorithm, target="0", diverged=diverged,
               final=dict(round=2, id_acc=ood, ood_acc=ood),
               history=[dict(round=2, id_acc=ood, ood_acc=ood)])
    return records.run_record(f"seed={seed}", seed, 1, {"seed": str(seed)},
                              {}, run)
  recs = [rec("fedavg", s, 0.5) for s in (0, 1)] + [
      rec("fedprox", 0, 0.9, "diverged: final training loss 1e+20 > 230"),
      rec("fedprox", 1, 0.8), rec("moon", 0, 0.6), rec("moon", 1, 0.6)]
  table = tables.table2(recs)
  rows = {r[0]: r for r in table.rows}
  assert tables.DIVERGED in rows["FedProx"][2] and "**" not in rows["FedProx"][2]
  assert rows["MOON"][2].startswith("**60.0")       # the best of the rest
  assert tables.DIVERGED not in rows["MOON"][2]
  assert "‡ = diverged" in table.notes
  assert "diverged: final" in tables.long_table(recs).csv()


def test_a_diverged_sweep_run_is_flagged_in_results_and_report(
    tiny, tmp_path, capsys, monkeypatch):
  """Item 6, end to end: FedProx at Adam lr 1e9 (finite, loss ~1e19) is
  recorded with its reason in results.json's `diverged`, marked in the
  report's tables and listed in report.md; FedAvg beside it at its normal
  lr is not flagged."""
  _no_run_figures(monkeypatch)
  path, _ = tiny
  out = str(tmp_path / "sw")
  assert cli.main(["sweep", "--config", path, "--seeds", "0", "--out", out,
                   "--set", "algorithms=fedavg,fedprox",
                   "--set", "fedprox.client.lr=1e9"]) == 0
  runs = {r["algorithm"]: r for r in json.load(
      open(os.path.join(out, "seed=0", "results.json")))["runs"]}
  assert runs["fedavg"]["diverged"] is None
  assert runs["fedprox"]["diverged"].startswith("diverged: final training loss")
  table = open(os.path.join(out, "report", "table2.md")).read()
  (prox,) = [l for l in table.splitlines() if l.startswith("| FedProx")]
  assert "‡" in prox and "**" not in prox
  report = open(os.path.join(out, "report", "report.md")).read()
  assert "‡ DIVERGED: 1 run(s)" in report and "`seed=0` FedProx / target 0" in report


def test_the_committed_paper_runs_are_never_flagged_as_diverged():
  """Item 6: every committed run with its history (the Styled Fashion-MNIST
  Table 1 sweep: FedAvg, FedProx, FedADG, FedDG-GA, FedSR, FedIIR, CCST,
  FedCCRL, ELCFS x 10 seeds x 4 targets; hFedF's Fig. 11 EMA grid) ends far
  below the rule's limit."""
  import csv
  import glob
  import math
  from fedjax_dg.report import records
  root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs",
                      "results")
  runs = [r for path in glob.glob(os.path.join(root, "**", "results.json"),
                                  recursive=True)
          for r in json.load(open(path))["runs"]]
  assert len(runs) >= 300
  for r in runs:
    assert records.diverged(r["history"], 10) is None, r["algorithm"]
  worst = max(r["history"][-1]["train_loss"] for r in runs) / math.log(10)
  assert worst < 1, worst
  curves = {}
  for path in glob.glob(os.path.join(root, "**", "per_round.csv"),
                        recursive=True):
    for row in csv.DictReader(open(path)):   # one curve per (setting, seed)
      key = (path,) + tuple(v for k, v in row.items() if k in (
          "ema_decay", "seed", "algorithm", "target"))
      curves.setdefault(key, []).append(
          dict(round=int(row["round"]), train_loss=float(row["train_loss"])))
  assert len(curves) >= 10
  for hist in curves.values():
    assert records.diverged(sorted(hist, key=lambda h: h["round"]), 10) is None
