"""fedjax_dg: federated domain generalization simulated as one jitted JAX program.

Packages import down only: cli -> run -> report / engine -> algorithms ->
server / client / models -> tree and errors, data beside models (the engine
never imports it). docs/architecture.md draws the allowed arrows,
tests/test_imports.py keeps them.
"""

__version__ = "0.1.0"
