"""FedADG's networks around a client model (Zhang et al. 2021, arXiv
2111.10487).

Each client holds four networks; the run's client model supplies two of them:

    F  feature extractor    `model.features`          x -> f   [B, F]
    C  classifier           `model.head`              f -> logits
    G  distribution generator (the reference distribution in feature space,
       conditioned on the label):
           r = act(W2 leaky_relu(W1 [u, s onehot(y)] + b1) + b2)      [B, F]
           u ~ U(0, 1)^noise_dim, s = `label_scale`, act = ReLU (or identity)
    D  discriminator (reference sample vs feature, conditioned on the label):
           D(v, y) = sigmoid(w3 leaky_relu(W2 (P [v, s onehot(y)]) + b2) + b3)
           P: [F + C, rp_size], no bias, divided by its Frobenius norm at init

Sizes in the released code (github.com/wzml/FedADG, `models/Nets.py`,
`pacs-ours/Nets.py`): noise 2048 (FedCCRL's re-implementation: F), generator
hidden 4096, projection 1024, discriminator hidden 1024, label scale 0.6 (0.7
in one PACS step), on AlexNet's 4096-d fc7 features. The defaults here are
small (256 / 256 / 256, noise = F) for the small models of this library;
every size is a setting. Initialization follows the code: the generator's
kernels xavier-uniform with gain 0.5, the other tensors PyTorch's `nn.Linear`
default. The leaky slope is PyTorch's default, 0.01.

Params: {"model": the client model's params, "gen": {"fc1", "fc2"}, "disc":
{"proj", "fc1", "fc2"}}; each Dense is {"kernel": [in, out], "bias": [out]}
(`proj` has no bias). G and D compute in the client model's compute dtype
(`model.dtype`); their outputs (r, D's probability) are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers
from fedjax_dg.models.fedsr import feature_dim

Params = Any
LEAKY_SLOPE = 0.01  # torch.nn.LeakyReLU's default


@dataclasses.dataclass(frozen=True)
class FedADGNets:
  """The client `model` plus FedADG's generator and discriminator.

  Attributes:
    model: the client model (F = `features`, C = `head`).
    noise_dim: the generator's noise width; 0: F, the feature width.
    gen_hidden: the generator's hidden width (code: 4096).
    rp_size: the discriminator's projection width (code: 1024).
    disc_hidden: the discriminator's hidden width (code: 1024).
    label_scale: the one-hot label's value fed to G and D (code: 0.6).
    gen_relu: a ReLU on the generator's output (code: True, matching
      AlexNet's post-ReLU fc7 features); False for models whose features can
      be negative.
  """
  model: Any
  noise_dim: int = 0
  gen_hidden: int = 256
  rp_size: int = 256
  disc_hidden: int = 256
  label_scale: float = 0.6
  gen_relu: bool = True
  feature_width: int = dataclasses.field(init=False, default=0)  # F

  def __post_init__(self):
    for field in ("noise_dim", "gen_hidden", "rp_size", "disc_hidden"):
      value = getattr(self, field)
      low = 0 if field == "noise_dim" else 1
      if value < low:
        raise ConfigError(f"fedadg.{field}={value!r}: must be >= {low}"
                          + (" (0: the feature width)" if low == 0 else ""))
    if not self.label_scale > 0:
      raise ConfigError(f"fedadg.label_scale={self.label_scale!r}: must be > 0")
    object.__setattr__(self, "feature_width", feature_dim(self.model))
    if not self.noise_dim:
      object.__setattr__(self, "noise_dim", self.feature_width)

  @property
  def num_classes(self) -> int:
    return self.model.num_classes

  def init(self, key: jax.Array) -> Params:
    """{"model", "gen", "disc"}; jitted."""
    return _jitted_init(dataclasses.replace(
        self, model=self.model.unnormalized()))(key)

  def init_generator(self, key: jax.Array) -> Params:
    return _init_generator(self, key)

  def init_discriminator(self, key: jax.Array) -> Params:
    return _init_discriminator(self, key)

  def label_code(self, y: jax.Array) -> jax.Array:
    """[B, C]: `label_scale` at the label, 0 elsewhere."""
    return self.label_scale * jax.nn.one_hot(y, self.num_classes)

  def noise(self, key: jax.Array, batch: int) -> jax.Array:
    """[B, noise_dim] ~ U(0, 1) (`torch.rand`)."""
    return jax.random.uniform(key, (batch, self.noise_dim))

  def generate(self, gen: Params, u: jax.Array, y: jax.Array) -> jax.Array:
    """Reference samples [B, F] for noise `u` [B, noise_dim] and labels `y`."""
    dtype = self.model.dtype
    h = layers.dense(gen["fc1"], jnp.concatenate([u, self.label_code(y)], axis=1),
                     dtype)
    out = layers.dense(gen["fc2"], jax.nn.leaky_relu(h, LEAKY_SLOPE), dtype)
    return layers.cast(jax.nn.relu(out) if self.gen_relu else out, jnp.float32)

  def discriminate(self, disc: Params, v: jax.Array, y: jax.Array) -> jax.Array:
    """[B] in (0, 1): the probability that `v` [B, F] is a reference sample."""
    dtype = self.model.dtype
    h = layers.dense(disc["proj"], jnp.concatenate([v, self.label_code(y)],
                                                   axis=1), dtype)
    h = jax.nn.leaky_relu(layers.dense(disc["fc1"], h, dtype), LEAKY_SLOPE)
    logit = layers.cast(layers.dense(disc["fc2"], h, dtype)[:, 0], jnp.float32)
    return jax.nn.sigmoid(logit)


def _uniform(key, layout):
  """{layer: {tensor: U(-bound, bound) of shape}} for a layout {layer:
  {tensor: (shape, bound)}}, from one draw (one threefry call: each call
  costs compile time on XLA:CPU)."""
  items = [(layer, name, shape, bound) for layer, tensors in layout.items()
           for name, (shape, bound) in tensors.items()]
  sizes = [math.prod(shape) for _, _, shape, _ in items]
  flat = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
  out, at = {}, 0
  for (layer, name, shape, bound), size in zip(items, sizes):
    out.setdefault(layer, {})[name] = bound * flat[at:at + size].reshape(shape)
    at += size
  return out


def _torch_linear(fan_in, out, bias=True, kernel_bound=None):
  """PyTorch's nn.Linear init: kernel and bias U(+-1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  layout = {"kernel": ((fan_in, out), kernel_bound or bound)}
  if bias:
    layout["bias"] = ((out,), bound)
  return layout


