"""Figure 3 of the hFedF paper: from zero- to few-shot (k target images per client).

FedAvg, FedSR and hFedF with k = 0, 1, 5, 10 images of the held-out domain added
to every client's training data (data.few_shot_k), leave-one-domain-out over the
six domains, d = 1, three seeds: 12 cells, 216 runs, the papers' protocol
(experiments/paper_protocol.py). The paper does not list its k values; these
span zero- to few-shot. The report's summary.csv has μ_id / μ_ood per k (the
figure's points); table2.md the same with ↑/↓ vs FedAvg at each k.

    fedjax-dg sweep --config experiments/fig3_few_shot.py \
        --grid data.few_shot_k=0,1,5,10 --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~170 days (216 runs x ~19 h; not
practical); on one GPU ~1.5 days (an estimate, not measured: ~10 min per run).
At the demo's scale (paper_protocol.BUDGET) ~4 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/fig3_few_shot.py \
        --grid data.few_shot_k=0,1,5,10 --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS
SWEEP = dict(grid={"data.few_shot_k": (0, 1, 5, 10)}, seeds=(0, 1, 2))


def get_config():
  c = _paper("fig3_few_shot")
  c.algorithms = ("fedavg", "fedsr", "hfedf")
  return c
