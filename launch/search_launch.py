"""Where a search's trials run (launch/search.py): each trial's process set up (the parent-death
signal, its worker's CPU cores), the devices split between workers, an earlier run's lock
waited out, and the SLURM array whose elements are the study's workers."""

import ctypes
import os
import shlex
import signal
import sys
import time

from t2t_jax import exit_codes
from t2t_jax import workdir_lock
from t2t_jax.tuning.search_space import SearchError

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))

_PRCTL = ctypes.CDLL(None).prctl  # Looked up here: the child after fork only calls it.
_PR_SET_PDEATHSIG = 1


def child_setup(cores) -> None:
  """In a trial's process: it gets SIGTERM (saves, exits) if the driver dies, even by kill -9,
  and runs on its worker's cores."""
  _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
  if cores:
    os.sched_setaffinity(0, cores)


def wait_for_lock_release(workdir: str) -> None:
  """Waits while an earlier run of the workdir still runs (a killed driver's trial saving its
  step): for as long as it runs on this host; for another host's, until its heartbeat is stale
  (the run then takes the lock over)."""
  deadline = time.monotonic() + workdir_lock.STALE_SECONDS + 30
  while (alive := workdir_lock.held(workdir)) is not False:
    if alive is None and time.monotonic() > deadline:
      return
    time.sleep(0.5)


def split_devices(workers: int) -> tuple[list[dict], list[list[int]]]:
  """Per worker: its environment (CUDA_VISIBLE_DEVICES where GPUs are listed) and CPU cores."""
  cores = sorted(os.sched_getaffinity(0))
  core_sets = [cores[i::workers] or [cores[i % len(cores)]] for i in range(workers)]
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  if visible and workers > 1:
    gpus = visible.split(',')
    if len(gpus) < workers:
      raise SearchError(f'--workers={workers} needs a GPU each; CUDA_VISIBLE_DEVICES lists '
                        f'{len(gpus)}')
    return [{'CUDA_VISIBLE_DEVICES': ','.join(gpus[i::workers])} for i in range(workers)], (
        core_sets)
  return [{} for _ in range(workers)], core_sets


def slurm_script(root: str, argv: list[str], elements: int, options: list[str]) -> str:
  lines = '\n'.join(f'#SBATCH {option}' for option in options)
  command = shlex.join([os.path.join(LAUNCH_DIR, 'slurm_step.sh'), sys.executable,
                        os.path.join(LAUNCH_DIR, 'search.py'), *argv])
  return f'''#!/bin/bash
#SBATCH --job-name=t2t_search
#SBATCH --array=0-{elements - 1}
#SBATCH --output={root}/slurm-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=TERM@300
{lines}
set -uo pipefail
cd {shlex.quote(os.getcwd())}
# Each element is one worker of the same study, run as a job step (srun), which --signal and
# scancel --signal reach (the batch shell they skip); slurm_step.sh requeues a preempted one
# (exit status {exit_codes.PREEMPTED}), which resumes.
{command}
'''


def worker_argv(argv: list[str]) -> list[str]:
  """This command's arguments for one array element: local, one worker."""
  dropped, kept, skip = ('--mode', '--array', '--sbatch', '--workers'), [], False
  for index, arg in enumerate(argv):
    if skip:
      skip = False
    elif '--' in argv and index >= argv.index('--'):
      kept.append(arg)  # The base command, untouched.
    elif arg.split('=')[0] in dropped:
      skip = '=' not in arg
    elif arg != '--dry_run':
      kept.append(arg)
  return ['--workers=1'] + kept
