"""Hyperparameter search with Optuna: trials of a training command, pruned from the runs' own
evaluations, on a study in a database that several workers (here, or a SLURM array) share.

  python launch/search.py configs/searches/tiny_lr.py -- \
      python -m t2t_jax.main --config=configs/tiny.py --workdir=/tmp/search
  python launch/search.py --workers=2 FILE -- <base command>     # 2 trials at once here
  python launch/search.py --storage=postgresql://me@dbhost/t2t FILE -- ...   # any SQLAlchemy URL
  python launch/search.py --storage=journal:/shared/s/search.journal FILE -- ...  # shared files
  python launch/search.py --mode=slurm --array=4 FILE -- ...     # 4 array elements, one study
  python launch/search.py --seeds=3 --seeds_for_best=2 FILE -- ...   # best 2 points, 3 seeds
  python launch/search.py --summarize /tmp/search --plot=/tmp/search/plots

The search file is t2t_jax/tuning/search_space.py's. Trial N trains the base command with the
trial's `--config.KEY=VALUE` in `<workdir>/trial_NNNN`; its in-loop evaluations report the
metric to the study (t2t_jax/tuning/trial_report.py), and a pruned trial saves and exits with status 4.
The study lives in `<workdir>/search.db` (SQLite) unless --storage names another. The same
command started again continues the study: finished trials are kept, trials whose worker is
gone (a flock on `<workdir>/locks/`) resume from their checkpoints, nothing is trained twice to
the end. With --seeds=S each completed trial (or the best --seeds_for_best) is trained again
with seeds config.seed + 1 .. S - 1 in `trial_NNNN_seedK`; the summary gives mean, standard
deviation and spread. No training logic lives here.
"""

import argparse
import dataclasses
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAUNCH_DIR))  # The checkout's t2t_jax, installed or not.
sys.path.insert(0, LAUNCH_DIR)
import search_launch  # pylint: disable=g-import-not-at-top,wrong-import-position
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import exit_codes  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import workdir_layout  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.tuning import search_space  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.tuning import search_summary  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.tuning import trial_report  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.tuning.search_space import SearchError  # pylint: disable=g-import-not-at-top,wrong-import-position

STOPPED = (exit_codes.PREEMPTED, exit_codes.INTERRUPTED)
RETRIES = 2  # A trial whose training was killed (not by this driver) is resumed this often.


@dataclasses.dataclass
class Job:
  """One training run: a trial (number, reported to the study) or a seed repeat of one."""
  number: int
  params: dict
  seed: int = 0  # 0: the trial itself; K: repeat K, seed config.seed + K.
  trial_id: int | None = None
  lock: object = None

  @property
  def name(self) -> str:
    return workdir_layout.trial_name(self.number, self.seed)


