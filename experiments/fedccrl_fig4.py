"""Fig. 4 of FedCCRL: average accuracy over the held-out domains against the
number of clients (k clients per source domain; PACS: 3k clients).

The paper's figure gives no exact client counts in its text; k = 1, 2, 4, 6, 8
(3 to 24 clients on PACS) is our choice. Every Table 1 method.

    fedjax-dg sweep --config experiments/fedccrl_fig4.py \
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \
        --set model.skip_head=True
    fedjax-dg report runs/sweep-fedccrl_fig4-<time>

Protocol and costs: fedjax_dg/run/configs/fedccrl_protocol.py.
"""

from fedjax_dg.run.configs.fedccrl_protocol import get_config as _protocol

SWEEP = dict(grid={"data.k_per_domain": (1, 2, 4, 6, 8)}, seeds=(0, 1, 2))


def get_config():
  return _protocol("fedccrl_fig4")
