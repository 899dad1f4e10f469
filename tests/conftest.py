"""Shared fixtures: a small synthetic multi-domain dataset that models can learn."""

import dataclasses
import os
import shutil
import tempfile

# XLA's backend optimizations off (what flax's own tests do): most tests compile
# a small program once and run it for milliseconds, so compile time is most of
# the suite (1.3-1.4x faster without; docs/testing.md). Numbers move by
# rounding only (the pinned tolerances cover it: `tests/pinned.py --spread`,
# setting "no opt"). Set before jax is imported, so the CLI tests'
# subprocesses inherit it; JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite
# optimized (`make test-all` runs the slow tests so).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# XLA:CPU's newer fusion emitters off where the optimizations are (the default
# suite): at optimization level 0 the elemental emitters compile the suite's
# programs 1.3-2x faster (an MLP run 2.1x, a ViT or a CNN run 1.3x; with the
# optimizations on they are slower, so the slow tests keep the emitters).
# Numbers move by rounding only: every pinned entry stays where "no opt" put
# it (`tests/pinned.py --spread`, docs/testing.md). The tests' own
# subprocesses start with SUITE_XLA_FLAGS (plus their device count).
SUITE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false"
                   if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
                   else "")
if SUITE_XLA_FLAGS and SUITE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS"), SUITE_XLA_FLAGS]))
# For a test of an op whose rounding decides a discrete result (a pixel
# operation equal to PIL's, a sample point on an image's edge): compiled with
# XLA's default emitters, as a user's run compiles it (`jax.jit(f,
# compiler_options=USERS_CODEGEN)`).
USERS_CODEGEN = {"xla_cpu_use_fusion_emitters": True}

# One persistent XLA compilation cache per test session, shared by its
# pytest-xdist workers and the subprocesses they start: tests that build the
# same program (the same algorithm on the same shapes, each run its own jitted
# closures) compile it once. A new directory each session, removed at its end
# (`pytest_unconfigure`), so a session never reads a program an earlier one
# compiled and `make test` on a fresh clone costs what it costs on CI. Set in
# the environment before jax is imported (jax reads JAX_* options from it) and
# as FEDJAX_DG_JAX_CACHE, which `cli.setup_jax` uses in place of .data's cache.
_MADE_CACHE = "FEDJAX_DG_TEST_JAX_CACHE" not in os.environ  # the first process
if _MADE_CACHE:
  os.environ["FEDJAX_DG_TEST_JAX_CACHE"] = tempfile.mkdtemp(
      prefix="fedjax_dg_test_jax_cache_")
