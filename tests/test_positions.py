"""Position encodings: the predictive formula, learned and absent positions, relative attention
(shift invariance, clipping, cached decoding), and the checks of their keys."""

import dataclasses
import functools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import assert_cached_decoding_matches_teacher_forcing
from t2t_jax import ConfigError
from t2t_jax.model import attention_variants
from t2t_jax.model import positions
from t2t_jax.model import transformer as model_lib

VOCAB = 13
CONFIG = model_lib.TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
    num_decoder_layers=2, max_len=32, deterministic=True)


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(2, VOCAB, shape), jnp.int32)


# The 'rbg' generator draws the parameters: the same initialisers, but each shape's draw
# compiles in milliseconds, threefry's in seconds.
KEY = jax.random.key(0, impl='rbg')


@functools.cache
def _init(config):
  """The parameters, once per config for the module."""
  if config.scan_layers:  # The unrolled layers' stacked, as test_model.py: initialising
    # scanned layers eagerly compiles each stack's scan.
    return model_lib.stack_layer_params(_init(dataclasses.replace(config, scan_layers=False)),
                                        config)
  tokens = jnp.ones((1, 4), jnp.int32)
  return nn.meta.unbox(model_lib.Transformer(config).init(KEY, tokens, tokens)['params'])


def test_predictive_positions_follow_the_lecture_formula():
  table = positions.predictive_positions(40, 10)
  for x in (0, 1, 5, 39):
    for i in range(5):
      rate = ((2 * i + 1) / 10) ** (1 / (1 - 0.883))
      assert table[x, 2 * i] == pytest.approx(math.sin(x * rate), abs=1e-6)
      assert table[x, 2 * i + 1] == pytest.approx(math.cos(x * rate), abs=1e-6)


def test_odd_width_tables_hold_the_formula_in_every_column():
  """At width 5 the pairs are (0, 1) and (2, 3), and column 4 is the sine of a third pair whose
  cosine does not fit; each rate still uses the table's own width, 5."""
  sinusoid, predictive = positions.sinusoidal_positions(7, 5), positions.predictive_positions(7, 5)
  assert sinusoid.shape == predictive.shape == (7, 5)
  for x in range(7):
    for column in range(5):
      i = column // 2
      turn = math.sin if column % 2 == 0 else math.cos
      assert sinusoid[x, column] == pytest.approx(turn(x / 10000 ** (2 * i / 5)), abs=1e-6)
      rate = ((2 * i + 1) / 5) ** (1 / (1 - 0.883))
      assert predictive[x, column] == pytest.approx(turn(x * rate), abs=1e-6)


def test_learned_positions_are_a_trained_table_with_logical_axes():
  config = dataclasses.replace(CONFIG, positions='learned')
  tokens = jnp.ones((1, 4), jnp.int32)
  boxed = model_lib.Transformer(config).init(KEY, tokens, tokens)['params']
  table = boxed['target_embedder']['position_embedding']
  assert table.names == ('length', 'embed') and table.value.shape == (32, 16)
  params = nn.meta.unbox(boxed)
  inputs, targets = _tokens(0, (1, 5)), _tokens(1, (1, 6))

  def loss(params):
    return model_lib.Transformer(config).apply({'params': params}, inputs, targets).sum()

  grads = jax.jit(jax.grad(loss))(params)  # One compile, not one per operation.
  # Rows of the positions used get gradients; the rows beyond them get none.
  rows = np.abs(np.asarray(grads['target_embedder']['position_embedding'])).sum(-1)
  assert np.all(rows[:6] > 0) and np.all(rows[6:] == 0)


def test_without_positions_the_source_order_does_not_matter():
  # No positions and full attention: the encoder is permutation-equivariant and the
  # cross-attention sums over its keys, so a shuffled source gives the same logits.
  config = dataclasses.replace(CONFIG, positions='none')
  params = _init(config)
  model = model_lib.Transformer(config)
  inputs, targets = _tokens(2, (2, 7)), _tokens(3, (2, 5))
  permuted = inputs[:, np.random.default_rng(0).permutation(7)]
  np.testing.assert_allclose(model.apply({'params': params}, permuted, targets),
                             model.apply({'params': params}, inputs, targets), atol=1e-5)
  sinusoidal = model_lib.Transformer(CONFIG)
  assert not np.allclose(sinusoidal.apply({'params': params}, permuted, targets),
                         sinusoidal.apply({'params': params}, inputs, targets), atol=1e-3)


