"""Local objectives: pure `loss(params, batch, rng, ctx)` builders over a Model."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.client.update import Batch


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(model) -> Any:
  """Mean softmax cross-entropy over the real (unmasked) examples of a batch."""

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    logits = model.apply(params, batch.x, train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    return masked_mean(ce, batch.mask)

  return loss


def augmented(base_loss, augment) -> Any:
  """`base_loss` on an augmented batch: `augment(batch, rng, ctx) -> Batch`.

  The augmentation is jittable and per client: it can read the client's id,
  persistent state or the cohort's shared values from `ctx` (a
  `ClientContext`). It gets its own key, split from the step's; the base loss
  gets the other half (its dropout key).
  """

  def loss(params, batch: Batch, rng: jax.Array, ctx) -> jax.Array:
    k_augment, k_loss = jax.random.split(rng)
    return base_loss(params, augment(batch, k_augment, ctx), k_loss, ctx)

  return loss


def proximal(base_loss, mu: float) -> Any:
  """FedProx: base loss + mu/2 |w - w_start|^2, w_start = `ctx.start`."""

  def loss(params, batch: Batch, rng: jax.Array, ctx) -> jax.Array:
    sq = optax.tree.norm(optax.tree.sub(params, ctx.start), squared=True)
    return base_loss(params, batch, rng, ctx) + 0.5 * mu * sq

  return loss


def row_norms(z: jax.Array) -> jax.Array:
  """[B] unsquared L2 norms of the rows of `z`, with a finite gradient at 0."""
  sq = jnp.sum(jnp.square(z), axis=-1)
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def fedsr_l2r(z: jax.Array, mask: jax.Array) -> jax.Array:
  """FedSR's L2R: the batch mean of the *unsquared* norm |z_b|_2 (`z.norm(dim=1)`)."""
  return masked_mean(row_norms(z), mask)


def fedsr_cmi(mu: jax.Array, sigma: jax.Array, y: jax.Array, r_mu: jax.Array,
              r_sigma: jax.Array, c: jax.Array, mask: jax.Array) -> jax.Array:
  """FedSR's CMI bound: batch mean of sum_d KL(N(c mu, c sigma) || N(r_mu[y], s[y])).

  As the reference code (src/methods/FedSR.py): s = softplus(r_sigma) per class,
  the representation's mean and scale are both multiplied by the scalar `c`, and
  KL = log s - log(c sigma) + ((c sigma)^2 + (c mu - r_mu[y])^2) / (2 s^2) - 1/2.
  mu, sigma: [B, z]; y: [B]; r_mu, r_sigma: [classes, z]; c: scalar.
  """
  s = jnp.take(jax.nn.softplus(r_sigma), y, axis=0)
  m = jnp.take(r_mu, y, axis=0)
  mu_c, sigma_c = mu * c, sigma * c
  kl = (jnp.log(s) - jnp.log(sigma_c)
        + (jnp.square(sigma_c) + jnp.square(mu_c - m)) / (2.0 * jnp.square(s))
        - 0.5)
  return masked_mean(jnp.sum(kl, axis=-1), mask)


def fedsr(prob_model, l2r_coeff: float, cmi_coeff: float) -> Any:
  """FedSR's local objective: CE(cls(z)) + l2r_coeff L2R(z) + cmi_coeff CMI.

  `prob_model`: a `models.fedsr.ProbabilisticModel`. The trained params are
  {"model": its params, "ref": (r_mu, r_sigma, c)} (the client's own
  reference distribution, trained locally like the model).
  """

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    p, ref = params["model"], params["ref"]
    k_body, k_z = jax.random.split(rng)
    mu, sigma = prob_model.distribution(p, batch.x, train=True, rng=k_body)
    z = mu + sigma * jax.random.normal(k_z, mu.shape)
    logits = prob_model.classify(p, z)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    obj = masked_mean(ce, batch.mask)
    if l2r_coeff:
      obj = obj + l2r_coeff * fedsr_l2r(z, batch.mask)
    if cmi_coeff:
      obj = obj + cmi_coeff * fedsr_cmi(mu, sigma, batch.y, ref.r_mu,
                                        ref.r_sigma, ref.c, batch.mask)
    return obj

  return loss


