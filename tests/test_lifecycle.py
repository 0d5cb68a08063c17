"""The run's lifecycle: one test per cell of docs/training.md's table (what SIGTERM, Ctrl-C, a
second Ctrl-C, a hang, a full disk and a NaN loss do in each phase), in process, the step
phase's cells in the fast tier and the rest marked slow (Ctrl-C's first signal takes
SIGTERM's path, so one cell checks it); then the Lifecycle's parts on their own. Each way a
process ends also runs once as a real process, marked slow: tests/test_checkpoint.py
(SIGTERM and its grace period, Ctrl-C, a second Ctrl-C, a full disk, kill -9 in its chaos
test), tests/test_launch.py (a hang), tests/test_multihost.py (Ctrl-C across processes).

Each cell test trains configs/tiny.py for 6 steps (saves at 2, 4 and 6, evaluations at 3 and
6) and makes its event happen on entering the phase, through lifecycle._entered. An exit
that does not unwind (lifecycle._exit: os._exit in a real run) is replaced by one that runs
the same clean-up, records the status and what is on disk, and raises _ProcessEnded.
"""

import dataclasses
import errno
import json
import os
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import saved_state_field
from t2t_jax import cli
from t2t_jax import NonFiniteLoss
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import checkpoint
from t2t_jax.training import lifecycle
from t2t_jax.training import train

PHASES = (lifecycle.STARTUP, lifecycle.STEP, lifecycle.SAVE, lifecycle.EVALUATION,
          lifecycle.FINAL_EVALUATION)
# The table's phases as parameters: the step phase in the fast tier, the others slow.
TABLE_PHASES = [pytest.param(phase, marks=() if phase == lifecycle.STEP else pytest.mark.slow)
                for phase in PHASES]
# The step at whose phase each cell's event happens (start-up has none).
AT = {lifecycle.STARTUP: None, lifecycle.STEP: 3, lifecycle.SAVE: 4,
      lifecycle.EVALUATION: 3, lifecycle.FINAL_EVALUATION: 6}
TIMEOUT = 5.0  # config.train.step_timeout_seconds of the hang cells (seconds), which must not
# fire on a step or a save that finishes. Those tests start after a `warm` run in this process,
# so no step of theirs compiles; a guarded save took under 0.7 s (measured under coverage on a
# loaded 2-core machine, when a process's first save still compiled orbax's per-device slices
# and later ones did not; on CPU devices none does now): 5 s is 7 times the longest guarded
# phase.


class _ProcessEnded(BaseException):
  """Where a real run's process would have ended (os._exit)."""


@pytest.fixture(scope='module', autouse=True)
def _built_once():
  """Every run here trains the same tiny model: its Setup (the jitted functions, traced and
  compiled once) is built once per config and handed out as a copy, so a cell that swaps its
  step functions (_nan_at) changes only its own. The hang guard's limit is left out of the key:
  building does not read it."""
  built, build = {}, train.build

  def cached(config, vocab_size, mesh=None, objective=None):
    key = config.copy_and_resolve_references()
    key.train.step_timeout_seconds = 0.0
    key = (key.to_json(), vocab_size, objective)
    if key not in built:
      built[key] = build(config, vocab_size, mesh, objective)
    return dataclasses.replace(built[key])
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train, 'build', cached)
    yield


