"""Local objectives and the local update loop of one client (vmapped by the engine)."""
