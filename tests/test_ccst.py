"""CCST: AdaIN and its networks against numpy (the reference nn.Sequentials
written out here), the weight files, the style statistics, the style draws,
the local objective against an independent computation, and the algorithm
end to end (a truncated encoder: depth 1 or 2, depth 4 once)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import synthetic_federation, with_sizes
from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.run import assemble
from fedjax_dg.algorithms import ccst
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client.style_pool import StylePool
from fedjax_dg.client.update import Batch, ClientContext, ClientData
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError, DataError, NeedsDataError
from fedjax_dg.models import adain

RNG = np.random.default_rng(0)
pytestmark = pytest.mark.filterwarnings("ignore:ccst. no AdaIN weights")

# The AdaIN reference release's networks (naoto0804/pytorch-AdaIN `net.py`,
# which CCST copies), module by module: its state dicts are named by these
# indices. "conv cin cout k"; the VGG list stops at relu4_1 plus one deeper
# conv (the release's file goes on to relu5_4).
VGG = (["conv 3 3 1", "pad", "conv 3 64 3", "relu", "pad", "conv 64 64 3",
        "relu", "pool", "pad", "conv 64 128 3", "relu", "pad", "conv 128 128 3",
        "relu", "pool", "pad", "conv 128 256 3", "relu"]
       + ["pad", "conv 256 256 3", "relu"] * 3
       + ["pool", "pad", "conv 256 512 3", "relu", "pad", "conv 512 512 3"])
DECODER = (["pad", "conv 512 256 3", "relu", "up"]
           + ["pad", "conv 256 256 3", "relu"] * 3
           + ["pad", "conv 256 128 3", "relu", "up", "pad", "conv 128 128 3",
              "relu", "pad", "conv 128 64 3", "relu", "up", "pad",
              "conv 64 64 3", "relu", "pad", "conv 64 3 3"])
# depth -> (modules of the VGG list kept: up to relu{depth}_1, first decoder
# module: the pad before the conv mirroring conv{depth}_1).
CUT = {1: (4, 27), 2: (11, 20), 3: (18, 13), 4: (31, 0)}


def _state(modules, first=0, scale=1.0, seed=0):
  """A random state dict in the reference naming (He-scaled convs)."""
  rng = np.random.default_rng(seed)
  out = {}
  for i, m in enumerate(modules):
    if m.startswith("conv") and i >= first:
      _, cin, cout, k = m.split()
      cin, cout, k = int(cin), int(cout), int(k)
      std = scale * np.sqrt(2.0 / (cin * k * k))
      out[f"{i}.weight"] = (std * rng.normal(size=(cout, cin, k, k))
                            ).astype(np.float32)
      out[f"{i}.bias"] = (0.1 * rng.normal(size=cout)).astype(np.float32)
  return out


def _numpy_sequential(modules, state, x, first=0, last=None):
  """Runs modules[first:last] on x [B, C, H, W] in float64 as torch would."""
  x = np.asarray(x, np.float64)
  for i in range(first, len(modules) if last is None else last):
    m = modules[i]
    if m == "pad":
      x = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect")
    elif m == "relu":
      x = np.maximum(x, 0.0)
    elif m == "up":
      x = x.repeat(2, axis=2).repeat(2, axis=3)
    elif m == "pool":  # MaxPool2d(2, 2, ceil_mode=True)
      h, w = x.shape[2:]
      x = np.pad(x, ((0, 0), (0, 0), (0, h % 2), (0, w % 2)),
                 constant_values=-np.inf)
      x = np.maximum.reduce([x[:, :, a::2, b::2] for a in (0, 1)
                             for b in (0, 1)])
    else:
      wgt = state[f"{i}.weight"].astype(np.float64)
      k = wgt.shape[-1]
      h, w = x.shape[2] - k + 1, x.shape[3] - k + 1
      cols = np.stack([x[:, :, a:a + h, b:b + w] for a in range(k)
                       for b in range(k)], axis=2)        # [B, C, k*k, h, w]
      x = (np.einsum("bcphw,ocp->bohw", cols, wgt.reshape(*wgt.shape[:2], -1))
           + state[f"{i}.bias"][None, :, None, None])
  return x


def _numpy_adain(f, mean, std, eps):
  mu = f.mean(axis=(2, 3), keepdims=True)
  sig = np.sqrt(f.var(axis=(2, 3), keepdims=True) + eps)
  return (f - mu) / sig * std[:, :, None, None] + mean[:, :, None, None]


def _save(tmp_path, name, state):
  path = str(tmp_path / f"{name}.safetensors")
  save_file(state, path)
  return path


# --------------------------------------------------------------------------
# AdaIN and the networks.


def test_adain_gives_each_channel_the_style_mean_and_std():
  f = RNG.normal(2.0, 3.0, size=(2, 5, 6, 4))
  f[1, ..., 2] = 0.0  # a dead (ReLU) channel: normalized to 0, becomes the mean
  mean, std = RNG.normal(size=(2, 4)), RNG.uniform(0.2, 2.0, size=(2, 4))
  # One program (eagerly: a program per op).
  out, (m, sd) = jax.tree.map(np.asarray, jax.jit(lambda f, mean, std: (
      adain.adain(f, mean, std, eps=1e-5),
      adain.instance_stats(f, eps=1e-5)))(
          *(np.asarray(a, np.float32) for a in (f, mean, std))))
  np.testing.assert_allclose(out.mean(axis=(1, 2)), mean, atol=1e-5)
  s = out.std(axis=(1, 2))  # population std
  np.testing.assert_allclose(np.delete(s.ravel(), 6), np.delete(std.ravel(), 6),
                             rtol=1e-4)
  assert s[1, 2] < 1e-6
  want = np.moveaxis(_numpy_adain(np.moveaxis(f, 3, 1), mean, std, 1e-5), 1, 3)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m, f.mean((1, 2)), rtol=1e-5)
  np.testing.assert_allclose(sd, np.sqrt(f.var((1, 2)) + 1e-5), rtol=1e-5)


@pytest.mark.parametrize("depth", [4, 2])
def test_loaded_networks_equal_the_reference_sequentials(tmp_path, depth):
  """Random weights in the release's naming, as .safetensors (torch-free):
  encode, AdaIN with alpha and decode equal a float64 numpy run of the
  reference modules; odd sides exercise ceil-mode pools and the crop."""
  n_vgg, first = CUT[depth]
  vgg = _state(VGG, seed=1)
  assert "32.weight" in vgg  # a deeper layer, ignored
  dec = _state(DECODER, first=first, seed=2)
  net = adain.load(_save(tmp_path, "vgg", vgg), _save(tmp_path, "dec", dec),
                   depth)
  x = RNG.uniform(0, 1, size=(2, 17, 18, 3)).astype(np.float32)
  xn = np.moveaxis(x, 3, 1)
  f_np = _numpy_sequential(VGG, vgg, xn, last=n_vgg)
  # Jitted (eagerly each layer's ops compiled apart: ~120 programs at depth 4).
  f = np.asarray(jax.jit(lambda net, x: adain.encode(net, x, depth=depth))(
      net, x))
  np.testing.assert_allclose(np.moveaxis(f, 3, 1), f_np, rtol=2e-4,
                             atol=2e-4 * np.abs(f_np).max())
  c = f_np.shape[1]
  mean = RNG.normal(size=(2, c)).astype(np.float32)
  std = RNG.uniform(0.5, 2.0, size=(2, c)).astype(np.float32)
  alpha = 0.7
  t = alpha * _numpy_adain(f_np, mean, std, 1e-5) + (1 - alpha) * f_np
  want = _numpy_sequential(DECODER, dec, t, first=first)[:, :, :17, :18]
  got = np.asarray(jax.jit(lambda net, x, mean, std: adain.transfer(
      net, x, mean, std, depth=depth, alpha=alpha))(net, x, mean, std))
  assert got.shape == (2, 17, 18, 3)
  np.testing.assert_allclose(np.moveaxis(got, 3, 1), want, rtol=2e-4,
                             atol=2e-4 * np.abs(want).max())
  # The mapping itself: one kernel transposed OIHW -> HWIO, one bias.
  np.testing.assert_array_equal(net["encoder"]["conv1_1"]["kernel"],
                                vgg["2.weight"].transpose(2, 3, 1, 0))
  np.testing.assert_array_equal(net["decoder"]["dec1_1"]["bias"],
                                dec["28.bias"])


def test_mismatching_weight_files_are_errors_naming_the_tensor(tmp_path):
  vgg, dec = _state(VGG), _state(DECODER, first=27)
  bad = dict(vgg, **{"5.weight": np.zeros((64, 32, 3, 3), np.float32)})
  with pytest.raises(DataError, match=r"5\.weight: \(64, 32, 3, 3\) in the "
                     r"file, \(64, 64, 3, 3\) in the model"):
    adain.load(_save(tmp_path, "bad", bad), _save(tmp_path, "d1", dec), 2)
  missing = {k: v for k, v in vgg.items() if k != "2.bias"}
  with pytest.raises(DataError, match=r"missing \(1\): \['2.bias'\]"):
    adain.to_flax(missing, 1, "vgg")
  with pytest.raises(DataError, match=r"unexpected \(1\): \['extra'\]"):
    adain.to_flax(dict(vgg, extra=np.zeros(1)), 1, "vgg")
  # The reference decoder.pth (depth 4's) at depth 1: a hint, not a silent
  # use of its last layer.
  with pytest.raises(DataError, match="deeper decoder"):
    adain.to_flax(_state(DECODER), 1, "decoder")
  assert set(adain.to_flax(dec, 1, "decoder")) == {"dec1_1"}
  try:
    import torch  # noqa: F401
  except ImportError:
    pth = tmp_path / "vgg_normalised.pth"
    pth.write_bytes(b"not read")
    with pytest.raises(DataError, match="needs PyTorch"):
      adain.load(str(pth), str(pth), 1)


# --------------------------------------------------------------------------
# Style statistics and draws.


@pytest.fixture(scope="module")
def net1():
  return adain.init(jax.random.key(0), depth=1)


def test_overall_and_single_styles_equal_numpy(net1):
  x = RNG.integers(0, 256, size=(7, 6, 5, 1)).astype(np.uint8)  # grey
  n = 5  # two padding rows, chunks of 3 (padded too)
  feats = np.asarray(jax.jit(lambda net, x: adain.encode(net, x, depth=1))(
      net1, np.repeat(x[:n] / 255.0, 3, -1)), np.float64)
  style = jax.jit(lambda x, n: ccst.overall_style(net1, x, n, depth=1, chunk=3,
                                                  eps=1e-5))(x, n)
  np.testing.assert_allclose(style.mu[0], feats.mean((0, 1, 2)), rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(style.sig[0], np.sqrt(feats.var((0, 1, 2)) + 1e-5),
                             rtol=1e-4)
  assert bool(style.valid[0])
  single = jax.jit(lambda x, n, k: ccst.single_styles(
      net1, x, n, k, r=0.5, slots=4, depth=1, chunk=3, eps=1e-5))(
          x, n, jax.random.key(3))
  assert np.asarray(single.valid).tolist() == [True, True, True, False]
  own = [np.argmin(np.abs(feats.mean((1, 2)) - single.mu[j]).max(1))
         for j in range(3)]
  assert len(set(own)) == 3  # three distinct valid images
  for j, i in enumerate(own):
    np.testing.assert_allclose(single.mu[j], feats[i].mean((0, 1)), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(single.sig[j], np.sqrt(feats[i].var((0, 1))
                                                      + 1e-5), rtol=1e-4)


def test_draws_take_valid_styles_distinct_clients_and_the_own_only_as_allowed():
  n_clients, slots = 4, 3
  mu = jnp.arange(n_clients * slots, dtype=jnp.float32).reshape(
      n_clients, slots, 1)
  valid = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
  bank = StylePool(mu, mu + 100.0, valid)
  allowed = {c * slots + j for c in range(n_clients) for j in range(slots)
             if valid[c, j]}
  draw = jax.jit(ccst.draw_styles, static_argnums=(3, 4),
                 static_argnames=("include_own", "distinct"))
  for own in (0, 3):
    # The authors' code: 3 distinct clients of the 3 holding data (itself
    # included).
    m, s, is_own = draw(jax.random.key(own), bank, jnp.asarray(own), 400, 3,
                        include_own=True, distinct=True)
    rows = np.asarray(m[..., 0]).astype(int)
    np.testing.assert_array_equal(np.asarray(s[..., 0]), rows + 100)
    clients = rows // slots
    assert all(len(set(c)) == 3 for c in clients)  # distinct per image
    assert set(rows.ravel()) == allowed            # every valid style, no other
    np.testing.assert_array_equal(np.asarray(is_own), clients == own)
    # FedCCRL's code: independent draws of the others' styles only.
    m, _, is_own = draw(jax.random.key(7 + own), bank, jnp.asarray(own), 400,
                        3, include_own=False, distinct=False)
    rows = np.asarray(m[..., 0]).astype(int)
    assert set(rows.ravel()) == {a for a in allowed if a // slots != own}
    assert not np.asarray(is_own).any()


# --------------------------------------------------------------------------
# The algorithm.


@pytest.fixture(scope="module")
def fed():
  return synthetic_federation(num_clients=3, per_domain=30, size=8)


@pytest.fixture(scope="module")
def model(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, hidden=16)


def _build(fed, model, lr=None, **hp):
  cfg = base_config()
  cfg.ccst.depth = 1
  cfg.ccst.client.lr = lr
  for k, v in hp.items():
    cfg.ccst[k] = v
  return assemble.algorithm("ccst", model, fed.num_clients, cfg, data=fed)


@pytest.fixture(scope="module")
def identity_files(tmp_path_factory):
  """Depth-1 AdaIN files whose decode(encode(x)) = x for x in [0, 1]:
  conv0 the identity, conv1_1's channels 0-2 the input's centre taps (the
  other 61 zero), the decoder's conv reading channels 0-2 back."""
  tmp = tmp_path_factory.mktemp("identity")
  w0 = np.eye(3, dtype=np.float32)[:, :, None, None]
  w1 = np.zeros((64, 3, 3, 3), np.float32)
  w1[np.arange(3), np.arange(3), 1, 1] = 1.0
  wd = np.zeros((3, 64, 3, 3), np.float32)
  wd[np.arange(3), np.arange(3), 1, 1] = 1.0
  vgg = {"0.weight": w0, "0.bias": np.zeros(3, np.float32), "2.weight": w1,
         "2.bias": np.zeros(64, np.float32)}
  dec = {"28.weight": wd, "28.bias": np.zeros(3, np.float32)}
  return _save(tmp, "vgg", vgg), _save(tmp, "dec", dec)


