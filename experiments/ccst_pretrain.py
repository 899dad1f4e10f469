"""Offline AdaIN weights for CCST: a fixed random encoder, "normalised" as
VGG's, and a decoder trained on synthetic images to invert it under AdaIN,
saved in the reference release's layout (`vgg_normalised` / `decoder`
`.safetensors`, read by `models.adain.load`).

CCST re-styles images with AdaIN (Huang & Belongie 2017): an ImageNet VGG-19
encoder and a decoder trained on MS-COCO content and WikiArt styles, both
external to the federated benchmark. Neither can be downloaded here, so this
script builds a stand-in that is external to the benchmark too: training
never reads a Styled Fashion-MNIST image (only the figure shows some).

* Encoder: the release's layers up to relu{depth}_1 (`--depth`, default 1:
  conv0 and conv1_1, 64 channels at full resolution). conv0 is the
  release's fixed 1x1 map (RGB in [0, 1] -> BGR in 0..255 minus Caffe's
  ImageNet means); the 3x3 convs are seeded He-normal random filters, then
  normalised as `vgg_normalised` was (Gatys et al. 2016): layer by layer,
  each filter and its bias scaled so that its channel's mean ReLU
  activation over (synthetic) images and positions is 1.
* Decoder: the release's mirror of that encoder (at depth 1 one 3x3 conv,
  64 -> 3), trained with AdaIN's loss (content: ||f(g(t)) - t||^2 at
  relu{depth}_1, t = AdaIN(f(c), f(s)); style: the squared distances of the
  per-channel means and stds at relu1_1 .. relu{depth}_1, weight 10, the
  paper's) plus a pixel reconstruction term 10 ||g(f(c)) - c||^2 (AdaIN with
  the image's own style must give the image back), Adam 1e-3 with a cosine
  decay over 4,000 steps of 16 fresh synthetic (content, style) pairs.
* Synthetic images (`synthetic_images`): smooth random colour fields, random
  ellipses, rectangles and rings, stripe / checker / dot textures, colours
  uniform, saturated or grey, some images grey, inverted or noisy; 28x28.

Depth 2 (relu2_1, 128 channels, ~225k parameters) was tried: after 3,000
steps of batch 8 (33 min here) its re-styled images were still noise and its
identity reconstruction poor (pixel MSE 0.072 on Styled Fashion-MNIST), and
a CCST round costs 16x a FedAvg round with it, 3.4x at depth 1
(docs/benchmarks.md, "FedCCRL"; the whole Table 1 run must fit a few CPU
hours). Depth 1 reconstructs to MSE 0.004
(random weights: 0.28) and moves colour and contrast to the target style;
it cannot carry textures (relu1_1 statistics are those of 3x3 filters).

    python experiments/ccst_pretrain.py      # ~7 min on 2 CPU cores
    python experiments/ccst_pretrain.py --figure-only \
        --figure docs/img/ccst_adain_synthetic.png   # the figure, from the files
        # (needs `fedjax-dg prepare styled_fashion_mnist`)

writes experiments/weights/adain_synthetic_d1_{vgg,decoder}.safetensors
(float16, 7.5 KB together), used by experiments/styled_fmnist_table1.py
(`ccst.vgg`, `ccst.decoder`, `ccst.depth=1`). How far it is from the
paper's network: docs/faithfulness.md, "CCST"; docs/models.md, "AdaIN
(CCST)".
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import ndimage

from fedjax_dg.models import adain

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = os.path.join(HERE, "weights")
# The release's conv0: RGB in [0, 1] -> BGR in 0..255 minus Caffe's means.
CONV0_KERNEL = 255.0 * np.eye(3)[::-1]            # [out, in]: out BGR, in RGB
CONV0_BIAS = -np.array([103.939, 116.779, 123.68])  # B, G, R


def weight_paths(depth: int, out_dir: str = WEIGHTS) -> tuple[str, str]:
  """(encoder, decoder) file paths of the synthetic AdaIN at `depth`."""
  stem = os.path.join(out_dir, f"adain_synthetic_d{depth}")
  return f"{stem}_vgg.safetensors", f"{stem}_decoder.safetensors"


# --------------------------------------------------------------------------
# Synthetic images (never the benchmark's).


def _colour(rng, n=()):
  """Random RGB colours: uniform, or (a third of the draws) from a saturated
  palette (each channel 0 or 1) or grey levels."""
  shape = tuple(np.atleast_1d(n)) + (3,)
  kind = rng.integers(3)
  if kind == 0:
    return rng.integers(0, 2, shape).astype(float)
  if kind == 1:
    return np.repeat(rng.uniform(0, 1, shape[:-1] + (1,)), 3, -1)
  return rng.uniform(0, 1, shape)


def _smooth_field(rng, size):
  """A smooth random colour field: a 2x2..6x6 grid of colours, upsampled."""
  g = rng.integers(2, 7)
  return np.clip(ndimage.zoom(rng.uniform(0, 1, (g, g, 3)),
                              (size / g, size / g, 1), order=1)[:size, :size],
                 0, 1)


def _texture(rng, yy, xx):
  """A random periodic pattern in [0, 1]: stripes, checkers or dots."""
  period = rng.uniform(2.5, 9)
  angle = rng.uniform(0, np.pi)
  u = xx * np.cos(angle) + yy * np.sin(angle)
  v = -xx * np.sin(angle) + yy * np.cos(angle)
  kind = rng.integers(3)
  if kind == 0:
    return (np.sin(2 * np.pi * u / period) > 0).astype(float)
  if kind == 1:
    return ((np.floor(u / period) + np.floor(v / period)) % 2).astype(float)
  return ((np.hypot((u % period) - period / 2, (v % period) - period / 2)
           < period / 4).astype(float))


def _shape_mask(rng, yy, xx, size):
  """A random ellipse or rectangle, or a ring (a line drawing)."""
  cy, cx = rng.uniform(0.15, 0.85, 2) * size
  ry, rx = rng.uniform(0.1, 0.45, 2) * size
  kind = rng.integers(3)
  if kind == 0:
    return ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
  if kind == 1:
    return (np.abs(yy - cy) < ry) & (np.abs(xx - cx) < rx)
  r = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
  return np.abs(r - 1) < rng.uniform(0.15, 0.5)


def synthetic_image(rng: np.random.Generator, size: int = 28) -> np.ndarray:
  """One float [size, size, 3] image in [0, 1]: a background (a smooth field
  or a coloured texture), 1-4 shapes filled with a colour or a texture,
  sometimes grey, inverted or noisy."""
  yy, xx = np.mgrid[:size, :size].astype(float)

  def fill():
    if rng.random() < 0.5:
      return np.broadcast_to(_colour(rng), (size, size, 3))
    t = _texture(rng, yy, xx)[..., None]
    a, b = _colour(rng, 2)
    return t * a + (1 - t) * b

  img = _smooth_field(rng, size) if rng.random() < 0.5 else fill()
  for _ in range(rng.integers(1, 5)):
    m = _shape_mask(rng, yy, xx, size)[..., None]
    img = np.where(m, fill(), img)
  if rng.random() < 0.2:
    img = np.repeat(img.mean(-1, keepdims=True), 3, -1)
  if rng.random() < 0.2:
    img = 1 - img
  if rng.random() < 0.3:
    img = img + rng.normal(0, rng.uniform(0.02, 0.12), img.shape)
  return np.clip(img, 0, 1).astype(np.float32)


def synthetic_images(rng: np.random.Generator, n: int,
                     size: int = 28) -> np.ndarray:
  return np.stack([synthetic_image(rng, size) for _ in range(n)])


# --------------------------------------------------------------------------
# The encoder: fixed, random, normalised.


def _he_normal(key, shape):
  fan_in = shape[0] * shape[1] * shape[2]
  return np.asarray(jax.random.normal(key, shape)) * np.sqrt(2.0 / fan_in)


def random_encoder(key: jax.Array, depth: int, size: int = 28) -> dict:
  """The release's encoder layers with conv0 = the release's map and
  seeded He-normal 3x3 filters (zero biases), not yet normalised."""
  template = adain.init(key, depth, size)["encoder"]
  keys = jax.random.split(key, len(template))
  enc = {}
  for k, (name, p) in zip(keys, sorted(template.items())):
    if name == "conv0":
      enc[name] = {"kernel": CONV0_KERNEL.T[None, None].astype(np.float32),
                   "bias": CONV0_BIAS.astype(np.float32)}
    else:
      shape = p["kernel"].shape
      enc[name] = {"kernel": _he_normal(k, shape).astype(np.float32),
                   "bias": np.zeros(shape[-1], np.float32)}
  return enc


def _pre_activations(enc: dict, x: jax.Array, depth: int) -> dict:
  """Every conv's output (before its ReLU) on images x."""
  _, state = adain.Encoder(depth).apply(
      {"params": enc}, x, capture_intermediates=True,
      mutable=["intermediates"])
  return {name: v["__call__"][0] for name, v in state["intermediates"].items()
          if name != "__call__"}


