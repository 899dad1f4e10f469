"""Tables 4 / 5 of the hFedF paper: accuracy per held-out domain at d = 3.

Central, Local-only, FedAvg, FedProx, pFedHN, FedSR, FedGMA and hFedF,
leave-one-domain-out over the six domains, d = 3, three seeds: 3 cells, 144
runs, the papers' protocol (experiments/paper_protocol.py). The report's
per_domain_d3.md is the table: mean ± std over seeds per domain, μ, ↑/↓ vs
FedAvg, id then ood.

    fedjax-dg sweep --config experiments/table4_5.py --seeds 0,1,2
    fedjax-dg report runs/sweep-table4_5-<time> --d 3

Expected wall-clock: on a 2-core CPU ~115 days (144 runs x ~19 h; not
practical); on one GPU ~1 day (an estimate, not measured: ~10 min per run).
At the demo's scale (paper_protocol.BUDGET) ~2.5 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/table4_5.py --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import TABLE2_ALGORITHMS, get_config as _paper

# Real data: Table 4 is Office-Home, Table 5 VLCS (each with its Table 10 column,
# listed in docs/protocol.md), e.g. --set data.name=vlcs --set data.manual_dir=/path/to/VLCS
SWEEP = dict(grid={}, seeds=(0, 1, 2))


def get_config():
  c = _paper("table4_5")
  c.algorithms = ("central",) + TABLE2_ALGORITHMS
  c.data.d = 3
  return c
