"""Round time of the engine vs a Python loop, central training and PyTorch (not a test).

One FedAvg round and one hFedF round of the hFedF Inception CNN (32x32x3 uint8, 7
classes) at C clients, 10 local SGD steps of batch 64 per client (640 examples per
client, epochs=1), the same synthetic data for every variant:

  engine  (a) the engine's jitted chunk (`engine.programs`, as `engine.run` builds
              it) called with length 1: ONE program per round, `client_mapping="auto"`
              with one XLA:CPU device per core, as the `fedjax-dg` command sets up
              JAX (`engine.use_cpu_devices`): the cohort sharded over the devices,
              sequential `lax.map` over each device's clients (`--cpu-devices 1`:
              one device, `lax.map` over all clients);
  engine_bf16 (a') the same with the model built from a run config with
              `model.dtype="bfloat16"` (bfloat16 compute, float32 parameters),
              as `fedjax-dg run --set model.dtype=bfloat16` builds it;
  engine_auto (a'') the same with `model.dtype="auto"`: the dtype
              `models.layers.auto_dtype` picks for this backend (printed);
  loop    (b) the FedJAX execution model: a Python loop over clients calling
              `jax.jit(local_update)` for one client, then the server step from
              Python: FedAvg = jitted weighted mean of the C models; hFedF = jitted
              generation per client, one jitted VJP per client giving a materialized
              hypernetwork gradient each, jitted mean / cosines / softmax / weighted
              sum over the list (GradAlign), jitted Adam step and EMA;
  central (c) the compute limit: ONE model trained on the same C*640 examples with
              the same steps, 10 steps of batch 64*C (the engine's `central`
              algorithm on the pooled data); `central_b64` (optional): C*10 steps of
              batch 64 in one scan;
  torch   (d) a plain PyTorch loop (benchmarks/torch_reference.py; CPU, or
              `--torch-device cuda`): deepcopy of
              the global model per client, torch SGD, mean of state_dicts; hFedF:
              pFedHN-style `torch.autograd.grad` per client, GradAlign, Adam, EMA.
  torch_bf16 (d') FedAvg's loop with the forward pass and loss under
              `torch.autocast(dtype=torch.bfloat16)` (float32 parameters), the
              PyTorch peer of (a').

Every (algorithm, C, variant) runs in its own worker process (its peak RSS is its
own, from `resource.getrusage`); all workers of one (algorithm, C) are started
one after the other (compile + 1 warm-up round each), then timed rounds are taken
round-robin over the workers (the starting worker rotates every repetition), so
machine noise hits every variant alike. Central training is the same computation
for both algorithms: it is measured once per C, in the first algorithm's group.

    .venv/bin/python benchmarks/round_time.py                       # full (~1 h+)
    .venv/bin/python benchmarks/round_time.py --clients 4 --reps 2  # quick (minutes)
    .venv/bin/python benchmarks/round_time.py --algs hfedf --clients 16 \
        --variants engine loop --reps 3
    .venv/bin/python benchmarks/round_time.py --algs fedavg --clients 4 \
        --variants engine engine_auto engine_bf16 --rates   # + GFLOP/s vs the peaks
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

STEPS, BATCH, N_CLASSES, SHAPE = 10, 64, 7, (32, 32, 3)
VARIANTS = ("engine", "engine_bf16", "engine_auto", "loop", "central",
            "central_b64", "torch", "torch_bf16")
DEFAULT_VARIANTS = ("engine", "loop", "central", "torch")
LABEL = {"engine": "(a) engine", "engine_bf16": "(a') engine bf16",
         "engine_auto": "(a'') engine auto",
         "loop": "(b) loop + jit", "central": "(c) central",
         "central_b64": "(c') central b64", "torch": "(d) torch",
         "torch_bf16": "(d') torch bf16"}
PROTO = "@@bench "


# ----------------------------------------------------------------------------- data

def synthetic_data(c: int, steps: int = STEPS, seed: int = 0, size: int = 32):
  """uint8 x [C, steps*64, size, size, 3], int32 y [C, steps*64] (640 examples
  per client by default, exactly 10 steps of batch 64 with epochs=1): the same
  for every variant."""
  import numpy as np
  rng = np.random.default_rng(seed)
  n = steps * BATCH
  x = rng.integers(0, 256, (c, n, size, size, SHAPE[2]), dtype=np.uint8)
  y = rng.integers(0, N_CLASSES, (c, n), dtype=np.int32)
  return x, y


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def trim_heap() -> None:
  """Gives freed heap pages back to the OS between rounds (so that transient
  per-round memory of one worker is not held while the others run)."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except OSError:
    pass


