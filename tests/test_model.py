"""Model properties: positions, causality, padding and packing invariance, cache, sizes,
scanned and rematerialised layers."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_cached_decoding_matches_teacher_forcing, quick_jit
from t2t_jax.model import model_config
from t2t_jax.model import positions
from t2t_jax.model import prng
from t2t_jax.model import transformer as model_lib

VOCAB = 13
CONFIG = model_lib.TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
    num_decoder_layers=2, max_len=32, deterministic=True)


def _init(config=CONFIG):
  tokens = jnp.ones((1, 4), jnp.int32)
  return model_lib.Transformer(config).init(jax.random.PRNGKey(0), tokens, tokens)['params']


def _shapes(config):
  """The parameters `_init` makes, as shapes (and logical names): nothing compiled, where
  initialising scanned layers eagerly compiles each stack's scan."""
  return jax.eval_shape(lambda: _init(config))


def _random_tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(2, VOCAB, shape), jnp.int32)


def test_positions_follow_the_paper_formula():
  table = positions.sinusoidal_positions(50, 16)
  for pos in (0, 1, 7, 49):
    for i in range(8):
      angle = pos / 10000 ** (2 * i / 16)
      assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
      assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize('norm', [pytest.param('post', marks=pytest.mark.slow), 'pre'])
def test_decoder_is_causal_through_gradients(norm):
  config = dataclasses.replace(CONFIG, norm=norm)
  model = model_lib.Transformer(config)
  params = _init(config)
  inputs, targets = _random_tokens(0, (1, 5)), _random_tokens(1, (1, 6))
  perturbations = model.init(jax.random.PRNGKey(0), inputs, targets)['perturbations']
  t = 3

  def output_at_t(perturbations):
    logits = model.apply({'params': params, 'perturbations': perturbations}, inputs, targets)
    return logits[0, t].sum()

  grads = quick_jit(jax.grad(output_at_t))(perturbations)['target_embedder']['embedded'][0]
  per_position = np.abs(np.asarray(grads)).sum(-1)
  # Decoder input p is target p - 1: output t may see targets 0..t-1 only.
  assert np.all(per_position[t + 1:] == 0.0)
  assert np.all(per_position[:t + 1] > 0.0)


def test_padding_changes_no_real_output():
  model = model_lib.Transformer(CONFIG)
  params = _init()
  inputs, targets = _random_tokens(2, (2, 5)), _random_tokens(3, (2, 4))

  @quick_jit  # One compilation for both shapes, where eager applies compile each operation.
  def logits_and_padded(params):
    return (model.apply({'params': params}, inputs, targets),
            model.apply({'params': params}, jnp.pad(inputs, ((0, 0), (0, 7))),
                        jnp.pad(targets, ((0, 0), (0, 3)))))

  logits, padded = logits_and_padded(params)
  np.testing.assert_allclose(padded[:, :4], logits, atol=1e-5)


def test_packed_row_equals_separate_sequences():
  model = model_lib.Transformer(CONFIG)
  params = _init()
  sources = [_random_tokens(4, (1, 3)), _random_tokens(5, (1, 5))]
  targets = [_random_tokens(6, (1, 4)), _random_tokens(7, (1, 2))]

  def pack(seqs, length):
    tokens = jnp.concatenate(seqs, axis=1)
    segments = jnp.concatenate([jnp.full(s.shape, i + 1) for i, s in enumerate(seqs)], 1)
    positions = jnp.concatenate([jnp.arange(s.shape[1])[None] for s in seqs], 1)
    pad = ((0, 0), (0, length - tokens.shape[1]))
    return jnp.pad(tokens, pad), jnp.pad(segments, pad), jnp.pad(positions, pad)

  inputs, inputs_segments, inputs_positions = pack(sources, 10)
  packed_targets, targets_segments, targets_positions = pack(targets, 8)

  @quick_jit  # One compilation for the three shapes, where eager applies compile each operation.
  def separate_and_packed(params):
    return ([model.apply({'params': params}, s, t) for s, t in zip(sources, targets)],
            model.apply({'params': params}, inputs, packed_targets, inputs_positions,
                        targets_positions, inputs_segments, targets_segments))

  separate, packed = separate_and_packed(params)
  np.testing.assert_allclose(packed[:, :4], separate[0], atol=1e-5)
  np.testing.assert_allclose(packed[:, 4:6], separate[1], atol=1e-5)


