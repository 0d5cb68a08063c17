"""Hyperparameter search (launch/search.py, t2t_jax/tuning/search_space.py, search_summary.py,
trial_report.py) on the tiny config with real Optuna and a real SQLite database: pruning that
stops trials early with a checkpoint, two workers on one study, a driver killed with SIGKILL
and started again, seeds as repeats, and every bad input refused in one line before any trial.
(The SLURM array sharing one study is in test_slurm.py, beside the local cluster.)"""

import json
import os
import runpy
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest

from conftest import ROOT, assert_drawn, scalar_events
from t2t_jax.tuning import search_space
from t2t_jax.tuning import trial_report
from t2t_jax.tuning import search_summary
from t2t_jax.tuning.search_space import SearchError

SEARCH = os.path.join(ROOT, 'configs', 'searches', 'tiny_lr.py')


def _base(root, steps=40, **overrides) -> list[str]:
  """The tiny config, evaluated (eval loss, no BLEU) and saved every 5 steps."""
  settings = {'train.num_steps': steps, 'train.eval_every': 5, 'ckpt.every': 5,
              'eval.bleu_sentences': 0, **overrides}
  return [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
          *[f'--config.{k}={v}' for k, v in settings.items()], f'--workdir={root}']


def _env():
  return dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS='', JAX_PLATFORMS='cpu')


def _search(*args, timeout=900):
  return subprocess.run([sys.executable, 'launch/search.py', *map(str, args)], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=timeout)


def _write_search(path, **entries) -> str:
  search = {'params': {'opt.lr_scale': ('log_uniform', 0.05, 8.0),
                       'opt.warmup_steps': ('int', 5, 40)},
            'metric': 'eval_loss', 'trials': 4, 'sampler': 'random', 'pruner': 'none',
            **entries}
  path.write_text(f'def get_search():\n  return {search!r}\n')
  return str(path)


def _study(root):
  return optuna.load_study(study_name='search', storage=f'sqlite:///{root}/search.db')


def _events(root) -> list[dict]:
  with open(os.path.join(root, 'search_events.jsonl')) as f:
    return [json.loads(line) for line in f]


# The search file and what is checked before any trial.


@pytest.mark.parametrize('entries, message', [
    (dict(params={'opt.lr_scale': ('uniform', 1.0, 1.0)}),
     "opt.lr_scale: the range [1.0, 1.0] is empty: low must be below high"),
    (dict(params={'model.positions': ('choice', [])}),
     'model.positions: the choice is empty: give at least one value'),
    (dict(params={'opt.lr_scale': ('log_uniform', 0.0, 1.0)}),
     'opt.lr_scale: a log range needs low > 0, got 0.0'),
    (dict(params={'opt.lr_scale': ('normal', 0.0, 1.0)}), 'a range is (kind, ...) with kind'),
    (dict(sampler='grid'), "the grid sampler needs 'choice' or 'int' ranges; ['opt.lr_scale']"),
    (dict(pruner='hyperband'), "pruner 'hyperband' must be one of"),
    (dict(trials=None), "give a budget: 'trials' (a count) and/or 'hours'"),
    (dict(metric=None), "'metric' must name what the evaluations report"),
    (dict(budget=3), "unknown entries ['budget']"),
])
def test_a_bad_search_file_is_one_line_naming_the_entry(tmp_path, entries, message):
  path = _write_search(tmp_path / 'search.py', **entries)
  with pytest.raises(SearchError) as raised:
    search_space.load(path)
  assert message in str(raised.value) and '\n' not in str(raised.value)
  assert str(raised.value).startswith(path)


def test_a_search_file_that_does_not_import_is_named_with_its_line(tmp_path):
  path = tmp_path / 'search.py'
  path.write_text("def get_search():\n  return {'params': {'seed': seeds}}\n")
  with pytest.raises(SearchError, match=r"search.py:2: NameError: name 'seeds' is not defined"):
    search_space.load(str(path))


