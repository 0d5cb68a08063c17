"""ELECTRA pre-training (Clark et al. 2020) of the encoder-only model: its parameters, its
objective against an independent computation, what the generator may propose, where each loss's
gradient reaches, its FLOPs, the config checks, and a run pre-trained then fine-tuned."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import dot_flops, encoder_only_params, leaves_equal, write_lines
from configs import bert
from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.checkpoints import saved_params
from t2t_jax.model import encoder_only
from t2t_jax.model import flops
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.training import build
from t2t_jax.training import encoder_tasks
from t2t_jax.training import tasks
from t2t_jax.training import train

PAD, EOS, CLS, SEP, MASK = 0, 1, 3, 4, 5
VOCAB = 40
CONFIG = TransformerConfig(
    vocab_size=VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
    kind='encoder_only', head='electra', generator_layers=1, norm='pre', positions='learned',
    max_len=32, dropout=0, attention_dropout=0, relu_dropout=0, deterministic=True,
    type_vocab_size=2)
LENGTHS = (25, 17, 9, 28)  # Ordinary tokens per row of the test batch.


def _params(config=CONFIG):
  return encoder_only_params(config)


def _batch():
  """[CLS] then ordinary tokens then EOS, padded to 32; every token a word start."""
  rng = np.random.default_rng(4)
  tokens = np.zeros((len(LENGTHS), 32), np.int32)
  for row, count in enumerate(LENGTHS):
    tokens[row, :count + 2] = [CLS, *rng.integers(6, VOCAB, count), EOS]
  return {'targets': jnp.asarray(tokens),
          'inputs': jnp.asarray(np.where(tokens > 0, encoder_tasks.WORD_START, 0))}


def _spied_metrics(monkeypatch, config=CONFIG, **options):
  """jitted (params, batch, rngs) -> (electra_metrics' sums, the positions and chosen flags it
  drew, the generator's input, the discriminator's input)."""
  seen = {'replaced': []}
  real_choose, real_replace = encoder_tasks.choose, encoder_tasks.replace_chosen

  def choose(*args, **kwargs):
    seen['choose'] = real_choose(*args, **kwargs)
    return seen['choose']

  def replace(*args, **kwargs):
    seen['replaced'].append(real_replace(*args, **kwargs))
    return seen['replaced'][-1]
  monkeypatch.setattr(encoder_tasks, 'choose', choose)
  monkeypatch.setattr(encoder_tasks, 'replace_chosen', replace)
  model = encoder_only.EncoderOnly(config)

  @jax.jit
  def run(params, batch, rngs):
    seen['replaced'].clear()
    metrics = encoder_tasks.electra_metrics(model, params, batch, 0.0, rngs=rngs, **options)
    masked, replaced = seen['replaced']
    return metrics, seen['choose'], masked, replaced
  return run


def test_electra_has_a_generator_and_a_replaced_token_head_and_no_pooler():
  params = _params()
  assert {'generator_0', 'generator_norm', 'replaced_transform', 'replaced_output',
          'mlm_transform', 'mlm_norm', 'mlm_bias', 'encoder_0', 'encoder_1'} <= set(params)
  assert 'generator_1' not in params and 'pooler' not in params
  assert params['replaced_output']['kernel'].shape == (16, 1)
  two = _params(dataclasses.replace(CONFIG, generator_layers=2))
  assert {'generator_0', 'generator_1'} <= set(two)
  # The generator is a layer of the encoder's shape, with parameters of its own.
  shapes = lambda tree: jax.tree.map(np.shape, tree)
  assert shapes(params['generator_0']) == shapes(params['encoder_0'])
  assert not leaves_equal(params['generator_0'], params['encoder_0'])


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def test_electra_loss_is_the_generators_mlm_plus_weighted_replaced_token_detection(monkeypatch):
  run = _spied_metrics(monkeypatch, replaced_weight=7.0)
  params, batch = _params(), _batch()
  metrics, (positions, chosen), masked, replaced = run(params, batch,
                                                       {'dropout': jax.random.key(3)})
  tokens, positions, chosen = (np.asarray(a) for a in (batch['targets'], positions, chosen))
  masked, replaced = np.asarray(masked), np.asarray(replaced)
  rows, at = np.nonzero(chosen)
  cols = positions[rows, at]
  # The generator reads [MASK] at exactly the chosen positions.
  expected_masked = tokens.copy()
  expected_masked[rows, cols] = MASK
  np.testing.assert_array_equal(masked, expected_masked)
  # The discriminator reads the text with ordinary tokens proposed there and nowhere else.
  other = np.ones_like(tokens, bool)
  other[rows, cols] = False
  np.testing.assert_array_equal(replaced[other], tokens[other])
  assert np.all(replaced[rows, cols] >= encoder_tasks.FIRST_ORDINARY_ID)
  is_replaced = replaced != tokens
  assert 0 < is_replaced.sum() <= len(rows)
  # The generator's masked-LM sums, recomputed in float64 from the model's own methods.
  model = encoder_only.EncoderOnly(CONFIG)
  generated = model.apply({'params': params}, jnp.asarray(masked), method='generate')
  logits = np.asarray(model.apply({'params': params}, generated, method='mlm_logits'),
                      np.float64)[rows, cols]
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  nll = -log_probs[np.arange(len(rows)), tokens[rows, cols]].sum()
  np.testing.assert_allclose(float(metrics['nll']), nll, rtol=1e-5)
  assert int(metrics['weight']) == len(rows)
  assert int(metrics['correct']) == (logits.argmax(-1) == tokens[rows, cols]).sum()
  # The discriminator's: sigmoid cross-entropy over the real tokens, padding excluded.
  states = model.apply({'params': params}, jnp.asarray(replaced), method='encode')
  replaced_logits = np.asarray(model.apply({'params': params}, states,
                                           method='replaced_logits'), np.float64)
  real = tokens != PAD
  per_token = -np.where(is_replaced, _log_sigmoid(replaced_logits),
                        _log_sigmoid(-replaced_logits))
  detection = per_token[real].sum()
  np.testing.assert_allclose(float(metrics['replaced_loss']), detection, rtol=1e-5)
  assert int(metrics['replaced_weight']) == real.sum() == sum(LENGTHS) + 2 * len(LENGTHS)
  assert int(metrics['replaced_correct']) == ((replaced_logits > 0) == is_replaced)[real].sum()
  # 'loss' / 'weight' is the generator's mean + 7 x the discriminator's mean.
  np.testing.assert_allclose(float(metrics['loss']) / len(rows),
                             nll / len(rows) + 7.0 * detection / real.sum(), rtol=1e-5)


def test_the_generator_proposes_from_its_softmax_and_never_a_special_token(monkeypatch):
  """With the generator's bias far up for [MASK] and for token 17, every proposal is 17 (the
  special token is never drawn); a chosen 17 stays 17 and is not a replacement."""
  params = jax.tree.map(np.array, _params())
  params['mlm_bias'][MASK] = 1e4
  params['mlm_bias'][17] = 1e3
  run = _spied_metrics(monkeypatch)
  batch = _batch()
  metrics, (positions, chosen), _, replaced = run(params, batch, {'dropout': jax.random.key(5)})
  tokens = np.asarray(batch['targets'])
  rows, at = np.nonzero(np.asarray(chosen))
  cols = np.asarray(positions)[rows, at]
  np.testing.assert_array_equal(np.asarray(replaced)[rows, cols], 17)
  # Replaced tokens counted by the objective's labels: the chosen ones that were not 17.
  assert int(metrics['replaced_weight']) > 0
  changed = (np.asarray(replaced) != tokens).sum()
  assert changed == (tokens[rows, cols] != 17).sum()


def test_draws_depend_only_on_the_key(monkeypatch):
  run = _spied_metrics(monkeypatch)
  params, batch = _params(), _batch()
  first = run(params, batch, {'dropout': jax.random.key(11)})
  again = run(params, batch, {'dropout': jax.random.key(11)})
  assert leaves_equal(first, again)
  other = run(params, batch, {'dropout': jax.random.key(12)})
  assert not np.array_equal(np.asarray(first[3]), np.asarray(other[3]))
  assert leaves_equal(run(params, batch, None), run(params, batch, None))  # Evaluation: fixed.


def _gradients(replaced_weight):
  model = encoder_only.EncoderOnly(CONFIG)

  def mean_loss(params):
    sums = encoder_tasks.electra_metrics(model, params, _batch(), 0.0,
                                         replaced_weight=replaced_weight)
    return sums['loss'] / sums['weight']
  return jax.jit(jax.grad(mean_loss))(_params())


def test_the_detection_loss_trains_the_encoder_and_embeddings_but_not_the_generator():
  """No gradient flows through the generator's draw: its layers and masked-LM head get the
  same gradient with the detection loss weighted 50 as with it off; the encoder gets none
  without it, and the shared embeddings get more with it."""
  with_detection, without = _gradients(50.0), _gradients(0.0)
  for name in ('generator_0', 'generator_norm', 'mlm_transform', 'mlm_norm', 'mlm_bias'):
    for a, b in zip(jax.tree.leaves(with_detection[name]), jax.tree.leaves(without[name]),
                    strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)
  for name in ('encoder_0', 'encoder_1', 'replaced_transform', 'replaced_output'):
    assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(without[name])), name
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(with_detection[name])), name
  assert not leaves_equal(with_detection['embedding'], without['embedding'])


@pytest.mark.parametrize('variant', ['tiny', 'tiny,electra'])
def test_analytic_flops_equal_the_matmuls_of_the_pretraining_step(variant):
  config = bert.get_config(variant)
  config.model.generator_layers = 2 if variant.endswith('electra') else 1
  setup = build.build(config, VOCAB)
  rows, length = 4, 32
  batch = {'inputs': jax.ShapeDtypeStruct((rows, length), jnp.int32),
           'targets': jax.ShapeDtypeStruct((rows, length), jnp.int32)}
  step = build.train_step_of(config, setup.model_config, setup.optimizer,
                             objective=tasks.for_config(config).objective)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    jaxpr = jax.make_jaxpr(step)(setup.abstract_state, batch,
                                 jax.ShapeDtypeStruct((2,), jnp.uint32))
  expected = flops.train_step_flops(setup.model_config, rows, length, length)
  assert dot_flops(jaxpr.jaxpr) == expected


@pytest.mark.parametrize('model_overrides, message', [
    ({'generator_layers': 0}, r"generator_layers=0 must be at least 1 with "
                              r"config\.model\.head='electra'"),
    ({'next_sentence': True}, r"next_sentence=True is a pre-training objective, and "
                              r"config\.model\.head='electra': set it with head='mlm' only"),
])
def test_electra_configs_that_cannot_be_built_are_refused(model_overrides, message):
  config = bert.get_config('tiny,electra')
  for key, value in model_overrides.items():
    config.model[key] = value
  with pytest.raises(ConfigError, match=message):
    TransformerConfig.from_config(config.model, VOCAB)


def _texts(directory):
  rng = np.random.default_rng(8)
  words = 'the cat dog bird sat ran on under a mat tree house red blue small big good bad'.split()
  sentence = lambda: ' '.join(rng.choice(words, rng.integers(3, 9)))
  write_lines(directory / 'train.txt', [sentence() for _ in range(300)])
  write_lines(directory / 'eval.txt', [sentence() for _ in range(30)])
  labelled = [f'{sentence()} {"good" if i % 2 else "bad"}\t{"pos" if i % 2 else "neg"}'
              for i in range(60)]
  write_lines(directory / 'train.tsv', labelled[:40])
  write_lines(directory / 'eval.tsv', labelled[40:])


def _electra_config(data_dir, steps):
  config = bert.get_config('tiny,electra')
  config.data.data_dir = str(data_dir)
  config.data.train_text, config.data.eval_text = 'train.txt', 'eval.txt'
  config.data.vocab_size = VOCAB
  config.opt.schedule, config.opt.lr_scale = 'constant', 1e-3  # Resumes at any step.
  config.train.num_steps = steps
  config.train.eval_every = config.ckpt.every = 5
  return config


@pytest.mark.slow
def test_electra_pretrains_then_fine_tunes_its_discriminator(tmp_path, caplog):
  """The run's figures name both losses; fine-tuning loads the discriminator and its
  embeddings and leaves the generator. (A resumed run's draws: the masked-LM resume test in
  test_encoder_only.py; ELECTRA draws from the same step key, test_draws_depend_only_on_the_key.)"""
  _texts(tmp_path)
  straight = tmp_path / 'pretrained'
  figures = train.train_and_evaluate(_electra_config(tmp_path, 10), str(straight))
  assert figures['step'] == 10
  for name in ('eval_loss', 'eval_accuracy', 'eval_replaced_loss', 'eval_replaced_accuracy'):
    assert np.isfinite(figures[name]), (name, figures)
  # Nearly every real token is an original one: detection is right on most from the start.
  assert figures['eval_replaced_accuracy'] > 0.5

  config = bert.get_config('tiny,finetune')
  config.data.data_dir = str(tmp_path)
  config.data.train_tsv, config.data.eval_tsv = 'train.tsv', 'eval.tsv'
  config.data.vocab_size, config.data.vocab_path = VOCAB, str(straight / 'vocab.model')
  config.ckpt.init_from = str(straight / 'checkpoints' / '10')
  config.train.num_steps, config.opt.warmup_steps = 2, 1
  config.train.eval_every = config.ckpt.every = 2
  caplog.set_level('INFO')
  train.train_and_evaluate(config, str(tmp_path / 'finetune'))
  pretrained = saved_params.load_params(config.ckpt.init_from)
  tuned = saved_params.load_params(str(tmp_path / 'finetune' / 'checkpoints' / '2'))
  shared = sorted(set(pretrained) & set(tuned))
  assert shared == ['embedder', 'embedding', 'encoder_0', 'encoder_1', 'encoder_norm',
                    'type_embedding']
  message = (f'Initialised from {config.ckpt.init_from}: loaded {", ".join(shared)}; '
             f'initialised fresh {", ".join(sorted(set(tuned) - set(pretrained)))}; '
             f'not used {", ".join(sorted(set(pretrained) - set(tuned)))}')
  assert message in '\n'.join(record.getMessage() for record in caplog.records)
  assert 'generator_0' in message.split('not used')[1]
