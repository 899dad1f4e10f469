"""Figure 8 of the hFedF paper: client-embedding dimension, learned vs fixed.

hFedF with embedding dimension e = 1, 2, 4, 8 (hfedf.embed_dim) and learned
embeddings vs fixed data-conditioned ones from the Table 6 autoencoder
(hfedf.embeddings=autoencoder), d = 1, on the held-out domain "30" (the analog
of PACS "photo", paper_protocol.PHOTO), three seeds: 24 cells, 24 runs, the
papers' protocol otherwise (experiments/paper_protocol.py). The paper does not
list its dimensions. The report's summary.csv has one row per (e, mode); its
table3.md the differences to the first setting (e = 1, learned).

    fedjax-dg sweep --config experiments/fig8_embeddings.py \
        --grid hfedf.embed_dim=1,2,4,8 --grid hfedf.embeddings=learned,autoencoder \
        --seeds 0,1,2

Expected wall-clock: on a 2-core CPU ~19 days (24 runs x ~19 h; not
practical); on one GPU ~4 h (an estimate, not measured). At the demo's scale
(paper_protocol.BUDGET) ~35 min on a 2-core CPU:

    fedjax-dg sweep --config experiments/fig8_embeddings.py \
        --grid hfedf.embed_dim=1,2,4,8 --grid hfedf.embeddings=learned,autoencoder \
        --seeds 0,1,2 --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import PHOTO, get_config as _paper

# Real data: --set data.name=pacs --set data.manual_dir=/path/to/PACS --set data.targets=photo
SWEEP = dict(grid={"hfedf.embed_dim": (1, 2, 4, 8),
                   "hfedf.embeddings": ("learned", "autoencoder")},
             seeds=(0, 1, 2))


def get_config():
  c = _paper("fig8_embeddings")
  c.algorithms = ("hfedf",)
  c.data.targets = PHOTO
  return c
