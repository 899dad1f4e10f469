"""FedSDAF's cost (not a test): its round against FedAvg (Adapter)'s and a plain
PyTorch loop's, and what the frozen backbone costs in memory per client.

`round`: one round of each variant on the same federation (same ViT, clients,
batch, epochs), timed round-robin so machine noise hits every variant alike;
medians and ratios to FedAvg (Adapter):

  fedavg_adapter   one adapter, cross-entropy (the paper's FedAvg (Adapter))
  fedsdaf          the full method: KIA with MHSA fusion, alternating BKD, GA
  fedsdaf-joint    BKD with both players at one point (one gradient per step)
  fedsdaf-nofusion fusion=False (the cost of the MHSA)
  fedsdaf-alpha0   alpha=0 (the KL terms' cost)
  torch            the same FedSDAF round as a plain PyTorch loop over clients
                   and batches (two models' worth of steps per batch, as the
                   released code), when torch is importable

`memory`: the compiled round program's argument and temporary bytes
(`jax.stages.Compiled.memory_analysis`) at C = 4, 16, 64 clients (every
client in the cohort, clients mapped with `lax.map`), next to the frozen
backbone's and one client's adapters' bytes: the backbone appears once, each
client adds its domain-aware adapters (and its data).

    .venv/bin/python benchmarks/fedsdaf.py round
    .venv/bin/python benchmarks/fedsdaf.py memory
    .venv/bin/python benchmarks/fedsdaf.py memory --size 224 --patch 16 \
        --dim 768 --depth 12 --heads 12 --mlp-ratio 4 --per-client 8 --batch 8
    PYTHONPATH=/path/to/torch benchmarks/fedsdaf.py round   # with the torch loop
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from _worker import round_robin
from fedccrl_overhead import federation

VARIANTS = {
    "fedavg_adapter": ("fedavg_adapter", {}),
    "fedsdaf": ("fedsdaf", {}),
    "fedsdaf-joint": ("fedsdaf", dict(bkd_order="joint")),
    "fedsdaf-nofusion": ("fedsdaf", dict(fusion=False)),
    "fedsdaf-alpha0": ("fedsdaf", dict(alpha=0.0)),
}


def vit(fed, args):
  from fedjax_dg import models
  return models.get_model("vit_tiny", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, patch=args.patch, dim=args.dim,
                          depth=args.depth, heads=args.heads,
                          mlp_dim=args.mlp_ratio * args.dim)


def build(name, model, fed, lr=1e-2):
  from fedjax_dg import algorithms
  from fedjax_dg.optim import make_optimizer
  alg_name, hp = VARIANTS[name]
  return algorithms.create(alg_name, model,
                           optimizer=make_optimizer("sgd", lr, 5e-4, 0.9),
                           hparams=hp, num_clients=fed.num_clients, data=fed)


def nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize
             for a in jax.tree.leaves(tree))


# ------------------------------------------------------------------ round


def jax_runner(name, model, fed, cfg, rounds):
  from fedjax_dg.engine.programs import programs
  alg = build(name, model, fed)
  progs = programs(alg, model, cfg, fed.num_clients)
  train = progs.layout.put_clients(fed.train)
  key = jax.random.key(0)
  frozen = progs.frozen(key)
  state = {"carry": progs.init(key), "r": 0}

  def one_round():
    carry, metrics = progs.chunk(state["carry"], jnp.int32(state["r"] % rounds),
                                 train, key, frozen, 1, jnp.int32(rounds))
    jax.block_until_ready((carry, metrics))
    state["carry"], state["r"] = carry, state["r"] + 1

  return one_round


def torch_runner(fed, args):
  """The FedSDAF round as a plain PyTorch loop (the released code's shape:
  per client, per batch, the di player's step then the dw player's)."""
  import torch
  from torch import nn
  import torch.nn.functional as F  # noqa: N812

  d, heads, depth, p = args.dim, args.heads, args.depth, args.patch
  h, w, c = fed.image_shape
  tokens = 1 + (h // p) * (w // p)

  def adapter():
    return nn.Sequential(nn.Linear(d, d // 4), nn.GELU(), nn.Linear(d // 4, d))

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
      self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
      r = args.mlp_ratio
      self.mlp = nn.Sequential(nn.Linear(d, r * d), nn.GELU(),
                               nn.Linear(r * d, d))

    def forward(self, x):
      y = self.ln1(x)
      x = x + self.attn(y, y, y, need_weights=False)[0]
      return x + self.mlp(self.ln2(x))

  class Fusion(nn.Module):
    def __init__(self):
      super().__init__()
      self.norm = nn.LayerNorm(d, eps=1e-6)
      self.attn = nn.MultiheadAttention(d, 8, batch_first=True)

    def forward(self, a, x):
      z = self.norm(torch.cat([a, x], 1))
      return self.attn(z[:, :a.shape[1]], z, z, need_weights=False)[0]

  class ViT(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Conv2d(c, d, p, p)
      self.cls = nn.Parameter(torch.zeros(1, 1, d))
      self.pos = nn.Parameter(torch.zeros(1, tokens, d))
      self.blocks = nn.ModuleList(Block() for _ in range(depth))
      self.norm = nn.LayerNorm(d, eps=1e-6)
      self.head = nn.Linear(d, fed.num_classes)
      self.adi = nn.ModuleList(adapter() for _ in range(depth))
      self.adw = nn.ModuleList(adapter() for _ in range(depth))
      self.fuse = nn.ModuleList(Fusion() for _ in range(depth))

    def forward(self, x, path):
      x = self.embed(x).flatten(2).transpose(1, 2)
      x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
      for i, blk in enumerate(self.blocks):
        x = blk(x)
        if path == "di":
          x = x + self.adi[i](x)
        else:
          x = x + 0.5 * self.fuse[i](self.adw[i](x), x) + 0.5 * self.adi[i](x)
      return self.head(self.norm(x)[:, 0])

  model = ViT()
  for q in model.parameters():
    q.requires_grad_(False)
  di = [*model.adi.parameters(), *model.head.parameters()]
  dw = [*model.adw.parameters(), *model.fuse.parameters()]
  x_all = torch.tensor(np.asarray(fed.train.x), dtype=torch.float32)
  x_all = x_all.permute(0, 1, 4, 2, 3) / 255.0
  y_all = torch.tensor(np.asarray(fed.train.y), dtype=torch.long)
  n_all = np.asarray(fed.train.n)
  kl = lambda student, teacher: F.kl_div(F.log_softmax(student, 1),
                                         F.softmax(teacher, 1),
                                         reduction="batchmean")

  def player_step(params, opt, x, y, path, teacher):
    for q in params:
      q.requires_grad_(True)
    with torch.no_grad():
      z_teacher = model(x, teacher)
    z = model(x, path)
    loss = F.cross_entropy(z, y) + kl(z, z_teacher)
    opt.zero_grad()
    loss.backward()
    opt.step()
    for q in params:
      q.requires_grad_(False)

  def one_round():
    model.train()
    for k in range(x_all.shape[0]):
      opt_di = torch.optim.SGD(di, lr=1e-2, momentum=0.9, weight_decay=5e-4)
      opt_dw = torch.optim.SGD(dw, lr=1e-2, momentum=0.9, weight_decay=5e-4)
      perm = torch.randperm(int(n_all[k]))
      for s in range(0, int(n_all[k]), args.batch):
        idx = perm[s:s + args.batch]
        x, y = x_all[k, idx], y_all[k, idx]
        # The di player steps against the dw path, then the reverse.
        player_step(di, opt_di, x, y, "di", "kia")
        player_step(dw, opt_dw, x, y, "kia", "di")

  return one_round


def cmd_round(args):
  from fedjax_dg import engine
  fed = federation(args.clients, args.per_client, args.size, args.classes)
  model = vit(fed, args)
  rounds = 1000
  cfg = engine.EngineConfig(rounds=rounds, eval_every=1, epochs=1,
                            batch_size=args.batch, client_mapping="map",
                            progress=False)
  runners = {}
  for name in args.variants:
    runners[name] = jax_runner(name, model, fed, cfg, rounds)
  try:
    if not args.no_torch:
      import torch
      torch.set_num_threads(args.torch_threads or torch.get_num_threads())
      runners["torch"] = torch_runner(fed, args)
  except ImportError:
    print("torch not importable: the PyTorch loop is left out", flush=True)
  for name, fn in runners.items():
    t0 = time.perf_counter()
    fn()  # compile + first round
    print(f"{name}: first round (with compiling) {time.perf_counter() - t0:.1f} s",
          flush=True)
  times = round_robin(runners, args.reps)
  base = statistics.median(times["fedavg_adapter"])
  steps = -(-args.per_client // args.batch)
  print(f"\nvit_tiny dim {args.dim} depth {args.depth} heads {args.heads} "
        f"patch {args.patch} on {args.size}x{args.size}x3, {args.clients} "
        f"clients x {args.per_client} examples, batch {args.batch}, 1 epoch "
        f"({steps} steps per client), medians of {args.reps} rounds, "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}")
  print(f"{'variant':18s} {'median s':>9s} {'x fedavg_adapter':>17s}")
  out = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    out[name] = dict(median_s=med, ratio=med / base, times=ts)
    print(f"{name:18s} {med:9.3f} {med / base:17.2f}")
  print("@@json " + json.dumps(dict(args=vars(args), results=out)))


# ----------------------------------------------------------------- memory


def cmd_memory(args):
  from fedjax_dg import engine
  from fedjax_dg.engine.round import make_round
  rows = []
  for c in args.counts:
    fed = federation(c, args.per_client, args.size, args.classes)
    model = vit(fed, args)
    alg = build("fedsdaf", model, fed)
    cfg = engine.EngineConfig(rounds=10, epochs=1, batch_size=args.batch,
                              client_mapping="map")
    round_fn = make_round(alg, cfg, c)
    key = jax.random.key(0)
    carry = jax.eval_shape(alg.init, key)
    frozen = jax.eval_shape(alg.frozen, key)
    train = jax.tree.map(jnp.asarray, fed.train)
    compiled = jax.jit(round_fn).lower(carry, jnp.int32(0), train, key,
                                       frozen).compile()
    mem = compiled.memory_analysis()
    server, clients = carry
    rows.append(dict(
        clients=c, frozen=nbytes(frozen), server=nbytes(server),
        client_state=nbytes(clients), data=nbytes(train),
        arguments=int(mem.argument_size_in_bytes),
        temp=int(mem.temp_size_in_bytes)))
    print(json.dumps(rows[-1]), flush=True)
  per_client = rows[0]["client_state"] / rows[0]["clients"]
  print(f"\nvit_tiny dim {args.dim} depth {args.depth} on {args.size}x"
        f"{args.size}x3, {args.per_client} examples per client; bytes "
        f"(frozen backbone {rows[0]['frozen']:,}; one client's domain-aware "
        f"adapters {per_client:,.0f})")
  print(f"{'C':>4s} {'args - data':>12s} {'d/client':>10s} {'temp':>12s}")
  first = rows[0]
  for r in rows:
    a = r["arguments"] - r["data"]
    grow = ((a - (first["arguments"] - first["data"]))
            / max(r["clients"] - first["clients"], 1))
    print(f"{r['clients']:4d} {a:12,d} {grow:10,.0f} {r['temp']:12,d}")
  print("@@json " + json.dumps(dict(args=vars(args), rows=rows)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("part", choices=("round", "memory"))
  p.add_argument("--size", type=int, default=32)
  p.add_argument("--patch", type=int, default=8)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--depth", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--mlp-ratio", type=int, default=2)
  p.add_argument("--clients", type=int, default=3)
  p.add_argument("--classes", type=int, default=7, help="7: PACS's")
  p.add_argument("--per-client", type=int, default=128)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--torch-threads", type=int, default=0)
  p.add_argument("--no-torch", action="store_true",
                 help="round: leave the PyTorch loop out (it runs on the CPU: "
                 "minutes a round at ViT-B/16 beside a GPU)")
  p.add_argument("--counts", type=int, nargs="+", default=[4, 16, 64])
  p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                 choices=list(VARIANTS))
  args = p.parse_args(argv)
  {"round": cmd_round, "memory": cmd_memory}[args.part](args)


if __name__ == "__main__":
  main()
