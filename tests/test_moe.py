"""Mixture of experts: dense equivalence, capacity, the balancing loss, sharding, training."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_adam_runs_agree, assert_cached_decoding_matches_teacher_forcing
from conftest import quick_jit, scalar_events
from configs import tiny
from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.data import pipeline as data
from t2t_jax.model import moe
from t2t_jax.model.transformer import FeedForward, Transformer, TransformerConfig
from t2t_jax.training import config_check
from t2t_jax.training import train


def _config(**overrides) -> TransformerConfig:
  settings = dict(vocab_size=16, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=1,
                  num_decoder_layers=1, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0,
                  moe_layers='all', deterministic=True)
  return TransformerConfig(**{**settings, **overrides})


def _inputs(batch=3, length=6, width=8, seed=0):
  """Random activations and a validity mask with padding at the end of some rows."""
  x_BLE = jax.random.normal(jax.random.PRNGKey(seed), (batch, length, width))
  lengths = np.array([length, length - 2, 1])[:batch]
  valid_BL = np.arange(length)[None, :] < lengths[:, None]
  return x_BLE, jnp.asarray(valid_BL)


def _run(cfg, x_BLE, valid_BL, params=None):
  """(output, params, sown 'moe' sums, router probabilities) of one MoE layer."""
  layer = moe.MoeFeedForward(cfg)
  if params is None:
    params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x_BLE, valid_BL)['params'])
  y_BLE, sown = _apply(cfg, params, x_BLE, valid_BL)
  return y_BLE, params, moe.metrics(sown[moe.COLLECTION]), sown['intermediates']['router_probs'][0]


@functools.partial(quick_jit, static_argnames='cfg')  # One program, not each operation.
def _apply(cfg, params, x_BLE, valid_BL):
  return moe.MoeFeedForward(cfg).apply({'params': params}, x_BLE, valid_BL,
                                       mutable=[moe.COLLECTION, 'intermediates'])


def _numpy_routing(probs_BLX, valid_BL, top_k, capacity_B):
  """Kept choices {(b, l, expert)} and the dropped count, slot by slot in token order; row b's
  experts take at most capacity_B[b] tokens each."""
  kept, dropped = set(), 0
  for b in range(probs_BLX.shape[0]):
    load, capacity = np.zeros(probs_BLX.shape[-1], int), capacity_B[b]
    for l in range(probs_BLX.shape[1]):
      if not valid_BL[b, l]:
        continue
      for expert in np.argsort(-probs_BLX[b, l])[:top_k]:
        if load[expert] < capacity:
          load[expert] += 1
          kept.add((b, l, int(expert)))
        else:
          dropped += 1
  return kept, dropped


def test_one_expert_top_1_without_a_limit_is_the_dense_feed_forward():
  cfg = _config(moe_experts=1, moe_top_k=1, moe_capacity_factor=0.0)
  x_BLE, _ = _inputs()
  valid_BL = jnp.ones(x_BLE.shape[:2], bool)
  dense = FeedForward(cfg)
  dense_params = nn.meta.unbox(dense.init(jax.random.PRNGKey(2), x_BLE)['params'])
  _, moe_params, _, _ = _run(cfg, x_BLE, valid_BL)
  moe_params = dict(moe_params, wi_kernel=dense_params['wi']['kernel'][None],
                    wi_bias=dense_params['wi']['bias'][None],
                    wo_kernel=dense_params['wo']['kernel'][None],
                    wo_bias=dense_params['wo']['bias'][None])
  cotangent_BLE = jax.random.normal(jax.random.PRNGKey(3), x_BLE.shape)

  def dense_loss(params, x):
    return jnp.sum(dense.apply({'params': params}, x) * cotangent_BLE)

  def moe_loss(params, x):
    return jnp.sum(moe.MoeFeedForward(cfg).apply({'params': params}, x, valid_BL)
                   * cotangent_BLE)

  # Each side one program (its loss, gradients, and output without a mask), where eager calls
  # compile each operation.
  @quick_jit
  def dense_results(params, x):
    return jax.value_and_grad(dense_loss, argnums=(0, 1))(params, x), dense.apply(
        {'params': params}, x)

  @quick_jit
  def moe_results(params, x):
    return jax.value_and_grad(moe_loss, argnums=(0, 1))(params, x), moe.MoeFeedForward(
        cfg).apply({'params': params}, x)

  (dense_value, dense_grads), dense_y = dense_results(dense_params, x_BLE)
  (moe_value, moe_grads), moe_y = moe_results(moe_params, x_BLE)
  np.testing.assert_allclose(moe_value, dense_value, rtol=1e-6)
  np.testing.assert_allclose(moe_y, dense_y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(moe_grads[1], dense_grads[1], rtol=1e-5, atol=1e-6)
  for name in ('wi', 'wo'):
    for kind in ('kernel', 'bias'):
      np.testing.assert_allclose(moe_grads[0][f'{name}_{kind}'][0], dense_grads[0][name][kind],
                                 rtol=1e-5, atol=1e-6)
  assert not np.any(moe_grads[0]['router'])  # A softmax over one expert is constant.


@pytest.mark.parametrize('top_k, capacity_factor', [(1, 0.5), (2, 0.5), (2, 1.0)])
def test_routing_respects_capacity_and_counts_the_dropped_choices(top_k, capacity_factor):
  cfg = _config(moe_top_k=top_k, moe_capacity_factor=capacity_factor)
  x_BLE, valid_BL = _inputs()
  y_BLE, _, sums, probs_BLX = _run(cfg, x_BLE, valid_BL)
  capacity = math.ceil(capacity_factor * 6 * top_k / 4)
  assert moe.expert_capacity(6, 4, top_k, capacity_factor) == capacity
  # A row's limit counts its real tokens (6, 4 and 1), not its width: at least 1 slot.
  capacity_B = [max(1, math.ceil(capacity_factor * n * top_k / 4)) for n in (6, 4, 1)]
  kept, dropped = _numpy_routing(np.asarray(probs_BLX), np.asarray(valid_BL), top_k, capacity_B)
  assert dropped > 0  # The settings are tight enough to drop some.
  assert sums['dropped'] == dropped and sums['routed'] == top_k * int(valid_BL.sum())

  dispatch_BLXC, combine_BLXC, _, _ = moe.route(probs_BLX, valid_BL, top_k, capacity,
                                                jnp.asarray(capacity_B))
  assert np.all(np.asarray(dispatch_BLXC).sum(1) <= 1)  # One token per slot.
  assert np.all(np.asarray(dispatch_BLXC).sum((1, 3)) <= np.asarray(capacity_B)[:, None])
  routed = {tuple(int(i) for i in index) for index in np.argwhere(dispatch_BLXC.sum(-1))}
  assert routed == kept
  # Padding, and tokens whose every choice was dropped, get a zero output.
  left_out = [(b, l) for b in range(3) for l in range(6)
              if not any((b, l, e) in kept for e in range(4))]
  assert left_out and all(not np.any(y_BLE[b, l]) for b, l in left_out)


def test_the_balancing_loss_is_the_switch_formula():
  cfg = _config(moe_top_k=2)
  x_BLE, valid_BL = _inputs(seed=4)
  _, _, sums, probs_BLX = _run(cfg, x_BLE, valid_BL)
  probs = np.asarray(probs_BLX)[np.asarray(valid_BL)]  # [tokens, X], real tokens only.
  top_2 = np.argsort(-probs, axis=-1)[:, :2]
  fraction = np.array([(top_2 == e).sum() for e in range(4)]) / top_2.size
  expected = 4 * np.sum(fraction * probs.mean(0))
  np.testing.assert_allclose(sums['aux_loss'], expected, rtol=1e-6)
  # Perfect balance gives 1: uniform probabilities, every expert chosen equally.
  uniform_BLX = jnp.full((1, 4, 4), 0.25)
  expert_BLK = jnp.array([[[0, 1], [2, 3], [1, 0], [3, 2]]])
  assert moe.load_balancing_loss(uniform_BLX, expert_BLK, jnp.ones((1, 4), bool)) == 1.0


@pytest.mark.parametrize('top_k', [1, 2])
def test_output_is_the_gate_weighted_sum_of_the_chosen_experts(top_k):
  """Top-1 weighs by the router probability; top-2 by the two renormalised to sum to 1."""
  cfg = _config(moe_top_k=top_k, moe_capacity_factor=0.0)
  x_BLE, valid_BL = _inputs(seed=5)
  y_BLE, params, sums, probs_BLX = _run(cfg, x_BLE, valid_BL)
  assert sums['dropped'] == 0
  x, probs = np.asarray(x_BLE, np.float64), np.asarray(probs_BLX, np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  expected = np.zeros_like(x)
  for b, l in zip(*np.nonzero(np.asarray(valid_BL))):
    chosen = np.argsort(-probs[b, l])[:top_k]
    gates = probs[b, l, chosen] / (probs[b, l, chosen].sum() if top_k > 1 else 1.0)
    for gate, e in zip(gates, chosen):
      hidden = np.maximum(x[b, l] @ p['wi_kernel'][e] + p['wi_bias'][e], 0)
      expected[b, l] += gate * (hidden @ p['wo_kernel'][e] + p['wo_bias'][e])
  np.testing.assert_allclose(y_BLE, expected, rtol=1e-5, atol=1e-6)


def test_a_token_keeps_its_slot_whatever_the_later_tokens_are():
  """Slots fill in token order, so capacity does not break a causal decoder."""
  cfg = _config(moe_top_k=2, moe_capacity_factor=0.5)
  x_BLE, _ = _inputs(seed=6)
  valid_BL = jnp.ones(x_BLE.shape[:2], bool)
  y_BLE, params, _, _ = _run(cfg, x_BLE, valid_BL)
  changed_BLE = x_BLE.at[:, 3:].set(jax.random.normal(jax.random.PRNGKey(7), (3, 3, 8)))
  changed_y_BLE, _, _, _ = _run(cfg, changed_BLE, valid_BL, params)
  np.testing.assert_array_equal(changed_y_BLE[:, :3], y_BLE[:, :3])
  assert not np.allclose(changed_y_BLE[:, 3:], y_BLE[:, 3:])


def test_cached_decoding_through_experts_equals_teacher_forcing():
  """Without a capacity limit a token's experts do not depend on the others: same logits."""
  cfg = _config(moe_capacity_factor=0.0, num_decoder_layers=2, max_len=16)
  tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 2, 5), 2, cfg.vocab_size)
  inputs_BS, targets_BL = tokens[0], tokens[1]
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), inputs_BS,
                                               targets_BL)['params'])
  assert_cached_decoding_matches_teacher_forcing(cfg, params, inputs_BS, targets_BL)


