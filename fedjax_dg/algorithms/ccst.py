"""CCST (Chen, Jiang, Dou & Chen, WACV 2023): cross-client style transfer with
a frozen AdaIN network; FedAvg on the server.

    style     = per-channel mean and std of the frozen VGG encoder's
                relu{depth}_1 features of [0, 1] RGB images (`models/adain.py`)
    overall   = one style per client: the pooled mean and std of the features
                of all its images (the reference code's running sums)
    single    = ceil(r n_i) styles of random single images of client i
    bank      = the clients' styles pooled on the server, read by every client
    local     = per image of a batch, K views (the augmentation level K):
      "reference":    K distinct clients among those holding data, the client
                      itself included (the authors' data-list generator); the
                      client's own draw is the original image, another
                      client's draw the image AdaIN-transferred to a style of
                      that client; loss = mean cross-entropy over the K B views
      "fedccrl_code": CE(x) + sum_{j < k'} CE(view_j), k' ~ U{0..K} per batch,
                      each view per image a random style of another client
                      (FedCCRL's released CCST client)
    transfer  = decode(alpha AdaIN(f, style) + (1 - alpha) f), clipped to
                [0, 1], then the classifier's input normalization
    server    = example-weighted FedAvg (McMahan et al. 2017)

The authors' code transfers each client's dataset offline (K styled copies
of every image, training on the union); here the transfer runs inside the
jitted local step on every batch, so the expected loss of a step is the
augmented dataset's and every epoch sees new draws. The AdaIN network is
shared-frozen (`Algorithm.frozen`: held once outside the scan carry, never
trained or stacked; `ctx.frozen["adain"]`). The overall style depends on
the data and the frozen encoder only: computed once at build (before
training, as the authors' code), never re-sent. Single-image styles are
drawn at build for round 0 and, with `refresh`, redrawn by every cohort
client each round (its end of round's message, the FedCCRL code's reading),
pooled by the server, read through `client.shared`. `bank="both"`: each view of a batch
uses the single or the overall bank with probability 1/2 (FedCCRL's code).
Round metric: `ccst_bank_size` (valid styles in the banks). Choices and the
references' readings: docs/faithfulness.md, "CCST".

Weights: `vgg` / `decoder` name the reference release's files
(`vgg_normalised.pth`, `decoder.pth`, or `.safetensors`; docs/models.md,
"AdaIN (CCST)"); empty: random weights (tests and wiring only: the transfer
is meaningless). `depth` < 4 truncates the encoder (cheap tests); the
reference decoder is depth 4's. experiments/ccst_pretrain.py writes an
offline stand-in at depth 1 (trained on synthetic images; docs/faithfulness.md).
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.style_pool import (StylePool, pool_slots, sampled_rows,
                                         valid_slots)
from fedjax_dg.errors import (ConfigError, DataError, NeedsDataError,
                              StandInWarning)
from fedjax_dg.models import adain

DISPLAY_NAME = "CCST"
PAPER = dict(
    title=("Federated Domain Generalization for Image Recognition via "
           "Cross-Client Style Transfer"),
    authors="Chen, Jiang, Dou, Chen", venue="WACV", year=2023)
# The reference code's clients: plain SGD (`optim.SGD(lr=args.lr)`), the
# README's lr 1e-3, no momentum or weight decay.
CLIENT = dict(optimizer="sgd", lr=1e-3, momentum=0.0, weight_decay=0.0)
BANKS = ("overall", "single", "both")
OBJECTIVES = ("reference", "fedccrl_code")
FROZEN = "adain"  # the shared-frozen entry: {"adain": {"encoder", "decoder"}}
RANDOM_WEIGHTS = ("ccst: no AdaIN weights (ccst.vgg, ccst.decoder): a randomly "
                  "initialized network re-styles the images, for tests only "
                  "(docs/models.md, \"AdaIN (CCST)\")")


class CCSTState(NamedTuple):
  params: dict
  opt: optax.OptState
  single: StylePool | None   # [N, S, C] per-image styles (None: not used)
  overall: StylePool | None  # [N, 1, C] one style per client (None: not used)


def uses_data(hparams) -> bool:
  """The first style bank is computed from the run's data."""
  del hparams
  return True


