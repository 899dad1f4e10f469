"""The federated DG benchmark's PACS protocol (Bai, Bagchi and Inouye, ICLR
2024; its released code's sweeps): the base of
experiments/feddg_benchmark_pacs*.py.

The protocol of its released code (github.com/inouye-lab/FedDG_Benchmark;
`main.py`'s argparse defaults where a sweep file gives no value): every
client trains every round (fraction 1: `train.cohort_size=0`), 1 local
epoch, 80 rounds, Adam (no weight decay unless said below), 224 px
images with ImageNet's input statistics; the source domains dealt to 100
clients by lambda (`data.partition="heterogeneous"`, `data.lam`: 1 every
client the same domain mixture, 0.1 heterogeneous, 0 one domain per client;
docs/data.md). The per-method values come from `sweep/random_seeds/pacs/
<method>.json`, the only sweep files with every method, its three seeds
(1002-1004) and lambda: batch 32 for every method (its
`sweep/main_results/pacs/erm.json` runs ERM at batch 128, `fedsr.json` FedSR
at 256 with lr 1e-5; they have no seeds and cover 3 of the methods).

The methods, with the sweep values (`hparam1`, `hparam2`; main.py's default
1 where the file gives none):

* FedAvg (its ERM): lr 3e-5.
* FedProx: lr 1e-5, mu = 1 (`fedprox.json` sets no `hparam1`, so main.py's
  default; `sweep/hparam_search/pacs/fedprox_hs.json` searched 0.001-0.1).
* SCAFFOLD: lr 1e-5, Adam (the benchmark's clients all use main.py's
  optimizer; this library's SCAFFOLD defaults to SGD 0.01, cleared here).
* FedDG as ELCFS: lr 3e-5, the library's ELCFS defaults (docs/faithfulness.md,
  "The federated DG benchmark's PACS protocol": the benchmark's FedDG is its
  Fourier mixing client alone, whose own-amplitude weight `hparam1` =
  `hparam2` = 1, main.py's defaults, leaves the images unchanged).
* FedADG: lr 3e-5, weight decay 5e-5, alpha = 0.15 (`hparam1`).
* FedSR: lr 3e-5, L2 0.01 (`hparam1`), CMI 0.001 (`hparam2`).
* FedGMA: lr 3e-5, mask threshold 0.1 (`hparam1`), server step 0.1 (its
  code multiplies the masked update by `hparam1` too).
* IRM: lr 3e-5, penalty 1000 (`hparam1`), annealed over 100 steps
  (`hparam2`).
* MMD, CORAL: lr 3e-5, penalty weight 1 (`hparam1`).
* GroupDRO: lr 3e-5, eta 0.01 (`hparam1`).
* Fish: lr 3e-5 (its inner steps' Adam), meta lr 0.1 (`hparam1`).
* AFL: lr 3e-5, weight decay 5e-5, lambda lr 0.1 (`hparam1`).

The benchmark also reports Mixup, which this library does not have; V-REx
is in its code but in none of its sweeps or tables, so not here.
Its IRM, MMD, CORAL and GroupDRO sweeps run lambda 1 and 0.1 only (at 0 each
client holds one domain); this grid runs them at 0 too.

Held-out domain: photo, the benchmark's test domain (its `metadata.csv`
trains on cartoon and sketch and validates on art painting); here art
painting is a training domain, the model is the last round's, and the
backbone is ImageNet-pretrained MobileNetV3-Large in place of its ResNet-50
(no pretrained ResNet-50 loads here; its weights file: docs/models.md,
"MobileNetV3-Large"): docs/faithfulness.md, "The federated DG benchmark's
PACS protocol".
"""

from fedjax_dg.run import config


# The benchmark's PACS methods that this library has.
METHODS = ("fedavg", "irm", "fish", "mmd", "coral", "groupdro", "afl",
           "fedprox", "scaffold", "elcfs", "fedadg", "fedsr", "fedgma")

# main.py's optimizer and lr (every client); `sweep/random_seeds/pacs/*.json`.
CLIENT = dict(optimizer="adam", lr=3e-5, weight_decay=0.0, momentum=0.0,
              schedule="constant")


def get_config(name: str = "feddg_benchmark_protocol"):
  c = config.base_config()
  c.name = name
  c.algorithms = METHODS
  c.data.name = "pacs"
  c.data.image_size = 224
  c.data.targets = "photo"
  c.data.partition = "heterogeneous"
  c.data.num_clients = 100
  c.data.lam = 0.1
  # The benchmark's id_val and id_test splits keep ~9 % of each source
  # domain out of training.
  c.data.val_fraction = 0.1
  c.data.normalization = "imagenet"
  c.model.name = "mobilenet_v3_large"
  c.train.rounds = 80
  c.train.epochs = 1
  c.train.batch_size = 32
  c.train.cohort_size = 0
  c.train.eval_every = 10
  c.train.ood_eval_max = 0
  # Every method's clients on the one Adam: each module's own client
  # settings cleared (None: the run's value), then the sweeps' differences.
  config.same_clients(c, **CLIENT)
  c.fedprox.client.lr = 1e-5        # fedprox.json
  c.fedprox.mu = 1.0                # main.py's hparam1 default
  c.scaffold.client.lr = 1e-5       # scaffold.json
  c.scaffold.correction = "step"    # ScaffoldClient.step: after Adam's step
  c.fedadg.client.weight_decay = 5e-5  # fedadg.json
  c.fedadg.alpha = 0.15             # fedadg.json hparam1
  c.fedsr.l2r_coeff = 0.01          # fedsr.json hparam1
  c.fedsr.cmi_coeff = 0.001         # fedsr.json hparam2
  c.fedgma.threshold = 0.1          # fedgma.json hparam1
  c.fedgma.step_size = 0.1          # fedgma.json hparam1 (server.py's step)
  c.irm.penalty_weight = 1000.0     # irm.json hparam1
  c.irm.anneal_steps = 100          # irm.json hparam2
  c.mmd.penalty_weight = 1.0        # mmd.json hparam1
  c.coral.penalty_weight = 1.0      # coral.json hparam1
  c.groupdro.eta = 0.01             # groupdro.json hparam1
  c.fish.meta_lr = 0.1              # fish.json hparam1
  c.afl.lambda_lr = 0.1             # afl.json hparam1
  c.afl.client.weight_decay = 5e-5  # afl.json
  return c
