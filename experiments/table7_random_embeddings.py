"""Table 7 of the hFedF paper: learned vs randomized client embeddings.

hFedF with learned embeddings and with embeddings redrawn after every server
update (hfedf.embeddings=random), leave-one-domain-out over the six domains,
d = 1, 2, 3, three seeds: 18 cells, 108 runs, the papers' protocol
(experiments/paper_protocol.py). The report's table3.md compares the random
variant with the learned one (the first value of the grid is the reference).

    fedjax-dg sweep --config experiments/table7_random_embeddings.py \
        --grid hfedf.embeddings=learned,random --grid data.d=1,2,3 --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~85 days (108 runs x ~19 h; not
practical); on one GPU ~18 h (an estimate, not measured: ~10 min per run).
At the demo's scale (paper_protocol.BUDGET) ~2 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/table7_random_embeddings.py \
        --grid hfedf.embeddings=learned,random --grid data.d=1,2,3 --seeds 0,1,2 \
        --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS
SWEEP = dict(grid={"hfedf.embeddings": ("learned", "random"), "data.d": (1, 2, 3)},
             seeds=(0, 1, 2))


def get_config():
  c = _paper("table7_random_embeddings")
  c.algorithms = ("hfedf",)
  return c