def _ctx(alg, params, cid=0):
  server, _ = alg.init(jax.random.key(0))
  return ClientContext(id=jnp.int32(cid), round=jnp.int32(0), start=params,
                       shared=alg.client.shared(server),
                       frozen=alg.frozen(jax.random.key(0))), server


@functools.partial(jax.jit, static_argnums=0)   # one program per model
def _ce_rows(model, params, x01, y):                # and shape
  logits = model.apply(params, x01, normalized=False)
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]


def _ce(model, params, x01, y, mask):
  ce = _ce_rows(model, params, np.asarray(x01, np.float32), np.asarray(y))
  return float(np.sum(np.asarray(ce) * mask) / mask.sum())


def _styled(x, overall, c):
  """Grey uint8 images [B, H, W, 1] in client c's overall style through the
  identity network, in numpy: AdaIN on the pixels, clipped."""
  f = np.moveaxis(x.astype(np.float64) / 255.0, 3, 1)
  mean, std = (np.broadcast_to(np.asarray(a)[c, 0, :1], (len(x), 1))
               for a in overall[:2])
  return np.moveaxis(np.clip(_numpy_adain(f, mean, std, 1e-5), 0, 1), 1, 3)


def _batch(fed, c, valid):
  x, y = np.asarray(fed.train.x[c, :8]), np.asarray(fed.train.y[c, :8])
  mask = np.asarray([1.0] * valid + [0.0] * (8 - valid), np.float32)
  return Batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))


