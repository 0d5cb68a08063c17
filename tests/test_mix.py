"""Training on a mix of parallel sources: weights (upsampling, fractional shares), the tag of
tagged back-translation, one-line errors for a bad part, and exact resume after kill -9."""

import logging as std_logging
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, leaves_equal, saved_state_field, text_config, write_lines
from t2t_jax import ConfigError
from t2t_jax.data import pipeline
from t2t_jax.data import sources
from t2t_jax.errors import DataError
from t2t_jax.training import train


def _pairs(tmp_path, name, count, start=0):
  src = write_lines(tmp_path / f'{name}.src', [f'source {n}' for n in range(start, start + count)])
  tgt = write_lines(tmp_path / f'{name}.tgt', [f'target {n}' for n in range(start, start + count)])
  return src, tgt


def _data_config(unused_tiny_config, tmp_path, **values):
  """A fresh tiny config's data on text files (text_config changes the config it is given)."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  config = text_config(tiny.get_config(), tmp_path).data
  real = _pairs(tmp_path, 'real', 10)
  config.train_src, config.train_tgt = real
  for key, value in values.items():
    config[key] = value
  return config


def test_weights_upsample_and_take_a_fixed_share_and_tags_mark_the_extra_sources(
    tiny_config, tmp_path, caplog):
  synthetic = _pairs(tmp_path, 'synthetic', 40, start=100)
  config = _data_config(tiny_config, tmp_path, extra_src=synthetic[0], extra_tgt=synthetic[1],
                        mix_weights='2,0.5', extra_tag='<BT>')
  with caplog.at_level(std_logging.INFO):
    pairs = list(sources.open_split(config, 'train').read())
  real = [p for p in pairs if not p[0].startswith('<BT> ')]
  tagged = [p for p in pairs if p[0].startswith('<BT> ')]
  assert sorted(real) == sorted([(f'source {n}', f'target {n}') for n in range(10)] * 2)
  # Half of the 40 in expectation (a fixed draw): each kept pair once, tagged, still aligned.
  assert 10 <= len(tagged) <= 30 and len(set(tagged)) == len(tagged)
  assert all(s == f'<BT> source {t.split()[1]}' for s, t in tagged)
  assert 'Training mix: ' in caplog.text
  assert f'{synthetic[0]} / {synthetic[1]}: 40 pairs x 0.5 = {len(tagged)}, sources tagged ' \
         "'<BT>'" in caplog.text
  assert 'real.src' in caplog.text and '10 pairs x 2 = 20' in caplog.text
  # The same share on every read, and the eval split is left alone.
  assert list(sources.open_split(config, 'train').read()) == pairs
  assert not any('<BT>' in s for s, _ in sources.open_split(config, 'eval').read())
  # The weights and the tag are part of the data's identity (the token cache's key).
  other = _data_config(tiny_config, tmp_path, extra_src=synthetic[0], extra_tgt=synthetic[1],
                       mix_weights='1,1')
  assert sources.open_split(other, 'train').key != sources.open_split(config, 'train').key


def test_the_tag_is_one_piece_of_the_vocabulary(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  synthetic = _pairs(tmp_path, 'synthetic', 40, start=100)
  config.data.extra_src, config.data.extra_tgt = synthetic
  config.data.extra_tag = '<BT>'
  config.data.vocab_size = 40
  vocab = pipeline.load_vocab(config, str(tmp_path / 'run'))
  tag = vocab.piece_id('<BT>')
  assert tag is not None and tag in vocab.encode(['<BT> source 1'])[0]
  # A vocabulary trained without it is refused in one line.
  from configs import tiny  # pylint: disable=import-outside-toplevel
  os.makedirs(tmp_path / 'plain')
  plain = text_config(tiny.get_config(), tmp_path / 'plain')
  plain.data.vocab_size = 40
  path = pipeline.load_vocab(plain, str(tmp_path / 'plain_run')).path
  config.data.vocab_path = path
  with pytest.raises(ConfigError, match=r"has no piece '<BT>' \(config.data.extra_tag\)"):
    pipeline.load_vocab(config, str(tmp_path / 'run2'))


@pytest.mark.parametrize('values, error, message', [
    (dict(extra_src='missing.src', extra_tgt='missing.tgt'), DataError,
     'cannot read .*missing.src'),
    (dict(extra_src='empty.src', extra_tgt='empty.tgt'), DataError,
     r'empty.src / .*empty.tgt: no pairs: empty'),
    (dict(extra_src='short.src', extra_tgt='long.tgt'), DataError,
     r'short.src has 2 lines but .*long.tgt has 3'),
    (dict(extra_src='long.tgt', extra_tgt='long.tgt,long.tgt'), ConfigError,
     'extra_src names 1 files but extra_tgt 2'),
    (dict(extra_src='long.tgt', extra_tgt='long.tgt', mix_weights='1'), ConfigError,
     'must give 2 numbers above 0'),
    (dict(extra_src='long.tgt', extra_tgt='long.tgt', mix_weights='1,0'), ConfigError,
     'must give 2 numbers above 0'),
    (dict(extra_src='long.tgt', extra_tgt='long.tgt', mix_weights='1,inf'), ConfigError,
     'must give 2 numbers above 0'),
    (dict(extra_src='long.tgt', extra_tgt='long.tgt', mix_weights='a,b'), ConfigError,
     'must be comma-separated numbers'),
    (dict(extra_tag='<BT>'), ConfigError, 'tags the sources of config.data.extra_src, which is'),
    (dict(mix_weights='2'), ConfigError, 'weighs train_src against config.data.extra_src'),
    (dict(source='tsv', extra_src='long.tgt', extra_tgt='long.tgt'), ConfigError,
     "add parallel text files to config.data.source='text', not to 'tsv'"),
])
def test_a_bad_part_of_the_mix_is_one_error_naming_it(tiny_config, tmp_path, values, error,
                                                      message):
  write_lines(tmp_path / 'empty.src', [])
  write_lines(tmp_path / 'empty.tgt', [])
  write_lines(tmp_path / 'short.src', ['a', 'b'])
  write_lines(tmp_path / 'long.tgt', ['a', 'b', 'c'])
  config = _data_config(tiny_config, tmp_path)
  config.data_dir = str(tmp_path)
  for key, value in values.items():
    config[key] = value
  with pytest.raises(error, match=message):
    list(sources.open_split(config, 'train').read())


COMMON = {'train.log_every': 1, 'train.eval_every': 1000, 'eval.bleu_sentences': 0,
          'ckpt.keep': 20, 'train.num_steps': 12, 'ckpt.every': 3}


def _mixed_config(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  synthetic = _pairs(tmp_path, 'synthetic', 150, start=7)
  config.data.extra_src, config.data.extra_tgt = synthetic
  config.data.mix_weights = '2,0.7'
  config.data.extra_tag = '<BT>'
  config.data.vocab_size = 40
  config.data.cache_dir = str(tmp_path / 'cache')
  config.data.max_len = 32  # The model's positions.
  config.update_from_flattened_dict(COMMON)
  return config


@pytest.mark.slow
def test_a_run_on_the_mix_killed_and_resumed_ends_as_a_straight_one(tiny_config, tmp_path):
  config = _mixed_config(tiny_config, tmp_path)
  straight = tmp_path / 'straight'
  train.train_and_evaluate(config, str(straight))
  killed = tmp_path / 'killed'
  flags = [f'--config.data.{key}={value}' for key, value in config.data.items()
           if key in ('source', 'train_src', 'train_tgt', 'eval_src', 'eval_tgt', 'vocab_size',
                      'cache_dir', 'extra_src', 'extra_tgt', 'mix_weights', 'extra_tag',
                      'max_len')]
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
             f'--workdir={killed}', *flags,
             *(f'--config.{key}={value}' for key, value in COMMON.items())]
  process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
  log = []
  for line in process.stderr:
    log.append(line)
    match = re.search(r'\] step (\d+): loss', line)
    if match and int(match.group(1)) >= 7:
      process.send_signal(signal.SIGKILL)
      break
  process.wait(timeout=600)
  assert process.returncode == -signal.SIGKILL, ''.join(log)[-3000:]
  # The mix is in the log, weights and tag too, though the token cache was built already.
  assert any("Token cache hit: " in line and " x2 + " in line and " x0.7 tagged '<BT>'" in line
             for line in log)
  assert max(int(s) for s in os.listdir(killed / 'checkpoints') if s.isdigit()) < 12
  assert train.train_and_evaluate(config, str(killed))['step'] == 12
  assert leaves_equal(saved_state_field(f'{straight}/checkpoints/12'),
                      saved_state_field(f'{killed}/checkpoints/12'))
