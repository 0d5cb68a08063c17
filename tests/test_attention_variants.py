"""Local and memory-compressed attention: their neighbourhoods against a dense reference,
causality and windows through gradients, padding and packing, memory, and cached decoding."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LEARNED_COPY_ACCURACY, assert_cached_decoding_matches_teacher_forcing
from conftest import learns_to_copy
from t2t_jax import runtime
from t2t_jax.compile import dry_run as dry_run_lib
from t2t_jax.decoding import decode
from t2t_jax.model import attention_variants
from t2t_jax.model import transformer as model_lib

VOCAB = 13
CONFIG = model_lib.TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
    num_decoder_layers=2, max_len=32, attention_dropout=0.0, deterministic=True)
NO_DROP = lambda weights: weights
# Compiled whole: eagerly, its start (the encoder, the first step) compiled each operation apart.
greedy_search = runtime.jit_search(decode.greedy_search, static_argnames=('config', 'max_len'))


def _tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(2, VOCAB, shape), jnp.int32)


@functools.cache
def _init(config):
  """The parameters, once per config for the module. Drawn with the 'rbg' generator: the same
  initialisers, but each shape's draw compiles in milliseconds, threefry's in seconds."""
  tokens = jnp.ones((1, 4), jnp.int32)
  return nn.meta.unbox(model_lib.Transformer(config).init(jax.random.key(0, impl='rbg'), tokens,
                                                          tokens)['params'])


def _perturbations(model, *batch):
  """Zero perturbations of the embedded inputs of `batch`, to read gradients at."""
  shapes = jax.eval_shape(model.init, jax.random.key(0, impl='rbg'), *batch)['perturbations']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _reference_attention(q, k, v, mask_BQK):
  """softmax over the keys `mask_BQK` allows, written out directly."""
  logits = np.einsum('bqhd,bkhd->bhqk', q, k)
  logits = np.where(mask_BQK[:, None], logits, -np.inf)
  with np.errstate(invalid='ignore'):  # Padding rows that see no key become NaN; unused.
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', weights, v)


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('window, length', [(3, 11), (4, 8), (1, 5)])
def test_local_attention_sees_exactly_its_window(causal, window, length):
  rng = np.random.default_rng(window)
  q, k, v = (rng.normal(size=(2, length, 2, 4)).astype(np.float32) for _ in range(3))
  valid = np.ones((2, length), bool)
  valid[1, -2:] = False
  segments = np.ones((2, length), np.int32)
  segments[0, length // 2:] = 2
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  near = ((i - j >= 0) & (i - j <= window)) if causal else (np.abs(i - j) <= window)
  expected_mask = near[None] & valid[:, None, :] & (segments[:, :, None] == segments[:, None, :])
  # Compiled whole: its few dozen operations one by one took longer to compile.
  local_attention = jax.jit(attention_variants.local_attention, static_argnums=(6, 7, 8))
  actual = local_attention(q, k, v, valid, segments, None, window, causal, NO_DROP)
  expected = _reference_attention(q, k, v, expected_mask)
  real = valid[:, :, None, None] & np.ones_like(expected, bool)
  np.testing.assert_allclose(np.asarray(actual)[real], expected[real], atol=1e-5)


def test_local_attention_memory_grows_with_the_window_not_the_square():
  length, window, heads, head_dim = 256, 4, 2, 2
  q = jnp.zeros((1, length, heads, head_dim))
  valid = jnp.ones((1, length), bool)
  jaxpr = jax.make_jaxpr(lambda q: attention_variants.local_attention(
      q, q, q, valid, valid.astype(jnp.int32), None, window, False, NO_DROP))(q)
  largest = max(np.prod(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars)
  # Each block's keys (and logits) span three blocks: 3 * window per query, never length.
  assert largest <= length * 3 * window * heads * head_dim < length * length


def _loss_and_grads(config, params, batch):
  def loss(params):
    logits = model_lib.Transformer(config).apply({'params': params}, *batch)
    return (jax.nn.log_softmax(logits).max(-1) * (batch[1] != 0)).sum(), logits
  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return value, logits, grads


def _batches():
  """A padded batch and a packed one (two segments per row, positions restarting)."""
  inputs, targets = np.array(_tokens(0, (2, 9))), np.array(_tokens(1, (2, 8)))
  segments_in = np.array([[1] * 4 + [2] * 4 + [0]] * 2)
  segments_out = np.array([[1] * 3 + [2] * 5] * 2)
  positions = lambda segments: np.concatenate(
      [np.arange((segments[0] == s).sum()) for s in (1, 2, 0)])
  packed = (np.where(segments_in > 0, inputs, 0), targets.copy(),
            np.tile(positions(segments_in), (2, 1)), np.tile(positions(segments_out), (2, 1)),
            segments_in, segments_out)
  inputs[0, 6:], targets[1, 5:] = 0, 0
  return {'padded': (inputs, targets), 'packed': packed}


@pytest.mark.parametrize('kind', ['padded', 'packed'])
def test_local_attention_with_a_window_over_the_sequence_equals_full(kind):
  batch = tuple(jnp.asarray(x) for x in _batches()[kind])
  params = _init(CONFIG)  # Local attention has no parameters of its own.
  expected = _loss_and_grads(CONFIG, params, batch)
  local = dataclasses.replace(CONFIG, attention_pattern='local', local_half_width=9)
  actual = _loss_and_grads(local, params, batch)
  valid = np.asarray(batch[1]) != 0
  np.testing.assert_allclose(np.asarray(actual[1])[valid], np.asarray(expected[1])[valid],
                             atol=1e-5)
  for x, y in zip(jax.tree.leaves(actual[2]), jax.tree.leaves(expected[2])):
    np.testing.assert_allclose(x, y, atol=1e-5)


def _embedding_gradients(config, side: str, position: int):
  """|d output[position] / d embedded input[j]| summed over features, for every j."""
  return np.abs(np.asarray(_embedding_gradients_program(config, side)(position))).sum(-1)


@functools.cache
def _embedding_gradients_program(config, side: str):
  """The gradients of `_embedding_gradients` compiled once for every position: eagerly, each of
  their hundreds of operations compiled apart. A position read at a traced index starts the
  backward pass from the same one-hot cotangent as a constant one."""
  model = model_lib.Transformer(config)
  inputs, targets = _tokens(2, (1, 12)), _tokens(3, (1, 12))
  params, perturbations = _init(config), _perturbations(model, inputs, targets)
  # Random weights over the output's features: a plain sum of the encoder's layer-normed output
  # is zero whatever the input (the norm subtracts the mean), so its gradient is rounding noise.
  weights = np.random.default_rng(7).normal(size=max(config.d_model, config.vocab_size))

  @jax.jit
  def gradients(position):
    def output(perturbations):
      state = {'params': params, 'perturbations': perturbations}
      if side == 'source_embedder':
        out = model.apply(state, inputs, method=model_lib.Transformer.encode)[0, position]
      else:
        out = model.apply(state, inputs, targets)[0, position]
      return (out * weights[:out.shape[-1]]).sum()
    return jax.grad(output)(perturbations)[side]['embedded'][0]

  return gradients


# Both windows (causal and not) are also checked without the model, in the fast
# test_local_attention_sees_exactly_its_window.
@pytest.mark.parametrize('side', [pytest.param('source_embedder', marks=pytest.mark.slow),
                                  pytest.param('target_embedder', marks=pytest.mark.slow)])
def test_a_position_sees_nothing_outside_its_window(side):
  window, t = 2, 7
  config = dataclasses.replace(CONFIG, attention_pattern='local', local_half_width=window,
                               num_encoder_layers=1, num_decoder_layers=1)
  per_position = _embedding_gradients(config, side, t)
  j = np.arange(12)
  if side == 'source_embedder':  # Non-causal: |t - j| <= window.
    inside = np.abs(t - j) <= window
  else:  # Causal: decoder input j is target j - 1; output t sees inputs t - window .. t.
    inside = (t - j >= 0) & (t - j <= window)
  assert np.all(per_position[~inside] == 0.0)
  assert np.all(per_position[inside] > 0.0)


@pytest.mark.parametrize('pattern', [pytest.param('compressed', marks=pytest.mark.slow),
                                     'local,compressed'])
def test_compressed_attention_is_causal_through_gradients(pattern):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, compression_stride=3,
                               local_half_width=2)
  for t in (0, 4, 8):
    per_position = _embedding_gradients(config, 'target_embedder', t)
    assert np.all(per_position[t + 1:] == 0.0), t
    assert np.all(per_position[:t + 1] > 0.0), t


def test_compressed_attention_hides_padding():
  config = dataclasses.replace(CONFIG, attention_pattern='compressed', compression_stride=3)
  params = _init(config)
  apply = jax.jit(model_lib.Transformer(config).apply)
  inputs, targets = _tokens(4, (2, 5)), _tokens(5, (2, 4))
  logits = apply({'params': params}, inputs, targets)
  padded = apply({'params': params}, jnp.pad(inputs, ((0, 0), (0, 7))),
                 jnp.pad(targets, ((0, 0), (0, 5))))
  np.testing.assert_allclose(padded[:, :4], logits, atol=1e-5)


@pytest.mark.parametrize('pattern', [pytest.param('local', marks=pytest.mark.slow), 'compressed'])
def test_packed_segments_do_not_see_each_other(pattern):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, local_half_width=3,
                               compression_stride=2)
  model = model_lib.Transformer(config)
  inputs, targets, in_positions, out_positions, in_segments, out_segments = (
      jnp.asarray(x) for x in _batches()['packed'])
  params, perturbations = _init(config), _perturbations(model, inputs, targets)

  def second_segment(perturbations):
    logits = model.apply({'params': params, 'perturbations': perturbations}, inputs, targets,
                         in_positions, out_positions, in_segments, out_segments)
    return (logits[0] * (out_segments[0] == 2)[:, None]).sum()

  grads = jax.jit(jax.grad(second_segment))(perturbations)  # One compile, not one per operation.
  for side, segments in (('source_embedder', in_segments), ('target_embedder', out_segments)):
    per_position = np.abs(np.asarray(grads[side]['embedded'][0])).sum(-1)
    assert np.all(per_position[segments[0] == 1] == 0.0), side
    assert np.all(per_position[segments[0] == 2] > 0.0), side


def test_a_packed_row_of_local_attention_equals_its_segments_one_by_one():
  config = dataclasses.replace(CONFIG, attention_pattern='local', local_half_width=2)
  params = _init(config)
  apply = jax.jit(model_lib.Transformer(config).apply)
  inputs, targets, in_positions, out_positions, in_segments, out_segments = (
      jnp.asarray(x) for x in _batches()['packed'])
  packed = apply({'params': params}, inputs, targets, in_positions, out_positions,
                 in_segments, out_segments)
  for segment in (1, 2):
    source = inputs[:, np.asarray(in_segments[0]) == segment]
    where = np.asarray(out_segments[0]) == segment
    # Each segment's targets padded to 5 (the longer's length): one shape, one compile.
    alone = apply({'params': params}, source, jnp.pad(targets[:, where],
                                                      ((0, 0), (0, 5 - where.sum()))))
    np.testing.assert_allclose(packed[:, where], alone[:, :where.sum()], atol=1e-5)


# One member in the fast tier; each of the others adds a slow step-by-step loop. Each attention
# kind is here; sinusoidal positions (added at the embedder, whatever the attention) decode in
# test_model.py and test_positions.py, and through local and compressed layers in
# test_decoder_only.py's family members, which also decode scanned compressed layers (scanned
# encoder-decoder layers: test_positions.py's relative member).
@pytest.mark.parametrize('pattern, positions, scan_layers', [
    pytest.param('local,compressed', 'learned', False, marks=pytest.mark.slow),
    ('local', 'relative', False),
])
def test_cached_decoding_matches_teacher_forcing(pattern, positions, scan_layers):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, positions=positions,
                               scan_layers=scan_layers, local_half_width=2, compression_stride=3,
                               norm='pre')
  params = _init(config)
  inputs, targets = _tokens(6, (2, 5)), _tokens(7, (2, 10))
  assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets)
  greedy = greedy_search(params, inputs, config=config, max_len=10)  # The search runs on it too.
  assert greedy.shape == (2, 10)


@pytest.mark.slow
@pytest.mark.parametrize('pattern, positions', [('local,compressed', 'learned'),
                                                ('full,local', 'relative')])
def test_family_configs_train_evaluate_and_dry_run(tiny_config, tmp_path, pattern, positions):
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  config = tiny_config
  config.model.attention_pattern, config.model.positions = pattern, positions
  config.model.local_half_width, config.model.num_decoder_layers = 4, 2
  learns_to_copy(config)
  # The copy task's pairs are at most 9 tokens, so a data.max_len of 16 drops none, and the
  # dry run's batch is the one bucket's, 16 rows of 16: it compiles the very train step the run
  # did, and reads it back from the compilation cache.
  config.data.max_len = 16
  # No BLEU: nothing here reads it. The search runs through local, compressed and relative
  # layers in test_cached_decoding_matches_teacher_forcing, and test_multi30k.py scores a
  # local,compressed member's BLEU.
  config.eval.bleu_sentences = 0
  results = train.train_and_evaluate(config, str(tmp_path))
  # Above what a model blind to the source can reach (conftest.py): the member's attention
  # carries the source to the decoder while it trains.
  assert results['step'] == 60 and results['eval_accuracy'] > LEARNED_COPY_ACCURACY, results
  dry = dry_run_lib.dry_run(config)
  assert (dry['attention_pattern'], dry['positions']) == (pattern, positions)
  assert dry['memory_per_device_bytes']['total'] > 0
  assert dry['batch_shape'] == [16, 16]  # The batch it trained on.
