"""hFedF vs FedAvg on Rotated Fashion-MNIST, leave-one-domain-out, the paper's protocol.

The hFedF papers' protocol (Sec. 5.1, App. C.8): N = number of source domains
(5 here), d = 1 source domain per client (Alg. 5), the Table 9 Inception CNN on
32x32 inputs, 200 rounds of 2 local epochs with batch 64, 10 % of each client's data
held out for id-accuracy, the unseen domain for ood-accuracy, Table 10's PACS
hyperparameters (no Rotated Fashion-MNIST values exist in the paper).

    fedjax-dg run --config experiments/rfmnist_hfedf.py      # or: fedjax-dg demo --full

Cost: the Inception CNN step (batch 64, 32x32) measured ~210 ms on a 2-core x86-64 CPU
(docs/models.md), so one round (5 clients x 2 epochs x ~165 steps) is ~6 min and one
target domain ~20 h per algorithm on CPU; on one modern GPU, roughly 10-20 minutes per
target domain and algorithm (estimate, not measured). Reduce with
`--set train.rounds=... data.max_per_domain=...`.
"""

from fedjax_dg.run.config import base_config


def get_config():
  c = base_config()
  c.name = "rfmnist_hfedf"
  c.algorithms = ("hfedf", "fedavg")
  c.data.name = "rotated_fashion_mnist"
  c.data.image_size = 32
  c.data.targets = "all"
  c.data.partition = "domain_split"
  c.data.d = 1
  c.model.name = "inception_cnn"
  c.train.rounds = 200
  c.train.eval_every = 5
  c.train.epochs = 2
  c.train.batch_size = 64
  # Table 10, PACS column.
  c.client.optimizer = "adam"
  c.client.lr = 1e-3
  c.client.weight_decay = 1e-4          # FedAvg
  c.hfedf.client.weight_decay = 1e-3    # hFedF's clients
  c.hfedf.server_lr = 1e-3
  c.hfedf.server_weight_decay = 1e-5
  c.hfedf.ema_decay = 0.95
  return c
