"""The run side: a config turned into runs, and the directories they write.

    config        the locked ConfigDict (`base_config`), experiment files, `--set`
    presets       hFedF's Table 10 per dataset, HyperGenFL's Table 1 scenarios
    configs/      the packaged configs (`fedjax-dg demo`, the experiments/ files)
    experiment    one config: algorithms x held-out targets, one engine run each
    sweep         grid values x seeds of a config, one run directory per cell

The config stops here: what the engine, the algorithm registry, the data and
the models receive are resolved values, never the config.
"""
