"""hFedF variants: per-tensor GradAlign, random / autoencoder embeddings, Table 3
ablation names, Table 10 presets, few-shot and client scaling end to end.

Learned embeddings (the default) learning above chance is
tests/test_pinned.py::test_learns_above_chance_and_reproduces_pinned_numbers
[hfedf] (and the ablation names'; hfedf@autoencoder's with -m slow); each
engine run here covers several variants at once to keep the file fast
(compilation dominates)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_domains
from fedjax_dg import algorithms, engine, models, server, tree
from fedjax_dg.run import assemble, checks, presets
from fedjax_dg.algorithms import hfedf as hfedf_lib
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.run.config import base_config
from fedjax_dg.data import federated, partition
from fedjax_dg.models import autoencoder as ae
from fedjax_dg.server import EmaState
from fedjax_dg.server.hypernetwork import default_embed_dim
from test_server import cohort_inputs, tiny_generator

ENGINE = engine.EngineConfig(rounds=6, eval_every=3, epochs=1, batch_size=8,
                             progress=False, eval_batch_size=16)


def _mlp(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean, std=fed.std)


def _cfg(**hfedf):
  c = base_config()
  c.client.lr = 1e-3
  c.hfedf.server_lr = 1e-2
  c.hfedf.ema_warmup = 2
  for k, v in hfedf.items():
    c.hfedf[k] = v
  return c


# --------------------------------------------------------------------------
# Per-tensor GradAlign.


def per_tensor_brute_force(h, theta, emb, deltas, temperature):
  """Per-client gradients by autodiff, then GradAlign on each theta leaf."""
  m = emb.shape[0]
  f = lambda th, e, d: sum(jnp.vdot(a, b) for a, b in zip(
      jax.tree.leaves(h(th, e)), jax.tree.leaves(d)))
  grad = jax.jit(jax.grad(f))
  grads = []
  for i in range(m):
    g_i = grad(theta, emb[i], jax.tree.map(lambda d: d[i], deltas))
    grads.append([np.asarray(g).ravel() for g in jax.tree.leaves(g_i)])
  out = []
  for t in range(len(grads[0])):
    g = np.stack([grads[i][t] for i in range(m)])  # [m, P_t]
    avg = g.mean(0)
    cos = g @ avg / (np.linalg.norm(g, axis=1) * np.linalg.norm(avg))
    w = np.exp(cos / temperature) / np.exp(cos / temperature).sum()
    out.append((cos, w, (w[:, None] * g).sum(0)))
  return out


@pytest.mark.parametrize("temperature,chunk", [(1.0, 2), (0.3, 1)])
def test_per_tensor_gradalign_matches_brute_force(temperature, chunk):
  h, theta = tiny_generator(0)
  m = 5  # with chunk 2: a zero-padded last chunk
  emb, deltas = cohort_inputs(1, m)
  got, model_mode = jax.jit(lambda th, e, d: [server.hypernetwork_grads(
      h, th, e, d, temperature=temperature, norm_batch_size=chunk,
      granularity=g) for g in ("tensor", "model")])(theta, emb, deltas)
  want = per_tensor_brute_force(h, theta, emb, deltas, temperature)
  leaves = jax.tree.leaves(got.theta)
  assert got.weights_theta_tensors.shape == (m, len(leaves))
  for t, (cos, w, g) in enumerate(want):
    np.testing.assert_allclose(got.cos_theta_tensors[:, t], cos, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(got.weights_theta_tensors[:, t], w, rtol=1e-4)
    np.testing.assert_allclose(np.ravel(leaves[t]), g, rtol=1e-4, atol=1e-5)
  # Tensors really get different weights; the reported [m] weights are their mean.
  assert float(jnp.max(jnp.std(got.weights_theta_tensors, axis=1))) > 1e-3
  np.testing.assert_allclose(got.weights_theta,
                             np.mean(got.weights_theta_tensors, 1), rtol=1e-6)
  # The embedding table is one tensor, GradAlign'd as a whole in both modes:
  # client i's table gradient G_i is its row alone (autodiff), weights
  # softmax(cos(G_i, mean G) / T), the aggregate's row i is w_i G_i[i].
  phi_dot = lambda e, d: sum(jnp.vdot(a, b) for a, b in zip(
      jax.tree.leaves(h(theta, e)), jax.tree.leaves(d)))
  row = jax.jit(jax.grad(phi_dot))
  rows = np.stack([row(emb[i], d) for i, d in enumerate(tree.unstack(deltas))])
  tables = [np.zeros_like(rows) for _ in range(m)]
  for i in range(m):
    tables[i][i] = rows[i]
  avg = np.mean(tables, 0)
  cos = np.array([np.vdot(avg, t) / (np.linalg.norm(avg) * np.linalg.norm(t))
                  for t in tables])
  w = np.exp(cos / temperature) / np.exp(cos / temperature).sum()
  for mode in (got, model_mode):
    np.testing.assert_allclose(mode.cos_emb, cos, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mode.weights_emb, w, rtol=1e-4)
    np.testing.assert_allclose(mode.embeddings, w[:, None] * rows, rtol=1e-4,
                               atol=1e-6)


def _avals(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield v.aval
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          yield from _avals(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("granularity", ["model", "tensor"])
def test_gradalign_never_stacks_per_client_hypernetwork_gradients(granularity):
  e, hidden, size, m = 3, 6, 7 * 11 * 13, 4
  theta = {"l1": jnp.ones((e, hidden)) * 0.1, "head": jnp.ones((hidden, size)) * 0.01}
  h = lambda th, v: {"out": jnp.tanh(v @ th["l1"]) @ th["head"]}
  deltas = {"out": jnp.ones((m, size))}
  jaxpr = jax.make_jaxpr(lambda th, v, d: server.hypernetwork_grads(
      h, th, v, d, norm_batch_size=1, granularity=granularity))(
          theta, jnp.ones((m, e)), deltas)
  stacked = [a.shape for a in _avals(jaxpr.jaxpr)
             if getattr(a, "shape", ()) and len(a.shape) == 3
             and a.shape[0] > 1 and a.shape[1:] == (hidden, size)]
  assert not stacked, stacked  # no [m, hidden, size] gradient of the head


# --------------------------------------------------------------------------
# Embeddings.


@pytest.fixture(scope="module")
def two_per_domain():
  # 6 clients, 2 per source domain (3 source domains, dom0 held out).
  ds = synthetic_domains(num_domains=4, per_domain=120, classes=4, noise=60)
  spec = partition.PartitionSpec(name="k_per_domain", k_per_domain=2, seed=0)
  return federated.build(ds, spec, target_domain=0, seed=0)


def _server_key(seed, r):
  """The engine's server key of round r (docs/architecture.md, Randomness)."""
  return jax.random.split(jax.random.fold_in(jax.random.key(seed), r), 3)[2]