def supervised_contrastive(z1: jax.Array, z2: jax.Array, y: jax.Array,
                           mask: jax.Array, temperature: float) -> jax.Array:
  """FedCCRL Eq. 9-11 (Khosla et al. 2020) on Z = cat(z1, z2), Y = cat(y, y):
  for each anchor i, -1/|P(i)| sum_{p in P(i)} log(s_ip / sum_{a != i} s_ia)
  with s = exp(cos / temperature), P(i) = the other rows of i's label (the
  anchor excluded). Padded rows (`mask` 0) are neither anchors nor candidates;
  the anchors' losses are averaged (Eq. 11 sums them: the mean keeps lambda_1
  independent of the batch size, as the released code does)."""
  z = jnp.concatenate([z1, z2], axis=0)
  labels = jnp.concatenate([y, y])
  valid = jnp.concatenate([mask, mask]) > 0
  norms = row_norms(z)
  z = z / jnp.maximum(norms, 1e-12)[:, None]
  sim = (z @ z.T) / temperature
  n = z.shape[0]
  others = valid[None, :] & valid[:, None] & ~jnp.eye(n, dtype=bool)
  log_denom = jax.nn.logsumexp(jnp.where(others, sim, -jnp.inf), axis=1)
  positive = others & (labels[:, None] == labels[None, :])
  count = jnp.sum(positive, axis=1)
  log_prob = jnp.where(positive, sim - log_denom[:, None], 0.0)
  per_anchor = -jnp.sum(log_prob, axis=1) / jnp.maximum(count, 1)
  anchors = (valid & (count > 0)).astype(jnp.float32)
  return masked_mean(per_anchor, anchors)


def js_divergence(logits: list[jax.Array], mask: jax.Array) -> jax.Array:
  """FedCCRL Eq. 13-14: mean over the k predictions of KL(p_k || mean p), the
  mixture clipped to [1e-7, 1] as the released code does; batch mean over
  the real examples."""
  probs = [jax.nn.softmax(l, axis=-1) for l in logits]
  log_mix = jnp.log(jnp.clip(sum(probs) / len(probs), 1e-7, 1.0))
  kls = [jnp.sum(p * (jax.nn.log_softmax(l, axis=-1) - log_mix), axis=-1)
         for p, l in zip(probs, logits)]
  return masked_mean(sum(kls) / len(kls), mask)


def ntxent(z: jax.Array, labels: jax.Array, mask: jax.Array,
           temperature: float) -> jax.Array:
  """NT-Xent with labels, as `pytorch_metric_learning.losses.NTXentLoss`
  computes it (ELCFS's boundary loss): s = cos(z_a, z_b) / temperature; every
  ordered pair (a, p), a != p, of one label is a positive pair with loss
  -log(e^s_ap / (e^s_ap + sum_{n: label differs} e^s_an)); the mean over the
  positive pairs (a pair whose anchor has no negative counts with loss 0); 0
  without positive or without negative pairs. Rows with `mask` 0 take no
  part. z: [B, F]; labels, mask: [B]."""
  valid = mask > 0
  u = z / jnp.maximum(row_norms(z), 1e-12)[:, None]
  sim = (u @ u.T) / temperature
  both = valid[:, None] & valid[None, :]
  same = labels[:, None] == labels[None, :]
  pos = both & same & ~jnp.eye(z.shape[0], dtype=bool)
  neg = both & ~same
  # A finite stand-in for -inf keeps the gradient of anchors without
  # negatives finite (their pairs' loss is then exactly 0).
  log_neg = jax.nn.logsumexp(jnp.where(neg, sim, -1e30), axis=1, keepdims=True)
  per_pair = jnp.logaddexp(sim, log_neg) - sim  # -log(e^s / (e^s + negatives))
  total = jnp.sum(jnp.where(pos, per_pair, 0.0))
  mean = total / jnp.maximum(jnp.sum(pos.astype(jnp.float32)), 1.0)
  return jnp.where(jnp.any(neg), mean, 0.0)


