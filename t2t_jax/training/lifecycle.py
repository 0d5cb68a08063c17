"""A training run's lifecycle: the phase it is in, and what a signal, a hang or a full disk does there.

The phases are start-up, step, save, evaluation and final evaluation. docs/training.md ("What
stops a run, phase by phase") tabulates what SIGTERM, Ctrl-C, a second signal, a hang, a full
disk and a NaN loss do in each; tests/test_lifecycle.py has a test per cell. The exit statuses
are exit_codes.py's.
"""

import contextlib
import errno
import faulthandler
import os
import signal
import sys
import threading
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from t2t_jax import exit_codes
from t2t_jax.errors import DiskFull  # Defined with the other user errors.
from t2t_jax import workdir_lock

STARTUP, STEP, SAVE, EVALUATION, FINAL_EVALUATION = (
    'start-up', 'step', 'save', 'evaluation', 'final evaluation')
# A signal abandons these at once (single process): they write nothing a later launch reads
# half-written, and an evaluation takes 25 s to minutes, longer than a scheduler's grace period.
_INTERRUPTIBLE = (STARTUP, EVALUATION, FINAL_EVALUATION)
# The hang guard watches these: their time is bounded. Start-up and evaluations are not: they
# compile (minutes on a big model) and start-up reads the data.
_GUARDED = (STEP, SAVE)
_NAMES = {signal.SIGTERM: 'SIGTERM', signal.SIGINT: 'Ctrl-C (SIGINT)'}


class Preempted(Exception):
  """Training stopped on SIGTERM or Ctrl-C; `step` is the checkpoint saved (None: nothing was
  trained since the newest checkpoint, so nothing was saved)."""

  def __init__(self, signum: int, phase: str, where: str, step: int | None, directory: str):
    what = 'preempted (SIGTERM)' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'
    if step is None:
      message = (f'{what} during {where}: nothing was trained since the newest checkpoint '
                 f'in {directory}, so nothing was saved; run the same command to resume')
    else:
      message = (f'{what}: saved a checkpoint at step {step} in {directory} (the signal came '
                 f'during {where}); run the same command to resume from it')
    super().__init__(message)
    self.step, self.phase = step, phase
    self.exit_code = exit_codes.BY_SIGNAL[signum]


class Interrupted(BaseException):
  """A signal arrived in an interruptible phase: its work is abandoned. Like KeyboardInterrupt
  it is not an Exception, so no `except Exception` on the way (a logging handler's, a
  library's) swallows it."""


def _exit(status: int, cleanup) -> None:
  """Ends the process now, without unwinding, after `cleanup()`. Tests replace it."""
  # Writer threads of an abandoned save may still print their own errors (tensorstore
  # callbacks on orbax's closed event loop); the line logged before this is the last word.
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  try:
    cleanup()
  finally:
    os._exit(status)  # pylint: disable=protected-access


def _entered(phase: str, step: int | None) -> None:
  """Called on entering each phase, after the hang guard is armed for it; does nothing. The
  tests replace it to make a signal, a hang or a full disk happen in a chosen phase."""
  del phase, step


