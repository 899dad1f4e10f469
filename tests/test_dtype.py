"""`model.dtype`: bfloat16 compute, float32 parameters and optimizer state.

(a) with "bfloat16" every matmul / convolution of a forward pass reads
    bfloat16 operands (read from its jaxpr, nested programs included,
    through the shape ops between) -- except, under the CPU policy of the
    models that keep float32 activations on a CPU (`MIXED_ON_CPU`,
    `layers.matmul`), exactly those whose shapes are off the matrix units
    (`layers.on_matrix_units`), which are float32 -- while logits, features
    and the heads' outputs are float32, and a training step leaves float32
    parameters, gradients and optimizer state;
(b) FedAvg and hFedF in bfloat16 track their float32 runs on the tests'
    small synthetic federation, within the tolerances measured here
    (`TRACKING`), and are not the float32 runs (a silently ignored dtype
    would give bit-identical ones);
(c) any other dtype is a ConfigError naming the field and the allowed values;
(d) `layers.bf16_matmul`'s backward pass is the gradient of the matmul of
    its rounded operands, and on the CPU its dots compile to bfloat16 ones
    (no float32 upcast of their operands);
(e) bfloat16 replicas (`run_replicas`, mapped or vmapped) are their
    separate bfloat16 runs within `BF16_REPLICA` (what bfloat16 changes in
    tests/test_replicas.py's tolerances).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_domains
from fedjax_dg import engine, models
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.runner import run_replicas
from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers
from fedjax_dg.models.fedadg import FedADGNets
from fedjax_dg.models.fedsr import ProbabilisticModel
from fedjax_dg.models.moon import ContrastiveModel
from fedjax_dg.run import assemble, config

# Every registered model, at sizes that trace in well under a second.
TINY = {
    "inception_cnn": ((16, 16, 3), {}),
    "small_cnn": ((8, 8, 1), {}),
    "mlp": ((8, 8, 1), {}),  # fc1 64 -> 32: on the matrix units
    "cifar_cnn": ((16, 16, 3), {}),
    "resnet50": ((8, 8, 3), dict(stages=(1, 1), width=8, norm_groups=4)),
    "mobilenet_v3_large": ((32, 32, 3), {}),
    "vit_b16": ((8, 8, 3), dict(patch=4, dim=16, depth=1, heads=2,
                                mlp_dim=16)),
    "vit_tiny": ((8, 8, 3), dict(patch=4, dim=16, depth=1, heads=2,
                                 mlp_dim=16)),
}
COMPUTE = ("dot_general", "conv_general_dilated")


# Ops that move values without arithmetic: their output has the precision of
# their inputs.
_SHAPE_OPS = {"reshape", "pad", "slice", "concatenate", "transpose",
              "broadcast_in_dim", "squeeze", "expand_dims", "rev", "copy",
              "convert_element_type", "dynamic_slice"}


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own
      if hasattr(sub, "eqns"):
        yield sub


def _mkn(eqn) -> tuple[int, int, int]:
  """(m, k, n) of a matmul / convolution equation as one matmul: rows,
  contraction, columns."""
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  out = eqn.outvars[0].aval.shape
  if eqn.primitive.name == "conv_general_dilated":  # NHWC, HWIO
    return math.prod(out[:-1]), math.prod(rhs[:-1]), rhs[-1]
  (lc, _), _ = eqn.params["dimension_numbers"]
  k = math.prod(lhs[d] for d in lc)
  return math.prod(lhs) // k, k, math.prod(rhs) // k


def _operand_precisions(jaxpr, inputs, found):
  """Appends to `found` (the operand precision: "bfloat16" or dtype names,
  (m, k, n)) of every matmul / convolution in `jaxpr` and the programs
  nested in it;
  `inputs`: the precision of each of `jaxpr`'s inputs. A value is of
  bfloat16 precision when it is bfloat16, `reduce_precision` to bfloat16's
  8 exponent and 7 mantissa bits, or moved by shape ops from such values.
  Returns the precision of each of `jaxpr`'s outputs."""
  prec = dict(zip(jaxpr.invars, inputs))

  def of(v):
    if hasattr(v, "val"):  # a Literal (the pads' zeros): exact
      return "bfloat16"
    return prec.get(v, str(v.aval.dtype))

  for eqn in jaxpr.eqns:
    ins = [of(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in COMPUTE:
      found.append(("bfloat16" if set(ins) == {"bfloat16"} else
                    "/".join(sorted(set(ins))), _mkn(eqn)))
    subs = [sub for sub in _sub_jaxprs(eqn) if len(sub.invars) == len(ins)]
    outs = [_operand_precisions(sub, ins, found) for sub in subs]
    if len(subs) == 1 and len(outs[0]) == len(eqn.outvars):  # a call
      prec.update(zip(eqn.outvars, outs[0]))
      continue
    for out in eqn.outvars:
      if str(out.aval.dtype) == "bfloat16" or (
          name == "reduce_precision" and eqn.params["exponent_bits"] == 8
          and eqn.params["mantissa_bits"] == 7):
        prec[out] = "bfloat16"
      elif name in _SHAPE_OPS and ins and set(ins) == {"bfloat16"}:
        prec[out] = "bfloat16"
      else:
        prec[out] = str(out.aval.dtype)
  return [of(v) for v in jaxpr.outvars]


def compute_ops(fn, *args) -> tuple[list, set[str]]:
  """([(operand precision, (m, k, n)) of every matmul / convolution
  `fn(*args)` runs], the dtypes of what it returns), from one trace."""
  closed = jax.make_jaxpr(fn)(*args)
  found = []
  _operand_precisions(closed.jaxpr,
                      [str(v.aval.dtype) for v in closed.jaxpr.invars], found)
  return found, {str(a.dtype) for a in closed.out_avals}


def compute_dtypes(fn, *args) -> tuple[set[str], set[str]]:
  """(the operand precisions of every matmul / convolution `fn(*args)`
  runs, the dtypes of what it returns)."""
  ops, out = compute_ops(fn, *args)
  return {p for p, _ in ops}, out


def check_bf16(fn, *args, mixed: bool, some: bool = True):
  """`fn(*args)` returns float32 and its matmuls / convolutions read
  bfloat16 operands; with `mixed` (the CPU policy), exactly those on the
  matrix units do, the others float32, and (`some`) at least one does."""
  ops, out = compute_ops(fn, *args)
  assert out == {"float32"}, out
  if not mixed:
    assert {p for p, _ in ops} == {"bfloat16"}, ops
    return
  want = [("bfloat16" if layers.on_matrix_units(*mkn) else "float32", mkn)
          for _, mkn in ops]
  assert ops == want, (ops, want)
  assert not some or any(p == "bfloat16" for p, _ in ops), ops


def dtypes(tree) -> set[str]:
  return {str(leaf.dtype) for leaf in jax.tree.leaves(tree)}


def tiny(name, dtype):
  shape, kw = TINY[name]
  return models.get_model(name, input_shape=shape, num_classes=3, dtype=dtype,
                          **kw)


def _mixed(model) -> bool:
  """Whether `model` computes under the CPU policy here."""
  return (getattr(model.module, "MIXED_ON_CPU", False)
          and layers.mixed_on_cpu(model.dtype))


@pytest.mark.parametrize("name", models.available())
def test_bf16_forward_computes_in_bf16_and_returns_float32(name):
  assert set(TINY) == set(models.available())  # a new model is listed here
  def forward(model):  # a new function each time: traces are cached by it
    return lambda p, v: (model.apply(p, v), model.features(p, v))

  model = tiny(name, "float32")
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jnp.zeros((16,) + model.input_shape, jnp.uint8)
  assert compute_dtypes(forward(model), params, x) == ({"float32"},
                                                       {"float32"})
  model = tiny(name, "bfloat16")
  assert dtypes(params) == {"float32"}
  check_bf16(forward(model), params, x, mixed=_mixed(model))
  feats = jax.ShapeDtypeStruct((16, params[model.head_name]["kernel"].shape[0]),
                               jnp.float32)
  # A 3-class head is off the matrix units: float32 under the CPU policy.
  check_bf16(model.head, params, feats, mixed=_mixed(model), some=False)
  assert _mixed(model) == (name in ("inception_cnn", "small_cnn", "mlp",
                                    "cifar_cnn"))


def test_bf16_heads_compute_in_bf16_and_return_float32():
  model = tiny("small_cnn", "bfloat16")
  x = jnp.zeros((16,) + model.input_shape, jnp.uint8)
  y = jnp.zeros((16,), jnp.int32)
  prob, moon, adg = (ProbabilisticModel(model), ContrastiveModel(model),
                     FedADGNets(model))
  outs = {
      "fedsr": (prob.init, lambda p: prob.distribution(p, x)),
      "moon": (moon.init, lambda p: moon.forward(p, x)),
      "fedadg": (adg.init, lambda p: adg.discriminate(
          p["disc"], adg.generate(p["gen"], adg.noise(jax.random.key(1), 16),
                                  y), y)),
  }
  for what, (init, fn) in outs.items():
    params = jax.eval_shape(init, jax.random.key(0))
    assert dtypes(params) == {"float32"}, what
    check_bf16(fn, params, mixed=_mixed(model))


def test_bf16_step_keeps_float32_params_grads_and_adam_state():
  model = tiny("small_cnn", "bfloat16")
  params = model.init(jax.random.key(0))
  opt = optax.adamw(1e-3, weight_decay=1e-4)
  x = jax.random.randint(jax.random.key(1), (4,) + model.input_shape, 0, 255
                         ).astype(jnp.uint8)
  y = jnp.arange(4) % 3

  @jax.jit
  def step(p, state):
    loss = lambda q: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(q, x), y).mean()
    value, grads = jax.value_and_grad(loss)(p)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, grads, value

  new, state, grads, value = step(params, opt.init(params))
  assert dtypes(new) == dtypes(grads) == {"float32"}
  assert dtypes(state) <= {"float32", "int32"}  # int32: Adam's step count
  assert value.dtype == jnp.float32 and np.isfinite(value)
  assert not jax.tree.all(jax.tree.map(np.array_equal, new, params))


# ---------------------------------------------------------------------------
# (b) A bf16 run tracks the float32 run.

# Measured on this federation and these runs (4 rounds of an MLP, Adam at
# 1e-2; XLA:CPU, so the CPU policy: fc1's 64 -> 32 matmul in bfloat16, the
# head float32): bfloat16 vs float32, the evaluated parameters' relative L2
# distance / the largest id or ood accuracy difference / the largest
# relative per-round loss difference:
#   FedAvg  1.8e-2 / 0.0 points / 3.4e-3
#   hFedF   8.3e-2 / 0.3 points / 2.9e-2
# Bounds: ~3x the parameters', ~1.7x hFedF's losses' (~15x FedAvg's), 4 target
# examples' accuracy
# (docs/models.md, "Mixed precision").
TRACKING = {"params": 0.25, "acc": 0.05, "loss": 0.05}


def _federation():
  ds = synthetic_domains(num_domains=5, per_domain=80, classes=4, size=8,
                         noise=140, seed=1)
  spec = partition.PartitionSpec(name="domain_split", num_clients=4, d=1,
                                 seed=1)
  return federated.build(ds, spec, target_domain=0, seed=1)


def _setup(name, fed, dtype):
  """(the algorithm, its model, the engine config) of a tracking run."""
  cfg = config.base_config()
  cfg.client.lr = 1e-2
  cfg.hfedf.server_lr = 1e-2
  cfg.hfedf.ema_warmup = 2
  cfg.model.dtype = dtype
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, dtype=assemble.model_dtype(cfg))
  alg = assemble.algorithm(name, model, fed.num_clients, cfg, data=fed)
  ecfg = engine.EngineConfig(rounds=4, eval_every=4, epochs=1, batch_size=8,
                             cohort_size=3, client_mapping="map", seed=3,
                             progress=False, eval_batch_size=16)
  return alg, model, ecfg


