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
domain, the library's MLP (one hidden layer of 32 ReLU units: its features
are what MMD, CORAL and FedSR act on), the 75-degree domain held out (the
hardest with 0; one target keeps the grid small), C = 5 (one client per
source domain at lambda 0) and C = 50 (~54 training images each), 40 rounds
of 1 epoch, Adam lr 1e-3 (the benchmark's 3e-5 fine-tunes a pretrained
ResNet-50; this model trains from scratch; no weight decay, as in its main
sweeps) for every method, each method's own client settings cleared, its
other defaults kept. The small CNN of the demo reaches the same accuracy
here at 20 rounds (FedAvg at lambda 0.1, C = 50, seeds 0 and 1: 52 and 61 %
in-domain against the MLP's 51 and 58 %) at about ten times the cost a run,
which puts the 10-seed grid at hours instead of minutes.

    fedjax-dg prepare rotated_fashion_mnist    # once (make data does it)
    fedjax-dg sweep --config experiments/feddg_benchmark_offline.py \\
        --seeds 0,1,2,3,4,5,6,7,8,9
    fedjax-dg report runs/sweep-feddg_benchmark_offline-<time>

The grid: 14 methods x lambda (1, 0.1, 0) x C (5, 50) x the seeds, each
method's runs of one (lambda, C) one replica batch (one compile). Its time
and results: docs/results.md, "The federated DG benchmark's grid".
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
  c.model.name = "mlp"
  c.train.rounds = 40
  c.train.eval_every = 5
  c.train.epochs = 1
  c.train.batch_size = 32
  c.train.cohort_size = 0
  # One client optimizer for every method, as the benchmark's code trains
  # them all with Adam: each method's own client settings cleared (None:
  # the run's value).
  config.same_clients(c, optimizer="adam", lr=1e-3, weight_decay=0.0,
                       schedule="constant")
  # The released code's SCAFFOLD: its correction after Adam's step.
  c.scaffold.correction = "step"
  return c