@pytest.fixture(scope='module')
def warm(tmp_path_factory):
  """One run of the cells' config in this process, with no hang guard, before the tests whose
  limit must not fire (see TIMEOUT)."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  train.train_and_evaluate(_config(tiny.get_config()), str(tmp_path_factory.mktemp('warm')))


def _config(tiny_config, step_timeout=0.0):
  config = tiny_config
  config.train.num_steps, config.ckpt.every, config.train.eval_every = 6, 2, 3
  config.train.log_every, config.eval.bleu_sentences, config.eval.num_batches = 1, 0, 1
  config.train.step_timeout_seconds = step_timeout
  return config


def _on_disk(workdir) -> dict:
  directory = os.path.join(workdir, 'checkpoints')
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  return {'steps': sorted(int(name) for name in names if name.isdigit()),
          'unfinished': [name for name in names if not name.isdigit()],
          'lock': os.path.exists(os.path.join(workdir, 'run.lock'))}


@pytest.fixture
def run(monkeypatch, tmp_path):
  """run(config, event) trains in a fresh workdir, calling event(phase, step) on entering each
  phase; returns (how it ended, the error or exit record, what is on disk after)."""
  workdir = str(tmp_path / 'run')
  ended = {}

  def process_exit(status, cleanup):
    cleanup()
    ended.update(status=status, disk=_on_disk(workdir))
    if threading.current_thread() is not threading.main_thread():  # The hang guard's.
      start.released.set()  # The stalled main thread goes on, to raise _ProcessEnded.
      raise SystemExit()  # Ends the guard's thread quietly.
    raise _ProcessEnded()

  def start(config, event):
    monkeypatch.setattr(lifecycle, '_exit', process_exit)
    monkeypatch.setattr(lifecycle, '_entered', event)
    try:
      outcome = ('finished', train.train_and_evaluate(config, workdir))
    except _ProcessEnded:
      outcome = ('exited', ended)
    except lifecycle.Preempted as e:
      outcome = ('preempted', e)
    except Exception as e:  # pylint: disable=broad-except
      assert isinstance(e, cli._user_errors()), e  # One `error:` line, exit status 1.
      outcome = ('error', e)
    finally:
      monkeypatch.setattr(lifecycle, '_entered', lambda phase, step: None)
    return outcome + (_on_disk(workdir),)
  start.workdir, start.released = workdir, threading.Event()
  return start


def _once_at(phase, step, action):
  """An event hook doing `action()` on the first entry into `phase` of `step`."""
  done = []

  def event(entered, at):
    if entered == phase and at == step and not done:
      done.append(True)
      action()
  return event


def _assert_whole(workdir, disk):
  assert disk['unfinished'] == [] and not disk['lock'], disk
  if disk['steps']:  # The newest checkpoint reads back with plain orbax.
    saved_state_field(os.path.join(workdir, 'checkpoints', str(disk['steps'][-1])))


# The signal rows: SIGTERM and Ctrl-C.
# (saved step, checkpoints left) per phase of the first signal.
SIGNALLED = {
    lifecycle.STARTUP: (None, []),  # Abandoned at once: nothing trained, nothing to save.
    lifecycle.STEP: (3, [2, 3]),  # Saved at the end of the step it came in.
    lifecycle.SAVE: (5, [2, 4, 5]),  # The save of 4 goes on; the next step is saved.
    lifecycle.EVALUATION: (3, [2, 3]),  # Abandoned; the evaluated step is saved.
    lifecycle.FINAL_EVALUATION: (6, [2, 4, 6]),  # Abandoned; the last step was saved before.
}


# SIGTERM in every phase; Ctrl-C takes the same path (lifecycle._handle), so one phase of it
# checks its exit status and name.
SIGNAL_CELLS = [pytest.param(phase, signal.SIGTERM, id=f'sigterm-{phase}',
                             marks=() if phase == lifecycle.STEP else pytest.mark.slow)
                for phase in PHASES] + [
                    pytest.param(lifecycle.STEP, signal.SIGINT, id='sigint-step',
                                 marks=pytest.mark.slow)]


@pytest.mark.parametrize('phase, signum', SIGNAL_CELLS)
def test_a_signal_stops_the_run_saving_the_table_s_step(run, tiny_config, caplog, phase,
                                                         signum):
  config = _config(tiny_config)
  how, error, disk = run(config, _once_at(
      phase, AT[phase], lambda: os.kill(os.getpid(), signum)))
  saved, steps = SIGNALLED[phase]
  assert how == 'preempted', (how, error)
  assert error.exit_code == 128 + signum and error.step == saved and error.phase == phase
  assert disk['steps'] == steps
  _assert_whole(run.workdir, disk)
  assert not os.path.exists(os.path.join(run.workdir, workdir_layout.FINAL_JSON))
  name = 'SIGTERM' if signum == signal.SIGTERM else 'Ctrl-C (SIGINT)'
  assert f'{name} received during ' in caplog.text
  if phase == lifecycle.EVALUATION:
    assert (f'{name} during the evaluation of step 3: evaluation abandoned, saving step 3'
            in caplog.text), caplog.text
  if phase == lifecycle.FINAL_EVALUATION:  # "Rerun to resume": nothing is trained again.
    how, figures, disk = run(config, lambda phase, step: None)
    assert how == 'finished' and figures['step'] == 6 and 'eval_loss' in figures
    assert disk['steps'] == [2, 4, 6]


# A second Ctrl-C, while the run stops after a first one that came in `phase`.

def _twice_from(phase, step):
  """Ctrl-C on entering `phase`, and again on entering the phase after it (or, where the
  first abandons start-up, while that unwinds)."""
  sent = []

  def event(entered, at):
    if sent == [] and entered == phase and at == step:
      sent.append(1)
      try:
        os.kill(os.getpid(), signal.SIGINT)
      except lifecycle.Interrupted:
        sent.append(2)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    elif sent == [1]:
      sent.append(2)
      os.kill(os.getpid(), signal.SIGINT)
  return event


# Checkpoints left: the second Ctrl-C removes every save still being written (the periodic
# save of step 2 may be, at step 3); whatever is left is whole.
SECOND = {
    lifecycle.STARTUP: ([],),
    lifecycle.STEP: ([], [2]),  # Second on entering the save of step 3: 3 is not written.
    lifecycle.SAVE: ([2], [2, 4]),  # Second on entering step 5: the save of 4 may be in flight.
    lifecycle.EVALUATION: ([], [2]),  # Second on entering the save of step 3.
    lifecycle.FINAL_EVALUATION: ([2, 4], [2, 4, 6]),  # Second while the save of 6 finishes.
}


@pytest.mark.parametrize('phase', TABLE_PHASES)
def test_a_second_ctrl_c_exits_at_once_leaving_whole_checkpoints(run, tiny_config, phase):
  how, ended, _ = run(_config(tiny_config), _twice_from(phase, AT[phase]))
  assert how == 'exited' and ended['status'] == 130, (how, ended)
  assert ended['disk']['steps'] in [list(steps) for steps in SECOND[phase]]
  _assert_whole(run.workdir, ended['disk'])


# A hang: a phase that outlasts config.train.step_timeout_seconds.

@pytest.mark.slow
@pytest.mark.parametrize('phase', [lifecycle.STEP, lifecycle.SAVE])
def test_a_hang_in_a_guarded_phase_exits_with_status_3(warm, run, tiny_config, phase, capfd):
  def stall():  # Until the guard ends the "process"; then the main thread stops there.
    assert run.released.wait(10 * TIMEOUT)
    raise _ProcessEnded()
  how, result, _ = run(_config(tiny_config, TIMEOUT), _once_at(phase, AT[phase], stall))
  assert how == 'exited' and result['status'] == 3, (how, result)
  assert result['disk']['steps'] == [2]  # The save of step 4 had not started.
  _assert_whole(run.workdir, result['disk'])
  what = ('training step 3 (or reading the metrics of step 2)' if phase == lifecycle.STEP
          else 'the save of step 4')
  stderr = capfd.readouterr().err
  assert f'{what} took longer than config.train.step_timeout_seconds={TIMEOUT:g} s' in stderr
  assert 'in stall' in stderr  # The stalled main thread's stack.


@pytest.mark.slow
def test_a_stall_in_each_unguarded_phase_outlasts_the_limit_and_the_run_finishes(
    warm, run, tiny_config):
  """Start-up, an evaluation and the final evaluation each sit out longer than the limit in
  one run: none is guarded."""
  stalled = []

  def event(entered, at):
    if entered in (lifecycle.STARTUP, lifecycle.EVALUATION, lifecycle.FINAL_EVALUATION) and (
        entered not in stalled):
      stalled.append(entered)
      time.sleep(TIMEOUT + 2)  # Past the limit, with 2 s for the guard's thread to wake.
  how, result, disk = run(_config(tiny_config, TIMEOUT), event)
  assert how == 'finished' and result['step'] == 6 and disk['steps'] == [2, 4, 6], result
  assert len(stalled) == 3
  # A guard that fired would have ended the "process" from its thread, which lets the stalled
  # main thread go on (the run would still finish): it never did.
  assert not run.released.is_set()


# A full disk.

def _disk_full(path):
  def fail(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  return fail


def _checkpoint_write_fails(monkeypatch, method):
  """orbax's `method` (save: the synchronous part; wait_until_finished: the background write,
  met by the next step's check) fails once with ENOSPC, as on a full disk."""
  calls = []
  real = getattr(ocp.CheckpointManager, method)

  def once(self, *args, **kwargs):
    if not calls:
      calls.append(1)
      _disk_full(self.directory)()
    return real(self, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, method, once)
  if method == 'wait_until_finished':  # The background write is over: check() looks.
    monkeypatch.setattr(ocp.CheckpointManager, 'is_saving_in_progress', lambda self: False)


