"""A sentence's logits and translation do not depend on its batch: alone, beside a much longer
source (so its own is padded), or packed beside other segments, for every attention kind and
position kind of the decoder-only model, and for compressed blocks straddling packed segments
of the encoder-decoder.

Tolerance: float32 throughout, rtol = atol = 1e-5. The same arithmetic runs on the same real
tokens; only the padding around them (exact zeros in softmax sums) and the array shapes, so
XLA's summation order, change, which moves a logit by a few float32 ulps (about 1e-6 here).
A window or block that counted another sentence or the padding moves logits by 1e-2 or more.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import QUICK_COMPILE, quick_jit
from t2t_jax import ConfigError
from t2t_jax import runtime
from t2t_jax.decoding import decode
from t2t_jax.model import decoder_only
from t2t_jax.model import model_config
from t2t_jax.model import moe as moe_lib
from t2t_jax.model import transformer as model_lib

VOCAB = 13
CONFIG = model_lib.TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_decoder_layers=2,
    num_encoder_layers=2, max_len=64, deterministic=True, kind='decoder_only',
    local_half_width=2, compression_stride=3)
TOLERANCE = {'rtol': 1e-5, 'atol': 1e-5}
# The sentence under test, and the company it keeps: a source four times as long, and (packed)
# one example before it whose 4 + 4 tokens leave it starting mid-block and mid-window.
SOURCE, TARGET = [3, 4, 1], [5, 6, 7, 8, 1]
LONG_SOURCE, LONG_TARGET = [9, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1], [2, 1]
BEFORE = ([6, 7, 8, 1], [9, 10, 11, 1])
AFTER = ([11, 1], [12, 4, 1])
# Every position kind with each pattern; compressed layers refuse the kinds that turn or
# measure by a key's one position (model_config.check_family).
POSITIONS = ('sinusoidal', 'predictive', 'learned', 'relative', 'rotary', 'alibi', 'none')
CASES = [(pattern, positions) for pattern in ('full', 'local', 'compressed', 'local,compressed')
         for positions in POSITIONS
         if 'compressed' not in pattern or positions not in ('relative', 'rotary', 'alibi')]
# One case per pattern in the fast tier, between them four position kinds.
FAST = {('full', 'alibi'), ('local', 'rotary'), ('compressed', 'learned'),
        ('local,compressed', 'sinusoidal')}


def _params_for(config):
  return nn.meta.unbox(decoder_only.make_model(config).init(
      jax.random.PRNGKey(1), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))['params'])


def _rows(sequences, width):
  return jnp.asarray([sequence + [0] * (width - len(sequence)) for sequence in sequences])


def packed_row(examples, source_width, target_width):
  """One packed row of (source, target) examples, as batching.py lays them out."""
  row = {key: np.zeros((1, width), np.int32) for key, width in (
      ('inputs', source_width), ('inputs_positions', source_width),
      ('inputs_segments', source_width), ('targets', target_width),
      ('targets_positions', target_width), ('targets_segments', target_width))}
  for side, index in (('inputs', 0), ('targets', 1)):
    column = 0
    for segment, example in enumerate(examples, start=1):
      sequence = example[index]
      span = slice(column, column + len(sequence))
      row[side][0, span] = sequence
      row[f'{side}_positions'][0, span] = np.arange(len(sequence))
      row[f'{side}_segments'][0, span] = segment
      column += len(sequence)
  return {key: jnp.asarray(value) for key, value in row.items()}


def _packed_logits(model, params, row):
  return model.apply({'params': params}, row['inputs'], row['targets'], row['inputs_positions'],
                     row['targets_positions'], row['inputs_segments'], row['targets_segments'])


def _case(fast, pattern, positions):
  return pytest.param(pattern, positions, marks=() if fast else (pytest.mark.slow,),
                      id=f'{pattern}-{positions}')


@pytest.mark.parametrize('pattern, positions', [_case(case in FAST, *case) for case in CASES])
def test_teacher_forced_logits_do_not_depend_on_the_batch(pattern, positions):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, positions=positions)
  model = decoder_only.make_model(config)
  params = _params_for(config)
  row = packed_row([BEFORE, (SOURCE, TARGET), AFTER], 12, 12)

  @quick_jit  # One compilation for the three batches.
  def logits(params):
    alone = model.apply({'params': params}, _rows([SOURCE], 3), _rows([TARGET], 5))
    beside = model.apply({'params': params}, _rows([SOURCE, LONG_SOURCE], 12),
                         _rows([TARGET, LONG_TARGET], 7))
    return alone, beside, _packed_logits(model, params, row)

  alone, beside, packed = (np.asarray(x) for x in logits(params))
  np.testing.assert_allclose(beside[0, :len(TARGET)], alone[0], **TOLERANCE)
  start = len(BEFORE[1])
  np.testing.assert_allclose(packed[0, start:start + len(TARGET)], alone[0], **TOLERANCE)


def _searches(params, inputs_BS, config):
  greedy = decode.greedy_search(params, inputs_BS, config, max_len=6)
  tokens, scores = decode.beam_search(params, inputs_BS, config, 6, beam_size=2, alpha=0.6)
  return greedy[0], tokens[0], scores[0]


def _translate(params, config, inputs_BS):
  """The first row's greedy output, beams and scores: both searches one program, compiled as
  Translator compiles a search and with QUICK_COMPILE (eager, each operation compiles apart)."""
  search = runtime.jit_search(functools.partial(_searches, config=config))
  return search.lower(params, inputs_BS).compile(QUICK_COMPILE)(params, inputs_BS)


@pytest.mark.parametrize('pattern, positions', [
    # All slow: a search compiled per member and batch shape (the teacher-forced test above
    # keeps a member in the fast tier).
    _case(False, 'local,compressed', 'sinusoidal'),
    _case(False, 'full', 'relative'),
    _case(False, 'local', 'rotary'),
    _case(False, 'local', 'alibi'),
    _case(False, 'compressed', 'learned'),
    _case(False, 'local,compressed', 'predictive'),
])
def test_greedy_and_beam_translations_do_not_depend_on_the_batch(pattern, positions):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, positions=positions)
  params = _params_for(config)
  alone = _translate(params, config, _rows([SOURCE], 3))
  beside = _translate(params, config, _rows([SOURCE, LONG_SOURCE], 12))
  np.testing.assert_array_equal(beside[0], alone[0])
  np.testing.assert_array_equal(beside[1], alone[1])
  np.testing.assert_allclose(beside[2], alone[2], **TOLERANCE)


@pytest.mark.parametrize('pattern', ['compressed', pytest.param('local', marks=pytest.mark.slow)])
def test_encoder_decoder_packed_segments_straddling_blocks_equal_them_alone(pattern):
  # Strides of 3: the sentence's source and target both start at column 4, inside the blocks
  # its neighbour ends in.
  config = dataclasses.replace(CONFIG, kind='encoder_decoder', attention_pattern=pattern)
  model = model_lib.Transformer(config)
  params = _params_for(config)
  row = packed_row([BEFORE, (SOURCE, TARGET), AFTER], 12, 12)

  @quick_jit
  def logits(params):
    alone = model.apply({'params': params}, _rows([SOURCE], 3), _rows([TARGET], 5))
    return alone, _packed_logits(model, params, row)

  alone, packed = (np.asarray(x) for x in logits(params))
  start = len(BEFORE[1])
  np.testing.assert_allclose(packed[0, start:start + len(TARGET)], alone[0], **TOLERANCE)


@pytest.mark.parametrize('positions', ['relative', 'rotary', 'alibi'])
def test_compressed_layers_refuse_the_positions_a_block_cannot_have(positions):
  # The combinations CASES leaves out: a compressed key summarises several positions.
  config = dataclasses.replace(CONFIG, attention_pattern='local,compressed', positions=positions)
  with pytest.raises(ConfigError, match=rf"positions='{positions}' cannot be used with "
                                        r"config.model.attention_pattern='local,compressed'"):
    model_config.check_family(config)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['encoder_decoder', 'decoder_only'])
def test_expert_capacity_counts_a_sentences_tokens_not_its_batchs_padding(kind):
  """Experts with a tight capacity: a row's limit comes from its real tokens, so a sentence
  beside a longer source (its row padded four times over) keeps the drops it has alone."""
  config = dataclasses.replace(CONFIG, kind=kind, moe_experts=4, moe_top_k=2,
                               moe_capacity_factor=1.0, moe_layers='all')
  model = (decoder_only.make_model(config) if kind == 'decoder_only'
           else model_lib.Transformer(config))
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.ones((1, 4), jnp.int32),
                                    jnp.ones((1, 4), jnp.int32))['params'])

  @quick_jit
  def logits(params):
    alone, sown = model.apply({'params': params}, _rows([SOURCE], 3), _rows([TARGET], 5),
                              mutable=['moe'])
    beside = model.apply({'params': params}, _rows([SOURCE, LONG_SOURCE], 12),
                         _rows([TARGET, LONG_TARGET], 7))
    return alone, beside, moe_lib.metrics(sown['moe'])['dropped']

  alone, beside, dropped = logits(params)
  assert dropped > 0  # The capacity binds: the sentence alone loses some choices.
  np.testing.assert_allclose(np.asarray(beside)[0, :len(TARGET)], alone[0], **TOLERANCE)
  alone = _translate(params, config, _rows([SOURCE], 3))
  beside = _translate(params, config, _rows([SOURCE, LONG_SOURCE], 12))
  np.testing.assert_array_equal(beside[0], alone[0])
  np.testing.assert_array_equal(beside[1], alone[1])
  np.testing.assert_allclose(beside[2], alone[2], **TOLERANCE)
