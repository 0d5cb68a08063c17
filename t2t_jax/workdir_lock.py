"""One run per workdir: a lock file naming the host and process that train in it.

`<workdir>/run.lock` holds {host, pid, start_ticks, since, slurm_job, slurm_restart}. It is created atomically (a link
of a finished file, which also works on NFS), refreshed by a heartbeat thread, and removed on
every way out Python sees: a clean exit, an error, SIGTERM and Ctrl-C (lifecycle.py turns
those into an exception, or removes the lock itself before an exit that does not unwind). A lock whose holder is gone is
taken over with a warning: on this host when the PID no longer runs (or is another process of
the same number), from another host when its heartbeat is older than STALE_SECONDS, and from
an earlier run of the same SLURM job (requeued, perhaps onto another node) at once.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import threading
import time

from absl import logging
import numpy as np

from t2t_jax.errors import WorkdirLocked, WorkdirUnusable  # Defined with the other user errors.

LOCK_FILE = 'run.lock'
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # Another host's lock not refreshed for this long is from a lost node.


def make_workdir(workdir: str) -> None:
  """Creates `workdir` (and its parents), or raises WorkdirUnusable saying what to change."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirUnusable(f'--workdir={workdir} is a file, not a directory: choose another '
                          'path (a new one is created)')
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirUnusable(f'cannot create --workdir={workdir}: {e.strerror}: choose a path '
                          'you can write to') from None


