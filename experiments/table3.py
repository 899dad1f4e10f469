"""Table 3 of the hFedF paper: hFedF without GradAlign, EMA or both, d = 1, 2, 3.

hFedF and its three ablations (algorithms hfedf_no_gradalign, hfedf_no_ema,
hfedf_no_both: the hfedf section with gradalign / ema switched off),
leave-one-domain-out over the six domains, d = 1, 2, 3, three seeds: 9 cells,
216 runs, the papers' protocol (experiments/paper_protocol.py). The report's
table3.md lists each variant with its difference to full hFedF.

    fedjax-dg sweep --config experiments/table3.py --grid data.d=1,2,3 --seeds 0,1,2
    fedjax-dg report runs/sweep-table3-<time>

The same ablation as a grid over the switches (36 cells of one algorithm):
`--set algorithms=hfedf --grid hfedf.gradalign=True,False --grid hfedf.ema=True,False`.

Expected wall-clock: on a 2-core CPU ~170 days (216 runs x ~19 h; not
practical); on one GPU ~1.5 days (an estimate, not measured: ~10 min per run).
At the demo's scale (paper_protocol.BUDGET) ~4 h on a 2-core CPU:

    fedjax-dg sweep --config experiments/table3.py --grid data.d=1,2,3 \
        --seeds 0,1,2 --set model.name=small_cnn --set data.image_size=16 \
        --set data.max_per_domain=800 --set train.epochs=1 --set train.rounds=20 \
        --set train.eval_every=2 --set train.ood_eval_max=0
"""

from fedjax_dg.run.configs.paper_protocol import get_config as _paper

# Real data: the paper's Table 3 is on Office-Home (Table 10: EMA decay 0.75):
#   --set data.name=office_home --set data.manual_dir=/path/to/OfficeHome
#   --set hfedf.ema_decay=0.75
SWEEP = dict(grid={"data.d": (1, 2, 3)}, seeds=(0, 1, 2))


def get_config():
  c = _paper("table3")
  c.algorithms = ("hfedf", "hfedf_no_gradalign", "hfedf_no_ema", "hfedf_no_both")
  return c