def test_layer_choice_and_config_errors():
  assert moe.layer_indices('every_other', 6) == (1, 3, 5)
  assert moe.layer_indices('all', 2) == (0, 1)
  assert moe.layer_indices('0,2', 2) == (0,)  # A shallower stack has no layer 2.
  params = jax.eval_shape(Transformer(_config(num_encoder_layers=2, num_decoder_layers=3,
                                              moe_layers='every_other')).init,
                          jax.random.PRNGKey(0), jnp.ones((1, 2), jnp.int32),
                          jnp.ones((1, 2), jnp.int32))['params']  # Names only: nothing runs.
  assert [name for name in sorted(params) if 'moe' in params[name]] == [
      'decoder_1', 'encoder_1']
  for overrides, message in [
      (dict(moe_top_k=5), 'config.model.moe_top_k=5 must be between 1 and'),
      (dict(moe_layers='odd'), "config.model.moe_layers='odd' must be one of"),
      (dict(moe_layers='0,3'), "config.model.moe_layers='0,3' names a layer outside 0..0"),
      (dict(scan_layers=True, moe_layers='every_other'), 'needs config.model.moe_layers'),
  ]:
    with pytest.raises(ConfigError, match=message):
      moe.check(_config(**overrides))
  config = tiny.get_config('moe')
  config_check.check(config)
  config.model.moe_top_k = 0
  with pytest.raises(ConfigError, match='config.model.moe_top_k=0 is outside'):
    config_check.check(config)


