"""Turns a hung step or collective into a crash with the Python stacks of every thread."""

import faulthandler
import os
import sys
import threading
import time

from absl import logging
import jax

from t2t_jax import exit_codes

EXIT_STATUS = exit_codes.HANG  # Not Python's 1: a launcher can tell a hang from an error.


class HangGuard:
  """A deadline per training step: past it, all thread stacks go to stderr and the process exits.

  `arm(what)` (re)starts the countdown, `disarm()` stops it. Each process of a multi-process
  run has its own guard, so when one peer stalls a collective, every process waiting on it
  dumps its stacks and exits instead of hanging until the job's wall-clock limit. A limit of 0
  disables the guard. The watcher is a daemon thread; blocking JAX calls release the GIL, so it
  runs while the main thread waits on a device.
  """

  def __init__(self, limit_seconds: float):
    self.limit_seconds = limit_seconds
    self._deadline, self._what, self._stopped = None, '', False
    self._changed = threading.Condition()
    self._thread = None

  def __enter__(self):
    if self.limit_seconds > 0:
      self._thread = threading.Thread(target=self._watch, name='hang_guard', daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc_info):
    if self._thread:
      with self._changed:
        self._deadline, self._stopped = None, True
        self._changed.notify()
      self._thread.join()

  def arm(self, what: str) -> None:
    if self._thread:
      with self._changed:
        self._deadline, self._what = time.monotonic() + self.limit_seconds, what
        self._changed.notify()

  def disarm(self) -> None:
    if self._thread:
      with self._changed:
        self._deadline = None
        self._changed.notify()

  def _watch(self) -> None:
    with self._changed:
      while not self._stopped:
        if self._deadline is None:
          self._changed.wait()
          continue
        left = self._deadline - time.monotonic()
        if left > 0:
          self._changed.wait(left)
          continue
        message = (f'{self._what} took longer than config.train.step_timeout_seconds='
                   f'{self.limit_seconds:g} s on process {jax.process_index()}: a stalled step, '
                   'data reader or collective (a peer may have died). Stacks of all threads '
                   f'follow; exiting with status {EXIT_STATUS}.')
        logging.error(message)
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_STATUS)  # pylint: disable=protected-access

