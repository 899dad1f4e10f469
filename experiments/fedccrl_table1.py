"""Table 1 of FedCCRL: accuracy per held-out domain and average, 6 clients (2
per source domain), PACS and OfficeHome, 3 seeds (the paper's three runs).

    fedjax-dg sweep --config experiments/fedccrl_table1.py \
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \
        --set model.skip_head=True
    fedjax-dg report runs/sweep-fedccrl_table1-<time>

The protocol and its costs: fedjax_dg/run/configs/fedccrl_protocol.py. The report's
per-domain table has Table 1's shape (columns = held-out domains, Avg.).
"""

from fedjax_dg.run.configs.fedccrl_protocol import get_config as _protocol

SWEEP = dict(grid={"data.name": ("pacs", "office_home")}, seeds=(0, 1, 2))


def get_config():
  return _protocol("fedccrl_table1")
