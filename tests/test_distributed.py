"""More than one process (`fedjax_dg.distributed`, `jax.distributed`): 2
processes on 127.0.0.1 give the same parameters and history as 1 process; a
process that cannot reach the coordinator stops within the timeout with a
message (never a hang, never JAX's C++ abort)."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import SUITE_XLA_FLAGS, tiny_experiment
from fedjax_dg import cli, distributed
from fedjax_dg.errors import ConfigError

TESTS = os.path.dirname(os.path.abspath(__file__))

# The start of one process of a run: `processes` processes of `devices` CPU
# devices each.
JOIN = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from fedjax_dg import distributed, engine
    engine.use_cpu_devices({devices})
    distributed.initialize(distributed.Settings(
        {coordinator!r}, {processes}, {pid}, timeout=120)
        if {processes} > 1 else distributed.Settings())
""")

# FedAvg and Local-only (per-client state scattered back every round) with a
# cohort of 3 of 4 clients (sampled; padded to 4 over 2 devices). With
# `ckpt`: 2 rounds, then resumed from the orbax checkpoint to 3.
WORKER = JOIN + textwrap.dedent("""
    import dataclasses, jax, numpy as np
    from conftest import synthetic_federation
    from fedjax_dg import models
    from fedjax_dg.algorithms.fedavg import fedavg
    from fedjax_dg.algorithms import local_only
    from fedjax_dg.client import objectives
    from fedjax_dg.optim import make_optimizer
    assert jax.device_count() == {processes} * {devices}
    fed = synthetic_federation(num_clients=4, d=2, num_domains=5, per_domain=40)
    model = models.get_model("mlp", input_shape=fed.image_shape,
                             num_classes=fed.num_classes, mean=fed.mean,
                             std=fed.std)
    loss, opt = objectives.cross_entropy(model), make_optimizer("adam", 1e-2)
    cfg = engine.EngineConfig(rounds=3, eval_every=1, epochs=1, batch_size=8,
                              cohort_size=3, progress=False, eval_batch_size=8,
                              checkpoint_every=0.0)
    out = {{}}
    for alg in (fedavg(model, opt, loss), local_only.build(model, opt, loss,
                                                           num_clients=4)):
      for mapping in {mappings!r}:
        c = dataclasses.replace(cfg, client_mapping=mapping)
        if {ckpt!r}:
          engine.run(alg, fed, model, dataclasses.replace(c, rounds=2),
                     checkpoint_dir={ckpt!r} + "/" + alg.name)
        res = engine.run(alg, fed, model, c, checkpoint_dir={ckpt!r} and
                         {ckpt!r} + "/" + alg.name)
        leaves = jax.tree.leaves((res.server, res.clients))
        out[alg.name + "/" + mapping] = dict(
            leaves=[np.asarray(x, np.float64).ravel().tolist() for x in leaves],
            history=res.history, final=res.final["ood_acc"],
            mesh=jax.device_count() if mapping == "auto" else 1)
    if distributed.is_main():
      json.dump(out, open({path!r}, "w"))
""")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _workers(tmp_path, processes, devices, mappings, ckpt=None,
             script=WORKER):
  """Runs the worker `script` in `processes` processes; process 0's results
  (`script` may write one file per process: `path` + its id)."""
  path = str(tmp_path / f"out{processes}.json")
  coordinator = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-c", script.format(
          tests=TESTS, devices=devices, coordinator=coordinator,
          processes=processes, pid=pid, mappings=mappings, ckpt=ckpt,
          path=path)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS))
      for pid in range(processes)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for pid, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {pid}:\n{log[-3000:]}"
  return json.load(open(path)) if os.path.exists(path) else None


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(a["leaves"], b["leaves"]))


def _assert_same_history(a, b):
  assert [h["round"] for h in a] == [h["round"] for h in b]
  for x, y in zip(a, b):
    assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-5)
    assert x["id_acc_per_client"] == pytest.approx(y["id_acc_per_client"])
    assert x["ood_acc"] == pytest.approx(y["ood_acc"])


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
  """2 processes x 1 CPU device (the mesh spans both; orbax checkpoints
  written and restored by both) == 1 process x 2 devices == 1 device."""
  t0 = time.perf_counter()
  one = _workers(tmp_path, 1, 2, ["auto", "map"])
  t1 = time.perf_counter()
  two = _workers(tmp_path, 2, 1, ["auto"], ckpt=str(tmp_path / "ckpt"))
  t2 = time.perf_counter()
  print(f"1 process: {t1 - t0:.1f} s, 2 processes: {t2 - t1:.1f} s")
  assert os.listdir(tmp_path / "ckpt" / "fedavg")  # written, then resumed
  for name in ("fedavg", "local_only"):
    sharded, single, multi = (one[f"{name}/auto"], one[f"{name}/map"],
                              two[f"{name}/auto"])
    assert sharded["mesh"] == multi["mesh"] == 2
    print(name, "2 processes vs 1:", _max_diff(multi, sharded),
          "2 devices vs 1:", _max_diff(sharded, single))
    assert _max_diff(multi, sharded) < 1e-5
    assert _max_diff(sharded, single) < 1e-5
    _assert_same_history(multi["history"], sharded["history"])
    _assert_same_history(sharded["history"], single["history"])
    assert multi["final"] == pytest.approx(single["final"])


