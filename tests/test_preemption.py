"""SIGTERM becomes "save and stop" in process; the hang guard's countdown (the process-ending
paths of both run as subprocesses in test_checkpoint.py and test_launch.py, marked slow)."""

import os
import signal
import threading
import time

import pytest

from t2t_jax import hang_guard
from t2t_jax import preemption


def _wait_for(condition, seconds=10.0) -> bool:
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)  # A signal handler runs in the main thread between bytecodes.
  return condition()


@pytest.fixture
def exits(monkeypatch):
  """The process exits the guard would make, recorded instead of made."""
  made = []
  monkeypatch.setattr(preemption.Preemption, '_exit_now',
                      lambda self, signum, message: made.append((signum, message)))
  return made


def test_sigterm_requests_a_save_and_close_cancels_the_grace_period(exits):
  previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  guard = preemption.Preemption(grace_seconds=0.3)
  try:
    assert signal.getsignal(signal.SIGTERM) != previous[signal.SIGTERM]  # Installed.
    assert not guard.requested(3)
    os.kill(os.getpid(), signal.SIGTERM)
    assert _wait_for(lambda: guard.requested(4))
  finally:
    guard.close()  # The save finished in time.
  time.sleep(0.6)  # Twice the grace period: a watchdog still running would have fired.
  assert exits == []
  assert {signum: signal.getsignal(signum) for signum in previous} == previous
  error = preemption.Preempted(7, '/tmp/w')
  assert error.step == 7 and 'step 7 in /tmp/w' in str(error) and error.exit_code == 143


def test_a_save_that_outlives_the_grace_period_ends_the_process(exits):
  guard = preemption.Preemption(grace_seconds=0.2)
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    assert _wait_for(lambda: exits != [])  # Not closed: the watchdog fires.
  finally:
    guard.close()
  [(signum, message)] = exits
  assert signum == signal.SIGTERM and 'grace period after SIGTERM ran out' in message


def test_ctrl_c_requests_a_save_and_a_second_one_exits_at_once(exits):
  guard = preemption.Preemption(grace_seconds=600)
  try:
    os.kill(os.getpid(), signal.SIGINT)  # Not a KeyboardInterrupt: the guard's handler.
    assert _wait_for(lambda: guard.requested(5)) and guard.signum == signal.SIGINT
    assert exits == []
    os.kill(os.getpid(), signal.SIGINT)
    assert _wait_for(lambda: exits != [])
  finally:
    guard.close()
  [(signum, message)] = exits
  assert signum == signal.SIGINT and message.startswith('Second Ctrl-C: exiting without saving')
  assert preemption.Preempted(5, '/tmp/w', signal.SIGINT).exit_code == 130


def test_hang_guard_disarmed_in_time_never_fires_and_stops_its_thread():
  with hang_guard.HangGuard(0.3) as guard:
    watcher = guard._thread
    assert watcher.is_alive()
    for step in range(3):  # Each step finishes well within the limit.
      guard.arm(f'training step {step}')
      time.sleep(0.05)
      guard.disarm()
    time.sleep(0.5)  # Past the limit while disarmed: nothing happens (else os._exit).
  assert not watcher.is_alive()
  with hang_guard.HangGuard(0) as off:  # 0 disables it: no thread at all.
    off.arm('step')
    assert off._thread is None and 'hang_guard' not in [t.name for t in threading.enumerate()]


def test_a_signal_abandons_only_the_work_marked_interruptible(exits):
  guard = preemption.Preemption(grace_seconds=600)
  try:
    with pytest.raises(preemption.Interrupted, match='SIGTERM'):
      with guard.interruptible():  # An evaluation: abandoned at once, not finished first.
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: False, seconds=5)  # Interrupted long before this ends.
    assert guard.requested(9) and exits == []
    os.kill(os.getpid(), signal.SIGTERM)  # A second signal outside: nothing is abandoned.
    time.sleep(0.1)
  finally:
    guard.close()
  assert exits == []