def domain_groups(d: jax.Array, mask: jax.Array) -> tuple[jax.Array,
                                                          jax.Array]:
  """A batch's domains as groups of its examples, without a static count of
  domains: (members [B, B] float32, first [B] float32).

  members[k, i] = 1 where examples k and i are both real (mask 1) and of one
  domain (d_k = d_i); first[k] = 1 where k is the first real example of its
  domain in the batch. The domains present are the rows k with first[k] = 1
  (at most B of them); a domain absent from the batch has no row."""
  valid = mask > 0
  same = (d[:, None] == d[None, :]) & valid[:, None] & valid[None, :]
  earlier = jnp.any(jnp.tril(same, k=-1), axis=1)  # a same-domain i < k
  return same.astype(jnp.float32), (valid & ~earlier).astype(jnp.float32)


def group_means(values: jax.Array, members: jax.Array) -> jax.Array:
  """[B]: row k the mean of `values` [B] over the members of k's domain,
  sum_i members[k, i] values_i / sum_i members[k, i] (0 for a padded row)."""
  return (members @ values) / jnp.maximum(jnp.sum(members, axis=1), 1.0)


def vrex_terms(logits: jax.Array, y: jax.Array, members: jax.Array,
               first: jax.Array) -> tuple[jax.Array, jax.Array]:
  """V-REx (Krueger et al. 2021) over the domains e present in a batch:
  (mean_e R_e, Var_e R_e), R_e the mean cross-entropy of domain e's
  examples and Var the population variance (1/|E| sum_e (R_e - mean)^2)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  risks = group_means(ce, members)
  mean = masked_mean(risks, first)
  return mean, masked_mean(jnp.square(risks - mean), first)


def irm_terms(logits: jax.Array, y: jax.Array, members: jax.Array,
              first: jax.Array) -> tuple[jax.Array, jax.Array]:
  """IRMv1 (Arjovsky et al. 2019) over the domains e present in a batch:
  (mean_e R_e, mean_e g_e^even g_e^odd).

  R_e is the mean cross-entropy of domain e's examples; with a dummy scale
  w on the logits, ell_i(w) = CE(w z_i, y_i), g_e^even (g_e^odd) is
  d/dw at w = 1 of the mean of ell_i over the even (odd) members of e, in
  batch order: the product of two independent halves' gradients, an
  unbiased estimate of |grad_w R_e|^2 (the released code's
  `losses[0::2]`, `losses[1::2]`). An empty half contributes 0."""
  def ce_at(w):
    return optax.softmax_cross_entropy_with_integer_labels(logits * w, y)

  ce, dce = jax.jvp(ce_at, (jnp.ones((), logits.dtype),),
                    (jnp.ones((), logits.dtype),))
  rank = jnp.sum(jnp.tril(members, k=-1), axis=1)  # earlier same-domain rows
  even = (rank % 2 == 0).astype(jnp.float32)
  g_even = group_means(dce, members * even[None, :])
  g_odd = group_means(dce, members * (1.0 - even)[None, :])
  return (masked_mean(group_means(ce, members), first),
          masked_mean(g_even * g_odd, first))


def annealed_weight(weight, anneal_steps: int, count: jax.Array) -> jax.Array:
  """The released code's penalty schedule of IRM / V-REx: count / anneal_steps
  during the first `anneal_steps` local steps of a client, then `weight`
  (`weight` from the start when anneal_steps = 0). `count`: the client's
  local steps before the current one, over every round."""
  if anneal_steps <= 0:
    return jnp.asarray(weight, jnp.float32)
  ramp = count.astype(jnp.float32) / anneal_steps
  return jnp.where(count >= anneal_steps, weight, ramp)


def domain_penalty(model, terms, weight, anneal_steps: int) -> Any:
  """risk + w_t * penalty, (risk, penalty) = `terms(logits, y, members,
  first)` over the batch's domains (`domain_groups` of `Batch.d`), w_t =
  `annealed_weight(weight, anneal_steps, count)` with count = ctx.state (the
  client's local steps of earlier rounds) + ctx.step."""

  def loss(params, batch: Batch, rng: jax.Array, ctx) -> jax.Array:
    logits = model.apply(params, batch.x, train=True, rng=rng)
    members, first = domain_groups(batch.d, batch.mask)
    risk, penalty = terms(logits, batch.y, members, first)
    w = annealed_weight(weight, anneal_steps, ctx.state + ctx.step)
    return risk + w * penalty

  return loss


def no_steps(key: jax.Array, ids: jax.Array) -> jax.Array:
  """int32 [k]: the initial step counts of clients `ids` (0 local steps
  taken): the client state `annealed_weight`'s count starts from."""
  del key
  return jnp.zeros(ids.shape, jnp.int32)


def add_steps(ctx, trained, data, key) -> tuple[jax.Array, None]:
  """A client's end of round (`algorithms.base.ClientEnd`, no data read):
  its count grows by the local steps it took (`data.steps`); no message."""
  del trained, key
  return ctx.state + data.steps, None


# The released code's MMD kernel bandwidths (`MMD.penalty`'s `gamma`, as
# DomainBed's).
MMD_GAMMAS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)


