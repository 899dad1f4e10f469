"""Your own image folder: hFedF vs FedAvg, leave-one-domain-out, every image.

    fedjax-dg prepare folder --manual-dir /path/to/root --name my_sites
    fedjax-dg run --config experiments/own_folder.py --set data.name=my_sites

The fields that depend on your data are at the top of `get_config`, marked
SET: `data.name` must be given (a run without it stops and says so);
`data.image_size` and `data.targets` have defaults to check. Everything else
is written out here, not inherited: every image of every domain
(`data.max_per_domain = 0`, no subset), one client per source domain (hFedF's
Algorithm 5, d = 1), the Table 9 Inception CNN, 200 rounds of 2 local epochs
of batch 64, and the hFedF paper's PACS hyperparameters (Table 10: PACS is a
DomainBed folder too). The images keep their channels: a folder whose images
are all grayscale is stored and trained with one channel, any other as RGB
(`fedjax-dg prepare folder` says which).

Cost: the Inception CNN step (batch 64, 32x32) is ~210 ms on a 2-core CPU
(docs/models.md), so a few thousand images per domain take hours per target
on CPU; a GPU or a smaller budget, named on the command line, e.g. a first try:

    fedjax-dg run --config experiments/own_folder.py --set data.name=my_sites \\
        --set model.name=small_cnn --set data.image_size=16 \\
        --set train.rounds=10 --set data.max_per_domain=500

`fedjax-dg partition --config experiments/own_folder.py --set data.name=...`
shows each client's examples per domain without training.
"""

from fedjax_dg.run.config import base_config


def get_config():
  c = base_config()
  c.name = "own_folder"
  # ---- SET: your data -------------------------------------------------------
  c.data.name = ""          # SET: the NAME of `fedjax-dg prepare folder --name NAME`
  c.data.image_size = 32    # SET: the side every image is resized to (the
                            # CNNs need a multiple of 4; a ViT: of its patch)
  c.data.targets = "all"    # SET: held-out domains, comma-separated folder
                            # names; "all": each domain in turn (LODO)
  # ---- the protocol, written out (no subset, nothing inherited) -------------
  c.algorithms = ("hfedf", "fedavg")
  c.data.max_per_domain = 0          # every image of every domain
  c.data.partition = "domain_split"  # hFedF Algorithm 5
  c.data.num_clients = 0             # one client per source domain
  c.data.d = 1                       # source domains per client
  c.data.val_fraction = 0.1          # each client's id-validation share
  c.model.name = "inception_cnn"     # the hFedF papers' Table 9 CNN
  c.train.rounds = 200
  c.train.eval_every = 5
  c.train.epochs = 2
  c.train.batch_size = 64
  c.client.optimizer = "adam"        # Table 10, PACS column
  c.client.lr = 1e-3
  c.client.weight_decay = 1e-4       # FedAvg
  c.hfedf.client.weight_decay = 1e-3  # hFedF's clients
  c.hfedf.server_lr = 1e-3
  c.hfedf.server_weight_decay = 1e-5
  c.hfedf.ema_decay = 0.95
  return c