def _run(name, fed, dtype):
  alg, model, ecfg = _setup(name, fed, dtype)
  res = engine.run(alg, fed, model, ecfg)
  params = jax.device_get(alg.server.eval_params(res.server, res.clients))
  return params, res


def tracking(name, fed) -> dict:
  """How far the bfloat16 run of `name` is from its float32 run: params (the
  evaluated parameters' relative L2 distance), acc (the largest id / ood
  accuracy difference), loss (the largest relative per-round loss
  difference); and `identical` (bit for bit)."""
  (p32, r32), (p16, r16) = _run(name, fed, "float32"), _run(name, fed,
                                                           "bfloat16")
  assert dtypes(p16) == {"float32"}  # master parameters stay float32
  a, b = (np.concatenate([np.ravel(v) for v in jax.tree.leaves(p)])
          for p in (p32, p16))
  l32, l16 = (np.asarray(r.round_metrics["loss"]) for r in (r32, r16))
  assert np.isfinite(b).all() and np.isfinite(l16).all()
  return dict(
      params=float(np.linalg.norm(a - b) / np.linalg.norm(a)),
      acc=max(abs(r32.final[k] - r16.final[k]) for k in ("id_acc", "ood_acc")),
      loss=float(np.max(np.abs(l16 - l32) / np.abs(l32))),
      identical=bool(np.array_equal(a, b)))


