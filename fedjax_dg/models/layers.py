"""Loop-safe building blocks: convolutions, pooling and dense layers.

Everything here is usable inside `lax.scan` / `lax.map` / `vmap` bodies. On XLA:CPU
the backward pass of `lax.conv_general_dilated` inside a loop body compiles to naive
loops (~24x slower, see docs/models.md), so `Conv` offers three implementations:

* ``"im2col"``: shifted slices of the padded input concatenated along channels and
  one matmul with the reshaped kernel. Only slices, pads and a dot: fast anywhere.
* ``"custom_vjp"``: forward `lax.conv_general_dilated`; the backward pass is two
  ordinary NHWC/HWIO convolutions with explicit transposes and a kernel flip.
  (A `custom_vjp` function supports reverse mode only: no `jax.jvp`/`jax.hessian`.)
* ``"taps"``: one matmul of the padded input with the kernel's kh*kw taps side
  by side ([Cin, kh*kw*Cout]), then the sum of the kh*kw shifted slices of its
  output: the input is read once, so it is fast where kh*kw*Cout <= Cin (a
  decoder's last 3x3 conv to RGB: 64 -> 3 at 28x28 took 3.5 ms here where
  XLA:CPU's conv took 124 ms).
* ``"xla"``: plain `lax.conv_general_dilated` (the right choice on GPU/TPU).
* ``"auto"``: ``"xla"`` on GPU/TPU; on CPU, per layer, im2col for 1x1 kernels and
  narrow inputs (<= `CPU_IM2COL_MAX_CHANNELS` channels), taps where kh*kw*Cout
  <= Cin, custom_vjp otherwise (picked by benchmarks/conv_in_loop.py; see
  docs/models.md).

Mixed precision (`DTYPES`, `cast`, `matmul`, `dense`): these layers keep
float32 parameters. Without a `dtype` they compute in the dtype of their
input (the kernel is cast to it), so a model computes in bfloat16 by casting
its input once; `cast` is the identity where the dtype already matches, so a
float32 model traces the very same program as before. With `dtype=bfloat16`
on the CPU backend (the models of `cnn` pass it) a layer reads float32
activations and returns float32 ones: where its matmul's shapes fill the
matrix units (AMX; `on_matrix_units`) it takes bfloat16 operands and
accumulates in float32 (`bf16_matmul`, forward and backward); where they do
not, the layer computes in float32, as PyTorch's CPU autocast keeps some ops
in float32. Every elementwise op, slice and pad stays float32, since
XLA:CPU's bfloat16 versions of those are 1.3-7x slower than float32
(docs/models.md, "Mixed precision").

Pooling is written with static slices so that its backward pass is elementwise (no
`select_and_scatter` inside loop bodies).

Initialization (`weight_init`): ``"flax"`` is flax's default (lecun_normal kernel,
zero bias; the layer default, as nn.Conv/nn.Dense); ``"torch"`` is PyTorch's default
for `nn.Conv2d`/`nn.Linear` (kaiming_uniform(a=sqrt(5)), i.e.
U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for kernel AND bias), the faithful choice for
models from PyTorch papers and the default of the models in `cnn`;
``"kaiming_out"`` is torchvision's ResNet conv init (normal, std sqrt(2 / fan_out),
zero bias), used by `resnet` and `mobilenet`; ``"normal"`` is torchvision's
MobileNetV3 Linear init (N(0, 0.01), zero bias).

`DepthwiseConv` (one kxk filter per channel, torch's `groups=C`) is a sum of
shifted slices times per-channel weights on every implementation but ``"xla"``:
elementwise work whose backward pass stays fast inside loop bodies.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fedjax_dg.errors import ConfigError

Array = jax.Array
Padding = str | int | tuple[int, int] | Sequence[tuple[int, int]]

# `model.dtype`: the compute dtypes a model accepts (parameters stay float32).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
CONV_IMPLS = ("im2col", "custom_vjp", "taps", "xla", "auto")
INITS = ("flax", "torch", "kaiming_out", "normal")
# "auto" on the CPU backend picks per layer (benchmarks/conv_in_loop.py, InceptionCNN
# training step inside lax.map x lax.scan): im2col for 1x1 kernels and for inputs
# with at most this many channels (where XLA:CPU's own conv is slow, e.g. the 3-channel
# first layer), custom_vjp for wider inputs (where the concatenated im2col buffer and
# its matmul are slower than Eigen's conv).
CPU_IM2COL_MAX_CHANNELS = 32

_DN = ("NHWC", "HWIO", "NHWC")


def resolve_conv_impl(impl: str, kernel_shape: Sequence[int] | None = None) -> str:
  """Maps "auto" to a concrete implementation for the default backend.

  "auto" is "xla" on GPU/TPU. On CPU it is "im2col" for 1x1 kernels or at most
  `CPU_IM2COL_MAX_CHANNELS` input channels, "taps" where kh * kw * Cout <= Cin,
  else "custom_vjp"; without a `kernel_shape` (HWIO) it stays "auto" on CPU
  (decided per layer).
  """
  if impl not in CONV_IMPLS:
    raise ConfigError(f"conv_impl must be one of {CONV_IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  if jax.default_backend() != "cpu":
    return "xla"
  if kernel_shape is None:
    return "auto"
  kh, kw, cin, cout = kernel_shape
  if kh * kw == 1 or cin <= CPU_IM2COL_MAX_CHANNELS:
    return "im2col"
  if kh * kw * cout <= cin:
    return "taps"
  return "custom_vjp"


def compute_dtype(name: str):
  """The jnp dtype of a `model.dtype` name; ConfigError for any other."""
  if name not in DTYPES:
    raise ConfigError(f"model.dtype={name!r}: allowed {tuple(DTYPES)} "
                      "(bfloat16: bfloat16 compute, float32 parameters), or "
                      "'auto' in a run's config (`auto_dtype`)")
  return DTYPES[name]


def auto_dtype(backend: str) -> tuple[str, str]:
  """(the compute dtype `model.dtype="auto"` means on `backend`, a
  jax.default_backend() name; why): bfloat16 on a GPU or TPU, whose matrix
  units run it at several times float32's rate; float32 on a CPU, where the
  engine's bfloat16 round is slower than its float32 round, with AMX or
  without (docs/models.md, "Mixed precision")."""
  if backend in ("gpu", "cuda", "rocm", "tpu"):
    return "bfloat16", f"{backend}: its matrix units run bfloat16 fastest"
  return "float32", (f"{backend}: the engine's bfloat16 round is slower than "
                     "float32 here")


def cast(x: Array, dtype) -> Array:
  """`x` as `dtype`; `x` itself where it already is (no convert in the program)."""
  return x if x.dtype == dtype else x.astype(dtype)


# The smallest contraction (k) and output width (n) of a bfloat16 matmul that
# pays on XLA:CPU's AMX path (the Inception CNN's convolutions inside
# lax.scan: those with k = 27 or n = 16 ran at 0.5-0.8x float32's speed as
# bfloat16 im2col matmuls, those with k >= 176 and n >= 32 at 1.6-3.7x; in
# `benchmarks/round_time.py --variants engine engine_bf16` the round took
# 2.2x float32's time with k, n >= 16, 1.2x with k >= 512, 1.13x with these).
MATRIX_UNIT_MIN_K = 64
MATRIX_UNIT_MIN_N = 32


def mixed_on_cpu(dtype) -> bool:
  """Whether a layer given compute dtype `dtype` takes the CPU policy:
  bfloat16 matmul operands between float32 activations."""
  return dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def activation_dtype(dtype):
  """The dtype a model that passes its compute dtype to its layers keeps
  activations in: float32 under the CPU policy (`mixed_on_cpu`), else
  `dtype`."""
  return jnp.float32 if mixed_on_cpu(dtype) else dtype


def on_matrix_units(m: int, k: int, n: int) -> bool:
  """Whether a [m, k] @ [k, n] bfloat16 matmul pays on XLA:CPU's matrix
  units (`MATRIX_UNIT_MIN_K`, `MATRIX_UNIT_MIN_N`; and m >= 8: XLA:CPU's
  bfloat16 dot library takes matrices, not vectors)."""
  return m >= 8 and k >= MATRIX_UNIT_MIN_K and n >= MATRIX_UNIT_MIN_N


def _row_major_t(x: Array) -> Array:
  """The transpose of a 2-D `x`, written so that XLA:CPU sees a row-major
  operand: it decides whether a bfloat16 dot runs natively before its
  layout passes, and a plain transpose feeding a dot is column-major there,
  which makes it upcast both operands to float32 (4x slower on AMX)."""
  m, k = x.shape
  return x.reshape(m, k, 1).transpose(1, 0, 2).reshape(k, m)


def _dot_bf16(a: Array, b: Array) -> Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def bf16_matmul(a: Array, b: Array) -> Array:
  """float32 `a @ b` of float32 [m, k] and [k, n] from bfloat16 operands,
  accumulated in float32; its backward pass is two such matmuls of the
  bfloat16 cotangent, each with canonical (row-major) operands so that
  XLA:CPU keeps it bfloat16; the gradients are float32."""
  return _dot_bf16(cast(a, jnp.bfloat16), cast(b, jnp.bfloat16))


def _bf16_matmul_fwd(a, b):
  a16, b16 = cast(a, jnp.bfloat16), cast(b, jnp.bfloat16)
  return _dot_bf16(a16, b16), (a16, b16)


def _bf16_matmul_bwd(res, g):
  a16, b16 = res
  g16 = cast(g, jnp.bfloat16)
  da = _dot_bf16(g16, _row_major_t(b16))
  # a^T g, or (g^T a)^T where g ([m, n]) is the smaller one to transpose
  # (an im2col conv's patches are kh * kw * Cin wide, its gradient Cout).
  if a16.shape[1] <= g16.shape[1]:
    return da, _dot_bf16(_row_major_t(a16), g16)
  return da, _row_major_t(_dot_bf16(_row_major_t(g16), a16))


bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def matmul(x: Array, kernel: Array, dtype=None) -> Array:
  """`x @ kernel` (`x` [..., k], `kernel` [k, n]) in compute dtype `dtype`
  (None: `x`'s). Off the CPU policy (`mixed_on_cpu` of an explicit `dtype`)
  both are cast to it; under it the result is float32: `bf16_matmul` where
  `on_matrix_units`, else the float32 matmul."""
  if dtype is None or not mixed_on_cpu(dtype):
    dtype = x.dtype if dtype is None else dtype
    return cast(x, dtype) @ cast(kernel, dtype)
  x = cast(x, jnp.float32)
  k, n = kernel.shape
  if not on_matrix_units(math.prod(x.shape[:-1]), k, n):
    return x @ kernel
  return bf16_matmul(x.reshape(-1, k), kernel).reshape(x.shape[:-1] + (n,))


def dense(params, x: Array, dtype=jnp.float32) -> Array:
  """`x @ kernel (+ bias)` of a {"kernel", ["bias"]} dict in compute dtype
  `dtype` (`matmul`): the heads written as plain dicts (FedSR, MOON,
  FedADG). Callers cast what feeds a loss to float32."""
  out = matmul(x, params["kernel"], dtype)
  return out + cast(params["bias"], out.dtype) if "bias" in params else out


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
  if isinstance(v, int):
    return (v, v)
  v = tuple(v)
  if len(v) != 2:
    raise ValueError(f"expected an int or a pair, got {v}")
  return v  # type: ignore[return-value]


def conv_padding(padding: Padding, kernel: tuple[int, int],
                 strides: tuple[int, int],
                 in_hw: tuple[int, int]) -> tuple[tuple[int, int], ...]:
  """Explicit ((lo, hi), (lo, hi)) padding with lax's 'SAME'/'VALID' semantics."""
  if isinstance(padding, str):
    p = padding.upper()
    if p == "VALID":
      return ((0, 0), (0, 0))
    if p == "SAME":
      return tuple(lax.padtype_to_pads(in_hw, kernel, strides, "SAME"))
    raise ValueError(f"unknown padding {padding!r}")
  if isinstance(padding, int):
    return ((padding, padding), (padding, padding))
  padding = tuple(padding)
  if len(padding) == 2 and all(isinstance(p, int) for p in padding):
    return ((padding[0], padding[0]), (padding[1], padding[1]))
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def _out_size(n: int, k: int, s: int, pad: tuple[int, int]) -> int:
  return (n + pad[0] + pad[1] - k) // s + 1


# ---------------------------------------------------------------------------
# Convolution implementations (NHWC input, HWIO kernel, no bias).


def conv_xla(x: Array, kernel: Array, strides=(1, 1), padding=((0, 0), (0, 0))
             ) -> Array:
  """`lax.conv_general_dilated` with NHWC/HWIO/NHWC layouts."""
  return lax.conv_general_dilated(x, kernel, tuple(strides), tuple(padding),
                                  dimension_numbers=_DN)


def conv_im2col(x: Array, kernel: Array, strides=(1, 1),
                padding=((0, 0), (0, 0)), mm=jnp.matmul) -> Array:
  """Convolution as shifted (strided) slices + one matmul (`mm` of the 2-D
  patches and the reshaped kernel: `bf16_matmul` under the CPU policy)."""
  kh, kw, cin, cout = kernel.shape
  sh, sw = strides
  b, h, w, _ = x.shape
  ho = _out_size(h, kh, sh, padding[0])
  wo = _out_size(w, kw, sw, padding[1])
  # Matmuls on 2-D reshapes: XLA:CPU runs the kernel-gradient dot with several
  # contracting dims (the einsum "bhwk,bhwo->ko") ~2x slower than its 2-D form.
  if kh == kw == 1 and sh == sw == 1 and all(p == (0, 0) for p in padding):
    return mm(x.reshape(-1, cin), kernel[0, 0]).reshape(b, h, w, cout)
  xp = jnp.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
  patches = [
      lax.slice(xp, (0, i, j, 0),
                (b, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, cin),
                (1, sh, sw, 1))
      for i in range(kh) for j in range(kw)
  ]
  cols = patches[0] if len(patches) == 1 else jnp.concatenate(patches, axis=-1)
  # Channel index of `cols` is (i * kw + j) * cin + c: the row-major HWI order.
  y = mm(cols.reshape(b * ho * wo, kh * kw * cin), kernel.reshape(-1, cout))
  return y.reshape(b, ho, wo, cout)


def conv_taps(x: Array, kernel: Array, strides=(1, 1),
              padding=((0, 0), (0, 0))) -> Array:
  """Convolution as one matmul to every tap's output channels, then the sum
  of the taps' shifted (strided) slices: reads the input once."""
  kh, kw, cin, cout = kernel.shape
  sh, sw = strides
  b, h, w, _ = x.shape
  ho = _out_size(h, kh, sh, padding[0])
  wo = _out_size(w, kw, sw, padding[1])
  xp = jnp.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
  hp, wp = xp.shape[1:3]
  # [Cin, kh * kw * Cout], column (i * kw + j) * cout + o: tap (i, j), out o.
  taps = kernel.transpose(2, 0, 1, 3).reshape(cin, kh * kw * cout)
  y = (xp.reshape(-1, cin) @ taps).reshape(b, hp, wp, kh * kw, cout)
  out = None
  for i in range(kh):
    for j in range(kw):
      tap = lax.slice(y[:, :, :, i * kw + j], (0, i, j, 0),
                      (b, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, cout),
                      (1, sh, sw, 1))
      out = tap if out is None else out + tap
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_cvjp(x, kernel, strides, padding):
  return conv_xla(x, kernel, strides, padding)


def _conv_cvjp_fwd(x, kernel, strides, padding):
  return conv_xla(x, kernel, strides, padding), (x, kernel)


def _conv_cvjp_bwd(strides, padding, res, g):
  x, kernel = res
  kh, kw, _, _ = kernel.shape
  _, h, w, _ = x.shape
  ks, ns = (kh, kw), (h, w)
  # Rows of the padded input that no output window reaches (stride > 1).
  rest = [ns[d] + sum(padding[d]) - ((g.shape[1 + d] - 1) * strides[d] + ks[d])
          for d in range(2)]
  # Input gradient: full correlation of the (stride-dilated) output gradient with
  # the spatially flipped, in/out-swapped kernel, cropped to the unpadded input.
  k_t = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
  pads = [(ks[d] - 1 - padding[d][0], ks[d] - 1 - padding[d][1] + rest[d])
          for d in range(2)]
  if all(lo >= 0 and hi >= 0 for lo, hi in pads):
    dx = lax.conv_general_dilated(g, k_t, (1, 1), pads, lhs_dilation=strides,
                                  dimension_numbers=_DN)
  else:  # Padding larger than kernel - 1: compute on the padded input and crop.
    full = [(ks[d] - 1, ks[d] - 1 + rest[d]) for d in range(2)]
    dxp = lax.conv_general_dilated(g, k_t, (1, 1), full, lhs_dilation=strides,
                                   dimension_numbers=_DN)
    dx = dxp[:, padding[0][0]:padding[0][0] + h, padding[1][0]:padding[1][0] + w]
  # Kernel gradient: the batch becomes the contracted channel axis: input as
  # [Cin, H, W, B] ("NHWC"), output gradient as [Ho, Wo, B, Cout] ("HWIO").
  dk = lax.conv_general_dilated(
      x.transpose(3, 1, 2, 0), g.transpose(1, 2, 0, 3), (1, 1), padding,
      rhs_dilation=strides, dimension_numbers=_DN)  # [Cin, kh+r, kw+r, Cout]
  dk = dk[:, :kh, :kw].transpose(1, 2, 0, 3)
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_conv_cvjp.defvjp(_conv_cvjp_fwd, _conv_cvjp_bwd)


def conv_custom_vjp(x: Array, kernel: Array, strides=(1, 1),
                    padding=((0, 0), (0, 0))) -> Array:
  """`lax.conv` forward; backward as two ordinary convs (loop-safe on CPU)."""
  padding = tuple(tuple(int(v) for v in p) for p in padding)
  return _conv_cvjp(x, kernel, tuple(int(s) for s in strides), padding)


_CONV_FNS = {"im2col": conv_im2col, "custom_vjp": conv_custom_vjp,
             "taps": conv_taps, "xla": conv_xla}


def conv2d(x: Array, kernel: Array, *, strides: int | Sequence[int] = 1,
           padding: Padding = "SAME", impl: str = "auto", dtype=None) -> Array:
  """2-D convolution of NHWC `x` with an HWIO `kernel` (no bias) in compute
  dtype `dtype` (None: `x`'s): `x` and `kernel` cast to it. Under the CPU
  policy (`mixed_on_cpu` of an explicit `dtype`) the result is float32: with
  "auto", an im2col `bf16_matmul` where `on_matrix_units` (of b * Ho * Wo,
  kh * kw * Cin, Cout); else (and with an explicit `impl`) the float32 convolution."""
  strides = _pair(strides)
  pads = conv_padding(padding, kernel.shape[:2], strides, x.shape[1:3])
  fn = _CONV_FNS[resolve_conv_impl(impl, kernel.shape)]
  if dtype is None or not mixed_on_cpu(dtype):
    dtype = x.dtype if dtype is None else dtype
    return fn(cast(x, dtype), cast(kernel, dtype), strides, pads)
  x = cast(x, jnp.float32)
  kh, kw, cin, cout = kernel.shape
  m = x.shape[0] * math.prod(_out_size(x.shape[1 + d], kernel.shape[d],
                                       strides[d], pads[d]) for d in range(2))
  if impl == "auto" and on_matrix_units(m, kh * kw * cin, cout):
    return conv_im2col(x, kernel, strides, pads, mm=bf16_matmul)
  return fn(x, kernel, strides, pads)


def depthwise_conv2d(x: Array, kernel: Array, *,
                     strides: int | Sequence[int] = 1, padding: Padding = "SAME",
                     impl: str = "auto") -> Array:
  """Depthwise convolution of NHWC `x` with a [kh, kw, 1, C] kernel (no bias).

  "xla" (also "auto" off CPU): `lax.conv_general_dilated` with
  `feature_group_count=C`; otherwise the sum over taps of the strided shifted
  slice times the tap's per-channel weights.
  """
  strides = _pair(strides)
  kh, kw, _, ch = kernel.shape
  pads = conv_padding(padding, (kh, kw), strides, x.shape[1:3])
  if resolve_conv_impl(impl, kernel.shape) == "xla":
    return lax.conv_general_dilated(x, kernel, strides, pads,
                                    dimension_numbers=_DN,
                                    feature_group_count=ch)
  b, h, w, _ = x.shape
  ho = _out_size(h, kh, strides[0], pads[0])
  wo = _out_size(w, kw, strides[1], pads[1])
  xp = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  out = None
  for i in range(kh):
    for j in range(kw):
      tap = lax.slice(xp, (0, i, j, 0),
                      (b, i + (ho - 1) * strides[0] + 1,
                       j + (wo - 1) * strides[1] + 1, ch),
                      (1,) + strides + (1,)) * kernel[i, j, 0]
      out = tap if out is None else out + tap
  return out


# ---------------------------------------------------------------------------
# Initializers.


def kernel_init(init: str) -> nn.initializers.Initializer:
  """Kernel initializer ("flax": lecun_normal; "torch": U(+-1/sqrt(fan_in)))."""
  if init == "flax":
    return nn.initializers.lecun_normal()
  if init == "torch":
    # kaiming_uniform(a=sqrt(5)): bound = sqrt(6 / ((1 + 5) fan_in)).
    return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
  if init == "kaiming_out":
    # torchvision ResNet convs: kaiming_normal_(mode="fan_out", relu), untruncated.
    return nn.initializers.variance_scaling(2.0, "fan_out", "normal")
  if init == "normal":
    return nn.initializers.normal(0.01)
  raise ConfigError(f"init must be one of {INITS}, got {init!r}")


def bias_init(init: str, fan_in: int) -> nn.initializers.Initializer:
  """Bias initializer ("torch": U(+-1/sqrt(fan_in)); the others: zeros)."""
  if init in ("flax", "kaiming_out", "normal"):
    return nn.initializers.zeros_init()
  if init == "torch":
    bound = 1.0 / math.sqrt(fan_in)

    def _init(key, shape, dtype=jnp.float32):
      return jax.random.uniform(key, shape, dtype, -bound, bound)

    return _init
  raise ConfigError(f"init must be one of {INITS}, got {init!r}")


def init_rng_mode():
  """Context for tracing parameter initialization: non-partitionable threefry.

  On XLA:CPU every threefry call of the default (partitionable) mode costs ~0.7-1.3 s
  of compile time, so a model with 26 parameter tensors took ~6.5 s to compile its
  init (2.9 s in this mode; the forward pass is ~0.7 s of that). The values are as
  random, just a different stream; deterministic per key as always.
  """
  return jax.threefry_partitionable(False)


# ---------------------------------------------------------------------------
# Modules.


class Conv(nn.Module):
  """2-D convolution; params `kernel` [kh, kw, in, out] and `bias` [out] as nn.Conv."""
  features: int
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: Padding = "SAME"
  use_bias: bool = True
  impl: str = "auto"
  weight_init: str = "flax"
  dtype: Any = None  # compute dtype (`conv2d`); None: the input's

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kh, kw = _pair(self.kernel_size)
    cin = x.shape[-1]
    kernel = self.param("kernel", kernel_init(self.weight_init),
                        (kh, kw, cin, self.features), jnp.float32)
    y = conv2d(x, kernel, strides=self.strides, padding=self.padding,
               impl=self.impl, dtype=self.dtype)
    if self.use_bias:
      bias = self.param("bias", bias_init(self.weight_init, kh * kw * cin),
                        (self.features,), jnp.float32)
      y = y + bias.astype(y.dtype)
    return y


class DepthwiseConv(nn.Module):
  """Depthwise convolution; param `kernel` [kh, kw, 1, C] (nn.Conv with
  `feature_group_count=C`), no bias."""
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: Padding = "SAME"
  impl: str = "auto"
  weight_init: str = "flax"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kh, kw = _pair(self.kernel_size)
    kernel = self.param("kernel", kernel_init(self.weight_init),
                        (kh, kw, 1, x.shape[-1]), jnp.float32)
    return depthwise_conv2d(x, kernel.astype(x.dtype), strides=self.strides,
                            padding=self.padding, impl=self.impl)


class Dense(nn.Module):
  """nn.Dense (same param names/shapes) with an `init` switch ("flax" | "torch")."""
  features: int
  use_bias: bool = True
  weight_init: str = "flax"
  dtype: Any = None  # compute dtype (`matmul`); None: the input's

  @nn.compact
  def __call__(self, x: Array) -> Array:
    fan_in = x.shape[-1]
    kernel = self.param("kernel", kernel_init(self.weight_init),
                        (fan_in, self.features), jnp.float32)
    y = matmul(x, kernel, self.dtype)
    if self.use_bias:
      bias = self.param("bias", bias_init(self.weight_init, fan_in), (self.features,),
                        jnp.float32)
      y = y + bias.astype(y.dtype)
    return y


# ---------------------------------------------------------------------------
# Pooling.


def max_pool(x: Array, window: int | Sequence[int] = 2,
             stride: int | Sequence[int] | None = None,
             padding: Padding = "VALID") -> Array:
  """Max pooling of NHWC `x` (padding with -inf), loop-safe.

  Separable: a max over strided row slices, then over strided column slices (the
  max over a rectangle is the max of its row maxima). Its backward pass is a few
  elementwise selects: ~15x faster on XLA:CPU than a max over all kh*kw shifted
  slices or `lax.reduce_window` (select_and_scatter), and ~3x faster than
  reshape + max for 2x2/2 (measured on [64, 8, 8, 176] and [64, 32, 32, 32]).
  """
  kh, kw = _pair(window)
  sh, sw = _pair(window if stride is None else stride)
  _, h, w, _ = x.shape
  pads = conv_padding(padding, (kh, kw), (sh, sw), (h, w))
  if pads != ((0, 0), (0, 0)):
    x = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-jnp.inf)
  for axis, k, s, n in ((1, kh, sh, h), (2, kw, sw, w)):
    n_out = _out_size(n, k, s, pads[axis - 1])
    out = None
    for i in range(k):
      sl = lax.slice_in_dim(x, i, i + (n_out - 1) * s + 1, s, axis=axis)
      out = sl if out is None else jnp.maximum(out, sl)
    x = out
  return x


