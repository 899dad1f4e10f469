"""ELCFS / FedDG (Liu et al., CVPR 2021): episodic learning in continuous
frequency space; FedAvg on the server.

    bank       = per client, the low-frequency amplitude windows of
                 ceil(f n_i) random images (`client.frequency.bank_entry`);
                 client i draws from the other clients' entries only
    x_trs      = x with its low-frequency amplitude interpolated toward a
                 foreign entry, lam ~ U(lam_low, lam_high) per image, its own
                 phase kept, clamped to 0..255          (`frequency.transfer`)
    meta-train L_inn  = CE(f(x; theta))
               theta' = theta - beta * clip(grad L_inn, -c, c)
    meta-test  L_out  = CE(f(x_trs; theta'))
                        + gamma * NT-Xent([z(x; theta), z(x_trs; theta')], y)
    local loss = L_inn + L_out, minimised over theta by the client optimizer
    server     = example-weighted FedAvg

First order (the released code, `torch.autograd.grad` without
`create_graph`): grad L_inn is a constant, so theta' moves with theta and the
meta-test gradient is the gradient at theta'. `second_order=True`
differentiates through the inner step (MAML). The paper's boundary-oriented
contrastive loss contrasts embeddings of boundary and background regions of a
segmentation mask; for classification the regions' labels become the class
labels: features of the raw images (at theta) and of their
frequency-transformed versions (at theta') of one class attract, of other
classes repel (`objectives.ntxent`, the code's `NTXentLoss`, temperature
0.05, weight 0.1; `contrastive_weight=0` drops it).

The bank reaches the server as its message and lives in the server state
([N, S, k, k, C], S = ceil(f n_max), k = 2b + 1 the window, a validity mask
[N, S]); each client reads it as `ctx.shared`. The amplitudes depend on the
data only, so the first bank is drawn at `build` and each round's cohort
re-draws its rows (`refresh_bank=False`: the first bank for the whole run,
as the code's offline bank). Choices and the code's readings:
docs/faithfulness.md, "ELCFS (FedDG)". Round metric: `elcfs_bank_size`.
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
from fedjax_dg.client import frequency
from fedjax_dg.client import objectives
from fedjax_dg.client.style_pool import pool_slots, sampled_rows, valid_slots
from fedjax_dg.errors import ConfigError, NeedsDataError

DISPLAY_NAME = "ELCFS"
PAPER = dict(
    title=("FedDG: Federated Domain Generalization on Medical Image "
           "Segmentation via Episodic Learning in Continuous Frequency "
           "Space"),
    authors="Liu et al.", venue="CVPR", year=2021)
# The released code: Adam (betas 0.9, 0.999), lr 1e-3, per client.
CLIENT = dict(optimizer="adam", lr=1e-3, weight_decay=0.0)


class AmplitudeBank(NamedTuple):
  """Amplitude windows [N, S, k, k, C] and their validity [N, S] (or one
  client's row of each, as its end of round sends them)."""
  amp: jax.Array
  valid: jax.Array


class ELCFSState(NamedTuple):
  params: dict
  opt: optax.OptState
  bank: AmplitudeBank


def uses_data(hparams) -> bool:
  """The first amplitude bank is drawn from the run's data."""
  del hparams
  return True


def client_bank(x: jax.Array, n: jax.Array, key: jax.Array, fraction: float,
                slots: int, ratio: float) -> AmplitudeBank:
  """One client's bank rows: the windows of ceil(f n) random images among its
  `n` valid ones (x: uint8 [n_max, H, W, C]); rows past ceil(f n) invalid."""
  imgs = sampled_rows(x, n, key, slots).astype(jnp.float32)
  amp = jax.vmap(lambda im: frequency.bank_entry(im, ratio))(imgs)
  return AmplitudeBank(amp, valid_slots(fraction, n, slots))


def transformed_batch(pixels, key, bank: AmplitudeBank, own, *, ratio: float,
                      lam_low: float, lam_high: float) -> jax.Array:
  """The batch [B, H, W, C] (pixel values) with each image's low-frequency
  amplitude interpolated toward an entry of another client's bank rows,
  lam ~ U(lam_low, lam_high) per image."""
  k_pick, k_lam = jax.random.split(key)
  b = pixels.shape[0]
  clients, slots = frequency.sample_foreign(k_pick, bank.valid, own, b)
  lam = jax.random.uniform(k_lam, (b,), minval=lam_low, maxval=lam_high)
  return jax.vmap(lambda im, w, l: frequency.transfer(im, w, l, ratio))(
      pixels, bank.amp[clients, slots], lam)


def _ce(logits, y, mask):
  return objectives.masked_mean(
      optax.softmax_cross_entropy_with_integer_labels(logits, y), mask)


def episodic_loss(model, params, x, x_trs, y, mask, k_inner, k_outer, *,
                  meta_step_size: float, clip_value: float,
                  second_order: bool, contrastive_weight: float,
                  temperature: float) -> jax.Array:
  """L_inn(theta) + L_out(theta') on normalized inputs x (the raw batch) and
  x_trs (its frequency-transformed version); `k_inner` / `k_outer` are the
  two passes' dropout keys (the inner gradient reuses the inner pass's)."""

  def inner(p):
    z = model.features(p, x, train=True, rng=k_inner, normalized=True)
    return _ce(model.head(p, z), y, mask), z

  (l_inn, z_in), g = jax.value_and_grad(inner, has_aux=True)(params)
  g = jax.tree.map(lambda v: jnp.clip(v, -clip_value, clip_value), g)
  if not second_order:
    g = jax.lax.stop_gradient(g)
  fast = jax.tree.map(lambda p, v: p - meta_step_size * v, params, g)
  z_out = model.features(fast, x_trs, train=True, rng=k_outer, normalized=True)
  total = l_inn + _ce(model.head(fast, z_out), y, mask)
  if contrastive_weight > 0:
    total = total + contrastive_weight * objectives.ntxent(
        jnp.concatenate([z_in, z_out]), jnp.concatenate([y, y]),
        jnp.concatenate([mask, mask]), temperature)
  return total


def prepare(model, *, data, seed: int = 0, ratio: float = 0.1,
            bank_fraction: float = 0.125, **unused) -> dict:
  """What `build` derives from the run's data, as arrays (the recipe's
  values, `algorithms.recipe`): the first amplitude bank, every client's
  spectra of `bank_fraction` of its images (`client_bank`, keyed by
  `seed`)."""
  del model, unused
  n = jnp.asarray(data.train.n)
  if int(jnp.sum(n > 0)) < 2:
    raise ConfigError("elcfs needs >= 2 clients holding data")
  slots = pool_slots(bank_fraction, int(data.train.x.shape[1]))
  keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0xF7),
                          n.shape[0])
  first = jax.jit(jax.vmap(lambda x, n_i, k: client_bank(
      x, n_i, k, bank_fraction, slots, ratio)))(jnp.asarray(data.train.x), n,
                                                 keys)
  return dict(first=jax.tree.map(np.asarray, first))


