"""Figure 10 of the hFedF paper: long runs (1000 rounds instead of 200).

FedAvg and hFedF for 1000 rounds (5x the protocol), evaluated every 10 rounds,
d = 1, on the held-out domain "30" (the analog of PACS "photo",
paper_protocol.PHOTO), three seeds: 3 cells, 6 runs, the papers' protocol
otherwise (experiments/paper_protocol.py). The paper does not state its number
of rounds. The figure is the report's curves.png (mean over seeds).

    fedjax-dg sweep --config experiments/fig10_long_run.py --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~24 days (6 runs x 5 x ~19 h; not
practical); on one GPU ~5 h (an estimate, not measured). At the demo's scale
(paper_protocol.BUDGET, 200 rounds: 10x its 20) ~1 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/fig10_long_run.py --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=200 \
        --set train.eval_every=10 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import PHOTO, get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS --set data.targets=photo
SWEEP = dict(grid={}, seeds=(0, 1, 2))


def get_config():
  c = _paper("fig10_long_run")
  c.algorithms = ("fedavg", "hfedf")
  c.data.targets = PHOTO
  c.train.rounds = 1000
  c.train.eval_every = 10
  return c
