"""SIGTERM (preemption): save at the current step, then exit within a grace period."""

import os
import signal
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils

EXIT_CODE = 128 + signal.SIGTERM  # What a shell reports for a process ended by SIGTERM.


class Preempted(Exception):
  """Training stopped on SIGTERM after saving a checkpoint at `step`."""

  def __init__(self, step: int, directory: str):
    super().__init__(f'preempted (SIGTERM): saved a checkpoint at step {step} in {directory}; '
                     'run the same command to resume from it')
    self.step = step


class Preemption:
  """Turns SIGTERM into "save at the end of this step and stop".

  Single process: a Python signal handler sets a flag. Multi-process: JAX's preemption service
  (started by jax.distributed.initialize) catches the signal on any process and agrees on one
  step at which all processes save. Either way a watchdog ends the process `grace_seconds`
  after the signal if the save has not finished; the previous checkpoint stays intact.
  """

  def __init__(self, grace_seconds: float):
    self.grace_seconds = grace_seconds
    self._signalled = threading.Event()
    self._timer = None
    self._multi_process = jax.process_count() > 1
    self._previous = None
    if not self._multi_process and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    if self._signalled.is_set():
      return
    self._signalled.set()
    logging.warning('SIGTERM received: saving a checkpoint after the current step, exiting '
                    'within %s seconds (config.ckpt.preemption_grace_seconds)',
                    self.grace_seconds)
    self._start_watchdog()

  def _start_watchdog(self):
    self._timer = threading.Timer(self.grace_seconds, self._expire)
    self._timer.daemon = True
    self._timer.start()

  def _expire(self):
    logging.error('The %s s grace period after SIGTERM ran out before the checkpoint was '
                  'written; exiting now. The previous checkpoint is intact; raise '
                  'config.ckpt.preemption_grace_seconds if the scheduler allows more time.',
                  self.grace_seconds)
    logging.flush()
    os._exit(EXIT_CODE)  # pylint: disable=protected-access

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
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