@pytest.fixture(scope="module")
def few_shot_fed():
  """Fig. 3 / Fig. 4 settings through assemble.federate: N = 6 > 3 source
  domains with d = 2 each, k = 3 target images per client."""
  ds = synthetic_domains(num_domains=4, per_domain=80, classes=4, noise=140)
  cfg = base_config()
  cfg.data.num_clients, cfg.data.d, cfg.data.few_shot_k = 6, 2, 3
  return ds, assemble.federate(cfg, ds, "dom0")


def test_few_shot_and_more_clients_than_domains_in_the_federation(few_shot_fed):
  ds, fed = few_shot_fed
  assert fed.num_clients == 6
  for c in range(6):
    assert len([d for d in fed.client_domains[c] if d != "dom0"]) == 2
    idx = fed.train_indices[c]
    assert int(np.sum(ds.domains[idx] == 0)) == 3  # k target images in training
    assert not np.intersect1d(idx, fed.target_indices).size  # not in the ood set
    assert not np.sum(ds.domains[fed.val_indices[c]] == 0)  # nor in id-val
  assert len(fed.target_y) == 80 - 6 * 3
  assert np.all(ds.domains[fed.target_indices] == 0)


def test_random_embeddings_per_tensor_few_shot_end_to_end(few_shot_fed):
  """Random embeddings (Table 7) with per-tensor GradAlign, trained by the
  engine on the few-shot, 6-client federation."""
  _, fed = few_shot_fed
  n = fed.num_clients
  model = _mlp(fed)
  alg = assemble.algorithm("hfedf", model, n, _cfg(
      embeddings="random", gradalign_granularity="tensor"), data=fed)
  # Nothing of the embeddings reaches the clients beyond the generated params:
  # no per-client state, and a client receives (and trains from) a stack of
  # client-model parameters only.
  server_shape, clients = jax.eval_shape(alg.init, jax.random.key(0))
  assert clients is None
  start = jax.eval_shape(alg.client.start, server_shape, None, jnp.arange(n))
  target = jax.eval_shape(model.init, jax.random.key(0))
  assert jax.tree.structure(start) == jax.tree.structure(target)
  for s, t in zip(jax.tree.leaves(start), jax.tree.leaves(target)):
    assert s.shape == (n,) + t.shape
  assert alg.client.extra(start, None, jnp.arange(n)) is None  # no extras

  res = engine.run(alg, fed, model, ENGINE)
  chance = 1.0 / fed.num_classes
  assert res.final["id_acc"] > chance + 0.25, res.final
  assert res.final["ood_acc"] > chance + 0.2, res.final
  assert len(res.final["ood_acc_per_client"]) == n
  # Every round's embeddings are a fresh N(0, 1) draw from that round's server
  # key (so independent of what the clients sent: never learned).
  e = default_embed_dim(n)
  assert res.server.hp.embeddings.shape == (n, e) == (6, 2)
  means = np.asarray(res.round_metrics["embeddings_mean"])
  draws = [jax.random.normal(_server_key(ENGINE.seed, r), (n, e))
           for r in range(ENGINE.rounds)]
  np.testing.assert_allclose(means, [float(jnp.mean(d)) for d in draws],
                             rtol=1e-5, atol=1e-6)
  assert np.all(np.abs(np.diff(means)) > 1e-6)
  np.testing.assert_array_equal(res.server.hp.embeddings, draws[-1])
  # Per-tensor GradAlign weights: [rounds, clients, tensors], columns sum to 1.
  w = np.asarray(res.round_metrics["gradalign_theta_tensors"])
  assert w.shape[:2] == (ENGINE.rounds, n) and w.shape[2] > 4
  np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
  assert np.max(np.std(w, axis=2)) > 0  # tensors get their own weights


