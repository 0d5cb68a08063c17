"""The encoder-only family (BERT): parameter counts, token types, masked-LM choice and
corruption, the objectives against independent computations, the classifier's scores, AdamW's
decay mask and layer-wise rates, partial initialisation, the config checks, pre-training then
fine-tuning end to end, and the pipeline's masked-LM rows and next-sentence pairs with their
objective."""

import dataclasses
import functools
import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import encoder_only_params, leaves_equal, saved_state_field, scalar_events
from conftest import write_lines
from configs import base as base_config
from configs import bert
from t2t_jax import CheckpointError
from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.checkpoints import partial_init
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline
from t2t_jax.data import tokenizer
from t2t_jax.data.token_cache import Ragged
from t2t_jax.model import encoder_only
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.training import build
from t2t_jax.training import classifier_eval
from t2t_jax.training import config_check
from t2t_jax.training import encoder_tasks
from t2t_jax.training import optim
from t2t_jax.training import train

PAD, EOS, CLS, SEP, MASK = 0, 1, 3, 4, 5
VOCAB = 40
CONFIG = TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
    kind='encoder_only', positions='learned', max_len=32, dropout=0, attention_dropout=0,
    relu_dropout=0, deterministic=True, type_vocab_size=2)


# BERT's published sizes (Devlin et al. 2019, section 3): BERT-Base 110M, BERT-Large 340M.
@pytest.mark.parametrize('variant, published', [('base', 110e6), ('large', 340e6)])
def test_bert_sizes_match_the_paper_and_the_formula(variant, published):
  config = bert.get_config(variant)
  model_config = TransformerConfig.from_config(config.model, config.data.vocab_size, 'cpu')
  params = build.abstract_params(model_config, sharding.make_mesh(config.mesh),
                                 sharding.rules(config.mesh))
  count = build.count_params(params)
  assert abs(count - published) / published < 0.02, count
  vocab, width, hidden = config.data.vocab_size, config.model.d_model, config.model.d_ff
  # The family's attention projections have no biases (BERT's have 4E per layer, 0.03% of
  # the model): 4 E^2; feed-forward 2 E F + F + E; two layer norms 4 E.
  layer = 4 * width * width + 2 * width * hidden + hidden + width + 4 * width
  expected = (vocab * width + 512 * width + 2 * width  # Tokens, positions, token types.
              + config.model.num_encoder_layers * layer
              + 2 * width  # The final (pre-norm) layer norm.
              + width * width + width + 2 * width + vocab)  # MLM transform, its norm, bias.
  assert count == expected


