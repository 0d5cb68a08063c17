"""SIGTERM becomes "save and stop" in process; the hang guard's countdown (the process-ending
paths of both run as subprocesses in test_checkpoint.py and test_launch.py, marked slow)."""

import os
import signal
import threading
import time

from t2t_jax import hang_guard
from t2t_jax import preemption


def test_sigterm_sets_the_request_and_close_restores_the_handler():
  previous = signal.getsignal(signal.SIGTERM)
  guard = preemption.Preemption(grace_seconds=600)
  try:
    assert signal.getsignal(signal.SIGTERM) != previous  # Installed.
    assert not guard.requested(3)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not guard.requested(4) and time.monotonic() < deadline:
      time.sleep(0.01)  # The handler runs in the main thread between bytecodes.
    assert guard.requested(4)
    assert guard._timer is not None and guard._timer.is_alive()  # The grace watchdog runs.
  finally:
    guard.close()
  assert not guard._timer.is_alive() or guard._timer.finished.is_set()  # Cancelled.
  assert signal.getsignal(signal.SIGTERM) == previous
  error = preemption.Preempted(7, '/tmp/w')
  assert error.step == 7 and 'step 7 in /tmp/w' in str(error)
  assert preemption.EXIT_CODE == 143


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