def test_conv_transpose_2x2_matches_its_definition():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
  k = rng.standard_normal((5, 2, 2, 6)).astype(np.float32)
  want = np.zeros((2, 6, 8, 6), np.float32)
  for a in range(2):
    for b in range(2):
      want[:, a::2, b::2] = np.einsum("nijc,co->nijo", x, k[:, a, b])
  np.testing.assert_allclose(ae.conv_transpose_2x2(jnp.asarray(x), jnp.asarray(k)),
                             want, rtol=1e-5, atol=1e-5)


def test_autoencoder_follows_table6_and_any_divisible_shape():
  shapes = jax.eval_shape(
      lambda k: ae.init_autoencoder(ae.AutoEncoder(4, (32, 32, 3)), k),
      jax.random.key(0))
  assert shapes["to_latent"]["kernel"].shape == (2048, 4)     # flatten 2048 -> e
  assert shapes["from_latent"]["kernel"].shape == (4, 2048)
  assert shapes["dec1"]["kernel"].shape == (32, 2, 2, 16)
  assert shapes["dec2"]["kernel"].shape == (16, 2, 2, 3)
  module = ae.AutoEncoder(2, (12, 8, 1))
  out = jax.eval_shape(lambda k, x: module.apply(
      {"params": ae.init_autoencoder(module, k)}, x), jax.random.key(0),
      jax.ShapeDtypeStruct((5, 12, 8, 1), jnp.float32))
  assert out.shape == (5, 12, 8, 1)
  with pytest.raises(ValueError, match="divisible by 4"):
    jax.eval_shape(lambda k: ae.init_autoencoder(ae.AutoEncoder(2, (10, 8, 1)), k),
                   jax.random.key(0))


# The autoencoder's epochs here (the config's default: 50): same-domain
# clients are already closer than the others' (mean distance ratio 0.18 with
# two_per_domain, the test's bound 0.5), at a fifth of the training.
AE_EPOCHS = 10


def _ae_embeddings(fed, seed=0):
  c = base_config().hfedf
  return hfedf_lib.autoencoder_embeddings(
      fed, default_embed_dim(fed.num_clients),
      key=jax.random.fold_in(jax.random.key(seed), 0xAE),
      num_images=c.autoencoder_images, epochs=AE_EPOCHS,
      lr=c.autoencoder_lr, batch_size=c.autoencoder_batch_size)