def test_token_types_turn_to_one_after_the_first_separator():
  # [CLS] a b [SEP] c d EOS pad, and a row with no [SEP] (a single text).
  tokens = jnp.array([[CLS, 7, 8, SEP, 9, 10, EOS, PAD],
                      [CLS, 7, 8, 9, EOS, PAD, PAD, PAD]])
  np.testing.assert_array_equal(encoder_only.token_types(tokens, None),
                                [[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8])


def test_token_types_restart_in_each_packed_segment():
  segments = [  # Pair, single text, pair with two [SEP]s, then padding.
      [CLS, 7, SEP, 8, EOS], [CLS, 9, 10, EOS], [CLS, 11, SEP, 12, SEP, 13, EOS]]
  expected = [[0, 0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1]]
  tokens = jnp.array([sum(segments, []) + [PAD, PAD]])
  segment_ids = jnp.array([sum(([i + 1] * len(s) for i, s in enumerate(segments)), [])
                           + [0, 0]])
  types = np.asarray(encoder_only.token_types(tokens, segment_ids))[0]
  np.testing.assert_array_equal(types[:-2], sum(expected, []))
  for segment, wanted in zip(segments, expected):  # Each segment typed as if alone.
    np.testing.assert_array_equal(encoder_only.token_types(jnp.array([segment]), None)[0],
                                  wanted)


def _mlm_rows(rng, contents, length):
  """Rows [CLS] ordinary ids ([SEP] in the middle of the longer ones) EOS pad..., one per
  entry of `contents` (its count of ordinary tokens); returns (tokens, maskable counts)."""
  rows = []
  for count in contents:
    body = list(rng.integers(6, VOCAB, count))
    if count >= 6:
      body.insert(count // 2, SEP)
    row = [CLS] + body + [EOS]
    rows.append(row + [PAD] * (length - len(row)))
  return np.array(rows, np.int32), np.array(contents)


def _expected_counts(maskable):
  """Chosen per row: round(0.15 m), at least one where any token is maskable."""
  return np.where(maskable > 0, np.maximum(1, np.round(0.15 * maskable)), 0).astype(int)


def test_choose_takes_the_rate_of_maskable_tokens_and_never_a_special_one():
  length = 64
  # Maskable counts whose 0.15 m is no tie (m = 10 mod 20 would be x.5): 0 and 1 at the edges.
  contents = [57, 37, 20, 6, 5, 1, 0, 44]
  tokens, maskable = _mlm_rows(np.random.default_rng(0), contents, length)
  positions, chosen = jax.jit(functools.partial(encoder_tasks.choose, rate=0.15,
                                                whole_word=False))(
      jax.random.key(0), jnp.asarray(tokens), jnp.zeros_like(tokens, bool))
  positions, chosen = np.asarray(positions), np.asarray(chosen)
  assert positions.shape == chosen.shape == (len(contents),
                                             encoder_tasks.mlm_slots(length, 0.15, False))
  np.testing.assert_array_equal(chosen.sum(1), _expected_counts(maskable))
  assert _expected_counts(maskable)[5] == 1 and _expected_counts(maskable)[6] == 0
  for row, at, take in zip(tokens, positions, chosen):
    picked = at[take]
    assert len(set(picked)) == len(picked)
    assert np.all(row[picked] >= 6), row[picked]


def test_choose_is_uniform_over_the_maskable_tokens():
  """The same row 2000 times (each row draws its own priorities): every maskable position
  is chosen about count / maskable of the time, the special tokens and padding never."""
  rows, length = 2000, 64
  tokens, maskable = _mlm_rows(np.random.default_rng(1), [57], length)
  tokens = np.repeat(tokens, rows, axis=0)
  positions, chosen = jax.jit(functools.partial(encoder_tasks.choose, rate=0.15,
                                                whole_word=False))(
      jax.random.key(3), jnp.asarray(tokens), jnp.zeros_like(tokens, bool))
  hits = np.zeros(length)
  np.add.at(hits, np.asarray(positions)[np.asarray(chosen)], 1)
  ordinary = tokens[0] >= 6
  p = _expected_counts(maskable)[0] / maskable[0]
  sigma = np.sqrt(rows * p * (1 - p))
  assert np.all(np.abs(hits[ordinary] - rows * p) < 6 * sigma), hits[ordinary]
  assert np.all(hits[~ordinary] == 0)


def test_whole_word_masking_chooses_whole_words():
  rng = np.random.default_rng(2)
  length, rate = 64, 0.15
  contents = [57, 40, 23, 9, 3, 40]
  tokens, maskable = _mlm_rows(rng, contents, length)
  # Words of 1 to 3 pieces over the ordinary tokens; [CLS], [SEP], EOS and padding each start
  # their own (as the pipeline flags them: data/pipeline.py). The last row: two words of 20
  # pieces, either longer than the slots.
  starts = np.ones_like(tokens, bool)
  starts[-1, 1:] = (tokens[-1, 1:] < 6) | (tokens[-1, :-1] < 6)
  for row in range(len(tokens) - 1):
    at = 0
    while at < length:
      if tokens[row, at] >= 6:
        size = rng.integers(1, 4)
        run = 1
        while run < size and at + run < length and tokens[row, at + run] >= 6:
          starts[row, at + run] = False
          run += 1
        at += run
      else:
        at += 1
  slots = encoder_tasks.mlm_slots(length, rate, True)
  positions, chosen = jax.jit(functools.partial(encoder_tasks.choose, rate=rate,
                                                whole_word=True))(
      jax.random.key(5), jnp.asarray(tokens), jnp.asarray(starts))
  positions, chosen = np.asarray(positions), np.asarray(chosen)
  assert positions.shape == (len(contents), slots)
  targets = _expected_counts(maskable)
  for row in range(len(tokens)):
    picked = set(positions[row][chosen[row]])
    assert all(tokens[row, i] >= 6 for i in picked)
    word_of = np.cumsum(starts[row]) - 1
    cut = []
    for word in set(word_of[list(picked)]):
      pieces = set(np.flatnonzero(word_of == word))
      assert min(pieces) in picked  # A word is chosen from its first piece on.
      if not pieces <= picked:
        cut.append(word)
    assert not cut or (len(cut) == 1 and len(picked) == slots), (row, cut)  # The slot limit.
    assert bool(cut) == (row == len(tokens) - 1)  # The long words' row is cut, no other.
    assert len(picked) >= targets[row] or len(picked) == slots
    if row < len(tokens) - 1:  # The last word overruns by 2 pieces at most.
      assert len(picked) <= targets[row] + 2


def test_corrupt_masks_80_replaces_10_keeps_10_percent():
  rows, length, chosen_per_row = 200, 128, 100
  rng = np.random.default_rng(3)
  tokens = rng.integers(6, VOCAB, (rows, length)).astype(np.int32)
  positions = np.stack([rng.permutation(length) for _ in range(rows)]).astype(np.int32)
  chosen = np.zeros((rows, length), bool)
  chosen[:, :chosen_per_row] = True
  corrupted = np.asarray(jax.jit(encoder_tasks.corrupt, static_argnums=4)(
      jax.random.key(7), jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(chosen),
      VOCAB))
  at_chosen = np.zeros_like(chosen)
  np.put_along_axis(at_chosen, positions, chosen, axis=1)
  n = int(at_chosen.sum())
  assert n == 20_000
  np.testing.assert_array_equal(corrupted[~at_chosen], tokens[~at_chosen])
  new, old = corrupted[at_chosen], tokens[at_chosen]
  assert np.all((new == MASK) | ((new >= 6) & (new < VOCAB)))
  same_draw = 0.1 / (VOCAB - 6)  # A random replacement equal to the original.
  for observed, p in [((new == MASK).sum(), 0.8),
                      (((new != MASK) & (new != old)).sum(), 0.1 - same_draw),
                      ((new == old).sum(), 0.1 + same_draw)]:
    assert abs(observed - n * p) < 5 * np.sqrt(n * p * (1 - p)), (observed, n * p)
  replaced = new[(new != MASK) & (new != old)]
  assert set(np.unique(replaced)) == set(range(6, VOCAB))  # Every ordinary id drawn.


def _params(config=CONFIG):
  return encoder_only_params(config)


def _mlm_batch():
  tokens, _ = _mlm_rows(np.random.default_rng(4), [25, 17, 9, 28], 32)
  return {'targets': jnp.asarray(tokens),
          'inputs': jnp.asarray(np.where(tokens > 0, encoder_tasks.WORD_START, 0))}


def _spied_mlm_metrics(monkeypatch, config=CONFIG, **options):
  """jitted (params, batch, rngs) -> (mlm_metrics' sums, the positions and chosen flags it drew,
  the tokens it corrupted them to); `options` go to mlm_metrics."""
  seen = {}

  def spy(name, real):
    def call(*args, **kwargs):
      seen[name] = real(*args, **kwargs)
      return seen[name]
    monkeypatch.setattr(encoder_tasks, name, call)
  spy('choose', encoder_tasks.choose)
  spy('corrupt', encoder_tasks.corrupt)
  model = encoder_only.EncoderOnly(config)

  @jax.jit
  def run(params, batch, rngs):
    metrics = encoder_tasks.mlm_metrics(model, params, batch, 0.0, rngs=rngs, **options)
    return metrics, seen['choose'], seen['corrupt']
  return run


def test_masks_depend_only_on_the_key(monkeypatch):
  run = _spied_mlm_metrics(monkeypatch)
  params, batch = _params(), _mlm_batch()
  key = jax.random.key(11)
  first, (positions, chosen), _ = run(params, batch, {'dropout': key})
  again, (positions_again, _), _ = run(params, batch, {'dropout': key})
  assert leaves_equal(first, again) and np.array_equal(positions, positions_again)
  _, (other, other_chosen), _ = run(params, batch, {'dropout': jax.random.fold_in(key, 1)})
  np.testing.assert_array_equal(chosen.sum(1), other_chosen.sum(1))  # Same counts, ...
  assert not np.array_equal(np.sort(np.where(chosen, positions, -1)),  # ... other tokens.
                            np.sort(np.where(other_chosen, other, -1)))
  evaluation = [run(params, batch, None) for _ in range(2)]
  assert leaves_equal(evaluation[0], evaluation[1])


def test_mlm_loss_is_the_cross_entropy_at_the_chosen_positions(monkeypatch):
  run = _spied_mlm_metrics(monkeypatch)
  params, batch = _params(), _mlm_batch()
  metrics, (positions, chosen), corrupted = run(params, batch, {'dropout': jax.random.key(1)})
  model = encoder_only.EncoderOnly(CONFIG)
  states = model.apply({'params': params}, corrupted, method='encode')
  logits = np.asarray(model.apply({'params': params}, states, method='mlm_logits'), np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  tokens = np.asarray(batch['targets'])
  rows, at = np.nonzero(chosen)
  cols = np.asarray(positions)[rows, at]
  expected = -log_probs[rows, cols, tokens[rows, cols]]
  assert int(metrics['weight']) == len(expected) == chosen.sum()
  np.testing.assert_array_equal(chosen.sum(1), _expected_counts(np.array([25, 17, 9, 28])))
  np.testing.assert_allclose(float(metrics['loss']), expected.sum(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['nll']), expected.sum(), rtol=1e-5)
  correct = (logits[rows, cols].argmax(-1) == tokens[rows, cols]).sum()
  assert int(metrics['correct']) == correct
  assert np.any(np.asarray(corrupted) != tokens)  # The model read corrupted tokens.


def _head_batch(targets):
  tokens, _ = _mlm_rows(np.random.default_rng(5), [12, 5, 20, 8, 3], 24)
  return {'inputs': jnp.asarray(tokens), 'targets': jnp.asarray(targets, jnp.int32)}


@pytest.mark.parametrize('label_smoothing', [0.0, 0.2])
def test_classification_metrics_are_the_cross_entropy_of_the_head(label_smoothing):
  config = dataclasses.replace(CONFIG, head='classification', num_labels=3)
  model = encoder_only.EncoderOnly(config)
  params = _params(config)
  labels = np.array([2, 0, 1, 2, -1])  # -1: a padding row (target 0).
  batch = _head_batch((labels + 1)[:, None])
  metrics = jax.jit(lambda p, b: encoder_tasks.head_metrics(model, p, b, label_smoothing))(
      params, batch)
  logits = np.asarray(model.apply({'params': params}, batch['inputs'],
                                  method='head_outputs'), np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  real = labels >= 0
  soft = np.eye(3)[labels[real]] * (1 - label_smoothing) + label_smoothing / 3
  np.testing.assert_allclose(float(metrics['loss']), -(soft * log_probs[real]).sum(),
                             rtol=1e-5)
  np.testing.assert_allclose(float(metrics['nll']),
                             -log_probs[real, labels[real]].sum(), rtol=1e-5)
  assert float(metrics['weight']) == 4
  assert float(metrics['correct']) == (logits[real].argmax(-1) == labels[real]).sum()


def test_regression_metrics_are_the_squared_error_of_the_head():
  config = dataclasses.replace(CONFIG, head='regression')
  model = encoder_only.EncoderOnly(config)
  params = _params(config)
  values = np.array([0.5, -2.25, 3.0, 1e-3, 0.0], np.float32)
  targets = np.stack([np.ones(5, np.int32), values.view(np.int32)], 1)
  targets[4] = 0  # A padding row.
  batch = _head_batch(targets)
  metrics = jax.jit(lambda p, b: encoder_tasks.head_metrics(model, p, b, 0.0))(params, batch)
  outputs = np.asarray(model.apply({'params': params}, batch['inputs'],
                                   method='head_outputs'), np.float64)
  assert outputs.shape == (5, 1)
  expected = ((outputs[:4, 0] - values[:4]) ** 2).sum()
  np.testing.assert_allclose(float(metrics['loss']), expected, rtol=1e-5)
  np.testing.assert_allclose(float(metrics['nll']), expected, rtol=1e-5)
  assert float(metrics['weight']) == 4 and float(metrics['correct']) == 0


def test_scores_of_two_classes_by_hand():
  labels = np.array([0, 0, 0, 1, 1, 1, 1, 0])
  predictions = np.array([0, 1, 0, 1, 1, 0, 1, 0])
  # TP 3, FN 1, FP 1, TN 3: F1 of either class 6/8; MCC (9 - 1) / sqrt(4^4) = 0.5.
  assert classifier_eval.scores(labels, predictions, regression=False) == pytest.approx(
      {'accuracy': 0.75, 'macro_f1': 0.75, 'mcc': 0.5})


def test_scores_of_three_classes_by_hand():
  labels = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
  predictions = np.array([0, 0, 1, 2, 1, 1, 0, 2, 2, 1])
  # Confusion (gold rows, predicted columns): [[2, 1, 1], [1, 2, 0], [0, 1, 2]].
  confusion = np.zeros((3, 3))
  np.add.at(confusion, (labels, predictions), 1)
  np.testing.assert_array_equal(confusion, [[2, 1, 1], [1, 2, 0], [0, 1, 2]])
  # F1 per class 2 TP / (2 TP + FP + FN): 4/7, 4/7, 4/6.
  macro_f1 = (4 / 7 + 4 / 7 + 4 / 6) / 3
  # Gorodkin's R_K: (c s - sum_k p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)).
  correct, total = np.trace(confusion), confusion.sum()
  predicted, gold = confusion.sum(0), confusion.sum(1)
  mcc = ((correct * total - predicted @ gold)
         / np.sqrt((total**2 - predicted @ predicted) * (total**2 - gold @ gold)))
  # Predicted per class 3, 4, 3; gold 4, 3, 3: (6 x 10 - 33) / sqrt((100 - 34)(100 - 34)).
  assert mcc == pytest.approx(27 / 66)
  assert classifier_eval.scores(labels, predictions, regression=False) == pytest.approx(
      {'accuracy': 0.6, 'macro_f1': macro_f1, 'mcc': mcc})


def test_regression_scores_are_pearson_and_spearman():
  rng = np.random.default_rng(6)
  labels = rng.normal(size=50)
  predictions = labels + rng.normal(scale=0.7, size=50)
  figures = classifier_eval.scores(labels, predictions, regression=True)
  ranks = lambda x: np.argsort(np.argsort(x))  # No ties among continuous draws.
  assert figures == pytest.approx({
      'pearson': np.corrcoef(labels, predictions)[0, 1],
      'spearman': np.corrcoef(ranks(labels), ranks(predictions))[0, 1]})
  assert classifier_eval.scores(labels, np.full(50, 2.0), regression=True) == {
      'pearson': 0.0, 'spearman': 0.0}


def _opt(**overrides):
  opt = base_config.get_config().opt
  opt.schedule, opt.lr_scale = 'constant', 0.01
  opt.update(overrides)
  return opt


def _step(optimizer, params, grads):
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  return jax.tree.map(lambda p, u: np.asarray(p + u), params, updates)


@pytest.mark.parametrize('decay_vectors', [False, True])
def test_weight_decay_spares_vectors_unless_asked(decay_vectors):
  params = {'dense': {'kernel': jnp.full((3, 4), 2.0), 'bias': jnp.full((4,), 2.0)},
            'norm': {'scale': jnp.full((3,), 2.0)}}
  optimizer = optim.make_optimizer(_opt(weight_decay=0.1, decay_vectors=decay_vectors),
                                   d_model=16, num_steps=10)
  new = _step(optimizer, params, jax.tree.map(jnp.zeros_like, params))
  shrunk = 2.0 * (1 - 0.01 * 0.1)  # A zero gradient moves Adam by 0: decay alone.
  np.testing.assert_allclose(new['dense']['kernel'], shrunk, rtol=1e-6)
  for vector in (new['dense']['bias'], new['norm']['scale']):
    if decay_vectors:
      np.testing.assert_allclose(vector, shrunk, rtol=1e-6)
    else:
      np.testing.assert_array_equal(vector, 2.0)


@pytest.mark.parametrize('scan_layers', [False, True])
def test_weight_decay_spares_the_models_biases_and_norms(scan_layers):
  """decay_vectors=False on a real encoder's tree: biases and layer-norm scales keep their
  values, every matrix shrinks, also when the layers are stacked on a leading axis."""
  config = dataclasses.replace(CONFIG, num_encoder_layers=2, scan_layers=scan_layers)
  dummy = jnp.ones((1, 4), jnp.int32)
  shapes = nn.meta.unbox(jax.eval_shape(lambda: encoder_only.EncoderOnly(config).init(
      jax.random.key(0), dummy, dummy))['params'])
  params = jax.tree.map(lambda s: jnp.full(s.shape, 2.0), shapes)
  optimizer = optim.make_optimizer(_opt(weight_decay=0.1, decay_vectors=False), d_model=16,
                                   num_steps=10)
  new = _step(optimizer, params, jax.tree.map(jnp.zeros_like, params))
  vectors = 0
  for path, value in jax.tree_util.tree_leaves_with_path(new):
    name = saved_params.path_name(path)
    if name.split('/')[-1] in ('bias', 'scale', 'mlm_bias'):
      vectors += 1
      np.testing.assert_array_equal(value, 2.0, err_msg=name)
    else:
      np.testing.assert_allclose(value, 2.0 * (1 - 0.01 * 0.1), rtol=1e-6, err_msg=name)
  assert vectors >= 10


def test_layer_rate_factors_decay_from_the_head_down():
  leaf = {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}
  params = {f'encoder_{i}': leaf for i in range(3)}
  params.update(embedding=leaf, embedder=leaf, type_embedding=leaf, classifier=leaf,
                encoder_norm=leaf)
  factors = optim.layer_rate_factors(params, 0.5)
  expected = {'encoder_0': 0.125, 'encoder_1': 0.25, 'encoder_2': 0.5, 'embedding': 0.0625,
              'embedder': 0.0625, 'type_embedding': 0.0625, 'classifier': 1.0,
              'encoder_norm': 1.0}
  for name, factor in expected.items():
    for value in jax.tree.leaves(factors[name]):
      assert float(value) == factor, name
  stacked = optim.layer_rate_factors(
      {'encoder_layers': {'kernel': jnp.ones((3, 4, 5)), 'bias': jnp.ones((3, 5))},
       'embedding': leaf}, 0.5)
  assert stacked['encoder_layers']['kernel'].shape == (3, 1, 1)
  np.testing.assert_array_equal(
      jnp.broadcast_to(stacked['encoder_layers']['kernel'], (3, 4, 5))[:, 2, 3],
      [0.125, 0.25, 0.5])
  np.testing.assert_array_equal(stacked['encoder_layers']['bias'][:, 0], [0.125, 0.25, 0.5])
  assert float(stacked['embedding']['kernel']) == 0.0625


def test_layer_lr_decay_scales_each_update():
  """Adam's first step moves every weight by the rate times the sign of its gradient; under
  layer_lr_decay 0.5 the lower layers move by that times their factor."""
  params = {'encoder_0': {'kernel': jnp.ones((2, 2))}, 'encoder_1': {'kernel': jnp.ones((2, 2))},
            'embedding': {'embedding': jnp.ones((4, 2))},
            'classifier': {'kernel': jnp.ones((2, 3))}}
  optimizer = optim.make_optimizer(_opt(layer_lr_decay=0.5), d_model=16, num_steps=10)
  new = _step(optimizer, params, jax.tree.map(jnp.ones_like, params))
  for name, factor in [('encoder_0', 0.25), ('encoder_1', 0.5), ('embedding', 0.125),
                       ('classifier', 1.0)]:
    for value in jax.tree.leaves(new[name]):
      np.testing.assert_allclose(value, 1.0 - 0.01 * factor, rtol=1e-6, err_msg=name)
  with pytest.raises(ConfigError, match=r'config.opt.layer_lr_decay=1.5 must be in \(0, 1\]'):
    optim.make_optimizer(_opt(layer_lr_decay=1.5), d_model=16, num_steps=10)


def test_frozen_parameters_keep_their_values_and_leave_the_rest_as_without_them():
  """opt.frozen: the named parameters get no update (nor weight decay); the others move as
  the same optimiser moves them on a model without the frozen ones, whose huge gradient
  therefore plays no part in the clipped norm."""
  params = {'embedding': {'embedding': jnp.full((4, 2), 2.0)},
            'encoder_0': {'kernel': jnp.full((2, 2), 2.0), 'bias': jnp.full((2,), 2.0)},
            'classifier': {'kernel': jnp.full((2, 3), 2.0)}}
  grads = {'embedding': {'embedding': jnp.full((4, 2), 100.0)},
           'encoder_0': {'kernel': jnp.full((2, 2), 0.5), 'bias': jnp.full((2,), -0.5)},
           'classifier': {'kernel': jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}}
  settings = dict(weight_decay=0.1, grad_clip=0.5)
  frozen = optim.make_optimizer(_opt(frozen=' embedding ', **settings), d_model=16, num_steps=10)
  state = frozen.init(params)
  updates, _ = frozen.update(grads, state, params)
  new = jax.tree.map(lambda p, u: np.asarray(p + u), params, updates)
  np.testing.assert_array_equal(new['embedding']['embedding'], params['embedding']['embedding'])
  rest = lambda tree: {k: v for k, v in tree.items() if k != 'embedding'}
  expected = _step(optim.make_optimizer(_opt(**settings), d_model=16, num_steps=10),
                   rest(params), rest(grads))
  for a, b in zip(jax.tree.leaves(rest(new)), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert not np.allclose(expected['encoder_0']['kernel'], 2.0)  # The rest did move.
  with pytest.raises(ConfigError, match=r"config.opt.frozen='embedding,pooler': this model has "
                     r'no parameters named pooler; its top-level names are classifier, '
                     r'embedding, encoder_0'):
    optim.make_optimizer(_opt(frozen='embedding,pooler'), d_model=16, num_steps=10).init(params)


def test_merge_takes_the_arrays_both_models_have():
  rng = np.random.default_rng(7)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  fresh = {'embedding': {'embedding': normal(40, 16)},
           'encoder_0': {'kernel': normal(16, 16), 'bias': normal(16)},
           'encoder_1': {'kernel': normal(16, 16), 'bias': normal(16)},
           'classifier': {'kernel': normal(16, 3), 'bias': normal(3)}}
  saved = {'embedding': {'embedding': rng.normal(size=(40, 16))},  # float64: cast.
           'encoder_0': {'kernel': normal(16, 16), 'bias': normal(16)},
           'encoder_1': {'kernel': normal(16, 16), 'bias': normal(8)},  # Another shape.
           'classifier': {'kernel': normal(16, 5)},  # The same name, another shape.
           'mlm_bias': normal(40)}
  merged, taken, kept = partial_init.merge(fresh, saved)
  assert taken == ['embedding', 'encoder_0']
  assert kept == ['classifier', 'encoder_1']
  assert merged['embedding']['embedding'].dtype == np.float32
  np.testing.assert_array_equal(merged['embedding']['embedding'],
                                saved['embedding']['embedding'].astype(np.float32))
  for name in ('kernel', 'bias'):
    np.testing.assert_array_equal(merged['encoder_0'][name], saved['encoder_0'][name])
    np.testing.assert_array_equal(merged['classifier'][name], fresh['classifier'][name])
  np.testing.assert_array_equal(merged['encoder_1']['kernel'], saved['encoder_1']['kernel'])
  np.testing.assert_array_equal(merged['encoder_1']['bias'], fresh['encoder_1']['bias'])
  assert 'mlm_bias' not in merged


def _finetune_setup(config):
  model_config = TransformerConfig.from_config(config.model, config.data.vocab_size, 'cpu')
  mesh = sharding.make_mesh(config.mesh)
  abstract = build.abstract_params(model_config, mesh, sharding.rules(config.mesh))
  fresh = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
  return fresh, abstract


def test_init_params_refuses_another_kind_vocabulary_or_size(tmp_path):
  """A params-only checkpoint of a tiny pre-trained encoder: a fine-tuning run takes its
  encoder, and refuses it when the kind, vocabulary size or vocabulary file differ, or when
  no array fits."""
  pretrain = bert.get_config('tiny')
  pretrain.data.vocab_size = VOCAB
  pretrain.data.vocab_path = write_lines(tmp_path / 'vocab.model', ['pieces'])
  fresh, abstract = _finetune_setup(pretrain)
  saved = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), fresh)
  path = saved_params.write_params(str(tmp_path / 'pretrained'), saved, pretrain.to_json(),
                                   {'kind': 'test'})

  def finetune(**changes):
    config = bert.get_config('tiny,finetune')
    config.data.vocab_size, config.data.labels, config.model.num_labels = VOCAB, ('a', 'b'), 2
    for key, value in changes.items():
      section, name = key.split('__')
      config[section][name] = value
    return config
  config = finetune()
  fresh, abstract = _finetune_setup(config)
  params = jax.device_get(partial_init.init_params(path, config, fresh, abstract,
                                                   pretrain.data.vocab_path))
  np.testing.assert_array_equal(params['embedding']['embedding'], 0.5)
  np.testing.assert_array_equal(params['classifier']['kernel'], 0.0)  # Fresh (zeros here).
  other_vocab = write_lines(tmp_path / 'other.model', ['other pieces'])
  vocab = pretrain.data.vocab_path
  with pytest.raises(ConfigError, match='holds a encoder_only model, and this run is '
                     'decoder_only'):
    partial_init.init_params(path, finetune(model__kind='decoder_only'), fresh, abstract, vocab)
  with pytest.raises(ConfigError, match='vocabulary of 40 pieces, this run has 41'):
    partial_init.init_params(path, finetune(data__vocab_size=41), fresh, abstract, vocab)
  with pytest.raises(ConfigError, match='whose pieces differ'):
    partial_init.init_params(path, config, fresh, abstract, other_vocab)
  narrow = finetune(model__d_model=16, model__d_ff=32)
  with pytest.raises(CheckpointError, match="has no array of this model's shape"):
    partial_init.init_params(path, narrow, *_finetune_setup(narrow), vocab)


@pytest.mark.parametrize('variant, key, value, message', [
    ('tiny', 'data.source', 'text', "config.model.kind='encoder_only' trains on text"),
    ('tiny', 'model.head', 'classification', 'config.model.head='),
    ('tiny,finetune', 'model.kind', 'encoder_decoder', "config.model.kind='encoder_only' (got "
     "'encoder_decoder')"),
    ('tiny,finetune', 'data.batching', 'packed', "config.data.batching='buckets' (got "
     "'packed')"),
    ('tiny,finetune', 'model.head', 'electra', "config.model.head 'classification' or "
     "'regression' (got 'electra')"),
    ('tiny,finetune', 'eval.best_metric', 'pearson', "config.eval.best_metric='pearson' must "
     'be one of'),
])
def test_config_check_refuses_encoder_only_mismatches(variant, key, value, message):
  config = bert.get_config(variant)
  config.data.labels, config.model.num_labels = ('neg', 'pos'), 2
  config_check.check(config)  # As shipped: accepted.
  section, name = key.split('.')
  config[section][name] = value
  with pytest.raises(ConfigError) as error:
    config_check.check(config)
  assert message in str(error.value)


def test_starting_from_a_checkpoint_needs_its_vocabulary_to_exist(tmp_path):
  """A missing vocab_path beside ckpt.init_from is refused before a vocabulary is trained in
  its place (which would then not match the checkpoint's)."""
  config = bert.get_config('tiny,finetune')
  config.data.labels, config.model.num_labels = ('neg', 'pos'), 2
  config.ckpt.init_from = str(tmp_path / 'pre' / 'checkpoints' / '20')
  config.data.vocab_path = str(tmp_path / 'pre' / 'vocab.model')
  with pytest.raises(ConfigError, match=r'config.data.vocab_path=.*vocab.model does not exist'):
    config_check.check(config)
  os.makedirs(tmp_path / 'pre')
  (tmp_path / 'pre' / 'vocab.model').write_bytes(b'a model')
  config_check.check(config)  # There: accepted (partial_init compares its bytes later).


WORDS = ('the cat dog bird sat ran on under a mat tree house red blue small big very quite '
         'good bad').split()
NEUTRAL = WORDS[:-2]


def _write_texts(directory, rng):
  """Unlabelled text over WORDS, and labelled TSVs over the other words whose label says
  whether 'good' or 'bad' occurs."""
  sentence = lambda words: ' '.join(rng.choice(words, rng.integers(3, 9)))
  write_lines(directory / 'train.txt', [sentence(WORDS) for _ in range(400)])
  write_lines(directory / 'eval.txt', [sentence(WORDS) for _ in range(40)])

  def labelled(count):
    lines = []
    for i in range(count):
      positive = i % 2 == 0
      words = sentence(NEUTRAL).split()
      words.insert(rng.integers(0, len(words) + 1), 'good' if positive else 'bad')
      lines.append(f'{" ".join(words)}\t{"pos" if positive else "neg"}')
    return lines
  write_lines(directory / 'train.tsv', labelled(200))
  write_lines(directory / 'eval.tsv', labelled(60))


def _pretrain_config(data_dir):
  config = bert.get_config('tiny')
  config.data.data_dir = str(data_dir)
  config.data.train_text, config.data.eval_text = 'train.txt', 'eval.txt'
  config.data.vocab_size = VOCAB
  config.opt.schedule, config.opt.lr_scale = 'constant', 1e-3  # Resumes at any step.
  config.train.num_steps = 20
  config.train.eval_every = config.ckpt.every = 10
  return config


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """(data folder, workdir) of the tiny BERT pre-trained 20 steps, saving steps 10 and 20."""
  data_dir = tmp_path_factory.mktemp('bert_data')
  _write_texts(data_dir, np.random.default_rng(8))
  workdir = tmp_path_factory.mktemp('bert_pretrained')
  figures = train.train_and_evaluate(_pretrain_config(data_dir), str(workdir))
  assert figures['step'] == 20 and np.isfinite(figures['eval_loss'])
  return data_dir, workdir


@pytest.mark.slow
def test_a_resumed_pretraining_draws_the_masks_of_an_uninterrupted_one(pretrained, tmp_path):
  data_dir, workdir = pretrained
  resumed = shutil.copytree(workdir, tmp_path / 'resumed')
  shutil.rmtree(resumed / 'checkpoints' / '20')
  os.remove(resumed / 'final.json')
  assert train.train_and_evaluate(_pretrain_config(data_dir), str(resumed))['step'] == 20
  straight = saved_params.load_params(str(workdir / 'checkpoints' / '20'))
  again = saved_params.load_params(str(resumed / 'checkpoints' / '20'))
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(a, b)
  at_10 = saved_params.load_params(str(workdir / 'checkpoints' / '10'))
  assert not leaves_equal(at_10, straight)  # The second half trained.


def _finetune_from(pretrained):
  """configs/bert.py:tiny,finetune on the fixture's labelled files, starting from its step 20;
  (config, pre-training workdir)."""
  data_dir, pre = pretrained
  config = bert.get_config('tiny,finetune')
  config.data.data_dir = str(data_dir)
  config.data.train_tsv, config.data.eval_tsv = 'train.tsv', 'eval.tsv'
  config.data.vocab_size, config.data.vocab_path = VOCAB, str(pre / 'vocab.model')
  config.ckpt.init_from = str(pre / 'checkpoints' / '20')
  return config, pre


@pytest.mark.slow
def test_finetuning_a_pretrained_encoder_classifies(pretrained, tmp_path, monkeypatch):
  config, pre = _finetune_from(pretrained)
  config.train.num_steps, config.opt.warmup_steps = 30, 3
  started = []  # The params the run starts from, as partial_init gives them.
  real_init = partial_init.init_params

  def spy(*args):
    params = real_init(*args)
    started.append(jax.device_get(params))  # The train step donates (deletes) the arrays.
    return params
  monkeypatch.setattr(partial_init, 'init_params', spy)
  workdir = tmp_path / 'finetune'
  figures = train.train_and_evaluate(config, str(workdir))
  assert figures['step'] == 30
  for name in ('eval_accuracy', 'eval_macro_f1', 'eval_mcc'):
    assert name in figures, figures
  # The keyword decides the label: a model that reads it is right where chance (0.5 on 60
  # balanced examples, sd 0.065) is 3 sd lower.
  assert figures['eval_accuracy'] >= 0.7, figures
  with open(workdir / 'config.json') as f:
    saved = json.load(f)
  assert tuple(saved['data']['labels']) == ('neg', 'pos')
  assert saved['model']['num_labels'] == 2
  with open(workdir / 'best_eval.json') as f:
    best = json.load(f)
  # The kept step is the first of the evaluations' highest accuracy, read back from the log.
  accuracy = scalar_events(workdir)['eval/accuracy']
  assert max(accuracy) == 30 and len(accuracy) >= 2, accuracy
  top = max(accuracy.values())
  assert best['metric'] == 'accuracy'
  assert best['step'] == min(step for step, value in accuracy.items() if value == top)
  assert best['figures']['eval_accuracy'] == pytest.approx(top)
  assert os.path.isdir(workdir / 'best_params')
  best_params = saved_params.load_params(str(workdir / 'best_params'))
  assert best_params['classifier']['kernel'].shape == (32, 2)
  # Step 0 of the run: the pre-trained encoder and embeddings, a fresh head.
  pretrained_params = saved_params.load_params(str(pre / 'checkpoints' / '20'))
  (start,) = started
  for name in ('embedding', 'type_embedding', 'embedder', 'encoder_0', 'encoder_1',
               'encoder_norm'):
    assert leaves_equal(start[name], pretrained_params[name]), name
  assert 'mlm_bias' not in start and 'classifier' in start


@pytest.mark.slow
def test_finetuning_with_frozen_embeddings_keeps_the_pretrained_ones(pretrained, tmp_path):
  """opt.frozen in a run: the pre-trained embeddings are saved unchanged, the encoder moved."""
  config, pre = _finetune_from(pretrained)
  config.train.num_steps, config.opt.warmup_steps = 4, 1
  config.train.eval_every = config.ckpt.every = 4
  config.opt.frozen = 'embedding,embedder,type_embedding'
  train.train_and_evaluate(config, str(tmp_path / 'frozen'))
  pretrained_params = saved_params.load_params(str(pre / 'checkpoints' / '20'))
  tuned = saved_state_field(f'{tmp_path}/frozen/checkpoints/4')
  for name in ('embedding', 'embedder', 'type_embedding'):
    assert leaves_equal(tuned[name], pretrained_params[name]), name
  assert not leaves_equal(tuned['encoder_0'], pretrained_params['encoder_0'])


# The pipeline's masked-LM rows and next-sentence pairs (data/pipeline.py).

class _Pieces:
  """A stand-in vocabulary of the given pieces (tokenizer.word_start_table reads vocab_size and
  piece)."""

  def __init__(self, pieces):
    self.pieces = list(pieces)
    self.vocab_size = len(self.pieces)

  def piece(self, token_id):
    return self.pieces[token_id]


PIECES = _Pieces(['<pad>', '</s>', '<unk>', '[CLS]', '[SEP]', '[MASK]', '\u2581the', '\u2581cat',
                  's', '\u2581sat', 'ting', '\u2581on', 'a', '\u2581'])
# Lines over PIECES, each ending in EOS, and their word-start flags (2: a word's first piece,
# unknown, [MASK] and EOS; 1: a later piece).
LINES = [[6, 7, 8, 9, EOS],  # ▁the ▁cat s ▁sat
         [13, 12, 10, MASK, EOS],  # ▁ a ting [MASK]
         [EOS],  # An empty line.
         [11, 2, 8, EOS]]  # ▁on <unk> s
LINE_FLAGS = [[2, 2, 1, 2, 2], [2, 1, 1, 2, 2], [2], [2, 2, 1, 2]]


def test_masked_lm_rows_are_cls_then_the_sentence_and_flag_word_starts():
  # Views in another order than the flat array's (as a filtered split's are), one left out.
  stored = Ragged.from_sequences([LINES[3], LINES[0], [30, 31, EOS], LINES[1], LINES[2]])
  split = pipeline.Split(Ragged.from_sequences([[]] * 4), stored.subset(np.array([1, 3, 4, 0])),
                         ['s0', 's1', 's2', 's3'], ['r0', 'r1', 'r2', 'r3'])
  rows = pipeline._masked_lm_split(split, PIECES)
  assert [list(row) for row in rows.targets] == [
      [CLS, 6, 7, 8, 9, EOS], [CLS, 13, 12, 10, MASK, EOS], [CLS, EOS], [CLS, 11, 2, 8, EOS]]
  assert [list(row) for row in rows.inputs] == [
      [2, 2, 2, 1, 2, 2], [2, 2, 1, 1, 2, 2], [2, 2], [2, 2, 2, 1, 2]]
  for ragged in (rows.inputs, rows.targets):
    assert ragged.tokens.dtype == np.int32
    np.testing.assert_array_equal(ragged.starts, [0, 6, 12, 14])
    np.testing.assert_array_equal(ragged.lengths, [6, 6, 2, 5])
    assert len(ragged.tokens) == 19
  assert rows.sources == ['s0', 's1', 's2', 's3'] and rows.references == ['r0', 'r1', 'r2', 'r3']


def test_masked_lm_flags_follow_a_trained_vocabularys_word_marks(tmp_path):
  """A SentencePiece vocabulary trained with the special pieces: a sentence written word by word
  (each word encoded alone) is flagged 2 at each word's first piece and 1 at the others."""
  rng = np.random.default_rng(9)
  words = 'the cat dog sat on mat a big small red house tree ran fast slow'.split()
  path = str(tmp_path / 'vocab.model')
  tokenizer.train_sentencepiece([' '.join(rng.choice(words, rng.integers(3, 9)))
                                 for _ in range(300)], path, 30, special=True)
  vocab = tokenizer.SentencePieceVocabulary(path)
  assert [vocab.piece(i) for i in (CLS, SEP, MASK)] == ['[CLS]', '[SEP]', '[MASK]']
  sentences = [['small', 'house', 'ran'], ['the', 'tree'], words]
  lines, expected = [], []
  for sentence in sentences:
    pieces = [vocab.encode([word])[0] for word in sentence]
    lines.append(sum(pieces, []) + [EOS])
    expected.append([2] + sum(([2] + [1] * (len(word) - 1) for word in pieces), []) + [2])
  assert 1 in sum(expected, [])  # Some word has later pieces.
  rows = pipeline._masked_lm_split(
      pipeline.Split(Ragged.from_sequences([[]] * 3), Ragged.from_sequences(lines), [], []),
      vocab)
  assert [list(row) for row in rows.targets] == [[CLS] + line for line in lines]
  assert [list(row) for row in rows.inputs] == expected


@pytest.mark.parametrize('name', ['train', 'eval', 'test', 'valid'])
def test_two_lines_pair_each_with_the_other_as_its_next(name):
  """Two lines have no other line to draw: each is paired with the next (wrapping), flagged
  IS_NEXT (3) at [CLS], the first without its EOS, then [SEP] and the second with it, whatever
  the split's draw ('test' and 'valid' draw a random second line for one pair, which two lines
  cannot have; 'train' and 'eval' for none)."""
  split = pipeline.Split(Ragged.from_sequences([[]] * 2),
                         Ragged.from_sequences([LINES[0], LINES[3]]), ['a', 'b'], [])
  pairs = pipeline._sentence_pairs(split, name)
  np.testing.assert_array_equal(pairs.inputs.lengths, [0, 0])
  rows = pipeline._masked_lm_split(pairs, PIECES)
  assert [list(row) for row in rows.targets] == [[CLS, 6, 7, 8, 9, SEP, 11, 2, 8, EOS],
                                                 [CLS, 11, 2, 8, SEP, 6, 7, 8, 9, EOS]]
  assert [list(row) for row in rows.inputs] == [[3, 2, 2, 1, 2, 2, 2, 2, 1, 2],
                                                [3, 2, 2, 1, 2, 2, 2, 1, 2, 2]]
  np.testing.assert_array_equal(rows.inputs.starts, rows.targets.starts)
  np.testing.assert_array_equal(rows.inputs.lengths, rows.targets.lengths)
  assert rows.sources == ['a', 'b']


def test_sentence_pairs_draw_half_random_second_lines_once_per_split():
  """2000 one-piece lines (id 6 + i; even ids begin a word): each row is [CLS] line i [SEP]
  line j EOS, flagged 3 when j is i + 1 (the last line's: 0) and 4 when j is any other line,
  about half of them; the same on every call, another draw for another split."""
  count = 2000
  vocab = _Pieces(['<pad>', '</s>', '<unk>', '[CLS]', '[SEP]', '[MASK]']
                  + ['\u2581w' if i % 2 == 0 else 'x' for i in range(6, 6 + count)])
  lines = [[6 + i, EOS] for i in range(count)]
  split = pipeline.Split(Ragged.from_sequences([[]] * count), Ragged.from_sequences(lines), [],
                         [])

  def rows(name):
    made = pipeline._masked_lm_split(pipeline._sentence_pairs(split, name), vocab)
    np.testing.assert_array_equal(made.targets.lengths, 5)
    np.testing.assert_array_equal(made.inputs.starts, made.targets.starts)
    return np.stack(list(made.targets)), np.stack(list(made.inputs))
  tokens, flags = rows('train')
  first, second = tokens[:, 1] - 6, tokens[:, 3] - 6
  np.testing.assert_array_equal(tokens[:, [0, 2, 4]], np.tile([CLS, SEP, EOS], (count, 1)))
  np.testing.assert_array_equal(first, np.arange(count))
  assert np.all((second >= 0) & (second < count))
  following = (np.arange(count) + 1) % count
  np.testing.assert_array_equal(flags[:, 0], np.where(second == following, 3, 4))
  word_start = lambda ids: np.where(ids % 2 == 0, 2, 1)
  np.testing.assert_array_equal(flags[:, 1:], np.stack(
      [word_start(tokens[:, 1]), np.full(count, 2), word_start(tokens[:, 3]), np.full(count, 2)],
      1))
  random = flags[:, 0] == 4
  assert abs(random.sum() - count / 2) < 6 * np.sqrt(count / 4), random.sum()
  # The random second lines are spread over the file, not one offset from the first.
  assert len(np.unique((second - first)[random] % count)) > 200
  again_tokens, again_flags = rows('train')
  np.testing.assert_array_equal(again_tokens, tokens)
  np.testing.assert_array_equal(again_flags, flags)
  eval_tokens, eval_flags = rows('eval')
  assert not np.array_equal(eval_flags[:, 0], flags[:, 0])
  assert not np.array_equal(eval_tokens, tokens)


# Next-sentence prediction (training/encoder_tasks.py, model/encoder_only.py).

NSP_CONFIG = dataclasses.replace(CONFIG, next_sentence=True)


def test_next_sentence_params_exist_only_when_asked_and_score_the_pooled_state():
  params = _params(NSP_CONFIG)
  assert 'pooler' not in _params(CONFIG) and 'next_sentence' not in _params(CONFIG)
  assert params['pooler']['kernel'].shape == (16, 16)
  assert params['next_sentence']['kernel'].shape == (16, 2)
  assert set(params) - set(_params(CONFIG)) == {'pooler', 'next_sentence'}
  states = np.random.default_rng(10).normal(size=(2, 3, 16)).astype(np.float32)
  logits = encoder_only.EncoderOnly(NSP_CONFIG).apply(
      {'params': params}, jnp.asarray(states), method='next_sentence_logits')
  pooled = np.tanh(states @ params['pooler']['kernel'] + params['pooler']['bias'])
  expected = pooled @ params['next_sentence']['kernel'] + params['next_sentence']['bias']
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


def _pair_segment(rng, first, second, cls_flag):
  """(tokens, flags) of [CLS] `first` ordinary ids [SEP] `second` ids EOS; words of 1 or 2
  pieces, `cls_flag` at [CLS]."""
  tokens = ([CLS] + list(rng.integers(6, VOCAB, first)) + [SEP]
            + list(rng.integers(6, VOCAB, second)) + [EOS])
  flags = [cls_flag] + [2 if token < 6 else int(rng.integers(1, 3)) for token in tokens[1:]]
  flags[1] = flags[first + 2] = 2  # Each sentence begins a word.
  return tokens, flags


def _nsp_batch():
  """Rows of length 32: an IS_NEXT pair, a NOT_NEXT pair, a packed row of a NOT_NEXT and an
  IS_NEXT pair, a row whose [CLS] is an ordinary word start (no pair), a padding row; with
  segment ids and positions. Returns the batch and each segment's (row, start, length)."""
  rng = np.random.default_rng(11)
  length = 32
  layout = [[(12, 9, encoder_tasks.IS_NEXT)], [(7, 14, encoder_tasks.NOT_NEXT)],
            [(6, 5, encoder_tasks.NOT_NEXT), (5, 7, encoder_tasks.IS_NEXT)],
            [(10, 8, encoder_tasks.WORD_START)], []]
  fields = {name: np.zeros((len(layout), length), np.int32)
            for name in ('targets', 'inputs', 'targets_segments', 'targets_positions')}
  segments = []
  for row, pairs in enumerate(layout):
    at = 0
    for number, spec in enumerate(pairs):
      tokens, flags = _pair_segment(rng, *spec)
      span = slice(at, at + len(tokens))
      fields['targets'][row, span], fields['inputs'][row, span] = tokens, flags
      fields['targets_segments'][row, span] = number + 1
      fields['targets_positions'][row, span] = np.arange(len(tokens))
      segments.append((row, at, len(tokens)))
      at += len(tokens)
  return {name: jnp.asarray(value) for name, value in fields.items()}, segments


def test_next_sentence_loss_is_the_cross_entropy_at_each_pairs_cls(monkeypatch):
  """The NSP sums against each pair's segment encoded alone (its corrupted tokens, no packing)
  and scored by numpy; the MLM sums as a model without NSP gives them on the same batch with
  plain word-start flags at [CLS] (the same masks); 'loss' the MLM sum plus the NSP sum scaled
  by masked tokens / pairs, so summarize's loss is MLM mean + NSP mean."""
  params = _params(NSP_CONFIG)
  batch, segments = _nsp_batch()
  key = jax.random.key(12)
  metrics, (positions, chosen), corrupted = _spied_mlm_metrics(
      monkeypatch, NSP_CONFIG, whole_word=True)(params, batch, {'dropout': key})
  flags = np.asarray(batch['inputs'])
  plain_batch = dict(batch, inputs=jnp.asarray(np.where(flags >= 3, 2, flags)))
  plain_params = {name: value for name, value in params.items()
                  if name not in ('pooler', 'next_sentence')}
  plain, (plain_positions, plain_chosen), plain_corrupted = _spied_mlm_metrics(
      monkeypatch, CONFIG, whole_word=True)(plain_params, plain_batch, {'dropout': key})
  assert set(plain) == {'loss', 'nll', 'correct', 'weight'}
  for drawn, again in [(positions, plain_positions), (chosen, plain_chosen),
                       (corrupted, plain_corrupted)]:
    np.testing.assert_array_equal(drawn, again)
  assert np.any(np.asarray(corrupted) != np.asarray(batch['targets']))
  np.testing.assert_allclose(float(metrics['nll']), float(plain['nll']), rtol=1e-6)
  assert float(metrics['correct']) == float(plain['correct'])
  assert float(metrics['weight']) == float(plain['weight']) > 0
  # Each pair alone: its [CLS] state through the pooler and the two logits.
  model = encoder_only.EncoderOnly(NSP_CONFIG)
  nll, correct = [], 0
  for row, start, size in segments:
    if flags[row, start] not in (encoder_tasks.IS_NEXT, encoder_tasks.NOT_NEXT):
      continue
    alone = jnp.asarray(corrupted)[row:row + 1, start:start + size]
    states = model.apply({'params': params}, alone, method='encode')
    logits = np.asarray(model.apply({'params': params}, states,
                                    method='next_sentence_logits'), np.float64)[0, 0]
    label = int(flags[row, start] == encoder_tasks.NOT_NEXT)
    nll.append(np.log(np.exp(logits).sum()) - logits[label])
    correct += int(logits.argmax() == label)
  assert len(nll) == 4 and float(metrics['next_sentence_weight']) == 4
  np.testing.assert_allclose(float(metrics['next_sentence_loss']), sum(nll), rtol=1e-5)
  assert float(metrics['next_sentence_correct']) == correct
  weight = float(metrics['weight'])
  np.testing.assert_allclose(float(metrics['loss']),
                             float(plain['loss']) + sum(nll) * weight / 4, rtol=1e-5)
  figures = optim.summarize(jax.device_get(metrics))
  assert figures['next_sentence_loss'] == pytest.approx(sum(nll) / 4, rel=1e-5)
  assert figures['next_sentence_accuracy'] == correct / 4
  assert figures['loss'] == pytest.approx(float(plain['loss']) / weight + sum(nll) / 4,
                                          rel=1e-5)
  assert 'next_sentence_loss' not in optim.summarize(jax.device_get(plain))


@pytest.mark.parametrize('head', ['classification', 'regression'])
def test_next_sentence_needs_the_mlm_head(head):
  config = bert.get_config('tiny')
  config.model.next_sentence = True
  assert TransformerConfig.from_config(config.model, VOCAB, 'cpu').next_sentence
  config.model.head, config.model.num_labels = head, 2
  with pytest.raises(ConfigError, match=rf"config\.model\.next_sentence=True .*"
                     rf"config\.model\.head='{head}': set it with head='mlm' only"):
    TransformerConfig.from_config(config.model, VOCAB, 'cpu')