@pytest.mark.slow
def test_experts_off_is_the_dense_model(tiny_config):
  """moe_experts=0: no expert weights, no MoE metrics, and the other MoE keys change nothing."""
  setup = train.build(tiny_config, data.vocab_size(tiny_config))
  batch = sharding.global_batch(_batches(tiny_config, 1)[0], setup.mesh)
  state = setup.init(jax.random.PRNGKey(0))
  assert 'moe' not in str(jax.tree_util.tree_structure(state.params))
  _, metrics = setup.train_step(state, batch, jax.random.PRNGKey(1))
  assert set(metrics) == {'loss', 'nll', 'correct', 'weight'}
  tiny_config.model.moe_top_k, tiny_config.model.moe_layers = 1, 'all'
  tiny_config.model.moe_aux_loss_weight = 1.0
  other = train.build(tiny_config, data.vocab_size(tiny_config))
  _, other_metrics = other.train_step(other.init(jax.random.PRNGKey(0)), batch,
                                      jax.random.PRNGKey(1))
  assert other_metrics['loss'] == metrics['loss']


def _batches(config, count, rows=16):
  task = data.load(config, '')
  batches = data.TokenBudgetBatches(task.train, rows * 16, [16], rows, shuffle=True, seed=0)
  return [batches[i] for i in range(count)]


