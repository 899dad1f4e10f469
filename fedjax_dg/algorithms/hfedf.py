"""hFedF (hypernetwork-based federated fusion): Algorithm 1 of the paper.

    phi_i   = h(theta, v[i])                  client.start: generate each model
    local   : E epochs of cross-entropy       (Alg. 2)
    delta_i = phi_i - phi_i^trained           (pFedHN sign, old minus new)
    g_i     = J_i^T delta_i                   VJP through the generator
    g       = sum_i GradAlign_i g_i           (Alg. 3, separately for theta and v)
    theta, v <- Adam(+weight decay) step      (server optimizer)
    theta, v <- EMA(theta, v, t)              (Alg. 4, warm-up round w)

Everything is a composition of `server.hypernetwork.hypernetwork_server`
(the generator, the server step with GradAlign) and `server.ema`; pFedHN
(`algorithms.pfedhn`) is the same hypernetwork server without GradAlign and
EMA.

Variants (docs/faithfulness.md, "hFedF variants"):

* `embeddings`: "learned" (the paper's main results: N(0, 1) init, learned with
  theta), "random" (App. C.3 / Table 7: re-drawn N(0, 1) after every server
  update from the round's server key, never learned; only the generated
  parameters reach the clients), "autoencoder" (App. C.2 / Table 6: fixed
  data-conditioned embeddings, `autoencoder_embeddings`, computed once before
  training from the run's FederatedData).
* `gradalign_granularity`: "model" (the paper) or "tensor" (`server.gradalign`).
* `gradalign_over`: "separate" (the conference paper: theta and the embeddings
  each their own GradAlign), "joint" (arXiv v1: one weight per client over
  both) or "theta" (the embeddings' gradients unweighted).
* Table 3 ablations as algorithm names (`VARIANTS`): "hfedf_no_gradalign",
  "hfedf_no_ema", "hfedf_no_both".

Round metrics: `gradalign_theta` / `gradalign_emb` ([m] GradAlign weights, in
cohort order), `gradalign_theta_tensors` ([m, T], per-tensor GradAlign) and
`embeddings_mean`. Extras: the embedding table.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg.algorithms.base import (Algorithm, ClientResult, ClientSide,
                                       ServerSide)
from fedjax_dg.client.update import local_update
from fedjax_dg.errors import ConfigError, NeedsDataError
from fedjax_dg.models import autoencoder as ae
from fedjax_dg.server import ema as ema_transform
from fedjax_dg.server.gradalign import ALIGN_OVER, GRANULARITIES
from fedjax_dg.server.hypernetwork import (HyperParams, HypernetworkState,
                                          default_embed_dim,
                                          hypernetwork_server)
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "hFedF"
# Arguments of the compiled programs, not constants (`algorithms.recipe`):
# Fig. 11's grid over the EMA's alpha shares one compile, as does a grid over
# the server's learning rate or GradAlign's temperature.
TRACED = ("ema_decay", "server_lr", "temperature")
PAPER = dict(
    title=("Hypernetwork-Driven Model Fusion for Federated Domain "
           "Generalization"),
    authors="Bartholet, Kim, Beuret, Yun, Buhmann", venue="arXiv 2402.06974", year=2024)
# The clients' optimizer: the run's (Table 10: Adam lr 1e-3) with weight decay
# 1e-3 (Table 10, PACS).
CLIENT = dict(weight_decay=1e-3)
EMBEDDINGS = ("learned", "random", "autoencoder")
# Table 3's ablations, usable as algorithm names in `cfg.algorithms`: name ->
# (display name, overrides of the `hfedf` config section).
VARIANTS = {
    "hfedf_no_gradalign": ("hFedF w/o GradAlign", dict(gradalign=False)),
    "hfedf_no_ema": ("hFedF w/o EMA", dict(ema=False)),
    "hfedf_no_both": ("hFedF w/o GradAlign & EMA",
                      dict(gradalign=False, ema=False)),
}
# The same switches in a grid (`--grid hfedf.ema=True,False`): the report names
# such rows as the variants and compares them in Table 3.
ABLATIONS = {"gradalign": "GradAlign", "ema": "EMA"}
ABLATION_TABLE = "Table 3"


class HFedFState(NamedTuple):
  hp: HyperParams          # hypernetwork weights and the [N, e] embedding table
  opt: HypernetworkState   # the server optimizer and GradAlign weights
  ema: ema_transform.EmaState | optax.EmptyState


def uses_data(hparams) -> bool:
  """Autoencoder embeddings are computed from the run's data."""
  return hparams.get("embeddings") == "autoencoder"


