"""The workdir lock: refused while its holder lives, taken over after kill -9 or from a lost
node, released on a clean exit and an error. Released after SIGTERM: tests/test_checkpoint.py
(a real run) and tests/test_lifecycle.py (every phase)."""

import json
import logging as std_logging
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from t2t_jax import workdir_lock

# As train.train_and_evaluate holds it: inside the run's lifecycle. A waiting holder outlives
# any test on a slow machine (600 s); the test kills it.
_HOLDER = '''
import sys, time
from t2t_jax import workdir_lock
from t2t_jax.training import lifecycle
with lifecycle.Lifecycle(60, 0), workdir_lock.WorkdirLock(sys.argv[1]):
  print('held', flush=True)
  if sys.argv[2] == 'error':
    raise RuntimeError('boom')
  if sys.argv[2] == 'wait':
    time.sleep(600)
'''


def _hold(workdir, how):
  """A process holding the lock of `workdir`, started once it holds it."""
  process = subprocess.Popen([sys.executable, '-c', _HOLDER, str(workdir), how], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  assert process.stdout.readline() == 'held\n', process.stderr.read()
  return process


@pytest.mark.slow
def test_refused_while_the_holder_lives_then_taken_over_after_kill9(tmp_path, caplog):
  holder = _hold(tmp_path, 'wait')
  with pytest.raises(workdir_lock.WorkdirLocked) as refused:
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  message = str(refused.value)
  assert f'PID {holder.pid} on host {socket.gethostname()}' in message
  assert '--force_unlock' in message and '\n' not in message
  holder.kill()
  holder.wait()
  caplog.set_level(std_logging.WARNING)
  with workdir_lock.WorkdirLock(str(tmp_path)):
    held = json.load(open(tmp_path / workdir_lock.LOCK_FILE))
    assert held['pid'] == os.getpid()
  assert f'from PID {holder.pid}' in caplog.text and 'no longer runs' in caplog.text
  assert os.listdir(tmp_path) == []  # Released, and no temporary file left.


@pytest.mark.slow
@pytest.mark.parametrize('how, returncode', [('exit', 0), ('error', 1)])
def test_released_on_every_exit_path(tmp_path, how, returncode):
  holder = _hold(tmp_path, how)
  assert holder.wait(timeout=30) == returncode
  assert 'Traceback' not in holder.stderr.read() or how == 'error'
  assert os.listdir(tmp_path) == []


def _foreign_lock(workdir, age_seconds):
  path = workdir / workdir_lock.LOCK_FILE
  path.write_text(json.dumps({'host': 'lost-node', 'pid': 4242, 'start_ticks': 1,
                              'since': 'yesterday'}))
  os.utime(path, (time.time() - age_seconds,) * 2)


def test_another_hosts_lock_is_kept_while_fresh_taken_when_stale_or_forced(tmp_path, caplog):
  caplog.set_level(std_logging.WARNING)
  _foreign_lock(tmp_path, 10)
  with pytest.raises(workdir_lock.WorkdirLocked, match='PID 4242 on host lost-node'):
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  with workdir_lock.WorkdirLock(str(tmp_path), force=True):
    pass
  assert 'forced by --force_unlock' in caplog.text
  _foreign_lock(tmp_path, workdir_lock.STALE_SECONDS + 60)
  with workdir_lock.WorkdirLock(str(tmp_path)):
    pass
  assert 'heartbeat stopped' in caplog.text and 'lost node' in caplog.text
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_prepare_removes_what_dead_builds_left_and_keeps_a_live_ones(tiny_config, tmp_path):
  from conftest import text_config  # pylint: disable=g-import-not-at-top
  from t2t_jax import prepare  # pylint: disable=g-import-not-at-top
  config = text_config(tiny_config, tmp_path)
  cache = tmp_path / 'cache'
  finished = subprocess.Popen(['true'])
  finished.wait()
  dead_pid = finished.pid  # A PID that no longer runs.
  host = socket.gethostname()
  left = [cache / f'.vocab-{host}-{dead_pid}-abc',
          cache / 'tokens' / f'.building-{host}-{dead_pid}-x']
  live = [cache / f'.vocab-{host}-{os.getpid()}-def', cache / 'tokens' / '.building-other-1-y']
  for folder in left + live:
    os.makedirs(folder / 'part')
  prepare.prepare(config, str(cache))
  assert not any(folder.exists() for folder in left)
  assert all(folder.exists() for folder in live)  # A live process's, and another host's.
  names = sorted(os.listdir(cache))
  assert names == sorted(['vocab.model', 'tokens', live[0].name]), names


@pytest.mark.slow
def test_second_launch_of_main_is_refused_in_one_line(tmp_path):
  holder = _hold(tmp_path, 'wait')
  try:
    result = subprocess.run([sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
                             f'--workdir={tmp_path}'], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  finally:
    holder.kill()
    holder.wait()
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  (line,) = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert f'in use by PID {holder.pid} on host {socket.gethostname()}' in line
