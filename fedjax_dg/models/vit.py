"""Vision Transformer (Dosovitskiy et al. 2021) with FedSDAF's adapters, loop-safe.

The backbone is the original ViT: non-overlapping patches embedded linearly
(a conv with kernel = stride = patch, computed as a reshape and one matmul: no
convolution inside the clients' loops), a class token, learned position
embeddings for the model's own input grid (a pretrained file's are resized by
`vit_weights`), `depth` pre-LN blocks

    x = x + MHSA(LN(x));   x = x + MLP(LN(x))     (GELU, exact erf by default)

a final LayerNorm (eps 1e-6 everywhere, as the AugReg / timm / torchvision
releases) and the class token's representation as `features`.

FedSDAF's Knowledge Integrator Adapter (KIA, Eq. 3-4) follows every block's
output h (the block ends with its FFN's residual sum):

    A(h)      = up(GELU(down(h)))                 bottleneck dim -> adapter_dim
    A_dw^(h)  = MHSA(LN[A_dw(h); h])[:T]          fusion: the adapter's T tokens
                                                   attend to all 2T tokens
    h'        = h + 1/2 A_dw^(h) + 1/2 A_di(h)     the "kia" path
    h'        = h + A_di(h)                        the "di" path (z_di of Eq. 5)

`adapters` picks which exist: "none" (a plain ViT), "di" (one adapter: the
FedAvg-adapter baseline), "kia" (both; `fusion=False` drops the MHSA,
`A_dw^ = A_dw`). Top-level parameter entries: `backbone` (patch embedding,
class token, position embeddings, blocks, final norm; frozen by FedSDAF),
`head`, `adi`, `adw`, `fuse`: an algorithm freezes, aggregates or keeps per
client whole entries.

Parameter names follow the original JAX release (`embedding`, `cls`,
`pos_embedding`, `MultiHeadDotProductAttention`'s `query/key/value/out`
kernels [D, H, D/H] / [H, D/H, D]), so its `.npz` checkpoints map one to one.

`dtype` (`model.dtype`) is the compute dtype of every layer (flax's `dtype=`;
parameters stay float32): LayerNorm statistics and the attention softmax are
float32 whatever it is, and the logits come back as float32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array

ADAPTERS = ("none", "di", "kia")
PATHS = ("kia", "di")
ADAPTER_INITS = ("torch", "zero")
LN_EPS = 1e-6
# (dim, depth, heads, mlp_dim) of the released sizes.
SIZES = {"b16": (768, 12, 12, 3072), "ti16": (192, 12, 3, 768)}


def _gelu(approximate: bool):
  return lambda x: nn.gelu(x, approximate=approximate)


def LayerNorm(name=None, dtype=jnp.float32) -> nn.LayerNorm:  # noqa: N802
  """nn.LayerNorm (params `scale`, `bias`), eps 1e-6; statistics in float32,
  output in `dtype`. (A module factory.)"""
  return nn.LayerNorm(epsilon=LN_EPS, name=name, dtype=dtype)


class PatchEmbed(nn.Module):
  """A conv with kernel = stride = patch (params `kernel` [p, p, C, D],
  `bias`) computed as patches [B, T, p*p*C] times the reshaped kernel."""
  patch: int
  dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = layers.cast(x, self.dtype)
    b, h, w, c = x.shape
    p = self.patch
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (p, p, c, self.dim))
    bias = self.param("bias", nn.initializers.zeros_init(), (self.dim,))
    gh, gw = h // p, w // p
    x = x.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
    kernel, bias = (layers.cast(v, self.dtype) for v in (kernel, bias))
    return x.reshape(b, gh * gw, p * p * c) @ kernel.reshape(-1, self.dim) + bias


class Attention(nn.Module):
  """Multi-head self-attention with the original release's parameter shapes.
  `queries`: the number of leading tokens that ask (all by default)."""
  heads: int
  out_dim: int = 0    # 0: the input width
  key_bias: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, queries: int = 0) -> Array:
    d = x.shape[-1]
    if d % self.heads:
      raise ConfigError(f"attention width {d} is not divisible by "
                        f"{self.heads} heads (model.vit.dim and "
                        "model.vit.heads; 0: the released size's)")
    dh = d // self.heads
    proj = lambda name, bias=True: nn.DenseGeneral(
        (self.heads, dh), use_bias=bias, name=name, dtype=self.dtype)
    q_in = x if queries == 0 else x[:, :queries]
    q = proj("query")(q_in) / math.sqrt(dh)
    k, v = proj("key", self.key_bias)(x), proj("value")(x)
    scores = layers.cast(jnp.einsum("bqhd,bkhd->bhqk", q, k), jnp.float32)
    w = layers.cast(jax.nn.softmax(scores, axis=-1), v.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v)
    return nn.DenseGeneral(self.out_dim or d, axis=(-2, -1), name="out",
                           dtype=self.dtype)(o)


class Block(nn.Module):
  """Pre-LN encoder block."""
  heads: int
  mlp_dim: int
  gelu_approximate: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    dt = self.dtype
    x = x + Attention(self.heads, name="attn", dtype=dt)(
        LayerNorm(name="ln1", dtype=dt)(x))
    y = LayerNorm(name="ln2", dtype=dt)(x)
    y = nn.Dense(self.mlp_dim, name="fc1", dtype=dt)(y)
    y = nn.Dense(x.shape[-1], name="fc2", dtype=dt)(
        _gelu(self.gelu_approximate)(y))
    return x + y


class Backbone(nn.Module):
  """Patch embedding, class token, position embeddings, blocks, final norm."""
  patch: int
  dim: int
  depth: int
  heads: int
  mlp_dim: int
  grid: tuple[int, int]
  gelu_approximate: bool = False
  dtype: Any = jnp.float32

  def setup(self):
    d = self.dim
    self.embedding = PatchEmbed(self.patch, d, dtype=self.dtype)
    self.cls = self.param("cls", nn.initializers.zeros_init(), (1, 1, d))
    tokens = 1 + self.grid[0] * self.grid[1]
    self.pos_embedding = self.param(
        "pos_embedding", nn.initializers.normal(0.02), (1, tokens, d))
    self.block = [Block(self.heads, self.mlp_dim, self.gelu_approximate,
                        dtype=self.dtype) for _ in range(self.depth)]
    self.encoder_norm = LayerNorm(dtype=self.dtype)

  def embed(self, x: Array) -> Array:
    """[B, H, W, C] -> tokens [B, 1 + gh * gw, D]."""
    b, h, w, _ = x.shape
    p, (gh, gw) = self.patch, self.grid
    if (h, w) != (gh * p, gw * p):
      raise ConfigError(f"ViT built for {gh * p}x{gw * p} inputs got {h}x{w}")
    t = self.embedding(x)
    cls = jnp.broadcast_to(layers.cast(self.cls, t.dtype), (b, 1, self.dim))
    return (jnp.concatenate([cls, t], axis=1)
            + layers.cast(self.pos_embedding, t.dtype))

  def __call__(self, x: Array) -> Array:
    h = self.embed(x)
    for blk in self.block:
      h = blk(h)
    return self.encoder_norm(h)


class Adapter(nn.Module):
  """Bottleneck adapter: Linear(D -> r) + GELU + Linear(r -> D); PyTorch's
  nn.Linear initialization (the released code's), or with `zero_up` the
  up-projection zero (the adapted model starts as the backbone: AdaptFormer's
  and Houlsby et al.'s near-identity start)."""
  bottleneck: int
  gelu_approximate: bool = False
  zero_up: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h: Array) -> Array:
    z = layers.Dense(self.bottleneck, weight_init="torch", name="down")(h)
    z = _gelu(self.gelu_approximate)(z)
    if self.zero_up:
      return nn.Dense(h.shape[-1], kernel_init=nn.initializers.zeros_init(),
                      name="up", dtype=self.dtype)(z)
    return layers.Dense(h.shape[-1], weight_init="torch", name="up")(z)


class Fusion(nn.Module):
  """Eq. 3: MHSA over LN[A_dw(h); h] (tokens concatenated), the adapter's
  tokens' outputs. No key bias: it adds q.b to every key's score of a query,
  which the softmax cancels, so its gradient is 0 up to rounding, and an
  adaptive optimizer (Adam) would turn that rounding into lr-sized steps."""
  heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, a: Array, h: Array) -> Array:
    z = LayerNorm(name="norm", dtype=self.dtype)(
        jnp.concatenate([a, h], axis=1))
    return Attention(self.heads, key_bias=False, name="attn", dtype=self.dtype)(
        z, queries=a.shape[1])


