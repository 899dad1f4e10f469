"""Where examples come from and how they are split among clients.

* `sources`: `load` / `prepare` a named dataset (TFDS builders, DomainBed image
  folders, the embedded offline Rotated Fashion-MNIST) as a `DomainDataset`
  (`dataset`): numpy arrays with domain and class names. Beneath them:
  `registry` and `lookup` (the names), `locations` (the data directory),
  `provenance` (the raw folder prepared data came from), `prepared` (TFDS),
  `streamed` (images read on demand), `splits` (official splits as domains).
* `partition`: leave-one-domain-out, hFedF domain split (Alg. 5), K clients per
  domain, IID, Dirichlet label skew, few-shot target injection.
* `federated`: `FederatedData`, packed per-client examples (and their padded
  view).
"""

from fedjax_dg.data import federated
from fedjax_dg.data import partition
from fedjax_dg.data import sources
from fedjax_dg.data.federated import build
from fedjax_dg.data.federated import ClientArrays
from fedjax_dg.data.federated import FederatedData
from fedjax_dg.data.federated import PackedClients
from fedjax_dg.data.partition import make_partition
from fedjax_dg.data.partition import PartitionSpec
from fedjax_dg.data.dataset import DomainDataset
from fedjax_dg.data.registry import available
from fedjax_dg.data.sources import load
from fedjax_dg.data.sources import prepare

__all__ = [
    "ClientArrays",
    "DomainDataset",
    "FederatedData",
    "PackedClients",
    "PartitionSpec",
    "available",
    "build",
    "federated",
    "load",
    "make_partition",
    "partition",
    "prepare",
    "sources",
]
