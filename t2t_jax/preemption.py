"""SIGTERM (preemption) and Ctrl-C: save at the current step, then exit within a grace period."""

import contextlib
import os
import signal
import sys
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils

from t2t_jax import exit_codes
from t2t_jax import workdir_lock

EXIT_CODE = exit_codes.PREEMPTED
EXIT_CODES = exit_codes.BY_SIGNAL
_NAMES = {signal.SIGTERM: 'SIGTERM', signal.SIGINT: 'Ctrl-C (SIGINT)'}


class Preempted(Exception):
  """Training stopped on SIGTERM or Ctrl-C after saving a checkpoint at `step`."""

  def __init__(self, step: int, directory: str, signum: int = signal.SIGTERM):
    what = 'preempted (SIGTERM)' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'
    super().__init__(f'{what}: saved a checkpoint at step {step} in {directory}; run the same '
                     'command to resume from it')
    self.step = step
    self.exit_code = EXIT_CODES[signum]


class Interrupted(BaseException):
  """A signal arrived inside `Preemption.interruptible()`: the work there is abandoned. Like
  KeyboardInterrupt it is not an Exception, so no `except Exception` on the way (a logging
  handler's, a library's) swallows it."""


class Preemption:
  """Turns SIGTERM and Ctrl-C into "save at the end of this step and stop".

  Single process: a Python signal handler sets a flag; a second Ctrl-C exits at once, after
  removing the unfinished save (`remove_unfinished`, e.g. `Checkpointer.remove_unfinished`) and
  the workdir lock, so the checkpoints left are whole and the next launch starts at once. Multi-process: JAX's preemption service (started by
  jax.distributed.initialize) catches SIGTERM on any process and agrees on one step at which
  all processes save; Ctrl-C there stays Python's KeyboardInterrupt. Either way a watchdog
  ends the process `grace_seconds` after the signal if the save has not finished; the
  previous checkpoint stays intact.
  """

  def __init__(self, grace_seconds: float, remove_unfinished=lambda: None):
    self.grace_seconds = grace_seconds
    self.remove_unfinished = remove_unfinished
    self.signum = signal.SIGTERM
    self._signalled = threading.Event()
    self._timer = None
    self._multi_process = jax.process_count() > 1
    self._previous = {}
    self._interruptible = False
    if not self._multi_process and threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self._signalled.is_set():
      if signum == signal.SIGINT:  # The user insists: stop now, keep only whole checkpoints.
        self._exit_now(signal.SIGINT, 'Second Ctrl-C: exiting without saving; the previous '
                       'checkpoint is intact.')
      return
    self.signum = signum
    self._signalled.set()
    logging.warning('%s received: saving a checkpoint after the current step, exiting within '
                    '%s seconds (config.ckpt.preemption_grace_seconds)%s', _NAMES[signum],
                    self.grace_seconds,
                    '; Ctrl-C again exits at once' if signum == signal.SIGINT else '')
    self._start_watchdog()
    if self._interruptible:  # An evaluation: abandon it, so the save fits the grace period.
      self._interruptible = False
      raise Interrupted(_NAMES[signum])

  @contextlib.contextmanager
  def interruptible(self):
    """Work that a signal abandons at once (an evaluation: 25 s to minutes, longer than a
    scheduler's grace period), raising Interrupted, rather than finishing it before the save.
    Only work that leaves nothing half-written belongs here (no checkpoint reads or writes)."""
    if self._signalled.is_set():  # It came since the step asked: abandon before starting.
      raise Interrupted(_NAMES[self.signum])
    self._interruptible = True
    try:
      yield
    finally:
      self._interruptible = False

  def _start_watchdog(self):
    self._timer = threading.Timer(self.grace_seconds, self._expire)
    self._timer.daemon = True
    self._timer.start()

  def _expire(self):
    self._exit_now(self.signum, f'The {self.grace_seconds} s grace period after '
                   f'{_NAMES[self.signum]} ran out before the checkpoint was written; exiting '
                   'now. The previous checkpoint is intact; raise '
                   'config.ckpt.preemption_grace_seconds if the scheduler allows more time.')

  def _exit_now(self, signum: int, message: str):
    logging.error('%s', message)
    logging.flush()
    sys.stderr.flush()
    # Exiting at once: writer threads of an abandoned save may still print their own errors
    # (tensorstore callbacks on orbax's closed event loop); the line above is the last word.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    try:
      self.remove_unfinished()
      workdir_lock.remove_held_locks()
    finally:
      os._exit(EXIT_CODES[signum])  # pylint: disable=protected-access

  def requested(self, step: int) -> bool:
    """True at the step where every process should save and stop."""
    if self._multi_process:
      if multihost_utils.reached_preemption_sync_point(step):
        if self._timer is None:
          logging.warning('Preemption notice: all processes save at step %d', step)
          self._start_watchdog()
        return True
      return False
    return self._signalled.is_set()

  def close(self):
    if self._timer is not None:
      self._timer.cancel()
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}