@pytest.mark.parametrize('scan_layers, attention_impl',
                         [(False, 'einsum'), (True, 'einsum'), (False, 'xla')])
def test_cached_decoding_matches_teacher_forcing(scan_layers, attention_impl):
  config = dataclasses.replace(CONFIG, norm='pre', scan_layers=scan_layers,
                               attention_impl=attention_impl)
  params = nn.meta.unbox(_init(dataclasses.replace(config, scan_layers=False)))
  # Stacked for scanned layers: initialising them eagerly would compile each stack's scan.
  params = model_lib.stack_layer_params(params, config) if scan_layers else params
  inputs, targets = _random_tokens(8, (2, 5)), _random_tokens(9, (2, 6))
  assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets)


def test_untied_and_unshared_embeddings_have_their_own_parameters():
  config = dataclasses.replace(CONFIG, share_embeddings=False, tie_output=False)
  params = _init(config)
  assert {'embedding', 'source_embedding', 'output_projection'} <= set(params)
  assert 'source_embedding' not in _init()


@pytest.mark.parametrize('variant, expected_millions', [('base', 63.0), ('big', 214.2)])
def test_parameter_count_matches_the_paper_scale(variant, expected_millions):
  from configs import wmt14_ende  # pylint: disable=g-import-not-at-top
  config = wmt14_ende.get_config(variant)
  model_config = model_lib.TransformerConfig.from_config(config.model, config.data.vocab_size)
  tokens = jnp.ones((1, 1), jnp.int32)
  shapes = jax.eval_shape(model_lib.Transformer(model_config).init, jax.random.PRNGKey(0),
                          tokens, tokens)['params']
  count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
  assert count / 1e6 == pytest.approx(expected_millions, abs=0.1)


def test_bad_model_config_names_the_key(tiny_config):
  tiny_config.model.num_heads = 3
  with pytest.raises(ValueError, match='config.model.d_model=32 is not divisible'):
    model_lib.TransformerConfig.from_config(tiny_config.model, VOCAB)


def test_bad_remat_names_the_key_and_the_choices(tiny_config):
  tiny_config.model.remat = 'some'
  with pytest.raises(ValueError, match="config.model.remat must be one of 'none', 'full', "
                                       "'dots', got 'some'"):
    model_lib.TransformerConfig.from_config(tiny_config.model, VOCAB)


def _loss_fn(config, rngs=None):
  """Params -> mean token cross-entropy of a fixed batch with padding."""
  inputs, targets = _random_tokens(10, (3, 6)), _random_tokens(11, (3, 5))
  inputs, targets = inputs.at[2, 4:].set(0), targets.at[2, 3:].set(0)

  def loss(params):
    logits = model_lib.Transformer(config).apply({'params': params}, inputs, targets,
                                                 rngs=rngs or {})
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return -(log_probs * (targets != 0)).sum() / (targets != 0).sum()

  return loss


def _loss_and_grads(config, params, rngs=None):
  return quick_jit(jax.value_and_grad(_loss_fn(config, rngs)))(params)


def _assert_trees_close(actual, expected, atol):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)


