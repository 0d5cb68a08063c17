"""The command-line tools' shared behaviour: strict JSON lines, one-line errors, short usage."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from t2t_jax import cli


def test_json_line_writes_null_with_the_reason_for_nan_and_infinity():
  line = cli.json_line({'step': 3, 'train_loss': math.nan, 'eval': {'loss': -math.inf},
                        'rates': [1.0, math.inf], 'mfu': None,
                        'null_reasons': {'mfu': 'unknown peak'}},
                       reasons={'train_loss': 'no training step ran'})
  assert 'NaN' not in line and 'Infinity' not in line and '\n' not in line
  record = json.loads(line)  # Python's parser accepts NaN; a strict one must accept it too.
  assert record['train_loss'] is None and record['eval'] == {'loss': None}
  assert record['rates'] == [1.0, None] and record['step'] == 3
  assert record['null_reasons'] == {'mfu': 'unknown peak', 'train_loss': 'no training step ran',
                                    'eval.loss': 'was -inf', 'rates[1]': 'was inf'}
  assert 'null_reasons' not in json.loads(cli.json_line({'loss': 1.5}))


def _cli(module, *args, cwd=ROOT):
  """Runs `python -m t2t_jax.<module> args`; returns (exit code, stderr)."""
  result = subprocess.run([sys.executable, '-m', f't2t_jax.{module}', *map(str, args)],
                          cwd=cwd, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
  return result.returncode, result.stderr


def _one_line_error(stderr: str, *parts: str) -> str:
  """The `error:` line of stderr, checked to be the only one and to hold `parts`."""
  assert 'Traceback' not in stderr, stderr
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, stderr
  for part in parts:
    assert part in errors[0], errors[0]
  return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize('module, args, parts', [
    ('main', ['--config=configs/tiny.py', '--workdir=W', '--config.model.d_modle=3'],
     ['--config.model.d_modle=3', "'d_modle'", 'did you mean "d_model"']),
    ('main', ['--config=configs/tiny.py', '--wrokdir=W'], ["'wrokdir'", 'workdir']),
    ('translate', [], ['--workdir is required']),
    ('evaluate', ['--workdir=W', '--src=a'], ['both --src and --ref']),
    ('plot', ['--workdir=W'], ['no TensorBoard event files']),
])
def test_usage_mistakes_are_one_line_and_a_usage_line(tmp_path, module, args, parts):
  args = [arg.replace('=W', f'={tmp_path}') for arg in args]
  returncode, stderr = _cli(module, *args)
  assert returncode == cli.USAGE_EXIT_CODE
  _one_line_error(stderr, *parts)
  assert stderr.splitlines()[-1].startswith(f'usage: python -m t2t_jax.{module} ')
  assert len(stderr.splitlines()) <= 3, stderr  # Not the whole --help.


@pytest.mark.slow
@pytest.mark.parametrize('module, args, parts', [
    ('translate', ['--workdir=W'], ['config.json', 'directory of a training run']),
    ('export', ['--workdir=W'], ['no checkpoint']),
    ('average', ['--workdir=W', '--last=3'], ['does not exist', 'training workdir']),
])
def test_checkpoint_errors_are_one_line(tmp_path, module, args, parts):
  args = [arg.replace('=W', f'={tmp_path}') for arg in args]
  returncode, stderr = _cli(module, *args)
  assert returncode == cli.ERROR_EXIT_CODE
  _one_line_error(stderr, *parts)


@pytest.mark.slow
@pytest.mark.parametrize('flag, parts', [
    ('--config.train.num_steps=0', ['config.train.num_steps=0', '[1, inf)']),
    ('--config.model.num_heads=3', ['config.model.d_model=32 is not divisible by '
                                    'config.model.num_heads=3']),
    ('--config.mesh.shape=(3,-1,1)', ['config.mesh.shape=(3, -1, 1)', 'needs a multiple of 3']),
])
def test_config_errors_are_one_line_before_any_work(tmp_path, flag, parts):
  returncode, stderr = _cli('main', '--config=configs/tiny.py', f'--workdir={tmp_path}', flag)
  assert returncode == cli.ERROR_EXIT_CODE
  _one_line_error(stderr, *parts)
  assert os.listdir(tmp_path) == []  # Refused before anything was written.