def adaptive_bins(n: int, out: int) -> list[tuple[int, int]]:
  """PyTorch AdaptiveAvgPool bins: [floor(i n / out), ceil((i + 1) n / out))."""
  return [((i * n) // out, -((-(i + 1) * n) // out)) for i in range(out)]


def adaptive_avg_pool(x: Array, out_size: int | Sequence[int]) -> Array:
  """PyTorch `AdaptiveAvgPool2d` on NHWC `x` with static slices (separable)."""
  oh, ow = _pair(out_size)
  _, h, w, _ = x.shape
  x = jnp.stack([x[:, a:e].mean(axis=1) for a, e in adaptive_bins(h, oh)], 1)
  return jnp.stack([x[:, :, a:e].mean(axis=2) for a, e in adaptive_bins(w, ow)],
                   2)


__all__ = [
    "CONV_IMPLS", "CPU_IM2COL_MAX_CHANNELS", "DTYPES", "INITS",
    "MATRIX_UNIT_MIN_K", "MATRIX_UNIT_MIN_N", "Conv", "Dense",
    "DepthwiseConv", "activation_dtype", "adaptive_avg_pool", "adaptive_bins", "bf16_matmul",
    "bias_init", "cast",
    "compute_dtype", "conv2d", "conv_custom_vjp", "conv_im2col", "conv_padding",
    "conv_xla", "dense", "depthwise_conv2d", "init_rng_mode", "kernel_init",
    "matmul", "max_pool", "mixed_on_cpu", "on_matrix_units",
    "resolve_conv_impl",
]