def _packed_apply(config, params, offset):
  """Logits and sown attention weights of a packed batch whose positions start at `offset`."""
  inputs, targets = _tokens(4, (2, 8)), _tokens(5, (2, 7))
  segments_in = jnp.asarray([[1] * 3 + [2] * 5] * 2)
  segments_out = jnp.asarray([[1] * 4 + [2] * 3] * 2)
  positions_in = jnp.asarray([list(range(3)) + list(range(5))] * 2) + offset
  positions_out = jnp.asarray([list(range(4)) + list(range(3))] * 2) + offset
  return model_lib.Transformer(config).apply(
      {'params': params}, inputs, targets, positions_in, positions_out, segments_in,
      segments_out, mutable=['intermediates'])


@pytest.mark.parametrize('pattern', ['full', pytest.param('local', marks=pytest.mark.slow)])
def test_relative_attention_ignores_a_shift_of_every_position(pattern):
  config = dataclasses.replace(CONFIG, positions='relative', attention_pattern=pattern,
                               local_half_width=3, max_relative_distance=2)
  params = _init(config)
  logits, state = _packed_apply(config, params, 0)
  shifted_logits, shifted_state = _packed_apply(config, params, 9)
  np.testing.assert_allclose(shifted_logits, logits, atol=1e-5)
  if pattern == 'full':  # The self-attention weights themselves are unchanged.
    for layer in ('encoder_0', 'decoder_1'):
      weights = state['intermediates'][layer]['self_attention']['attention_weights'][0]
      shifted = shifted_state['intermediates'][layer]['self_attention']['attention_weights'][0]
      np.testing.assert_allclose(shifted, weights, atol=1e-6)
  # Absolute positions do see the shift, so the test can tell.
  absolute = dataclasses.replace(CONFIG, positions='sinusoidal')
  absolute_params = _init(absolute)
  assert not np.allclose(_packed_apply(absolute, absolute_params, 9)[0],
                         _packed_apply(absolute, absolute_params, 0)[0], atol=1e-3)


def test_relative_embeddings_are_clipped_at_the_maximum_distance():
  config = dataclasses.replace(CONFIG, positions='relative', max_relative_distance=2,
                               num_encoder_layers=1, num_decoder_layers=1)
  params = _init(config)
  attention = params['encoder_0']['self_attention']
  assert attention['relative_key'].shape == (5, 8)
  inputs, targets = _tokens(6, (1, 9)), _tokens(7, (1, 3))

  def loss(attention):
    variables = {'params': {**params, 'encoder_0': {**params['encoder_0'],
                                                    'self_attention': attention}}}
    return model_lib.Transformer(config).apply(variables, inputs, targets).sum()

  grads = jax.jit(jax.grad(loss))(attention)
  # Distances of 3..8 all land on the end rows (+-2); every row is used.
  for name in ('relative_key', 'relative_value'):
    assert np.all(np.abs(np.asarray(grads[name])).sum(-1) > 0)
  buckets = np.asarray(attention_variants.relative_buckets(jnp.arange(9), jnp.arange(9), 2,
                                                          jnp.float32))
  expected = np.clip(np.arange(9)[None, :] - np.arange(9)[:, None], -2, 2) + 2  # key - query
  np.testing.assert_array_equal(buckets.argmax(-1), expected)
  assert np.all(buckets.sum(-1) == 1)


@pytest.mark.parametrize('scan_layers', [False, True])
def test_relative_cached_decoding_matches_teacher_forcing(scan_layers):
  config = dataclasses.replace(CONFIG, positions='relative', max_relative_distance=3,
                               scan_layers=scan_layers, norm='pre')
  params = _init(config)
  inputs, targets = _tokens(8, (2, 5)), _tokens(9, (2, 7))
  assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets)


def _model_config(**changes):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config().model
  config.attention_dropout = 0.0
  for key, value in changes.items():
    config[key] = value
  return config