class Stack(nn.Module):
  """One module per block (`block_<i>`)."""
  make: nn.Module
  depth: int

  def setup(self):
    self.block = [self.make.clone() for _ in range(self.depth)]

  def __call__(self, i: int, *args):
    return self.block[i](*args)


class ViT(nn.Module):
  """ViT classifier with optional FedSDAF adapters (module docstring)."""
  num_classes: int
  input_hw: tuple[int, int]
  patch: int = 16
  dim: int = 768
  depth: int = 12
  heads: int = 12
  mlp_dim: int = 3072
  adapters: str = "none"
  adapter_dim: int = 0        # 0: dim // 4 (768 -> 192, the paper's)
  fusion: bool = True
  fusion_heads: int = 8       # the released code's declared MHSA
  adapter_init: str = "torch"  # torch | zero (the up-projections start at 0)
  gelu_approximate: bool = False
  conv_impl: str = "auto"     # unused: patches are a matmul
  dtype: Any = jnp.float32    # compute dtype (model.dtype)
  HEAD = "head"

  def setup(self):
    if self.adapters not in ADAPTERS:
      raise ConfigError(f"ViT adapters={self.adapters!r}: allowed {ADAPTERS} "
                        "(in a config, fedsdaf.domain_invariant and "
                        "fedsdaf.domain_aware choose them)")
    h, w = self.input_hw
    if h % self.patch or w % self.patch:
      raise ConfigError(f"ViT patch {self.patch} does not divide the input "
                        f"{h}x{w} (set model.vit.patch, or data.image_size)")
    self.backbone = Backbone(self.patch, self.dim, self.depth, self.heads,
                             self.mlp_dim, (h // self.patch, w // self.patch),
                             self.gelu_approximate, dtype=self.dtype)
    self.head = nn.Dense(self.num_classes, dtype=self.dtype)
    r = self.adapter_dim or self.dim // 4
    if self.adapter_init not in ADAPTER_INITS:
      raise ConfigError(f"fedsdaf.adapter_init={self.adapter_init!r}: "
                        f"allowed {ADAPTER_INITS}")
    adapter = Adapter(r, self.gelu_approximate,
                      zero_up=self.adapter_init == "zero", dtype=self.dtype)
    if self.adapters != "none":
      self.adi = Stack(adapter, self.depth)
    if self.adapters == "kia":
      self.adw = Stack(adapter, self.depth)
      if self.fusion:
        if self.dim % self.fusion_heads:
          raise ConfigError(f"fedsdaf.fusion_heads={self.fusion_heads} does "
                            f"not divide the ViT width {self.dim} "
                            "(model.vit.dim; 0 there: the released size's)")
        self.fuse = Stack(Fusion(self.fusion_heads, dtype=self.dtype),
                          self.depth)

  def _adapted(self, i: int, h: Array, path: str) -> Array:
    if self.adapters == "none":
      return h
    if self.adapters == "di" or path == "di":
      return h + self.adi(i, h)
    a = self.adw(i, h)
    if self.fusion:
      a = self.fuse(i, a, h)
    return h + 0.5 * a + 0.5 * self.adi(i, h)

  def trainable(self, h: Array) -> Array:
    """Touches the adapters and the head only: `init(..., h, method=
    ViT.trainable)` samples them without the backbone (`h`: [B, T, dim])."""
    for i in range(self.depth):
      if self.adapters != "none":
        self.adi(i, h)
      if self.adapters == "kia":
        a = self.adw(i, h)
        if self.fusion:
          self.fuse(i, a, h)
    return self.head(h[:, 0])

  def features(self, x: Array, train: bool = False, path: str = "kia") -> Array:
    """The class token's representation [B, D] after the final norm."""
    del train  # No dropout: the released ViTs fine-tune without it.
    if path not in PATHS:
      raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    h = self.backbone.embed(layers.cast(x, self.dtype))
    for i in range(self.depth):
      h = self._adapted(i, self.backbone.block[i](h), path)
    return self.backbone.encoder_norm(h)[:, 0]

  def __call__(self, x: Array, train: bool = False, path: str = "kia") -> Array:
    return layers.cast(self.head(self.features(x, train, path)), jnp.float32)


def vit(num_classes: int, input_hw, size: str = "b16", **kw) -> ViT:
  """A ViT of a released size ("b16": ViT-B/16, "ti16": ViT-Ti/16) with field
  overrides (`patch`, `dim`, `depth`, ...)."""
  dim, depth, heads, mlp = SIZES[size]
  kw = {"patch": 16, "dim": dim, "depth": depth, "heads": heads,
        "mlp_dim": mlp, **kw}
  return ViT(num_classes=num_classes, input_hw=tuple(input_hw), **kw)
