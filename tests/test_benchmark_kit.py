"""benchmarks/accelerator_kit.py: its CPU dry run writes a result for every
step and row, with finite positive numbers; what is missing (torch, the bf16
`model.dtype`) is said, and a step that fails, writes nothing or outlives its
budget is reported, never crashes the kit or hides the others.

The default suite runs the dry run's cheaper steps (demo, the FedAvg round,
scale: ~20 s of CPU); the hFedF round and FedSDAF steps (~30 s more) run in
the slow test of the whole dry run.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import accelerator_kit as kit  # noqa: E402
from fedjax_dg.run import config  # noqa: E402

TORCH = importlib.util.find_spec("torch") is not None
BF16 = "dtype" in config.base_config().model


def run_kit(out, *args):
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "accelerator_kit.py"),
       "--dry-run", "--out", str(out), *args],
      capture_output=True, text=True, cwd=ROOT)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(os.path.join(out, "kit_summary.json")) as f:
    return json.load(f), done.stdout


def check_summary(out, summary, stdout, steps):
  """Every planned step ran ok, wrote its log, and has every planned row:
  measured (finite, positive) or with its reason."""
  assert list(summary["plan"]) == steps
  results = {r["step"]: r for r in summary["steps"]}
  assert list(results) == steps
  with open(os.path.join(out, "kit_summary.md")) as f:
    md = f.read()
  for name in steps:
    res = results[name]
    assert res["status"] == "ok", res
    assert os.path.getsize(os.path.join(out, res["log"])) > 0
    assert [r["id"] for r in res["rows"]] == summary["plan"][name]
    for row in res["rows"]:
      assert row["measures"] or row["note"], row
      for key, value in row["measures"].items():
        assert math.isfinite(value) and value > 0, (row["id"], key, value)
      assert row["variant"] in md and row["variant"] in stdout
  return results


def round_row(results, step, variant):
  return next(r for r in results[step]["rows"]
              if r["id"] == f"{step}/{variant}")


def check_round(results, step):
  for variant in ("engine", "loop"):
    assert round_row(results, step, variant)["measures"]["median_s"] > 0
  assert round_row(results, step, "loop")["measures"]["ratio"] > 0
  torch, bf16 = (round_row(results, step, v) for v in ("torch", "engine_bf16"))
  assert not torch["measures"]
  assert torch["note"].startswith("torch not installed" if not TORCH
                                  else "not run in a dry run")
  if BF16:
    assert bf16["measures"]["median_s"] > 0 and bf16["measures"]["ratio"] > 0
  else:
    assert bf16["note"] == "bf16: model.dtype not available in this checkout"


# Slow (~27 s: each step a process that imports JAX and compiles): the
# default suite's 8-minute budget keeps only the kit's in-process tests.
@pytest.mark.slow
def test_dry_run_cheap_steps(tmp_path):
  steps = ["demo", "round_fedavg_C2", "scale"]
  summary, stdout = run_kit(tmp_path, "--steps", "demo,round_fedavg,scale")
  results = check_summary(tmp_path, summary, stdout, steps)
  check_round(results, "round_fedavg_C2")
  assert [r["id"] for r in results["demo"]["rows"]] == ["demo/prepare",
                                                        "demo/demo"]
  scale = {r["id"]: r["measures"] for r in results["scale"]["rows"]}
  assert set(scale["scale/fedavg/host/40"]) >= {"round_ms", "peak_mib", "ratio"}
  assert "Rows to paste" in stdout


@pytest.mark.slow
def test_dry_run_every_step(tmp_path):
  steps = ["demo", "round_fedavg_C2", "round_hfedf_C2", "scale", "fedsdaf"]
  summary, stdout = run_kit(tmp_path)
  results = check_summary(tmp_path, summary, stdout, steps)
  for step in ("round_fedavg_C2", "round_hfedf_C2"):
    check_round(results, step)
  assert results["fedsdaf"]["rows"][1]["measures"]["ratio"] > 0


def fake_step(tmp_path, code, parse=None):
  rows = {"fake/a": kit._row("fake/a", "fake", "a"),
          "fake/b": kit._row("fake/b", "fake", "b", note="not installed")}

  def read(log, step, walls):
    return [dict(rows["fake/a"], measures=dict(median_s=float(v)))
            for v in re.findall(r"^RESULT ([0-9.]+)$", log, re.M)]

  return kit.Step("fake", [[sys.executable, "-c", code]], parse or read, rows)


def test_a_step_that_writes_nothing_fails(tmp_path):
  res = kit.run_step(fake_step(tmp_path, "print('nothing')"), str(tmp_path), 60)
  assert res["status"] == "failed" and "no result for fake/a" in res["why"]
  assert res["rows"][0]["note"].startswith("not measured")
  assert res["rows"][1]["note"] == "not installed"


def test_a_step_that_raises_fails_with_its_error(tmp_path):
  res = kit.run_step(fake_step(tmp_path, "raise ValueError('bad C')"),
                     str(tmp_path), 60)
  assert res["status"] == "failed" and "ValueError: bad C" in res["why"]
  assert "ValueError: bad C" in res["rows"][0]["note"]


def test_a_parser_that_raises_fails_the_step_only(tmp_path):
  def broken(log, step, walls):
    raise KeyError("rows")
  res = kit.run_step(fake_step(tmp_path, "print('RESULT 1')", broken),
                     str(tmp_path), 60)
  assert res["status"] == "failed" and "could not read its log" in res["why"]


def test_a_step_past_its_budget_keeps_what_it_logged(tmp_path):
  code = "import time; print('RESULT 0.5', flush=True); time.sleep(60)"
  res = kit.run_step(fake_step(tmp_path, code), str(tmp_path), 3)
  assert res["status"] == "partial" and res["wall_s"] < 30
  assert res["rows"][0]["measures"] == {"median_s": 0.5}


def test_round_log_gives_medians_ratios_and_errors():
  facts = dict(bf16=True, torch=True, gpu="", gpu_memory_gib=0,
               host_memory_gib=16)
  step = kit.round_steps(kit.DRY_SIZES, facts, dry=False)[0]
  log = "\n".join([
      "[fedavg C=2 engine] ready in 1.0 s (all started) (setup 0.5 s, "
      "warm-up round 0.7 s) ",
      "[fedavg C=2 loop] ready in 1.0 s (setup nan s, warm-up round nan s) "
      "ERROR worker died: killed by SIGKILL (out of memory?)",
      "[fedavg C=2 engine] rep 1/3: 0.2000 s (own 1 cores, others 0 cores)",
      "[fedavg C=2 engine_bf16] rep 1/3: 0.1000 s (own 1 cores)",
      "[fedavg C=2 engine] rep 2/3: 0.4000 s (own 1 cores)",
      "[fedavg C=2 torch] rep 1/3: 0.9000 s (own 1 cores)"])  # then killed
  rows = {r["id"].rsplit("/", 1)[1]: r for r in kit.parse_round(log, step, [])}
  assert rows["engine"]["measures"] == {"median_s": pytest.approx(0.3),
                                        "rounds": 2, "first_round_s": 0.7}
  assert "first round 700.0 ms" in kit.value_text(rows["engine"])
  assert "first_round_s" not in rows["torch"]["measures"]  # no ready line
  assert rows["engine_bf16"]["measures"]["ratio"] == pytest.approx(3.0)
  assert rows["torch"]["measures"]["ratio"] == pytest.approx(3.0)
  assert "out of memory" in rows["loop"]["note"]


def test_hfedf_loop_is_not_run_where_its_gradients_do_not_fit():
  facts = dict(bf16=False, torch=False, gpu="H100", gpu_memory_gib=80,
               host_memory_gib=128)
  steps = {s.name: s for s in kit.round_steps(kit.GPU_SIZES, facts, dry=False)}
  loop = steps["round_hfedf_C1024"].rows["round_hfedf_C1024/loop"]
  assert "181 GiB" in loop["note"]
  assert "loop" not in steps["round_hfedf_C1024"].commands[0]
  assert "loop" in steps["round_hfedf_C64"].commands[0]
  assert not steps["round_fedavg_C1024"].rows["round_fedavg_C1024/loop"]["note"]
  # FedAvg's PyTorch loop: 10,240 steps one after another at C = 1,024 only
  facts["torch"] = True
  steps = {s.name: s for s in kit.round_steps(kit.GPU_SIZES, facts, dry=False)}
  assert "10,240" in steps["round_fedavg_C1024"].rows[
      "round_fedavg_C1024/torch"]["note"]
  assert "torch" in steps["round_fedavg_C256"].commands[0]
  assert all("--parallel-start" in s.commands[0] for s in steps.values())


def test_the_two_parts_hold_every_step_once(tmp_path):
  facts = dict(bf16=True, torch=True, gpu="H200", gpu_memory_gib=140,
               host_memory_gib=128)
  every = [s.name for s in kit.plan(kit.GPU_SIZES, facts, False, str(tmp_path))]
  parts = [[s.name for s in kit.select(
      kit.plan(kit.GPU_SIZES, facts, False, str(tmp_path)), kit.PARTS[k])]
      for k in sorted(kit.PARTS)]
  assert sorted(sum(parts, [])) == sorted(every)
  assert set(every) == set(kit.BUDGETS)
  # each part's budgets fit its one call
  for names in parts:
    assert sum(kit.BUDGETS[n] for n in names) <= kit.DEADLINE_S


@pytest.mark.parametrize("argv, message", [
    (["--part", "1", "--steps", "scale"], "choose one"),
    (["--budget", "scale"], "STEP=SECONDS"),
    (["--budget", "nosuch=3"], "STEP=SECONDS"),
])
def test_bad_arguments_say_what_to_do(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    kit.main(["--dry-run"] + argv)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_steps_near_the_deadline_are_skipped_with_a_note(tmp_path):
  assert kit.main(["--dry-run", "--out", str(tmp_path), "--deadline", "1",
                   "--steps", "scale"]) == 1
  with open(os.path.join(tmp_path, "kit_summary.json")) as f:
    res = json.load(f)["steps"][0]
  assert res["status"] == "skipped"
  assert all("deadline" in r["note"] for r in res["rows"])
