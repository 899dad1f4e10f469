"""The run side: a config turned into runs, and the directories they write.

    config        the locked ConfigDict (`base_config`), experiment files, `--set`
    presets       hFedF's Table 10 per dataset, HyperGenFL's Table 1 scenarios
    configs/      the packaged configs (`fedjax-dg demo`, the experiments/ files)
    assemble      the config resolved, once, into a run's pieces: engine settings,
                  dataset, federations, model, algorithms
    checks        what a config is checked for before anything is computed
    ignored       a given value that another setting overrides, refused
    directory     run and sweep directories: making one, the files in them
    provenance    what produced a run's numbers: the fedjax_dg commit (dirty or
                  not), the data fingerprint, library versions and machine
    disk          the disk the checkpoints take (the check, `fedjax-dg algorithms`)
    experiment    one config: algorithms x held-out targets, one engine run each
    sweep         grid values x seeds of a config, one run directory per cell
    lock          one sweep per folder: an OS file lock held for the sweep's life
    estimate      `run --estimate`: one measured round per algorithm, the
                  protocol's memory per device, round time and total
    reports       `fedjax-dg report`: a directory's tables, or several compared

The config stops at `assemble`: the engine, the algorithm registry, the data
and the models receive resolved values, never the config. Imports point from
here to `fedjax_dg.report`, never back.
"""