# hFedF's pair of runs (~11 s) is slow: the default suite keeps FedAvg's.
@pytest.mark.parametrize("name", ["fedavg", pytest.param(
    "hfedf", marks=pytest.mark.slow)])
def test_bf16_run_tracks_float32_run(name):
  got = tracking(name, _federation())
  print(name, got)
  assert not got["identical"], "bfloat16 gave the float32 run: ignored?"
  for part, bound in TRACKING.items():
    assert got[part] <= bound, (part, got)


# ---------------------------------------------------------------------------
# (c) Anything else is an error.


@pytest.mark.parametrize("bad", ["float16", "bf16", "fp32", ""])
def test_other_dtypes_are_config_errors(bad):
  cfg = config.base_config()
  cfg.model.dtype = bad
  with pytest.raises(ConfigError, match=r"model\.dtype.*float32.*bfloat16"):
    assemble.model_dtype(cfg)
  with pytest.raises(ConfigError, match=r"model\.dtype"):
    models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2, dtype=bad)


def test_auto_is_bfloat16_on_accelerators_and_float32_on_cpu():
  """model.dtype="auto" per backend, and what a run's model computes in:
  float32 on the CPU the suite runs on (its bfloat16 round is slower)."""
  from fedjax_dg.models import layers
  assert layers.auto_dtype("cpu")[0] == "float32"
  for backend in ("gpu", "cuda", "tpu"):
    assert layers.auto_dtype(backend)[0] == "bfloat16", backend
  cfg = config.base_config()
  cfg.model.dtype = "auto"
  assert jax.default_backend() == "cpu"
  assert assemble.model_dtype(cfg) == "float32"