@pytest.mark.parametrize('changes, message', [
    ({'positions': 'rotary_v2'}, "config.model.positions='rotary_v2' must be one of"),
    ({'positions': 'rotary', 'attention_pattern': 'local,compressed'},
     "positions='rotary' cannot be used with config.model.attention_pattern"),
    ({'positions': 'alibi', 'attention_pattern': 'compressed'},
     "positions='alibi' cannot be used with config.model.attention_pattern"),
    ({'positions': 'alibi', 'attention_impl': 'xla'}, "cannot add ALiBi's bias"),
    ({'positions': 'rotary', 'd_model': 30, 'num_heads': 2}, 'is odd'),
    ({'attention_pattern': 'full,sparse'}, "config.model.attention_pattern='full,sparse' "
                                           r"names \['sparse'\]"),
    ({'local_half_width': 0}, 'config.model.local_half_width=0 must be at least 1'),
    ({'compression_stride': 0}, 'config.model.compression_stride=0 must be at least 1'),
    ({'max_relative_distance': 0}, 'config.model.max_relative_distance=0 must be at least 1'),
    ({'positions': 'relative', 'attention_impl': 'xla'},
     "attention_impl='xla' .*cannot add relative positions"),
    ({'attention_pattern': 'local', 'attention_impl': 'xla'}, "runs 'full' attention only"),
    ({'positions': 'relative', 'attention_pattern': 'local,compressed'},
     "positions='relative' cannot be used with config.model.attention_pattern"),
    ({'attention_pattern': 'local,compressed', 'scan_layers': True},
     'scan_layers=True .* mixes them'),
    ({'kind': 'decoder_only', 'prefix_attention': 'full', 'attention_pattern': 'full,local'},
     "prefix_attention='full' .* needs 'full' layers.*attention_pattern='full,local'"),
])
def test_family_keys_that_cannot_run_are_config_errors(changes, message):
  with pytest.raises(ConfigError, match=message):
    model_lib.TransformerConfig.from_config(_model_config(**changes), VOCAB)


def test_config_check_names_an_unknown_position_kind(tiny_config):
  from t2t_jax.training import config_check  # pylint: disable=g-import-not-at-top
  tiny_config.model.positions = 'absolute'
  tiny_config.model.local_half_width = 0
  with pytest.raises(ConfigError) as error:
    config_check.check(tiny_config, mesh=False)
  assert "config.model.positions='absolute' must be one of" in str(error.value)
  assert 'config.model.local_half_width=0 is outside the allowed range' in str(error.value)


def test_a_config_saved_before_the_keys_existed_means_the_paper_model():
  config = _model_config()
  legacy = ml_collections.ConfigDict({key: value for key, value in config.items()
                                      if key not in ('positions', 'max_relative_distance',
                                                     'attention_pattern', 'local_half_width',
                                                     'compression_stride')})
  built = model_lib.TransformerConfig.from_config(legacy, VOCAB)
  assert (built.positions, built.attention_pattern) == ('sinusoidal', 'full')


def test_a_config_saved_with_the_old_local_window_key_loads_under_the_new_name(tmp_path):
  from t2t_jax.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  from t2t_jax.deploy import trained_run  # pylint: disable=g-import-not-at-top
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.model.local_half_width = 5
  saved = json.loads(config.to_json_best_effort())
  saved['model']['local_window'] = saved['model'].pop('local_half_width')
  legacy = ml_collections.ConfigDict(saved['model'])
  assert model_lib.TransformerConfig.from_config(legacy, VOCAB).local_half_width == 5
  assert checkpoint.config_differences(json.dumps(saved), config) == {}
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert trained_run.load_config(str(tmp_path)).model.local_half_width == 5
  config.model.local_half_width = 6  # A real change is still reported, under the new name.
  assert checkpoint.config_differences(json.dumps(saved), config) == {
      'model.local_half_width': (5, 6)}


def test_rotary_turns_interleaved_pairs_by_position_times_the_base_frequencies():
  x = np.random.default_rng(0).normal(size=(1, 3, 2, 8)).astype(np.float32)
  positions_BL = np.array([[0, 1, 7]])
  turned = np.asarray(positions.rotary(jnp.asarray(x), jnp.asarray(positions_BL)))
  for l, p in enumerate(positions_BL[0]):
    for i in range(4):  # Pair (2i, 2i+1) turns by p * 10000^(-2i/8).
      angle = p * 10000.0 ** (-2 * i / 8)
      a, b = x[0, l, :, 2 * i], x[0, l, :, 2 * i + 1]
      np.testing.assert_allclose(turned[0, l, :, 2 * i],
                                 a * math.cos(angle) - b * math.sin(angle), atol=1e-5)
      np.testing.assert_allclose(turned[0, l, :, 2 * i + 1],
                                 a * math.sin(angle) + b * math.cos(angle), atol=1e-5)


