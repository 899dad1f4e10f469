"""Table 2 of FedSDAF: FedAvg (Adapter) and FedSDAF per held-out domain on PACS,
VLCS and OfficeHome (ViT-B/16), 3 seeds.

    fedjax-dg sweep --config experiments/fedsdaf_table2.py \
        --set model.weights=/path/to/vit_b_16-c867db91.pth
    fedjax-dg report runs/sweep-fedsdaf_table2-<time>

The CNN rows of the table (FedSR, FedADG, CCST, ELCFS, GA) are FedCCRL's
baselines on ResNet-50: experiments/fedccrl_table1.py with `--set
model.name=resnet50`. VLCS's batch is 64 in the paper (`--set
train.batch_size=64 --grid data.name=vlcs`). Protocol and costs:
fedjax_dg/run/configs/fedsdaf_protocol.py.
"""

from fedjax_dg.run.configs.fedsdaf_protocol import get_config as _protocol

SWEEP = dict(grid={"data.name": ("pacs", "vlcs", "office_home")},
             seeds=(0, 1, 2))


def get_config():
  return _protocol("fedsdaf_table2")
