"""hFedF vs FedAvg on Rotated Fashion-MNIST, leave-one-domain-out, the paper's protocol.

The hFedF papers' protocol (Sec. 5.1, App. C.8): N = number of source domains
(5 here), d = 1 source domain per client (Alg. 5), the Table 9 Inception CNN on
32x32 inputs, 200 rounds of 2 local epochs with batch 64, 10 % of each client's data
held out for id-accuracy, the unseen domain for ood-accuracy, Table 10's PACS
hyperparameters (no Rotated Fashion-MNIST values exist in the paper).

    fedjax-dg run --config experiments/rfmnist_hfedf.py      # or: fedjax-dg demo --full

Cost: the Inception CNN step (batch 64, 32x32) measured ~210 ms on a 2-core CPU
(docs/models.md), so one round (5 clients x 2 epochs x ~165 steps) is ~6 min and one
target domain ~20 h per algorithm on CPU; on one modern GPU, roughly 10-20 minutes per
target domain and algorithm (estimate, not measured). Reduce with
`--set train.rounds=... data.max_per_domain=...`.
"""

# The config lives in the package (other configs build on it).
from fedjax_dg.run.configs.rfmnist_hfedf import get_config  # noqa: F401
