"""SCAFFOLD on FedSDAF's adapters beside FedAvg (Adapter), on the offline
benchmark of experiments/fedsdaf_offline.py (its data, tiny ViT, pretrained
frozen backbone, budget and held-out domains).

The released FedSDAF code trains its clients with "the Scaffold optimizer"
(SGD momentum 0.9, weight decay 5e-4, with SCAFFOLD's control variates);
`scaffold.adapters=True` is that setting as its own algorithm: only the
domain-invariant adapter and the head train, with their control variates, on
the frozen ViT (docs/faithfulness.md, "SCAFFOLD" and "FedSDAF").

Both rows here train with plain SGD (lr 5e-2, the offline lr, weight decay
5e-4, no momentum) from the same adapter start (`adapter_init="zero"`), so
they differ only in the control variates (and SCAFFOLD's uniform server
average, option II). Not momentum 0.9: with it every SCAFFOLD run of this
benchmark went non-finite by round 6 (12 of 12, 2026-11-27): option II
estimates c_i+ from the model's move divided by K x lr, which momentum makes
up to 1 / (1 - 0.9) = 10 times larger than plain steps would, so the control
variates grow each round (docs/faithfulness.md, "SCAFFOLD").

    fedjax-dg prepare styled_fashion_mnist
    python experiments/fedsdaf_pretrain.py runs/vit_tiny_gray.npz
    fedjax-dg sweep --config experiments/fedsdaf_offline_scaffold.py \\
        --seeds 0,1,2 --set model.weights=runs/vit_tiny_gray.npz \\
        --set data.targets=tint,inverse,sketch,texture
"""

import importlib.util
import os

from fedjax_dg.algorithms import fedsdaf

_spec = importlib.util.spec_from_file_location(
    "fedsdaf_offline", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "fedsdaf_offline.py"))
_offline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_offline)

SWEEP = dict(seeds=(0, 1, 2))


def get_config():
  c = _offline.get_config()
  c.name = "fedsdaf_offline_scaffold"
  c.algorithms = ("fedavg_adapter", "scaffold")
  c.scaffold.adapters = True
  c.scaffold.adapter_init = "zero"
  plain_sgd = dict(fedsdaf.CLIENT, lr=c.fedsdaf.client.lr, momentum=0.0)
  c.fedsdaf.client.update(plain_sgd)   # FedAvg (Adapter)'s clients
  c.scaffold.client.update(plain_sgd)
  return c