@contextlib.contextmanager
def hold(workdir: str, force: bool = False):
  """Process 0 holds the workdir's lock for the block; a refusal stops every process.

  In a multi-process run process 0 tells the others whether it got the lock, so all of them
  raise the same WorkdirLocked at once instead of waiting for process 0 at a collective.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    with WorkdirLock(workdir, force):
      yield
    return
  lock, refusal = None, ''
  if jax.process_index() == 0:
    lock = WorkdirLock(workdir, force)
    try:
      lock.acquire()
    except WorkdirLocked as e:
      lock, refusal = None, str(e)
  refusal = _from_process_zero(refusal)
  if refusal:
    raise WorkdirLocked(refusal)
  try:
    yield
  finally:
    if lock:
      lock.release()


_MESSAGE_BYTES = 2048


def _from_process_zero(text: str) -> str:
  """Process 0's `text` on every process (a collective: all processes must call it)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  encoded = text.encode()[:_MESSAGE_BYTES]
  buffer = np.zeros(_MESSAGE_BYTES + 1, np.int32)  # The length, then the bytes.
  buffer[0] = len(encoded)
  buffer[1:1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
  received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return bytes(received[1:1 + int(received[0])].astype(np.uint8)).decode(errors='replace')


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  start_ticks: int | None  # From /proc/<pid>/stat: tells a reused PID from the holder.
  since: str
  slurm_job: str | None = None  # A requeued SLURM job keeps its ID and counts its restarts.
  slurm_restart: int = 0

  @classmethod
  def this_process(cls) -> 'Holder':
    return cls(socket.gethostname(), os.getpid(), _start_ticks(os.getpid()),
               time.strftime('%Y-%m-%d %H:%M:%S'), os.environ.get('SLURM_JOB_ID'),
               int(os.environ.get('SLURM_RESTART_COUNT', '0')))


def _start_ticks(pid: int) -> int | None:
  """Start time of `pid` in clock ticks since boot; None when it does not run (or no /proc)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()  # The name may hold spaces and ')'.
  except OSError:
    return None
  return None if fields[0] in 'ZX' else int(fields[19])  # A zombie has ended.


def _runs(holder: Holder) -> bool:
  """Whether `holder` (a process of this host) still runs."""
  if os.path.isdir('/proc'):
    return _start_ticks(holder.pid) is not None and holder.start_ticks in (
        None, _start_ticks(holder.pid))
  try:
    os.kill(holder.pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Runs, as another user.
  return True


def held(workdir: str) -> bool | None:
  """Whether a live process holds `workdir`'s lock: False (no lock, or its holder on this host
  has ended), True (it runs here), None (another host's: its heartbeat decides)."""
  try:
    with open(os.path.join(workdir, LOCK_FILE)) as f:
      holder = Holder(**json.load(f))
  except (OSError, ValueError, TypeError):
    return False
  if holder.host != socket.gethostname():
    return None
  return _runs(holder)


class WorkdirLock:
  """Holds `<workdir>/run.lock` while in use (a context manager); `force` takes it regardless."""

  def __init__(self, workdir: str, force: bool = False):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.force = force
    self.holder = Holder.this_process()
    self._stop = threading.Event()
    self._heartbeat = None

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc_info):
    self.release()

  def acquire(self) -> None:
    """Takes the lock, or raises WorkdirLocked naming the live holder and what to do."""
    for _ in range(5):  # Another launch may take or free it between our reads.
      if self._create():
        break
      current = self._read()
      if current is None:
        continue  # Freed meanwhile.
      problem = self._stale(current)
      if not (problem or self.force):
        raise WorkdirLocked(
            f'{os.path.dirname(self.path)} is in use by PID {current.pid} on host '
            f'{current.host} (running since {current.since}): wait for that run to end or stop '
            f'it; if you know it is gone, rerun with --force_unlock (or delete {self.path})')
      logging.warning('Taking over the lock of %s from PID %d on host %s: %s.',
                      os.path.dirname(self.path), current.pid, current.host,
                      problem or 'forced by --force_unlock')
      self._remove_if(current)
    else:
      raise WorkdirLocked(f'could not take {self.path}: other launches keep taking it; launch '
                          'one run per workdir')
    self._heartbeat = threading.Thread(target=self._beat, name='workdir-lock', daemon=True)
    self._heartbeat.start()
    _HELD.add(self)

  def release(self) -> None:
    """Removes the lock if it is still this process's."""
    _HELD.discard(self)
    self._stop.set()
    if self._heartbeat:
      self._heartbeat.join()
      self._heartbeat = None
    self._remove_if(self.holder)

  def _create(self) -> bool:
    temporary = f'{self.path}.{self.holder.host}.{self.holder.pid}'
    with open(temporary, 'w') as f:
      json.dump(dataclasses.asdict(self.holder), f)
    try:
      os.link(temporary, self.path)  # Atomic, and fails if the lock exists.
      return True
    except FileExistsError:
      return False
    finally:
      os.remove(temporary)

  def _read(self) -> Holder | None:
    try:
      with open(self.path) as f:
        return Holder(**json.load(f))
    except FileNotFoundError:
      return None
    except (ValueError, TypeError):  # Not ours to judge: an unreadable lock counts as stale.
      return Holder('?', -1, None, 'unknown')

  def _stale(self, holder: Holder) -> str:
    """Why `holder`'s lock is left over ('' while its run may live)."""
    if holder.pid < 0:
      return f'{self.path} is unreadable'
    if holder.slurm_job and holder.slurm_job == self.holder.slurm_job and (
        holder.slurm_restart < self.holder.slurm_restart):
      return (f'it is from run {holder.slurm_restart} of SLURM job {holder.slurm_job}, which '
              'SLURM ended before requeueing the job')
    if holder.host == self.holder.host:
      return '' if _runs(holder) else 'that process no longer runs (killed?)'
    try:
      age = time.time() - os.path.getmtime(self.path)
    except FileNotFoundError:
      return 'it was released'
    return (f'its heartbeat stopped {age:.0f} s ago (a lost node?)' if age > STALE_SECONDS
            else '')

  def _remove_if(self, holder: Holder) -> None:
    if self._read() == holder:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      try:
        os.utime(self.path)
      except OSError as e:
        logging.warning('Could not refresh the workdir lock %s: %s', self.path, e)


_HELD = set()  # The locks this process holds.


def remove_held_locks() -> None:
  """Removes this process's lock files at once, for a process about to end without unwinding
  (lifecycle.py: after a second Ctrl-C, a grace period run out or a hang)."""
  for lock in list(_HELD):
    lock._remove_if(lock.holder)  # pylint: disable=protected-access


def scratch_prefix(stem: str) -> str:
  """Prefix of a temporary folder this process writes: `<stem>-<host>-<pid>-`."""
  return f'{stem}-{socket.gethostname()}-{os.getpid()}-'


def remove_dead_scratch(parent: str, stem: str) -> None:
  """Removes the `scratch_prefix(stem)` folders in `parent` of this host's ended processes.

  A killed vocabulary or cache build leaves its folder behind; a live one's is left alone, as
  is another host's (whose processes cannot be seen from here).
  """
  host = socket.gethostname()
  try:
    names = os.listdir(parent)
  except FileNotFoundError:
    return
  for name in names:
    if not name.startswith(f'{stem}-{host}-'):
      continue
    pid = name[len(stem) + len(host) + 2:].split('-', 1)[0]
    if pid.isdigit() and not _runs(Holder(host, int(pid), None, '')):
      logging.info('Removing %s, left by an interrupted run (PID %s)', name, pid)
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