# -------------------------------------------------------------------- JAX variants

def _jax_common(spec):
  import jax
  from fedjax_dg.client import objectives
  from fedjax_dg.optim import make_optimizer
  model = _model(spec)
  opt = make_optimizer(spec["client_opt"], spec["lr"])
  loss = objectives.cross_entropy(model)
  return jax, model, opt, loss


def _model(spec):
  """--model (the Inception CNN) at --size; `engine_bf16` / `engine_auto`:
  built from a run config with `model.dtype="bfloat16"` / `"auto"`
  (`assemble.make_model`, as a run builds it), checked to compute in
  bfloat16 where that is the dtype."""
  import jax
  import jax.numpy as jnp
  from fedjax_dg import models
  shape = (spec["size"], spec["size"], SHAPE[2])
  if spec["variant"] not in ("engine_bf16", "engine_auto"):
    return models.get_model(spec["model"], input_shape=shape,
                            num_classes=N_CLASSES)
  import types
  from fedjax_dg.run import assemble, config
  cfg = config.base_config()
  if "dtype" not in cfg.model:
    raise RuntimeError("bf16: model.dtype not available in this checkout")
  cfg.model.name = spec["model"]
  cfg.model.dtype = "auto" if spec["variant"] == "engine_auto" else "bfloat16"
  fed = types.SimpleNamespace(image_shape=shape, num_classes=N_CLASSES)
  model = assemble.make_model(cfg, fed, (0.5,), (0.5,))
  if cfg.model.dtype == "auto":
    dtype, why = models.layers.auto_dtype(jax.default_backend())
    print(f"engine_auto: model.dtype=auto: {dtype} ({why})", file=sys.stderr)
    if dtype == "float32":
      return model
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((BATCH,) + shape, jnp.uint8)  # a step's batch
  if "bf16" not in str(jax.make_jaxpr(model.apply)(params, x)):
    raise RuntimeError("bf16: model.dtype='bfloat16' did not reach the model "
                       "that assemble.make_model builds (no bf16 op traced)")
  return model


def _build_alg(name, model, opt, loss, c):
  if name == "fedavg":
    from fedjax_dg.algorithms.fedavg import fedavg
    return fedavg(model, opt, loss)
  if name == "central":
    from fedjax_dg.algorithms import central
    return central.build(model, opt, loss)
  from fedjax_dg.algorithms import hfedf
  return hfedf.build(model, opt, loss, num_clients=c)


def _fingerprint(jax, before, after):
  """Per-leaf L2 norm of (after - before): compares what two variants computed."""
  import numpy as np
  diffs = jax.tree.map(lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64)
                                                         - np.asarray(b, np.float64))),
                       after, before)
  return [float(v) for v in jax.tree.leaves(diffs)]


def _server_of(alg_name, server):
  """The trained server parameters of an engine state (or the loop's dict)."""
  get = server.get if isinstance(server, dict) else server._asdict().get
  return get("params") if alg_name != "hfedf" else tuple(get("hp"))


