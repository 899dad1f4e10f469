"""FedAvg vs FedCCRL on Styled Fashion-MNIST, leave-one-domain-out, reduced budget.

Styled Fashion-MNIST (docs/data.md) holds the same clothes in five colour /
texture styles (gray, tint, inverse, sketch, texture): a style shift, what
FedCCRL's cross-client style transfer (CCDT) and AugMix (DIFP) are meant to
bridge, where Rotated Fashion-MNIST shifts geometry. One client per source
domain (4 clients, `domain_split` with d = 1), every domain held out in turn,
both algorithms with FedCCRL's optimizer (Adam lr 1e-3, Sec. 4.2; FedCCRL adds
its cosine schedule over the run), 28x28x3 inputs (no resize), the small CNN,
2,000 images per domain, 10 rounds of 2 local epochs of batch 64.

    fedjax-dg prepare styled_fashion_mnist     # once, offline (~20 s)
    fedjax-dg run --config experiments/styled_fmnist_fedccrl.py

Cost, measured on a 2-core CPU: 12 min 24 s for both algorithms and all
five held-out domains (FedCCRL ~11.8 s per round, FedAvg ~2.9 s: ~4x per local step,
two AugMix views per image through the model); the first numbers (1 seed) are in
docs/data.md, "Styled Fashion-MNIST". The same budget with the pooled data, the
domain-shift measurement of docs/data.md (~3-6 min):

    fedjax-dg run --config experiments/styled_fmnist_fedccrl.py --set algorithms=central

Halve it with `--set data.max_per_domain=1000 --set train.epochs=1` (6.5 min, id
accuracy ~73 % instead of ~81 %); raise it with `--set train.rounds=...
data.max_per_domain=0` (all 14,000 per domain).
"""

from fedjax_dg.run.config import base_config
from fedjax_dg.run.configs.fedccrl_protocol import styled_fmnist


def get_config():
  c = base_config()
  c.name = "styled_fmnist_fedccrl"
  c.algorithms = ("fedccrl", "fedavg")
  styled_fmnist(c, max_per_domain=2000)
  c.train.rounds = 10
  c.train.epochs = 2
  c.client.optimizer = "adam"
  c.client.lr = 1e-3
  c.client.weight_decay = 0.0
  return c
