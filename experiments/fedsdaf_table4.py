"""Table 4 of FedSDAF: the contribution of BKD, MHSA, A_di and A_dw, on PACS,
OfficeHome and VLCS (ViT-B/16), 3 seeds.

Each row is an algorithm variant of `algorithms/fedsdaf.py`: `fedsdaf` (all
on), `fedsdaf_no_bkd` (alpha = 0), `fedsdaf_no_mhsa` (fusion off),
`fedsdaf_di` (A_di only: the table's rows 4 and 5, equal here since one
adapter leaves nothing to distill) and `fedsdaf_head` (no adapter: the head
on the frozen ViT, row 6); `fedavg_adapter` is the paper's FedAvg (Adapter).

    fedjax-dg sweep --config experiments/fedsdaf_table4.py \
        --set model.weights=/path/to/vit_b_16-c867db91.pth
    fedjax-dg report runs/sweep-fedsdaf_table4-<time>

Protocol and costs: fedjax_dg/run/configs/fedsdaf_protocol.py.
"""

from fedjax_dg.run.configs.fedsdaf_protocol import get_config as _protocol

SWEEP = dict(grid={"data.name": ("pacs", "office_home", "vlcs")},
             seeds=(0, 1, 2))


def get_config():
  c = _protocol("fedsdaf_table4")
  c.algorithms = ("fedsdaf", "fedsdaf_no_bkd", "fedsdaf_no_mhsa", "fedsdaf_di",
                  "fedsdaf_head", "fedavg_adapter")
  return c