def build(model, optimizer, *,
          ratio: float = 0.1,          # window half-width / min(H, W) (code: L)
          lam_low: float = 0.0,        # the foreign amplitude's weight is
                                       # drawn from U(lam_low, lam_high)
          lam_high: float = 1.0,       # upper end of that draw
          bank_fraction: float = 0.125,  # share of a client's images in the
                                         # bank (code: 1/8)
          refresh_bank: bool = True,   # the cohort re-draws its bank rows
          meta_step_size: float = 1e-3,  # beta, the inner SGD step
          clip_value: float = 100.0,   # inner gradient clamp
          second_order: bool = False,  # differentiate through the inner step
          contrastive_weight: float = 0.1,  # gamma (0: no contrastive loss)
          temperature: float = 0.05,   # NT-Xent temperature
          num_clients: int = 0, data=None, seed: int = 0, prepared=None,
          name: str = "elcfs") -> Algorithm:
  """ELCFS on `model` (any model with `features` + `head`). `prepared`:
  `prepare`'s arrays (the first amplitude bank), given instead of `data`."""
  checks = [
      (0.0 <= ratio <= 0.5, f"elcfs.ratio={ratio!r}: allowed [0, 0.5] (the "
                            "window's half-width over min(H, W); 0 keeps the "
                            "DC term only)"),
      (0.0 <= lam_low <= lam_high <= 1.0,
       f"elcfs.lam_low={lam_low!r}, lam_high={lam_high!r}: need 0 <= lam_low "
       "<= lam_high <= 1"),
      (0.0 < bank_fraction <= 1.0, f"elcfs.bank_fraction={bank_fraction!r}: "
                                   "the share of images banked, in (0, 1]"),
      (meta_step_size >= 0, f"elcfs.meta_step_size={meta_step_size!r}: must "
                            "be >= 0"),
      (clip_value > 0, f"elcfs.clip_value={clip_value!r}: must be > 0"),
      (contrastive_weight >= 0, f"elcfs.contrastive_weight="
                                f"{contrastive_weight!r}: must be >= 0"),
      (temperature > 0, f"elcfs.temperature={temperature!r}: must be > 0"),
      (num_clients != 1, "elcfs needs >= 2 clients (a client draws the "
                         "others' amplitude spectra)"),
  ]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  if data is None and prepared is None:
    raise NeedsDataError("elcfs draws its first amplitude bank from the run's "
                         "data: algorithms.build(..., data=fed)")
  if prepared is None:
    prepared = prepare(model, data=data, seed=seed, ratio=ratio,
                       bank_fraction=bank_fraction)
  first = jax.tree.map(jnp.asarray, prepared["first"])
  slots = first.valid.shape[1]
  hp = dict(meta_step_size=meta_step_size, clip_value=clip_value,
            second_order=second_order, contrastive_weight=contrastive_weight,
            temperature=temperature)

  def loss(params, batch, rng, ctx):
    k_view, k_inner, k_outer = jax.random.split(rng, 3)
    pixels = batch.x.astype(jnp.float32)
    x = model.normalize(pixels / 255.0)
    x_trs = model.normalize(transformed_batch(
        pixels, k_view, ctx.shared, ctx.id, ratio=ratio, lam_low=lam_low,
        lam_high=lam_high) / 255.0)
    return episodic_loss(model, params, x, x_trs, batch.y, batch.mask,
                         k_inner, k_outer, **hp)

  base = fedavg(model, optimizer, loss, name=name)

  def init(key):
    server, clients = base.init(key)
    return ELCFSState(server.params, server.opt, first), clients

  def end(ctx, trained, data_i, key):  # message: its amplitude spectra
    del trained
    return ctx.state, client_bank(data_i.x, data_i.n, key, bank_fraction,
                                  slots, ratio)

  def server_update(server, result: ClientResult, key):
    new, metrics = base.server.update(ServerState(server.params, server.opt),
                                      result, key)
    bank = server.bank
    if refresh_bank:
      bank = tree.put(server.bank, result.ids, result.message)
    metrics = dict(metrics, elcfs_bank_size=jnp.sum(bank.valid))
    return ELCFSState(new.params, new.opt, bank), metrics

  return base.replace(
      init=init, update=server_update, shared=lambda server: server.bank,
      end=ClientEnd(end, reads_data=True) if refresh_bank else None)