@pytest.fixture(scope="module")
def ae_table(two_per_domain):
  """The autoencoder embeddings of `two_per_domain` (one computation for
  the module)."""
  return _ae_embeddings(two_per_domain)


def test_autoencoder_embeddings_shape_determinism_and_domains(two_per_domain,
                                                              ae_table):
  fed = two_per_domain
  emb = ae_table
  assert emb.shape == (6, 2) and np.all(np.isfinite(emb))
  np.testing.assert_array_equal(emb, _ae_embeddings(fed))  # deterministic
  # Clients of the same domain are closer than clients of different domains.
  dom = [c[0] for c in fed.client_domains]
  dist = np.linalg.norm(emb[:, None] - emb[None], axis=-1)
  same = [dist[i, j] for i in range(6) for j in range(i) if dom[i] == dom[j]]
  diff = [dist[i, j] for i in range(6) for j in range(i) if dom[i] != dom[j]]
  assert len(same) == 3 and min(diff) > 1e-3
  assert np.mean(same) < 0.5 * np.mean(diff), (same, diff)
  with pytest.raises(ValueError, match="needs the run's FederatedData"):
    assemble.algorithm("hfedf", _mlp(fed), 6, _cfg(embeddings="autoencoder"))


def test_autoencoder_embeddings_are_the_servers_fixed_table(two_per_domain,
                                                            ae_table,
                                                            monkeypatch):
  """hfedf.embeddings="autoencoder": the server's table is the autoencoder's
  embeddings from init on, and server steps (EMA mixing from the second)
  leave it exactly unchanged (never learned, never re-drawn, never rounded)."""
  fed = two_per_domain  # as the test above: the autoencoder program is reused
  n = fed.num_clients
  # The build's autoencoder run is `ae_table`'s if it asks for that very
  # computation (the same federation, dimension, key and settings): the
  # module's table, not a second training. Any other request (a wrong seed,
  # epochs, ...) trains for real, and its table fails the comparisons below.
  real, c = hfedf_lib.autoencoder_embeddings, base_config().hfedf
  made = dict(num_images=c.autoencoder_images, epochs=AE_EPOCHS,
              lr=c.autoencoder_lr, batch_size=c.autoencoder_batch_size)
  made_key = jax.random.key_data(jax.random.fold_in(jax.random.key(0), 0xAE))

  def reuse(data, latent, *, key, **kw):
    if (data is fed and latent == ae_table.shape[1] and kw == made
        and np.array_equal(jax.random.key_data(key), made_key)):
      return ae_table.copy()
    return real(data, latent, key=key, **kw)

  monkeypatch.setattr(hfedf_lib, "autoencoder_embeddings", reuse)
  alg = assemble.algorithm("hfedf", _mlp(fed), n,
                           _cfg(embeddings="autoencoder", ema_warmup=0,
                                autoencoder_epochs=AE_EPOCHS),
                           data=fed)
  ids = jnp.arange(n)

  def step(server, r):
    start = alg.client.start(server, None, ids)
    trained = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(
        jax.random.fold_in(jax.random.key(p.size), r), p.shape), start)
    result = ClientResult(ids, r, start, trained, jnp.full(n, 10), jnp.ones(n))
    new, metrics = alg.server.update(server, result, jax.random.key(1))
    return new, (new.hp.embeddings, metrics["embeddings_mean"])

  @jax.jit
  def rounds(key):
    server, _ = alg.init(key)
    last, (tables, means) = jax.lax.scan(step, server, jnp.arange(4))
    return server, last, tables, means

  server, last, tables, means = rounds(jax.random.key(0))
  fixed = ae_table
  np.testing.assert_array_equal(server.hp.embeddings, fixed)
  for table in tables:
    np.testing.assert_array_equal(table, fixed)
  assert not np.allclose(last.hp.theta["trunk_0"]["kernel"],
                         server.hp.theta["trunk_0"]["kernel"])  # theta learns
  np.testing.assert_allclose(means, np.full(4, fixed.mean()), rtol=1e-6)


