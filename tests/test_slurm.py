"""launch/ on a real one-node SLURM (tests/slurm_cluster.py): a 2-task job of launch/slurm.sbatch
trains like one process, a job preempted with SIGTERM requeues itself and ends bitwise equal to
an uninterrupted one, or, requeued onto 1 task, within the bound of a run moved between shapes,
a sweep runs as one array whose failed element is reported, and a search's array elements
train the trials of one study between them."""

import dataclasses
import json
import os
import re
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT, assert_moved_run_agrees, scalar_events
import slurm_cluster
from t2t_jax import workdir_lock
from t2t_jax.training import train

STEPS = 30
OVERRIDES = {'train.num_steps': STEPS, 'train.log_every': 1, 'train.eval_every': STEPS,
             'ckpt.every': 10, 'eval.bleu_sentences': 0, 'ckpt.preemption_grace_seconds': 20}
# Every step saved and kept, for assert_moved_run_agrees: by the uninterrupted job (it reads
# steps 1..STEPS there) and by the one requeued onto 1 task.
EVERY_STEP = {**OVERRIDES, 'ckpt.every': 1, 'ckpt.keep': STEPS}
# launch/slurm.sbatch asks for 2 nodes x 8 GPUs; here: 2 tasks on the one CPU node.
TWO_TASKS = ['--nodes=1', '--ntasks=2', '--ntasks-per-node=2', '--cpus-per-task=1',
             '--gpus-per-task=0', '--time=10']
JOB_TIMEOUT = 900  # A bound for a hung job, 3 times what a slow day takes, not a speed target.


@pytest.fixture(scope='session')
def slurm(tmp_path_factory):
  lacking = slurm_cluster.missing()
  if lacking:
    reason = (f'SLURM is not installed (no {", ".join(lacking)} on PATH): apt-get install '
              'slurm-wlm')
    if os.environ.get('CI'):  # .ci/run installs it: CI must not skip these silently.
      pytest.fail(reason)
    pytest.skip(reason)
  cluster = slurm_cluster.SlurmCluster(str(tmp_path_factory.mktemp('slurm')))
  cluster.start()
  yield cluster
  cluster.stop()


def _job_env(cluster):
  # Jobs inherit the submitter's environment: the worktree's t2t_jax, one CPU device each.
  return cluster.env(PYTHONPATH=ROOT, XLA_FLAGS='', JAX_PLATFORMS='cpu')


def _submit(cluster, *args) -> str:
  run = cluster.run('sbatch', '--parsable', *args, cwd=ROOT, env=_job_env(cluster),
                    check=False)
  assert run.returncode == 0, run.stderr
  return run.stdout.strip().split(';')[0]


def _sbatch_two_tasks(cluster, workdir, overrides=OVERRIDES) -> tuple[str, str]:
  """Submits launch/slurm.sbatch with 2 tasks training the tiny config; (job id, log path)."""
  log = os.path.join(os.path.dirname(workdir), f'{os.path.basename(workdir)}-%j.out')
  job = _submit(cluster, *TWO_TASKS, f'--output={log}', 'launch/slurm.sbatch',
                '--config=configs/tiny.py', f'--workdir={workdir}',
                *[f'--config.{key}={value}' for key, value in overrides.items()])
  return job, log.replace('%j', job)


def _read(path) -> str:
  with open(path, errors='replace') as f:
    return f.read()


def _params(workdir, step):
  """The params of a checkpoint, read with plain orbax as numpy arrays (independent reader)."""
  item = os.path.join(workdir, 'checkpoints', str(step), 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  saved = checkpointer.metadata(item).item_metadata.tree['params']
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
  restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
      item={'params': saved}, restore_args={'params': args}, partial_restore=True))
  return restored['params']


def _train_losses(workdir):
  losses = scalar_events(workdir)['train/loss']
  return [losses[step] for step in sorted(losses)]


def _wait_for(predicate, what, timeout=JOB_TIMEOUT):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if value := predicate():
      return value
    time.sleep(0.2)
  raise TimeoutError(f'no {what} after {timeout} s')


@pytest.fixture(scope='module')
def two_task_run(slurm, tmp_path_factory):
  """An uninterrupted 2-task job of launch/slurm.sbatch saving every step: its workdir, log
  and final job fields."""
  workdir = str(tmp_path_factory.mktemp('straight') / 'run')
  job, log = _sbatch_two_tasks(slurm, workdir, EVERY_STEP)
  fields = slurm.wait_done(job, JOB_TIMEOUT)
  return workdir, _read(log), fields


