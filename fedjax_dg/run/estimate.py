"""What a config's full protocol costs, measured before it is run:
`fedjax-dg run --config FILE --estimate`.

A researcher about to book an accelerator for a paper's protocol (200 rounds
of ViT-B/16 on PACS, say) needs three numbers first: the memory one device
must hold, the time of one round, and the total. Guessing them from FLOPs is
unreliable (padding, the clients' mapping, what XLA fuses); running the
protocol to find out is what the estimate avoids. So it runs ONE real round
of every algorithm of the config, on the config's own data, model and
batch, on this machine's backend, and extrapolates:

* **memory per device**: what the "device" placement holds for the whole
  run (`engine.placement.device_placement_bytes`: the padded client data and
  the scan carry, the data scaled to the full dataset when
  `data.max_per_domain` caps it), the shared-frozen parameters (FedSDAF's
  ViT backbone) and the round program's own buffers (XLA's memory analysis
  of the compiled round: activations, gradients, temporaries; for this
  backend; on another the compiler may fuse differently);
* **time per round**: one round measured after its compile, at ONE local
  epoch (the local work of a round is epochs x the clients' steps: the
  measured round is scaled by the protocol's epochs), scaled by the full
  dataset's images over the loaded ones when `data.max_per_domain` caps
  them. Per-round costs that do not grow with the local steps (a server's
  distillation, hFedF's hypernetwork step) are scaled too: an upper bound
  there;
* **total**: per algorithm, rounds x round + the evaluations (every
  `train.eval_every` rounds and the final one, one measured after its
  compile and scaled with the images too: an upper bound, the target's
  share is capped by `train.ood_eval_max`), summed over the algorithms and the held-out targets; for the
  experiment file's `SWEEP`, times its cells (each cell costed as this
  config: cells that change the dataset or the clients cost what theirs do).

It builds the first target's federation, as `experiment.run` does, and
drives the engine's compiled programs as the benchmarks do
(`engine.programs`, the "device" placement); it writes no run directory.
The compile times are printed too: they are paid once per program, not per
round.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg import engine
from fedjax_dg.data import sources
from fedjax_dg.engine import feeds, runner
from fedjax_dg.engine.placement import resolve_placement
from fedjax_dg.run import assemble, checks, sweep
from fedjax_dg.run.config import ConfigDict


@dataclasses.dataclass(frozen=True)
class AlgorithmCost:
  """One algorithm's measured round and what it extrapolates to."""
  name: str
  compile_s: float       # the round program's compile (once per program)
  round_s: float         # one measured round (after its compile)
  steps: int             # local steps of the measured round (the cohort's)
  eval_s: float          # one evaluation (after its compile)
  epoch_scale: float     # the protocol's local epochs / the measured ones
  image_scale: float     # the dataset's images / the loaded ones
  data_bytes: int        # the padded client data the device holds (full data)
  carry_bytes: int       # the scan carry: server and client state
  frozen_bytes: int      # shared-frozen parameters (a frozen backbone)
  program_bytes: int     # the compiled round's own buffers (XLA's analysis)
  placement: str         # where "auto" puts the full run ("device" / "host")

  @property
  def protocol_round_s(self) -> float:
    return self.round_s * self.epoch_scale * self.image_scale

  @property
  def protocol_eval_s(self) -> float:
    return self.eval_s * self.image_scale

  @property
  def device_bytes(self) -> int:
    """Memory of one device for the run (the "device" placement)."""
    return (self.data_bytes + self.carry_bytes + self.frozen_bytes
            + self.program_bytes)

  def run_s(self, rounds: int, evals: int) -> float:
    """One run (one held-out target): rounds and evaluations."""
    return rounds * self.protocol_round_s + evals * self.protocol_eval_s


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The estimate of a config (`estimate`); `lines()` prints it."""
  name: str
  device: str
  rounds: int
  evals: int             # evaluations per run (every eval_every + the final)
  targets: int           # held-out targets (runs per algorithm)
  cells: int             # the experiment file's SWEEP cells (1: none)
  measured: str          # what the measured round ran on
  costs: tuple[AlgorithmCost, ...]

  @property
  def run_s(self) -> float:
    """`fedjax-dg run` of the config: every algorithm on every target."""
    return self.targets * sum(c.run_s(self.rounds, self.evals)
                              for c in self.costs)

  @property
  def sweep_s(self) -> float:
    return self.cells * self.run_s

  @property
  def device_bytes(self) -> int:
    """The largest algorithm's memory per device."""
    return max(c.device_bytes for c in self.costs)

  def lines(self) -> list[str]:
    out = [f"[estimate] {self.name} on {self.device}; {self.measured}",
           "  algorithm: memory per device (data + carry + frozen + round "
           "program) | compile | measured round (local steps) -> protocol "
           "round | evaluation | one run"]
    for c in self.costs:
      out.append(
          f"  {c.name}: {gib(c.device_bytes)} ({gib(c.data_bytes)} + "
          f"{gib(c.carry_bytes)} + {gib(c.frozen_bytes)} + "
          f"{gib(c.program_bytes)}; auto placement: {c.placement}) | "
          f"{hms(c.compile_s)} | {hms(c.round_s)} ({c.steps} steps) -> "
          f"{hms(c.protocol_round_s)} | {hms(c.protocol_eval_s)} | "
          f"{hms(c.run_s(self.rounds, self.evals))}")
    out += [f"memory per device: {gib(self.device_bytes)}",
            "time per round: " + ", ".join(
                f"{c.name} {hms(c.protocol_round_s)}" for c in self.costs),
            f"estimated total: {hms(self.run_s)} for one run ({self.rounds} "
            f"rounds, {self.evals} evaluations, {len(self.costs)} "
            f"algorithm(s) x {self.targets} target(s))"
            + (f"; {hms(self.sweep_s)} for the sweep's {self.cells} cells"
               if self.cells > 1 else "")]
    return out


def gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def hms(seconds: float) -> str:
  """1.23 s, 4.5 min, 6.7 h or 8.9 d."""
  for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
    if seconds >= size:
      return f"{seconds / size:.1f} {unit}"
  return f"{seconds:.2f} s"


def _nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize
             for a in jax.tree.leaves(tree))


def _program_bytes(compiled) -> int:
  """The compiled program's own buffers beyond its arguments: outputs that
  do not alias a donated argument, and temporaries (0 where the backend
  gives no analysis)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return 0
  return int(max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
             + stats.temp_size_in_bytes)


def local_steps(ecfg: engine.EngineConfig, alg, counts) -> int:
  """The local steps of one round over the cohort: each client's epochs x
  ceil(n / B) (or the fixed local steps), the cohort's share of the sum."""
  counts = np.asarray(counts)
  fixed = alg.client.local_steps or ecfg.local_steps
  per = (np.full(len(counts), fixed) if fixed else
         ecfg.epochs * np.ceil(counts / ecfg.batch_size))
  share = (ecfg.cohort_size / len(counts)) if ecfg.cohort_size else 1.0
  return int(round(float(np.sum(per)) * share))


def measure(alg, fed, model, ecfg: engine.EngineConfig, echo=print) -> dict:
  """One round of `alg` and one evaluation, each timed after its compile,
  and the round program's memory (the runner's own set-up and programs,
  "device" placement). The memory is echoed before the round runs: a round
  that does not fit has said what it needs."""
  placement = resolve_placement("auto", alg, (
      fed.pooled() if alg.client.pooled else fed).packed_train, fed.packed_val)
  ecfg, _, recipe, (rep,) = runner.setup(
      alg, [fed], model, dataclasses.replace(ecfg, placement="device",
                                             host_gather="clients"),
      [ecfg.seed])
  alg = recipe.alg
  feed = feeds.SingleFeed(recipe, ecfg, rep, "device")
  progs, frozen = feed.progs, feed.frozen
  carry, inputs = feed.store.begin(feed.state, 0, 1)
  jax.block_until_ready(carry)
  rounds = jnp.int32(ecfg.rounds)
  t = time.perf_counter()
  compiled = progs.chunk.lower(carry, jnp.int32(0), inputs, rep.root, frozen,
                               1, rounds, rep.values).compile()
  compile_s = time.perf_counter() - t
  echo(f"[estimate] {alg.name}: compiled in {hms(compile_s)}; the round's "
       f"own buffers {gib(_program_bytes(compiled))}, frozen parameters "
       f"{gib(_nbytes(frozen))}, carry {gib(engine.checkpoint_bytes(alg))}; "
       "running one round")
  t = time.perf_counter()
  feed.state, metrics = compiled(carry, jnp.int32(0), inputs, rep.root, frozen,
                                 rounds, rep.values)
  jax.block_until_ready((feed.state, metrics))
  round_s = time.perf_counter() - t
  jax.block_until_ready(feed.evaluate(1))  # compiles
  t = time.perf_counter()
  jax.block_until_ready(feed.evaluate(1))
  eval_s = time.perf_counter() - t
  train = fed.pooled().packed_train if alg.client.pooled else fed.packed_train
  return dict(compile_s=compile_s, round_s=round_s, eval_s=eval_s,
              program_bytes=_program_bytes(compiled),
              frozen_bytes=_nbytes(frozen),
              steps=local_steps(ecfg, alg, train.n),
              data_bytes=(train.nbytes(padded=True)
                          + fed.packed_val.nbytes(padded=True)),
              carry_bytes=engine.checkpoint_bytes(alg),
              placement=placement)