def to_unit_rgb(x: jax.Array) -> jax.Array:
  """uint8 images [..., H, W, 1 or 3] -> float RGB in [0, 1] (grey repeated)."""
  x = x.astype(jnp.float32) / 255.0
  return jnp.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def image_stats(net, x: jax.Array, *, depth: int,
                chunk: int) -> tuple[jax.Array, jax.Array]:
  """Per image of x (uint8 [m, H, W, ch]): the mean and population variance
  of each relu{depth}_1 channel, [m, C] each; `chunk` images per encoder
  pass (sequential, so memory stays one chunk's)."""
  m = x.shape[0]
  pad = -m % chunk
  xp = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

  def one(xc):
    f = adain.encode(net, to_unit_rgb(xc), depth=depth)
    mean = jnp.mean(f, axis=(1, 2))
    var = jnp.mean(jnp.square(f - mean[:, None, None]), axis=(1, 2))
    return mean, var

  mean, var = jax.lax.map(one, xp.reshape((-1, chunk) + x.shape[1:]))
  flat = lambda a: a.reshape((-1,) + a.shape[2:])[:m]
  return flat(mean), flat(var)


def overall_style(net, x: jax.Array, n: jax.Array, *, depth: int, chunk: int,
                  eps: float) -> StylePool:
  """One client's overall style [1, C]: the mean and sqrt(var + eps) of each
  channel over all positions of all its `n` images (law of total variance
  over the per-image statistics: the reference's pooled sums, stably)."""
  mean_i, var_i = image_stats(net, x, depth=depth, chunk=chunk)
  w = (jnp.arange(x.shape[0]) < n).astype(jnp.float32)[:, None]
  count = jnp.maximum(jnp.sum(w), 1.0)
  mean = jnp.sum(w * mean_i, axis=0) / count
  var = jnp.sum(w * (var_i + jnp.square(mean_i - mean)), axis=0) / count
  return StylePool(mean[None], jnp.sqrt(var + eps)[None], (n > 0)[None])


def single_styles(net, x: jax.Array, n: jax.Array, key: jax.Array, *, r: float,
                  slots: int, depth: int, chunk: int, eps: float) -> StylePool:
  """One client's single-image styles [S, C]: of ceil(r n) random distinct
  images among its `n`; the rows past ceil(r n) are invalid."""
  mean, var = image_stats(net, sampled_rows(x, n, key, slots), depth=depth,
                          chunk=min(chunk, slots))
  return StylePool(mean, jnp.sqrt(var + eps), valid_slots(r, n, slots))


def draw_styles(key: jax.Array, bank: StylePool, own: jax.Array, num: int,
                k: int, *, include_own: bool, distinct: bool):
  """K styles for each of `num` images: (mean [num, k, C], std [num, k, C],
  is_own [num, k]).

  A client is drawn uniformly among those with a valid style (the client
  `own` itself only with `include_own`), then one of its valid styles
  uniformly. `distinct`: the k clients of an image are distinct (a random
  k-subset; needs k <= the candidates), else independent draws.
  """
  k_client, k_slot = jax.random.split(key)
  n_clients, slots = bank.valid.shape
  ok = jnp.any(bank.valid, axis=1)
  if not include_own:
    ok = ok & (jnp.arange(n_clients) != own)
  logits = jnp.where(ok, 0.0, -jnp.inf)
  if distinct:
    g = jax.random.gumbel(k_client, (num, n_clients)) + logits
    clients = jax.lax.top_k(g, k)[1]
  else:
    clients = jax.random.categorical(k_client, logits, shape=(num, k))
  slot_logits = jnp.where(bank.valid[clients], 0.0, -jnp.inf)  # [num, k, S]
  slot = jax.random.categorical(k_slot, slot_logits)
  mean = bank.mu[clients, slot]
  std = bank.sig[clients, slot]
  return mean, std, clients == own