def _init_generator(nets: FedADGNets, key):
  # xavier_uniform_(weight, gain=0.5): U(+-0.5 sqrt(6 / (fan_in + fan_out))).
  xavier = lambda fan_in, out: 0.5 * math.sqrt(6.0 / (fan_in + out))
  n_in = nets.noise_dim + nets.num_classes
  h, f = nets.gen_hidden, nets.feature_width
  return _uniform(key, {
      "fc1": _torch_linear(n_in, h, kernel_bound=xavier(n_in, h)),
      "fc2": _torch_linear(h, f, kernel_bound=xavier(h, f))})


def _init_discriminator(nets: FedADGNets, key):
  c, f = nets.num_classes, nets.feature_width
  out = _uniform(key, {"proj": _torch_linear(f + c, nets.rp_size, bias=False),
                       "fc1": _torch_linear(nets.rp_size, nets.disc_hidden),
                       "fc2": _torch_linear(nets.disc_hidden, 1)})
  out["proj"]["kernel"] = out["proj"]["kernel"] / jnp.linalg.norm(
      out["proj"]["kernel"])
  return out


@functools.lru_cache(maxsize=16)
def _jitted_init(nets: FedADGNets):

  def init(key):
    k_model, k_gen, k_disc = jax.random.split(key, 3)
    with layers.init_rng_mode():
      return {"model": nets.model.init(k_model),
              "gen": _init_generator(nets, k_gen),
              "disc": _init_discriminator(nets, k_disc)}

  return jax.jit(init)