def full_images(cfg: ConfigDict, loaded: int) -> int:
  """The dataset's images without `data.max_per_domain` (their labels read,
  not their pixels), or `loaded` when nothing caps them."""
  d = cfg.data
  if not d.max_per_domain:
    return loaded
  ds = sources.load(d.name, image_size=d.image_size,
                    data_dir=d.data_dir or None,
                    manual_dir=d.manual_dir or None, streaming="on")
  return len(ds.labels)


def sweep_cells(config_path: str | None, sets=()) -> int:
  """The cells of the experiment file's `SWEEP` (grid x seeds; 1 without)."""
  if not config_path:
    return 1
  return len(sweep.plan(config_path, sets).cells)


def estimate(cfg: ConfigDict, *, config_path: str | None = None, sets=(),
             echo=print) -> Estimate:
  """Measures one round of every algorithm of `cfg` at one local epoch and
  extrapolates to the protocol (module docstring). `config_path` / `sets`:
  the experiment file and its `--set`s, for its `SWEEP`. Bad settings are
  ConfigErrors before anything is computed, as for a run."""
  cfg = assemble.resolve(cfg)
  checks.validate(cfg)
  cells = sweep_cells(config_path, sets)
  dataset = assemble.load_dataset(cfg)
  targets = assemble.target_domains(cfg, dataset.domain_names)
  fed = assemble.federate(cfg, dataset, targets[0])
  ecfg = assemble.engine_config(cfg)
  ecfg.validate(fed.num_clients)
  model = assemble.make_model(cfg, fed, *assemble.normalization(cfg, dataset,
                                                                fed))
  fixed = bool(ecfg.local_steps)
  epochs = 1.0 if fixed else float(max(ecfg.epochs, 1))
  measured_cfg = ecfg if fixed else dataclasses.replace(ecfg, epochs=1)
  images = full_images(cfg, len(dataset.labels))
  image_scale = images / max(len(dataset.labels), 1)
  echo(f"[estimate] {cfg.name}: one round of each of {len(cfg.algorithms)} "
       f"algorithm(s) at 1 local epoch on {len(dataset.labels)} images "
       f"(target {targets[0]}, {fed.num_clients} clients)")
  costs = []
  for name in cfg.algorithms:
    alg = assemble.algorithm(name, model, fed.num_clients, cfg, data=fed)
    m = measure(alg, fed, model, measured_cfg, echo)
    costs.append(AlgorithmCost(
        name=name, compile_s=m["compile_s"], round_s=m["round_s"],
        steps=m["steps"], eval_s=m["eval_s"],
        epoch_scale=epochs, image_scale=image_scale,
        data_bytes=int(m["data_bytes"] * image_scale),
        carry_bytes=m["carry_bytes"], frozen_bytes=m["frozen_bytes"],
        program_bytes=m["program_bytes"], placement=m["placement"]))
    echo(f"[estimate] {name}: round {hms(m['round_s'])} "
         f"({m['steps']} local steps), compile {hms(m['compile_s'])}")
  evals = math.ceil(cfg.train.rounds / max(cfg.train.eval_every, 1)) + 1
  device = jax.devices()[0]
  measured = (f"measured at 1 local epoch (x {epochs:g} for the protocol's "
              f"epochs)" if not fixed else "measured at the fixed local steps")
  if image_scale != 1:
    measured += (f", on {len(dataset.labels)} of the dataset's {images} "
                 f"images (x {image_scale:.3g})")
  return Estimate(name=cfg.name,
                  device=f"{device.platform} ({device.device_kind}, "
                  f"{jax.device_count()} device(s), {os.cpu_count()} cores)",
                  rounds=int(cfg.train.rounds), evals=evals,
                  targets=len(targets), cells=cells, measured=measured,
                  costs=tuple(costs))
