"""FedSDAF (the Federated Source Domain Awareness Framework): a frozen ViT with
a shared domain-invariant adapter and a per-client domain-aware adapter fused by
attention, bidirectional distillation between the two, GA aggregation.

    backbone   frozen ViT, held once (`Algorithm.frozen`), never sent
    global     A_di (the domain-invariant adapters) + the head: broadcast,
               trained locally, aggregated
    per client A_dw (+ the MHSA fusion of Eq. 3): initialized once before
               round 0, trained locally only, never aggregated
               (`client_state`, gathered / scattered with the cohort)
    paths      z_di = head(ViT with h' = h + A_di(h))
               z_dw = head(ViT with h' = h + 1/2 A_dw^(h) + 1/2 A_di(h))  (Eq. 4)
    BKD        (Eq. 5-7) per batch, alternating as Fig. 3 and the released code:
               1. {A_di, head} step on CE(z_di) + alpha KL(p_dw || p_di),
                  the dw path fixed;
               2. {A_dw, fusion} step on CE(z_dw) + alpha KL(p_di || p_dw) at the
                  updated A_di, the di path fixed
               (`bkd_order="joint"`: both at the same point, one gradient)
    server     A_di, head <- GA (Eq. 8, `server.ga`: gaps of each client's
               model measured on a fixed slice of its training rows) or the
               example-weighted mean (`aggregation="fedavg"`)
    evaluation each client's own model (its A_dw with the global A_di): the
               target accuracy is the mean over the source clients (no model
               picked on the target; the per-client values are reported)

Table 4's ablations are switches: `alpha=0` (no BKD: each path its own
cross-entropy), `fusion=False` (no MHSA: A_dw^ = A_dw), `domain_aware=False`
(one adapter: A_di only, a single path), both adapters off
(`domain_invariant=False, domain_aware=False`: the head alone on the frozen
ViT). The variant `fedavg_adapter` is the paper's "FedAvg (Adapter)". The
released code's readings that change numbers are switches too (`train_head`,
`kl`, `metric`); docs/faithfulness.md, "FedSDAF", lists every choice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ClientSide, ServerSide, ServerState,
                                       with_frozen)
from fedjax_dg.client.objectives import masked_mean
from fedjax_dg.client.passes import slice_metrics
from fedjax_dg.client.update import RunProgress
from fedjax_dg.errors import ConfigError
from fedjax_dg.models.vit_adapters import (FROZEN, GLOBAL, LOCAL, MODELS,
                                           adapted_model, frozen_backbone,
                                           sample_trainable)
from fedjax_dg.server import ga, weighted_mean
from fedjax_dg.server.ga import GapMetrics, ga_server_update

DISPLAY_NAME = "FedSDAF"
PAPER = dict(
    title=("FedSDAF: Leveraging Source Domain Awareness for Enhanced "
           "Federated Domain Generalization"),
    authors="Li, Zhou, Cao, Li, Chen, Zhang", venue="arXiv 2505.02515", year=2025)
# The released code's client optimizer: SGD, momentum 0.9, weight decay 5e-4,
# lr 1e-3 (its `Scaffold` optimizer without the control variates).
CLIENT = dict(optimizer="sgd", lr=1e-3, momentum=0.9, weight_decay=5e-4)
VARIANTS = {
    "fedavg_adapter": ("FedAvg (Adapter)", dict(
        domain_aware=False, aggregation="fedavg", alpha=0.0)),
    # Table 4's rows (the first is fedsdaf; its rows 4 and 5 coincide here:
    # with one adapter there is one path and nothing to distill).
    "fedsdaf_no_bkd": ("FedSDAF w/o BKD", dict(alpha=0.0)),
    "fedsdaf_no_mhsa": ("FedSDAF w/o MHSA", dict(fusion=False)),
    "fedsdaf_di": ("FedSDAF (A_di only)", dict(domain_aware=False,
                                               fusion=False)),
    "fedsdaf_head": ("FedSDAF (head only)", dict(domain_aware=False,
                                                 domain_invariant=False)),
}
# MODELS (imported above): the models it runs on (checked before any data
# is read).
AGGREGATIONS = ("ga", "fedavg")
BKD_ORDERS = ("alternate", "joint")
KLS = ("forward", "reverse")


def kl_div(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
  """KL(softmax p || softmax q) per row, temperature 1."""
  lp = jax.nn.log_softmax(p_logits)
  return jnp.sum(jnp.exp(lp) * (lp - jax.nn.log_softmax(q_logits)), axis=-1)


def bkd_losses(module, params, x, y, mask, *, alpha: float, kl_dir: str):
  """(di player's loss, dw player's loss) of one batch (Eq. 5-7).

  Each reaches its own player only: the dw path sees A_di and the head
  stopped, each KL term sees the other path's prediction stopped.
  `kl_dir="forward"`: KL(teacher || student) (the released code's
  `F.kl_div(log_softmax(student), softmax(teacher))`); "reverse":
  KL(student || teacher) (Eq. 5-6 read literally).
  """
  sg = jax.lax.stop_gradient
  z_di = module.apply({"params": params}, x, path="di")
  fixed = {k: (sg(v) if k in GLOBAL else v) for k, v in params.items()}
  z_dw = module.apply({"params": fixed}, x, path="kia")
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y)
  if kl_dir == "forward":
    d_di, d_dw = kl_div(sg(z_dw), z_di), kl_div(sg(z_di), z_dw)
  else:
    d_di, d_dw = kl_div(z_di, sg(z_dw)), kl_div(z_dw, sg(z_di))
  return (masked_mean(ce(z_di) + alpha * d_di, mask),
          masked_mean(ce(z_dw) + alpha * d_dw, mask))


def alternate(optimizer: optax.GradientTransformation,
              first: tuple[str, ...]) -> optax.GradientTransformationExtraArgs:
  """`optimizer` applied block-wise in turn (Gauss-Seidel): the top-level
  entries in `first` step on the batch's gradient at p; the others then step
  on the gradient at p with `first` already moved (`grad_fn`, the step's own
  loss; `client.update.local_update` hands it over). Each block has its own
  optimizer state. Keeps a `RunProgress` optimizer's kind. (`optimizer`
  must not need a gradient function of its own, as SAM does; the clients'
  optimizers of `client.optimizer` never do.)"""
  split = lambda t: ({k: v for k, v in t.items() if k in first},
                     {k: v for k, v in t.items() if k not in first})

  def init(params):
    a, b = split(params)
    return optimizer.init(a), optimizer.init(b)

  def update(grads, state, params=None, *, grad_fn, **extra):
    kw = extra  # a RunProgress optimizer's `progress`
    (ga_, _), (pa, pb) = split(grads), split(params)
    ua, sa = optimizer.update(ga_, state[0], pa, **kw)
    moved = {**params, **optax.apply_updates(pa, ua)}
    _, gb = split(grad_fn(moved, 0))
    ub, sb = optimizer.update(gb, state[1], pb, **kw)
    return {**ua, **ub}, (sa, sb)

  kind = (RunProgress if isinstance(optimizer, RunProgress)
          else optax.GradientTransformationExtraArgs)
  return kind(init, update)


def _check(alpha, aggregation, bkd_order, kl_dir, domain_invariant,
           domain_aware, step_size, metric, gap_examples):
  if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)
          and alpha >= 0):
    raise ConfigError(f"fedsdaf.alpha={alpha!r}: the BKD weight must be a "
                      "finite number >= 0 (0: no distillation)")
  for name, value, allowed in (("aggregation", aggregation, AGGREGATIONS),
                               ("bkd_order", bkd_order, BKD_ORDERS),
                               ("kl", kl_dir, KLS)):
    if value not in allowed:
      raise ConfigError(f"fedsdaf.{name}={value!r}: allowed {allowed}")
  if domain_aware and not domain_invariant:
    raise ConfigError("fedsdaf.domain_aware=True needs domain_invariant=True "
                      "(Eq. 4 adds A_dw^ to A_di; Table 4 has no A_dw-only "
                      "row): set both False for the head alone")
  if not (isinstance(step_size, (int, float)) and math.isfinite(step_size)
          and step_size >= 0):
    raise ConfigError(f"fedsdaf.step_size={step_size!r}: must be a finite "
                      "number >= 0")
  if metric not in ga.SIGNS:
    raise ConfigError(f"fedsdaf.metric={metric!r}: allowed {tuple(ga.SIGNS)}")
  if gap_examples < 0:
    raise ConfigError(f"fedsdaf.gap_examples={gap_examples!r}: must be >= 0 "
                      "(0: all of a client's examples)")


def build(model, optimizer, *, num_clients: int,
          alpha: float = 1.0,            # BKD weight (Eq. 7); 0: no BKD
          fusion: bool = True,           # the MHSA of Eq. 3
          domain_invariant: bool = True,  # A_di
          domain_aware: bool = True,     # A_dw (per client)
          bkd_order: str = "alternate",  # alternate (Fig. 3) | joint
          kl: str = "forward",           # forward: KL(teacher || student)
          train_head: bool = True,       # False: the released code's head
          aggregation: str = "ga",       # ga (Eq. 8) | fedavg (by examples)
          step_size: float = 0.2,        # GA's d (the code's --step_size)
          metric: str = "loss",          # GA's E_k: loss | acc (code: acc)
          gap_examples: int = 64,        # rows of each client measured
          adapter_dim: int = 0,          # 0: dim // 4 (768 -> 192)
          fusion_heads: int = 8,         # the code's declared MHSA
          adapter_init: str = "torch",   # torch (the code's) | zero (up = 0)
          name: str = "fedsdaf",
          ) -> Algorithm:
  """FedSDAF on the run's ViT (`model.name` vit_b16 / vit_tiny)."""
  _check(alpha, aggregation, bkd_order, kl, domain_invariant, domain_aware,
         step_size, metric, gap_examples)
  vmodel = adapted_model(model, domain_invariant=domain_invariant,
                         domain_aware=domain_aware, fusion=fusion,
                         adapter_dim=adapter_dim, fusion_heads=fusion_heads,
                         adapter_init=adapter_init)
  module = vmodel.module
  two_paths = domain_aware
  # An untrained head (the released code's) is held with the backbone.
  held = FROZEN + (() if train_head else ("head",))
  trained_global = tuple(k for k in GLOBAL if k not in held)
  if aggregation == "ga":
    aggregator = ga.ga_aggregation(num_clients, step_size=step_size,
                                   metric=metric)
  else:
    aggregator = weighted_mean()
  sample = sample_trainable(vmodel)

  def client_init(key, ids):
    """Each client's own draw of the domain-aware adapters (and fusion)."""
    keys = jax.random.split(jax.random.fold_in(key, 1), num_clients)
    rows = jax.vmap(sample)(keys[ids])
    return {k: rows[k] for k in LOCAL if k in rows}

  def init(key):
    p = sample(key)
    glob = {k: p[k] for k in trained_global if k in p}
    server = ServerState(glob, aggregator.init(glob))
    if not two_paths:
      return server, None
    return server, client_init(key, jnp.arange(num_clients))

  backbone = frozen_backbone(vmodel, who=name)

  def frozen(key):
    out = backbone(key)
    if "head" in held:  # sampled from the same key as `init`'s
      out["head"] = sample(key)["head"]
    return out

  def client_start(server, rows, ids):
    start = tree.broadcast(server.params, ids.shape[0])
    return start if rows is None else {**start, **rows}


  def loss(params, batch, rng, ctx):
    del rng  # no dropout
    p = with_frozen(ctx.frozen, params)
    x = vmodel.normalize(batch.x)
    if two_paths:
      return sum(bkd_losses(module, p, x, batch.y, batch.mask, alpha=alpha,
                            kl_dir=kl))
    logits = module.apply({"params": p}, x)
    return masked_mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, batch.y),
        batch.mask)

  client_opt = (alternate(optimizer, trained_global)
                if two_paths and bkd_order == "alternate" else optimizer)
  pick = 0 if metric == "loss" else 1

  def measure(frozen_, params, data):
    return slice_metrics(vmodel, with_frozen(frozen_, params), data.x, data.y,
                         data.n, gap_examples, 64)[pick]

  def end(ctx, trained, data, key):
    """Its row: its domain-aware adapters (two paths); its message: E_k
    before and after (GA aggregation)."""
    del key
    row = ({k: trained[k] for k in LOCAL if k in trained} if two_paths
           else ctx.state)
    if aggregation != "ga":
      return row, None
    return row, GapMetrics(received=measure(ctx.frozen, ctx.start, data),
                           trained=measure(ctx.frozen, trained, data))

  def server_update(server, result: ClientResult, key):
    stacked = {k: result.params[k] for k in server.params}
    if aggregation == "fedavg":
      params, opt = aggregator.update(stacked, server.opt,
                                      weights=result.num_examples)
      return ServerState(params, opt), {}
    return ga_server_update(aggregator, server, stacked, result, key)

  def eval_params(server, clients):
    if clients is None:
      return server.params
    n = jax.tree.leaves(clients)[0].shape[0]
    return {**tree.broadcast(server.params, n), **clients}

  ends = two_paths or aggregation == "ga"
  return Algorithm(
      name=name, init=init,
      client=ClientSide(
          start=client_start, loss=loss, optimizer=client_opt,
          end=ClientEnd(end, reads_data=aggregation == "ga") if ends else None,
          init_rows=client_init if two_paths else None),
      server=ServerSide(update=server_update, eval_params=eval_params,
                        personalized=two_paths),
      frozen=frozen, model=vmodel)