def _trajectory(config, batches, mesh):
  """Per-step (loss, aux loss, dropped), the final state, and (params, opt_state) on the host
  after each step of training on `mesh`."""
  setup = train.build(config, data.vocab_size(config), mesh)
  state = setup.init(jax.random.PRNGKey(0))
  figures, history = [], []
  for batch in batches:
    state, metrics = setup.train_step(state, sharding.global_batch(batch, mesh),
                                      jax.random.PRNGKey(1))
    weight = float(metrics['weight'])
    figures.append((float(metrics['loss']) / weight, float(metrics['moe_aux_loss']) / weight,
                    float(metrics['moe_dropped'])))
    history.append(jax.device_get((state.params, state.opt_state)))
  return np.array(figures), state, history


@pytest.mark.slow
def test_experts_sharded_over_the_expert_axis_train_as_on_one_device():
  config = tiny.get_config('moe')
  config.model.dropout = config.model.attention_dropout = config.model.relu_dropout = 0.0
  config.model.moe_capacity_factor = 0.75  # Some choices dropped: the counts must agree too.
  config.model.moe_aux_loss_weight = 0.1
  config.opt.schedule, config.opt.lr_scale = 'constant', 3e-3
  batches = _batches(config, 3)
  config.mesh.shape = (1, 1, 1)
  single, _, single_history = _trajectory(config, batches,
                                          sharding.make_mesh(config.mesh, jax.devices()[:1]))
  config.mesh.shape = (2, 1, 1, 4)
  mesh = sharding.make_mesh(config.mesh)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 1, 'tensor': 1, 'expert': 4}
  sharded, sharded_state, sharded_history = _trajectory(config, batches, mesh)
  assert single[:, 2].sum() > 0  # Dropping happened and is counted alike.
  np.testing.assert_array_equal(sharded[:, 2], single[:, 2])
  np.testing.assert_allclose(sharded[:, :2], single[:, :2], rtol=2e-5)
  assert single[-1, 0] < single[0, 0]  # It trains, so the comparison means something.
  expert_kernel = sharded_state.params['decoder_0']['moe']['wi_kernel']
  assert expert_kernel.sharding.spec[0] == 'expert'
  assert {shard.data.shape for shard in expert_kernel.addressable_shards} == {(1, 32, 64)}
  # First-step gradients tightly, the weights after 3 Adam steps within what rounding noise
  # can move them (the derivation above GRADIENT_NOISE in conftest.py).
  assert_adam_runs_agree(sharded_history, single_history, [3e-3] * len(batches))


