"""The config: locked, one source of defaults, unknown keys named with the closest."""

import dataclasses
import inspect
import textwrap

import pytest

from fedjax_dg import algorithms, engine
from fedjax_dg.data import partition, settings
from fedjax_dg.run import assemble, checks, config, experiment, presets
from fedjax_dg.report.records import split_settings


def _experiment(tmp_path, body: str) -> str:
  path = tmp_path / "exp.py"
  path.write_text("from fedjax_dg.run.config import base_config\n\n"
                  "def get_config():\n  c = base_config()\n"
                  + textwrap.indent(textwrap.dedent(body), "  ") + "  return c\n")
  return str(path)


@pytest.mark.parametrize("line,key,guess", [
    ("c.train.round = 3", "round", "rounds"),
    ("c.fedavg.client.learning_rate = 0.5", "learning_rate", "lr"),
    ("c.trian.rounds = 3", "trian", "train"),
    ("c.hfedf.emma_decay = 0.9", "emma_decay", "ema_decay"),
])
def test_unknown_key_in_an_experiment_file_names_it_and_the_closest(
    tmp_path, line, key, guess):
  path = _experiment(tmp_path, line + "\n")
  with pytest.raises(config.ConfigError) as e:
    config.load(path)
  msg = str(e.value)
  assert path in msg and repr(key) in msg and repr(guess) in msg, msg


def test_wrong_type_in_an_experiment_file_is_a_config_error(tmp_path):
  with pytest.raises(config.ConfigError, match="rounds"):
    config.load(_experiment(tmp_path, "c.train.rounds = 'many'\n"))


@pytest.mark.parametrize("item,needle", [
    ("train.round=3", "did you mean 'train.rounds'"),
    ("fedavg.client.learning_rate=0.5", "did you mean 'fedavg.client.lr'"),
    ("trian.rounds=3", "did you mean 'train'"),
    ("hfedf.wd=1e-3", "unknown config key 'hfedf.wd'"),
    ("train.rounds=abc", "expected int like 200, got 'abc'"),
    ("train=3", "'train' is a section"),
    ("train.rounds.x=1", "not a section"),
    ("rounds", "--set expects key=value"),
])
def test_unknown_or_mistyped_set_is_a_config_error(item, needle):
  with pytest.raises(config.ConfigError, match=needle.replace("(", r"\(")):
    config.apply_overrides(config.base_config(), [item])


def test_overrides_take_the_fields_types_and_none_fields_take_literals():
  c = config.apply_overrides(config.base_config(), [
      "train.rounds=7", "client.lr=1", "data.targets=0,15", "algorithms=fedavg,moon",
      "fedprox.client.lr=0.01", "hfedf.ema=False"])
  assert c.train.rounds == 7 and c.client.lr == 1.0
  assert isinstance(c.client.lr, float)
  assert c.data.targets == "0,15"  # strings stay verbatim
  assert c.algorithms == ("fedavg", "moon")
  assert c.fedprox.client.lr == 0.01 and c.hfedf.ema is False


def test_client_override_of_the_wrong_type_is_an_error():
  c = config.base_config()
  c.fedavg.client.lr = "fast"  # a None field takes any value...
  with pytest.raises(ValueError, match="client override lr='fast'"):
    assemble.client_optimizer(c, "fedavg")  # ...and is checked where read


def test_defaults_have_one_source(monkeypatch):
  """The algorithm sections ARE `build`'s keyword defaults, and `train` IS
  EngineConfig: changing the factory's default changes the config."""
  c = config.base_config()
  for section in algorithms.modules():
    got = {k: v for k, v in c[section].items() if k != "client"}
    assert got == algorithms.hyperparameters(section), section
  fields = {f.name: f.default for f in dataclasses.fields(engine.EngineConfig)}
  for key, value in c.train.items():
    if key != "keep_checkpoints":
      assert fields[key] == value, key
  # One source: the config follows the signature (unwrap: under mutation
  # testing `build` is mutmut's wrapper, docs/testing.md).
  build = inspect.unwrap(algorithms.spec("fedprox").module.build)
  monkeypatch.setattr(build, "__kwdefaults__", dict(build.__kwdefaults__, mu=0.5))
  assert config.base_config().fedprox.mu == 0.5
  # ... and the engine's dataclass.
  assert assemble.engine_config(config.base_config()) == engine.EngineConfig(
      seed=0, **{k: v for k, v in c.train.items() if k != "keep_checkpoints"})


def test_the_data_defaults_are_declared_once():
  """The `data` section IS `DataConfig` (fields, values, types);
  `PartitionSpec`'s split settings and the scenario presets' defaults are
  DataConfig's too, under the same names."""
  want = {f.name: f.default for f in dataclasses.fields(settings.DataConfig)}
  got = config.base_config().data.to_dict()
  assert {k: (v, type(v)) for k, v in got.items()} == {
      k: (v, type(v)) for k, v in want.items()}
  spec = partition.PartitionSpec(num_clients=2)
  assert spec.name == want["partition"]
  for key in ("d", "alpha", "min_partition_size", "few_shot_k"):
    assert getattr(spec, key) == want[key], key
  for key in ("num_clients", "k_per_domain"):  # the config's names
    assert key in {f.name for f in dataclasses.fields(partition.PartitionSpec)}
  for path in presets.SCENARIO_FIELDS:
    section, leaf = path.split(".")
    assert presets._default(path) == config.base_config()[section][leaf], path