# Slow: the wiring (the autoencoder's table fixed on the server through a
# step) is test_autoencoder_embeddings_are_the_servers_fixed_table; learning
# above chance with learned embeddings is tests/test_pinned.py::
# test_learns_above_chance_and_reproduces_pinned_numbers[hfedf].
@pytest.mark.slow
def test_autoencoder_embeddings_learn_above_chance(two_per_domain):
  fed = two_per_domain  # as the test above: the autoencoder program is reused
  model = _mlp(fed)
  alg = assemble.algorithm("hfedf", model, fed.num_clients,
                           _cfg(embeddings="autoencoder",
                                autoencoder_epochs=AE_EPOCHS), data=fed)
  res = engine.run(alg, fed, model, ENGINE)
  chance = 1.0 / fed.num_classes
  assert res.final["id_acc"] > chance + 0.25, res.final
  assert res.final["ood_acc"] > chance + 0.2, res.final
  fixed = _ae_embeddings(fed)
  np.testing.assert_array_equal(res.server.hp.embeddings, fixed)
  np.testing.assert_allclose(res.round_metrics["embeddings_mean"],
                             np.full(ENGINE.rounds, fixed.mean()), rtol=1e-6)


# --------------------------------------------------------------------------
# Ablation names, presets, few-shot and client scaling.


def test_table3_ablations_are_algorithm_names(fed3):
  cfg = base_config()
  cfg.algorithms = tuple(hfedf_lib.VARIANTS)
  cfg.model.name = "mlp"
  checks.validate(cfg)  # a sweep over algorithms accepts them
  for name in hfedf_lib.VARIANTS:
    assert name in algorithms.available()
    assert algorithms.spec(name).section == "hfedf"
    assert assemble.algorithm(name, _mlp(fed3), 3, cfg).name == name
  assert {k: v[1] for k, v in hfedf_lib.VARIANTS.items()} == {
      "hfedf_no_gradalign": dict(gradalign=False),
      "hfedf_no_ema": dict(ema=False),
      "hfedf_no_both": dict(gradalign=False, ema=False)}
  # Each name really switches its parts off: no EMA state without EMA (the
  # state's structure: traced, not compiled); uniform GradAlign weights
  # without GradAlign, shown for one name with and one without (one compile
  # each; the registry hands every name its overrides by the same code).
  model = _mlp(fed3)
  ids = jnp.arange(3)
  for name, smooth in {"hfedf": True, "hfedf_no_gradalign": True,
                       "hfedf_no_ema": False, "hfedf_no_both": False}.items():
    server = jax.eval_shape(assemble.algorithm(name, model, 3, cfg).init,
                            jax.random.key(0))[0]
    assert isinstance(server.ema, EmaState) == smooth, name
  aligns = {"hfedf": True, "hfedf_no_gradalign": False}

  def metrics(alg, key):
    server, _ = alg.init(key)
    start = alg.client.start(server, None, ids)
    trained = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(
        jax.random.key(x.size), x.shape), start)
    result = ClientResult(ids, 0, start, trained, jnp.full(3, 10),
                          jnp.ones(3))
    return alg.server.update(server, result, jax.random.key(1))[1]

  algs = {name: assemble.algorithm(name, model, 3, cfg) for name in aligns}
  weights = jax.jit(lambda key: {  # one program for both names
      name: metrics(alg, key)["gradalign_theta"]
      for name, alg in algs.items()})(jax.random.key(0))
  for name, align in aligns.items():
    uniform = np.allclose(weights[name], 1 / 3, atol=1e-7)
    assert uniform == (not align), name
  assert algorithms.spec("hfedf_no_both").display_name == (
      "hFedF w/o GradAlign & EMA")


