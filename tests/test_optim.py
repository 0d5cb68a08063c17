"""Loss, schedules and the optimiser (clipping, decay, Adam) against independent computations."""

import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import adam_moments
from t2t_jax.training import optim


def _opt_config(**overrides):
  config = ml_collections.ConfigDict(dict(
      schedule='rsqrt', lr_scale=1.0, warmup_steps=4000, b1=0.9, b2=0.98, eps=1e-9,
      grad_clip=0.0, weight_decay=0.0, label_smoothing=0.1, cooldown_steps=0,
      final_lr_fraction=0.0))
  config.update(overrides)
  return config


@pytest.mark.parametrize('step', [1, 10, 3999, 4000, 4001, 100_000])
def test_paper_schedule(step):
  schedule = optim.learning_rate_schedule(_opt_config(), d_model=512)
  expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
  assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize('step', [1, 500, 8000, 20_000])
def test_tensor2tensor_schedule(step):
  schedule = optim.learning_rate_schedule(
      _opt_config(schedule='t2t', lr_scale=2.0, warmup_steps=8000), d_model=512)
  expected = 2.0 * min(1.0, step / 8000) / math.sqrt(max(step, 8000)) / math.sqrt(512)
  assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-5)


def test_unknown_schedule_is_refused():
  with pytest.raises(ValueError, match="config.opt.schedule must be"):
    optim.learning_rate_schedule(_opt_config(schedule='noam'), 512)


def _budget_rates(step, num_steps, warmup, final, shape, peak):
  """The rate of update `step` (1-based), written out case by case from the definitions."""
  if step < warmup:
    return peak * step / warmup
  fraction_done = (step - warmup) / (num_steps + 1 - warmup)
  if shape == 'linear':
    remaining = 1 - fraction_done
  else:
    remaining = (1 + math.cos(math.pi * fraction_done)) / 2
  return peak * (final + (1 - final) * remaining)


@pytest.mark.parametrize('shape', ['linear', 'cosine'])
@pytest.mark.parametrize('final', [0.0, 0.1])
def test_budget_schedules_against_formula(shape, final):
  num_steps, warmup, scale, d_model = 1000, 100, 2.0, 128
  schedule = optim.learning_rate_schedule(
      _opt_config(schedule=shape, lr_scale=scale, warmup_steps=warmup, final_lr_fraction=final),
      d_model, num_steps)
  peak = scale / math.sqrt(d_model * warmup)
  for step in [1, 50, 99, 100, 101, 400, 550, 999, 1000]:
    assert float(schedule(step - 1)) == pytest.approx(
        _budget_rates(step, num_steps, warmup, final, shape, peak), rel=1e-4,
        abs=1e-6 * peak), step  # float32 rounding near the end of the decay
  # The peak equals the paper schedule's at the end of the warmup, so lr_scale means the same.
  rsqrt = optim.learning_rate_schedule(_opt_config(lr_scale=scale, warmup_steps=warmup), d_model)
  assert float(schedule(warmup - 1)) == pytest.approx(float(rsqrt(warmup - 1)), rel=1e-6)
  # Every update moves the weights, and the rate never rises after the warmup.
  rates = np.asarray([float(schedule(t)) for t in range(num_steps)])
  assert rates[-1] > 0
  assert np.all(np.diff(rates[warmup - 1:]) <= 1e-12)
  if shape == 'cosine':  # Half-way through the decay the cosine is at the middle of its range.
    middle = warmup + (num_steps + 1 - warmup) / 2
    assert float(schedule(middle - 1)) == pytest.approx(peak * (1 + final) / 2, rel=1e-5)


@pytest.mark.parametrize('name', ['rsqrt', 't2t', 'constant', 'linear'])
def test_cooldown_ramps_the_last_updates_to_zero(name):
  num_steps, cooldown = 600, 200
  plain = optim.learning_rate_schedule(_opt_config(schedule=name, warmup_steps=100), 256,
                                       num_steps)
  cooled = optim.learning_rate_schedule(
      _opt_config(schedule=name, warmup_steps=100, cooldown_steps=cooldown), 256, num_steps)
  for step in [1, 100, 400, 401, 500, 599, 600]:  # 1-based updates; cooldown from 401 on.
    factor = min(1.0, (num_steps + 1 - step) / cooldown)
    assert float(cooled(step - 1)) == pytest.approx(float(plain(step - 1)) * factor,
                                                    rel=1e-5), step
  assert float(cooled(num_steps - 1)) == pytest.approx(float(plain(num_steps - 1)) / cooldown,
                                                       rel=1e-5)


@pytest.mark.parametrize('overrides, num_steps, message', [
    (dict(schedule='linear', warmup_steps=1000), 1000, 'warmup_steps=1000 must be below'),
    (dict(schedule='cosine', warmup_steps=2000), 1000, 'warmup_steps=2000 must be below'),
    (dict(cooldown_steps=1001), 1000, 'cooldown_steps=1001 must not exceed'),
])
def test_budget_schedule_errors_name_the_keys(overrides, num_steps, message):
  with pytest.raises(ValueError, match=message):
    optim.learning_rate_schedule(_opt_config(**overrides), 512, num_steps)


def _numpy_smoothed_loss(logits, targets, smoothing):
  vocab = logits.shape[-1]
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  soft = np.full(logits.shape, smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1 - smoothing, -1)
  entropy = -np.sum(soft[0, 0] * np.log(soft[0, 0]))
  return (-(soft * log_probs).sum(-1) - entropy) * (targets != 0)


