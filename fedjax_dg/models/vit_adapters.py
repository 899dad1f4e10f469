"""FedSDAF's adapter setting on the run's ViT: which entries train, which stay
frozen, and how each is made.

The ViT of `models.vit` carries FedSDAF's adapters when asked (`adapters`:
"di", one domain-invariant adapter; "kia", that plus a per-client
domain-aware one and their fusion). Its parameters split by top-level entry:

    backbone   the pretrained ViT, frozen (`FROZEN`): read once, held by the
               engine outside the trained state, never sent
    adi, head  the domain-invariant adapters and the classifier (`GLOBAL`):
               the trained global model
    adw, fuse  the domain-aware adapters and the fusion (`LOCAL`): each
               client's own

FedSDAF builds on all of it; FedAvg (Adapter)'s setting (`adapter_setting`:
one domain-invariant adapter and the head on the frozen backbone) is also
SCAFFOLD's with `adapters=True`.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp

from fedjax_dg.errors import ConfigError, StandInWarning
from fedjax_dg.models import vit as vit_lib

# The models that carry the adapters.
MODELS = ("vit_b16", "vit_tiny")
GLOBAL = ("adi", "head")
LOCAL = ("adw", "fuse")
FROZEN = ("backbone",)


def adapted_model(model, *, domain_invariant: bool = True,
                  domain_aware: bool = False, fusion: bool = False,
                  adapter_dim: int = 0, fusion_heads: int = 8,
                  adapter_init: str = "torch", who: str = "fedsdaf"):
  """The run's ViT with FedSDAF's adapters (a clear error naming `who` for
  other models)."""
  if not isinstance(model.module, vit_lib.ViT):
    raise ConfigError(f"{who} runs on a ViT (model.name one of {MODELS}), "
                      f"not model.name={model.name!r}")
  adapters = ("kia" if domain_aware else "di") if domain_invariant else "none"
  if adapter_init not in vit_lib.ADAPTER_INITS:
    section = who.split(".")[0].split("=")[0]
    raise ConfigError(f"{section}.adapter_init={adapter_init!r}: allowed "
                      f"{vit_lib.ADAPTER_INITS}")
  module = model.module.clone(adapters=adapters, fusion=fusion,
                              adapter_dim=adapter_dim,
                              fusion_heads=fusion_heads,
                              adapter_init=adapter_init)
  return dataclasses.replace(model, module=module)


def frozen_backbone(vmodel, held=FROZEN, who: str = "fedsdaf"):
  """`Algorithm.frozen` of a ViT whose `held` entries are not trained: the
  backbone read once (eagerly: `model.weights` is read here), never the
  file's head (other classes). Without `model.weights` the frozen backbone
  is a random one: a `StandInWarning` naming `who` (the run records it)."""
  if not vmodel.weights:
    warnings.warn(
        f"{who}: no model.weights: the frozen ViT backbone is randomly "
        "initialized and never trained, so only the adapters and head learn, "
        "on random features (the paper's backbone is ImageNet-pretrained; "
        "docs/models.md, \"ViT\", says where weights come from)",
        StandInWarning, stacklevel=2)

  def frozen(key):
    full = dataclasses.replace(vmodel, skip_head=True).init(key)
    return {k: full[k] for k in held}

  return frozen


def sample_trainable(vmodel):
  """key -> the adapters and the head alone (never the backbone)."""
  dummy = jnp.zeros((1, 2, vmodel.module.dim), jnp.float32)

  def sample(key):
    return vmodel.module.init({"params": key}, dummy,
                              method=vit_lib.ViT.trainable)["params"]

  return sample


def adapter_setting(model, who: str, adapter_init: str = "torch"):
  """(the ViT with one domain-invariant adapter, its `frozen`, key -> its
  trained entries {adi, head}): FedAvg (Adapter)'s setting, for other
  algorithms (SCAFFOLD's `adapters=True`), its adapter initialized as
  `adapter_init` says (`vit.ADAPTER_INITS`). Their objective sees the frozen
  backbone and the trained entries together (`algorithms.base.with_frozen`)."""
  vmodel = adapted_model(model, adapter_init=adapter_init, who=who)
  sample = sample_trainable(vmodel)

  def init(key):
    p = sample(key)
    return {k: p[k] for k in GLOBAL}

  return vmodel, frozen_backbone(vmodel, who=who), init