# ---------------------------------------------------------------------------
# (d) The mixed matmul's own gradient, and its dots on the CPU.


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32),
                    np.float64)


def test_bf16_matmul_value_and_gradients_are_those_of_its_rounded_operands():
  """Against a float64 numpy matmul of the bfloat16-rounded operands (and
  of the rounded cotangent, in the backward pass): bfloat16 products are
  exact in float32, so only float32 accumulation separates them."""
  from fedjax_dg.models import layers
  ka, kb, kg = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(ka, (96, 80))
  b = jax.random.normal(kb, (80, 48))
  g = jax.random.normal(kg, (96, 48))
  out, vjp = jax.vjp(layers.bf16_matmul, a, b)
  da, db = vjp(g)
  assert out.dtype == da.dtype == db.dtype == jnp.float32
  ra, rb, rg = _bf16(a), _bf16(b), _bf16(g)
  for got, want in ((out, ra @ rb), (da, rg @ rb.T), (db, ra.T @ rg)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5,
                               atol=1e-4)
  # Not the float32 matmul: the rounding is there.
  assert np.abs(np.asarray(out) - np.asarray(a @ b)).max() > 1e-3


def _has_amx() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return "amx_bf16" in f.read()
  except OSError:
    return False


@pytest.mark.skipif(jax.default_backend() != "cpu" or not _has_amx(),
                    reason="XLA:CPU's bfloat16 dots on AMX")