@pytest.mark.slow
@pytest.mark.parametrize('scan_layers, loss_chunk_tokens', [(False, 0), (True, 64)])
def test_a_tiny_moe_run_trains_end_to_end_and_logs_the_balance(tmp_path, scan_layers,
                                                               loss_chunk_tokens):
  config = tiny.get_config('moe')
  config.model.scan_layers = scan_layers
  config.opt.loss_chunk_tokens = loss_chunk_tokens
  config.train.num_steps = config.train.eval_every = 6
  config.train.log_every = 3
  config.ckpt.every = 0
  config.eval.bleu_sentences = 4
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 6 and np.isfinite(results['eval_loss'])
  assert np.isfinite(results['bleu'])  # Decoding through the experts works.
  assert 0.0 < results['eval_moe_aux_loss'] <= 4.0  # At most the number of experts.
  events = scalar_events(tmp_path)
  assert set(events['train/moe_aux_loss']) == {3, 6}
  assert all(0.0 <= value < 1.0 for value in events['train/moe_dropped_fraction'].values())


def _largest_intermediate(cfg, length, params):
  """Elements of the largest array the layer's forward pass makes, for rows of `length`."""
  x_BLE, valid_BL = _inputs(batch=2, length=length)
  layer = moe.MoeFeedForward(cfg)
  jaxpr = jax.make_jaxpr(lambda x, v: layer.apply({'params': params}, x, v,
                                                  mutable=[moe.COLLECTION, 'intermediates']))(
                                                      x_BLE, valid_BL)
  return max(math.prod(var.aval.shape) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars)


def test_routing_groups_of_a_row_length_are_the_rows_and_smaller_ones_route_alone():
  x_BLE, valid_BL = _inputs(batch=3, length=8)
  rows, params, _, _ = _run(_config(), x_BLE, valid_BL)
  whole, _, _, _ = _run(_config(moe_group_size=8), x_BLE, valid_BL, params)
  np.testing.assert_array_equal(whole, rows)
  # Groups of 4: the same as routing each half row as a row of its own.
  grouped, _, _, _ = _run(_config(moe_group_size=4), x_BLE, valid_BL, params)
  halves, _, _, _ = _run(_config(), x_BLE.reshape(6, 4, 8), valid_BL.reshape(6, 4), params)
  np.testing.assert_allclose(grouped, halves.reshape(3, 8, 8), atol=1e-6)
  assert not np.allclose(grouped, rows, atol=1e-4)  # Capacity per group drops other tokens.
  # A length that is no multiple of the group: the last group is filled with padding.
  odd, _, _, _ = _run(_config(moe_group_size=3), x_BLE, valid_BL, params)
  assert odd.shape == x_BLE.shape and np.all(np.isfinite(odd))


def test_routing_groups_make_the_dispatch_memory_linear_in_length():
  _, params, _, _ = _run(_config(), *_inputs(batch=2, length=8))
  rows = [_largest_intermediate(_config(), length, params) for length in (64, 256)]
  groups = [_largest_intermediate(_config(moe_group_size=16), length, params)
            for length in (64, 256)]
  assert rows[1] / rows[0] == pytest.approx(16, rel=0.05)  # [B, L, P, X, A], A ∝ L.
  assert groups[1] / groups[0] == pytest.approx(4, rel=0.05)  # [B L / g, g, P, X, A].