def test_keys_and_metric_are_checked_against_the_base_config(tiny_config):
  search = search_space.check({'params': {'opt.lr_scal': ('uniform', 1.0, 2.0)},
                               'metric': 'eval_loss', 'trials': 2})
  with pytest.raises(SearchError, match=r"no such config key 'opt.lr_scal' .*did you mean "
                                        r"'lr_scale'\?"):
    search_space.check_against_config(search, tiny_config, 'f.py')
  tiny_config.eval.bleu_sentences = 0
  search = search_space.check({'params': {'opt.lr_scale': ('uniform', 1.0, 2.0)},
                               'metric': 'bleu', 'trials': 2})
  with pytest.raises(SearchError, match=r"metric 'bleu' is never reported by these runs' "
                                        r"evaluations, which report \['eval_accuracy', "
                                        r"'eval_loss', 'eval_perplexity'\]"):
    search_space.check_against_config(search, tiny_config, 'f.py')
  tiny_config.eval.bleu_sentences, tiny_config.opt.ema_decay = 16, 0.99
  assert {'bleu', 'ema_bleu', 'ema_eval_loss'} <= search_space.reported_metrics(tiny_config)
  assert search['direction'] == 'maximize'  # BLEU up; eval_loss would be down.


def test_a_classifier_search_may_maximise_its_f1_and_matthews_correlation():
  from test_configs import _load  # pylint: disable=g-import-not-at-top
  config = _load('bert', 'small,finetune')
  reported = search_space.reported_metrics(config)
  assert {'eval_macro_f1', 'eval_mcc', 'eval_accuracy'} <= reported
  assert 'bleu' not in reported and 'eval_pearson' not in reported
  for metric in ('eval_macro_f1', 'eval_mcc'):
    search = search_space.check({'params': {'opt.lr_scale': ('uniform', 1.0, 2.0)},
                                 'metric': metric, 'trials': 2})
    search_space.check_against_config(search, config, 'f.py')
    assert search['direction'] == 'maximize'
  config.model.head = 'regression'
  assert {'eval_pearson', 'eval_spearman'} <= search_space.reported_metrics(config)


@pytest.mark.parametrize('url, message', [
    ('sqlite:////no/such/directory/search.db', 'cannot open the database (OperationalError'),
    ('postgresql://me:secret@127.0.0.1:9/t2t', 'postgresql://me:***@127.0.0.1:9/t2t: cannot '
     'open the database'),
    ('journal:/no/such/directory/search.journal', 'the directory of /no/such/directory'),
])
def test_a_storage_that_cannot_be_opened_is_one_line(url, message):
  with pytest.raises(SearchError) as raised:
    search_space.storage(url)
  assert message in str(raised.value) and 'secret' not in str(raised.value)


def test_suggestions_stay_in_their_ranges():
  search = search_space.check({'params': {
      'opt.warmup_steps': ('int', 10, 40, 10),
      'model.positions': ('choice', ['sinusoid', 'rotary'])}, 'metric': 'eval_loss',
      'sampler': 'grid'})
  assert search['trials'] == 8  # The grid's size: 4 warmups x 2 kinds of positions.
  study = optuna.create_study(sampler=search_space.sampler(search))
  seen = {tuple(search_space.suggest(study.ask(), search['params']).values())
          for _ in range(8)}
  assert seen == {(w, p) for w in (10, 20, 30, 40) for p in ('sinusoid', 'rotary')}
  search = search_space.check({'params': {'opt.lr_scale': ('log_uniform', 0.1, 10.0),
                                          'opt.warmup_steps': ('log_int', 1, 1000)},
                               'metric': 'eval_loss', 'trials': 200, 'sampler': 'random'})
  study = optuna.create_study(sampler=search_space.sampler(search))
  values = [search_space.suggest(study.ask(), search['params']) for _ in range(200)]
  scales = np.log10([v['opt.lr_scale'] for v in values])
  warmups = [v['opt.warmup_steps'] for v in values]
  assert scales.min() >= -1 and scales.max() <= 1 and all(1 <= w <= 1000 for w in warmups)
  assert 0.3 < np.mean(scales < 0) < 0.7  # Uniform in log: half below 1.
  assert all(isinstance(w, int) for w in warmups) and np.median(warmups) < 100