# The "host" placement, Local-only, a cohort of 2 of 4 clients over 2 devices
# (1 per device): every gather of the training clients' examples recorded.
HOST_WORKER = JOIN + textwrap.dedent("""
    import jax, numpy as np
    from conftest import synthetic_federation
    from fedjax_dg import models
    from fedjax_dg.algorithms import local_only
    from fedjax_dg.client import objectives
    from fedjax_dg.data import federated
    from fedjax_dg.optim import make_optimizer
    fed = synthetic_federation(num_clients=4, d=2, num_domains=5, per_domain=40)
    gathered, gather = [], federated.PackedClients.gather

    def spy(self, ids, rows=None):
      if self is fed.packed_train and np.size(ids):
        gathered.append(np.asarray(ids).tolist())
      return gather(self, ids, rows)

    federated.PackedClients.gather = spy
    model = models.get_model("mlp", input_shape=fed.image_shape,
                             num_classes=fed.num_classes, mean=fed.mean,
                             std=fed.std)
    alg = local_only.build(model, make_optimizer("adam", 1e-2),
                           objectives.cross_entropy(model), num_clients=4)
    res = engine.run(alg, fed, model, engine.EngineConfig(
        rounds=4, eval_every=2, epochs=1, batch_size=8, cohort_size=2,
        placement="host", progress=False, eval_batch_size=8))
    leaves = jax.tree.leaves((res.server, res.clients))
    json.dump(dict(leaves=[np.asarray(x, np.float64).ravel().tolist()
                           for x in leaves], gathered=gathered,
                   history=res.history), open({path!r} + str({pid}), "w"))
""")


def test_each_process_gathers_only_its_own_cohort_members(tmp_path):
  """The "host" placement in 2 processes x 1 device, a cohort of 2: each
  process gathers, per chunk, only the cohort member its device trains (one
  of two per round), together exactly the gathers of 1 process x 2 devices,
  with the same numbers."""
  _workers(tmp_path, 1, 2, [], script=HOST_WORKER)
  _workers(tmp_path, 2, 1, [], script=HOST_WORKER)
  read = lambda name: json.load(open(tmp_path / name))
  one, two = read("out1.json0"), [read(f"out2.json{p}") for p in (0, 1)]
  assert one["gathered"]  # [L rounds, 1 member] per device and chunk
  assert all(np.shape(g)[1] == 1 for g in one["gathered"])
  for p in (0, 1):  # process p: member p of every round, not the other
    assert two[p]["gathered"] == one["gathered"][p::2]
    assert _max_diff(two[p], one) < 1e-5
    _assert_same_history(two[p]["history"], one["history"])


def test_unreachable_coordinator_stops_with_a_message_in_bounded_time():
  """`fedjax-dg run` as process 1 of 2 with nothing at the coordinator's
  address: exit status 2 and what to check, within the 0.5 s timeout (+ start;
  a short timeout: the test waits it out)."""
  address = f"127.0.0.1:{free_port()}"
  t0 = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", "fedjax_dg.cli", "demo", "--coordinator", address,
       "--num-processes", "2", "--process-id", "1",
       "--coordinator-timeout", "0.5"], capture_output=True, text=True,
      timeout=60)
  seconds = time.perf_counter() - t0
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"cannot reach the coordinator at {address} within 0.5 s" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert seconds < 30, seconds


