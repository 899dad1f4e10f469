"""Jitted server transforms, all of optax's shape (`server.aggregate` explains)."""

from fedjax_dg.server.aggregate import ServerTransform, stateless, weighted_mean
from fedjax_dg.server.ema import ema, EmaState
from fedjax_dg.server.gradalign import hypernetwork_grads
from fedjax_dg.server.hypernetwork import (HyperParams, HypernetworkState,
                                          hypernetwork_step)

__all__ = ["ServerTransform", "stateless", "weighted_mean", "ema", "EmaState",
           "hypernetwork_grads", "HyperParams", "HypernetworkState",
           "hypernetwork_step"]
