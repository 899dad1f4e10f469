"""The engine: a whole federated run as chunks of one jitted `lax.scan` over rounds.

Round body (inside the scan, nothing crosses to the host):

    ids    = the cohort (all N clients, or m drawn without replacement)
    start  = algorithm.client.start(server, client_state[ids], ids)  [m, ...]
    local  = the cohort's local training (client.update: each client its
             own steps), each client with its ClientContext   [m, ...],
             then its end of round (algorithm.client.end: new state row,
             message to the server)
    server = algorithm.server.update(server, ClientResult(...), key)

(the full contract: `algorithms.base`). Between chunks of `eval_every` rounds
(and only there) the host evaluates, logs, moves the progress bar and writes
orbax checkpoints. Randomness: one root key; round key = fold_in(root, r);
client key = fold_in(round key, client id), so results do not depend on the
mapping, the placement or the number of devices.

Where each question is answered:

    settings.py    what a run is asked to do: `EngineConfig` and its
                   validation, the allowed values (MAPPINGS, PLACEMENTS,
                   HOST_GATHERS), `RunResult`
    layout.py      where a round's clients run: CPU devices
                   (`use_cpu_devices`), the mesh, the client mapping ("vmap",
                   "map", "shard", "auto"), `Layout`, lanes (`resolve_lanes`)
    round.py       one round's body (`make_round`), its keys and cohorts, and
                   the same draws made ahead on the host (`host_schedule`,
                   `step_rows`); `Cohort`
    placement.py   where client data and state live: "device" / "host"
                   (`resolve_placement`, `resolve_gather`), the stores that
                   keep them (`DeviceStore`, `HostStore`), the host's rows
    evaluation.py  how a run is scored: id / target accuracy, calibration,
                   divergence, extras (`make_eval`), the target sets, features
    programs.py    what is compiled, keyed by what: one run's programs
                   (`programs`, `Programs`, `program_key`), a batch of R
                   replicas' (`replica_programs`, `replica_mapping`), and
                   forgetting them (`forget_programs`)
    checkpoint.py  the orbax checkpoints and what they cost on disk
    runner.py      `run_batch`: R >= 1 runs as one batch (the chunks, the
                   NaN guard, evaluation, checkpoints, resume, the progress
                   bar); `run`: a batch of one

Imports inside the package point one way: settings <- layout <- round <-
placement <- evaluation <- programs <- runner; checkpoint imports no engine
module. The engine imports no data module: it asks the data objects
(`PackedClients.streamed`, `FederatedData.target_streamed`).

This module exports what code outside the engine uses; everything else is
imported from its module.
"""

from fedjax_dg.engine.checkpoint import checkpoint_bytes, checkpoints_held
from fedjax_dg.engine.layout import use_cpu_devices
from fedjax_dg.engine.programs import forget_programs
from fedjax_dg.engine.runner import run, run_batch, run_replicas
from fedjax_dg.engine.settings import EngineConfig, RunResult

__all__ = ["EngineConfig", "RunResult", "checkpoint_bytes", "checkpoints_held",
           "forget_programs", "run", "run_batch", "run_replicas",
           "use_cpu_devices"]
