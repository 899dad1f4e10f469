"""Plain PyTorch reference of one FedAvg / hFedF round (variant (d) of round_time.py;
CPU by default, `device="cuda"` on a GPU).

The shape of the papers' reference code (pFedHN / FedDG-style loops), written the
way a PyTorch user would write it; nothing here is tuned:

* `InceptionCNN`: the hFedF client CNN of Table 9 (the same layers as
  `fedjax_dg.models.InceptionCNN`: conv3x3 32, maxpool 2 + relu, conv1x1 32,
  conv3x3 64, maxpool 2 + relu, two naive Inception modules [1x1 32, 3x3 64, 5x5 16,
  3x3/1 max pool passthrough] + relu, adaptive avg pool 3, flatten, dropout 0.2,
  linear 256, linear n_classes), PyTorch default init, NCHW.
* FedAvg round: for every client `copy.deepcopy(global_model)`, `torch.optim.SGD`,
  `steps` steps of batch `batch_size` (a fresh permutation per round), then the
  example-weighted mean of the clients' `state_dict`s loaded into the global model.
* hFedF round (pFedHN-style server step with GradAlign): per client
  `weights = hnet(i)`, `net.load_state_dict(weights)`, local SGD,
  `delta = weights - trained`, `torch.autograd.grad(weights, hnet.parameters(),
  grad_outputs=delta)`; the per-client gradients are kept (flattened, one
  [P_hypernetwork] vector per client), GradAlign weights = softmax of each one's
  cosine to their mean (separately for the hypernetwork weights and the
  embedding table), weighted sum, Adam (weight decay on the hypernetwork weights
  only), then hFedF's EMA (Alg. 4).

    import benchmarks.torch_reference as tr
    model = tr.InceptionCNN(num_classes=7)
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class NaiveInception(nn.Module):
  """Szegedy et al. (2015) Fig. 2a: [1x1 c1, 3x3 c3, 5x5 c5, 3x3/1 max pool]."""

  def __init__(self, cin: int, channels=(32, 64, 16)):
    super().__init__()
    c1, c3, c5 = channels
    self.branch1x1 = nn.Conv2d(cin, c1, 1)
    self.branch3x3 = nn.Conv2d(cin, c3, 3, padding=1)
    self.branch5x5 = nn.Conv2d(cin, c5, 5, padding=2)

  def forward(self, x):
    pool = F.max_pool2d(x, 3, stride=1, padding=1)
    return torch.cat([self.branch1x1(x), self.branch3x3(x), self.branch5x5(x), pool],
                     dim=1)


class InceptionCNN(nn.Module):
  """hFedF Table 9 client CNN (928,199 parameters for 3 channels and 7 classes)."""

  def __init__(self, num_classes: int = 7, in_channels: int = 3,
               dropout: float = 0.2):
    super().__init__()
    self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
    self.conv2 = nn.Conv2d(32, 32, 1)
    self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
    self.inception1 = NaiveInception(64)
    self.inception2 = NaiveInception(176)
    self.pool = nn.AdaptiveAvgPool2d(3)
    self.drop = nn.Dropout(dropout)
    self.fc1 = nn.Linear(288 * 9, 256)
    self.fc2 = nn.Linear(256, num_classes)

  def forward(self, x):
    x = F.relu(F.max_pool2d(self.conv1(x), 2))
    x = self.conv3(self.conv2(x))
    x = F.relu(F.max_pool2d(x, 2))
    x = F.relu(self.inception1(x))
    x = F.relu(self.inception2(x))
    x = torch.flatten(self.pool(x), 1)
    return self.fc2(self.fc1(self.drop(x)))


def to_torch_data(x_uint8: np.ndarray, y: np.ndarray):
  """uint8 [C, n, H, W, ch] -> float NCHW normalized ((x/255 - 0.5)/0.5), int64 y.

  Done once, outside the timed rounds (the most favorable data path for torch).
  """
  x = torch.from_numpy(np.ascontiguousarray(x_uint8)).permute(0, 1, 4, 2, 3)
  x = (x.float() / 255.0 - 0.5) / 0.5
  return x.contiguous(), torch.from_numpy(np.asarray(y, np.int64))


def local_train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int,
                batch_size: int, lr: float, optimizer: str = "sgd",
                bf16: bool = False):
  """`steps` SGD (or Adam) steps on one client's examples; returns mean loss.
  `bf16`: the forward pass and loss under `torch.autocast` with bfloat16
  (float32 parameters and optimizer, PyTorch's mixed-precision recipe)."""
  net.train()
  opt = (torch.optim.SGD(net.parameters(), lr=lr) if optimizer == "sgd" else
         torch.optim.Adam(net.parameters(), lr=lr))
  perm = torch.randperm(x.shape[0]).to(x.device)
  total = 0.0
  for s in range(steps):
    idx = perm[(s * batch_size) % x.shape[0]:][:batch_size]
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
      loss = F.cross_entropy(net(x[idx]), y[idx])
    loss.backward()
    opt.step()
    total += loss.item()
  return total / steps


class FedAvgReference:
  """Global model + a round = deepcopy per client, local SGD, mean of state_dicts."""

  def __init__(self, num_classes: int, *, steps: int, batch_size: int, lr: float,
               optimizer: str = "sgd", device: str = "cpu", bf16: bool = False):
    self.model = InceptionCNN(num_classes).to(device)
    self.kw = dict(steps=steps, batch_size=batch_size, lr=lr, optimizer=optimizer,
                   bf16=bf16)

  def round(self, xs, ys):
    import time
    states, weights = [], []
    for x, y in zip(xs, ys):
      local = copy.deepcopy(self.model)
      local_train(local, x, y, **self.kw)
      states.append(local.state_dict())
      weights.append(float(x.shape[0]))
    t0 = time.perf_counter()
    total = sum(weights)
    avg = OrderedDict(
        (k, sum(w * sd[k] for w, sd in zip(weights, states)) / total)
        for k in states[0])
    self.model.load_state_dict(avg)
    self.last_server_s = time.perf_counter() - t0
    return {}


class HyperNetwork(nn.Module):
  """pFedHN / hFedF Table 8: embedding -> [Linear(50), LeakyReLU] x 3 -> Linear(50)
  -> one Linear head per client-parameter tensor.

  Heads are initialized like the library's `head_init="client_init"` (bias = a
  client-model init sample, kernel N(0, 0.1 * (std / sqrt(hidden))^2)) so the
  generated models are sane (the timing does not depend on it).
  """

  def __init__(self, target: nn.Module, num_clients: int, embed_dim: int,
               hidden: int = 50, n_hidden: int = 3, head_scale: float = 0.1):
    super().__init__()
    self.embeddings = nn.Embedding(num_clients, embed_dim)
    nn.init.normal_(self.embeddings.weight)
    layers, d = [], embed_dim
    for _ in range(n_hidden):
      layers += [nn.Linear(d, hidden), nn.LeakyReLU(0.01)]
      d = hidden
    layers.append(nn.Linear(hidden, hidden))
    self.trunk = nn.Sequential(*layers)
    self.names = [k for k, _ in target.named_parameters()]
    self.shapes = [tuple(p.shape) for _, p in target.named_parameters()]
    self.heads = nn.ModuleList()
    with torch.no_grad():
      for _, p in target.named_parameters():
        head = nn.Linear(hidden, p.numel())
        head.bias.copy_(p.reshape(-1))
        std = float(p.std()) * math.sqrt(head_scale / hidden)
        head.weight.normal_(0.0, std)
        self.heads.append(head)

  def theta(self):
    """The hypernetwork weights (everything but the embedding table)."""
    return [p for n, p in self.named_parameters() if not n.startswith("embeddings")]

  def forward(self, idx: int):
    idx = torch.tensor([idx], device=self.embeddings.weight.device)
    h = self.trunk(self.embeddings(idx)[0])
    return OrderedDict((n, head(h).reshape(s))
                       for n, s, head in zip(self.names, self.shapes, self.heads))


class HFedFReference:
  """hnet + Adam + EMA; a round = pFedHN per-client VJPs + GradAlign over all clients."""

  def __init__(self, num_classes: int, num_clients: int, *, steps: int,
               batch_size: int, lr: float, optimizer: str = "sgd",
               server_lr: float = 1e-3, server_weight_decay: float = 1e-5,
               ema_decay: float = 0.95, ema_warmup: int = 5,
               device: str = "cpu"):
    self.net = InceptionCNN(num_classes)
    embed_dim = int(1 + num_clients / 4)
    self.hnet = HyperNetwork(self.net, num_clients, embed_dim).to(device)
    self.net.to(device)
    self.opt = torch.optim.Adam(
        [{"params": self.hnet.theta(), "weight_decay": server_weight_decay},
         {"params": [self.hnet.embeddings.weight], "weight_decay": 0.0}],
        lr=server_lr)
    self.kw = dict(steps=steps, batch_size=batch_size, lr=lr, optimizer=optimizer)
    self.ema_decay, self.ema_warmup = ema_decay, ema_warmup
    self.ema = None
    self.round_idx = 0
    self.last_server_s = 0.0

  def round(self, xs, ys):
    import time
    theta = self.hnet.theta()
    emb = self.hnet.embeddings.weight
    g_theta, g_emb = [], []        # per-client flattened gradients (materialized)
    t_server = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
      weights = self.hnet(i)                                   # with autograd graph
      self.net.load_state_dict(weights)
      inner = OrderedDict((k, v.detach().clone()) for k, v in weights.items())
      local_train(self.net, x, y, **self.kw)
      t0 = time.perf_counter()
      final = self.net.state_dict()
      delta = [inner[k] - final[k] for k in weights]
      grads = torch.autograd.grad(list(weights.values()), theta + [emb],
                                  grad_outputs=delta)
      g_theta.append(torch.cat([g.reshape(-1) for g in grads[:-1]]))
      g_emb.append(grads[-1].reshape(-1))
      del grads, weights
      t_server += time.perf_counter() - t0

    t0 = time.perf_counter()
    agg = []
    for gs in (g_theta, g_emb):   # GradAlign, separately for theta and embeddings
      mean = torch.zeros_like(gs[0])
      for g in gs:
        mean += g
      mean /= len(gs)
      cos = torch.stack([F.cosine_similarity(g, mean, dim=0) for g in gs])
      w = torch.softmax(cos, dim=0)
      out = torch.zeros_like(gs[0])
      for wi, g in zip(w, gs):
        out.add_(g, alpha=float(wi))
      agg.append(out)
    del g_theta, g_emb
    self.opt.zero_grad()
    offset = 0
    for p in theta:
      p.grad = agg[0][offset:offset + p.numel()].view_as(p).clone()
      offset += p.numel()
    emb.grad = agg[1].view_as(emb).clone()
    self.opt.step()
    # hFedF Alg. 4: EMA after the server step, initialized at the warm-up round.
    with torch.no_grad():
      params = list(self.hnet.parameters())
      if self.round_idx == self.ema_warmup:
        self.ema = [p.detach().clone() for p in params]
      elif self.round_idx > self.ema_warmup:
        for p, e in zip(params, self.ema):
          e.mul_(1.0 - self.ema_decay).add_(p, alpha=self.ema_decay)
          p.copy_(e)
    self.round_idx += 1
    self.last_server_s = t_server + time.perf_counter() - t0
    return {}


def num_params(module: nn.Module) -> int:
  return sum(p.numel() for p in module.parameters())
