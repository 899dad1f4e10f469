"""Checks of a config that need no data, run before anything is computed or
any directory is made: names (algorithms, dataset, model), value ranges,
engine settings, and every algorithm's settings on a stand-in model
(`assemble.check_algorithms`)."""

from __future__ import annotations

from fedjax_dg import algorithms, models
from fedjax_dg.data import lookup, registry, streamed
from fedjax_dg.errors import ConfigError
from fedjax_dg.run import assemble, ignored
from fedjax_dg.run.config import ConfigDict

# The largest seed with its own random stream (`jax.random.key` keeps 32 bits).
MAX_SEED = 2**32 - 1


def validate(cfg: ConfigDict) -> None:
  """Checks settings that need no data, before any compute."""
  cfg = assemble.resolve(cfg)
  seed = cfg.seed
  if not 0 <= seed <= MAX_SEED:
    raise ConfigError(
        f"invalid setting seed={seed!r}: allowed values are integers 0 .. "
        f"{MAX_SEED} (2**32 - 1): JAX's random keys keep a seed's low 32 "
        "bits, so a larger seed would repeat a smaller one's draws (2**32 + 5 "
        "is seed 5), and the data's numpy generators refuse a negative one")
  algs = tuple(cfg.algorithms)
  if not algs:
    raise ConfigError("algorithms is empty: name at least one of "
                     f"{algorithms.available()}")
  for a in algs:
    if a not in algorithms.available():
      raise ConfigError(f"unknown algorithm {a!r} in algorithms; allowed: "
                       f"{algorithms.available()}")
  ignored.check(cfg)   # a client field a module's CLIENT would override
  known = registry.available(cfg.data.data_dir or None)
  if not cfg.data.name:
    raise ConfigError(f"data.name is not set: name a dataset, one of {known}, "
                      "e.g. the NAME of your `fedjax-dg prepare folder "
                      "--manual-dir DIR --name NAME` (--set data.name=NAME)")
  if cfg.data.name not in known:
    raise ConfigError(f"unknown dataset data.name={cfg.data.name!r}; allowed: "
                      f"{known}. "
                      + lookup.where_to_find(cfg.data.name,
                                             cfg.data.data_dir or None))
  size = cfg.data.image_size
  if not isinstance(size, int) or isinstance(size, bool) or size < 1:
    raise ConfigError(
        f"data.image_size={size!r}: must be a positive side in "
        "pixels (every image is resized to image_size x image_size; there is "
        "no native-size setting: give the stored size, e.g. 28 for "
        "Fashion-MNIST)")
  if cfg.model.name not in models.available():
    raise ConfigError(f"unknown model model.name={cfg.model.name!r}; allowed: "
                     f"{models.available()}")
  models.check_weights(cfg.model.name, cfg.model.weights)
  assemble.model_fields(cfg)
  assemble.model_dtype(cfg)
  for a in algs:
    runs_on = algorithms.spec(a).models
    if runs_on and cfg.model.name not in runs_on:
      raise ConfigError(f"{a} runs on model.name one of {runs_on}, not "
                        f"{cfg.model.name!r} (--set model.name={runs_on[-1]})")
  if cfg.data.normalization not in assemble.NORMALIZATIONS:
    raise ConfigError(f"data.normalization={cfg.data.normalization!r}: allowed "
                     f"{assemble.NORMALIZATIONS}")
  frac = cfg.data.server_fraction
  if not 0 <= frac < 1:
    raise ConfigError(f"data.server_fraction={frac!r}: allowed [0, 1) (the share "
                     "of the source examples held by the server; 0 = none)")
  needy = [a for a in algs if algorithms.needs_server_data(a)]
  if needy and frac == 0:
    raise ConfigError(
        f"{', '.join(needy)} train(s) on the server's split, but "
        "data.server_fraction=0 gives the server none: set data.server_fraction "
        "> 0 (e.g. --set data.server_fraction=0.02, FedLAW's proxy share)")
  if cfg.data.num_clients < 0:
    raise ConfigError(f"data.num_clients={cfg.data.num_clients}: allowed values "
                     "are 0 (one client per source domain) or a positive count")
  assemble.engine_config(cfg).validate(cfg.data.num_clients or None)
  if cfg.data.streaming not in streamed.STREAMING:
    raise ConfigError(f"data.streaming={cfg.data.streaming!r}: allowed "
                      f"{streamed.STREAMING} (auto: stream when the images would "
                      f"take more than {streamed.AUTO_STREAM_SHARE:.0%} of the "
                      "host's memory)")
  probes = assemble.check_algorithms(cfg)
  if cfg.data.streaming == "on":
    assemble.check_streaming(cfg, probes)
