"""The command-line tools' shared behaviour: strict JSON lines, one-line errors, short usage."""

import json
import logging as logging_module
import math
import os
import subprocess
import sys
import threading

from absl import logging as absl_logging
import pytest

from conftest import ROOT
from t2t_jax import cli
from t2t_jax import exit_codes


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
    ('main', ['--config=configs/tiny.py', '--workdir=W', '--config.model.local_window=4'],
     ['--config.model.local_window=4', 'renamed', '--config.model.local_half_width']),
    ('translate', [], ['--workdir is required']),
    ('evaluate', ['--workdir=W', '--src=a'], ['both --src and --ref']),
    ('plot', ['--workdir=W'], ['no TensorBoard event files']),
    ('main', ['--config=configs/nope.py', '--workdir=W'],
     ['--config=configs/nope.py: no such config file', 'e.g. configs/default.py']),
    ('main', ['--config=configs/multi30k.py:nonsense', '--workdir=W'],
     ["error: --config=configs/multi30k.py:nonsense: the variant must be one of ['raw', 'tok']"]),
    ('translate', ['--workdir=W', '--beam_size=0'], ['--beam_size=0', 'not a positive integer']),
    ('translate', ['--workdir=W', '--output=/missing/dir/out.txt'],
     ['--output=/missing/dir/out.txt', 'the directory /missing/dir does not exist']),
    ('main', ['--config=configs/tiny.py', '--workdir=W', '--dry_run_target=tpu:v5e-8'],
     ['--dry_run_target only applies with --dry_run']),
    ('main', ['--config=configs/tiny.py', '--workdir=W', '--dry_run', '--search_mesh'],
     ['--search_mesh needs --dry_run_target']),
])
def test_usage_mistakes_are_one_line_and_a_usage_line(tmp_path, module, args, parts):
  args = [arg.replace('=W', f'={tmp_path}') for arg in args]
  returncode, stderr = _cli(module, *args)
  assert returncode == exit_codes.USAGE
  error = _one_line_error(stderr, *parts)
  assert 'File "' not in error  # A config's own message, not its flattened traceback.
  assert stderr.splitlines()[-1].startswith(f'usage: python -m t2t_jax.{module} ')
  assert len(stderr.splitlines()) <= 3, stderr  # Not the whole --help.


@pytest.mark.slow
@pytest.mark.parametrize('text, where', [
    ('x = (\n', ":1: SyntaxError: '(' was never closed"),
    ('import ml_collections\n\ndef get_config():\n  config = ml_collections.ConfigDict()\n'
     '  config.width = widht\n  return config\n', ":5: NameError: name 'widht' is not defined"),
])
def test_a_config_file_that_fails_to_load_is_one_line_naming_its_line(tmp_path, text, where):
  config = tmp_path / 'broken.py'
  config.write_text(text)
  returncode, stderr = _cli('main', f'--config={config}', f'--workdir={tmp_path / "w"}')
  assert returncode == exit_codes.USAGE
  _one_line_error(stderr, f'--config={config}{where}')
  assert 'Traceback' not in stderr and len(stderr.splitlines()) == 2, stderr
  assert not (tmp_path / 'w').exists()


def test_load_error_names_the_files_own_line_not_the_importers(tmp_path):
  path = tmp_path / 'module.py'
  path.write_text('def f():\n  return 1 / 0\n')
  namespace = {}
  exec(compile(path.read_text(), str(path), 'exec'), namespace)  # pylint: disable=exec-used
  try:
    namespace['f']()
  except ZeroDivisionError as e:
    assert cli.load_error(e, str(path)) == f'{path}:2: ZeroDivisionError: division by zero'
  try:
    compile('a = [1,\n', str(path), 'exec')
  except SyntaxError as e:
    assert cli.load_error(e, str(path)) == f"{path}:1: SyntaxError: '[' was never closed"
  assert cli.load_error(ValueError('no\nline'), 'x.py') == 'x.py: ValueError: no line'


@pytest.mark.slow
@pytest.mark.parametrize('module, args, parts', [
    ('translate', ['--workdir=W'], ['config.json', 'directory of a training run']),
    ('export', ['--workdir=W'], ['no checkpoint']),
    ('average', ['--workdir=W', '--last=3'], ['does not exist', 'training workdir']),
])
def test_checkpoint_errors_are_one_line(tmp_path, module, args, parts):
  args = [arg.replace('=W', f'={tmp_path}') for arg in args]
  returncode, stderr = _cli(module, *args)
  assert returncode == exit_codes.ERROR
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
  assert returncode == exit_codes.ERROR
  _one_line_error(stderr, *parts)
  assert os.listdir(tmp_path) == []  # Refused before anything was written.