def test_seed_statistics_are_numpys(tmp_path):
  rng = np.random.default_rng(0)
  values = list(rng.normal(30.0, 2.0, 5))
  stats = search_summary.aggregate(values)
  assert stats['n'] == 5
  assert stats['mean'] == pytest.approx(np.mean(values), abs=1e-12)
  assert stats['std'] == pytest.approx(np.std(values, ddof=1), abs=1e-12)
  assert stats['spread'] == pytest.approx(np.ptp(values), abs=1e-12)
  assert search_summary.aggregate([2.5]) == {'n': 1, 'mean': 2.5, 'std': 0.0, 'spread': 0.0}


# Each shipped search file with the base config its docstring names.
SEARCH_BASES = {'tiny_lr': ('configs/tiny.py', ''), 'multi30k_lr': ('configs/multi30k.py',
                                                                    'rotary'),
                'bert_finetune': ('configs/bert.py', 'small,finetune')}


def test_every_shipped_search_file_loads_and_its_ranges_are_valid_configs():
  from t2t_jax.training import config_check  # pylint: disable=g-import-not-at-top
  from test_configs import _load, _override  # pylint: disable=g-import-not-at-top
  directory = os.path.join(ROOT, 'configs', 'searches')
  assert {f[:-3] for f in os.listdir(directory) if f.endswith('.py')} == set(SEARCH_BASES)
  for name, (path, variant) in SEARCH_BASES.items():
    search = search_space.load(os.path.join(directory, f'{name}.py'))
    config = _load(os.path.basename(path)[:-3], variant)
    search_space.check_against_config(search, config, name)
    for end in (0, -1):  # Each range's ends (each choice) pass the config checks.
      point = {key: (r[1][end] if r[0] == 'choice' else r[1 if end == 0 else 2])
               for key, r in search['params'].items()}
      config_check.check(_override(config, point), mesh=False)


# Whole searches.


@pytest.mark.slow
def test_bad_input_stops_the_command_in_one_line_before_any_trial(tmp_path):
  root = tmp_path / 'search'
  # Each case a driver of its own. A metric no evaluation reports is refused by the same
  # check as a key (search_space.check_against_config): in process, in
  # test_keys_and_metric_are_checked_against_the_base_config.
  cases = [
      (['--storage=sqlite:////no/such/dir/x.db', SEARCH], 'cannot open the database'),
      ([_write_search(tmp_path / 'key.py', params={'opt.lr': ('uniform', 1.0, 2.0)})],
       "no such config key 'opt.lr'"),
  ]
  for args, message in cases:
    result = _search(*args, '--', *_base(root))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # One line.
    assert result.stderr.startswith('error: ') and message in result.stderr
    assert not os.path.exists(root / 'trial_0000')