def normalise(enc: dict, x: np.ndarray, depth: int) -> dict:
  """`vgg_normalised`'s rescaling: layer by layer (conv1_1 first), each
  filter and bias scaled so its channel's mean ReLU activation over `x`'s
  images and positions is 1 (dead channels kept). ReLU is positively
  homogeneous, so a layer's scale leaves the earlier layers' means at 1."""
  enc = {k: dict(v) for k, v in enc.items()}
  for _, name, _, _ in adain.encoder_layers(depth)[1:]:
    pre = _pre_activations(enc, jnp.asarray(x), depth)[name]
    mean = np.asarray(jnp.mean(jax.nn.relu(pre), axis=(0, 1, 2)))
    scale = np.where(mean > 1e-8, 1.0 / np.maximum(mean, 1e-8), 1.0)
    enc[name] = {"kernel": (enc[name]["kernel"] * scale).astype(np.float32),
                 "bias": (enc[name]["bias"] * scale).astype(np.float32)}
  return enc


# --------------------------------------------------------------------------
# The decoder: AdaIN's loss plus reconstruction.


def relu_stats(enc: dict, x: jax.Array, depth: int):
  """[(mean, std) per channel, [B, C] each] at relu1_1 .. relu{depth}_1 (one
  encoder pass) and the relu{depth}_1 features."""
  pre = _pre_activations(enc, x, depth)
  feats = [jax.nn.relu(pre[name]) for name in
           (adain.encoder_layers(d)[-1][1] for d in range(1, depth + 1))]
  return [adain.instance_stats(f) for f in feats], feats[-1]