def prepare(model, *, data, seed: int = 0, depth: int = 4,
            bank: str = "overall", k: int = 3, r: float = 0.5,
            objective: str = "reference", eps: float = 1e-5, vgg: str = "",
            decoder: str = "", style_chunk: int = 32, **unused) -> dict:
  """What `build` derives from the run's data and seed, as arrays (the
  recipe's values, `algorithms.recipe`): the AdaIN network (the weight
  files', or random weights drawn from `seed`) and the first single /
  overall style banks of every client's examples."""
  del unused
  h, w, ch = model.input_shape
  if ch not in (1, 3):
    raise ConfigError(f"ccst needs RGB or grey images, got {ch} channels")
  if min(h, w) < adain.min_image_size(depth):
    raise ConfigError(
        f"ccst.depth={depth}: images of {h}x{w} are too small for the "
        f"relu{depth}_1 encoder (reflection padding needs a 2x2 map: sides "
        f">= {adain.min_image_size(depth)}); use a smaller depth")
  n = np.asarray(data.train.n)
  holding = int(np.sum(n > 0))
  if holding < 2:
    raise ConfigError("ccst needs >= 2 clients holding data")
  if objective == "reference" and k > holding:
    raise ConfigError(f"ccst.k={k}: objective='reference' draws K distinct "
                      f"clients per image (itself included): at most the "
                      f"{holding} clients holding data")
  if vgg:
    net = adain.load(vgg, decoder, depth)
  else:
    warnings.warn(RANDOM_WEIGHTS, StandInWarning, stacklevel=3)
    net = jax.device_get(adain.init(
        jax.random.fold_in(jax.random.key(seed), 0xADA1), depth, min(h, w)))
  style = dict(depth=depth, chunk=style_chunk, eps=eps)
  slots = pool_slots(r, int(data.train.x.shape[1]))
  x_all, n_all = jnp.asarray(data.train.x), jnp.asarray(n)
  single0 = overall0 = None
  if bank in ("single", "both"):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0xCC57),
                            n.shape[0])
    single0 = jax.jit(lambda x, n_, ks: jax.lax.map(
        lambda a: single_styles(net, *a, r=r, slots=slots, **style),
        (x, n_, ks)))(x_all, n_all, keys)
  if bank in ("overall", "both"):
    overall0 = jax.jit(lambda x, n_: jax.lax.map(
        lambda a: overall_style(net, *a, **style), (x, n_)))(x_all, n_all)
  host = lambda t: None if t is None else jax.tree.map(np.asarray, t)
  return dict(net=host(net), single=host(single0), overall=host(overall0))


