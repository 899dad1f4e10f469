"""FedCCRL (Wang & Tang): cross-client style transfer, AugMix, supervised
contrastive and Jensen-Shannon alignment in the local objective; FedAvg on the
server (the paper's Algorithms 1-3, Eq. 3-16).

    F_i        = per-image, per-channel (mean, std) of the normalized inputs of
                 ceil(r n_i) random examples of client i         (Eq. 6-8)
    pool       = all clients' F; client i draws from pool \\ F_i (Alg. 1, l. 7)
    X1, X2     = DIFP(CCDT(X)), two independent draws            (Eq. 3, Alg. 2-3)
    Z, Z1, Z2  = features (the input of the last Linear layer)  (Eq. 4)
    L          = L_CLS + lambda1 L_RA + lambda2 L_JS              (Eq. 12, 14-16)
    server     = example-weighted FedAvg                          (Eq. 2)

The style statistics reach the server as its message and the pool lives in
the server state ([N, S, C], S = ceil(r n_max), a validity mask [N, S]); each
client reads it as `ctx.shared`. The statistics depend on the data only, not
on the model, so the pool a client reads in round t was drawn in round t-1
(by each client's end of round) and before round 0 from the data (`build`):
the same distribution as a draw at the start of round t, without a second
pass over the clients inside the round. Choices and the released code's
readings: docs/faithfulness.md, "FedCCRL".

Ablations (Table 2): `ccdt`, `difp` switch the two augmentations off (off
both: the two views equal the original batch), `lambda1=0` / `lambda2=0` drop
L_RA / L_JS. Round metrics: `ccdt_pool_size` (valid statistics in the pool).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import augment
from fedjax_dg.client import objectives
from fedjax_dg.client.style_pool import (StylePool, pool_slots, sampled_rows,
                                         valid_slots)
from fedjax_dg.errors import ConfigError, NeedsDataError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "FedCCRL"
PAPER = dict(
    title=("FedCCRL: Federated Domain Generalization with Cross-Client "
           "Representation Learning"),
    authors="Wang, Guo, Tang", venue="arXiv 2410.11267", year=2024)
# Section 4.2: Adam, lr 1e-3, a cosine schedule over the run
# (`optim.cosine_over_run`: per local epoch over rounds x epochs, the code's).
CLIENT = dict(optimizer="adam", lr=1e-3, weight_decay=0.0, schedule="cosine")
OVERFLOW = ("clamp", "wrap")
CLS = ("mean", "sum")
# Arguments of the compiled programs, not constants (`algorithms.recipe`): a
# grid over them shares one compile. A loss weight is off (its term not
# computed) only when it is a constant 0; a traced weight always computes its
# term, which a 0 then multiplies away (the same numbers).
TRACED = ("temperature", "lambda1", "lambda2")


class FedCCRLState(NamedTuple):
  params: dict
  opt: optax.OptState
  pool: StylePool


def uses_data(hparams) -> bool:
  """CCDT's first pool is drawn from the run's data."""
  return bool(hparams.get("ccdt", True))


def prepare(model, *, data, seed: int = 0, r: float = 0.1, eps: float = 1e-6,
            ccdt: bool = True, **unused) -> dict:
  """What `build` derives from the run's data, as arrays (the recipe's
  values, `algorithms.recipe`: runs of other seeds and data then share one
  program): CCDT's first style pool, every client's F_i from its own
  examples (`client_styles`, keyed by `seed`). {} without CCDT."""
  del unused
  if not ccdt:
    return {}
  n = jnp.asarray(data.train.n)
  if int(jnp.sum(n > 0)) < 2:
    raise ConfigError("fedccrl.ccdt=True needs >= 2 clients holding data")
  slots = pool_slots(r, int(data.train.x.shape[1]))
  keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0xCC),
                          n.shape[0])
  first = jax.jit(jax.vmap(
      lambda x, n_i, k: client_styles(model, x, n_i, k, r, slots, eps)))(
          jnp.asarray(data.train.x), n, keys)
  return dict(first=jax.tree.map(np.asarray, first))


def client_styles(model, x: jax.Array, n: jax.Array, key: jax.Array, r: float,
                  slots: int, eps: float) -> StylePool:
  """One client's F_i (Eq. 8): statistics of ceil(r n) random examples of its
  `n` valid ones (x: uint8 [n_max, ...]); rows past ceil(r n) are invalid."""
  imgs = model.normalize(sampled_rows(x, n, key, slots))
  mu, sig = jax.vmap(lambda im: augment.style_stats(im, eps))(imgs)
  return StylePool(mu, sig, valid_slots(r, n, slots))


def build(model, optimizer, *, r: float = 0.1,  # share of statistics uploaded
          alpha: float = 0.1,        # CCDT's Beta(alpha, alpha)
          beta: float = 1.0,         # DIFP's (AugMix) Dirichlet / Beta
          temperature: float = 0.1,  # supervised contrastive tau
          lambda1: float = 0.1,      # L_RA weight (0: off)
          lambda2: float = 0.1,      # L_JS weight (0: off)
          ccdt: bool = True,         # cross-client style transfer (Table 2)
          difp: bool = True,         # the AugMix views (Table 2)
          eps: float = 1e-6,         # inside the std's square root (MixStyle)
          augmix_width: int = 3,     # chains; 0: k ~ U{1,2,3} (the appendix)
          augmix_severity: float = 3.0,  # AugMix operations' strength
          augmix_per_batch: bool = False,  # released code: one chain per batch
          pixel_overflow: str = "clamp",   # clamp (paper) | wrap (released code)
          cls_loss: str = "mean",          # Eq. 16's 1/3 | sum (released code)
          num_clients: int = 0, data=None, seed: int = 0, prepared=None,
          name: str = "fedccrl") -> Algorithm:
  """FedCCRL on `model` (any model with `features` + `head`). `prepared`:
  `prepare`'s arrays (the first style pool), given instead of `data`."""
  checks = [(0 < r <= 1, f"fedccrl.r={r!r}: the share of statistics uploaded "
                         "must be in (0, 1]"),
            (alpha > 0, f"fedccrl.alpha={alpha!r}: must be > 0"),
            (beta > 0, f"fedccrl.beta={beta!r}: must be > 0"),
            (not is_concrete(temperature) or temperature > 0,
             f"fedccrl.temperature={temperature!r}: must be > 0"),
            (not is_concrete(lambda1) or not is_concrete(lambda2)
             or (lambda1 >= 0 and lambda2 >= 0),
             f"fedccrl.lambda1={lambda1!r}, lambda2={lambda2!r}: must be >= 0"),
            (eps > 0, f"fedccrl.eps={eps!r}: must be > 0"),
            (augmix_width >= 0, f"fedccrl.augmix_width={augmix_width!r}: a "
                                "chain count >= 1, or 0 (k ~ U{1,2,3})"),
            (augmix_severity > 0.1, f"fedccrl.augmix_severity="
                                    f"{augmix_severity!r}: must be > 0.1"),
            (pixel_overflow in OVERFLOW, f"fedccrl.pixel_overflow="
                                         f"{pixel_overflow!r}: allowed {OVERFLOW}"),
            (cls_loss in CLS, f"fedccrl.cls_loss={cls_loss!r}: allowed {CLS}"),
            (not ccdt or num_clients != 1,
             "fedccrl.ccdt=True needs >= 2 clients (a client draws the others' "
             "statistics)")]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  if ccdt and data is None and prepared is None:
    raise NeedsDataError("fedccrl.ccdt=True draws its first style pool from the "
                         "run's data: algorithms.build(..., data=fed)")
  mean = jnp.asarray(model.mean, jnp.float32)
  std = jnp.asarray(model.std, jnp.float32)

  if ccdt:
    if prepared is None:
      prepared = prepare(model, data=data, seed=seed, r=r, eps=eps)
    first = jax.tree.map(jnp.asarray, prepared["first"])
  else:
    ch = model.input_shape[-1]
    first = StylePool(jnp.zeros((max(num_clients, 1), 1, ch)),
                      jnp.ones((max(num_clients, 1), 1, ch)),
                      jnp.zeros((max(num_clients, 1), 1), bool))

  def view(x, key, ctx):
    """One draw of M(X) = DIFP(CCDT(X)) on a normalized batch [B, H, W, C]."""
    k_pick, k_lam, k_chain, k_mix = jax.random.split(key, 4)
    b = x.shape[0]
    if ccdt:
      pool = ctx.shared
      mu2, sig2 = augment.sample_foreign(k_pick, pool.mu, pool.sig, pool.valid,
                                         ctx.id, b)
      lam = augment.symmetric_beta(k_lam, alpha, (b,))
      x = jax.vmap(lambda im, m, s, l: augment.mixstyle(im, m, s, l, eps))(
          x, mu2, sig2, lam)
    if difp:
      pix = augment.to_pixels(x, mean, std, pixel_overflow)
      chain_keys = (jnp.broadcast_to(k_chain, (b,)) if augmix_per_batch
                    else jax.random.split(k_chain, b))
      out = jax.vmap(lambda im, kc, km: augment.augmix(
          im, kc, km, width=augmix_width, severity=augmix_severity, beta=beta))(
              pix, chain_keys, jax.random.split(k_mix, b))
      x = (out / 255.0 - mean) / std
    return x

  def on(weight):
    return not is_concrete(weight) or weight > 0

  def loss(params, batch, rng, ctx):
    k_drop, k1, k2 = jax.random.split(rng, 3)
    x = model.normalize(batch.x)
    xs = jnp.concatenate([x, view(x, k1, ctx), view(x, k2, ctx)])
    feats = model.features(params, xs, train=True, rng=k_drop, normalized=True)
    logits = model.head(params, feats)
    z, l = jnp.split(feats, 3), jnp.split(logits, 3)
    ce = [objectives.masked_mean(
        optax.softmax_cross_entropy_with_integer_labels(li, batch.y), batch.mask)
          for li in l]
    total = sum(ce) / (3.0 if cls_loss == "mean" else 1.0)
    if on(lambda1):
      sc = lambda za: objectives.supervised_contrastive(
          za, z[0], batch.y, batch.mask, temperature)
      total = total + lambda1 * 0.5 * (sc(z[1]) + sc(z[2]))
    if on(lambda2):
      total = total + lambda2 * objectives.js_divergence(l, batch.mask)
    return total

  base = fedavg(model, optimizer, loss, name=name)
  slots = first.valid.shape[1]

  def init(key):
    server, clients = base.init(key)
    return FedCCRLState(server.params, server.opt, first), clients

  def end(ctx, trained, data_i, key):  # message: its style statistics
    del trained
    return ctx.state, client_styles(model, data_i.x, data_i.n, key, r, slots,
                                    eps)

  def server_update(server, result: ClientResult, key):
    new, metrics = base.server.update(ServerState(server.params, server.opt),
                                      result, key)
    pool = server.pool
    if ccdt:
      pool = tree.put(server.pool, result.ids, result.message)
    metrics = dict(metrics, ccdt_pool_size=jnp.sum(pool.valid))
    return FedCCRLState(new.params, new.opt, pool), metrics

  return base.replace(
      init=init, update=server_update,
      shared=(lambda server: server.pool) if ccdt else base.client.shared,
      end=ClientEnd(end, reads_data=True) if ccdt else None)