def test_reference_loss_is_the_mean_over_all_clients_styles_own_kept(
    fed, model, identity_files):
  """K = 3 of 3 clients: every image in every client's overall style, its
  own client's being the original image; the loss is the mean of the three
  cross-entropies whatever the draw. Computed here with numpy AdaIN on the
  pixels (the identity network's features are the image)."""
  vgg, dec = identity_files
  alg = _build(fed, model, vgg=vgg, decoder=dec, k=3)
  params = model.init(jax.random.key(1))
  ctx, server = _ctx(alg, params, cid=1)
  batch = _batch(fed, 1, 6)
  x, y, mask = (np.asarray(a) for a in (batch.x, batch.y, batch.mask))
  ces = []
  for c in range(3):
    styled = x / 255.0 if c == 1 else _styled(x, server.overall, c)
    if c != 1:
      assert not np.allclose(styled, x / 255.0, atol=1e-2)  # another style
    ces.append(_ce(model, params, styled, y, mask))
  for seed in range(3):
    got = float(jax.jit(alg.client.loss)(params, batch, jax.random.key(seed), ctx))
    np.testing.assert_allclose(got, np.mean(ces), rtol=1e-4)


def test_fedccrl_code_loss_adds_k_views_in_foreign_styles_only(
    fed, model, identity_files):
  """FedCCRL's objective: CE(x) + k' CE(view), k' ~ U{0..K}. With client 2's
  style marked invalid, client 0's only foreign style is client 1's, so every
  view is x in client 1's style (numpy): (loss - CE(x)) / CE(view) must be an
  integer in 0..3 for every draw (an own-style or original view breaks it)."""
  vgg, dec = identity_files
  alg = _build(fed, model, vgg=vgg, decoder=dec, k=3,
               objective="fedccrl_code")
  params = model.init(jax.random.key(1))
  ctx, server = _ctx(alg, params, cid=0)
  overall = server.overall._replace(
      valid=server.overall.valid.at[2].set(False))
  ctx = ctx._replace(shared=(None, overall))
  batch = _batch(fed, 0, 5)
  x, y, mask = (np.asarray(a) for a in (batch.x, batch.y, batch.mask))
  ce = _ce(model, params, x / 255.0, y, mask)
  ce_view = _ce(model, params, _styled(x, overall, 1), y, mask)
  assert abs(ce_view - ce) > 1e-3
  loss = jax.jit(alg.client.loss)
  counts = [(float(loss(params, batch, jax.random.key(s), ctx)) - ce) / ce_view
            for s in range(16)]
  np.testing.assert_allclose(counts, np.round(counts), atol=1e-3)
  assert set(np.round(counts)) <= {0, 1, 2, 3}
  assert len(set(np.round(counts))) >= 3, counts