def _base_config(command: list[str]):
  """The config the base command asks for (its --config and --config.KEY flags)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=values, lock_config=False)
  wanted = [arg for arg in command if arg.startswith('--config')]
  if not any(arg.startswith('--config=') for arg in wanted):
    raise SearchError('the base command needs --config=FILE, the config the trials train')
  try:
    values(['search'] + wanted)
    return values.config
  except Exception as e:  # pylint: disable=broad-except  # The config file's own error.
    raise SearchError(f'the base command\'s config: {" ".join(str(e).split())}') from None


class StudyDriver:
  """The workers of one driver on one study."""

  def __init__(self, args, search: dict, command: list[str], root: str, config):
    import optuna  # pylint: disable=g-import-not-at-top
    self.optuna, self.args, self.search = optuna, args, search
    self.command, self.root = command, root
    self.base_seed = int(config.seed)
    self.num_steps = int(config.train.num_steps)
    self.storage_url = args.storage or f'sqlite:///{os.path.join(root, "search.db")}'
    storage = search_space.storage(self.storage_url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    self.study = optuna.create_study(
        study_name=args.study, storage=storage, sampler=search_space.sampler(search),
        direction=search['direction'], load_if_exists=True)
    self.lock = threading.Lock()
    self.children, self.stopping, self.failed = {}, False, 0
    os.makedirs(os.path.join(root, 'locks'), exist_ok=True)

  # Who does what: under a flock on <root>/search.lock, shared by every driver of the study.

  def _try_lock(self, name: str):
    handle = open(os.path.join(self.root, 'locks', name + '.lock'), 'a')
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.close()
      return None
    return handle

  def next_job(self) -> Job | str | None:
    """The next run for a worker: a job, 'wait' (others' trials decide what is left), or None."""
    with self.lock, open(os.path.join(self.root, 'search.lock'), 'a') as handle:
      fcntl.flock(handle, fcntl.LOCK_EX)
      if self.stopping:
        return None
      trials = self.study.get_trials(deepcopy=False)
      state = self.optuna.trial.TrialState
      for trial in trials:  # A running trial whose worker is gone: resumed.
        if trial.state == state.RUNNING and (lock := self._try_lock(
            workdir_layout.trial_name(trial.number))):
          return Job(trial.number, dict(trial.params), trial_id=trial._trial_id, lock=lock)
      if self._budget_left(trials):
        # Seeded by the search's seed and the trial's index, not once per process: every
        # process (SLURM array elements, a restarted driver) would draw the same points. The
        # grid sampler keeps the search's seed: its order over the grid is what keeps workers
        # off each other's points.
        if self.search['sampler'] != 'grid':
          seed = int(np.random.SeedSequence([self.search['seed'], len(trials)]
                                            ).generate_state(1)[0])
          self.study.sampler = search_space.sampler({**self.search, 'seed': seed})
        trial = self.study.ask()
        params = search_space.suggest(trial, self.search['params'])
        lock = self._try_lock(workdir_layout.trial_name(trial.number))
        return Job(trial.number, params, trial_id=trial._trial_id, lock=lock)
      running = any(t.state == state.RUNNING for t in trials)
      for trial in self._repeated(trials, running):
        for seed in range(1, self.args.seeds):
          job = Job(trial.number, dict(trial.params), seed=seed)
          if (not os.path.exists(os.path.join(self.root, job.name, workdir_layout.FINAL_JSON)) and
              (lock := self._try_lock(job.name))):
            job.lock = lock
            return job
      return 'wait' if running or self.children else None

  def _budget_left(self, trials) -> bool:
    if self.search['trials'] is not None and len(trials) >= self.search['trials']:
      return False
    started = [t.datetime_start for t in trials if t.datetime_start]
    if self.search['hours'] is not None and started:
      return (time.time() - min(started).timestamp()) < self.search['hours'] * 3600
    return True

  def _repeated(self, trials, running: bool) -> list:
    if self.args.seeds <= 1:
      return []
    done = [t for t in trials if t.state == self.optuna.trial.TrialState.COMPLETE]
    if not self.args.seeds_for_best:
      return done
    if running:  # The best k are known once every trial has ended.
      return []
    best = sorted(done, key=lambda t: t.value, reverse=self.search['direction'] == 'maximize')
    return best[:self.args.seeds_for_best]

  # Running a job.

  def run(self, job: Job, worker: int) -> None:
    workdir = os.path.join(self.root, job.name)
    overrides = [f'--config.{key}={value}' for key, value in job.params.items()]
    if job.seed:
      overrides.append(f'--config.seed={self.base_seed + job.seed}')
    command = self.command + overrides + [f'--workdir={workdir}']
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'search_trial.json'), 'w') as f:
      json.dump({'trial': job.number, 'seed': self.base_seed + job.seed, 'overrides': job.params,
                 'command': shlex.join(command)}, f, indent=1)
    for attempt in range(RETRIES + 1):
      finished = self._finished_before(job, workdir)
      code = finished if finished is not None else self._train(job, worker, command, workdir,
                                                               attempt)
      if self.stopping and code not in (0, exit_codes.PRUNED):
        self._event(job, 'stopped', code=code)
        return
      if code in (0, exit_codes.PRUNED) or (code not in STOPPED and code >= 0):
        break
      self._event(job, 'killed', code=code)  # By a signal not from this driver: resumed.
    self._end(job, workdir, code)

  def _finished_before(self, job: Job, workdir: str) -> int | None:
    """The exit status of a run that ended before a driver could record it, or None."""
    if os.path.exists(os.path.join(workdir, workdir_layout.FINAL_JSON)):
      return 0
    if not job.seed and os.path.exists(os.path.join(workdir, workdir_layout.PRUNED_JSON)):
      return exit_codes.PRUNED
    return None

  def _train(self, job: Job, worker: int, command: list[str], workdir: str, attempt: int) -> int:
    search_launch.wait_for_lock_release(workdir)  # A killed driver's run may still be saving.
    env = dict(os.environ, **self.args.worker_env[worker])
    if not job.seed:
      env[trial_report.ENV] = json.dumps({
          'storage': self.storage_url, 'study': self.args.study, 'trial_id': job.trial_id,
          'metric': self.search['metric'], 'pruner': self.search['pruner']})
    resumed = os.path.isdir(workdir_layout.checkpoints_dir(workdir))
    self._event(job, 'resume' if resumed or attempt else 'start', worker=worker)
    with open(os.path.join(workdir, 'train.log'), 'ab') as log:
      cores = self.args.worker_cores[worker]
      # Its own session: a Ctrl-C at the terminal reaches the driver, which stops it.
      child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True, preexec_fn=lambda: search_launch.child_setup(cores))
      self.children[job.name] = child
      if self.stopping:
        child.send_signal(signal.SIGTERM)
      code = child.wait()
      del self.children[job.name]
    return code

  def _end(self, job: Job, workdir: str, code: int) -> None:
    state = self.optuna.trial.TrialState
    with self.lock:
      why = None
      if code == 0:
        final = workdir_layout.read_final(workdir) or {}
        value = final.get(self.search['metric'])
        if value is None:
          code, why = exit_codes.ERROR, f"its final.json has no {self.search['metric']!r}"
      if code == 0:
        if not job.seed:
          self._tell(job.number, float(value))
        self._event(job, 'complete', value=value, step=final.get('step'))
      elif code == exit_codes.PRUNED:
        self._tell(job.number, state=state.PRUNED)
        with open(os.path.join(workdir, workdir_layout.PRUNED_JSON)) as f:
          self._event(job, 'pruned', **json.load(f))
      else:
        self.failed += 1
        why = why or _error_line(workdir)
        if not job.seed:
          self._tell(job.number, state=state.FAIL)
        self._event(job, 'failed', code=code, why=why)
    if job.lock:
      job.lock.close()

  def _tell(self, number: int, value: float | None = None, state=None) -> None:
    try:
      self.study.tell(number, value, state=state)
    except RuntimeError as e:
      # The grid sampler calls Study.stop once the grid is used up, which Optuna refuses
      # outside Study.optimize, after the trial is recorded; the budget stops this search.
      if 'Study.stop' not in str(e):
        raise

  def _event(self, job: Job, event: str, **fields) -> None:
    record = {'time': round(time.time(), 3), 'run': job.name, 'trial': job.number,
              'seed': self.base_seed + job.seed, 'event': event, 'pid': os.getpid(), **fields}
    with open(os.path.join(self.root, 'search_events.jsonl'), 'a') as f:
      f.write(json.dumps(record, default=str) + '\n')
    detail = ', '.join(f'{k}={v}' for k, v in fields.items() if k not in ('worker',))
    print(f'=== {job.name} {event}' + (f' ({detail})' if detail else '') +
          (f': {search_summary.overrides_text(job.params)}' if event == 'start' else ''),
          flush=True)

  def work(self, worker: int) -> None:
    while True:
      job = self.next_job()
      if job is None:
        return
      if job == 'wait':
        time.sleep(1.0)
        continue
      self.run(job, worker)

  def stop(self, signum, frame) -> None:
    del frame
    self.stopping = True
    for child in list(self.children.values()):
      child.send_signal(signal.SIGTERM)  # Each saves its step and exits 143; resumed later.
    print(f'=== {signal.Signals(signum).name}: stopping the trials after they save', flush=True)


