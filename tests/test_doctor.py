"""`fedjax-dg doctor`: the table, what to do for each problem, the exit code."""

import importlib.metadata
import types

from fedjax_dg import cli, doctor
from fedjax_dg.data import locations, lookup, registry
from fedjax_dg.data.builders import fashion_mnist_base as fmb


def rows_by_name(rows):
  return {r.name: r for r in rows}


def test_ready_machine_passes_with_versions_devices_and_data(monkeypatch,
                                                             capsys):
  data_dir = locations.data_dir_default()
  assert lookup.is_prepared(doctor.OFFLINE_DATASET, data_dir), (
      "the test environment prepares it (make data)")
  monkeypatch.setenv(locations.ENV_DATA_DIR, data_dir)
  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  lines = {l.split()[0]: l for l in out.splitlines() if l and l[0] != " "}
  for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
    assert lines[pkg].split()[1:] == ["ok", importlib.metadata.version(pkg)]
  import jax
  assert lines["backend"].split()[2] == jax.default_backend()
  assert f"x {len(jax.devices())}" in lines["devices"]
  assert data_dir in lines["data"]
  assert lines[doctor.OFFLINE_DATASET].split()[1:] == ["ok", "prepared"]
  assert "MISSING" not in out and out.rstrip().endswith(
      "all required checks passed")


def test_datasets_are_optional_a_ready_machine_with_none_passes(
    tmp_path, monkeypatch, capsys):
  """A user of their own folder only (no Fashion-MNIST anywhere): exit 0,
  the missing demo dataset and raw files listed as optional with what uses
  them and what to do, and the user's prepared folder listed."""
  data = tmp_path / "data"
  monkeypatch.setenv(locations.ENV_DATA_DIR, str(data))
  monkeypatch.setenv(fmb.ENV_SOURCE_DIR, str(tmp_path / "raw"))
  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  assert "MISSING" not in out
  assert f"{doctor.OFFLINE_DATASET}  optional  not prepared in {data}" in out
  assert "-> used only by the demo (make demo, fedjax-dg demo) and make test: " \
      "make data, or: fedjax-dg prepare rotated_fashion_mnist" in out
  assert "fashion-mnist raw      optional" in out
  assert "dataset-fashion-mnist" in out
  assert "prepared               note      no dataset yet" in out
  lines = out.rstrip().splitlines()
  assert lines[-2] == "all required checks passed"
  assert lines[-1].startswith("optional, not needed for your own data: "
                              "rotated_fashion_mnist, fashion-mnist raw")
  # The user's own prepared folder dataset is what the data line shows.
  mine = data / "mine" / "1.0.0"
  mine.mkdir(parents=True)
  (mine / registry.FOLDER_RECORD).write_text('{"domains": ["a", "b"]}')
  (mine / "dataset_info.json").write_text("{}")
  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  assert "prepared               ok        mine" in out


def test_raw_files_are_optional_once_prepared_and_before(tmp_path):
  raw = tmp_path / "raw"
  raw.mkdir()
  for pair in fmb.IDX_FILES:
    for f in pair:
      (raw / f).write_bytes(b"")
  empty = str(tmp_path / "data")
  rows = rows_by_name(doctor.data_checks(empty, str(raw)))
  assert rows["fashion-mnist raw"].status == doctor.OK
  assert rows[doctor.OFFLINE_DATASET].status == doctor.OPTIONAL
  assert doctor.exit_code(list(rows.values())) == 0
  rows = doctor.data_checks(locations.data_dir_default(), str(tmp_path / "no"))
  by = rows_by_name(rows)
  assert by["fashion-mnist raw"].status == doctor.NOTE
  assert "prepare again" in by["fashion-mnist raw"].fix
  assert doctor.exit_code(rows) == 0


def test_a_missing_package_is_required_and_the_summary_counts_kinds():
  def version(name):
    if name == "optax":
      raise importlib.metadata.PackageNotFoundError(name)
    return "1.0"
  rows = rows_by_name(doctor.package_checks(version))
  assert rows["optax"].status == doctor.MISSING
  assert "requirements.lock" in rows["optax"].fix
  assert doctor.exit_code(list(rows.values())) == 1
  assert doctor.exit_code([rows["jax"]]) == 0
  dev = lambda kind: types.SimpleNamespace(device_kind=kind)
  assert doctor.device_summary([dev("H100"), dev("H100"), dev("cpu")]) == (
      "H100 x 2, cpu x 1")