@pytest.mark.slow
def test_pruned_trials_stop_early_with_a_checkpoint_and_are_recorded_as_pruned(tmp_path):
  """configs/searches/tiny_lr.py with a budget of 4 trials (its 8 are an example's; each is a
  process of its own): 40 steps, evaluated every 5, the median pruner from the third trial
  on. Without periodic saves: the step a pruned trial stops at is saved because it stops."""
  root = tmp_path / 'search'
  # The sampler draws trial k's point from (seed, k), so these are the shipped search's first
  # four: the fourth warms up over 37 steps and is pruned at step 5, worse than both completed
  # trials by about 0.15 there.
  search = {**runpy.run_path(SEARCH)['get_search'](), 'trials': 4}
  (tmp_path / 'tiny_lr_4.py').write_text(f'def get_search():\n  return {search!r}\n')
  result = _search(tmp_path / 'tiny_lr_4.py', '--', *_base(root, **{'ckpt.every': 0}))
  assert result.returncode == 0, result.stdout + result.stderr
  trials = _study(root).get_trials()
  assert len(trials) == 4
  states = {t.number: t.state.name for t in trials}
  assert set(states.values()) <= {'COMPLETE', 'PRUNED'}
  pruned = [t for t in trials if t.state.name == 'PRUNED']
  assert pruned and states[0] == states[1] == 'COMPLETE'  # n_startup_trials=2.
  for trial in trials:
    workdir = root / f'trial_{trial.number:04d}'
    saved = sorted(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())
    trained = max(scalar_events(str(workdir))['train/loss'])
    if trial.state.name == 'COMPLETE':
      assert saved[-1] == trained == 40 and max(trial.intermediate_values) == 40
      continue
    record = json.loads((workdir / 'pruned.json').read_text())
    stop = max(trial.intermediate_values)
    assert stop < 40 and record['step'] == stop == saved[-1]
    assert trained == stop  # No step after the evaluation that pruned it was trained.
    # The median pruner's own rule, recomputed: worse than the median of the completed
    # trials' values at that step.
    others = [t.intermediate_values[stop] for t in trials if t.state.name == 'COMPLETE'
              and t.number < trial.number and stop in t.intermediate_values]
    assert trial.intermediate_values[stop] > np.median(others)
    assert record['why'].startswith(
        f'trial {trial.number} pruned at step {stop} by the median pruner: eval_loss '
        f'{trial.intermediate_values[stop]:.4g}; the {len(others)} completed trials at this '
        f'step: median {np.median(others):.4g}, best {min(others):.4g}')
    assert record['why'] in (workdir / 'train.log').read_text()
  summary = _search('--summarize', root, '--plot', tmp_path / 'plots')
  assert summary.returncode == 0, summary.stderr
  lines = summary.stdout.splitlines()
  assert lines[0].split() == ['trial', 'state', 'eval_loss', 'step', 'opt.lr_scale',
                              'opt.warmup_steps']
  completed = sorted((t.value, t.number) for t in trials if t.state.name == 'COMPLETE')
  assert [int(line.split()[0]) for line in lines[1:1 + len(completed)]] == [
      n for _, n in completed]  # Best (lowest loss) first.
  assert f'trial {completed[0][1]}: ' in summary.stdout and '--config.opt.lr_scale=' in (
      summary.stdout)
  assert f'Pruning: {len(pruned)} of 4 trials stopped early' in summary.stdout
  assert 'Parameter importances' in summary.stdout
  for name in ('curves.png', 'eval_loss_vs_opt.lr_scale.png', 'eval_loss_vs_opt.warmup_steps.png'):
    assert_drawn(tmp_path / 'plots' / name)


@pytest.fixture(scope='module')
def grid_on_two_workers(tmp_path_factory):
  """A 2 x 2 grid (its size the budget) on two workers, then its best point with seeds 1 and
  2: one search for the two tests below (each run is a process of its own). The search's
  root; the tests read its study, events, workdirs and summary."""
  tmp_path = tmp_path_factory.mktemp('grid')
  root = tmp_path / 'search'
  grid = _write_search(tmp_path / 's.py', sampler='grid', trials=None, params={
      'opt.warmup_steps': ('int', 5, 10, 5), 'opt.lr_scale': ('choice', [1.0, 2.0])})
  # Evaluated and saved at the last step only: nothing here reads another step.
  result = _search('--workers=2', '--seeds=3', '--seeds_for_best=1', grid, '--',
                   *_base(root, steps=20, **{'train.eval_every': 20, 'ckpt.every': 0}))
  assert result.returncode == 0, result.stdout + result.stderr
  return root