class Lifecycle:
  """Signals, the hang guard and the phase of one training run (a context manager).

  Single process: a Python handler turns the first SIGTERM or Ctrl-C into "save at the end of
  this step and stop", or abandons an interruptible phase at once (raising Interrupted); a
  second Ctrl-C exits at once (a second SIGTERM changes nothing). Multi-process: JAX's
  preemption service (started by jax.distributed.initialize) catches SIGTERM on any process
  and agrees on one step at which every process saves; Ctrl-C is handed to it as SIGTERM, and
  the processes agree at that step whether any saw Ctrl-C. Nothing is abandoned there: a
  process cannot leave a collective its peers are in. Either way a watchdog ends the process
  `grace_seconds` after the signal if the save has not finished, and a guarded phase that
  outlasts `step_timeout_seconds` (0: never) dumps every thread's stack and exits with
  exit_codes.HANG. Exits without unwinding first remove the unfinished save
  (`remove_unfinished`, set once the Checkpointer exists) and the workdir lock.
  """

  def __init__(self, grace_seconds: float, step_timeout_seconds: float):
    self.grace_seconds = grace_seconds
    self.step_timeout_seconds = step_timeout_seconds
    self.remove_unfinished = lambda: None
    self.current_phase, self.step = STARTUP, None
    self.signum = signal.SIGTERM
    self._signalled_in = None  # (phase, where) the first signal came in.
    self._multi_process = jax.process_count() > 1
    self._signalled = threading.Event()
    self._sigint_seen = False
    self._interruptible = False
    self._grace_timer = None
    self._previous = {}
    self._deadline = None
    self._changed = threading.Condition()
    self._watcher, self._watcher_stop = None, False

  def __enter__(self) -> 'Lifecycle':
    if threading.current_thread() is threading.main_thread():
      # Multi-process: JAX's preemption service has SIGTERM; a handler here would replace it.
      signals = (signal.SIGINT,) if self._multi_process else (signal.SIGTERM, signal.SIGINT)
      for signum in signals:
        self._previous[signum] = signal.signal(signum, self._handle)
    self._interruptible = not self._multi_process  # Start-up, until the first phase.
    if self.step_timeout_seconds > 0:
      self._watcher = threading.Thread(target=self._watch, name='hang_guard', daemon=True)
      self._watcher.start()
    return self

  def __exit__(self, *exc_info):
    self._interruptible = False
    if self._grace_timer is not None:
      self._grace_timer.cancel()
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}
    if self._watcher:
      with self._changed:
        self._deadline, self._watcher_stop = None, True
        self._changed.notify()
      self._watcher.join()
      self._watcher = None

  @contextlib.contextmanager
  def phase(self, name: str, step: int | None = None):
    """The block is phase `name` (of `step`): interruptible, guarded, or neither, as the
    tables above say; a write in it that finds the disk full raises DiskFull."""
    interruptible = name in _INTERRUPTIBLE and not self._multi_process
    if interruptible and self._signalled.is_set():  # Came since the step asked: abandon now.
      raise Interrupted(_NAMES[self.signum])
    self.current_phase, self.step, self._interruptible = name, step, interruptible
    if name in _GUARDED:
      self._arm()
    try:
      _entered(name, step)
      yield
    except OSError as e:
      if e.errno != errno.ENOSPC:
        raise
      raise DiskFull(f'the disk is full: writing {e.filename or "a file"} failed during '
                     f'{self.where()} ({e.strerror}). Training stopped; the checkpoints '
                     'already written are intact. Free space (or use a --workdir on another '
                     'disk, copying the checkpoints) and rerun the same command to resume.'
                     ) from e
    finally:
      self._interruptible = False
      self.disarm()

  def where(self) -> str:
    """The phase, for messages: 'start-up', 'step 5', 'the evaluation of step 6'."""
    if self.step is None:
      return self.current_phase
    if self.current_phase == STEP:
      return f'step {self.step}'
    return f'the {self.current_phase} of step {self.step}'

  def requested(self, step: int) -> bool:
    """True at the step where every process should save and stop."""
    if not self._multi_process:
      return self._signalled.is_set()
    if not multihost_utils.reached_preemption_sync_point(step):
      return False
    # Every process is at this step: agree whether it was Ctrl-C on any of them.
    seen = multihost_utils.process_allgather(np.array(self._sigint_seen))
    self.signum = signal.SIGINT if np.any(seen) else signal.SIGTERM
    if self._grace_timer is None:
      logging.warning('%s: all processes save at step %d', _NAMES[self.signum], step)
      self._start_grace_period()
    return True

  def stopped(self, step: int | None, directory: str) -> Preempted:
    """The Preempted error for a run stopped by this lifecycle's signal, `step` saved."""
    phase, where = self._signalled_in or (self.current_phase, self.where())
    return Preempted(self.signum, phase, where, step, directory)

  # Signals.

  def _handle(self, signum, frame):
    del frame
    if self._signalled.is_set() or self._sigint_seen:
      if signum == signal.SIGINT:  # The user insists: stop now, keep only whole checkpoints.
        self._exit_now(exit_codes.INTERRUPTED, f'Second Ctrl-C during {self.where()}: '
                       'exiting without saving; the previous checkpoint is intact.')
      return
    if self._multi_process:  # Only SIGINT comes here: the preemption service has SIGTERM.
      self._sigint_seen = True
      self._signalled_in = (self.current_phase, self.where())
      logging.warning('Ctrl-C (SIGINT) received during %s: all processes save at a step '
                      'they agree on, then exit; Ctrl-C again exits at once', self.where())
      os.kill(os.getpid(), signal.SIGTERM)  # To JAX's preemption service, which tells all.
      return
    self.signum = signum
    self._signalled_in = (self.current_phase, self.where())
    self._signalled.set()
    logging.warning('%s received during %s: saving a checkpoint after the current step, '
                    'exiting within %s seconds (config.ckpt.preemption_grace_seconds)%s',
                    _NAMES[signum], self.where(), self.grace_seconds,
                    '; Ctrl-C again exits at once' if signum == signal.SIGINT else '')
    self._start_grace_period()
    if self._interruptible:
      self._interruptible = False
      raise Interrupted(_NAMES[signum])

  def _start_grace_period(self):
    self._grace_timer = threading.Timer(self.grace_seconds, self._grace_expired)
    self._grace_timer.daemon = True
    self._grace_timer.start()

  def _grace_expired(self):
    self._exit_now(exit_codes.BY_SIGNAL[self.signum], (
        f'The {self.grace_seconds} s grace period after {_NAMES[self.signum]} ran out during '
        f'{self.where()} before the checkpoint was written; exiting now. The previous '
        'checkpoint is intact; raise config.ckpt.preemption_grace_seconds if the scheduler '
        'allows more time.'))

  def _exit_now(self, status: int, message: str, stacks: bool = False):
    logging.error('%s', message)
    logging.flush()
    if stacks:
      print(message, file=sys.stderr, flush=True)
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()

    def cleanup():
      self.remove_unfinished()
      workdir_lock.remove_held_locks()
    _exit(status, cleanup)

  # The hang guard.

  def _arm(self):
    if self._watcher:
      with self._changed:
        self._deadline = time.monotonic() + self.step_timeout_seconds
        self._changed.notify()

  def disarm(self) -> None:
    """Stops the hang guard's countdown until the next guarded phase (a step that compiles)."""
    if self._watcher:
      with self._changed:
        self._deadline = None
        self._changed.notify()

  def _watch(self) -> None:
    """The watcher thread; blocking JAX calls release the GIL, so it runs while the main
    thread waits on a device. Each process of a multi-process run has its own, so when one
    peer stalls a collective, every process waiting on it dumps its stacks and exits."""
    with self._changed:
      while not self._watcher_stop:
        if self._deadline is None:
          self._changed.wait()
          continue
        left = self._deadline - time.monotonic()
        if left > 0:
          self._changed.wait(left)
          continue
        what = (f'training step {self.step} (or reading the metrics of step {self.step - 1})'
                if self.current_phase == STEP else self.where())
        self._deadline = None
        self._exit_now(exit_codes.HANG, (
            f'{what} took longer than config.train.step_timeout_seconds='
            f'{self.step_timeout_seconds:g} s on process {jax.process_index()}: a stalled '
            'step, data reader, save or collective (a peer may have died). Stacks of all '
            f'threads follow; exiting with status {exit_codes.HANG}.'), stacks=True)
