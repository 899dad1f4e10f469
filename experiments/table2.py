"""Table 2 of the hFedF paper: μ_id / μ_ood of every algorithm for d = 1, 2, 3.

Local-only, FedAvg, FedProx, pFedHN, FedSR, FedGMA and hFedF, leave-one-domain-out
over the six domains, d = 1, 2, 3, three seeds: 9 cells, 378 runs, the papers'
protocol (experiments/paper_protocol.py). The report's table2.md is Table 2
(↑/↓ vs FedAvg); its per_domain_d{1,2,3}.md have the shape of Tables 11-17.

    fedjax-dg sweep --config experiments/table2.py --grid data.d=1,2,3 --seeds 0,1,2
    fedjax-dg report runs/sweep-table2-<time>

Expected wall-clock: on a 2-core CPU ~300 days (378 runs x ~19 h; not
practical); on one GPU ~2-3 days (an estimate, not measured: ~10 min per run).
At the demo's scale (paper_protocol.BUDGET) ~7 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/table2.py --grid data.d=1,2,3 \
        --seeds 0,1,2 --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import TABLE2_ALGORITHMS, get_config as _paper

# Real data (Table 10's PACS column is already set; other datasets: their column,
# docs/protocol.md): --set data.name=pacs --set data.manual_dir=/path/to/PACS
SWEEP = dict(grid={"data.d": (1, 2, 3)}, seeds=(0, 1, 2))


def get_config():
  c = _paper("table2")
  c.algorithms = TABLE2_ALGORITHMS
  return c