def _error_line(workdir: str) -> str:
  try:
    with open(os.path.join(workdir, 'train.log'), errors='replace') as f:
      lines = [line.strip() for line in f if line.startswith('error:')]
  except OSError:
    lines = []
  return lines[-1] if lines else f'see {os.path.join(workdir, "train.log")}'


def _check_recorded(root: str, record: dict) -> None:
  """The study's identity in <root>/search.json: a restart must be the same search."""
  path = os.path.join(root, 'search.json')
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    for key in ('search', 'command', 'study', 'storage'):
      if saved.get(key) != record[key]:
        raise SearchError(f'{root} holds a search with another {key} ({saved.get(key)!r}, not '
                          f'{record[key]!r}): start again with the same command, or choose a '
                          'new --workdir')
    return
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f, indent=1)
  os.replace(path + '.tmp', path)


def main():
  # No abbreviations: _worker_argv would forward a '--mod=slurm' and each element submit more.
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], allow_abbrev=False)
  parser.add_argument('--mode', choices=('local', 'slurm'), default='local')
  parser.add_argument('--workers', type=int, default=1, help='Trials at once here, the devices '
                      '(GPUs) or CPU cores split between them.')
  parser.add_argument('--array', type=int, default=2, help='--mode=slurm: array elements.')
  parser.add_argument('--sbatch', action='append', default=[], help='Extra #SBATCH option.')
  parser.add_argument('--dry_run', action='store_true', help='--mode=slurm: print the script.')
  parser.add_argument('--storage', default='', help='SQLAlchemy URL, or journal:PATH; '
                      'default sqlite:///<workdir>/search.db.')
  parser.add_argument('--study', default='search', help='The study name in the storage.')
  parser.add_argument('--seeds', type=int, default=1, help='Seeds per chosen point.')
  parser.add_argument('--seeds_for_best', type=int, default=0, help='With --seeds: only the '
                      'best K completed trials get the other seeds (0: every one).')
  parser.add_argument('--summarize', metavar='DIR', help='Print the trials, best first.')
  parser.add_argument('--plot', metavar='DIR', help='With --summarize: write PNGs here.')
  parser.add_argument('--markdown', action='store_true', help='With --summarize: markdown.')
  parser.add_argument('--top', type=int, default=5, help='With --summarize: the commands of '
                      'this many best trials.')
  parser.add_argument('rest', nargs=argparse.REMAINDER, help='SEARCH_FILE -- base command')
  argv = sys.argv[1:]
  args = parser.parse_args()
  try:
    if args.summarize:
      print(search_summary.summarize(args.summarize, args.plot, args.markdown, args.top))
      return
    if (args.plot or args.markdown):
      raise SearchError('--plot and --markdown go with --summarize DIR')
    if '--' not in args.rest or args.rest.index('--') != 1:
      parser.error('give the search file, then -- and the base command')
    if args.workers < 1 or args.seeds < 1 or args.seeds_for_best < 0 or args.array < 1:
      raise SearchError('--workers, --seeds and --array must be at least 1, '
                        '--seeds_for_best at least 0')
    search_file, base = args.rest[0], args.rest[2:]
    search = search_space.load(search_file)
    try:
      command, root = sweep._split_workdir(base)  # pylint: disable=protected-access
    except sweep.SweepError as e:
      raise SearchError(str(e)) from None
    root = os.path.abspath(root)
    config = _base_config(command)
    search_space.check_against_config(search, config, search_file)
    if args.mode == 'slurm' and args.dry_run:  # The script only: nothing is written.
      print(search_launch.slurm_script(root, search_launch.worker_argv(argv), args.array, args.sbatch))
      return
    os.makedirs(root, exist_ok=True)
    args.worker_env, args.worker_cores = search_launch.split_devices(args.workers)
    driver = StudyDriver(args, search, command, root, config)
    _check_recorded(root, {'search': search, 'command': command, 'study': args.study,
                           'storage': driver.storage_url, 'seeds': args.seeds,
                           'seeds_for_best': args.seeds_for_best})
    if args.mode == 'slurm':
      script = search_launch.slurm_script(root, search_launch.worker_argv(argv), args.array, args.sbatch)
      path = os.path.join(root, 'search.sbatch')
      with open(path, 'w') as f:
        f.write(script)
      sys.exit(subprocess.call(['sbatch', path]))
  except SearchError as e:
    sys.exit(f'error: {e}')
  signal.signal(signal.SIGTERM, driver.stop)
  signal.signal(signal.SIGINT, driver.stop)
  threads = [threading.Thread(target=driver.work, args=(i,), daemon=True)
             for i in range(args.workers)]
  for thread in threads:
    thread.start()
  while any(thread.is_alive() for thread in threads):
    for thread in threads:
      thread.join(0.5)
  if driver.stopping:
    sys.exit(exit_codes.PREEMPTED)
  print(search_summary.summarize(root))
  sys.exit(1 if driver.failed else 0)


if __name__ == '__main__':
  main()