def worker_engine(spec, x, y):
  """(a), and (c)/(c') through the engine's `central` algorithm on pooled data."""
  from fedjax_dg import engine
  from fedjax_dg.engine.programs import programs
  if spec["cpu_devices"] != 1:  # as the fedjax-dg command sets up JAX
    engine.use_cpu_devices(spec["cpu_devices"] or None)
  jax, model, opt, loss = _jax_common(spec)
  import jax.numpy as jnp
  import numpy as np
  from fedjax_dg.data.federated import ClientArrays
  c = spec["clients"]
  variant = spec["variant"]
  if variant in ("engine", "engine_bf16", "engine_auto"):
    alg = _build_alg(spec["alg"], model, opt, loss, c)
    batch, n_clients = BATCH, c
  else:  # central: the union of all clients' examples as ONE client
    alg = _build_alg("central", model, opt, loss, 1)
    x, y = x.reshape((1, -1) + x.shape[2:]), y.reshape(1, -1)
    batch = BATCH * c if variant == "central" else BATCH
    n_clients = 1
  cfg = engine.EngineConfig(rounds=1, eval_every=1, epochs=1, batch_size=batch,
                            client_mapping=spec["mapping"], progress=False)
  progs = programs(alg, model, cfg, n_clients)
  run_chunk = progs.chunk
  train = progs.layout.put_clients(ClientArrays(
      x=x, y=y, n=np.full((n_clients,), x.shape[1], np.int32)))
  root = jax.random.key(0)
  carry = progs.init(jax.random.fold_in(root, 2**31 - 1))
  name = "central" if variant.startswith("central") else spec["alg"]
  before = jax.tree.map(np.asarray, _server_of(name, carry[0]))
  state = {"carry": carry, "r": 0}

  def one_round():
    carry, metrics = run_chunk(state["carry"], jnp.int32(state["r"]), train, root,
                               None, 1, jnp.int32(cfg.rounds))
    jax.block_until_ready((carry, metrics))
    state["carry"], state["r"] = carry, state["r"] + 1
    return {}

  def fingerprint():
    return _fingerprint(jax, before, _server_of(name, state["carry"][0]))

  def diagnose():
    """The server step alone (jitted, on the current state), for the time split."""
    if variant.startswith("central"):
      return {}
    from fedjax_dg.algorithms.base import ClientResult
    server = state["carry"][0]
    ids = jnp.arange(c)
    start = jax.jit(alg.client.start)(server, None, ids)
    trained = jax.tree.map(lambda a: a * 0.999, start)
    res = ClientResult(ids=ids, round=jnp.int32(1), start=start, params=trained,
                       num_examples=jnp.full((c,), x.shape[1], jnp.int32),
                       loss=jnp.zeros((c,)))
    step = jax.jit(lambda s, r: alg.server.update(s, r, root))
    gen = jax.jit(lambda s: alg.client.start(s, None, ids))
    out = {}
    for key, fn in (("server_s", lambda: step(server, res)),
                    ("client_start_s", lambda: gen(server))):
      jax.block_until_ready(fn())
      ts = []
      for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
      out[key] = statistics.median(ts)
    return out

  return one_round, fingerprint, diagnose