def test_a_lock_from_an_earlier_run_of_the_same_slurm_job_is_taken_over(tmp_path, monkeypatch):
  # The requeued job may start on another node while the lost node's heartbeat looks fresh.
  lost = workdir_lock.Holder('lost-node', 4242, None, '2024-01-01 00:00:00', '77', 0)
  lock_path = tmp_path / workdir_lock.LOCK_FILE
  for job, restart, taken in (('77', '1', True), ('77', '0', False), ('78', '1', False)):
    lock_path.write_text(json.dumps(dataclasses.asdict(lost)))
    monkeypatch.setenv('SLURM_JOB_ID', job)
    monkeypatch.setenv('SLURM_RESTART_COUNT', restart)
    if taken:
      with workdir_lock.WorkdirLock(str(tmp_path)):
        assert json.loads(lock_path.read_text())['slurm_restart'] == 1
      assert not lock_path.exists()
    else:  # The same allocation, or another job: a live run elsewhere, as before.
      with pytest.raises(workdir_lock.WorkdirLocked, match='in use by PID 4242 on host lost-node'):
        workdir_lock.WorkdirLock(str(tmp_path)).acquire()


@pytest.mark.slow
def test_two_task_sbatch_job_trains_like_one_process(two_task_run, tiny_config, tmp_path):
  workdir, log, fields = two_task_run
  assert (fields['JobState'], fields['ExitCode'], fields['NumTasks']) == ('COMPLETED', '0:0',
                                                                          '2'), log[-3000:]
  # jax.distributed found the topology in SLURM's environment, not in T2T_* variables.
  for process in (0, 1):
    assert (f'Process {process} of 2 joined the coordinator detected from the SLURM/TPU '
            'environment; 1 local / 2 global devices') in log
  final = json.loads(_read(os.path.join(workdir, 'final.json')))
  assert final['step'] == STEPS
  assert sorted(map(int, os.listdir(os.path.join(workdir, 'checkpoints')))) == list(
      range(1, STEPS + 1))
  assert not os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))

  for key, value in EVERY_STEP.items():  # The same config in this process, on 8 CPU devices.
    section, name = key.split('.')
    tiny_config[section][name] = value
  one = train.train_and_evaluate(tiny_config, str(tmp_path / 'one'))
  np.testing.assert_allclose(_train_losses(workdir), _train_losses(tmp_path / 'one'), rtol=1e-5)
  np.testing.assert_allclose(final['eval_loss'], one['eval_loss'], rtol=1e-5)
  # Sums in another order only: the parameters within the bound that derives from that.
  assert_moved_run_agrees(workdir, str(tmp_path / 'one'), STEPS, tiny_config)


@pytest.mark.slow
def test_sigterm_requeues_the_job_which_resumes_to_the_uninterrupted_result(
    slurm, two_task_run, tmp_path):
  workdir = str(tmp_path / 'run')
  job, log = _sbatch_two_tasks(slurm, workdir)
  _wait_for(lambda: os.path.exists(log) and 'step 2:' in _read(log), 'step 2 in the log')
  # What --signal=TERM@300 does before the time limit: SIGTERM to every task, not the script.
  slurm.run('scancel', '--signal=TERM', job)
  _wait_for(lambda: slurm.job_state(job)['Restarts'] == '1' and
            slurm.job_state(job)['JobState'] == 'PENDING', 'requeued job')
  # As if the old allocation's node died holding the lock, its heartbeat still fresh: the
  # requeued job (SLURM ends an allocation before requeueing it) must take the lock over.
  lost = workdir_lock.Holder('lost-node', 4242, None, 'then', job, 0)
  with open(os.path.join(workdir, workdir_lock.LOCK_FILE), 'w') as f:
    json.dump(dataclasses.asdict(lost), f)
  fields = slurm.wait_done(job, JOB_TIMEOUT)
  text = _read(log)  # --open-mode=append: both allocations' output.
  assert (fields['JobState'], fields['ExitCode'], fields['Restarts']) == ('COMPLETED', '0:0',
                                                                          '1'), text[-3000:]
  saved = [int(step) for step in re.findall(r'preempted \(SIGTERM\): saved a checkpoint at '
                                            r'step (\d+)', text)]
  assert len(saved) == 2 and saved[0] == saved[1] and 2 <= saved[0] < STEPS, text[-3000:]
  assert f'slurm_step.sh: preempted (exit status 143): requeueing job {job}' in text
  assert f'slurm_step.sh: job {job}, restart 1, 2 task(s)' in text
  assert f'Restored checkpoint {workdir}/checkpoints/{saved[0]}' in text
  assert (f'from PID 4242 on host lost-node: it is from run 0 of SLURM job {job}, which SLURM '
          'ended before requeueing the job') in text
  assert json.loads(_read(os.path.join(workdir, 'final.json')))['step'] == STEPS
  assert not os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))
  straight = _params(two_task_run[0], STEPS)
  resumed = _params(workdir, STEPS)
  assert jax.tree.structure(straight) == jax.tree.structure(resumed)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(straight),
                                                  jax.tree.leaves(resumed)))


