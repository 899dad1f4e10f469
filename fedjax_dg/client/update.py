"""One client's local training: a pure function the engine maps over clients.

E local epochs over a client's `n` valid examples (of `n_max` padded ones) are
`E * ceil(n / B)` steps: a loop of the client's own count, or a static scan of
`E * ceil(n_max / B)` steps whose steps past its own count change nothing
(masked out with `jnp.where(active, new, old)`), so one compile serves unequal
clients and E epochs mean E epochs for every client. The pieces of a step
(`local_training`) also serve the engine's lanes (`client.lanes`), which train
several clients one after another per lane under vmap. Each epoch is a fresh
permutation of the valid examples; the last batch of an epoch is partial
(PyTorch `drop_last=False`) and its padding is masked out of the loss. With
fixed steps only the positions the steps read are drawn out of each
permutation (`first_of_argsort`), and a client whose rows the host gathered
in read order (`LocalTraining.rows`, `in_order`) reads them as they come.
`shuffle="feistel"` orders a pass by a keyed Feistel permutation evaluated
only at the positions the steps read (`feistel_permutation`): draws that do
not grow with the client.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class Batch(NamedTuple):
  x: jax.Array      # uint8 [B, H, W, ch]
  y: jax.Array      # int32 [B]
  mask: jax.Array   # float32 [B]: 1 for real examples, 0 for padding
  d: jax.Array | None = None  # int32 [B]: each example's domain (an index
                              # into the federation's `domain_names`), only
                              # for an algorithm that asks for it
                              # (`ClientSide.domains`); 0 at padding


class ClientContext(NamedTuple):
  """What one client's objective (and its end of round, `ClientEnd`) sees
  besides its batch; built per client by the engine (`algorithms.base`
  describes the round)."""
  id: jax.Array     # scalar: the client's id in 0..N-1
  round: jax.Array  # scalar: the round index
  start: PyTree     # the parameters it started this round from
  state: PyTree = None   # its row of the persistent client state
  extra: PyTree = None   # its row of `ClientSide.extra`
  shared: PyTree = None  # `ClientSide.shared(server)`: one copy for the cohort
  frozen: PyTree = None  # the shared-frozen parameters
  epoch: Any = 0         # the local epoch of the current step (0-based; filled
                         # by `local_update`, 0 elsewhere, e.g. at its end)
  step: Any = 0          # the current local step of this round (0-based;
                         # filled by `local_update`, 0 elsewhere)


class ClientData(NamedTuple):
  """One client's padded training arrays (and, from the engine, the local steps
  it took this round: `local_steps`). At a `ClientEnd` that does not read the
  client's data, `x` and `y` are None."""
  x: jax.Array | None  # uint8 [n_max, H, W, ch]
  y: jax.Array | None  # int32 [n_max]
  n: jax.Array  # scalar: real examples (rows 0..n-1; the rest is padding)
  steps: jax.Array | None = None  # scalar: its local steps this round


class RunProgress(optax.GradientTransformationExtraArgs):
  """A client optimizer whose `update` takes `progress=`: the share of the
  run's local epochs done before the current one, (round * E + epoch) /
  (rounds * E), so a schedule can span the run although the optimizer state
  starts fresh every round (`optim.cosine_over_run`). `local_update` passes it
  (and needs `rounds`)."""


class SeesContext(optax.GradientTransformationExtraArgs):
  """A client optimizer whose `update` takes `ctx=`: the step's
  `ClientContext` (SCAFFOLD's correction after the step, which reads the
  client's control variates). `local_update` passes it."""


# loss_fn(params, batch, rng, ctx: ClientContext) -> scalar loss.
LossFn = Callable[[PyTree, Batch, jax.Array, ClientContext], jax.Array]


def num_steps(n_max: int, batch_size: int, epochs: int) -> int:
  """The static number of scanned local steps for padded size `n_max`."""
  return epochs * math.ceil(n_max / batch_size)