def worker_loop(spec, x, y):
  """(b): Python loop over clients, jitted per-client `local_update`, server from
  Python (jitted pieces)."""
  jax, model, opt, loss = _jax_common(spec)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from fedjax_dg.client.update import local_update
  c = spec["clients"]
  alg = _build_alg(spec["alg"], model, opt, loss, c)
  root = jax.random.key(0)
  server = jax.jit(alg.init)(jax.random.fold_in(root, 2**31 - 1))[0]
  before = jax.tree.map(np.asarray, _server_of(spec["alg"], server))
  server = server._asdict()
  # Per-client device arrays prepared once, outside the timed rounds.
  xs = [jnp.asarray(x[i]) for i in range(c)]
  ys = [jnp.asarray(y[i]) for i in range(c)]
  n = jnp.int32(x.shape[1])
  local = jax.jit(functools.partial(local_update, loss, opt, batch_size=BATCH,
                                    epochs=1))

  @jax.jit
  def client_keys(r):  # the engine's keys: fold_in(split(fold_in(root, r))[1], i)
    _, ck, _ = jax.random.split(jax.random.fold_in(root, r), 3)
    return jax.vmap(lambda i: jax.random.fold_in(ck, i))(jnp.arange(c))

  # The server's sums run as a Python loop of one jitted two-operand step per
  # client, in the order of a left-to-right sum: a jitted function of all C
  # models would be one C-ary program per leaf, whose compile grows with C
  # (on an H200, FedAvg's at C = 256 was not compiled after 150 s).
  @jax.jit
  def axpy(acc, w, tree):  # acc + w * tree, leaf by leaf
    return jax.tree.map(lambda a, p: a + w * p, acc, tree)

  def weighted_sum(ws, trees):
    acc = jax.tree.map(jnp.zeros_like, trees[0])
    for i, tree in enumerate(trees):
      acc = axpy(acc, ws[i], tree)
    return acc

  split = {}
  state = {"server": server, "r": 0}

  if spec["alg"] == "fedavg":
    weights = jnp.full((c,), float(x.shape[1]))
    weights = weights / jnp.sum(weights)

    def one_round():
      params = state["server"]["params"]
      keys = client_keys(state["r"])
      t0 = time.perf_counter()
      trained = [local(params, xs[i], ys[i], n, keys[i])[0] for i in range(c)]
      jax.block_until_ready(trained)
      t1 = time.perf_counter()
      new = weighted_sum(weights, trained)
      jax.block_until_ready(new)
      state["server"] = {"params": new}
      state["r"] += 1
      return {"clients_s": t1 - t0, "server_s": time.perf_counter() - t1}

  else:  # hfedf, the naive way: materialized per-client hypernetwork gradients
    from fedjax_dg.models.hypernetwork import hypernetwork_module
    from fedjax_dg.optim import make_optimizer
    from fedjax_dg.server import ema as ema_transform
    from fedjax_dg.server.hypernetwork import HyperParams
    module = hypernetwork_module(model)           # hfedf.build()'s defaults
    h = lambda theta, v: module.apply({"params": theta}, v)
    server_opt = make_optimizer("adam", 1e-3, 1e-5,
                                decay_mask=HyperParams(theta=True, embeddings=False))
    ema = ema_transform(0.95, 5)
    generate = jax.jit(lambda hp, i: h(hp.theta, hp.embeddings[i]))

    @jax.jit
    def client_grad(hp, i, start, trained):
      """g_i = J_i^T (start - trained), for (theta, the whole embedding table)."""
      delta = jax.tree.map(jnp.subtract, start, trained)
      _, vjp = jax.vjp(lambda th, emb: h(th, emb[i]), hp.theta, hp.embeddings)
      return vjp(delta)


    @jax.jit
    def cosines(g, avg):  # (cos theta, cos embeddings) of one client's gradient
      out = []
      for a, b in ((g[0], avg[0]), (g[1], avg[1])):
        out.append(optax.tree.vdot(a, b)
                   / jnp.maximum(optax.tree.norm(a) * optax.tree.norm(b), 1e-30))
      return jnp.stack(out)


    @jax.jit
    def adam_step(hp, opt_state, grads):
      updates, opt_state = server_opt.update(grads, opt_state, hp)
      return optax.apply_updates(hp, updates), opt_state

    ema_step = jax.jit(ema.update)
    # The loop's own server state: the raw optimizer and EMA states.
    state["server"] = {"hp": server["hp"], "opt": server_opt.init(server["hp"]),
                       "ema": ema.init(server["hp"])}

    def one_round():
      s = state["server"]
      hp = s["hp"]
      keys = client_keys(state["r"])
      t0 = time.perf_counter()
      starts = [generate(hp, i) for i in range(c)]
      trained = [local(starts[i], xs[i], ys[i], n, keys[i])[0] for i in range(c)]
      jax.block_until_ready(trained)
      t1 = time.perf_counter()
      grads = [client_grad(hp, i, starts[i], trained[i]) for i in range(c)]
      avg = weighted_sum(jnp.full((c,), 1.0 / c), grads)
      cos = jnp.stack([cosines(g, avg) for g in grads])
      w = jax.nn.softmax(cos, axis=0)        # [C, 2]: GradAlign's weights
      g = HyperParams(theta=weighted_sum(w[:, 0], [g[0] for g in grads]),
                      embeddings=weighted_sum(w[:, 1], [g[1] for g in grads]))
      del grads
      new_hp, opt_state = adam_step(hp, s["opt"], g)
      new_hp, ema_state = ema_step(new_hp, s["ema"])
      jax.block_until_ready(new_hp)
      state["server"] = {"hp": new_hp, "opt": opt_state, "ema": ema_state}
      state["r"] += 1
      return {"clients_s": t1 - t0, "server_s": time.perf_counter() - t1}

  def fingerprint():
    return _fingerprint(jax, before, _server_of(spec["alg"], state["server"]))

  return one_round, fingerprint, lambda: split