@pytest.mark.slow
def test_two_workers_run_trials_of_one_study_at_once(grid_on_two_workers):
  """Every point of the grid once, two at a time."""
  root = grid_on_two_workers
  trials = _study(root).get_trials()
  assert [t.state.name for t in trials] == ['COMPLETE'] * 4
  assert {(t.params['opt.warmup_steps'], t.params['opt.lr_scale']) for t in trials} == {
      (5, 1.0), (5, 2.0), (10, 1.0), (10, 2.0)}
  spans = [(t.datetime_start.timestamp(), t.datetime_complete.timestamp()) for t in trials]
  overlapping = [(a, b) for a in range(4) for b in range(a + 1, 4)
                 if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
  assert overlapping  # Two ran at once.
  workers = {e['worker'] for e in _events(root) if e['event'] == 'start'}
  assert workers == {0, 1}


@pytest.mark.slow
def test_seeds_repeat_the_best_point_and_the_summary_aggregates_them(grid_on_two_workers):
  root = grid_on_two_workers
  trials = _study(root).get_trials()
  best = min(trials, key=lambda t: t.value)
  values = [best.value]
  for seed in (1, 2):
    workdir = root / f'trial_{best.number:04d}_seed{seed}'
    assert json.loads((workdir / 'config.json').read_text())['seed'] == seed
    values.append(json.loads((workdir / 'final.json').read_text())['eval_loss'])
  for other in trials:  # Only the best is repeated.
    assert other is best or not list(root.glob(f'trial_{other.number:04d}_seed*'))
  assert len(set(values)) == 3  # Other seeds, other runs.
  summary = _search('--summarize', root).stdout.splitlines()
  assert summary[0].split()[:6] == ['trial', 'state', 'eval_loss', 'mean', 'seeds', 'std']
  # Rows go by their mean: the best trial's three seeds may rank it below another's one.
  rows = {int(line.split()[0]): line.split() for line in summary[1:5]}
  assert sorted(rows) == [0, 1, 2, 3] and {row[3] for n, row in rows.items()
                                           if n != best.number} == {'1'}
  row = rows[best.number]
  assert row[3] == '3'
  assert float(row[2]) == pytest.approx(np.mean(values), rel=1e-3)
  assert float(row[4]) == pytest.approx(np.std(values, ddof=1), rel=1e-3)
  assert float(row[5]) == pytest.approx(np.ptp(values), rel=1e-3)


@pytest.mark.slow
def test_a_killed_driver_is_started_again_and_no_trial_completes_twice(tmp_path):
  root = tmp_path / 'search'
  # Saved every 10 steps and evaluated every 20, half and a quarter as often as _base's every
  # 5 (each costs the runs time): after its first save a run still has 50 steps to go.
  command = [sys.executable, 'launch/search.py', _write_search(tmp_path / 's.py', trials=3),
             '--', *_base(root, steps=60, **{'train.eval_every': 20, 'ckpt.every': 10})]
  driver = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  second = root / 'trial_0001' / 'checkpoints'
  deadline = time.monotonic() + 300
  while not (second.is_dir() and any(s.isdigit() for s in os.listdir(second))):
    assert time.monotonic() < deadline and driver.poll() is None
    time.sleep(0.2)
  driver.send_signal(signal.SIGKILL)
  driver.communicate(timeout=60)
  # Its running trial got SIGTERM (the parent-death signal), saves and ends on its own.
  deadline = time.monotonic() + 120
  while (root / 'trial_0001' / 'run.lock').exists():
    assert time.monotonic() < deadline
    time.sleep(0.2)
  assert _study(root).get_trials()[1].state.name == 'RUNNING'
  # The same command again; this time a worker's training is killed (kill -9) mid-run.
  again = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  third = root / 'trial_0002'
  deadline = time.monotonic() + 300
  while not ((third / 'checkpoints').is_dir() and any(
      s.isdigit() for s in os.listdir(third / 'checkpoints')) and (third / 'run.lock').exists()):
    assert time.monotonic() < deadline and again.poll() is None
    time.sleep(0.2)
  os.kill(json.loads((third / 'run.lock').read_text())['pid'], signal.SIGKILL)
  output, _ = again.communicate(timeout=600)
  assert again.returncode == 0, output
  trials = _study(root).get_trials()
  assert [t.state.name for t in trials] == ['COMPLETE'] * 3
  events = _events(root)
  for number in range(3):
    assert [e['event'] for e in events if e['trial'] == number].count('complete') == 1
  assert [e['event'] for e in events if e['trial'] == 0] == ['start', 'complete']
  assert [e['event'] for e in events if e['trial'] == 1] == ['start', 'resume', 'complete']
  assert [e['event'] for e in events if e['trial'] == 2] == [
      'start', 'killed', 'resume', 'complete']
  for workdir in (root / 'trial_0001', third):  # Each resumed from its checkpoint.
    log = (workdir / 'train.log').read_text()
    starts = [line.split('Training from step ')[1] for line in log.splitlines()
              if 'Training from step ' in line]
    assert len(starts) == 2 and starts[0].startswith('0 ') and not starts[1].startswith('0 ')
  assert 'trial_0001 resume' in output and 'trial_0002 killed (code=-9)' in output


def test_a_trial_run_reports_to_its_study_and_is_pruned_below_the_median(tmp_path,
                                                                           monkeypatch):
  """The training side in process (tuning/trial_report.py): the reporter a trial's run gets from
  T2T_JAX_TRIAL reports each evaluation to its trial in a real SQLite study, and stops the run
  where the median pruner says so, never at the last step; pruned.json records why."""
  url = f'sqlite:///{tmp_path}/study.db'
  study = optuna.create_study(study_name='s', storage=url, direction='minimize')
  for loss in (1.0, 2.0, 3.0):  # Completed trials at step 5: median 2, best 1.
    done = study.ask()
    done.report(loss, 5)
    study.tell(done, loss)
  monkeypatch.delenv(trial_report.ENV, raising=False)
  assert trial_report.from_environment() is None  # Not a trial: the loop gets no reporter.

  def new_trial_and_its_reporter():
    trial = study.ask()
    monkeypatch.setenv(trial_report.ENV, json.dumps({
        'storage': url, 'study': 's', 'trial_id': trial._trial_id, 'metric': 'eval_loss',
        'pruner': ['median', {'n_startup_trials': 0, 'n_warmup_steps': 0}]}))
    return trial, trial_report.from_environment()

  trial, reporter = new_trial_and_its_reporter()
  assert reporter.decide(5, {'eval_loss': 1.5}, last=False) is None  # Better than the median.
  assert reporter.decide(5, {'bleu': 9.0}, last=False) is None  # No metric: nothing reported.
  assert study.trials[trial.number].intermediate_values == {5: 1.5}
  _, reporter = new_trial_and_its_reporter()
  assert reporter.decide(5, {'eval_loss': 2.5}, last=True) is None  # The last step: never.
  trial, reporter = new_trial_and_its_reporter()
  why = reporter.decide(5, {'eval_loss': 2.5}, last=False)
  assert why == (f'trial {trial.number} pruned at step 5 by the median pruner: eval_loss 2.5; '
                 'the 3 completed trials at this step: median 2, best 1')
  reporter.record(str(tmp_path), 5, why)
  assert json.loads((tmp_path / 'pruned.json').read_text()) == {'step': 5, 'why': why}


def test_the_budget_is_trials_or_hours_since_the_first_trial_began(tmp_path, tiny_config):
  import argparse  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(ROOT, 'launch'))
  import search as driver  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(storage='', study='search', seeds=1, seeds_for_best=0)
  search = search_space.check({'params': {'opt.lr_scale': ('uniform', 1.0, 2.0)},
                               'metric': 'eval_loss', 'trials': 2, 'hours': 1.0})
  runner = driver.StudyDriver(args, search, ['python'], str(tmp_path), tiny_config)
  assert runner._budget_left(runner.study.get_trials())  # pylint: disable=protected-access
  for _ in range(2):
    runner.study.tell(runner.study.ask(), 1.0)
  assert not runner._budget_left(runner.study.get_trials())  # Two trials: spent.
  runner.search = {**search, 'trials': None}
  assert runner._budget_left(runner.study.get_trials())  # An hour has not passed.
  runner.search = {**search, 'trials': None, 'hours': 1e-9}
  assert not runner._budget_left(runner.study.get_trials())