for _name in ("JAX_COMPILATION_CACHE_DIR", "FEDJAX_DG_JAX_CACHE"):
  os.environ[_name] = os.environ["FEDJAX_DG_TEST_JAX_CACHE"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest

from fedjax_dg.data import federated, partition
from fedjax_dg.data.dataset import DomainDataset

# CI's time budget for the slow tests (FEDJAX_DG_SLOW_DEADLINE, set by .ci/run).
pytest_plugins = ["slow_budget", "suite_time"]


def synthetic_domains(num_domains=4, per_domain=60, classes=3, size=8, seed=0,
                      shift=25.0, noise=30.0) -> DomainDataset:
  """Class prototypes + a per-domain brightness shift + noise, uint8 [N, size, size, 1]."""
  rng = np.random.default_rng(seed)
  protos = rng.uniform(40, 215, (classes, size, size, 1))
  images, labels, domains = [], [], []
  for d in range(num_domains):
    y = rng.integers(0, classes, per_domain)
    x = protos[y] + shift * d + rng.normal(0, noise, (per_domain, size, size, 1))
    images.append(np.clip(x, 0, 255).astype(np.uint8))
    labels.append(y.astype(np.int32))
    domains.append(np.full(per_domain, d, np.int32))
  return DomainDataset(
      name="synthetic", images=np.concatenate(images), labels=np.concatenate(labels),
      domains=np.concatenate(domains),
      domain_names=tuple(f"dom{d}" for d in range(num_domains)),
      class_names=tuple(f"c{c}" for c in range(classes)))


def synthetic_federation(num_clients=3, d=1, target=0, seed=0, **kw):
  ds = synthetic_domains(seed=seed, **kw)
  spec = partition.PartitionSpec(name="domain_split", num_clients=num_clients,
                                 d=d, seed=seed)
  return federated.build(ds, spec, target_domain=target, seed=seed)


def with_sizes(fed, sizes):
  """`fed` whose client c keeps the first sizes[c] of its training examples
  (unequal clients; the padded width stays)."""
  assert fed.train.x.shape[1] >= max(sizes)
  return dataclasses.replace(fed, packed_train=federated.pack_padded(
      fed.train.replace(n=np.asarray(sizes, np.int32))))


def sgd_in_client_loop(model, stacked, xs, ys, lr, rng=None):
  """Plain SGD on the cross-entropy, lax.map over clients x lax.scan over
  steps (the engine's loop shape), one jitted program: stacked params
  [clients, ...], xs [clients, steps, B, ...], ys [clients, steps, B] ->
  (new params, losses [clients, steps])."""

  def loss(p, x, y):
    logits = model.apply(p, x, train=True, rng=rng)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

  def client(args):
    def step(p, b):
      value, g = jax.value_and_grad(loss)(p, *b)
      return jax.tree.map(lambda a, d: a - lr * d, p, g), value
    return jax.lax.scan(step, args[0], args[1:])

  return jax.jit(lambda *a: jax.lax.map(client, a))(stacked, xs, ys)


def every_algorithm_setup(num_clients=4):
  """A federation and config every registered algorithm builds and runs on
  in seconds: 5 domains of 24 images, a server split (FedDF, FedBE, FedLAW),
  2 server steps, 1 autoencoder epoch (hFedF), CCST's encoder up to relu1_1
  (8x8 images). -> (fed, cfg)."""
  from fedjax_dg.run import config
  fed = federated.build(synthetic_domains(num_domains=5, per_domain=24),
                        partition.PartitionSpec(num_clients=num_clients,
                                                seed=0),
                        target_domain=0, server_fraction=0.2)
  cfg = config.base_config()
  for name in ("feddf", "fedbe", "fedlaw"):
    cfg[name].steps = 2
  cfg.hfedf.autoencoder_epochs = 1
  cfg.ccst.depth = 1
  return fed, cfg


# A ViT small enough for 8x8 test images (2x2 patches of 4x4 pixels).
TINY_VIT = dict(patch=4, dim=16, depth=2, heads=2, mlp_dim=32)


def model_for(name, fed, vit=None, **mlp_fields):
  """The test model of algorithm `name`: a tiny ViT (`vit`: its fields,
  default `TINY_VIT`) for those that run on ViTs only (their module's
  `MODELS`), else an MLP with `mlp_fields`."""
  from fedjax_dg import algorithms, models
  kw = dict(input_shape=fed.image_shape, num_classes=fed.num_classes,
            mean=fed.mean, std=fed.std)
  if getattr(algorithms.spec(name).module, "MODELS", None):
    return models.get_model("vit_tiny", **kw, **(vit or TINY_VIT))
  return models.get_model("mlp", **kw, **mlp_fields)


def tiny_experiment(path, out, algorithms=("hfedf", "fedavg"), targets="0,75",
                    max_per_domain=40) -> str:
  """Writes an experiment file to `path` (Rotated Fashion-MNIST at 16x16,
  `max_per_domain` images per domain, an MLP, 2 rounds of 1 epoch, an
  evaluation each round, no progress bar, a checkpoint after every chunk:
  the resume tests need them) whose runs go to `out`; returns the path. The
  CLI, sweep and metrics-log tests run it."""
  lines = ["from fedjax_dg.run.config import base_config", "",
           "def get_config():", "  c = base_config()", '  c.name = "tiny"',
           f"  c.output_dir = {str(out)!r}",
           f"  c.algorithms = {tuple(algorithms)!r}",
           f"  c.data.max_per_domain = {max_per_domain}",
           "  c.data.image_size = 16", f"  c.data.targets = {targets!r}",
           '  c.model.name = "mlp"', "  c.train.rounds = 2",
           "  c.train.eval_every = 1", "  c.train.epochs = 1",
           "  c.train.batch_size = 16", "  c.train.progress = False",
           "  c.train.checkpoint_every = 0.0", "  return c", ""]
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return str(path)


@pytest.fixture(scope="session")
def fed3():
  return synthetic_federation(num_clients=3)


# Numerical comparisons at float32: on GPUs/TPUs JAX's default matmul/conv
# precision is TF32/bf16 passes (seen on an H100: 4e-3 relative differences in
# the im2col-vs-lax conv test). No effect on CPU.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _jax_devices_before_any_test():
  """Starts JAX in every test process before its first test, so each has the
  backend's default devices (one on CPU) whichever test comes first. Without
  it a process whose first JAX work is a CLI test (`cli.setup_jax`: one CPU
  device per core) ran the rest of its tests sharded over two devices: a
  pytest-xdist worker did, and a float-order-sensitive test changed. Started
  here, not at import: collecting the tests must not start a backend
  (`tests/mutation_report.py --preflight`)."""
  jax.devices()


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  """Removes the session's compilation cache (above), in the process that made
  it (pytest-xdist's workers inherit it and leave it)."""
  if _MADE_CACHE:
    shutil.rmtree(os.environ["FEDJAX_DG_TEST_JAX_CACHE"], ignore_errors=True)