def test_identity_transfer_leaves_the_reference_loss_the_cross_entropy(
    fed, model, identity_files):
  """alpha = 0 with the identity network: every view is the image, so the
  reference objective (single styles, K = 2) is the cross-entropy."""
  vgg, dec = identity_files
  params = model.init(jax.random.key(1))
  batch = _batch(fed, 0, 5)
  ce = _ce(model, params, np.asarray(batch.x) / 255.0, np.asarray(batch.y),
           np.asarray(batch.mask))
  ref = _build(fed, model, vgg=vgg, decoder=dec, alpha=0.0, k=2,
               bank="single")
  ctx, _ = _ctx(ref, params)
  np.testing.assert_allclose(
      jax.jit(ref.client.loss)(params, batch, jax.random.key(0), ctx), ce, rtol=1e-4)


# Slow (~5 s, an engine run): the default test_pinned.py::test_learns_above_
# chance_and_reproduces_pinned_numbers[ccst] runs CCST end to end (above
# chance, pinned losses and parameters); test_refreshed_single_styles_land_in_
# their_own_clients_rows pins the single bank's refresh, and
# test_both_reads_the_single_and_the_overall_bank the overall bank kept, the
# network out of the trained state, the bank size and which settings upload.
@pytest.mark.slow
def test_ccst_learns_keeps_the_network_frozen_and_refreshes_single_styles(
    fed, model):
  alg = _build(fed, model, lr=0.05, bank="both", k=2, r=0.25)
  assert alg.client.end is not None and alg.frozen is not None
  first, _ = alg.init(jax.random.key(0))
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=3, eval_every=3, epochs=1, batch_size=16, progress=False))
  assert res.final["id_acc"] > 1.0 / fed.num_classes + 0.2, res.final
  # The AdaIN network is nowhere in the trained state.
  assert set(res.server.params) == set(model.init(jax.random.key(0)))
  np.testing.assert_array_equal(res.server.overall.mu, first.overall.mu)
  assert not np.allclose(res.server.single.mu, first.single.mu)  # redrawn
  np.testing.assert_array_equal(res.server.single.valid, first.single.valid)
  np.testing.assert_array_equal(res.round_metrics["ccst_bank_size"],
                                int(first.single.valid.sum()) + 3)
  assert _build(fed, model).client.end is None        # overall: nothing to send
  assert _build(fed, model, bank="single", refresh=False).client.end is None


