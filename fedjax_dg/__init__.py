"""fedjax_dg: federated domain generalization simulated as one jitted JAX program.

Layers (lower never imports higher): tree -> data -> models -> client -> server
-> algorithms -> engine -> evaluate/report -> cli. See docs/architecture.md.
"""

__version__ = "0.1.0"