def local_steps(n: jax.Array, batch_size: int, epochs: int,
                steps: int = 0) -> jax.Array:
  """The local steps a client with `n` real examples takes (int32 scalar):
  `steps` when fixed (> 0), else `epochs * ceil(n / batch_size)`; 0 when it has
  no examples (`local_update` then leaves its parameters unchanged)."""
  n = jnp.asarray(n)
  taken = steps if steps > 0 else epochs * ((n + batch_size - 1) // batch_size)
  return jnp.where(n > 0, taken, 0).astype(jnp.int32)


def epoch_permutations(key: jax.Array, n: jax.Array, n_max: int,
                       epochs: int, first: int = 0) -> jax.Array:
  """[epochs, n_max] int32: per epoch a random order of the `n` valid examples
  first: the stable argsort of uniform draws, padding (2.0) last.

  `first` in 1..n_max - 1: only each order's first `first` positions,
  [epochs, first] (`first_of_argsort`: the same draws, a top-k instead of a
  whole sort; what fixed local steps read of a client larger than them)."""
  u = jax.random.uniform(key, (epochs, n_max))
  u = jnp.where(jnp.arange(n_max)[None, :] < n, u, 2.0)  # padding sorts last
  if 0 < first < n_max:
    return first_of_argsort(u, first)
  return unit_argsort(u)


def first_of_argsort(u: jax.Array, k: int) -> jax.Array:
  """`jnp.argsort(u, axis=-1, stable=True)[..., :k]` by `lax.top_k` of -u,
  which puts the lower index first among equal values (its documented tie
  rule): a partial selection, 3-10x cheaper than the whole sort on XLA:CPU
  for k = 128 of 160 .. 17,779 draws (identical: tested, ties included)."""
  return jax.lax.top_k(-u, k)[1].astype(jnp.int32)


# Index bits a sort key holds beside the 24 of a draw (`unit_argsort`), and
# the widest tie window (2^6 neighbours) before plain argsort is cheaper.
_INDEX_BITS, _MAX_WINDOW_BITS = 8, 6


def unit_argsort(u: jax.Array) -> jax.Array:
  """`jnp.argsort(u, axis=-1)` (stable) of float32 uniform draws (k / 2^23,
  as `jax.random.uniform` makes them) and 2.0, by a sort of one uint32 key.

  XLA:CPU sorts a single integer operand ~20x faster than it argsorts (a
  two-operand sort with a comparator): 20 clients x 674 draws took 0.9 ms
  instead of 20 ms. The key is k (24 bits with 2.0 as 2^23) over the high
  index bits i >> s; an element's rank is the count of smaller keys
  (`searchsorted` in the sorted keys) plus the count of equal keys before it,
  all within its block of 2^s indices. Identical to argsort (tested)."""
  n_max = u.shape[-1]
  s = max(0, (n_max - 1).bit_length() - _INDEX_BITS)
  if s > _MAX_WINDOW_BITS:
    return jnp.argsort(u, axis=-1).astype(jnp.int32)
  k = jnp.where(u < 1.0, (u * 2.0**23).astype(jnp.uint32), jnp.uint32(2**23))
  keys = ((k << _INDEX_BITS)
          | (jnp.arange(n_max, dtype=jnp.uint32) >> s)).reshape(-1, n_max)
  smaller = jax.vmap(jnp.searchsorted)(jnp.sort(keys, axis=-1), keys)
  earlier_equal = sum(
      jnp.pad(keys[:, d:] == keys[:, :-d], [(0, 0), (d, 0)]).astype(jnp.int32)
      for d in range(1, 2**s))
  rank = smaller.astype(jnp.int32) + earlier_equal
  perm = jax.vmap(lambda r: jnp.zeros((n_max,), jnp.int32).at[r].set(
      jnp.arange(n_max, dtype=jnp.int32), unique_indices=True))(rank)
  return perm.reshape(u.shape)


# train.shuffle: how a pass orders a client's examples (`local_training`).
SHUFFLES = ("sort", "feistel")
# Rounds of the Feistel network: Luby-Rackoff's 4 make a pseudo-random
# permutation of random round functions; 6 leave a margin for a mix that is
# only a hash (and cost 6 integer mixes per position and walk step).
FEISTEL_ROUNDS = 6


def _mix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer (fmix32): every input bit flips each output
  bit with probability ~1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def feistel_permutation(keys: jax.Array, n: jax.Array,
                        positions: jax.Array) -> jax.Array:
  """int32 like `positions`: a keyed pseudo-random permutation of [0, n)
  evaluated at `positions` (int32, any shape); a position outside [0, n)
  maps to itself. `keys`: uint32 [FEISTEL_ROUNDS], the round keys (one pass's
  order; `feistel_rows` draws them).

  A balanced Feistel network on b bits, b the even number >= the bit
  length of n - 1 (traced: one program serves every n), permutes [0, 2^b);
  its round i maps halves (L, R) to (R, L ^ F_i(R)), F_i(R) the low b / 2
  bits of fmix32(R ^ keys[i]). A value >= n is permuted again (cycle
  walking: it stays on its own cycle, so it comes back into [0, n) and the
  restriction is a permutation of [0, n)); 2^b < 4n, so each walk is short
  (geometric, mean < 4 steps) and the loop runs until every position is in.
  The cost is O(positions read), independent of n and of the padded width,
  where the sort's draws are O(n_max) per pass. Small domains get only the
  permutations a Feistel network makes (even ones of [0, 2^b)), which does
  not bias where a position lands (tested: each (position, value) pair's
  frequency, chi-square)."""
  n_u = jnp.asarray(n).astype(jnp.uint32)
  bits = 32 - jax.lax.clz(jnp.maximum(n_u, 1) - 1)  # bit length of n - 1
  half = (bits + 1) // 2  # n <= 1: half 0, the identity on [0, 1)
  mask = (jnp.uint32(1) << half) - 1

  def permute(x):
    left, right = x >> half, x & mask
    for i in range(FEISTEL_ROUNDS):
      left, right = right, left ^ (_mix32(right ^ keys[i]) & mask)
    return (left << half) | right

  x = positions.astype(jnp.uint32)
  inside = (positions >= 0) & (x < n_u)
  walk = lambda x: jnp.where(inside & (x >= n_u), permute(x), x)
  x = jax.lax.while_loop(lambda x: jnp.any(inside & (x >= n_u)), walk,
                         jnp.where(inside, permute(x), x))
  return jnp.where(inside, x.astype(jnp.int32), positions)


def feistel_rows(key: jax.Array, n: jax.Array, n_max: int, batch_size: int,
                 passes: int, steps: int) -> jax.Array:
  """int32 [steps * batch_size]: the rows local steps 0 .. steps - 1 of a
  client with `n` examples (of `n_max` padded) read, in read order, under
  train.shuffle="feistel": pass e's order is `feistel_permutation` with
  round keys bits(fold_in(key, e)), evaluated only at the positions the
  steps read (`step_position`); a masked position reads its own row,
  clipped to n_max - 1 as `batch_at` clips."""
  keys = jax.vmap(lambda e: jax.random.bits(
      jax.random.fold_in(key, e), (FEISTEL_ROUNDS,), jnp.uint32))(
          jnp.arange(passes))

  def at(s):
    epoch, pos, _, _ = step_position(s, n, batch_size, passes)
    return feistel_permutation(keys[jnp.minimum(epoch, passes - 1)], n, pos)

  rows = jax.vmap(at)(jnp.arange(steps)).reshape(-1)
  return jnp.minimum(rows, n_max - 1)


def step_position(step: jax.Array, n: jax.Array, batch_size: int,
                  epochs: int) -> tuple[jax.Array, jax.Array, jax.Array,
                                        jax.Array]:
  """(epoch, positions [B] in that epoch's order, example mask [B],
  step-active flag) of local step `step` of a client with `n` examples."""
  steps_per_epoch = jnp.maximum((n + batch_size - 1) // batch_size, 1)
  epoch = step // steps_per_epoch
  pos = (step % steps_per_epoch) * batch_size + jnp.arange(batch_size)
  return epoch, pos, pos < n, (epoch < epochs) & (n > 0)


def batch_at(step: jax.Array, perms: jax.Array, n: jax.Array,
             batch_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Indices [B], example mask [B] and step-active flag of local step `step`."""
  epochs, width = perms.shape
  epoch, pos, valid, active = step_position(step, n, batch_size, epochs)
  row = jax.lax.dynamic_index_in_dim(perms, jnp.minimum(epoch, epochs - 1), 0,
                                     keepdims=False)
  idx = jnp.take(row, jnp.minimum(pos, width - 1))
  return idx, valid, active


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset(
      getattr(aval, "vma", ()))


def match_varying(values: PyTree, like: PyTree) -> PyTree:
  """Marks `values` as varying over the mesh axes any leaf of `like` varies
  over.

  Inside `shard_map` a scan carry built from constants (a zero loss sum, an
  optimizer step count) is device-invariant while the body makes it vary per
  client shard; `pcast` makes the types agree. A no-op outside `shard_map`.
  """
  axes = frozenset().union(*map(_varying_axes, jax.tree.leaves(like)))
  if not axes:
    return values

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, values)


class Local(NamedTuple):
  """One client's training between two local steps (`LocalTraining`)."""
  params: PyTree
  opt_state: PyTree
  loss_sum: jax.Array   # summed loss of the steps taken so far
  perms: jax.Array      # [passes, n_max] int32: `epoch_permutations`; or
                        # (shuffle="feistel") [padded_steps * B] int32: the
                        # rows its steps read (`feistel_rows`); None: the
                        # rows arrive in read order (`in_order`)
  step_key: jax.Array   # step s draws fold_in(step_key, s)
  n: jax.Array          # its real examples


class LocalTraining(NamedTuple):
  """One client's local training as loop pieces: `local_update` runs them in
  one loop per client, the engine's lanes (`client.lanes`) run several
  clients one after another in each lane. Every form gives a client the same
  permutations, step keys and steps."""
  order: Callable   # order(n, key) -> (perms, step key): split(key), the
                    # permutations drawn from its first half
  begin: Callable   # begin(params, perms, step_key, n) -> Local: a fresh
                    # optimizer state, loss 0
  step: Callable    # step(local, s, fetch, ctx) -> (Local, active): local step
                    # s (fetch(idx) -> (x, y) rows of the client's arrays,
                    # (x, y, d) where the domains are carried);
                    # `active` is False past the client's own count
  end: Callable     # end(local) -> (params, mean loss over its steps)
  padded_steps: int  # E * ceil(n_max / B) (or `steps`): the static scan
  count: Callable   # count(n) -> int32: the client's own steps (local_steps)
  rows: Callable    # rows(n, key) -> int32 [padded_steps * B]: the rows of
                    # the client's arrays its steps read, step by step, in
                    # order (a masked position's row too: padding or an
                    # example masked out); arange with `in_order`


def local_training(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                   *, n_max: int, batch_size: int, epochs: int, steps: int = 0,
                   rounds: int = 0, in_order: bool = False,
                   shuffle: str = "sort") -> LocalTraining:
  """The pieces of `local_update` for clients padded to `n_max` examples
  (arguments as there).

  `shuffle` (`SHUFFLES`, the engine's `train.shuffle`): each pass's order of
  the client's examples. "sort": the stable argsort of `uniform` draws over
  the padded width (`epoch_permutations`; with fixed steps their first
  steps x B positions, `first_of_argsort`), O(passes x n_max) a client.
  "feistel": a keyed Feistel permutation evaluated only at the positions the
  steps read (`feistel_rows`), O(steps x B) a client however large it is;
  other orders than "sort" for the same key (so other numbers), equally
  uniform.

  `in_order`: the client's arrays hold, instead of its examples, the rows its
  steps read in the order they read them (`rows` of the same client and key,
  gathered on the host: the engine's `train.host_gather="rows"`), so step s
  reads rows s*B .. s*B + B - 1 and draws no permutation; the same batches,
  step keys and masks, so the same training."""
  scheduled = isinstance(optimizer, RunProgress)
  if shuffle not in SHUFFLES:
    raise ValueError(f"shuffle={shuffle!r}: one of {SHUFFLES}")
  if scheduled and rounds < 1:
    raise ValueError("a RunProgress optimizer (a schedule over the run) needs "
                     "local_update(..., rounds=R)")
  fixed_steps = steps > 0
  # With fixed steps at most one pass per step: `steps` permutations suffice.
  passes = steps if fixed_steps else epochs
  grad_fn = jax.value_and_grad(loss_fn)
  # An optimizer taking extra arguments gets `grad_fn(params, i)`, the gradient of
  # the step's own loss (same batch, key and ctx) at other parameters: SAM's
  # second gradient (`client.sam`, optax.contrib.sam's opaque mode). Transforms
  # that take no extra arguments ignore it (optax.chain).
  extra_args = isinstance(optimizer, optax.GradientTransformationExtraArgs)
  count = lambda n: local_steps(n, batch_size, epochs, steps)

  # Fixed steps read positions below steps * B of each order (a client
  # larger than that takes part of one pass, a smaller one ceil(n / B) <=
  # steps batches a pass): only those are drawn out, and `batch_at`'s clip
  # to the width is never reached.
  first = steps * batch_size if fixed_steps else 0

  def order(n, key):
    perm_key, step_key = jax.random.split(key)
    if in_order:
      return None, step_key
    if shuffle == "feistel":
      return feistel_rows(perm_key, n, n_max, batch_size, passes,
                          padded), step_key
    return epoch_permutations(perm_key, n, n_max, passes, first), step_key

  def read_at(s, perms, n):
    if in_order or shuffle == "feistel":  # the rows read, step by step
      _, _, valid, active = step_position(s, n, batch_size, passes)
      at = s * batch_size + jnp.arange(batch_size)
      return (at if in_order else jnp.take(perms, at, mode="clip"), valid,
              active)
    return batch_at(s, perms, n, batch_size)

  def begin(params, perms, step_key, n):
    return Local(params, optimizer.init(params), jnp.zeros((), jnp.float32),
                 perms, step_key, n)

  def step(local, s, fetch, ctx):
    n = local.n
    idx, valid, active = read_at(s, local.perms, n)
    rng = jax.random.fold_in(local.step_key, s)
    xb, yb, *domains = fetch(idx)  # (x, y) rows, and d where carried
    batch = Batch(xb, yb, valid.astype(jnp.float32), *domains)
    per_pass = jnp.maximum((n + batch_size - 1) // batch_size, 1)
    step_ctx = ctx
    if isinstance(ctx, ClientContext):
      step_ctx = ctx._replace(epoch=jnp.minimum(s // per_pass, passes - 1),
                              step=s)
    loss, grads = grad_fn(local.params, batch, rng, step_ctx)
    kw = {}
    if extra_args:
      kw["grad_fn"] = lambda q, _: jax.grad(loss_fn)(q, batch, rng, step_ctx)
    if scheduled:
      # With fixed steps a round counts as one epoch.
      e = 1 if fixed_steps else epochs
      epoch = 0 if fixed_steps else jnp.minimum(s // per_pass, e - 1)
      kw["progress"] = (getattr(ctx, "round", 0) * e + epoch) / (rounds * e)
    if isinstance(optimizer, SeesContext):
      kw["ctx"] = step_ctx
    updates, opt_state = optimizer.update(grads, local.opt_state, local.params,
                                          **kw)
    # Under shard_map a state field the update rebuilds from constants
    # (optax.contrib.sam's opaque step count) would lose its variation over
    # the client axis: the loop carry's type must stay the same.
    return match_varying(local._replace(
        params=optax.apply_updates(local.params, updates), opt_state=opt_state,
        loss_sum=local.loss_sum + loss), n), active

  def end(local):
    return local.params, local.loss_sum / jnp.maximum(count(local.n), 1)

  padded = steps if fixed_steps else num_steps(n_max, batch_size, epochs)

  def rows(n, key):
    perms, _ = order(n, key)
    return jax.vmap(lambda s: read_at(s, perms, n)[0])(
        jnp.arange(padded)).reshape(-1)

  return LocalTraining(order, begin, step, end, padded, count, rows)


def keep_where(active: jax.Array, new: Local, old: Local) -> Local:
  """`new` where `active`, else `old`: a masked step (the trained fields)."""
  pick = lambda a, b: jax.tree.map(lambda u, v: jnp.where(active, u, v), a, b)
  return new._replace(params=pick(new.params, old.params),
                      opt_state=pick(new.opt_state, old.opt_state),
                      loss_sum=jnp.where(active, new.loss_sum, old.loss_sum))


def rows_of(x: jax.Array, y: jax.Array) -> Callable:
  """fetch(idx) -> (x[idx], y[idx]): a batch of one client's rows."""
  return lambda idx: (jnp.take(x, idx, axis=0), jnp.take(y, idx, axis=0))


def local_update(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                 params: PyTree, x: jax.Array, y: jax.Array, n: jax.Array,
                 key: jax.Array, ctx: Any = None, *, batch_size: int,
                 epochs: int, steps: int = 0, rounds: int = 0,
                 own_steps: bool = False,
                 shuffle: str = "sort") -> tuple[PyTree, jax.Array]:
  """Trains one client; returns (params, mean loss over its steps).

  `epochs` passes over the client's own `n` examples, or, with `steps > 0`,
  exactly `steps` steps for every client (pFedHN's "inner steps"), cycling through
  fresh permutations. The optimizer state starts fresh every call (every round),
  as in the papers' reference code. `x`: uint8 [n_max, ...], `y`: [n_max], `n`:
  scalar count. `rounds`: the run's rounds, for a `RunProgress` optimizer
  (a static int: the engine compiles such clients per run length).
  `shuffle`: how each pass orders the examples (`local_training`).
  `own_steps`: a loop of the client's own count of steps (a `lax.while_loop`:
  under vmap JAX runs it to the batch's largest count and masks the rest);
  else a static scan of the padded count `E * ceil(n_max / B)` whose steps
  past the client's count are computed and discarded (`jnp.where`). The same
  numbers either way.
  A `ClientContext` reaches the loss with `epoch` set to the step's pass over
  the client's data: `s // ceil(n / B)`, at most the last pass (with `steps >
  0` too, where a pass is `ceil(n / B)` steps).
  """
  lt = local_training(loss_fn, optimizer, n_max=x.shape[0],
                      batch_size=batch_size, epochs=epochs, steps=steps,
                      rounds=rounds, shuffle=shuffle)
  return train_client(lt, params, rows_of(x, y), n, key, ctx,
                      own_steps=own_steps)


def train_client(training: LocalTraining, params: PyTree, fetch: Callable,
                 n: jax.Array, key: jax.Array, ctx: Any = None, *,
                 own_steps: bool) -> tuple[PyTree, jax.Array]:
  """`local_update` of one client whose rows `fetch(idx) -> (x, y)` reads
  (the engine reads them from the cohort's arrays in place)."""
  lt = training
  local = match_varying(lt.begin(params, *lt.order(n, key), n), n)
  if own_steps:
    local = jax.lax.fori_loop(
        0, lt.count(n), lambda s, l: lt.step(l, s, fetch, ctx)[0], local)
  else:
    def masked(l, s):
      new, active = lt.step(l, s, fetch, ctx)
      return keep_where(active, new, l), None

    local, _ = jax.lax.scan(masked, local, jnp.arange(lt.padded_steps))
  return lt.end(local)