@pytest.mark.parametrize('phase', TABLE_PHASES)
def test_a_full_disk_stops_the_run_with_one_error_line(run, tiny_config, monkeypatch, phase):
  finals = []

  def event(entered, at):
    if entered == lifecycle.FINAL_EVALUATION:
      finals.append(at)
    if entered != phase or at != AT[phase]:
      return
    if phase == lifecycle.STEP:  # The save of step 2 failed in the background.
      _checkpoint_write_fails(monkeypatch, 'wait_until_finished')
    elif phase == lifecycle.SAVE:
      _checkpoint_write_fails(monkeypatch, 'save')
    elif phase != lifecycle.FINAL_EVALUATION or len(finals) == 2:  # final.json is the 2nd.
      _disk_full(os.path.join(run.workdir, 'some_file'))()
  how, error, disk = run(_config(tiny_config), event)
  assert how == 'error', (how, error)
  if phase in (lifecycle.STEP, lifecycle.SAVE):
    failed = 2 if phase == lifecycle.STEP else 4
    assert isinstance(error, checkpoint.CheckpointError)
    assert f'saving checkpoint {failed} in ' in str(error) and 'the disk is full' in str(error)
  else:
    assert isinstance(error, lifecycle.DiskFull)
    where = {lifecycle.STARTUP: 'start-up', lifecycle.EVALUATION: 'the evaluation of step 3',
             lifecycle.FINAL_EVALUATION: 'the final evaluation of step 6'}[phase]
    assert f'some_file failed during {where} (No space left on device)' in str(error)
  assert disk['steps'] == {lifecycle.STARTUP: [], lifecycle.STEP: [], lifecycle.SAVE: [2],
                           lifecycle.EVALUATION: [2], lifecycle.FINAL_EVALUATION: [2, 4, 6]
                           }[phase]
  _assert_whole(run.workdir, disk)