def test_smoothed_loss_equals_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11))
  targets = rng.integers(0, 11, (3, 5))
  targets[0, 3:] = 0  # Padding contributes nothing.
  loss, weights = optim.smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), 0.1)
  np.testing.assert_allclose(loss, _numpy_smoothed_loss(logits, targets, 0.1), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(weights, targets != 0)


def test_perfect_smoothed_prediction_scores_zero():
  vocab, smoothing = 7, 0.1
  targets = np.array([[3, 5]])
  soft = np.full((1, 2, vocab), smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1 - smoothing, -1)
  loss, _ = optim.smoothed_cross_entropy(jnp.log(jnp.asarray(soft)), jnp.asarray(targets),
                                         smoothing)
  np.testing.assert_allclose(loss, 0.0, atol=1e-6)


def test_metrics_count_real_tokens_only():
  logits = np.full((1, 4, 5), -10.0)
  for position, token in enumerate([2, 3, 4, 1]):
    logits[0, position, token] = 10.0
  targets = np.array([[2, 3, 1, 0]])  # Third prediction wrong, fourth position padding.
  sums = optim.compute_metrics(jnp.asarray(logits), jnp.asarray(targets), 0.0)
  summary = optim.summarize(sums)
  assert float(sums['weight']) == 3
  assert summary['accuracy'] == pytest.approx(2 / 3)
  assert summary['perplexity'] == pytest.approx(math.exp(float(sums['nll']) / 3))


def _paper_rate(step, d_model=512, warmup=4000):
  return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize('scale', [0.3, 7.0])  # Global norm below and above the clip.
def test_gradients_are_clipped_to_the_global_norm_before_adam(scale):
  rng = np.random.default_rng(0)
  grads = {'w': rng.normal(size=(3, 4)), 'b': rng.normal(size=(5,))}
  norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
  grads = {k: g * scale / norm for k, g in grads.items()}  # Global norm exactly `scale`.
  clip, b1, b2 = 1.0, 0.9, 0.98
  optimizer = optim.make_optimizer(_opt_config(grad_clip=clip), 512)
  params = {k: jnp.zeros(g.shape) for k, g in grads.items()}
  _, state = optimizer.update({k: jnp.asarray(g, jnp.float32) for k, g in grads.items()},
                              optimizer.init(params), params)
  mu, nu = adam_moments(state)
  factor = min(1.0, clip / scale)
  seen = {k: np.asarray(m) / (1 - b1) for k, m in mu.items()}  # Adam's first moment: (1-b1) g.
  for k, g in grads.items():
    np.testing.assert_allclose(seen[k], g * factor, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(nu[k]) / (1 - b2), (g * factor)**2, rtol=1e-5,
                               atol=1e-9)
  clipped_norm = np.sqrt(sum((v**2).sum() for v in seen.values()))
  assert clipped_norm == pytest.approx(min(scale, clip), rel=1e-5)


def test_weight_decay_is_decoupled_lr_times_decay_times_param():
  """With a zero gradient Adam's own step is 0, so the update is the decay term alone:
  -lr * weight_decay * param (AdamW), not scaled by Adam's normalisation."""
  params = {'w': jnp.asarray([0.5, -2.0, 3.0]), 'b': jnp.asarray([1e-3])}
  optimizer = optim.make_optimizer(_opt_config(weight_decay=0.1), 512)
  updates, _ = optimizer.update(_zeros_like(params), optimizer.init(params), params)
  for k, p in params.items():
    np.testing.assert_allclose(updates[k], -_paper_rate(1) * 0.1 * np.asarray(p), rtol=1e-6)
  plain = optim.make_optimizer(_opt_config(weight_decay=0.0), 512)
  updates, _ = plain.update(_zeros_like(params), plain.init(params), params)
  assert all(not np.any(np.asarray(u)) for u in updates.values())


def _zeros_like(tree):
  return {k: jnp.zeros_like(v) for k, v in tree.items()}


def _numpy_adamw(params, grads_per_step, clip, wd, b1=0.9, b2=0.98, eps=1e-9):
  """Adam with decoupled decay after global-norm clipping, in float64, from the papers."""
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(p) for k, p in params.items()}
  for t, grads in enumerate(grads_per_step, start=1):
    norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
    factor = min(1.0, clip / norm) if clip else 1.0
    for k, g in grads.items():
      g = g * factor
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
      params[k] = params[k] - _paper_rate(t, warmup=1) * (m_hat / (np.sqrt(v_hat) + eps) + wd * params[k])
  return params


@pytest.mark.parametrize('clip, wd', [(0.0, 0.0), (1.0, 0.0), (0.5, 0.1)])
def test_three_updates_equal_a_hand_written_numpy_adam(clip, wd):
  rng = np.random.default_rng(1)
  params = {'w': rng.normal(size=(4, 3)), 'b': rng.normal(size=(3,))}
  # Gradients of growing norm, with signs that change between steps: the moments matter.
  grads_per_step = [{k: rng.normal(size=p.shape) * scale for k, p in params.items()}
                    for scale in (0.1, 1.0, 3.0)]
  expected = _numpy_adamw(params, grads_per_step, clip, wd)
  # warmup 1: rates 512^-0.5 * t^-0.5, large enough that float32 rounding of the weights
  # (1e-7 relative) is far below the motion compared.
  optimizer = optim.make_optimizer(
      _opt_config(grad_clip=clip, weight_decay=wd, warmup_steps=1), 512)
  current = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  state = optimizer.init(current)
  for grads in grads_per_step:
    updates, state = optimizer.update({k: jnp.asarray(g, jnp.float32) for k, g in grads.items()},
                                      state, current)
    current = optax.apply_updates(current, updates)
  for k in params:
    moved = expected[k] - params[k]  # About 3 lr per weight: compare the motion, not the sum.
    np.testing.assert_allclose(np.asarray(current[k]) - params[k], moved, rtol=2e-5,
                               atol=1e-6)
