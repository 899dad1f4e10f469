"""Figure 9 of the hFedF paper: local epochs E = 1, 2, 5 and convergence speed.

Local-only, FedAvg, FedProx, pFedHN, FedSR, FedGMA and hFedF with E = 1, 2, 5
local epochs per round (train.epochs), d = 1, on the held-out domain "30" (the
analog of PACS "photo", paper_protocol.PHOTO), three seeds: 9 cells, 63 runs,
the papers' protocol otherwise (experiments/paper_protocol.py). The paper does
not list its E values. The figure is the learning curves: the report's
curves.png (mean over seeds, evaluation every 5 rounds) and the per-evaluation
values in the cells' results.json.

    fedjax-dg sweep --config experiments/fig9_local_epochs.py \
        --grid train.epochs=1,2,5 --seeds 0,1,2

Expected wall-clock (cost grows with E: 1 + 2 + 5 epochs = 4 runs of the
protocol's 2 epochs per algorithm and seed): on a 2-core CPU ~65 days (84
run-equivalents x ~19 h; not practical); on one GPU ~14 h (an estimate, not
measured). At the demo's scale (paper_protocol.BUDGET; E from the grid) ~3-3.5 h
on a 2-core CPU:

    fedjax-dg sweep --config experiments/fig9_local_epochs.py \
        --grid train.epochs=1,2,5 --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import PHOTO, TABLE2_ALGORITHMS, get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS --set data.targets=photo
SWEEP = dict(grid={"train.epochs": (1, 2, 5)}, seeds=(0, 1, 2))


def get_config():
  c = _paper("fig9_local_epochs")
  c.algorithms = TABLE2_ALGORITHMS
  c.data.targets = PHOTO
  return c
