"""Figure 11 of the hFedF paper: the EMA smoothing factor alpha.

hFedF with alpha = 0.25, 0.5, 0.75, 0.85, 0.95 (hfedf.ema_decay; alpha weighs
the new parameters, so lower = smoother), d = 1, on the held-out domain "30"
(the analog of PACS "photo", paper_protocol.PHOTO), three seeds: 15 cells, 15
runs, the papers' protocol otherwise (experiments/paper_protocol.py). The paper
does not list its values beyond Table 10's grid {0.75, 0.85, 0.95}. The figure
is the report's curves.png (mean over seeds); summary.csv has the final and
best values per alpha.

    fedjax-dg sweep --config experiments/fig11_ema_decay.py \
        --grid hfedf.ema_decay=0.25,0.5,0.75,0.85,0.95 --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~12 days (15 runs x ~19 h; not
practical); on one GPU ~2.5 h (an estimate, not measured). At the demo's scale
(paper_protocol.BUDGET) 17 min on a 2-core CPU (measured; docs/results.md):

    fedjax-dg sweep --config experiments/fig11_ema_decay.py \
        --grid hfedf.ema_decay=0.25,0.5,0.75,0.85,0.95 --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import PHOTO, get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS --set data.targets=photo
SWEEP = dict(grid={"hfedf.ema_decay": (0.25, 0.5, 0.75, 0.85, 0.95)},
             seeds=(0, 1, 2))


def get_config():
  c = _paper("fig11_ema_decay")
  c.algorithms = ("hfedf",)
  c.data.targets = PHOTO
  return c
