"""The data settings and their defaults, declared once.

The config's `data` section is this dataclass's fields (`config.base_config`,
the way `train` is the engine's `EngineConfig`); `partition.PartitionSpec`
takes its split settings' defaults from here, under the same names, and the
presets read what they compare against from here. Change a default here and
every entry point follows.

`min_partition_size` is 1: a client needs one training example, and every run
through the config has always used 1 (the HyperGenFL presets set 10,
flwr-datasets' `DirichletPartitioner` default, explicitly); docs/data.md
("Data defaults") says why.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which dataset, how it is split among clients, and where it lives.

  Attributes:
    name: the dataset (`registry.available()`).
    image_size: side in pixels every image is resized to (> 0; no native-size
      value: give it).
    max_per_domain: 0: every example; else a seeded subset per domain.
    targets: "all" | "none" | comma-separated held-out domain names.
    partition: "domain_split" (hFedF Alg. 5) | "k_per_domain" | "iid" |
      "dirichlet" | "heterogeneous" (the federated DG benchmark's).
    num_clients: 0: one per source domain (the hFedF papers); else the count
      (k_per_domain: k x source domains).
    d: source domains per client (domain_split).
    k_per_domain: clients per source domain (k_per_domain).
    alpha: Dirichlet concentration (dirichlet).
    min_partition_size: smallest client partition a Dirichlet draw may give
      (redrawn until every client has it).
    lam: the benchmark's balancing parameter lambda in 0..1 (heterogeneous):
      1 every client the same mixture of the source domains, 0 each client
      its main domain only (whole domains when there are fewer clients
      than domains).
    few_shot_k: target-domain images injected into each client's training data.
    val_fraction: each client's id-validation share.
    server_fraction: share of the source examples held by the server (carved
      out before the client partition, stratified by domain and label): the
      unlabeled transfer set of FedDF / FedBE, the labeled proxy set of FedLAW
      (FedLAW ref. code: 0.02). 0: none (every other algorithm).
    normalization: input statistics: "dataset" (all images) | "train" |
      "imagenet" (pretrained weights; RGB).
    streaming: "auto" | "on" | "off": "on" leaves the images in their prepared
      array_record files and reads each chunk's cohorts from them (a dataset
      larger than host memory; the "host" placement); "auto": "on" when the
      images would take more than `streamed.AUTO_STREAM_SHARE` of the host's
      memory (docs/scale.md).
    data_dir: prepared data ("": `locations.data_dir_default()`).
    manual_dir: folder with manually downloaded data.
  """

  name: str = "rotated_fashion_mnist"
  image_size: int = 32
  max_per_domain: int = 0
  targets: str = "all"
  partition: str = "domain_split"
  num_clients: int = 0
  d: int = 1
  k_per_domain: int = 1
  alpha: float = 0.5
  min_partition_size: int = 1
  lam: float = 0.1
  few_shot_k: int = 0
  val_fraction: float = 0.1
  server_fraction: float = 0.0
  normalization: str = "dataset"
  streaming: str = "auto"
  data_dir: str = ""
  manual_dir: str = ""


def data_defaults() -> dict:
  """The config's `data` section: every `DataConfig` field with its default."""
  return dataclasses.asdict(DataConfig())
