"""The federated DG benchmark's PACS table (Bai, Bagchi and Inouye, ICLR 2024):
its methods that this library has (FedAvg, IRM, MMD, CORAL, GroupDRO,
FedProx, SCAFFOLD, FedDG as ELCFS, FedADG, FedSR, FedGMA) over the balancing
parameter lambda (1, 0.1, 0), 100 clients, photo held out, 3 seeds (its
three), on the real PACS.

    fedjax-dg prepare pacs --manual-dir /path/to/PACS
    fedjax-dg sweep --config experiments/feddg_benchmark_pacs.py \\
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \\
        --set model.skip_head=True
    fedjax-dg report runs/sweep-feddg_benchmark_pacs-<time>

The protocol, each method's values and the sweep file they come from:
fedjax_dg/run/configs/feddg_benchmark_protocol.py; where it departs from the
released code: docs/faithfulness.md, "The federated DG benchmark's PACS
protocol". Without `model.weights` the backbone trains from scratch.

Cost: 11 methods x 3 lambdas x 3 seeds (99 runs of 80 rounds, 100 clients)
of MobileNetV3-Large at 224 px: GPU work, not measured; on a 2-core CPU not
practical. `fedjax-dg run --config experiments/feddg_benchmark_pacs.py
--estimate` measures rounds on the machine at hand.
"""

from fedjax_dg.run.configs.feddg_benchmark_protocol import get_config as _protocol

SWEEP = dict(grid={"data.lam": (1.0, 0.1, 0.0)}, seeds=(0, 1, 2))


def get_config():
  return _protocol("feddg_benchmark_pacs")