# A NaN loss.

def _nan_at(monkeypatch, train_step: int | None = None, evaluation: str | None = None):
  """Makes the training loss of step `train_step`, and the eval loss of the `evaluation`
  phase, NaN; returns the event hook that follows the phases."""
  build, phases = train.build, [None]

  def building(*args, **kwargs):
    setup = build(*args, **kwargs)
    step, evaluate, calls = setup.train_step, setup.eval_step, [0]

    def train_step_(state, batch, rng):
      calls[0] += 1
      state, metrics = step(state, batch, rng)
      return state, dict(metrics, loss=metrics['loss'] * (
          jnp.nan if calls[0] == train_step else 1.0))

    def eval_step(params, batch):
      metrics = evaluate(params, batch)
      return dict(metrics, loss=metrics['loss'] * (
          jnp.nan if phases[-1] == evaluation else 1.0))
    setup.train_step, setup.eval_step = train_step_, eval_step
    return setup
  monkeypatch.setattr(train, 'build', building)
  return lambda entered, at: phases.append(entered)


# Start-up computes no loss; what it restores is a checkpoint saved only after its loss was
# read finite, which the save cell shows (the run stopped by a NaN at a save step leaves the
# step before it).
@pytest.mark.parametrize('phase', [
    pytest.param(phase, marks=() if phase == lifecycle.STEP else pytest.mark.slow)
    for phase in PHASES if phase != lifecycle.STARTUP])