def gaussian_kernels(h: jax.Array, gammas=MMD_GAMMAS) -> jax.Array:
  """[B, B]: sum_g exp(-g D_ij), D_ij = |h_i - h_j|^2 clamped at 1e-30 (the
  released code's `my_cdist`, which expands it as |h_i|^2 + |h_j|^2 - 2
  h_i.h_j: here the differences themselves, [B, B, F], whose float32 sum
  does not cancel, so that exp(-1000 D) does not move with the summation
  order). h: [B, F]."""
  diff = h[:, None, :] - h[None, :, :]
  dist = jnp.maximum(jnp.sum(jnp.square(diff), axis=-1), 1e-30)
  return sum(jnp.exp(-g * dist) for g in gammas)


def _pairs_mean(values: jax.Array, first: jax.Array) -> jax.Array:
  """The mean of values[k, l] over the pairs k < l of domains present
  (`first`), 0 with fewer than two domains."""
  pairs = jnp.triu(first[:, None] * first[None, :], k=1)
  return jnp.sum(pairs * values) / jnp.maximum(jnp.sum(pairs), 1.0)


def mmd_penalty(h: jax.Array, members: jax.Array, first: jax.Array,
                gammas=MMD_GAMMAS) -> jax.Array:
  """MMD (Li et al. 2018, the released code's `MMD.penalty`): the mean over
  the pairs of domains (a, b) present in the batch of mean K_aa + mean K_bb
  - 2 mean K_ab, K = `gaussian_kernels(h)` restricted to the two domains'
  real examples (means over all their pairs of examples). h: [B, F]."""
  w = members / jnp.maximum(jnp.sum(members, axis=1), 1.0)[:, None]
  means = w @ gaussian_kernels(h, gammas) @ w.T  # [k, l]: mean K, k's x l's
  diag = jnp.diagonal(means)
  return _pairs_mean(diag[:, None] + diag[None, :] - 2.0 * means, first)


def coral_penalty(h: jax.Array, members: jax.Array,
                  first: jax.Array) -> jax.Array:
  """Deep CORAL (Sun & Saenko 2016, the released code's `Coral.penalty`):
  the mean over the pairs of domains (a, b) present in the batch of
  mean_f (mu_a - mu_b)^2 + mean_fg (C_a - C_b)^2, mu the mean and C the
  covariance (over n - 1) of a domain's real examples' features h [B, F];
  a domain of one example has covariance 0."""
  count = jnp.sum(members, axis=1)
  mu = (members @ h) / jnp.maximum(count, 1.0)[:, None]  # [k, F]
  cent = h[None, :, :] - mu[:, None, :]                  # [k, i, F]
  cov = jnp.einsum("ki,kif,kig->kfg", members, cent, cent) / jnp.maximum(
      count - 1.0, 1.0)[:, None, None]
  f = h.shape[1]
  mean_diff = jnp.mean(jnp.square(mu[:, None, :] - mu[None, :, :]), axis=-1)
  sq = jnp.sum(jnp.square(cov), axis=(1, 2))
  cov_diff = (sq[:, None] + sq[None, :]
              - 2.0 * jnp.einsum("kfg,lfg->kl", cov, cov)) / (f * f)
  return _pairs_mean(mean_diff + cov_diff, first)