def test_refreshed_single_styles_land_in_their_own_clients_rows(fed, model):
  """The server writes client c's redrawn single-image styles (its message)
  to row c of the bank, whatever the cohort's order, and leaves the other
  rows alone. Unequal clients (6, 27, 15 examples: ceil(r n) = 3, 14, 8 valid
  styles) and a cohort [2, 0] (neither sorted nor rows 0..m-1), so a wrong
  row shows in the valid counts and in whose images the styles are: every
  valid style of row c must be the channel means and stds of a distinct one
  of client c's own n_c images (numpy on the encoder's features)."""
  sizes = [6, 27, 15]
  sized = with_sizes(fed, sizes)
  alg = _build(sized, model, bank="single", r=0.5)
  frozen = alg.frozen(jax.random.key(0))
  ids = np.array([2, 0])
  x, y, n = (np.asarray(a)[ids] for a in (sized.train.x, sized.train.y,
                                           sized.train.n))

  @jax.jit
  def round_end(server):
    """The cohort's redrawn styles (their messages), then the server update."""
    aux = jax.vmap(lambda c, *a: alg.client.end.fn(ClientContext(
        id=c, round=0, start=None, frozen=frozen), None, ClientData(*a[:3]),
                                                   a[3])[1])(
        ids, x, y, n, jax.random.split(jax.random.key(5), len(ids)))
    result = ClientResult(ids=jnp.asarray(ids), round=jnp.int32(0), start=None,
                          params=tree.broadcast(server.params, len(ids)),
                          num_examples=jnp.asarray(n), loss=jnp.zeros(2),
                          message=aux)
    return aux, alg.server.update(server, result, jax.random.key(1))

  server, _ = alg.init(jax.random.key(0))
  aux, (new, metrics) = jax.device_get(round_end(server))
  old = jax.device_get(server.single)
  for j, c in enumerate(ids):
    for got, want in zip(new.single, aux):
      np.testing.assert_array_equal(got[c], want[j])
  for got, was in zip(new.single, old):
    np.testing.assert_array_equal(got[1], was[1])  # not in the cohort
  x01 = np.repeat(np.asarray(sized.train.x, np.float32) / 255.0, 3, -1)
  feats = np.asarray(jax.jit(jax.vmap(lambda a: adain.encode(
      frozen[ccst.FROZEN], a, depth=1)))(x01), np.float64)
  for c, size in enumerate(sizes):
    valid = new.single.valid[c]
    assert valid.sum() == np.ceil(0.5 * size) and valid[:valid.sum()].all()
    f = feats[c, :size]
    mu, sd = f.mean((1, 2)), np.sqrt(f.var((1, 2)) + 1e-5)  # [n_c, C]
    own = [int(np.argmin(np.abs(mu - new.single.mu[c, s]).max(1)))
           for s in np.flatnonzero(valid)]
    assert len(set(own)) == len(own)  # distinct images of client c
    np.testing.assert_allclose(new.single.mu[c, valid], mu[own], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(new.single.sig[c, valid], sd[own], rtol=1e-4,
                               atol=1e-5)
  assert int(metrics["ccst_bank_size"]) == sum(np.ceil(0.5 * np.array(sizes)))


def test_both_reads_the_single_and_the_overall_bank(fed, model):
  """bank="both": each view reads the single or the overall bank (p = 1/2).
  One bank's stds set to NaN make the loss NaN exactly when a view read it
  (a foreign client's style; the own client's view is the original image):
  over 12 draws (K = 2 views) each poisoned bank must give both NaN losses
  (it was read) and finite ones (the other bank alone was read). Pins that
  both banks are used, e.g. against the overall bank never being read."""
  alg = _build(fed, model, bank="both", k=2)
  params = model.init(jax.random.key(1))
  ctx, server = _ctx(alg, params)
  batch = _batch(fed, 0, 8)
  loss = jax.jit(alg.client.loss)
  poison = lambda b: b._replace(sig=jnp.full_like(b.sig, jnp.nan))
  single, overall = ctx.shared
  for shared in ((poison(single), overall), (single, poison(overall))):
    c = ctx._replace(shared=shared)
    nan = np.isnan([float(loss(params, batch, jax.random.key(s), c))
                    for s in range(12)])
    assert nan.any() and not nan.all(), nan
  # The server: the cohort's single styles written, the overall bank kept, the
  # AdaIN network nowhere in the trained state, both banks counted; only a
  # refreshed single bank is uploaded.
  assert alg.client.end is not None and alg.frozen is not None
  ids = jnp.asarray([2, 0])
  stacked = tree.broadcast(server.params, 2)
  aux = jax.tree.map(lambda a: a[::-1], tree.take(server.single, ids))
  new, metrics = jax.device_get(jax.jit(alg.server.update)(
      server, ClientResult(ids=ids, round=jnp.int32(0), start=stacked,
                           params=stacked, num_examples=jnp.asarray([5, 5]),
                           loss=jnp.zeros(2), message=aux), jax.random.key(0)))
  np.testing.assert_array_equal(new.single.mu[[2, 0]],
                                np.asarray(server.single.mu)[[0, 2]])
  for got, was in zip(new.overall, server.overall):
    np.testing.assert_array_equal(got, was)
  assert set(new.params) == set(model.init(jax.random.key(0)))
  assert int(metrics["ccst_bank_size"]) == int(
      server.single.valid.sum()) + 3 == int(new.single.valid.sum()) + int(
          new.overall.valid.sum())
  assert _build(fed, model).client.end is None        # overall: nothing to send
  assert _build(fed, model, bank="single", refresh=False).client.end is None


def test_bad_settings_and_missing_data_are_errors(fed, model, tmp_path):
  for hp, needle in ((dict(depth=5), "ccst.depth=5"),
                     (dict(bank="all"), "ccst.bank"),
                     (dict(k=0), "ccst.k=0"),
                     (dict(k=4), "at most the 3 clients"),
                     (dict(alpha=1.5), "ccst.alpha"),
                     (dict(r=0.0), "ccst.r=0.0"),
                     (dict(objective="x"), "ccst.objective"),
                     (dict(eps=0.0), "ccst.eps"),
                     (dict(vgg="a.pth"), "both weight files or neither"),
                     (dict(depth=4), "too small")):
    with pytest.raises(ConfigError, match=needle):
      _build(fed, model, **hp)
  with pytest.raises(DataError, match="no such file"):
    _build(fed, model, vgg=str(tmp_path / "v.pth"),
           decoder=str(tmp_path / "d.pth"))
  cfg = base_config()
  with pytest.raises(NeedsDataError, match="first style bank"):
    assemble.algorithm("ccst", model, 3, cfg)
  # A run's settings are checked on a 4x4 stand-in model before any data is
  # read: depth 4 must pass there (the image size is the data's to check).
  cfg.algorithms = ["ccst"]
  assemble.check_algorithms(cfg)
  cfg.ccst.k = 0
  with pytest.raises(ConfigError, match="ccst.k=0"):
    assemble.check_algorithms(cfg)
  assert ccst.uses_data({})


def test_two_clients_are_enough_and_one_is_refused(fed, model):
  two = synthetic_federation(num_clients=2, per_domain=30, size=8)
  assert int(np.sum(np.asarray(two.train.n) > 0)) == 2
  assert _build(two, model, k=2).name == "ccst"  # 2 clients holding data
  with pytest.raises(ConfigError, match=r"^ccst needs >= 2 clients \(a client "
                     r"transfers its images to the others' styles\)$"):
    assemble.algorithm("ccst", model, 1, base_config(), data=fed)


# --------------------------------------------------------------------------
# The committed offline AdaIN (experiments/ccst_pretrain.py) on the benchmark.

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"
WEIGHTS = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                       "experiments", "weights",
                       "adain_synthetic_d1_{}.safetensors")


