"""The HyperGenFL hypernetwork: client embeddings -> layer-wise aggregation weights.

Section 3.1 of the paper (Fig. 2), for the m active clients with embeddings
sigma [m, d]:

    x      = sigma
    x      = MHA_k(x) + x,  k = 1..K            Eq. 4 (K = 1 in the paper)
    z      = softmax(x)                          Eq. 4, over the d features
    s^l_c  = ReLU(w_l . z_c + b_l) + lambda      Eq. 5, one 1-layer MLP per layer l
    a^l_c  = s^l_c / sum_c' s^l_c'               Eq. 6 (SumNorm over active clients)

The attention is self-attention over the *cohort* (sequence axis = active
clients), so a client's weight depends on which other clients are active. The
L parallel Linear(d, 1) decoders are one [d, L] kernel (PyTorch's nn.Linear
initialization, as the paper's PyTorch code). See docs/faithfulness.md
("HyperGenFL") for the choices the paper leaves open (number of heads,
softmax axis, lambda, how K > 1 layers are stacked).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array


class AttentionScores(nn.Module):
  """HN(phi, sigma) of Eq. 7: [m, d] embeddings -> [m, L] weights (columns sum to 1).

  Attributes:
    embed_dim: d, the embedding width (= the attention width, as PyTorch's
      nn.MultiheadAttention(embed_dim=d)).
    num_layers: L, the number of client-model layers (one weight per layer).
    num_heads: attention heads (must divide d; the paper gives no value).
    attention_layers: K residual MHA blocks before the softmax (Tables 7-8).
    lam: the lambda of Eq. 5 (a small positive constant; no value in the paper).
  """
  embed_dim: int
  num_layers: int
  num_heads: int = 4
  attention_layers: int = 1
  lam: float = 1e-3

  def setup(self):
    if self.embed_dim % self.num_heads:
      raise ConfigError(f"hypergenfl: num_heads={self.num_heads} must divide the "
                       f"embedding dimension {self.embed_dim}")
    self.mha = [nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.embed_dim,
        out_features=self.embed_dim, deterministic=True)
                for _ in range(self.attention_layers)]
    self.decode = layers.Dense(self.num_layers, weight_init="torch")

  def latent(self, sigma: Array) -> Array:
    """z = softmax(MHA(sigma) + sigma) (Eq. 4), [m, d]."""
    x = sigma[None]  # a batch of one "sequence" of m clients
    for mha in self.mha:
      x = mha(x) + x
    return jax.nn.softmax(x[0], axis=-1)

  def preactivations(self, sigma: Array) -> Array:
    """MLP_l(z_c) before the ReLU of Eq. 5, [m, L] (<= 0: the ReLU is off)."""
    return self.decode(self.latent(sigma))

  def __call__(self, sigma: Array) -> Array:
    s = jax.nn.relu(self.preactivations(sigma)) + self.lam   # Eq. 5
    return s / jnp.sum(s, axis=0, keepdims=True)              # Eq. 6


def init_attention_scores(module: AttentionScores, key: Array,
                          embed_dim: int) -> dict:
  """phi: the hypernetwork weights (independent of the cohort size)."""
  with layers.init_rng_mode():
    return jax.jit(module.init)(key, jnp.ones((2, embed_dim)))["params"]


def decoder_preactivations(module: AttentionScores, phi: dict,
                           sigma: Array) -> Array:
  """[m, L] pre-ReLU decoder outputs of the cohort with embeddings `sigma`."""
  return module.apply({"params": phi}, sigma,
                      method=AttentionScores.preactivations)