@pytest.mark.slow
def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  path = tmp_path / 'a_file'
  path.write_text('not a directory')
  returncode, stderr = _cli('main', '--config=configs/tiny.py', f'--workdir={path}')
  assert returncode == exit_codes.ERROR
  _one_line_error(stderr, f'--workdir={path} is a file, not a directory', 'another path')
  assert path.read_text() == 'not a directory'


@pytest.mark.slow
def test_a_batch_smaller_than_the_mesh_is_one_line_before_any_work(tmp_path):
  # conftest gives 8 devices: 64 tokens are 4 rows of the 16-token shortest bucket.
  returncode, stderr = _cli('main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                            '--config.data.batch_tokens=64')
  assert returncode == exit_codes.ERROR
  _one_line_error(stderr, 'config.data.batch_tokens=64 gives 4 rows of 16 tokens (the shortest '
                  'bucket, config.data.min_bucket), fewer than the 8 data shards', 'at least 128')
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_model_shorter_than_the_batches_is_one_line(tmp_path):
  returncode, stderr = _cli('main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                            '--config.model.max_len=2')
  assert returncode == exit_codes.ERROR
  # The copy task's pairs (up to 9 tokens) are padded to the 16-token bucket.
  _one_line_error(stderr, 'a batch of 16 positions exceeds config.model.max_len=2',
                  'raise config.model.max_len to at least 16')


@pytest.mark.slow
def test_a_nan_loss_is_one_line_and_releases_the_workdir(tmp_path):
  returncode, stderr = _cli('main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                            '--config.opt.schedule=constant', '--config.opt.lr_scale=1e30',
                            '--config.ckpt.every=0')
  assert returncode == exit_codes.ERROR
  _one_line_error(stderr, 'training loss is', 'at step', 'the last checkpoint is intact')
  assert not os.path.exists(tmp_path / 'run.lock')


def _record(pathname, level, message, args=(), error=None):
  exc_info = (type(error), error, error.__traceback__) if error else None
  return logging_module.LogRecord('orbax.checkpoint', level, pathname, 7, message, args, exc_info)


def test_other_libraries_errors_reach_the_user_as_one_line_and_info_does_not():
  try:
    raise OSError(28, 'No space left on device')
  except OSError as e:
    error = e
  shown = cli._LibraryRecords()  # pylint: disable=protected-access
  orbax_file = '/site-packages/orbax/checkpoint/async_checkpointer.py'
  record = _record(orbax_file, logging_module.ERROR, 'Saving step %d failed', (3,), error)
  assert shown.filter(record)
  assert logging_module.Formatter('%(message)s').format(record) == (
      'Saving step 3 failed (OSError: [Errno 28] No space left on device) (--verbose shows the '
      'traceback)')  # The message and the error; no traceback.
  warning = _record(orbax_file, logging_module.WARNING, 'retrying\nTraceback (most recent call '
                    'last):\n  File "x.py", line 1\nValueError: bad shard')
  assert shown.filter(warning) and warning.getMessage() == (
      'retrying ValueError: bad shard (--verbose shows the traceback)')
  assert not shown.filter(_record(orbax_file, logging_module.INFO, 'Saved step 3'))
  own = _record(os.path.join(os.path.dirname(cli.__file__), 'train.py'), logging_module.INFO,
                'step 3', error=error)
  assert shown.filter(own) and own.exc_info is not None  # t2t_jax's records are untouched.


def test_quiet_libraries_filters_the_absl_handler_and_chains_thread_hooks(monkeypatch):
  handler = absl_logging.get_absl_handler()
  monkeypatch.setattr(handler, 'filters', list(handler.filters))
  seen = []
  monkeypatch.setattr(threading, 'excepthook', seen.append)  # Someone else's hook.
  warnings = []
  monkeypatch.setattr(absl_logging, 'warning', lambda *args: warnings.append(args[0] % args[1:]))
  cli.quiet_libraries()
  cli.quiet_libraries()  # Twice: one filter, one hook.
  assert sum(isinstance(f, cli._LibraryRecords) for f in handler.filters) == 1  # pylint: disable=protected-access

  def fail():
    raise RuntimeError('tensorstore writer lost')
  thread = threading.Thread(target=fail, name='writer')
  thread.start()
  thread.join()
  assert warnings == ['Background thread writer ended with RuntimeError: tensorstore writer '
                      'lost (--verbose shows the traceback)']
  assert [type(args.exc_value) for args in seen] == [RuntimeError]  # The previous hook ran.