def feature_alignment(model, penalty, weight) -> Any:
  """CE + weight * penalty(h, members, first): the batch's mean
  cross-entropy (over its real examples) and a distance between its
  domains' features h = `model.features` (`mmd_penalty`, `coral_penalty`;
  the domains from `Batch.d`, `domain_groups`); logits = `model.head(h)`."""

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    h = model.features(params, batch.x, train=True, rng=rng)
    logits = model.head(params, h)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    members, first = domain_groups(batch.d, batch.mask)
    return masked_mean(ce, batch.mask) + weight * penalty(h, members, first)

  return loss


class GroupWeights(NamedTuple):
  """A client's GroupDRO weights over the domain indices 0..D-1 (its
  persistent state, trained beside the model: `group_dro`)."""
  log_q: jax.Array  # [D] float32: log of the unnormalized weights, 0 at the
                    # start, + eta * (a domain's mean loss) at every step
  seen: jax.Array   # [D] float32: 1 for the domains met in a batch so far


def domain_means(values: jax.Array, d: jax.Array, mask: jax.Array,
                 num_domains: int) -> tuple[jax.Array, jax.Array]:
  """(means [D], present [D]): per domain index the mean of `values` [B] over
  the batch's real examples of that domain (0 where it has none), and 1
  where it has some. A domain index >= D counts in no domain."""
  onehot = jax.nn.one_hot(d, num_domains) * mask[:, None]  # [B, D]
  count = jnp.sum(onehot, axis=0)
  means = (values @ onehot) / jnp.maximum(count, 1.0)
  return means, (count > 0).astype(jnp.float32)


def group_dro_update(weights: GroupWeights, losses: jax.Array,
                     present: jax.Array, eta) -> GroupWeights:
  """The released code's step of the weights, in logs: q_g <- q_g exp(eta
  L_g), L_g the batch's mean loss of domain g (0 where absent, so an absent
  domain keeps its weight); the domains met so far grow by the present
  ones."""
  return GroupWeights(weights.log_q + eta * losses,
                      jnp.maximum(weights.seen, present))


def normalized_weights(weights: GroupWeights) -> jax.Array:
  """[D]: q_g / sum q over the domains met so far (`seen`), 0 elsewhere."""
  z = jnp.where(weights.seen > 0, weights.log_q, -jnp.inf)
  return jnp.where(weights.seen > 0, jax.nn.softmax(z), 0.0)


def carried(new, old):
  """A term of value 0 whose gradient w.r.t. `old` (a pytree) is
  -(new - old): an SGD step of learning rate 1 on `old` then sets it to
  `new`, so a quantity updated by a rule instead of its gradient rides in
  the trained parameters (`group_dro`'s weights)."""
  step = jax.tree.map(lambda n, o: jax.lax.stop_gradient(n - o), new, old)
  terms = jax.tree.map(
      lambda st, o: -jnp.sum(st * (o - jax.lax.stop_gradient(o))), step, old)
  return sum(jax.tree.leaves(terms))


def group_dro(model, eta, num_domains: int) -> Any:
  """GroupDRO's local objective (Sagawa et al. 2020, the released code's
  `GroupDRO.step`) on params {"model": the model's, "weights": the client's
  `GroupWeights`}: with L_g the batch's mean cross-entropy of domain g
  (`domain_means` of `Batch.d`) and q' = `group_dro_update(weights, L,
  eta)`, the objective is sum_g stop_gradient(q'_g / sum q') L_g over the
  domains met so far, plus `carried(q', weights)` (value 0), so that the
  weights' SGD step of learning rate 1 (`groupdro.build`'s optimizer) makes
  them q'."""

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    logits = model.apply(params["model"], batch.x, train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    losses, present = domain_means(ce, batch.d, batch.mask, num_domains)
    weights = params["weights"]
    new = group_dro_update(weights, jax.lax.stop_gradient(losses), present,
                           eta)
    q = jax.lax.stop_gradient(normalized_weights(new))
    return jnp.sum(q * losses) + carried(new, weights)

  return loss