@pytest.mark.parametrize('pattern', ['full', pytest.param('local', marks=pytest.mark.slow)])
def test_rotary_and_alibi_scores_depend_only_on_the_offset(pattern):
  for kind in ('rotary', 'alibi'):
    config = dataclasses.replace(CONFIG, positions=kind, attention_pattern=pattern,
                                 local_half_width=3)
    params = _init(config)
    assert 'position_embedding' not in str(jax.tree_util.tree_structure(params))
    logits, state = _packed_apply(config, params, 0)
    shifted_logits, shifted_state = _packed_apply(config, params, 9)
    np.testing.assert_allclose(shifted_logits, logits, atol=1e-4)
    if pattern == 'full':  # The self-attention weights themselves are unchanged.
      for layer in ('encoder_0', 'decoder_1'):
        weights = state['intermediates'][layer]['self_attention']['attention_weights'][0]
        shifted = shifted_state['intermediates'][layer]['self_attention']['attention_weights'][0]
        np.testing.assert_allclose(shifted, weights, atol=1e-5)
    # The positions do matter: the same rows with every position at 0 differ.
    flat = dataclasses.replace(config)
    inputs, targets = _tokens(4, (2, 8)), _tokens(5, (2, 7))
    zeros_in, zeros_out = jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 7), jnp.int32)
    positional = model_lib.Transformer(flat).apply({'params': params}, inputs, targets)
    unplaced = model_lib.Transformer(flat).apply({'params': params}, inputs, targets, zeros_in,
                                                 zeros_out)
    assert not np.allclose(positional, unplaced, atol=1e-3)


def _published_alibi_slopes(heads):
  """Press et al.'s recipe, written out: 2^(-8/n) to the powers 1..n for n a power of two; else
  the closest lower power of two's slopes and every other slope of twice that count."""
  if heads & (heads - 1) == 0:
    start = 2 ** (-8 / heads)
    return [start ** h for h in range(1, heads + 1)]
  lower = 1
  while lower * 2 < heads:
    lower *= 2
  return _published_alibi_slopes(lower) + _published_alibi_slopes(2 * lower)[::2][:heads - lower]


def test_alibi_slopes_and_biases_follow_the_paper():
  np.testing.assert_allclose(positions.alibi_slopes(8), [2.0 ** -h for h in range(1, 9)])
  for heads in (6, 12):
    np.testing.assert_allclose(positions.alibi_slopes(heads), _published_alibi_slopes(heads),
                               rtol=1e-6)
  np.testing.assert_allclose(positions.alibi_slopes(6),
                             [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])
  query, key = jnp.asarray([[0, 3, 5]]), jnp.asarray([[0, 1, 2, 3, 4, 5]])
  bias = np.asarray(positions.alibi_bias(query, key, positions.alibi_slopes(8)))
  assert bias.shape == (1, 8, 3, 6)
  for h in range(8):
    for i, qp in enumerate([0, 3, 5]):
      for j in range(6):
        assert bias[0, h, i, j] == pytest.approx(-(2.0 ** -(h + 1)) * abs(qp - j))


# Each stack's two layers are one full and one local layer: each kind of layer with each kind
# of position in one model.
@pytest.mark.parametrize('kind', ['rotary', 'alibi'])
def test_rotary_and_alibi_cached_decoding_matches_teacher_forcing(kind):
  config = dataclasses.replace(CONFIG, positions=kind, attention_pattern='full,local',
                               local_half_width=2)
  params = _init(config)
  inputs, targets = _tokens(8, (2, 5)), _tokens(9, (2, 7))
  assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets)


def test_the_default_model_is_the_papers_sinusoidal_one():
  # The fixture the code before these changes wrote (tests/test_compat.py) still gives its
  # logits; here: the default adds the sinusoid table and has no position parameters.
  assert CONFIG.positions == 'sinusoidal'
  params = _init(CONFIG)
  assert 'position' not in str(jax.tree_util.tree_structure(params))
  tokens = _tokens(10, (1, 6))
  embedded = model_lib.Transformer(CONFIG).apply(
      {'params': params}, tokens, method=lambda m, t: m.source_embedder(t))
  table = positions.sinusoidal_positions(CONFIG.max_len, CONFIG.d_model)[:6]
  expected = np.asarray(params['embedding']['embedding'])[np.asarray(tokens[0])] * 4.0 + table
  np.testing.assert_allclose(embedded[0], expected, atol=1e-6)