def test_bf16_matmul_dots_compile_to_bfloat16_dots_on_amx():
  """The forward dot and both backward dots of `bf16_matmul` keep bfloat16
  operands in the compiled program: XLA:CPU upcasts a dot's operands to
  float32 (4x slower here) where one is a plain transpose, which is why the
  backward pass transposes with `_row_major_t`."""
  from fedjax_dg.models import layers
  a = jax.ShapeDtypeStruct((256, 96), jnp.float32)
  b = jax.ShapeDtypeStruct((96, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((256, 64), jnp.float32)
  fn = jax.value_and_grad(
      lambda a, b, w: jnp.sum(jnp.sin(layers.bf16_matmul(a, b)) * w), (0, 1))
  text = jax.jit(fn).lower(a, b, w).compile().as_text()
  # Each computation (a fusion's body or the entry) with a dot: its
  # parameters are what the dot reads.
  dots = []
  for block in text.split("\n\n"):
    if " dot(" in block:
      params = [ln.split("=")[1].split()[0] for ln in block.splitlines()
                if " parameter(" in ln]
      dots.append(params)
  assert len(dots) == 3, text
  for params in dots:
    assert params and all(p.startswith("bf16[") for p in params), (params,
                                                                   text)


# ---------------------------------------------------------------------------
# (e) Replicas in bfloat16.

# A replica's program differs from its run alone's (its values are
# arguments; vmapped, its sums are ordered otherwise), so float32 runs
# differ by float rounding: up to 1e-6 mapped, 1e-4 vmapped
# (tests/test_replicas.py). bfloat16 operands magnify such a difference
# where it moves a value across a rounding boundary (one bfloat16 step:
# 2**-7 relative).
# Measured on hFedF's tracking run, seeds 3 and 5 (AMD EPYC), the state's
# relative L2 distance to the run alone / the largest per-round loss
# difference: mapped 2.0e-3 / 4.5e-4 with the default suite's settings, 0 with
# XLA's optimizations on; vmapped 2.2e-3 / 4.1e-4 (FedAvg: 0 mapped, 6.7e-5
# vmapped). Bounds ~10x those (another CPU's matrix units order the sums
# otherwise, so another rounding boundary may be crossed); the final
# accuracies were equal (bound: `TRACKING`'s). Two seeds' runs are 1.4 apart
# (asserted > 0.2), the float32 run 8.3e-2 in state and 2.9e-2 in loss
# (`TRACKING`).
BF16_REPLICA = {"state": 2e-2, "loss": 5e-3, "acc": 0.05}


def _state(result) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in
                         jax.tree.leaves((result.server, result.clients))])


@pytest.mark.parametrize("mapping", ["map", "vmap"])
def test_bf16_replicas_are_their_separate_runs(mapping):
  """hFedF's bfloat16 tracking run at seeds 3 and 5 as one `run_replicas`
  batch equals each seed's `engine.run` within `BF16_REPLICA` (state,
  per-round losses, final accuracies), and the replicas are not one
  another's run."""
  fed = _federation()
  alg, model, ecfg = _setup("hfedf", fed, "bfloat16")
  seeds = (3, 5)
  together = run_replicas(alg, [fed, fed], model, ecfg, seeds,
                          mapping=mapping)
  states = []
  for seed, got in zip(seeds, together, strict=True):
    alone = engine.run(alg, fed, model, dataclasses.replace(ecfg, seed=seed))
    a, b = _state(got), _state(alone)
    states.append(b)
    dist = np.linalg.norm(a - b) / np.linalg.norm(b)
    loss = np.max(np.abs(np.asarray(got.round_metrics["loss"])
                         - np.asarray(alone.round_metrics["loss"])))
    print(mapping, seed, dist, loss)
    assert dist <= BF16_REPLICA["state"], (seed, dist)
    assert loss <= BF16_REPLICA["loss"], (seed, loss)
    for k in ("id_acc", "ood_acc"):
      assert abs(got.final[k] - alone.final[k]) <= BF16_REPLICA["acc"], k
  apart = np.linalg.norm(states[0] - states[1]) / np.linalg.norm(states[1])
  assert apart > 10 * BF16_REPLICA["state"], apart
