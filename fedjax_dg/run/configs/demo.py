"""`make demo`: hFedF vs FedAvg on Rotated Fashion-MNIST, LODO over all six domains.

The paper-scale protocol of fedjax_dg/run/configs/rfmnist_hfedf.py, shrunk to finish in under
10 minutes on a 2-core CPU: a seeded subset of each domain, 16x16 images, the small
CNN instead of the Table 9 Inception CNN (which costs ~200 ms per client-step at
32x32 on a 2-core x86-64 CPU, ~18x the small CNN at 16x16), fewer rounds of one local epoch.
Same algorithms, partition and hyperparameters otherwise.

    make demo                      # or: fedjax-dg demo
    fedjax-dg demo --full          # the paper-scale protocol (hours on CPU)
"""

from fedjax_dg.run.configs.rfmnist_hfedf import get_config as full_config


def get_config():
  c = full_config()
  c.name = "demo"
  c.data.max_per_domain = 800
  c.data.image_size = 16
  c.model.name = "small_cnn"
  c.train.rounds = 10
  c.train.eval_every = 2
  c.train.epochs = 1
  c.train.ood_eval_max = 0
  return c