def worker_torch(spec, x, y):
  """(d): plain PyTorch loop (benchmarks/torch_reference.py)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import torch
  import torch_reference as tr
  if spec["model"] != "inception_cnn":
    raise ValueError(f"--model {spec['model']}: the PyTorch reference is the "
                     "Inception CNN only")
  if spec["torch_threads"]:
    torch.set_num_threads(spec["torch_threads"])
  torch.manual_seed(0)
  c, device = spec["clients"], spec["torch_device"]
  xt, yt = tr.to_torch_data(x, y)
  xs, ys = list(xt.to(device).unbind(0)), list(yt.to(device).unbind(0))
  kw = dict(steps=spec["steps"], batch_size=BATCH, lr=spec["lr"],
            optimizer=spec["client_opt"], device=device)
  if spec["alg"] == "fedavg":
    ref = tr.FedAvgReference(N_CLASSES, bf16=spec["variant"] == "torch_bf16",
                             **kw)
  elif spec["variant"] == "torch_bf16":
    raise ValueError("torch_bf16: FedAvg only (--algs fedavg)")
  else:
    ref = tr.HFedFReference(N_CLASSES, c, **kw)
  sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

  def one_round():
    t0 = time.perf_counter()
    ref.round(xs, ys)
    sync()
    total = time.perf_counter() - t0
    server = getattr(ref, "last_server_s", None)
    return {} if server is None else {"server_s": server, "clients_s": total - server}

  info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
          "params": tr.num_params(ref.model if spec["alg"] == "fedavg" else ref.hnet)}
  return one_round, lambda: info, lambda: {}


def worker_main(spec):
  """Worker protocol on stdout (lines starting with PROTO): ready, then one result
  per 'run' line read from stdin, then 'quit' -> final (peak RSS, diagnostics)."""
  out = sys.stdout
  sys.stdout = sys.stderr          # library prints never reach the protocol channel

  def send(obj):
    out.write(PROTO + json.dumps(obj) + "\n")
    out.flush()

  try:
    x, y = synthetic_data(spec["clients"], spec["steps"], size=spec["size"])
    build = {"engine": worker_engine, "engine_bf16": worker_engine,
             "engine_auto": worker_engine,
             "central": worker_engine,
             "central_b64": worker_engine, "loop": worker_loop,
             "torch": worker_torch, "torch_bf16": worker_torch}[spec["variant"]]
    t0 = time.perf_counter()
    one_round, fingerprint, diagnose = build(spec, x, y)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    extra = one_round()              # warm-up: compiles, first touch of buffers
    warm_s = time.perf_counter() - t0
    send(dict(event="ready", setup_s=setup_s, warmup_s=warm_s,
              fingerprint=fingerprint(), rss_gib=peak_rss_gib(), **extra))
    del x, y
    trim_heap()
    for line in sys.stdin:
      cmd = line.strip()
      if cmd == "run":
        t0 = time.perf_counter()
        extra = one_round()
        dt = time.perf_counter() - t0
        send(dict(event="result", seconds=dt, rss_gib=peak_rss_gib(), **extra))
        trim_heap()
      elif cmd == "quit":
        rss = peak_rss_gib()
        diag = diagnose() if spec.get("diagnose") else {}
        send(dict(event="final", rss_gib=rss, **diag))
        return
  except BaseException as e:  # noqa: BLE001 - reported to the driver
    import traceback
    traceback.print_exc()
    send(dict(event="error", error=f"{type(e).__name__}: {str(e)[:300]}",
              rss_gib=peak_rss_gib()))


# -------------------------------------------------------------------------- driver

class Worker:
  """One variant's process. `wait=False` starts it and returns: `wait_ready`
  reads its ready message later (--parallel-start)."""

  def __init__(self, spec, log, wait=True):
    self.spec, self.log = spec, log
    # On a GPU, JAX takes 75 % of its memory per process by default: the
    # workers share one device, so each allocates only what it uses.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        env=env)
    self.error = None
    self.ready = self.read() if wait else None

  def wait_ready(self):
    if self.ready is None:
      self.ready = self.read()
    return self.ready

  def read(self):
    for line in self.proc.stdout:
      if line.startswith(PROTO):
        msg = json.loads(line[len(PROTO):])
        if msg["event"] == "error":
          self.error = msg["error"]
          self.proc.wait()
        return msg
      self.log(line.rstrip())
    rc = self.proc.wait()
    why = "killed by SIGKILL (out of memory?)" if rc == -9 else f"exit code {rc}"
    self.error = f"worker died: {why}"
    return dict(event="error", error=self.error, rss_gib=float("nan"))

  def call(self, cmd):
    if self.error:
      return dict(event="error", error=self.error)
    try:
      self.proc.stdin.write(cmd + "\n")
      self.proc.stdin.flush()
    except BrokenPipeError:
      pass
    return self.read()

  def close(self):
    msg = self.call("quit") if not self.error else {}
    try:
      self.proc.stdin.close()
    except OSError:
      pass
    self.proc.wait()
    return msg


def _system_busy_ticks() -> int:
  with open("/proc/stat") as f:
    v = [int(a) for a in f.readline().split()[1:]]
  return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]   # user nice system irq softirq steal


def _process_ticks(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return int(fields[11]) + int(fields[12])          # utime + stime (all threads)


def timed_call(worker):
  """One 'run' of a worker, plus the CPU it used and what everything else used
  meanwhile (cores, averaged over the round): the contention it ran under."""
  hz = os.sysconf("SC_CLK_TCK")
  try:
    s0, p0, t0 = _system_busy_ticks(), _process_ticks(worker.proc.pid), time.time()
  except OSError:
    return worker.call("run")
  msg = worker.call("run")
  try:
    s1, p1, t1 = _system_busy_ticks(), _process_ticks(worker.proc.pid), time.time()
    msg["own_cores"] = (p1 - p0) / hz / (t1 - t0)
    msg["other_cores"] = max(0.0, (s1 - s0) - (p1 - p0)) / hz / (t1 - t0)
  except OSError:
    pass
  return msg


def fmt(v, digits=0):
  return "—" if v is None or v != v else f"{v:,.{digits}f}"


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def versions() -> dict:
  out = {"python": platform.python_version()}
  for mod in ("jax", "jaxlib", "flax", "optax", "torch"):
    try:
      out[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
      out[mod] = "not installed"
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--algs", nargs="+", default=["fedavg", "hfedf"],
                  choices=["fedavg", "hfedf"])
  ap.add_argument("--clients", nargs="+", type=int, default=[4, 16, 64])
  ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                  choices=VARIANTS)
  ap.add_argument("--reps", type=int, default=3, help="timed rounds per variant")
  ap.add_argument("--reps-large", type=int, default=2,
                  help="timed rounds per variant at C >= --large (a round is minutes)")
  ap.add_argument("--large", type=int, default=64)
  ap.add_argument("--steps", type=int, default=STEPS,
                  help="local steps per client (= examples / 64); 10 in the issue")
  ap.add_argument("--size", type=int, default=SHAPE[0],
                  help="image side (32 in the issue; a dry run: 8)")
  ap.add_argument("--model", default="inception_cnn",
                  choices=["inception_cnn", "small_cnn", "mlp"],
                  help="the JAX variants' model (a dry run: mlp, whose "
                  "hypernetwork compiles in seconds; torch: inception_cnn only)")
  ap.add_argument("--torch-device", default="cpu",
                  help="the PyTorch reference's device (cpu, cuda)")
  ap.add_argument("--client-opt", default="sgd", choices=["sgd", "adam"])
  ap.add_argument("--lr", type=float, default=0.01)
  ap.add_argument("--mapping", default="auto", help="engine client_mapping")
  ap.add_argument("--cpu-devices", type=int, default=0,
                  help="XLA:CPU devices of the engine's process (engine and "
                  "central): 0 = one per core, as `fedjax-dg` sets up JAX "
                  "(engine.use_cpu_devices); 1 = JAX's default single device")
  ap.add_argument("--torch-threads", type=int, default=0,
                  help="torch.set_num_threads (0: torch's default)")
  ap.add_argument("--no-diagnose", action="store_true",
                  help="skip timing the engine's server step alone")
  ap.add_argument("--parallel-start", action="store_true",
                  help="start every variant's process at once and time them "
                  "once all are ready (set-up and compiles overlap: a GPU "
                  "machine's many cores; on a small CPU they would contend)")
  ap.add_argument("--rates", action="store_true",
                  help="also each round's arithmetic rate (GFLOP/s) against "
                  "XLA:CPU's float32 and bfloat16 matmul rates, measured "
                  "here by benchmarks/matmul_peak.py's code after the rounds "
                  "(the Inception CNN at 32x32 only)")
  ap.add_argument("--json", default="", help="also write all measurements here")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker_main(json.loads(args.worker))

  log = lambda s: print(s, file=sys.stderr, flush=True)
  info = dict(cpu=cpu_model(), cores=os.cpu_count(), **versions())
  print(f"# round_time: {info}", flush=True)
  print(f"# load average at start: {os.getloadavg()}", flush=True)
  rows, central_done = [], {}
  t_start = time.perf_counter()
  for c in args.clients:
    reps = args.reps_large if c >= args.large else args.reps
    for alg in args.algs:
      variants = [v for v in args.variants
                  if not (v.startswith("central") and (c, v) in central_done)]
      workers, t_group = {}, time.perf_counter()
      for v in variants:
        spec = dict(alg=alg, clients=c, variant=v, steps=args.steps,
                    size=args.size, model=args.model,
                    torch_device=args.torch_device,
                    client_opt=args.client_opt,
                    lr=args.lr, mapping=args.mapping,
                    cpu_devices=args.cpu_devices,
                    torch_threads=args.torch_threads,
                    diagnose=not args.no_diagnose)
        t0 = time.perf_counter()
        workers[v] = w = Worker(spec, log, wait=not args.parallel_start)
        if not args.parallel_start:
          _print_ready(alg, c, v, w, t0)
      for v in variants if args.parallel_start else ():
        w = workers[v]
        w.wait_ready()
        _print_ready(alg, c, v, w, t_group, since="all started")
      times = {v: [] for v in variants}
      extras = {v: [] for v in variants}
      rss = {v: workers[v].ready.get("rss_gib", float("nan")) for v in variants}
      for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
          if workers[v].error:
            continue
          msg = timed_call(workers[v])
          if msg["event"] != "result":
            print(f"[{alg} C={c} {v}] ERROR {workers[v].error}", flush=True)
            continue
          times[v].append(msg["seconds"])
          extras[v].append({k: msg[k] for k in
                            ("clients_s", "server_s", "own_cores", "other_cores")
                            if k in msg})
          rss[v] = max(rss[v], msg["rss_gib"])
          print(f"[{alg} C={c} {v}] rep {rep + 1}/{reps}: {msg['seconds']:.4f} s "
                f"(own {msg.get('own_cores', float('nan')):.2f} cores, others "
                f"{msg.get('other_cores', float('nan')):.2f} cores)", flush=True)
      for v in variants:
        fin = workers[v].close()
        if fin.get("rss_gib") == fin.get("rss_gib"):
          rss[v] = max(rss[v], fin.get("rss_gib", 0.0))
        row = dict(alg=alg, clients=c, variant=v, times=times[v],
                   rss_gib=rss[v], error=workers[v].error,
                   fingerprint=workers[v].ready.get("fingerprint"),
                   setup_s=workers[v].ready.get("setup_s"),
                   warmup_s=workers[v].ready.get("warmup_s"),
                   split=extras[v], diag={k: fin[k] for k in
                                          ("server_s", "client_start_s") if k in fin})
        rows.append(row)
        if v.startswith("central"):
          central_done[(c, v)] = row
      check_fingerprints(rows, alg, c)
  print(f"# total {time.perf_counter() - t_start:.0f} s; load average at end: "
        f"{os.getloadavg()}", flush=True)
  report(rows, central_done, args, info)
  if args.rates:
    rates(rows, args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(info=info, args=vars(args), rows=rows), f, indent=1)


def _print_ready(alg, c, v, w, t0, since=""):
  r = w.ready
  print(f"[{alg} C={c} {v}] ready in {time.perf_counter() - t0:.1f} s"
        f"{' (' + since + ')' if since else ''} (setup "
        f"{r.get('setup_s', float('nan')):.1f} s, warm-up round "
        f"{r.get('warmup_s', float('nan')):.1f} s) "
        + (f"ERROR {w.error}" if w.error else ""), flush=True)


def check_fingerprints(rows, alg, c):
  """Engine vs loop: the same round (same init, data, keys) -> same update."""
  import numpy as np
  got = {r["variant"]: r["fingerprint"] for r in rows
         if r["alg"] == alg and r["clients"] == c}
  if isinstance(got.get("engine"), list) and isinstance(got.get("loop"), list):
    a, b = np.array(got["engine"]), np.array(got["loop"])
    rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-12)))
    print(f"[{alg} C={c}] engine vs loop, per-leaf |update| after the warm-up round: "
          f"max relative difference {rel:.1e} over {a.size} leaves", flush=True)
    for r in rows:
      if r["alg"] == alg and r["clients"] == c and r["variant"] == "loop":
        r["update_rel_diff_vs_engine"] = rel


def _median(ts):
  return statistics.median(ts) if ts else float("nan")


def report(rows, central, args, info):
  print()
  print(f"Machine: {info['cpu']}, {info['cores']} cores; jax {info['jax']} "
        f"(jaxlib {info['jaxlib']}), flax {info['flax']}, optax {info['optax']}, "
        f"torch {info['torch']}, Python {info['python']}.")
  print(f"Workload: {args.model} {args.size}x{args.size}x3 uint8, 7 classes, {args.steps} local steps x "
        f"batch {BATCH} per client, client optimizer {args.client_opt} "
        f"lr {args.lr}, engine client_mapping={args.mapping!r}, engine CPU "
        f"devices {args.cpu_devices or 'one per core'}.")
  print()
  print("| algorithm | C | variant | ms / round (median) | range | timed rounds | "
        "ms / client-step | server step ms | peak RSS GiB | cores used: own / "
        "other processes | other / engine |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  ratios = []
  for alg in args.algs:
    for c in args.clients:
      sel = {r["variant"]: r for r in rows if r["alg"] == alg and r["clients"] == c}
      for v in args.variants:  # central rows come from the first algorithm's group
        if v.startswith("central") and v not in sel and (c, v) in central:
          sel[v] = central[(c, v)]
      eng = _median(sel["engine"]["times"]) if "engine" in sel else float("nan")
      ratio_row = dict(alg=alg, clients=c)
      for v in args.variants:
        r = sel.get(v)
        if r is None:
          continue
        med = _median(r["times"])
        if r["error"] and not r["times"]:
          print(f"| {alg} | {c} | {LABEL[v]} | {r['error']} | | 0 | | | "
                f"{fmt(r['rss_gib'], 2)} | | |")
          ratio_row[v] = r["error"]
          continue
        rng = (f"{1e3 * min(r['times']):,.0f}–{1e3 * max(r['times']):,.0f}"
               if r["times"] else "")
        server = None
        split = [s["server_s"] for s in r["split"] if "server_s" in s]
        if split:
          server = 1e3 * _median(split)
        elif r["diag"].get("server_s") is not None:
          server = 1e3 * r["diag"]["server_s"]
        ratio = med / eng if v != "engine" else 1.0
        own = _median([s["own_cores"] for s in r["split"] if "own_cores" in s])
        other = _median([s["other_cores"] for s in r["split"] if "other_cores" in s])
        note = " *" if v.startswith("central") and r["alg"] != alg else ""
        print(f"| {alg} | {c} | {LABEL[v]}{note} | {fmt(1e3 * med)} | {rng} | "
              f"{len(r['times'])} | {fmt(1e3 * med / (c * args.steps), 1)} | "
              f"{fmt(server)} | {fmt(r['rss_gib'], 2)} | {fmt(own, 2)} / "
              f"{fmt(other, 2)} | {fmt(ratio, 2)} |")
        ratio_row[v] = ratio
      ratios.append(ratio_row)
  print()
  print("\\* central training is the same computation for both algorithms; measured "
        "once per C in the first algorithm's group. server step ms: (b)/(d) measured "
        "inside their rounds; (a) the engine's `server_update` jitted alone "
        "(diagnostic, not part of the round time). cores used: CPU time of the "
        "variant's process and of everything else on the machine during its timed "
        "rounds, divided by wall time (medians; 2 cores in all).")
  print()
  others = [v for v in args.variants if v != "engine"]
  print("| algorithm | C | " + " | ".join(f"{LABEL[v]} / engine" for v in others)
        + " |")
  print("|---|---|" + "---|" * len(others))
  for r in ratios:
    cells = [(fmt(r[v], 2) if isinstance(r.get(v), float) else str(r.get(v, "—")))
             for v in others]
    print(f"| {r['alg']} | {r['clients']} | " + " | ".join(cells) + " |")
  print()
  print("Ratios are time(other) / time(engine) of medians: > 1 means the engine is "
        "faster.")


def rates(rows, args, peak_reps: int = 5):
  """Each timed round as GFLOP/s (C x steps x XLA's FLOP count of one
  float32 client step, the model's arithmetic whatever the dtype) against
  the float32 and bfloat16 matmul rates XLA:CPU reaches in this process at
  the Inception CNN's im2col shapes and a large one (their maximum: the
  peak a round could approach)."""
  if args.model != "inception_cnn" or args.size != SHAPE[0]:
    print("\n(--rates: the FLOP count is the Inception CNN's at 32x32; "
          "not printed for this workload)")
    return
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import matmul_peak
  step = matmul_peak.client_step_gflop("float32")
  measured = matmul_peak.matmul_rates(peak_reps)
  f32 = max(r[1] for r in measured)
  b16 = max(r[2] for r in measured)
  print()
  print(f"Arithmetic rate: one client step is {step:.2f} GFLOP (XLA's count, "
        f"float32); XLA:CPU's matmul peak here {f32:,.0f} GFLOP/s float32, "
        f"{b16:,.0f} GFLOP/s bfloat16 -> float32 (benchmarks/matmul_peak.py's "
        "shapes, measured after the rounds).")
  print()
  print("| algorithm | C | variant | GFLOP/s | of the float32 peak | "
        "of the bfloat16 peak |")
  print("|---|---|---|---:|---:|---:|")
  for r in rows:
    if not r["times"] or r["variant"].startswith("central"):
      continue
    rate = r["clients"] * args.steps * step / _median(r["times"])
    print(f"| {r['alg']} | {r['clients']} | {LABEL[r['variant']]} | "
          f"{rate:,.0f} | {rate / f32:.0%} | {rate / b16:.0%} |")


if __name__ == "__main__":
  main()
