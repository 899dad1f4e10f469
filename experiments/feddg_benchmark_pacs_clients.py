"""The federated DG benchmark's client-count study on PACS (Bai, Bagchi and
Inouye, ICLR 2024): C = 10, 50, 100, 200 clients at lambda 0 (one domain per
client), the four methods of its `sweep/num_client/pacs/*.json`.

    fedjax-dg prepare pacs --manual-dir /path/to/PACS
    fedjax-dg sweep --config experiments/feddg_benchmark_pacs_clients.py \\
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \\
        --set model.skip_head=True
    fedjax-dg report runs/sweep-feddg_benchmark_pacs_clients-<time>

The main table's protocol (fedjax_dg/run/configs/feddg_benchmark_protocol.py:
80 rounds of 1 local epoch, every client every round, Adam, photo held out,
MobileNetV3-Large in place of ResNet-50), with the values of the study's
sweep files: FedAvg (`erm.json`: lr 3e-5, weight decay 5e-5), SCAFFOLD
(`scaffold.json`: lr 1e-5), FedSR (`fedsr.json`: lr 3e-5, L2 0.01, CMI
0.001), FedGMA (`fedgma.json`: lr 3e-5, mask threshold and server step
0.1), batch 128 (`fedsr.json` alone has 32). Those files give no seed, so
main.py's one default seed ran; here seed 0 (`--seeds 0,1,2` for more).

Cost: 4 methods x 4 client counts, 80 rounds of MobileNetV3-Large at 224 px:
GPU work, not measured; on a 2-core CPU not practical.
"""

from fedjax_dg.run.configs.feddg_benchmark_protocol import get_config as _protocol

SWEEP = dict(grid={"data.num_clients": (10, 50, 100, 200)}, seeds=(0,))

METHODS = ("fedavg", "scaffold", "fedsr", "fedgma")


def get_config():
  c = _protocol("feddg_benchmark_pacs_clients")
  c.algorithms = METHODS
  c.data.lam = 0.0
  c.data.num_clients = 100
  c.train.batch_size = 128
  c.fedavg.client.weight_decay = 5e-5   # erm.json
  c.scaffold.client.lr = 1e-5           # scaffold.json
  return c
