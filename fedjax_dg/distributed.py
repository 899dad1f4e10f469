"""More than one process: JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program (`fedjax-dg run ... --coordinator HOST:PORT
--num-processes N --process-id I`); `jax.distributed.initialize` joins them, and
then `jax.devices()` lists the devices of every process: the engine's "clients"
mesh spans them all, each process places the clients of its own devices
(`engine.layout.Layout.put_clients`) and the round's collectives cross
processes (on CPU through gloo, JAX's default CPU collectives). Process 0
writes the run directory (results, metrics, reports); orbax checkpoints are
written by all processes together (each one calls save and restore with the
same directory).
docs/scale.md: the commands for GPU / TPU hosts, what was tested.

Settings: the flags, else the environment JAX reads (`JAX_COORDINATOR_ADDRESS`;
with `--distributed` and nothing else JAX detects the cluster: SLURM, Open MPI,
Cloud TPU, Kubernetes). A process that cannot reach the coordinator, or a
coordinator that does not see all N processes, stops within
`--coordinator-timeout` seconds with a message naming the address and what to
check (JAX alone would abort with a C++ stack trace).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

import numpy as np

from fedjax_dg.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
DEFAULT_TIMEOUT = 300  # seconds; jax.distributed.initialize's default
# JAX's own deadline comes this much after ours, so that ours reports first.
_JAX_GRACE = 30
EXIT_CODE = 2  # the CLI's status for an error the user can fix


@dataclasses.dataclass(frozen=True)
class Settings:
  """How this process joins a multi-process run (all None: a single process)."""
  coordinator: str | None = None   # HOST:PORT of process 0 (it hosts the service)
  num_processes: int | None = None
  process_id: int | None = None
  timeout: float = DEFAULT_TIMEOUT
  detect: bool = False             # --distributed: JAX fills what is not given

  @property
  def enabled(self) -> bool:
    return self.detect or any(v is not None for v in (
        self.coordinator, self.num_processes, self.process_id))

  def validate(self) -> None:
    """Every given setting (a cluster JAX detects fills the others)."""
    n, i = self.num_processes, self.process_id
    if n is not None and n < 1:
      raise ConfigError(f"invalid setting --num-processes={n}: allowed values "
                        "are integers >= 1")
    if i is not None and not (0 <= i < (n or i + 1)):
      raise ConfigError(
          f"invalid setting --process-id={i}: allowed values are 0.."
          f"{(n or i + 1) - 1} (0 up to --num-processes - 1; process 0 hosts "
          "the coordinator)")
    if self.timeout <= 0:
      raise ConfigError(f"invalid setting --coordinator-timeout={self.timeout}: "
                        "allowed values are seconds > 0")
    if self.coordinator is not None:
      host_port(self.coordinator)


def host_port(address: str) -> tuple[str, int]:
  """("host", port) of "host:port" ("[::1]:port" for IPv6); ConfigError else."""
  host, sep, port = address.rpartition(":")
  host = host.strip("[]")
  if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
    raise ConfigError(
        f"invalid setting --coordinator={address!r} (or ${ENV_COORDINATOR}): "
        "allowed values are HOST:PORT, process 0's host name or IP address as "
        "the other processes reach it and a free port, e.g. 10.0.0.1:1234")
  return host, int(port)


def from_args(args) -> Settings:
  """The settings of `fedjax-dg run / demo / sweep` (`add_flags`), the
  coordinator defaulting to $JAX_COORDINATOR_ADDRESS."""
  return Settings(
      coordinator=args.coordinator or os.environ.get(ENV_COORDINATOR) or None,
      num_processes=args.num_processes, process_id=args.process_id,
      timeout=args.coordinator_timeout, detect=args.distributed)


def add_flags(parser) -> None:
  group = parser.add_argument_group(
      "more than one process (jax.distributed; docs/scale.md)")
  group.add_argument("--coordinator", metavar="HOST:PORT",
                     help="process 0's address, the same for every process "
                     f"(default: ${ENV_COORDINATOR})")
  group.add_argument("--num-processes", type=int, metavar="N",
                     help="how many processes take part")
  group.add_argument("--process-id", type=int, metavar="I",
                     help="this process: 0..N-1 (0 hosts the coordinator and "
                     "writes the run directory)")
  group.add_argument("--distributed", action="store_true",
                     help="join a multi-process run whose settings JAX detects "
                     "(SLURM, Open MPI, Cloud TPU, Kubernetes)")
  group.add_argument("--coordinator-timeout", type=float, default=DEFAULT_TIMEOUT,
                     metavar="SECONDS", help="how long to wait for the "
                     f"coordinator and every process (default {DEFAULT_TIMEOUT})")


def initialize(s: Settings) -> None:
  """Joins the run described by `s` (nothing for a single process). Call it
  before JAX runs anything (as `jax.distributed.initialize`)."""
  s.validate()
  if not s.enabled:
    return
  import jax
  deadline = time.monotonic() + s.timeout
  if s.coordinator and s.process_id:
    wait_for_coordinator(s, deadline)
  # `initialize` blocks in C++ (the GIL released) and, past its deadline, JAX
  # aborts the process with a stack trace: this timer says why first.
  timer = threading.Timer(max(0.0, deadline - time.monotonic()),
                          lambda: _give_up(_not_all_joined(s)))
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(
        s.coordinator, s.num_processes, s.process_id,
        initialization_timeout=int(s.timeout) + _JAX_GRACE)
  except (ValueError, TypeError) as e:  # settings JAX could not complete
    raise ConfigError(
        f"jax.distributed.initialize: {e}; give --coordinator, --num-processes "
        "and --process-id (no cluster JAX detects was found)") from e
  finally:
    timer.cancel()


def wait_for_coordinator(s: Settings, deadline: float) -> None:
  """Returns once the coordinator accepts a TCP connection; ConfigError if it
  does not before `deadline` (time.monotonic())."""
  host, port = host_port(s.coordinator)
  while True:
    try:
      socket.create_connection((host, port), timeout=max(
          0.1, min(2.0, deadline - time.monotonic()))).close()
      return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConfigError(
            f"process {s.process_id} cannot reach the coordinator at "
            f"{s.coordinator} within {s.timeout:g} s ({type(e).__name__}: {e}): "
            f"check that process 0 runs with --coordinator {s.coordinator} "
            f"(it hosts the coordinator), that {host} is process 0's host as "
            f"this host reaches it, and that port {port} is open between them "
            "(firewall); --coordinator-timeout sets the wait") from e
      time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _not_all_joined(s: Settings) -> str:
  n = s.num_processes
  who = "this process" if s.process_id is None else f"process {s.process_id}"
  return (f"{who} of {n or '?'}: the coordinator at "
          f"{s.coordinator or '(detected)'} did not see all {n or ''} processes "
          f"within {s.timeout:g} s: start every process "
          f"{f'0..{n - 1} ' if n else ''}once, each "
          "with the same --coordinator and --num-processes and its own "
          "--process-id, and check that each reaches the coordinator's port "
          "(firewall); --coordinator-timeout sets the wait")


def _give_up(message: str) -> None:
  print(f"fedjax-dg: error: {message}", file=sys.stderr, flush=True)
  os._exit(EXIT_CODE)  # the main thread is blocked inside JAX


def process_count() -> int:
  import jax
  return jax.process_count()


def is_main() -> bool:
  """Whether this process writes the run directory (process 0, or the only
  one). A process that has not imported JAX has joined no multi-process run:
  the only one, asked without starting JAX (a sweep lock's holder)."""
  if "jax" not in sys.modules:
    return True
  import jax
  return jax.process_index() == 0


def main_only(echo):
  """`echo` on process 0 (it reports the run), a no-op on the others."""
  return echo if is_main() else lambda *args, **kwargs: None


def same_everywhere(text: str) -> str:
  """Process 0's `text` on every process (a run directory named by process 0)."""
  if process_count() == 1:
    return text
  from jax.experimental import multihost_utils
  raw = np.frombuffer(text.encode(), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(raw.size)))
  buf = np.zeros(size, np.uint8)  # the shape process 0 sends
  buf[:min(size, raw.size)] = raw[:size]
  return bytes(multihost_utils.broadcast_one_to_all(buf)).decode()


def barrier(name: str) -> None:
  """Every process waits here until all have come (nothing for one process)."""
  if process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
