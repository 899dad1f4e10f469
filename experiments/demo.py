"""`make demo`: hFedF vs FedAvg on Rotated Fashion-MNIST, LODO over all six domains.

The paper-scale protocol of experiments/rfmnist_hfedf.py, shrunk to finish in under
10 minutes on a 2-core CPU: a seeded subset of each domain, 16x16 images, the small
CNN instead of the Table 9 Inception CNN (which costs ~200 ms per client-step at
32x32 on a 2-core CPU, ~18x the small CNN at 16x16), fewer rounds of one local epoch.
Same algorithms, partition and hyperparameters otherwise.

    make demo                      # or: fedjax-dg demo
    fedjax-dg demo --full          # the paper-scale protocol (hours on CPU)
"""

# The config lives in the package (other configs build on it).
from fedjax_dg.run.configs.demo import get_config  # noqa: F401