def test_config_py_writes_no_algorithm_default():
  """No algorithm section is typed into config.py (they come from `build`)."""
  source = inspect.getsource(config)
  for section in algorithms.modules():
    assert f"c.{section} = " not in source and f"c[\"{section}\"]" not in source


def test_every_section_is_known_to_the_tables():
  """A grid key of any registered algorithm's section never splits FedAvg's
  rows (the registry, not a hand-kept list, says what a section is)."""
  for section in algorithms.modules():
    own, general = split_settings("fedavg", {f"{section}.x": "1"})
    assert general == {}, section
    assert (own == {"fedavg.x": "1"}) == (section == "fedavg")


SCENARIO_FILE = """
from fedjax_dg.run.config import base_config

def get_config():
  c = base_config()
  c.scenario = "extreme"
  c.data.alpha = 0.5          # = base_config's default, given explicitly
  return c
"""


def test_a_value_the_scenario_would_replace_is_refused_on_every_path(tmp_path):
  """scenario=extreme sets data.alpha=0.1: an alpha given explicitly, even
  the base default 0.5, is an error from a config file and from Python, never
  silently replaced (`config.explicit`)."""
  import copy
  import pickle
  from fedjax_dg.run import presets
  from fedjax_dg.errors import ConfigError
  needle = r"sets data\.alpha=0\.1, but data\.alpha=0\.5 was given too"
  path = tmp_path / "extreme.py"
  path.write_text(SCENARIO_FILE)
  from_file = config.load(str(path))
  with pytest.raises(ConfigError, match=needle):
    checks.validate(from_file)
  cfg = config.base_config()  # the Python API
  cfg.scenario = "extreme"
  cfg.data.alpha = 0.5
  for c in (cfg, copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg)),
            cfg.copy_and_resolve_references()):  # copies keep the record
    with pytest.raises(ConfigError, match=needle):
      presets.resolve_scenario(c)
  with pytest.raises(ConfigError, match=needle):  # before any data or directory
    experiment.run(cfg, run_dir=str(tmp_path / "never"))
  assert not (tmp_path / "never").exists()
  # Not given (or given the scenario's own value): the scenario's values.
  cfg = config.base_config()
  cfg.scenario = "extreme"
  cfg.train.cohort_size = 20
  resolved = assemble.resolve(cfg)
  assert (resolved.data.num_clients, resolved.train.cohort_size,
          resolved.data.alpha) == (100, 20, 0.1)
  assert assemble.resolve(resolved).data.alpha == 0.1  # idempotent
  assert config.explicit(config.base_config().data) == frozenset()


def test_client_schedule_wraps_any_algorithms_optimizer_or_is_refused():
  """`client.schedule="cosine"` (run-wide or per section) makes the clients'
  optimizer a schedule over the run; FedCCRL has it by default (Sec. 4.2),
  FedAvg not; an unknown schedule, and an algorithm whose wrapper would drop
  the run's progress (FedSAM's SAM step), are ConfigErrors."""
  from conftest import synthetic_federation
  from fedjax_dg import models
  from fedjax_dg.client.update import RunProgress
  c = config.base_config()
  assert isinstance(assemble.client_optimizer(c, "fedccrl"), RunProgress)
  assert not isinstance(assemble.client_optimizer(c, "fedavg"), RunProgress)
  c.fedccrl.client.schedule = "constant"
  assert not isinstance(assemble.client_optimizer(c, "fedccrl"), RunProgress)
  c.client.schedule = "cosine"
  assert isinstance(assemble.client_optimizer(c, "fedavg"), RunProgress)
  fed = synthetic_federation(num_clients=2, per_domain=8)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, hidden=4)
  assert isinstance(assemble.algorithm("fedprox", model, 2, c).client.optimizer,
                    RunProgress)
  with pytest.raises(ValueError, match="fedsam: client.schedule='cosine'"):
    assemble.algorithm("fedsam", model, 2, c)
  c.client.schedule = "linear"
  with pytest.raises(ValueError, match=r"schedule='linear'.*'constant', 'cosine'"):
    assemble.client_optimizer(c, "fedavg")


@pytest.mark.parametrize("value", ["0", "-3", "None"])
def test_image_size_must_be_a_positive_side(value):
  """data.image_size=0 once meant "the stored size", silently (`or None`);
  0, a negative side or None is refused, naming the field and what to give."""
  cfg = config.apply_overrides(config.base_config(), [
      f"data.image_size={value}", "algorithms=fedavg", "model.name=mlp"])
  with pytest.raises(config.ConfigError, match=rf"data.image_size={value}: "
                     "must be a positive side in pixels.*e.g. 28"):
    checks.validate(cfg)
  if value != "None":  # no path skips it (None: the Python API's native size)
    with pytest.raises(ValueError, match="image_size"):
      assemble.load_dataset(cfg)
