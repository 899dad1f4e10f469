"""Table 1 of FedCCRL, its miniDomainNet columns: accuracy per held-out domain
(clipart, painting, real, sketch) and average, 6 clients (2 per source
domain), 3 seeds.

miniDomainNet is 126 classes of four DomainNet domains listed by Zhou et al.'s
split files (`mini_domainnet`: fedjax_dg/data/builders/mini_domainnet.py says
where to get them and how they are read). The released code resizes its
images to 128x128 (Sec. 4.2) and sets batch 128 for it; everything else is the
protocol of fedjax_dg/run/configs/fedccrl_protocol.py.

    fedjax-dg prepare mini_domainnet --manual-dir /path/to/domainnet
    fedjax-dg sweep --config experiments/fedccrl_table1_mini_domainnet.py \\
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \\
        --set model.skip_head=True
    fedjax-dg report runs/sweep-fedccrl_table1_mini_domainnet-<time>

Cost: 140,006 images x 3 epochs x 10 rounds per held-out domain, at 128 px:
before booking a GPU, estimate it (docs/how-to/paper-protocol-on-a-gpu.md).
"""

from fedjax_dg.run.configs.fedccrl_protocol import get_config as _protocol

SWEEP = dict(seeds=(0, 1, 2))


def get_config():
  c = _protocol("fedccrl_table1_mini_domainnet")
  c.data.name = "mini_domainnet"
  c.data.image_size = 128
  c.train.batch_size = 128
  return c
