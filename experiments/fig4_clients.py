"""Figure 4 of the hFedF paper: scaling the number of clients N (d = 1 and 3).

FedAvg, FedSR and hFedF with N = 5, 10, 20, 40 clients (data.num_clients; the
source domains are split further by hFedF's Alg. 5, all clients train every
round) and d = 1, 3, on the held-out domain "30" (the analog of PACS "photo",
paper_protocol.PHOTO), three seeds: 24 cells, 72 runs, the papers' protocol
otherwise (experiments/paper_protocol.py). The paper does not list its N values.
The report's summary.csv has μ_id / μ_ood per (N, d).

    fedjax-dg sweep --config experiments/fig4_clients.py \
        --grid data.num_clients=5,10,20,40 --grid data.d=1,3 --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~60 days (72 runs x ~19 h: the training
data and so the steps per round do not grow with N; evaluation does); on one GPU
~12-15 h (an estimate, not measured). At the demo's scale
(paper_protocol.BUDGET) ~1.5-2 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/fig4_clients.py \
        --grid data.num_clients=5,10,20,40 --grid data.d=1,3 --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import PHOTO, get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS --set data.targets=photo
SWEEP = dict(grid={"data.num_clients": (5, 10, 20, 40), "data.d": (1, 3)},
             seeds=(0, 1, 2))


def get_config():
  c = _paper("fig4_clients")
  c.algorithms = ("fedavg", "fedsr", "hfedf")
  c.data.targets = PHOTO
  return c