@pytest.mark.skipif(not os.path.exists(os.path.join(
    FMNIST_DIR, "t10k-images-idx3-ubyte.gz")), reason="no dataset-fashion-mnist")
def test_synthetic_adain_reconstructs_and_restyles_styled_fashion_mnist():
  """The committed AdaIN stand-in, trained on synthetic images only, on 20
  Styled Fashion-MNIST test images per domain: AdaIN with an image's own
  style gives the image back (pixel MSE < 0.01, 20x below random weights'),
  and AdaIN to another domain's overall style moves every image set's mean
  colour at least halfway to that domain's (random weights: not so)."""
  from fedjax_dg.data.builders import fashion_mnist_base as fmb
  from fedjax_dg.data.builders import styled_fashion_mnist as sfm
  raw = fmb.read_idx_splits(FMNIST_DIR)["test"][0][:20]
  x = np.stack([sfm.render_all(raw, [d] * 20, range(20))
                for d in range(5)])                  # [domain, 20, 28, 28, 3]
  # Every computation jitted, the rest numpy (eagerly: ~45 programs).
  x01 = np.asarray(jax.jit(jax.vmap(ccst.to_unit_rgb))(x))
  colour = x01.mean(axis=(1, 2, 3))                    # [domain, 3]
  transfer = jax.jit(lambda net, x, m, s: jnp.clip(adain.transfer(
      net, x, m, s, depth=1), 0.0, 1.0))
  overall = jax.jit(lambda net, x: ccst.overall_style(
      net, x, jnp.int32(20), depth=1, chunk=20, eps=1e-5))
  own_stats = jax.jit(lambda net, x: adain.instance_stats(adain.encode(
      net, x, depth=1)))

  def measure(net):
    flat = x01.reshape((-1, 28, 28, 3))
    own = own_stats(net, flat)
    mse = float(np.mean(np.square(np.asarray(transfer(net, flat, *own))
                                  - flat)))
    moved = []
    for b in range(5):
      style = overall(net, x[b])
      for a in set(range(5)) - {b}:
        out = np.asarray(transfer(net, x01[a], *(
            np.repeat(np.asarray(v), 20, 0) for v in style[:2])))
        moved.append(np.linalg.norm(np.mean(out, (0, 1, 2)) - colour[b])
                     / np.linalg.norm(colour[a] - colour[b]))
    return mse, np.array(moved)

  trained = adain.load(WEIGHTS.format("vgg"), WEIGHTS.format("decoder"), 1)
  mse, moved = measure(trained)
  mse_random, moved_random = measure(adain.init(jax.random.key(0), 1, 28))
  assert mse < 0.01 and mse < mse_random / 20, (mse, mse_random)
  assert np.all(moved < 0.5), moved
  assert not np.all(moved_random < 0.5), moved_random