def autoencoder_embeddings(data, latent: int, *, key: jax.Array,
                           num_images: int = 100, epochs: int = 50,
                           lr: float = 1e-3, batch_size: int = 20,
                           conv_impl: str = "auto") -> np.ndarray:
  """[N, latent] fixed client embeddings from the Table 6 autoencoder (App. C.2).

  Every client starts from the same autoencoder initialization ("each client
  receives the same autoencoder"), trains it locally with Adam on the MSE
  reconstruction of (at most) `num_images` of its training images for `epochs`
  epochs of `batch_size`, and sends the mean latent code of its validation
  images (of those training images without validation splits, val_fraction =
  0). One jitted
  program: clients vmapped (accelerators) or `lax.map`ped (CPU); the latent
  codes of the validation images are computed in chunks of 256.

  Args:
    data: a `FederatedData` (uint8 images with H, W divisible by 4).
    latent: the latent (= embedding) dimension e.
    key: seeds the shared initialization and each client's batch order.
  """
  tx = np.asarray(data.train.x)[:, :num_images]
  tn = np.minimum(np.asarray(data.train.n), num_images).astype(np.int32)
  vx, vn = np.asarray(data.val.x), np.asarray(data.val.n).astype(np.int32)
  module = ae.AutoEncoder(latent=int(latent), image_shape=tuple(tx.shape[2:]),
                          conv_impl=conv_impl)
  return np.asarray(_autoencoder_program(module, int(num_images), int(epochs),
                                         float(lr), int(batch_size))(
                                             key, tx, tn, vx, vn))


@functools.lru_cache(maxsize=8)
def _autoencoder_program(module, num_images, epochs, lr, batch_size):
  del num_images  # part of the cache key only (fixes the training-set shape)
  loss = ae.reconstruction_loss(module)
  opt = optax.adam(lr)
  mapped = (jax.vmap if jax.default_backend() != "cpu"
            else lambda f: lambda *a: jax.lax.map(lambda t: f(*t), a))

  def encode_mean(params, x, n):
    z = jax.lax.map(
        lambda im: module.apply({"params": params}, ae.to_unit(im[None]),
                                method=ae.AutoEncoder.encode)[0],
        x, batch_size=min(256, x.shape[0]))
    mask = (jnp.arange(x.shape[0]) < n).astype(jnp.float32)[:, None]
    return jnp.sum(z * mask, 0) / jnp.maximum(jnp.sum(mask), 1.0)

  @jax.jit
  def program(key, tx, tn, vx, vn):
    k_init, k_train = jax.random.split(key)
    params0 = ae.init_autoencoder(module, k_init)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(k_train,
                                                   jnp.arange(tx.shape[0]))

    def client(x, n, k, val_x, val_n):
      y = jnp.zeros(x.shape[:1], jnp.int32)
      params, _ = local_update(loss, opt, params0, x, y, n, k, None,
                               batch_size=batch_size, epochs=epochs)
      # Every client has >= 1 validation image unless val_fraction = 0.
      if val_x.shape[0] == 0:
        return encode_mean(params, x, n)
      return encode_mean(params, val_x, val_n)

    return mapped(client)(tx, tn, keys, vx, vn)

  return program