def test_a_nan_loss(run, tiny_config, monkeypatch, phase):
  if phase in (lifecycle.STEP, lifecycle.SAVE):
    # Step: NaN at step 3. Save: at step 4, which saves: its loss is read before the save.
    nan_step = 3 if phase == lifecycle.STEP else 4
    how, error, disk = run(_config(tiny_config), _nan_at(monkeypatch, train_step=nan_step))
    assert how == 'error' and isinstance(error, NonFiniteLoss), (how, error)
    assert f'at step {nan_step}' in str(error)
    assert disk['steps'] == [2]
    _assert_whole(run.workdir, disk)
    params = saved_state_field(os.path.join(run.workdir, 'checkpoints', '2'))
    assert all(np.isfinite(leaf).all() for leaf in jax_leaves(params))
    return
  # An evaluation reports a NaN figure; training goes on; final.json holds null and why.
  how, figures, disk = run(_config(tiny_config), _nan_at(monkeypatch, evaluation=phase))
  assert how == 'finished' and disk['steps'] == [2, 4, 6], (how, figures)
  final = json.load(open(os.path.join(run.workdir, workdir_layout.FINAL_JSON)))
  if phase == lifecycle.FINAL_EVALUATION:
    assert final['eval_loss'] is None and final['null_reasons']['eval_loss'] == 'was nan'
  else:
    assert np.isfinite(final['eval_loss'])
    assert np.isnan(_scalar(run.workdir, 'eval/loss', 3))


def jax_leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _scalar(workdir, tag, step):
  from conftest import scalar_events  # pylint: disable=import-outside-toplevel
  return scalar_events(workdir)[tag][step]


# The parts on their own.

def _wait_for(condition, seconds=10.0) -> bool:
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)  # A signal handler runs in the main thread between bytecodes.
  return condition()


@pytest.fixture
def exits(monkeypatch):
  """The exits the lifecycle would make, recorded instead of made (the run goes on)."""
  made = []
  monkeypatch.setattr(lifecycle, '_exit', lambda status, cleanup: made.append(status))
  return made


def test_sigterm_requests_a_save_and_closing_cancels_the_grace_period(exits):
  previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  with lifecycle.Lifecycle(grace_seconds=60, step_timeout_seconds=0) as life:
    assert signal.getsignal(signal.SIGTERM) != previous[signal.SIGTERM]  # Installed.
    with life.phase(lifecycle.STEP, 3):
      assert not life.requested(3)
      os.kill(os.getpid(), signal.SIGTERM)
      assert _wait_for(lambda: life.requested(3))
  grace_timer = life._grace_timer  # pylint: disable=protected-access
  grace_timer.join(10)  # Cancelled on closing: its thread ends without firing.
  assert not grace_timer.is_alive() and grace_timer.finished.is_set()
  assert exits == []
  assert {signum: signal.getsignal(signum) for signum in previous} == previous


def test_a_save_that_outlives_the_grace_period_ends_the_process(exits):
  with lifecycle.Lifecycle(grace_seconds=0.2, step_timeout_seconds=0) as life:
    with life.phase(lifecycle.SAVE, 4):
      os.kill(os.getpid(), signal.SIGTERM)
      assert _wait_for(lambda: exits != [])  # Not closed: the watchdog fires.
  assert exits == [143]


def test_a_second_sigterm_changes_nothing(exits):
  with lifecycle.Lifecycle(grace_seconds=600, step_timeout_seconds=0) as life:
    with life.phase(lifecycle.STEP, 1):
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)
      assert life.requested(1) and life.signum == signal.SIGTERM
  assert exits == []


def test_a_guarded_phase_finished_in_time_never_fires_and_0_disables_the_guard(exits):
  with lifecycle.Lifecycle(grace_seconds=600, step_timeout_seconds=2.0) as life:
    watcher = life._watcher  # pylint: disable=protected-access
    assert watcher.is_alive()
    for step in range(3):  # Each step finishes 40 times within the limit.
      with life.phase(lifecycle.STEP, step):
        time.sleep(0.05)
    time.sleep(2.5)  # Past the limit between phases: nothing happens.
  assert not watcher.is_alive() and exits == []
  with lifecycle.Lifecycle(grace_seconds=600, step_timeout_seconds=0) as off:
    with off.phase(lifecycle.STEP, 1):
      assert off._watcher is None  # pylint: disable=protected-access
      assert 'hang_guard' not in [t.name for t in threading.enumerate()]


def test_only_an_other_errno_passes_through_a_phase_unchanged():
  with lifecycle.Lifecycle(grace_seconds=600, step_timeout_seconds=0) as life:
    with pytest.raises(PermissionError):
      with life.phase(lifecycle.SAVE, 2):
        raise PermissionError(errno.EACCES, 'Permission denied', '/x')
    with pytest.raises(lifecycle.DiskFull, match=r'writing /x failed during the save of step 2'):
      with life.phase(lifecycle.SAVE, 2):
        raise OSError(errno.ENOSPC, 'No space left on device', '/x')
