"""The hFedF papers' protocol for every algorithm: the base of the table / figure
sweeps (experiments/table*.py, experiments/fig*.py; docs/protocol.md).

experiments/rfmnist_hfedf.py (leave-one-domain-out over the six Rotated
Fashion-MNIST domains, N = 5 clients = source domains, the Table 9 Inception CNN
on 32x32 inputs, 200 rounds x 2 local epochs, batch 64, 10 % id-validation per
client) with Table 10's PACS column for every algorithm (fedjax_dg.run.presets;
Rotated Fashion-MNIST has no column of its own, PACS is the papers' main
benchmark).

    fedjax-dg run --config experiments/paper_protocol.py    # one run: seed 0, d = 1

Costs used by the estimates in the sweep files (one "run" = one algorithm on one
held-out domain):

* paper scale on a 2-core x86-64 CPU: the Inception CNN step (batch 64, 32 px) was
  measured at ~200-210 ms (docs/models.md), one round is 5 clients x 2 epochs x
  ~165 steps ~ 1650 steps ~ 6 min, so one 200-round run ~ 19 h;
* paper scale on one GPU: ~10 min per run (an estimate, not measured: ~330k
  client-steps at ~2 ms, clients vmapped);
* `BUDGET` below (the demo's scale: small CNN, 16 px, 800 images per domain,
  20 rounds x 1 epoch) on that CPU: ~1-2 s per round measured for 5 clients,
  ~3 s with evaluation and compilation (the demo's 120 rounds take ~6 min), so
  ~1 min per run plus ~20 s of tracing per algorithm and cell.
"""

from fedjax_dg.run import presets  # Table 10's values
from fedjax_dg.run.configs.rfmnist_hfedf import get_config as _rfmnist_config

# Table 2's rows (Central is only in the d = 3 tables: it pools all domains).
TABLE2_ALGORITHMS = ("local_only", "fedavg", "fedprox", "pfedhn", "fedsr",
                     "fedgma", "hfedf")
# The figures on PACS "photo" use one held-out domain; its analog here is a
# middle rotation (an interpolation between source domains, the easiest target,
# as photo is on PACS).
PHOTO = "30"

# The demo's scale, for a 2-core CPU (append to any sweep command).
BUDGET = ("--set model.name=small_cnn --set data.image_size=16 "
          "--set data.max_per_domain=800 --set train.epochs=1 "
          "--set train.rounds=20 --set train.eval_every=2 "
          "--set train.ood_eval_max=0")


def get_config(name: str = "paper_protocol"):
  c = _rfmnist_config()
  c.name = name
  presets.apply(c, "rotated_fashion_mnist")
  return c
