"""FedAvg (Adapter), FedSDAF and Table 4's ablations on the offline
benchmarks, reduced budget, the tiny ViT on CPU.

Styled Fashion-MNIST (a colour / texture shift) by default, Rotated
Fashion-MNIST (a geometric one) with `--set data.name=rotated_fashion_mnist
data.image_size=28`; one client per source domain, every domain held out in
turn, 1,000 images per domain, a ViT of ViT-Ti/16's design cut to CPU size
(patch 7 on 28x28: 16 patches; width 64, 4 blocks, 4 heads), 10 rounds of 2
local epochs of batch 64, the clients' SGD of the paper (`fedsdaf.CLIENT`:
momentum 0.9, weight decay 5e-4) at lr 5e-2 (1e-3 barely moves in 10
rounds), the adapters' up-projections starting at 0 (`adapter_init`: the
adapted model starts as the pretrained backbone).

The backbone: no ImageNet ViT of this size exists offline, so
experiments/fedsdaf_pretrain.py trains one on the gray domain (79 % held-out
accuracy there after 5 epochs, 20 s) and the runs hold out the other four
domains. Without `model.weights` the backbone stays at its random
initialization (weak features for every method alike).

    fedjax-dg prepare styled_fashion_mnist     # once, offline (~25 s)
    python experiments/fedsdaf_pretrain.py runs/vit_tiny_gray.npz
    fedjax-dg sweep --config experiments/fedsdaf_offline.py --seeds 0,1,2 \
        --set model.weights=runs/vit_tiny_gray.npz \
        --set data.targets=tint,inverse,sketch,texture
"""

from fedjax_dg.run.config import base_config


def get_config():
  c = base_config()
  c.name = "fedsdaf_offline"
  c.algorithms = ("fedavg_adapter", "fedsdaf", "fedsdaf_no_bkd",
                  "fedsdaf_no_mhsa", "fedsdaf_di", "fedsdaf_head")
  c.data.name = "styled_fashion_mnist"
  c.data.image_size = 28
  c.data.max_per_domain = 1000
  c.data.targets = "all"
  c.data.partition = "domain_split"
  c.data.d = 1
  c.model.name = "vit_tiny"
  c.model.vit.patch = 7
  c.model.vit.dim = 64
  c.model.vit.depth = 4
  c.model.vit.heads = 4
  c.model.vit.mlp_dim = 128
  c.train.rounds = 10
  c.train.eval_every = 5
  c.train.epochs = 2
  c.train.batch_size = 64
  c.train.ood_eval_max = 0
  c.fedsdaf.client.lr = 5e-2
  c.fedsdaf.adapter_init = "zero"
  return c
