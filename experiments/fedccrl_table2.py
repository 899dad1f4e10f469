"""Table 2 of FedCCRL: ablations of CCDT, DIFP, L_RA (lambda1) and L_JS (lambda2),
6 clients, r = 0.1.

The grid is the full 2 x 2 x 2 x 2 product: its 12 cells with CCDT or DIFP on
are Table 2's rows; the 4 with both off (no augmented view differs from the
original) are extra.

    fedjax-dg sweep --config experiments/fedccrl_table2.py \
        --set model.weights=/path/to/mobilenet_v3_large-8738ca79.pth \
        --set model.skip_head=True
    fedjax-dg report runs/sweep-fedccrl_table2-<time>

Other datasets: --set data.name=office_home. Protocol and costs:
fedjax_dg/run/configs/fedccrl_protocol.py.
"""

from fedjax_dg.run.configs.fedccrl_protocol import get_config as _protocol

SWEEP = dict(grid={"fedccrl.ccdt": (True, False), "fedccrl.difp": (True, False),
                   "fedccrl.lambda1": (0.0, 0.1),
                   "fedccrl.lambda2": (0.0, 0.1)},
             seeds=(0, 1, 2))


def get_config():
  c = _protocol("fedccrl_table2")
  c.algorithms = ("fedccrl",)
  return c