@pytest.mark.slow
def test_a_job_requeued_onto_one_task_resumes_in_one_process_to_the_uninterrupted_result(
    slurm, two_task_run, tiny_config, tmp_path):
  """A preempted 2-task job is given 1 task while it waits for its restart (as a user would,
  to have it scheduled sooner); it goes on in one process of one device."""
  workdir = str(tmp_path / 'run')
  job, log = _sbatch_two_tasks(slurm, workdir, EVERY_STEP)
  _wait_for(lambda: os.path.exists(log) and 'step 2:' in _read(log), 'step 2 in the log')
  slurm.run('scancel', '--signal=TERM', job)
  _wait_for(lambda: slurm.job_state(job)['Restarts'] == '1' and
            slurm.job_state(job)['JobState'] == 'PENDING', 'requeued job')
  # Held while it changes, or it could start on 2 tasks (its BeginTime is 6 s after the
  # requeue). NumTasks alone would be recomputed from the 2 tasks per node when it starts.
  for command in (['hold', job], ['update', f'JobId={job}', 'NumTasks=1', 'TasksPerNode=1'],
                  ['release', job]):
    slurm.run('scontrol', *command)
  fields = slurm.wait_done(job, JOB_TIMEOUT)
  text = _read(log)
  assert (fields['JobState'], fields['ExitCode'], fields['Restarts'],
          fields['NumTasks']) == ('COMPLETED', '0:0', '1', '1'), text[-3000:]
  saved = [int(step) for step in re.findall(r'preempted \(SIGTERM\): saved a checkpoint at '
                                            r'step (\d+)', text)]
  assert len(saved) == 2 and saved[0] == saved[1] and 2 <= saved[0] < STEPS, text[-3000:]
  restart = text.index(f'slurm_step.sh: job {job}, restart 1, 1 task(s)')
  mesh = lambda devices: f'mesh data={devices} fsdp=1 tensor=1 expert=1, 1 micro-batch'
  assert text.count(
      f'Resuming {workdir}/checkpoints/{saved[0]} on another shape: 2 cpu devices in 2 '
      f'processes, {mesh(2)} -> 1 cpu device in 1 process, {mesh(1)}. The same global batches '
      '(rows in multiples of 2) and dropout masks follow') == 1, text[restart:][-3000:]
  assert 'joined the coordinator' not in text[restart:]  # One process: nothing to join.
  assert json.loads(_read(os.path.join(workdir, 'final.json')))['step'] == STEPS

  straight = two_task_run[0]
  losses, expected = (scalar_events(w)['train/loss'] for w in (workdir, straight))
  assert sorted(losses) == sorted(expected) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([losses[step] for step in sorted(losses)],
                             [expected[step] for step in sorted(expected)], rtol=1e-5)
  for key, value in EVERY_STEP.items():
    section, name = key.split('.')
    tiny_config[section][name] = value
  assert_moved_run_agrees(workdir, straight, STEPS, tiny_config)


