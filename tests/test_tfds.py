"""TFDS WMT sources under tfds.testing.mock_data: training end to end, reuse, direction, errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from t2t_jax.compile import dry_run as dry_run_lib
from t2t_jax.data import pipeline as data
from t2t_jax.data import sources
from t2t_jax.training import train



@pytest.fixture
def mock_wmt():
  """Random WMT examples from TFDS's mock (the `test` extra installs TFDS and TensorFlow)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=64):
    yield tfds


def _tfds_config(config, tmp_path):
  """`config` reading mock wmt14_translate/de-en, sized for a few CPU steps."""
  config.data.source = 'tfds'
  config.data.tfds_name = 'wmt14_translate/de-en'
  config.data.tfds_data_dir = str(tmp_path / 'tfds')
  config.data.cache_dir = str(tmp_path / 'cache')
  config.data.vocab_size = 24
  config.data.max_len = 32
  config.data.batch_tokens = 256
  config.data.min_bucket = 16
  config.model.max_len = 64
  return config


def _wmt_pairs(tfds, split, source_lang='en', target_lang='de'):
  dataset = tfds.load('wmt14_translate/de-en', split=split)
  return [(e[source_lang].decode().strip(), e[target_lang].decode().strip())
          for e in tfds.as_numpy(dataset)]


@pytest.mark.slow
def test_mock_wmt_trains_end_to_end_then_reuses_vocab_and_cache(tiny_config, tmp_path, mock_wmt,
                                                                 caplog):
  config = _tfds_config(tiny_config, tmp_path)
  config.train.num_steps = 3
  config.train.eval_every = 3
  config.ckpt.every = 0
  config.eval.bleu_sentences = 4
  workdir = str(tmp_path / 'run')
  results = train.train_and_evaluate(config, workdir)
  assert results['step'] == 3 and np.isfinite(results['eval_loss'])
  vocab = tmp_path / 'cache' / 'vocab.model'
  entries = sorted(os.listdir(tmp_path / 'cache' / 'tokens'))
  assert [e.split('-')[0] for e in entries] == ['eval', 'train']
  mtime = os.path.getmtime(vocab)
  config.train.num_steps = 5
  config.train.eval_every = 5
  with caplog.at_level('INFO'):
    again = train.train_and_evaluate(config, str(tmp_path / 'second'))
  assert again['step'] == 5
  assert os.path.getmtime(vocab) == mtime and 'Reusing the vocabulary' in caplog.text
  assert 'Training a 24-piece' not in caplog.text
  assert caplog.text.count('Token cache hit') == 2 and 'Tokenising' not in caplog.text
  assert sorted(os.listdir(tmp_path / 'cache' / 'tokens')) == entries


@pytest.mark.slow
def test_wmt14_config_defaults_to_tfds_and_works_under_mock_data(tmp_path, mock_wmt):
  from configs import wmt14_ende  # pylint: disable=g-import-not-at-top
  config = wmt14_ende.get_config('base')
  assert (config.data.source, config.data.tfds_name) == ('tfds', 'wmt14_translate/de-en')
  assert (config.data.tfds_eval_split, config.data.tfds_test_split) == ('validation', 'test')
  config.data.vocab_size = 24  # Mock text has a dozen characters, not 37k pieces.
  config.data.vocab_type = 'unigram'
  config.data.tfds_data_dir = str(tmp_path / 'tfds')
  task = data.load(config, str(tmp_path))
  assert len(task.train) == 64 and len(task.eval) == 64
  pairs = _wmt_pairs(mock_wmt, 'validation')
  assert (task.eval.sources, task.eval.references) == tuple(map(list, zip(*pairs)))
  assert task.vocab.decode(task.eval.inputs[0]) == ' '.join(pairs[0][0].split())
  test, _ = data.load_split(config, str(tmp_path), 'test', task.vocab)
  assert len(test) == 64
  train_batches, _ = data.make_batchers(config, task.train, task.eval, 8)
  batch = train_batches[0]
  assert batch['inputs'].shape[0] % 8 == 0 and (batch['inputs'][:, 0] > 0).any()
  assert dry_run_lib.dry_run(_shrunk(config))['batch_shape'][0] % 8 == 0