def build(model, optimizer, *, depth: int = 4,  # encoder ends at relu{depth}_1
          bank: str = "overall",    # overall | single | both (FedCCRL's code)
          k: int = 3,               # augmentation level K (views per image)
          alpha: float = 1.0,       # AdaIN content-style interpolation
          r: float = 0.5,           # share of images sent as single styles
          refresh: bool = True,     # redraw single styles every round
          objective: str = "reference",  # reference | fedccrl_code
          eps: float = 1e-5,        # inside the std's square root (AdaIN code)
          vgg: str = "",            # vgg_normalised .pth / .safetensors
          decoder: str = "",        # decoder .pth / .safetensors ("": random)
          style_chunk: int = 32,    # images per encoder pass for the styles
          num_clients: int = 0, data=None, seed: int = 0, prepared=None,
          name: str = "ccst") -> Algorithm:
  """CCST on `model` (any model; the transfer runs on its input images).
  `prepared`: `prepare`'s arrays (the AdaIN network, the first style
  banks), given instead of `data`."""
  h, w, ch = model.input_shape
  checks = [
      (depth in adain.DEPTHS, f"ccst.depth={depth!r}: allowed {adain.DEPTHS} "
                              "(4: relu4_1, the paper's network)"),
      (bank in BANKS, f"ccst.bank={bank!r}: allowed {BANKS}"),
      (isinstance(k, int) and k >= 1, f"ccst.k={k!r}: the augmentation level "
                                      "must be an integer >= 1"),
      (0.0 <= alpha <= 1.0, f"ccst.alpha={alpha!r}: allowed [0, 1] (1: the "
                            "style's statistics, 0: the content's)"),
      (0.0 < r <= 1.0, f"ccst.r={r!r}: the share of images sent as single "
                       "styles must be in (0, 1]"),
      (objective in OBJECTIVES, f"ccst.objective={objective!r}: allowed "
                                f"{OBJECTIVES}"),
      (eps > 0, f"ccst.eps={eps!r}: must be > 0"),
      (bool(vgg) == bool(decoder), f"ccst.vgg={vgg!r}, ccst.decoder="
                                   f"{decoder!r}: give both weight files or "
                                   "neither (random weights)"),
      (style_chunk >= 1, f"ccst.style_chunk={style_chunk!r}: must be >= 1"),
      (num_clients != 1, "ccst needs >= 2 clients (a client transfers its "
                         "images to the others' styles)"),
  ]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  for path, key in ((vgg, "vgg"), (decoder, "decoder")):
    if path and not os.path.isfile(path):
      raise DataError(f"ccst.{key}={path!r}: no such file (docs/models.md, "
                      "\"AdaIN (CCST)\", says where the weights come from)")
  if data is None and prepared is None:
    raise NeedsDataError("ccst computes its first style bank from the run's "
                         "data: algorithms.build(..., data=fed)")
  if prepared is None:
    prepared = prepare(model, data=data, seed=seed, depth=depth, bank=bank,
                       k=k, r=r, objective=objective, eps=eps, vgg=vgg,
                       decoder=decoder, style_chunk=style_chunk)
  net, single0, overall0 = jax.tree.map(jnp.asarray, (
      prepared["net"], prepared["single"], prepared["overall"]))
  style = dict(depth=depth, chunk=style_chunk, eps=eps)
  use_single = bank in ("single", "both")
  slots = single0.valid.shape[1] if use_single else 0
  mean = jnp.asarray(model.mean, jnp.float32)
  std = jnp.asarray(model.std, jnp.float32)
  reference = objective == "reference"

  def views(x01, key, ctx):
    """[k, B, H, W, ch] re-styled, normalized classifier inputs."""
    k_bank, k_draw = jax.random.split(key)
    single, overall = ctx.shared
    kw = dict(include_own=reference, distinct=reference)
    b = x01.shape[0]
    if bank == "both":
      m1, s1, o1 = draw_styles(k_draw, single, ctx.id, b, k, **kw)
      m2, s2, o2 = draw_styles(k_draw, overall, ctx.id, b, k, **kw)
      coin = jax.random.bernoulli(k_bank, shape=(k,))  # per view
      m, s = (jnp.where(coin[:, None], a, c) for a, c in ((m1, m2), (s1, s2)))
      own = jnp.where(coin, o1, o2)
    else:
      m, s, own = draw_styles(k_draw, single if use_single else overall,
                              ctx.id, b, k, **kw)
    net_ = ctx.frozen[FROZEN]
    out = jax.lax.map(lambda a: adain.transfer(
        net_, x01, a[0], a[1], depth=depth, alpha=alpha, eps=eps),
                      (jnp.swapaxes(m, 0, 1), jnp.swapaxes(s, 0, 1)))
    out = jnp.clip(jax.lax.stop_gradient(out), 0.0, 1.0)
    if ch == 1:
      out = jnp.mean(out, axis=-1, keepdims=True)
    own = jnp.swapaxes(own, 0, 1)[..., None, None, None]  # [k, B, 1, 1, 1]
    gray = x01[..., :1] if ch == 1 else x01
    out = jnp.where(own, gray[None], out)
    return (out - mean) / std

  def loss(params, batch, rng, ctx):
    k_views, k_count, k_drop = jax.random.split(rng, 3)
    x01 = to_unit_rgb(batch.x)
    styled = views(x01, k_views, ctx)
    b = batch.x.shape[0]
    if reference:
      xs, weights = styled, jnp.full((k,), 1.0 / k)
    else:
      xs = jnp.concatenate([model.normalize(batch.x)[None], styled])
      used = jax.random.randint(k_count, (), 0, k + 1)
      weights = jnp.concatenate([jnp.ones((1,)),
                                 (jnp.arange(k) < used).astype(jnp.float32)])
    xs = xs.reshape((-1,) + xs.shape[2:])
    logits = model.apply(params, xs, train=True, rng=k_drop, normalized=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.tile(batch.y, xs.shape[0] // b)).reshape(-1, b)
    per_view = jax.vmap(lambda c: objectives.masked_mean(c, batch.mask))(ce)
    return jnp.sum(weights * per_view)

  base = fedavg(model, optimizer, loss, name=name)

  def init(key):
    server, clients = base.init(key)
    return CCSTState(server.params, server.opt, single0, overall0), clients

  def end(ctx, trained, data_i, key):  # message: its single-image styles
    del trained
    return ctx.state, single_styles(ctx.frozen[FROZEN], data_i.x, data_i.n,
                                    key, r=r, slots=slots, **style)

  def server_update(server, result: ClientResult, key):
    new, metrics = base.server.update(ServerState(server.params, server.opt),
                                      result, key)
    single = server.single
    if result.message is not None:
      single = tree.put(server.single, result.ids, result.message)
    size = sum(jnp.sum(b.valid) for b in (single, server.overall)
               if b is not None)
    return (CCSTState(new.params, new.opt, single, server.overall),
            dict(metrics, ccst_bank_size=size))

  return base.replace(
      init=init, update=server_update,
      shared=lambda server: (server.single, server.overall),
      end=(ClientEnd(end, reads_data=True) if use_single and refresh
           else None),
      frozen=lambda key: {FROZEN: jax.tree.map(jnp.asarray, net)})


__all__ = ["BANKS", "CCSTState", "DISPLAY_NAME", "OBJECTIVES", "build",
           "draw_styles", "image_stats", "overall_style", "single_styles",
           "to_unit_rgb", "uses_data"]