@pytest.mark.parametrize("name", ["pacs", "office_home", "vlcs"])
def test_presets_set_table10_values(name):
  t = {  # (FedAvg lr, wd), hFedF (server lr, server wd, EMA), FedGMA (tau, eta)
      "pacs": ((1e-3, 1e-4), (1e-3, 1e-5, 0.95), (0.7, 1.0), 1e-1, (1e-2, 1e-3)),
      "office_home": ((1e-3, 1e-5), (1e-3, 1e-5, 0.75), (0.3, 1e-2), 1e-1,
                      (1e-3, 1e-4)),
      "vlcs": ((1e-4, 1e-4), (1e-3, 1e-3, 0.75), (0.5, 1e-2), 1e-2,
               (1e-3, 1e-4)),
  }[name]
  cfg = base_config()
  applied = presets.apply(cfg, name)
  assert applied
  (lr, wd), (slr, swd, ema), (tau, eta), l2r, (plr, pwd) = t
  assert (cfg.client.lr, cfg.client.weight_decay) == (lr, wd)
  for section in ("fedavg", "central", "local_only"):
    assert (cfg[section].client.lr, cfg[section].client.weight_decay) == (lr, wd)
  h = cfg.hfedf
  assert (h.server_lr, h.server_weight_decay, h.ema_decay) == (slr, swd, ema)
  assert (h.client.lr, h.client.weight_decay) == (1e-3, 1e-3)
  if "fedprox" in cfg:
    assert cfg.fedprox.mu == 1e-2 and cfg.fedprox.client.lr == 1e-3
  if "fedgma" in cfg:
    assert (cfg.fedgma.threshold, cfg.fedgma.step_size) == (tau, eta)
  if "fedsr" in cfg:
    assert cfg.fedsr.l2r_coeff == l2r
  if "pfedhn" in cfg:
    assert (cfg.pfedhn.server_lr, cfg.pfedhn.server_weight_decay) == (plr, pwd)
  # The optimizer an algorithm gets reflects the preset: Adam with L2 weight
  # decay, so at w = 1 a zero gradient steps by -lr (the decay alone), and a
  # gradient of -wd cancels the decay (no step).
  opt = assemble.client_optimizer(cfg, "hfedf")
  w = {"w": jnp.ones(3)}
  lr = cfg.hfedf.client.lr or cfg.client.lr  # the section overrides the run's
  wd = cfg.hfedf.client.weight_decay
  step, _ = opt.update({"w": jnp.zeros(3)}, opt.init(w), w)
  np.testing.assert_allclose(step["w"], -lr, rtol=1e-3)
  step, _ = opt.update({"w": jnp.full(3, -wd)}, opt.init(w), w)
  np.testing.assert_allclose(step["w"], 0.0, atol=1e-12)


def test_presets_skip_missing_sections_and_rfmnist_is_pacs():
  cfg = base_config()
  with cfg.unlocked():  # a config not built on base_config
    for section in ("fedprox", "pfedhn", "fedsr", "fedgma"):
      del cfg[section]
  applied = presets.apply(cfg, "vlcs")
  assert not any(a.startswith(("fedgma", "fedsr")) for a in applied)
  assert cfg.hfedf.server_weight_decay == 1e-3
  with pytest.raises(ValueError, match="has no"):
    presets.apply(cfg, "vlcs", strict=True)
  assert presets.values("rotated_fashion_mnist") == presets.values("pacs")
  with pytest.raises(ValueError, match="unknown preset"):
    presets.apply(cfg, "domainnet")


# joint (arXiv v1) slow: its weights are checked against brute force in
# tests/test_server.py::test_joint_gradalign_matches_brute_force.
@pytest.mark.parametrize("over", [pytest.param("joint", marks=pytest.mark.slow),
                                  "theta"])
def test_gradalign_over_reaches_the_server_step(few_shot_fed, over):
  """`hfedf.gradalign_over` is wired to the server step: "joint" reports one
  weight per client for theta and the embeddings, "theta" unweighted rows."""
  _, fed = few_shot_fed
  n = fed.num_clients
  model = _mlp(fed)
  alg = assemble.algorithm("hfedf", model, n, _cfg(gradalign_over=over))
  ids = jnp.arange(n)

  @jax.jit  # one program (op by op, each op compiled: 4x the time)
  def metrics(key):
    server_state, _ = alg.init(key)
    start = alg.client.start(server_state, None, ids)
    trained = jax.tree.map(
        lambda p: p + 0.1 * jax.random.normal(jax.random.key(1), p.shape),
        start)
    result = ClientResult(ids=ids, round=jnp.int32(0), start=start,
                          params=trained, num_examples=jnp.ones((n,)),
                          loss=jnp.zeros((n,)))
    return alg.server.update(server_state, result, jax.random.key(2))[1]

  metrics = metrics(jax.random.key(0))
  w_t = np.asarray(metrics["gradalign_theta"])
  w_e = np.asarray(metrics["gradalign_emb"])
  np.testing.assert_allclose(w_t.sum(), 1.0, rtol=1e-5)
  assert np.std(w_t) > 0
  if over == "joint":
    np.testing.assert_array_equal(w_t, w_e)
  else:
    np.testing.assert_allclose(w_e, np.full(n, 1 / n), rtol=1e-6)
