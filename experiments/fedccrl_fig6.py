"""Fig. 6 of FedCCRL: sensitivity to the upload ratio r (this file's grid), and
to lambda1 (with lambda2 = 1) and lambda2 (with lambda1 = 0.1), 6 clients.

    fedjax-dg sweep --config experiments/fedccrl_fig6.py          # r
    fedjax-dg sweep --config experiments/fedccrl_fig6.py \
        --grid fedccrl.r=0.1 --grid fedccrl.lambda1=0.01,0.05,0.1,0.5,1.0 \
        --set fedccrl.lambda2=1.0                                  # lambda1
    fedjax-dg sweep --config experiments/fedccrl_fig6.py \
        --grid fedccrl.r=0.1 --grid fedccrl.lambda2=0.01,0.05,0.1,0.5,1.0 \
        --set fedccrl.lambda1=0.1                                  # lambda2

(each with --set model.weights=... --set model.skip_head=True). The paper's
figure gives no exact grid values in its text: these are our choice.
Protocol and costs: fedjax_dg/run/configs/fedccrl_protocol.py.
"""

from fedjax_dg.run.configs.fedccrl_protocol import get_config as _protocol

SWEEP = dict(grid={"fedccrl.r": (0.01, 0.05, 0.1, 0.2, 0.5)}, seeds=(0, 1, 2))


def get_config():
  c = _protocol("fedccrl_fig6")
  c.algorithms = ("fedccrl",)
  return c
