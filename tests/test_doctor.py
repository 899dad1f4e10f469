"""`fedjax-dg doctor`: the table, what to do for each problem, the exit code."""

import importlib.metadata
import types

from fedjax_dg import cli, doctor
from fedjax_dg.data import sources
from fedjax_dg.data.builders import rotated_fashion_mnist as rfm


def rows_by_name(rows):
  return {r.name: r for r in rows}


def test_ready_machine_passes_with_versions_devices_and_data(monkeypatch,
                                                             capsys):
  data_dir = sources.data_dir_default()
  assert sources.is_prepared(doctor.OFFLINE_DATASET, data_dir), (
      "the test environment prepares it (make data)")
  monkeypatch.setenv(sources.ENV_DATA_DIR, data_dir)
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


def test_empty_data_dir_fails_and_says_what_to_do(tmp_path, monkeypatch,
                                                  capsys):
  monkeypatch.setenv(sources.ENV_DATA_DIR, str(tmp_path / "data"))
  monkeypatch.setenv(rfm.ENV_SOURCE_DIR, str(tmp_path / "raw"))
  assert cli.main(["doctor"]) == 1
  out = capsys.readouterr().out
  assert f"{doctor.OFFLINE_DATASET}  MISSING  not prepared in {tmp_path}" in out
  assert "-> make data, or: fedjax-dg prepare rotated_fashion_mnist" in out
  assert "fashion-mnist raw      MISSING" in out
  assert "dataset-fashion-mnist" in out
  assert "2 required check(s) failed" in out


def test_raw_files_are_optional_once_prepared_and_required_before(tmp_path):
  raw = tmp_path / "raw"
  raw.mkdir()
  for pair in rfm.IDX_FILES:
    for f in pair:
      (raw / f).write_bytes(b"")
  empty = str(tmp_path / "data")
  rows = rows_by_name(doctor.data_checks(empty, str(raw)))
  assert rows["fashion-mnist raw"].status == doctor.OK
  assert rows[doctor.OFFLINE_DATASET].status == doctor.MISSING
  rows = doctor.data_checks(sources.data_dir_default(), str(tmp_path / "no"))
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
