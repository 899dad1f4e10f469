"""The federated DG benchmark's grid (Bai, Bagchi and Inouye, ICLR 2024) on
the offline Rotated Fashion-MNIST, at a CPU budget: its methods made for
federation (not AFL nor the centralized DG objectives on clients), over
the balancing parameter lambda and two client counts.

The benchmark's protocol (its released code's PACS sweeps): every client
trains every round (fraction 1), 1 local epoch of batch 32, Adam, 80
rounds; the source domains dealt to C clients by lambda
(`data.partition="heterogeneous"`, `data.lam`: 1 every client the same
domain mixture, 0.1 heterogeneous, 0 one domain per client; docs/data.md),
C = 100 for the main table and 10-200 for its client-count study; the
methods: FedAvg (ERM), FedProx, SCAFFOLD, FedDG (ELCFS here), FedADG, FedSR,
FedGMA, and the centralized DG objectives adapted to clients (IRM, Fish,
MMD, CORAL, GroupDRO) and AFL: all of them here, with V-REx (in its code,
in none of its sweeps or tables); its Mixup is not in this library. The
same grid on the real PACS: experiments/feddg_benchmark_pacs.py.

Here, for 2 CPU cores: Rotated Fashion-MNIST at 16x16, 600 images per
domain, the small CNN, the 75-degree domain held out (the hardest with 0;
one target keeps the grid small), C = 5 (one client per source domain at
lambda 0) and C = 50 (~54 training images each), 20 rounds of 1 epoch,
Adam lr 1e-3 (the benchmark's 3e-5 fine-tunes a pretrained ResNet-50; this
CNN trains from scratch; no weight decay, as in its main sweeps) for every
method, each method's own client settings cleared, its other defaults kept.

    fedjax-dg prepare rotated_fashion_mnist    # once (make data does it)
    fedjax-dg sweep --config experiments/feddg_benchmark_offline.py \\
        --seeds 0,1,2,3,4,5,6,7,8,9
    fedjax-dg report runs/sweep-feddg_benchmark_offline-<time>

The grid: 14 methods x lambda (1, 0.1, 0) x C (5, 50) x the seeds. Cost,
from the rounds `fedjax-dg run --config experiments/feddg_benchmark_offline.py
--estimate` measured at this budget (C = 50; its totals scale to the whole
dataset, so read its "measured round" column). The first 7 methods: 0.5-1.3 s
a round (ELCFS the most), 4.5-9 s to compile, on a 2-core Intel Xeon with
another job on one core: about 2-3 minutes a cell for those 7. The 5
objectives (`--set algorithms=irm,vrex,mmd,coral,groupdro`, on a 2-core AMD
EPYC with another job running, at 7a3f1a0): 1.0-1.4 s a round (IRM 1.11,
V-REx 1.01, MMD 1.36, GroupDRO 1.07), CORAL 3.8-4.1 s, 7-9.5 s to compile
each: about 3.5 minutes a cell more. So about 6 minutes a cell for those
12, the 10-seed grid (60 cells) about 6 hours; Fish and AFL are not
measured yet (Fish's inner steps are one forward and backward pass per
domain of a batch).
"""

from fedjax_dg.run import config
from fedjax_dg.run.configs.demo import get_config as _demo

SWEEP = dict(grid={"data.lam": (1.0, 0.1, 0.0),
                   "data.num_clients": (5, 50)},
             seeds=(0, 1, 2))


def get_config():
  c = _demo()
  c.name = "feddg_benchmark_offline"
  c.algorithms = ("fedavg", "fedprox", "scaffold", "elcfs", "fedadg", "fedsr",
                  "fedgma", "irm", "vrex", "fish", "mmd", "coral", "groupdro",
                  "afl")
  c.data.partition = "heterogeneous"
  c.data.num_clients = 50
  c.data.lam = 0.1
  c.data.max_per_domain = 600
  c.data.targets = "75"
  c.train.rounds = 20
  c.train.eval_every = 5
  c.train.epochs = 1
  c.train.batch_size = 32
  c.train.cohort_size = 0
  # One client optimizer for every method, as the benchmark's code trains
  # them all with Adam: each method's own client settings cleared (None:
  # the run's value).
  config.same_clients(c, optimizer="adam", lr=1e-3, weight_decay=0.0,
                       schedule="constant")
  return c
