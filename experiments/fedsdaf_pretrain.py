"""A pretrained backbone for experiments/fedsdaf_offline.py: its tiny ViT
trained centrally on Styled Fashion-MNIST's gray domain, written as an
AugReg-layout `.npz` that `model.weights` loads (docs/models.md, "ViT").

FedSDAF adapts an ImageNet-pretrained ViT; no ViT of this size is pretrained
offline, and a frozen *random* backbone gives the adapters weak features. The
gray domain holds its own 14,000 images (the domains are disjoint), so runs
that load this file hold out the other four domains only: gray stays a source
(a client), its images seen in pretraining as a source's would be.

    fedjax-dg prepare styled_fashion_mnist
    python experiments/fedsdaf_pretrain.py runs/vit_tiny_gray.npz
    fedjax-dg run --config experiments/fedsdaf_offline.py \
        --set model.weights=runs/vit_tiny_gray.npz \
        --set data.targets=tint,inverse,sketch,texture

Rotated Fashion-MNIST (the upright domain "0" pretrains, the five rotated
ones are held out):

    python experiments/fedsdaf_pretrain.py runs/vit_tiny_rot0.npz \
        --dataset rotated_fashion_mnist --domain 0
    fedjax-dg run --config experiments/fedsdaf_offline.py \
        --set data.name=rotated_fashion_mnist \
        --set model.weights=runs/vit_tiny_rot0.npz \
        --set data.targets=15,30,45,60,75

Pretraining: the offline config's model and input statistics, every gray
image (`data.max_per_domain=0`), 90 % trained / 10 % held out, Adam 1e-3,
`--epochs` passes of batch 128 (5 by default); it prints the held-out
accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

import numpy as np


def offline_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "fedsdaf_offline.py")
  spec = importlib.util.spec_from_file_location("fedsdaf_offline", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("out", help="the .npz to write")
  p.add_argument("--dataset", default="styled_fashion_mnist")
  p.add_argument("--domain", default="gray")
  p.add_argument("--epochs", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  from fedjax_dg import algorithms, engine
  from fedjax_dg.run import assemble
  from fedjax_dg.data import federated, partition
  from fedjax_dg.errors import ConfigError
  from fedjax_dg.models import vit_weights
  cfg = offline_config()
  cfg.data.name = args.dataset
  cfg.data.max_per_domain = 0
  cfg.seed = args.seed
  dataset = assemble.load_dataset(cfg)
  if args.domain not in dataset.domain_names:
    raise ConfigError(f"--domain {args.domain!r}: allowed "
                      f"{dataset.domain_names}")
  pick = dataset.domains == dataset.domain_names.index(args.domain)
  one = dataclasses.replace(
      dataset, images=dataset.images[pick], labels=dataset.labels[pick],
      domains=np.zeros(int(pick.sum()), np.int32),
      domain_names=(args.domain,))
  fed = federated.build(one, partition.PartitionSpec(name="iid",
                                                     num_clients=1,
                                                     seed=args.seed),
                        target_domain=None, seed=args.seed)
  # The statistics of the whole dataset, as the offline runs normalize.
  mean, std = assemble.normalization(cfg, dataset, fed)
  model = assemble.make_model(cfg, fed, mean, std)
  cfg.client.optimizer, cfg.client.lr = "adam", 1e-3
  alg = assemble.algorithm("central", model, fed.num_clients, cfg, data=fed)
  run_cfg = dataclasses.replace(assemble.engine_config(cfg), rounds=args.epochs,
                                epochs=1, batch_size=128, eval_every=1,
                                cohort_size=0)
  res = engine.run(alg, fed, model, run_cfg)
  print(f"held-out accuracy on {args.domain}: {res.final['id_acc']:.3f}")
  params = alg.server.eval_params(res.server, res.clients)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  np.savez(args.out, **vit_weights.to_layout(params, "augreg"))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
