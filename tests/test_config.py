"""The config: locked, one source of defaults, unknown keys named with the closest."""

import dataclasses
import inspect
import textwrap

import pytest

from fedjax_dg import algorithms, config, engine, experiment, tables


def _experiment(tmp_path, body: str) -> str:
  path = tmp_path / "exp.py"
  path.write_text("from fedjax_dg.config import base_config\n\n"
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
    algorithms.client_optimizer(c, "fedavg")  # ...and is checked where read


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
  assert experiment.engine_config(config.base_config()) == engine.EngineConfig(
      seed=0, **{k: v for k, v in c.train.items() if k != "keep_checkpoints"})


def test_config_py_writes_no_algorithm_default():
  """No algorithm section is typed into config.py (they come from `build`)."""
  source = inspect.getsource(config)
  for section in algorithms.modules():
    assert f"c.{section} = " not in source and f"c[\"{section}\"]" not in source


def test_every_section_is_known_to_the_tables():
  """A grid key of any registered algorithm's section never splits FedAvg's
  rows (the registry, not a hand-kept list, says what a section is)."""
  for section in algorithms.modules():
    own, general = tables.split_settings("fedavg", {f"{section}.x": "1"})
    assert general == {}, section
    assert (own == {"fedavg.x": "1"}) == (section == "fedavg")