@pytest.mark.slow
def test_a_sweep_is_one_job_array_and_its_failed_element_is_reported(slurm, tmp_path):
  sweep_file = tmp_path / 'two.py'
  # The second point's warmup is out of range: its run stops with a config error.
  sweep_file.write_text("def get_sweep():\n  return {'zip': {'opt.warmup_steps': [10, -1]}}\n")
  root = tmp_path / 'sweep'
  submit = slurm.run(sys.executable, 'launch/sweep.py', '--mode=slurm', str(sweep_file), '--',
                     sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
                     f'--workdir={root}', '--config.train.num_steps=3',
                     '--config.train.eval_every=3', '--config.ckpt.every=0',
                     '--config.eval.bleu_sentences=0', cwd=ROOT, env=_job_env(slurm),
                     check=False)
  assert submit.returncode == 0, submit.stderr
  job = re.fullmatch(r'Submitted batch job (\d+)\n', submit.stdout).group(1)
  slurm.wait_done(job, JOB_TIMEOUT)
  states = {index: slurm.job_state(f'{job}_{index}') for index in (0, 1)}
  assert [states[i]['JobState'] for i in (0, 1)] == ['COMPLETED', 'FAILED']
  assert states[0]['ArrayJobId'] == states[1]['ArrayJobId'] == job

  ok, failed = root / 'warmup_steps=10', root / 'warmup_steps=-1'
  assert json.loads(_read(ok / 'final.json'))['step'] == 3
  assert not os.path.exists(ok / 'sweep_status.json')
  status = json.loads(_read(failed / 'sweep_status.json'))
  assert status['job'] == f'{job}_1' and status['exit_status'] != 0
  assert 'config.opt.warmup_steps=-1 is outside the allowed range' in _read(
      root / f'slurm-{job}_1.out')
  table = slurm.run(sys.executable, 'launch/sweep.py', '--summarize', str(root),
                    cwd=ROOT).stdout.splitlines()
  assert table[0].split()[:3] == ['run', 'warmup_steps', 'step']
  rows = {line.split()[0]: line for line in table[1:]}
  assert set(rows) == {'warmup_steps=10', 'warmup_steps=-1'}
  assert rows['warmup_steps=10'].split()[1:3] == ['10', '3']
  assert (f'(failed: exit status {status["exit_status"]}, SLURM job {job}_1; see '
          f'slurm-{job}_1.out)') in rows['warmup_steps=-1']


SEARCH_FILE = '''def get_search():
  return {'params': {'opt.lr_scale': ('log_uniform', 0.1, 4.0),
                     'opt.warmup_steps': ('int', 1, 10)},
          'metric': 'eval_loss', 'trials': 4, 'sampler': 'random', 'pruner': 'none'}
'''


@pytest.mark.slow
def test_a_search_array_trains_one_study_whose_trials_both_elements_take(slurm, tmp_path):
  """launch/search.py --mode=slurm: two array elements (one CPU each, at once on the 2-CPU
  node) pull trials from one SQLite study; each trial is trained once, by one of them."""
  import optuna  # pylint: disable=g-import-not-at-top
  search_file = tmp_path / 'lr.py'
  search_file.write_text(SEARCH_FILE)
  root = tmp_path / 'search'
  submit = slurm.run(sys.executable, 'launch/search.py', '--mode=slurm', '--array=2',
                     str(search_file), '--', sys.executable, '-m', 't2t_jax.main',
                     '--config=configs/tiny.py', f'--workdir={root}',
                     '--config.train.num_steps=10', '--config.train.eval_every=5',
                     '--config.ckpt.every=5', '--config.eval.bleu_sentences=0', cwd=ROOT,
                     env=_job_env(slurm), check=False)
  assert submit.returncode == 0, submit.stderr
  job = re.search(r'^Submitted batch job (\d+)$', submit.stdout, re.M).group(1)
  script = _read(root / 'search.sbatch')
  assert '#SBATCH --array=0-1' in script and ' --workers=1 ' in script
  # A job step, which --signal=TERM@300 and scancel --signal reach, requeued when preempted.
  assert f'launch/slurm_step.sh {sys.executable} ' in script
  assert '--mode' not in script and '--array=2' not in script
  slurm.wait_done(job, JOB_TIMEOUT)
  states = {index: slurm.job_state(f'{job}_{index}') for index in (0, 1)}
  logs = {index: _read(root / f'slurm-{job}_{index}.out') for index in (0, 1)}
  for index in (0, 1):
    assert (states[index]['JobState'], states[index]['ExitCode'],
            states[index]['ArrayJobId']) == ('COMPLETED', '0:0', job), logs[index][-3000:]

  study = optuna.load_study(study_name='search', storage=f'sqlite:///{root}/search.db')
  trials = sorted(study.get_trials(), key=lambda t: t.number)
  assert [t.number for t in trials] == [0, 1, 2, 3]
  assert [t.state.name for t in trials] == ['COMPLETE'] * 4
  for trial in trials:
    run = root / f'trial_{trial.number:04d}'
    final = json.loads(_read(run / 'final.json').strip().splitlines()[-1])
    assert final['step'] == 10 and trial.value == final['eval_loss']
    assert sorted(trial.intermediate_values) == [5, 10]  # Each in-loop evaluation, reported.
    assert json.loads(_read(run / 'search_trial.json'))['overrides'] == trial.params
    assert 0.1 <= trial.params['opt.lr_scale'] <= 4.0
    assert 1 <= trial.params['opt.warmup_steps'] <= 10
  # Two samplers of one seed must not draw the same points for the two elements' trials.
  assert len({t.params['opt.lr_scale'] for t in trials}) == 4, [t.params for t in trials]

  events = [json.loads(line) for line in _read(root / 'search_events.jsonl').splitlines()]
  runs = {f'trial_{n:04d}' for n in range(4)}
  assert {e['run'] for e in events} == runs
  for run in runs:  # Trained once, to the end, by one element: no trial twice.
    mine = [e for e in events if e['run'] == run]
    assert [e['event'] for e in mine] == ['start', 'complete'], mine
    assert mine[0]['pid'] == mine[1]['pid']
  by_pid = {}
  for e in events:
    if e['event'] == 'complete':
      by_pid.setdefault(e['pid'], set()).add(e['run'])
  assert len(by_pid) == 2, by_pid  # Both elements trained trials...
  in_logs = [set(re.findall(r'^=== (trial_\d{4}) complete', logs[i], re.M)) for i in (0, 1)]
  assert sorted(map(sorted, by_pid.values())) == sorted(map(sorted, in_logs))
  assert in_logs[0] and in_logs[1] and in_logs[0] | in_logs[1] == runs
  # ... at the same time: each element started a trial before the other's last one ended.
  spans = [(min(e['time'] for e in events if e['pid'] == pid and e['event'] == 'start'),
            max(e['time'] for e in events if e['pid'] == pid and e['event'] == 'complete'))
           for pid in by_pid]
  assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans

  table = slurm.run(sys.executable, 'launch/search.py', '--summarize', str(root), cwd=ROOT,
                    env=_job_env(slurm)).stdout.splitlines()
  assert table[0].split() == ['trial', 'state', 'eval_loss', 'step', 'opt.lr_scale',
                              'opt.warmup_steps']
  rows = {int(line.split()[0]): line.split() for line in table[1:5]}
  assert sorted(rows) == [0, 1, 2, 3]
  assert all(row[1:2] + row[3:4] == ['complete', '10'] for row in rows.values()), table
  best = min(trials, key=lambda t: t.value)
  assert int(table[1].split()[0]) == best.number  # Best first, its command to reproduce it.
  assert any(line.startswith(f'  trial {best.number}: ') and
             line.endswith(f'--workdir={root}/trial_{best.number:04d}') for line in table), table