def test_coordinator_without_its_processes_stops_with_a_message():
  """Process 0 of 2 alone: JAX would abort (SIGABRT, a C++ stack trace) at its
  deadline; ours comes first (here at 0.5 s) with exit status 2 and what to
  start."""
  address = f"127.0.0.1:{free_port()}"
  proc = subprocess.run(
      [sys.executable, "-c", "from fedjax_dg import distributed; "
       f"distributed.initialize(distributed.Settings({address!r}, 2, 0, "
       "timeout=0.5))"], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (f"the coordinator at {address} did not see all 2 processes within "
          "0.5 s") in proc.stderr
  assert "0..1" in proc.stderr


def test_wait_for_coordinator_gives_up_at_the_deadline():
  """In-process: a closed port is retried until the deadline, then a
  ConfigError names the address and the timeout."""
  port = free_port()
  s = distributed.Settings(f"127.0.0.1:{port}", 2, 1, timeout=0.5)
  t0 = time.monotonic()
  with pytest.raises(ConfigError, match=f"127.0.0.1:{port} within 0.5 s"):
    distributed.wait_for_coordinator(s, t0 + s.timeout)
  assert 0.5 <= time.monotonic() - t0 < 5


def test_wait_for_coordinator_returns_once_it_listens():
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    s = distributed.Settings(f"127.0.0.1:{server.getsockname()[1]}", 2, 1)
    distributed.wait_for_coordinator(s, time.monotonic() + 5)


def test_flags_and_the_environment_jax_reads(monkeypatch):
  seen = []

  def fake_run(*args, processes=None, **kwargs):
    seen.append(processes)
    return 0

  monkeypatch.setattr(cli, "_run", fake_run)

  def parse(*flags):
    """`fedjax-dg run`'s distributed settings from its flags."""
    assert cli.main(["run", "--config", "x.py", *flags]) == 0
    return seen[-1]

  monkeypatch.delenv(distributed.ENV_COORDINATOR, raising=False)
  assert not parse().enabled  # a single process: nothing initialized
  s = parse("--coordinator", "10.0.0.1:1234", "--num-processes", "4",
            "--process-id", "3", "--coordinator-timeout", "9")
  assert s == distributed.Settings("10.0.0.1:1234", 4, 3, 9.0)
  assert s.enabled
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "h:99")
  s = parse("--num-processes", "2", "--process-id", "0")
  assert s.coordinator == "h:99"
  assert parse("--coordinator", "g:1").coordinator == "g:1"  # flag first
  monkeypatch.delenv(distributed.ENV_COORDINATOR)
  assert parse("--distributed").enabled  # JAX detects the rest


@pytest.mark.parametrize("settings,needle", [
    (dict(num_processes=0), "--num-processes=0"),
    (dict(num_processes=2, process_id=2), "--process-id=2: allowed values are 0..1"),
    (dict(process_id=-1), "--process-id=-1"),
    (dict(coordinator="nohost"), "--coordinator='nohost'"),
    (dict(coordinator="h:0"), "--coordinator='h:0'"),
    (dict(coordinator="h:x"), "--coordinator='h:x'"),
    (dict(coordinator="h:1", timeout=0), "--coordinator-timeout=0"),
])
def test_invalid_settings_are_named(settings, needle):
  with pytest.raises(ConfigError, match=re.escape(needle)):
    distributed.Settings(**settings).validate()


def test_host_port_reads_ipv6():
  assert distributed.host_port("[::1]:8476") == ("::1", 8476)
  assert distributed.host_port("node-0.cluster:8476") == ("node-0.cluster", 8476)


def _cli(config, processes):
  """`fedjax-dg run` of test_cli's tiny config (FedAvg, one target) in
  `processes` processes of one CPU device each (one process: two devices);
  their outputs."""
  coordinator = f"127.0.0.1:{free_port()}"
  flags = lambda pid: (["--coordinator", coordinator, "--num-processes",
                        str(processes), "--process-id", str(pid)]
                       if processes > 1 else [])
  env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS,
             FEDJAX_DG_CPU_DEVICES=str(2 // processes))
  procs = [subprocess.Popen(
      [sys.executable, "-m", "fedjax_dg.cli", "run", "--config", config,
       "--set", "algorithms=fedavg", "--set", "data.targets=0", *flags(pid)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
      for pid in range(processes)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for pid, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {pid}:\n{log[-3000:]}"
  return logs


@pytest.mark.slow
def test_cli_run_in_two_processes_writes_one_run_directory(tmp_path):
  """`fedjax-dg run` as 2 processes: one run directory (named by process 0),
  written by process 0 alone (process 1 prints no table), its history that of
  a 1-process run, the finished run's checkpoints deleted."""
  results = []
  for processes in (1, 2):
    out = tmp_path / f"runs{processes}"
    config = tmp_path / f"tiny{processes}.py"
    tiny_experiment(config, out)
    logs = _cli(str(config), processes)
    (run_dir,) = os.listdir(out)
    assert "ood" in logs[0] and all("ood" not in log for log in logs[1:])
    assert not os.listdir(out / run_dir / "checkpoints")
    results.append(json.load(open(out / run_dir / "results.json")))
  (one,), (two,) = (r["runs"] for r in results)
  _assert_same_history(two["history"], one["history"])
  assert two["final"]["ood_acc"] == one["final"]["ood_acc"]
