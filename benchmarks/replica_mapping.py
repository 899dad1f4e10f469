"""The replica mappings against separate runs, in one process: the 9 runs
of one algorithm at seed 0 of the hFedF Table 2 shape (d = 1, 2, 3 x targets
0, 30, 60) as `engine.run` one after another and as `engine.run_replicas`
mapped ("map") and sharded over the devices ("shard"), on 2 CPU devices:
wall time (each side pays its own compile) and the largest difference from
the separate runs' parameters and final target accuracy.

    python benchmarks/replica_mapping.py [fedavg]
"""

import os
import sys
import time

from fedjax_dg import engine

engine.use_cpu_devices(2)

import jax  # noqa: E402  (after the devices are set)
import numpy as np  # noqa: E402

from fedjax_dg.run import assemble, config as config_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sweep_batches import TABLE2_SHAPE  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "experiments",
                      "table2.py")


def federations():
  """(the 9 federations, the model, the config of the last)."""
  feds = []
  for d in (1, 2, 3):
    cfg = assemble.resolve(config_lib.apply_overrides(
        config_lib.load(CONFIG), TABLE2_SHAPE + ["train.rounds=10",
                                                 f"data.d={d}"]))
    ds = assemble.load_dataset(cfg)
    feds += [assemble.federate(cfg, ds, t)
             for t in assemble.target_domains(cfg, ds.domain_names)]
  model = assemble.make_model(cfg, feds[0],
                              *assemble.normalization(cfg, ds, feds[0]))
  return feds, model, cfg


def main(name: str = "fedavg") -> None:
  feds, model, cfg = federations()
  alg = assemble.algorithm(name, model, feds[0].num_clients, cfg)
  ecfg = assemble.engine_config(cfg)
  t = time.perf_counter()
  alone = [engine.run(alg, f, model, ecfg) for f in feds]
  print(f"{name}: {len(feds)} engine.run one after another: "
        f"{time.perf_counter() - t:.1f} s", flush=True)
  leaves = lambda r: jax.tree.leaves((r.server, r.clients))
  for mapping in ("map", "shard"):
    t = time.perf_counter()
    got = engine.run_replicas(alg, feds, model, ecfg, [0] * len(feds),
                              mapping=mapping)
    wall = time.perf_counter() - t
    params = max(float(np.max(np.abs(np.asarray(a, np.float64)
                                     - np.asarray(b, np.float64))))
                 for g, a_ in zip(got, alone)
                 for a, b in zip(leaves(g), leaves(a_)))
    ood = max(abs(g.final["ood_acc"] - a.final["ood_acc"])
              for g, a in zip(got, alone))
    print(f"{name}: run_replicas {mapping}: {wall:.1f} s; largest difference "
          f"from the separate runs: parameters {params:.2e}, final ood "
          f"accuracy {ood:.4f}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
