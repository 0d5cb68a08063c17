"""Sweeps, the hang guard, and the launch scripts (dry runs: test_dry_run.py)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from t2t_jax import exit_codes

sys.path.insert(0, os.path.join(ROOT, 'launch'))
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position


def _run(command, timeout=300, **kwargs):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env['XLA_FLAGS'] = ''
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout, **kwargs)


@pytest.mark.parametrize('text, where', [
    ("def get_sweep():\n  return {'product': {'seed': [0, 1]}\n",
     ":2: SyntaxError: '{' was never closed"),
    ("def get_sweep():\n  return {'product': {'seed': seeds}}\n",
     ":2: NameError: name 'seeds' is not defined"),
    ('x = 1\n', ': a sweep file must define get_sweep()'),
])
def test_a_sweep_file_that_fails_to_load_is_named_with_its_line(tmp_path, text, where):
  path = tmp_path / 'sweep_file.py'
  path.write_text(text)
  with pytest.raises(sweep.SweepError) as raised:
    sweep.load_sweep(str(path))
  assert str(raised.value) == f'{path}{where}'


def test_every_exit_status_is_the_one_table_s():
  """The launchers requeue on PREEMPTED and the modules exit with the table's codes, as a shell
  reports a process a signal ended (128 + the signal's number)."""
  step_script = open(os.path.join(ROOT, 'launch', 'slurm_step.sh')).read()
  assert re.search(r'^readonly PREEMPTED=(\d+)', step_script, re.M).group(1) == '143'
  assert exit_codes.PREEMPTED == 128 + 15 and exit_codes.INTERRUPTED == 128 + 2
  assert sweep.PREEMPTED == exit_codes.PREEMPTED == 143
  assert (exit_codes.ERROR, exit_codes.USAGE, exit_codes.HANG,
          exit_codes.INTERRUPTED) == (1, 2, 3, 130)
  # No module keeps an alias of its own: each names exit_codes.X where it exits.
  package = os.path.join(ROOT, 't2t_jax')
  for name in os.listdir(package):
    if name.endswith('.py') and name != 'exit_codes.py':
      text = open(os.path.join(package, name)).read()
      assert not re.search(r'^\w*(EXIT_CODES?|EXIT_STATUS)\w* = ', text, re.M), name
  codes = [value for name, value in vars(exit_codes).items() if name.isupper()
           and isinstance(value, int)]
  assert len(codes) == len(set(codes))  # No two meanings share a status.


def test_sweep_expands_products_and_zips():
  points = sweep.expand({'product': {'opt.lr_scale': [1, 2]},
                         'zip': {'--config.model.dropout': [0.1, 0.3], 'seed': [5, 6]}})
  assert points == [{'opt.lr_scale': 1, 'model.dropout': 0.1, 'seed': 5},
                    {'opt.lr_scale': 1, 'model.dropout': 0.3, 'seed': 6},
                    {'opt.lr_scale': 2, 'model.dropout': 0.1, 'seed': 5},
                    {'opt.lr_scale': 2, 'model.dropout': 0.3, 'seed': 6}]
  assert sweep.point_name(points[0]) == 'lr_scale=1,dropout=0.1,seed=5'
  assert sweep.point_name({'a.dropout': 1, 'b.dropout': 2}) == 'a.dropout=1,b.dropout=2'
  with pytest.raises(sweep.SweepError, match=r'zip lists must have equal lengths'):
    sweep.expand({'zip': {'a': [1, 2], 'b': [1]}})
  with pytest.raises(sweep.SweepError, match=r"must return 'product' and/or 'zip'"):
    sweep.expand({'grid': {'a': [1]}})
  with pytest.raises(sweep.SweepError, match=r'needs --workdir=DIR'):
    sweep.commands(points, ['python', '-m', 't2t_jax.main'])


@pytest.mark.slow
def test_sweep_dry_run_prints_commands_and_slurm_array(tmp_path):
  base = ['--', 'python', '-m', 't2t_jax.main', '--config=configs/tiny.py',
          f'--workdir={tmp_path}']
  printed = _run([sys.executable, 'launch/sweep.py', '--dry_run', 'configs/sweeps/tiny_grid.py']
                 + base, check=True).stdout.splitlines()
  assert printed == [f'python -m t2t_jax.main --config=configs/tiny.py '
                     f'--config.opt.lr_scale={lr} --config.opt.warmup_steps={w} '
                     f'--workdir={tmp_path}/lr_scale={lr},warmup_steps={w}'
                     for lr in (1.0, 2.0) for w in (10, 20)]
  script = _run([sys.executable, 'launch/sweep.py', '--mode=slurm', '--dry_run',
                 '--sbatch=--gpus=8', 'configs/sweeps/tiny_grid.py'] + base, check=True).stdout
  assert '#SBATCH --array=0-3' in script and '#SBATCH --gpus=8' in script
  assert os.listdir(tmp_path) == []  # A dry run writes nothing.


def _finished_sweep(root):
  """Four hand-written runs of an lr_scale x dropout grid; one of them has no final.json yet."""
  figures = {  # (lr_scale, dropout): (bleu, eval_loss)
      (1.0, 0.1): (30.5, 2.25), (1.0, 0.3): (33.0, 2.5), (2.0, 0.1): (31.25, 2.0),
      (2.0, 0.3): None}
  for (lr_scale, dropout), result in figures.items():
    point = {'opt.lr_scale': lr_scale, 'model.dropout': dropout}
    workdir = root / sweep.point_name(point)
    os.makedirs(workdir)
    (workdir / 'sweep_point.json').write_text(json.dumps({'overrides': point, 'command': 'x'}))
    if result:
      bleu, eval_loss = result
      (workdir / 'final.json').write_text(json.dumps(
          {'config': 'tiny', 'step': 100, 'bleu': bleu, 'eval_loss': eval_loss,
           'train_loss': 3.0, 'steps_per_second': 5.0, 'train_seconds': 20.5}) + '\n')
  (root / 'notes.txt').write_text('not a run')
  os.makedirs(root / 'unrelated')  # Neither file: not a run of the sweep.


def test_summary_shows_swept_values_then_metrics_and_lists_unfinished_runs(tmp_path):
  _finished_sweep(tmp_path)
  table = sweep.summarize(str(tmp_path)).splitlines()
  assert table[0].split() == ['run', 'lr_scale', 'dropout', 'step', 'bleu', 'eval_loss',
                              'train_loss', 'steps_per_second', 'train_seconds']
  assert len(table) == 5
  assert table[1].split() == ['lr_scale=1.0,dropout=0.1', '1.0', '0.1', '100', '30.5', '2.25',
                              '3', '5', '20.5']
  assert table[4].split()[:3] == ['lr_scale=2.0,dropout=0.3', '2.0', '0.3']
  assert '(no final.json: running or failed)' in table[4]


@pytest.mark.parametrize('column, order', [
    ('bleu', [(1.0, 0.3), (2.0, 0.1), (1.0, 0.1), (2.0, 0.3)]),  # Highest first; no BLEU last.
    ('eval_loss', [(2.0, 0.1), (1.0, 0.1), (1.0, 0.3), (2.0, 0.3)]),  # Lowest first.
    ('dropout', [(1.0, 0.1), (2.0, 0.1), (1.0, 0.3), (2.0, 0.3)])])  # Ties keep name order.
def test_summary_sorts_by_a_column(tmp_path, column, order):
  _finished_sweep(tmp_path)
  rows = sweep.summarize(str(tmp_path), sort=column).splitlines()[1:]
  assert [row.split()[0] for row in rows] == [f'lr_scale={lr},dropout={dropout}'
                                              for lr, dropout in order]
  with pytest.raises(sweep.SweepError, match=r'--sort=blue: no such column.*bleu'):
    sweep.summarize(str(tmp_path), sort='blue')


@pytest.mark.slow
def test_summary_as_a_markdown_table_from_the_command_line(tmp_path):
  _finished_sweep(tmp_path)
  run = _run([sys.executable, 'launch/sweep.py', '--summarize', str(tmp_path), '--sort=bleu',
              '--markdown'], timeout=60)
  assert run.returncode == 0, run.stderr
  lines = run.stdout.strip().splitlines()
  assert len(lines) == 2 + 4  # Header, separator, one row per run.
  cells = [[cell.strip() for cell in line.strip().split('|')[1:-1]] for line in lines]
  assert all(line.startswith('| ') and line.endswith(' |') for line in lines)
  assert cells[0] == ['run', 'lr_scale', 'dropout', 'step', 'bleu', 'eval_loss', 'train_loss',
                      'steps_per_second', 'train_seconds']
  assert cells[1] == ['---'] * 9
  assert all(len(row) == 9 for row in cells)
  assert [row[4] for row in cells[2:]] == ['33', '31.25', '30.5', '']
  assert cells[5][3] == '(no final.json: running or failed)'
  misuse = _run([sys.executable, 'launch/sweep.py', '--markdown', 'configs/sweeps/tiny_grid.py',
                 '--', 'python'], timeout=60)
  assert misuse.returncode == 2 and '--sort and --markdown go with --summarize' in misuse.stderr


@pytest.mark.slow
def test_sweep_runs_a_two_by_two_grid_and_summarizes_it(tmp_path):
  sweep_file = tmp_path / 'grid.py'
  # Seeds and data sizes leave the compiled program unchanged: four short runs, one compile.
  sweep_file.write_text("def get_sweep():\n  return {'product': {'seed': [0, 1], "
                        "'data.num_train': [256, 512]}}\n")
  root = tmp_path / 'runs'
  run = _run([sys.executable, 'launch/sweep.py', str(sweep_file), '--', sys.executable, '-m',
              't2t_jax.main', '--config=configs/tiny.py', f'--workdir={root}',
              '--config.train.num_steps=3', '--config.train.eval_every=3',
              '--config.train.log_every=1', '--config.ckpt.every=0',
              '--config.eval.bleu_sentences=4'], timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  names = sorted(os.listdir(root))
  assert names == sorted(f'seed={s},num_train={n}' for s in (0, 1) for n in (256, 512))
  for name in names:
    point = json.load(open(root / name / 'sweep_point.json'))
    config = json.load(open(root / name / 'config.json'))
    assert config['seed'] == point['overrides']['seed']
    assert config['data']['num_train'] == point['overrides']['data.num_train']
  table = _run([sys.executable, 'launch/sweep.py', '--summarize', str(root)],
               check=True).stdout.splitlines()
  assert table[0].split() == ['run', 'seed', 'num_train', 'step', 'bleu', 'eval_loss',
                              'train_loss', 'steps_per_second', 'train_seconds']
  assert len(table) == 5
  for line in table[1:]:
    name, seed, num_train, step, bleu, eval_loss, train_loss, _, _ = line.split()
    assert name == f'seed={seed},num_train={num_train}'
    final = json.load(open(root / name / 'final.json'))
    assert step == '3' and float(bleu) == pytest.approx(final['bleu'], rel=1e-3)
    assert float(eval_loss) == pytest.approx(final['eval_loss'], rel=1e-3)
    assert float(train_loss) == pytest.approx(final['train_loss'], rel=1e-3)
  losses = {json.load(open(root / name / 'final.json'))['train_loss'] for name in names}
  assert len(losses) == 4  # Four different runs, not one repeated.


@pytest.mark.slow
def test_hang_guard_dumps_stacks_and_exits_on_a_stalled_step(tmp_path):
  script = textwrap.dedent(f'''
      import os
      import time
      import jax
      from configs import tiny
      from t2t_jax.training import train

      def stall_forever(x):
        time.sleep(600)
        return x

      build = train.build
      def stalling_build(*args, **kwargs):
        setup = build(*args, **kwargs)
        step, calls = setup.train_step, [0]
        def train_step(state, batch, rng):
          calls[0] += 1
          state, metrics = step(state, batch, rng)
          if calls[0] == 4:  # The fourth step never finishes on the device.
            metrics = jax.pure_callback(stall_forever, metrics, metrics)
          return state, metrics
        setup.train_step = train_step
        return setup
      train.build = stalling_build
      jax.config.update('jax_compilation_cache_dir', os.path.expanduser('~/.cache/t2t_jax/xla'))

      config = tiny.get_config()
      config.train.step_timeout_seconds = 5.0
      config.train.num_steps, config.ckpt.every, config.eval.bleu_sentences = 8, 0, 0
      train.train_and_evaluate(config, {str(tmp_path)!r})
  ''')
  run = _run([sys.executable, '-c', script], timeout=300)
  assert run.returncode == 3, run.stderr[-3000:]
  assert re.search(r'training step [45] \(or reading the metrics of step [34]\) took longer '
                   r'than config.train.step_timeout_seconds=5 s on process 0', run.stderr)
  assert 'Thread 0x' in run.stderr and 'in stall_forever' in run.stderr
  assert 'in train_and_evaluate' in run.stderr  # The main thread, waiting on the step.


@pytest.mark.slow
def test_launch_scripts_parse():
  for script in ('launch/slurm.sbatch', 'launch/tpu_vm.sh'):
    subprocess.run(['bash', '-n', script], cwd=ROOT, check=True)
  usage = _run(['bash', 'launch/tpu_vm.sh'])
  assert usage.returncode == 2 and 'launch/tpu_vm.sh run' in usage.stdout
