"""Two processes x 4 CPU devices train like one process x 8 and their checkpoints restore; a
peer that never joins, a refused lock and Ctrl-C on one process stop every process cleanly. A
run that moves between process and device counts: tests/test_moving.py."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, scalar_events
from t2t_jax.training import train

STEPS = 4
OVERRIDES = {'train.num_steps': STEPS, 'train.log_every': 1, 'train.eval_every': STEPS,
             'ckpt.every': 2, 'eval.bleu_sentences': 0}


def _train_losses(workdir):
  losses = scalar_events(workdir)['train/loss']
  return [losses[step] for step in sorted(losses)]


def _env():
  env = dict(os.environ, PYTHONPATH=ROOT)
  env['XLA_FLAGS'] = ''  # launch/local.py sets each process's device count.
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _process_env(port: int, index: int) -> dict:
  """Process `index` of 2 joining at 127.0.0.1:`port`, as a separate host would (4 devices)."""
  return dict(_env(), T2T_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', T2T_NUM_PROCESSES='2',
              T2T_PROCESS_ID=str(index), JAX_PLATFORMS='cpu',
              XLA_FLAGS='--xla_force_host_platform_device_count=4')


def _start_two(workdir, flags: list[str], stderr_of) -> list[subprocess.Popen]:
  """The tiny config's two processes on `workdir`, each its own slice, started without a
  launcher (none stops the others for them); `stderr_of(index)` is each one's stderr."""
  port = _free_port()
  return [subprocess.Popen([sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
                            f'--workdir={workdir}', '--config.mesh.dcn_data=2', *flags],
                           cwd=ROOT, env=_process_env(port, index), stderr=stderr_of(index),
                           stdout=subprocess.DEVNULL, text=True) for index in range(2)]


@pytest.mark.slow
@pytest.mark.multihost
def test_two_processes_match_one_and_their_checkpoint_restores(tiny_config, tmp_path):
  two = str(tmp_path / 'two')
  command = [sys.executable, 'launch/local.py', '--num_processes=2', '--devices_per_process=4',
             '--', sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
             f'--workdir={two}', '--config.mesh.dcn_data=2'  # Each process as one slice.
             ] + [f'--config.{k}={v}' for k, v in OVERRIDES.items()]
  run = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stdout[-3000:]
  assert '[1] ' in run.stdout and 'Process 1 of 2 joined' in run.stdout
  final_two = json.load(open(os.path.join(two, 'final.json')))

  for key, value in OVERRIDES.items():
    section, name = key.split('.')
    tiny_config[section][name] = value
  one = train.train_and_evaluate(tiny_config, str(tmp_path / 'one'))  # 1 process x 8 devices.
  assert final_two['step'] == one['step'] == STEPS
  # Losses, not weights, are compared tightly: the weights of the two runs may differ by up to
  # about lr per step where a gradient is rounding noise (conftest.py, GRADIENT_NOISE), but the
  # loss is flat along exactly those weights, so it moves by |g| * lr there: far below 1e-5.
  np.testing.assert_allclose(_train_losses(two), _train_losses(str(tmp_path / 'one')),
                             rtol=1e-5)
  assert len(_train_losses(two)) == STEPS
  np.testing.assert_allclose(final_two['eval_loss'], one['eval_loss'], rtol=1e-5)

  # Both workdirs resume in this single process and must continue identically.
  tiny_config.train.num_steps = STEPS + 2
  resumed_two = train.train_and_evaluate(tiny_config, two)
  resumed_one = train.train_and_evaluate(tiny_config, str(tmp_path / 'one'))
  assert resumed_two['step'] == resumed_one['step'] == STEPS + 2
  np.testing.assert_allclose(resumed_two['train_loss'], resumed_one['train_loss'], rtol=1e-5)
  np.testing.assert_allclose(resumed_two['eval_loss'], resumed_one['eval_loss'], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multihost
def test_a_peer_that_never_joins_gives_a_clear_error(tmp_path):
  env = dict(_env(), T2T_COORDINATOR_ADDRESS=f'127.0.0.1:{_free_port()}',
             T2T_NUM_PROCESSES='2', T2T_PROCESS_ID='0')
  run = subprocess.run([sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
                        f'--workdir={tmp_path}', '--distributed_timeout=3'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 2
  assert ('within --distributed_timeout=3 s: a peer never joined. Start every process with '
          'the same --coordinator_address') in run.stderr


@pytest.mark.slow
@pytest.mark.multihost
def test_a_refused_lock_on_process_0_stops_every_process_with_its_message(tmp_path):
  """Launched as separate hosts would be (no launcher stopping the others for them)."""
  from t2t_jax import workdir_lock  # pylint: disable=g-import-not-at-top
  with workdir_lock.WorkdirLock(str(tmp_path)):  # A live run (this test) holds the workdir.
    processes = _start_two(tmp_path, [], lambda index: subprocess.PIPE)
    # Below the 300 s a waiting process would otherwise spend before a timeout (8 s alone;
    # a 2-core machine busy with other work has taken over 120 s).
    errors = [process.communicate(timeout=240)[1] for process in processes]
  for process, stderr in zip(processes, errors):
    assert process.returncode == 1, stderr[-3000:]
    assert 'Traceback' not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith('error: ')]
    assert len(lines) == 1 and f'{tmp_path} is in use by PID {os.getpid()}' in lines[0], stderr
  assert errors[0].splitlines()[-1] == errors[1].splitlines()[-1]


@pytest.mark.slow
@pytest.mark.multihost
def test_ctrl_c_on_one_process_makes_every_process_save_one_step_and_exit_130(tiny_config,
                                                                             tmp_path):
  """Ctrl-C goes to process 1 only (the harder case: process 0 writes the checkpoint);
  JAX's preemption service makes both save at one step, as for SIGTERM."""
  import re  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / 'run'
  logs = [tmp_path / f'{index}.log' for index in range(2)]
  processes = _start_two(
      workdir, ['--config.train.num_steps=100000', '--config.train.log_every=1',
                '--config.ckpt.every=0', '--config.eval.bleu_sentences=0',
                '--config.train.eval_every=100000', '--config.ckpt.preemption_grace_seconds=120'],
      lambda index: open(logs[index], 'w'))  # pylint: disable=consider-using-with
  deadline = time.monotonic() + 400
  while not re.search(r'\] step 3: loss', logs[1].read_text()):
    assert time.monotonic() < deadline and processes[1].poll() is None, logs[1].read_text()
    time.sleep(0.1)
  processes[1].send_signal(signal.SIGINT)
  codes = [process.wait(timeout=900) for process in processes]
  texts = [log.read_text() for log in logs]
  assert codes == [130, 130], [text[-3000:] for text in texts]
  saved = [int(re.search(r'interrupted \(Ctrl-C\): saved a checkpoint at step (\d+)',
                         text).group(1)) for text in texts]
  assert saved[0] == saved[1] >= 3, saved
  assert 'Traceback' not in texts[0] + texts[1]
  assert os.listdir(workdir / 'checkpoints') == [str(saved[0])]
  assert not os.path.exists(workdir / 'run.lock')
  # The run resumes from that step (here in one process of 8 devices, as above).
  tiny_config.train.num_steps, tiny_config.eval.bleu_sentences = saved[0] + 1, 0
  assert train.train_and_evaluate(tiny_config, str(workdir))['step'] == saved[0] + 1