def prepare(model=None, *, data, seed: int = 0, num_clients: int = 0,
            embed_dim: int = 0, autoencoder_images: int = 100,
            autoencoder_epochs: int = 50, autoencoder_lr: float = 1e-3,
            autoencoder_batch_size: int = 20, **unused) -> dict:
  """What `build` derives from the run's data with
  `embeddings="autoencoder"`, as arrays (the recipe's values,
  `algorithms.recipe`): the clients' [N, e] autoencoder embeddings, the
  autoencoder seeded by `seed`."""
  del model, unused
  if num_clients and data.num_clients != num_clients:
    raise ConfigError(f"data has {data.num_clients} clients, hfedf was built "
                      f"for {num_clients}")
  e = embed_dim or default_embed_dim(data.num_clients)
  return dict(embeddings=np.asarray(autoencoder_embeddings(
      data, e, key=jax.random.fold_in(jax.random.key(seed), 0xAE),
      num_images=autoencoder_images, epochs=autoencoder_epochs,
      lr=autoencoder_lr, batch_size=autoencoder_batch_size), np.float32))


def build(model, optimizer, loss, *, num_clients: int,
          embed_dim: int = 0,          # 0: floor(1 + N/4) (pFedHN's rule, the paper)
          hidden: int = 50,    # the hypernetwork MLP's width (Table 8)
          n_hidden: int = 3,   # its hidden layers (Table 8)
          head_init: str = "client_init",  # client_init | default
                                           # (docs/faithfulness.md)
          server_optimizer: str = "adam",  # the hypernetwork's optimizer
                                           # (Table 10: Adam with weight decay)
          server_lr: float = 1e-3,         # its learning rate (Table 10)
          server_weight_decay: float = 1e-5,  # its weight decay (Table 10)
          server_momentum: float = 0.0,    # "sgd" only
          server_clip_norm: float = 0.0,   # > 0: global-norm clip (pFedHN: 50)
          embed_weight_decay: bool = False,  # decay the embeddings too (pFedHN
                                             # ref. code; docs/faithfulness.md)
          gradalign: bool = True,         # GradAlign weights (Alg. 3); False:
                                          # the clients' mean
          temperature: float = 1.0,       # GradAlign's softmax temperature
          norm_batch_size: int = 1,       # clients per pass when GradAlign
                                          # measures per-client norms
          gradalign_granularity: str = "model",  # model (the paper) | tensor
          gradalign_over: str = "separate",  # separate (the paper) | joint
                                             # (arXiv v1) | theta
          ema: bool = True,               # the server EMA (Alg. 4)
          ema_decay: float = 0.95,        # alpha: the new parameters' weight
          ema_warmup: int = 5,            # the round index the EMA starts at
          learn_embeddings: bool = True,  # "learned" only; False: fixed N(0, 1)
          embeddings: str = "learned",    # learned | random (Table 7) |
                                          # autoencoder (Table 6)
          # Autoencoder embeddings (App. C.2; the paper gives no training
          # settings), trained with Adam on each client's first images:
          autoencoder_images: int = 100,  # images per client
          autoencoder_epochs: int = 50,   # the autoencoder's epochs
          autoencoder_lr: float = 1e-3,   # the autoencoder's Adam learning rate
          autoencoder_batch_size: int = 20,  # the autoencoder's batch size
          data=None, seed: int = 0, prepared=None,
          name: str = "hfedf") -> Algorithm:
  """hFedF; `data` (the run's FederatedData) is needed by
  `embeddings="autoencoder"` only, `seed` seeds that autoencoder;
  `prepared`: `prepare`'s embeddings, given instead of `data`."""
  if embeddings not in EMBEDDINGS:
    raise ConfigError(f"hfedf.embeddings={embeddings!r}: allowed {EMBEDDINGS}")
  if is_concrete(temperature) and temperature <= 0:
    raise ConfigError(f"hfedf.temperature={temperature!r}: GradAlign's softmax "
                      "temperature must be > 0 (1 = the paper)")
  if norm_batch_size < 1:
    raise ConfigError(f"hfedf.norm_batch_size={norm_batch_size!r}: allowed >= 1")
  if gradalign_granularity not in GRANULARITIES:
    raise ConfigError(f"hfedf.gradalign_granularity={gradalign_granularity!r}: "
                     f"allowed {GRANULARITIES}")
  if gradalign_over not in ALIGN_OVER:
    raise ConfigError(f"hfedf.gradalign_over={gradalign_over!r}: allowed "
                      f"{ALIGN_OVER}")
  if gradalign_over == "joint" and gradalign_granularity != "model":
    raise ConfigError("hfedf.gradalign_over='joint' needs "
                      "hfedf.gradalign_granularity='model' (one weight per "
                      "client over theta and the embeddings)")
  e = embed_dim or default_embed_dim(num_clients)
  fixed = None
  if embeddings == "autoencoder":
    if data is None and prepared is None:
      raise NeedsDataError("hfedf.embeddings='autoencoder' needs the run's "
                           "FederatedData: algorithms.build(..., data=fed)")
    if prepared is None:
      prepared = prepare(data=data, seed=seed, num_clients=num_clients,
                         embed_dim=e, autoencoder_images=autoencoder_images,
                         autoencoder_epochs=autoencoder_epochs,
                         autoencoder_lr=autoencoder_lr,
                         autoencoder_batch_size=autoencoder_batch_size)
    fixed = jnp.asarray(prepared["embeddings"])
  # Random and autoencoder embeddings are never learned.
  learn = learn_embeddings and embeddings == "learned"
  hn = hypernetwork_server(
      model, num_clients=num_clients, embed_dim=e, hidden=hidden,
      n_hidden=n_hidden, head_init=head_init, optimizer=server_optimizer,
      lr=server_lr, weight_decay=server_weight_decay,
      momentum=server_momentum, clip_norm=server_clip_norm,
      decay_embeddings=embed_weight_decay, embeddings=fixed,
      align=gradalign, temperature=temperature,
      norm_batch_size=norm_batch_size, learn_embeddings=learn,
      granularity=gradalign_granularity, align_over=gradalign_over)
  smoother = ema_transform(ema_decay, ema_warmup) if ema else None

  def init(key):
    hp, opt = hn.init(key)
    return HFedFState(hp, opt,
                      smoother.init(hp) if smoother else optax.EmptyState()), None

  def client_start(server, rows, ids):
    del rows
    return hn.models(server.hp, ids)

  def server_update(server, result: ClientResult, key):
    hp, opt = hn.step(server.hp, server.opt, result.start, result.params,
                      result.ids)
    ema_state = server.ema
    if smoother is not None:
      hp, ema_state = smoother.update(hp, server.ema)
    if embeddings == "random":  # a fresh draw for the next round (Table 7)
      hp = hp._replace(embeddings=jax.random.normal(key, (num_clients, e)))
    elif not learn:  # exactly unchanged (the EMA mix may round them)
      hp = hp._replace(embeddings=server.hp.embeddings)
    # The mean of the embedding table of the next round: drifts when learned,
    # constant for autoencoder embeddings, a fresh value every round if random.
    cohort = lambda w: jnp.take(w, result.ids, axis=0)
    metrics = {"gradalign_theta": cohort(opt.weights_theta),
               "gradalign_emb": cohort(opt.weights_emb),
               "embeddings_mean": jnp.mean(hp.embeddings)}
    if opt.weights_theta_tensors is not None:
      metrics["gradalign_theta_tensors"] = cohort(opt.weights_theta_tensors)
    return HFedFState(hp, opt, ema_state), metrics

  def eval_params(server, clients):
    del clients
    return hn.all_models(server.hp)

  def eval_clients(server, rows, ids):
    return client_start(server, rows, ids)  # the generated models

  def extras(server, clients):
    del clients
    return {"embeddings": server.hp.embeddings}

  return Algorithm(
      name=name, init=init,
      client=ClientSide(start=client_start, loss=loss, optimizer=optimizer),
      server=ServerSide(update=server_update, eval_params=eval_params,
                        personalized=True, eval_clients=eval_clients,
                        extras=extras))
