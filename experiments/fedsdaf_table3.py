"""Table 3 of FedSDAF: FedAvg (Adapter) and FedSDAF per held-out domain on
DomainNet (clipart, infograph, painting, quickdraw, real, sketch; ViT-B/16),
3 seeds.

DomainNet is read from the TFDS catalog (`domainnet`: its six domains, the
official train and test lists merged per domain, 345 classes; the paper
counts 569,010 images, and `fedjax-dg prepare domainnet` prints the count of
the release the catalog holds); one client per source domain (5), batch
1,024 (Sec. 4.3: "1024 for the more extensive DomainNet"); everything else is
the protocol of fedjax_dg/run/configs/fedsdaf_protocol.py.

    fedjax-dg prepare domainnet
    fedjax-dg sweep --config experiments/fedsdaf_table3.py \\
        --set model.weights=/path/to/vit_b_16-c867db91.pth
    fedjax-dg report runs/sweep-fedsdaf_table3-<time>

Cost: the full budget (200 rounds x 30 epochs over the five source domains'
images, four forward passes per step) is far beyond one GPU's days per
target (an estimate, not measured); estimate it before booking one
(docs/how-to/paper-protocol-on-a-gpu.md) and reduce with `--set
train.rounds=... train.epochs=...`.
"""

from fedjax_dg.run.configs.fedsdaf_protocol import get_config as _protocol

SWEEP = dict(seeds=(0, 1, 2))


def get_config():
  c = _protocol("fedsdaf_table3")
  c.data.name = "domainnet"
  c.train.batch_size = 1024
  return c