def test_the_translation_array_of_the_back_translation_guide_writes_one_processs_output(
    slurm, tiny_run, tmp_path):
  """docs/backtranslation.md's SLURM array: two elements share a file's chunks; the last to
  finish writes the output, equal to one process translating it all (sampled, so every line's
  draws must not depend on the element that made them)."""
  from t2t_jax.decoding import sampling  # pylint: disable=g-import-not-at-top
  from t2t_jax.deploy import file_translation  # pylint: disable=g-import-not-at-top
  from t2t_jax.deploy import trained_run  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  source = tmp_path / 'mono.txt'
  source.write_text(''.join(' '.join(map(str, rng.integers(2, 8, rng.integers(1, 9)))) + '\n'
                            for _ in range(1500)))
  output = tmp_path / 'out.txt'
  script = tmp_path / 'translate.sbatch'
  script.write_text(
      '#!/bin/bash\n#SBATCH --array=0-1\n#SBATCH --cpus-per-task=1\n#SBATCH --time=10\n'
      f'{sys.executable} -m t2t_jax.translate --workdir={tiny_run[0]} --input={source} '
      f'--output={output} --sampling=sample --seed=1 --chunk_lines=200 '
      '--process_index=$SLURM_ARRAY_TASK_ID --process_count=2\n')
  job = _submit(slurm, f'--output={tmp_path}/slurm-%A_%a.out', str(script))
  slurm.wait_done(job, JOB_TIMEOUT)
  logs = [_read(tmp_path / f'slurm-{job}_{index}.out') for index in (0, 1)]
  assert [slurm.job_state(f'{job}_{index}')['JobState'] for index in (0, 1)] == [
      'COMPLETED', 'COMPLETED'], logs
  assert sum(f'wrote {output}' in log for log in logs) == 1  # The last to finish.
  assert all('this process translated 800 of them' in log or
             'this process translated 700 of them' in log for log in logs)
  run = trained_run.load(tiny_run[0], sampling=sampling.Sampling(seed=1))
  alone = file_translation.Plan(str(source), str(tmp_path / 'alone.txt'), chunk_lines=1500)
  file_translation.translate_file(
      alone, lambda lines, first: trained_run.translate_lines(run, lines, first_line=first)[0],
      progress=False)
  assert output.read_bytes() == (tmp_path / 'alone.txt').read_bytes()