def decoder_loss(dec, enc, content, style, *, depth, style_weight,
                 recon_weight):
  """AdaIN's content + style_weight * style loss of decoding
  AdaIN(f(content), f(style)), plus recon_weight * the pixel MSE of decoding
  f(content) itself. Returns (total, parts)."""
  net = {"encoder": enc, "decoder": dec}
  fc = adain.encode(net, content, depth=depth)
  target, _ = relu_stats(enc, style, depth)
  t = adain.adain(fc, *target[-1])
  out_stats, out_feats = relu_stats(enc, adain.decode(net, t, depth=depth),
                                    depth)
  content_loss = jnp.mean(jnp.square(out_feats - t))
  style_loss = sum(jnp.mean(jnp.square(mo - ms)) + jnp.mean(jnp.square(so - ss))
                   for (mo, so), (ms, ss) in zip(out_stats, target))
  recon = jnp.mean(jnp.square(adain.decode(net, fc, depth=depth) - content))
  total = content_loss + style_weight * style_loss + recon_weight * recon
  return total, dict(content=content_loss, style=style_loss, recon=recon)


def train_decoder(enc: dict, dec: dict, *, depth: int, steps: int, batch: int,
                  lr: float, style_weight: float, recon_weight: float,
                  seed: int, log_every: int = 100) -> dict:
  """Adam with a cosine decay over `steps`, fresh synthetic pairs per step."""
  opt = optax.adam(optax.cosine_decay_schedule(lr, steps))
  loss = lambda d, c, s: decoder_loss(d, enc, c, s, depth=depth,
                                      style_weight=style_weight,
                                      recon_weight=recon_weight)

  @jax.jit
  def step(dec, state, content, style):
    (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(dec, content,
                                                                style)
    updates, state = opt.update(grads, state, dec)
    return optax.apply_updates(dec, updates), state, parts

  rng = np.random.default_rng(seed)
  state = opt.init(dec)
  t0 = time.perf_counter()
  for i in range(steps):
    content, style = (synthetic_images(rng, batch) for _ in range(2))
    dec, state, parts = step(dec, state, content, style)
    if (i + 1) % log_every == 0 or i == 0:
      print(f"step {i + 1}/{steps}: " + ", ".join(
          f"{k} {float(v):.4f}" for k, v in parts.items())
            + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
  return dec


# --------------------------------------------------------------------------
# The reference layout.


def to_state_dicts(net: dict, depth: int) -> tuple[dict, dict]:
  """(vgg, decoder) torch-named state dicts (OIHW kernels), float16."""
  def conv(p):
    return {"weight": np.asarray(p["kernel"]).transpose(3, 2, 0, 1),
            "bias": np.asarray(p["bias"])}

  vgg, dec = {}, {}
  for idx, name, _, _ in adain.encoder_layers(depth):
    for k, v in conv(net["encoder"][name]).items():
      vgg[f"{idx}.{k}"] = v.astype(np.float16)
  for idx, name, _ in adain.decoder_layers(depth):
    for k, v in conv(net["decoder"][name]).items():
      dec[f"{idx}.{k}"] = v.astype(np.float16)
  return vgg, dec


def save(net: dict, depth: int, out_dir: str = WEIGHTS) -> tuple[str, str]:
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  paths = weight_paths(depth, out_dir)
  for state, path in zip(to_state_dicts(net, depth), paths):
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path)
  return paths


# --------------------------------------------------------------------------
# The figure: Styled Fashion-MNIST re-styled to each domain's overall style.


def figure(net: dict, depth: int, path: str, seed: int = 0) -> str:
  """Rows: one image per domain, by the synthetic network and by a random
  one (`adain.init`); columns: the image, then AdaIN to each domain's
  overall style (CCST's "overall": pooled over 1,000 of its images)."""
  from fedjax_dg.algorithms import ccst
  from fedjax_dg.data import sources
  from fedjax_dg.report.plots import _plt
  ds = sources.load("styled_fashion_mnist", max_per_domain=1000)
  names = ds.domain_names
  rng = np.random.default_rng(seed)
  label = int(rng.integers(ds.num_classes))
  picks = [int(rng.choice(np.flatnonzero((ds.domains == d) & (ds.labels == label))))
           for d in range(len(names))]
  x = jnp.asarray(ds.images[picks])
  nets = {"synthetic": net, "random": jax.device_get(
      adain.init(jax.random.key(seed), depth, 28))}
  plt = _plt()
  rows = 2 * len(names)
  fig, axes = plt.subplots(rows, len(names) + 1, figsize=(
      0.9 * (len(names) + 1) + 0.9, 0.9 * rows + 0.6), squeeze=False)
  for g, (kind, n_) in enumerate(nets.items()):
    styles = [ccst.overall_style(n_, jnp.asarray(ds.images[ds.domains == d]),
                                 jnp.int32(np.sum(ds.domains == d)),
                                 depth=depth, chunk=100, eps=1e-5)
              for d in range(len(names))]
    x01 = ccst.to_unit_rgb(x)
    for j, st in enumerate(styles):
      mean = jnp.repeat(st.mu, len(picks), 0)
      std = jnp.repeat(st.sig, len(picks), 0)
      out = np.clip(np.asarray(adain.transfer(n_, x01, mean, std,
                                              depth=depth)), 0, 1)
      for i in range(len(picks)):
        axes[g * len(names) + i, j + 1].imshow(out[i])
    for i, d in enumerate(names):
      r = g * len(names) + i
      axes[r, 0].imshow(np.asarray(ds.images[picks[i]]))
      axes[r, 0].set_ylabel(f"{kind}\n{d}", fontsize=7)
  for j, d in enumerate(("image",) + tuple(f"-> {n}" for n in names)):
    axes[0, j].set_title(d, fontsize=8)
  for ax in axes.ravel():
    ax.set_xticks([])
    ax.set_yticks([])
  fig.suptitle(f"AdaIN to relu{depth}_1 to each domain's overall style:\n"
               "synthetic-trained (top), random weights (bottom)", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)
  return path


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--depth", type=int, default=1, choices=adain.DEPTHS)
  p.add_argument("--steps", type=int, default=4000)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--style-weight", type=float, default=10.0)
  p.add_argument("--recon-weight", type=float, default=10.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=100)
  p.add_argument("--out-dir", default=WEIGHTS)
  p.add_argument("--figure", default="", help="also write the re-styling "
                 "figure here (needs styled_fashion_mnist prepared)")
  p.add_argument("--figure-only", action="store_true",
                 help="draw the figure from the saved weights")
  args = p.parse_args(argv)
  key = jax.random.key(args.seed)
  if args.figure_only:
    net = adain.load(*weight_paths(args.depth, args.out_dir), args.depth)
  else:
    rng = np.random.default_rng(args.seed + 1)
    enc = normalise(random_encoder(key, args.depth),
                    synthetic_images(rng, 256), args.depth)
    dec = adain.init(jax.random.fold_in(key, 1), args.depth, 28)["decoder"]
    dec = train_decoder(enc, dec, depth=args.depth, steps=args.steps,
                        batch=args.batch, lr=args.lr,
                        style_weight=args.style_weight,
                        recon_weight=args.recon_weight, seed=args.seed + 2,
                        log_every=args.log_every)
    paths = save({"encoder": enc, "decoder": dec}, args.depth, args.out_dir)
    print("wrote", *paths, f"({sum(os.path.getsize(q) for q in paths)} bytes)")
    net = adain.load(*paths, args.depth)  # what CCST will read
  if args.figure:
    print("wrote", figure(net, args.depth, args.figure, args.seed))


if __name__ == "__main__":
  main()
