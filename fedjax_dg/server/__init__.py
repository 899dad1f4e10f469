"""Jitted server transforms over per-client stacked updates (optax-style init/update)."""

from fedjax_dg.server.aggregate import weighted_mean
from fedjax_dg.server.ema import ema, EmaState
from fedjax_dg.server.gradalign import hypernetwork_grads
from fedjax_dg.server.hypernetwork import hypernetwork_step

__all__ = ["weighted_mean", "ema", "EmaState", "hypernetwork_grads",
           "hypernetwork_step"]
