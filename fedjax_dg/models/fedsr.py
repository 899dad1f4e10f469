"""FedSR's probabilistic representation on top of a client model (Nguyen et al. 2022).

    f        = model.features(x)                 penultimate representation [B, F]
    [m, s]   = f @ rep.kernel + rep.bias         Dense(2 z_dim): the reference
                                                 code's `net.fc`
    mu, sigma = m, softplus(s)
    z        = mu + sigma * eps   (training, reparameterized, one sample)
             = mu                (evaluation)
    logits   = z @ cls.kernel + cls.bias         Dense(num_classes): `cls`

Params: {"body": the client model's params without its last layer
(`model.head_name`: `fc2`, a ViT's `head`),
"rep": Dense(2 z_dim), "cls": Dense(num_classes)}, PyTorch-default initialized like
the client model.

At evaluation `cls(mu)` is an affine function of f, so `to_model_params` folds
`rep[:, :z_dim]` and `cls` into the client model's own last layer: the
engine evaluates FedSR with the plain client model (no FedSR-specific code in the
engine or evaluation). The reference code instead averages the softmax of 20
samples at test time; see docs/faithfulness.md.

`rep` and `cls` compute in the client model's compute dtype (`model.dtype`);
mu, sigma and the logits are float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Params = Any


def feature_dim(model) -> int:
  """F, the width of `model.features` (the input of its last Linear layer)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return int(shapes[model.head_name]["kernel"].shape[0])


@dataclasses.dataclass(frozen=True)
class ProbabilisticModel:
  """A client `Model` whose last layer is replaced by FedSR's z ~ N(mu, sigma).

  Attributes:
    model: the client model (its `features` feed the representation).
    z_dim: size of z; 0 means F, the model's feature width (the reference code
      uses z_dim = 512 = ResNet-18's feature width).
  """
  model: Any
  z_dim: int = 0
  feature_width: int = dataclasses.field(init=False, default=0)  # F

  def __post_init__(self):
    if self.z_dim < 0:
      raise ConfigError(
          f"z_dim must be >= 0 (0: the feature width), got {self.z_dim}")
    object.__setattr__(self, "feature_width", feature_dim(self.model))
    if not self.z_dim:
      object.__setattr__(self, "z_dim", self.feature_width)

  def init(self, key: jax.Array) -> Params:
    """Samples {"body", "rep", "cls"}; jitted."""
    return _jitted_init(dataclasses.replace(
        self, model=self.model.unnormalized()))(key)

  def distribution(self, params: Params, x: jax.Array, *, train: bool = False,
                   rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(mu, sigma), each [B, z_dim]; `rng` is the dropout key of the body."""
    f = self.model.features(params["body"], x, train=train, rng=rng)
    out = layers.cast(layers.dense(params["rep"], f, self.model.dtype),
                      jnp.float32)
    z = self.z_dim
    return out[:, :z], jax.nn.softplus(out[:, z:])

  def classify(self, params: Params, z: jax.Array) -> jax.Array:
    return layers.cast(layers.dense(params["cls"], z, self.model.dtype),
                       jnp.float32)

  def apply(self, params: Params, x: jax.Array, *, train: bool = False,
            rng: jax.Array | None = None) -> jax.Array:
    """Logits: of one sample of z when training (needs `rng`), of mu otherwise."""
    if not train:
      return self.classify(params, self.distribution(params, x)[0])
    k_body, k_z = jax.random.split(rng)
    mu, sigma = self.distribution(params, x, train=True, rng=k_body)
    return self.classify(params, mu + sigma * jax.random.normal(k_z, mu.shape))

  def to_model_params(self, params: Params) -> Params:
    """Client-model params whose logits equal `cls(mu)` (the evaluation model)."""
    z = self.z_dim
    w_mu, b_mu = params["rep"]["kernel"][:, :z], params["rep"]["bias"][:z]
    w_c, b_c = params["cls"]["kernel"], params["cls"]["bias"]
    last = {"kernel": w_mu @ w_c, "bias": b_mu @ w_c + b_c}
    return dict(params["body"], **{self.model.head_name: last})


@functools.lru_cache(maxsize=16)
def _jitted_init(prob: ProbabilisticModel):
  how = getattr(prob.model.module, "weight_init", "torch")
  f, z, c = prob.feature_width, prob.z_dim, prob.model.num_classes
  dense = lambda kk, kb, fan_in, out: {
      "kernel": layers.kernel_init(how)(kk, (fan_in, out), jnp.float32),
      "bias": layers.bias_init(how, fan_in)(kb, (out,), jnp.float32)}

  def init(key):
    k_body, k_rk, k_rb, k_ck, k_cb = jax.random.split(key, 5)
    body = dict(prob.model.init(k_body))
    body.pop(prob.model.head_name)
    with layers.init_rng_mode():
      return {"body": body, "rep": dense(k_rk, k_rb, f, 2 * z),
              "cls": dense(k_ck, k_cb, z, c)}

  return jax.jit(init)
