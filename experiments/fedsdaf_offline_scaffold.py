"""SCAFFOLD on FedSDAF's adapters beside FedAvg (Adapter), on the offline
benchmark of experiments/fedsdaf_offline.py (its data, tiny ViT, pretrained
frozen backbone, budget and held-out domains).

The released FedSDAF code trains its clients with "the Scaffold optimizer"
(SGD momentum 0.9, weight decay 5e-4, with SCAFFOLD's control variates);
`scaffold.adapters=True` is that setting as its own algorithm: only the
domain-invariant adapter and the head train, with their control variates, on
the frozen ViT (docs/faithfulness.md, "SCAFFOLD" and "FedSDAF"). Here it
runs with FedAvg (Adapter)'s clients (`fedsdaf.CLIENT` at the offline lr
5e-2) and adapter start (`adapter_init="zero"`), so the two rows differ only
in the control variates (and SCAFFOLD's uniform server average, option II).

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
  c.scaffold.client.update(dict(fedsdaf.CLIENT, lr=c.fedsdaf.client.lr))
  return c
