"""A one-node SLURM cluster on 127.0.0.1 for tests: slurmctld and slurmd from Debian's slurm-wlm.

The configuration, state, spool and logs live in one temporary directory; no munge (auth/none,
cred/none), no cgroups (proctrack/linuxproc), the daemons run as the current user (root in CI).
`SlurmCluster.start()` returns once `sinfo` shows the node idle; `stop()` ends both daemons'
process groups. Clients (sbatch, squeue, scontrol, scancel) find it through `env()`'s
SLURM_CONF.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ('slurmctld', 'slurmd')
CLIENTS = ('sbatch', 'srun', 'squeue', 'scontrol', 'scancel', 'sinfo')
NODE = 'localhost'  # Resolves everywhere; JAX takes the coordinator's host from the node list.


def missing() -> list[str]:
  """The SLURM programs this machine lacks."""
  return [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def config_text(directory: str, cpus: int) -> str:
  """A slurm.conf for one node named `NODE` with `cpus` CPUs, everything under `directory`."""
  user = pwd.getpwuid(os.getuid()).pw_name
  return f'''\
ClusterName=t2t_test
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
# A requeued job waits cred_expire + 1 s before it may start again (default 121 s).
AuthInfo=cred_expire=5
CredType=cred/none
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
# Run the scheduler every second, not every 60 s: a requeued job starts once its BeginTime passes.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# After SIGTERM (scancel, requeue, time limit) a job has this long to save before SIGKILL.
KillWait=30
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
'''


class SlurmCluster:
  """slurmctld and slurmd for one node on this machine, configured under `directory`."""

  def __init__(self, directory: str, cpus: int = 0):
    self.directory = directory
    self.conf = os.path.join(directory, 'slurm.conf')
    self.cpus = cpus or max(2, os.cpu_count() or 1)
    self._daemons: list[subprocess.Popen] = []

  def env(self, **extra) -> dict[str, str]:
    """The environment for SLURM clients (and the jobs they submit)."""
    return dict(os.environ, SLURM_CONF=self.conf, **extra)

  def start(self, timeout: float = 60.0) -> 'SlurmCluster':
    for name in ('state', 'spool'):
      os.makedirs(os.path.join(self.directory, name), exist_ok=True)
    with open(self.conf, 'w') as f:
      f.write(config_text(self.directory, self.cpus))
    # -D: foreground, so the process we hold is the daemon; -i/-c: ignore any old state.
    commands = [['slurmctld', '-D', '-i', '-f', self.conf],
                ['slurmd', '-D', '-c', '-N', NODE, '-f', self.conf]]
    try:
      for command in commands:
        log = open(os.path.join(self.directory, f'{command[0]}.stdout'), 'w')
        self._daemons.append(subprocess.Popen(command, env=self.env(), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        log.close()
      self._wait_idle(timeout)
    except BaseException:
      self.stop()
      raise
    return self

  def _wait_idle(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ''
    while time.monotonic() < deadline:
      for daemon in self._daemons:
        if daemon.poll() is not None:
          raise RuntimeError(f'{daemon.args[0]} exited with status {daemon.returncode}:\n'
                             f'{self.logs()}')
      state = self.run('sinfo', '--noheader', '--format=%T', check=False).stdout.strip()
      if state == 'idle':
        return
      time.sleep(0.5)
    raise RuntimeError(f'the SLURM node is not idle after {timeout:.0f} s (state '
                       f'{state!r}):\n{self.logs()}')

  def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """A SLURM client command against this cluster."""
    kwargs.setdefault('env', self.env())
    return subprocess.run(list(command), capture_output=True, text=True, check=check,
                          timeout=180, **kwargs)

  def logs(self) -> str:
    """The tails of both daemons' logs, for failure messages."""
    tails = []
    for name in DAEMONS:
      path = os.path.join(self.directory, f'{name}.log')
      if os.path.exists(path):
        with open(path, errors='replace') as f:
          tails.append(f'--- {path}\n' + ''.join(f.readlines()[-30:]))
    return '\n'.join(tails)

  def job_state(self, job_id: str) -> dict[str, str]:
    """The `scontrol show job` fields of one job (JobState, ExitCode, Restarts, ...)."""
    text = self.run('scontrol', '--oneliner', 'show', 'job', job_id).stdout
    fields = {}
    for item in text.split():
      key, _, value = item.partition('=')
      fields.setdefault(key, value)
    return fields

  def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
    """Waits until the job (every element of an array) has left the queue; its last fields."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      queued = self.run('squeue', '--noheader', f'--jobs={job_id}', '--format=%i %T',
                        check=False).stdout.split()
      if not queued:
        return self.job_state(job_id)
      time.sleep(0.5)
    raise TimeoutError(f'job {job_id} still queued after {timeout:.0f} s:\n'
                       + self.run('squeue', check=False).stdout)

  def stop(self) -> None:
    """Cancels every job, then ends both daemons and everything they started."""
    if all(daemon.poll() is None for daemon in self._daemons):
      # Job steps run under slurmstepd, outside the daemons' process groups: let SLURM end
      # them (SIGTERM, SIGKILL after KillWait) before the daemons go.
      self.run('scancel', '--full', f'--user={pwd.getpwuid(os.getuid()).pw_name}', check=False)
      deadline = time.monotonic() + 45
      while time.monotonic() < deadline and self.run('squeue', '--noheader', check=False).stdout:
        time.sleep(0.5)
    for daemon in reversed(self._daemons):  # slurmd (and its job steps) first.
      _end_group(daemon)
    self._daemons = []


def _end_group(process: subprocess.Popen) -> None:
  """SIGTERM to the process group, SIGKILL after 10 s; the group includes jobs slurmd forked."""
  for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      break
    try:
      process.wait(timeout=wait)
      # Children of the group (slurmstepd, job tasks) may outlive the daemon itself.
      os.killpg(process.pid, signal.SIGKILL)
    except subprocess.TimeoutExpired:
      continue
    except ProcessLookupError:
      pass
    break
  process.wait()