@pytest.mark.parametrize('norm', ['post', 'pre'])
def test_scanned_layers_give_the_unrolled_loss_and_gradients(norm):
  config = dataclasses.replace(CONFIG, norm=norm)
  scanned = dataclasses.replace(config, scan_layers=True)
  params = nn.meta.unbox(_init(config))
  stacked = model_lib.stack_layer_params(params, config)
  boxed = _shapes(scanned)
  own = nn.meta.unbox(boxed)  # The layout the scanned model creates for itself.
  assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, own)
  assert own['decoder_layers']['ffn']['wi']['kernel'].shape == (2, 16, 32)
  # The stacked axis carries the logical name 'layers' ahead of the layer's own names.
  assert boxed['encoder_layers']['self_attention']['query'].names == ('layers', 'embed', 'heads',
                                                                     'kv')
  jax.tree.map(np.testing.assert_array_equal,
               model_lib.unstack_layer_params(stacked, config), params)

  loss, grads = _loss_and_grads(config, params)
  scanned_loss, scanned_grads = _loss_and_grads(scanned, stacked)
  assert float(scanned_loss) == pytest.approx(float(loss), rel=1e-6)
  _assert_trees_close(model_lib.unstack_layer_params(scanned_grads, config), grads, atol=1e-6)


def _dropout_config(scan_layers):
  return dataclasses.replace(CONFIG, scan_layers=scan_layers, deterministic=False, dropout=0.3,
                             attention_dropout=0.3, relu_dropout=0.3)


def _gradient_program(config, params, rngs):
  return str(jax.make_jaxpr(jax.grad(_loss_fn(config, rngs)))(params))


@functools.cache  # Shared by both remat policies: the same programs, compiled once.
def _without_remat(scan_layers):
  """(params, dropout keys, gradient program, loss and gradients with dropout, loss without
  dropout) of the model without remat."""
  config = _dropout_config(scan_layers)
  # The unrolled model's parameters, stacked for scanned layers (the layout
  # test_scanned_layers_give_the_unrolled_loss_and_gradients checks): initialising scanned
  # layers eagerly would compile each stack's scan.
  params = nn.meta.unbox(_init(dataclasses.replace(config, scan_layers=False,
                                                  deterministic=True)))
  params = model_lib.stack_layer_params(params, config) if scan_layers else params
  # Keys of the default dropout PRNG, as the train step makes them.
  rngs = {'dropout': jax.random.wrap_key_data(jax.random.PRNGKey(7), impl=prng.impl('hash32'))}
  loss, grads = _loss_and_grads(config, params, rngs)
  without_dropout = quick_jit(_loss_fn(dataclasses.replace(config, deterministic=True)))(params)
  return (params, rngs, _gradient_program(config, params, rngs), loss, grads,
          float(without_dropout))


# One combination in the fast tier, the rest with the slow tier.
@pytest.mark.parametrize('scan_layers', [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize('remat', ['full', pytest.param('dots', marks=pytest.mark.slow)])
def test_remat_gives_the_same_loss_gradients_and_dropout_masks(scan_layers, remat):
  params, rngs, program, loss, grads, without_dropout = _without_remat(scan_layers)
  rematerialised = dataclasses.replace(_dropout_config(scan_layers), remat=remat)
  assert (jax.tree.map(jnp.shape, nn.meta.unbox(_shapes(dataclasses.replace(
      rematerialised, deterministic=True)))) == jax.tree.map(jnp.shape, params))
  assert 'remat' in _gradient_program(rematerialised, params, rngs)
  assert 'remat' not in program
  remat_loss, remat_grads = _loss_and_grads(rematerialised, params, rngs)
  assert abs(float(loss) - without_dropout) > 1e-2  # The masks matter.
  assert float(remat_loss) == pytest.approx(float(loss), rel=1e-6)
  _assert_trees_close(remat_grads, grads, atol=1e-6)


def test_auto_dtype_is_bfloat16_on_accelerators_and_float32_on_cpu():
  assert model_config.compute_dtype('auto', 'gpu') == jnp.bfloat16
  assert model_config.compute_dtype('auto', 'tpu') == jnp.bfloat16
  assert model_config.compute_dtype('auto', 'cpu') == jnp.float32
  assert model_config.compute_dtype('bfloat16', 'cpu') == jnp.bfloat16
  with pytest.raises(ValueError, match=r"config.model.dtype='fp8' must be"):
    model_config.compute_dtype('fp8', 'gpu')