def _shrunk(config):
  config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 2
  config.model.num_encoder_layers = config.model.num_decoder_layers = 1
  config.data.batch_tokens = 512
  return config


def test_direction_and_eval_dataset_are_configurable(tiny_config, tmp_path, mock_wmt):
  config = _tfds_config(tiny_config, tmp_path)
  config.data.source_lang, config.data.target_lang = 'de', 'en'
  config.data.tfds_name = 'wmt17_translate/de-en'
  config.data.tfds_eval_name = 'wmt14_translate/de-en'
  assert sources.open_split(config.data, 'train').name == 'wmt17_translate/de-en[train]'
  assert sources.open_split(config.data, 'eval').name == 'wmt14_translate/de-en[validation]'
  task = data.load(config, str(tmp_path))
  pairs = _wmt_pairs(mock_wmt, 'validation', 'de', 'en')
  assert (task.eval.sources, task.eval.references) == tuple(map(list, zip(*pairs)))


def test_unknown_language_is_refused(tiny_config, tmp_path, mock_wmt):
  config = _tfds_config(tiny_config, tmp_path)
  config.data.target_lang = 'fr'
  with pytest.raises(data.DataError, match=r"wmt14_translate/de-en\[train\] has languages "
                     r"\['de', 'en'\]; .*target_lang='fr'"):
    data.load(config, str(tmp_path))


@pytest.mark.slow
def test_core_modules_never_import_tensorflow():
  code = ('import sys; import t2t_jax.training.train, t2t_jax.data.pipeline, t2t_jax.prepare; '
          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
          "('tensorflow', 'tensorflow_datasets')))")
  output = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT)).stdout
  assert output.strip() == '[]'


@pytest.mark.parametrize('bad, message', [
    (b'', r'wmt14_translate/de-en\[train\] example 1 \(de\): empty line'),
    (b'\xff ok', r'wmt14_translate/de-en\[train\] example 1 \(de\): not valid UTF-8 \(byte 0\)')])
def test_bad_tfds_examples_are_named_or_skipped(tiny_config, tmp_path, caplog, bad, message):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  english, german = ['a house', 'the cat', 'a dog'], [b'ein haus', bad, b'ein hund']
  dataset_fn = lambda *args, **kwargs: tf.data.Dataset.from_tensor_slices(
      {'en': english, 'de': german})
  config = _tfds_config(tiny_config, tmp_path)
  with tfds.testing.mock_data(as_dataset_fn=dataset_fn):
    with pytest.raises(data.DataError, match=message + r"\. .*bad_lines='skip'"):
      list(sources.open_split(config.data, 'train').read())
    config.data.bad_lines = 'skip'
    with caplog.at_level('WARNING'):
      pairs = list(sources.open_split(config.data, 'train').read())
  assert pairs == [('a house', 'ein haus'), ('a dog', 'ein hund')]
  assert 'wmt14_translate/de-en[train]: skipped 1 of 3 pairs' in caplog.text


@pytest.mark.slow
def test_training_from_a_prepared_cache_needs_no_tensorflow(tiny_config, tmp_path, mock_wmt):
  config = _tfds_config(tiny_config, tmp_path)
  prepared = data.load(config, '')
  code = ('import sys, json; from ml_collections import ConfigDict; from t2t_jax.data import pipeline; '
          'task = pipeline.load(ConfigDict(json.loads(sys.argv[1])), ""); '
          "print(len(task.train), len(task.eval), sorted(m for m in sys.modules "
          "if m.split('.')[0] in ('tensorflow', 'tensorflow_datasets')))")
  output = subprocess.run([sys.executable, '-c', code, config.to_json()], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT)).stdout
  assert output.split() == [str(len(prepared.train)), str(len(prepared.eval)), '[]']
