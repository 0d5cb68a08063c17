"""A run resumed on other devices, mesh splits, micro-batches and process counts trains on with
the same global batches as one that stayed, within float32 sum-order noise; a mesh that cannot
split the saved plan, or a change of what the run trains, stops the resume in one line before
any work.

Every launch on another count of simulated CPU devices than this process's 8 goes through the
command line in a subprocess with that count (and several processes through launch/local.py);
those on 8 devices, the runs that stay among them, train in this process (the same code from
train.train_and_evaluate on, without a process to start). Every run saves every step, so each
step's data position and weights can be compared.
"""

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT, assert_moved_run_agrees, saved_state_field, scalar_events
from t2t_jax import ConfigError
from t2t_jax import exit_codes
from t2t_jax import workdir_layout
from t2t_jax.training import optim
from t2t_jax.training import train

ENGLISH = ['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine']
GERMAN = ['eins', 'zwei', 'drei', 'vier', 'fuenf', 'sechs', 'sieben', 'acht', 'neun']
# What every run here shares: a checkpoint at every step, none dropped, a loss logged at every
# step, and no evaluation before the last step's (which decodes nothing and reads one batch:
# nothing here reads its figures).
SAVE_EVERY_STEP = {'ckpt.every': 1, 'ckpt.keep': 100, 'train.log_every': 1,
                   'train.eval_every': 1000, 'eval.bleu_sentences': 0, 'eval.num_batches': 1}


def _write_corpus(directory, names: dict[str, str], pairs: int, longest: int) -> None:
  """Parallel files of 1..`longest` number words (English -> German) in `directory`; `names`
  maps 'train_src', 'train_tgt', 'eval_src', 'eval_tgt' to file names."""
  rng = np.random.default_rng(0)
  picks = [rng.integers(0, len(ENGLISH), rng.integers(1, longest + 1)) for _ in range(pairs)]
  sides = {'src': [' '.join(ENGLISH[i] for i in p) for p in picks],
           'tgt': [' '.join(GERMAN[i] for i in p) for p in picks]}
  for split, count in (('train', pairs), ('eval', 16)):
    for side, lines in sides.items():
      with open(os.path.join(directory, names[f'{split}_{side}']), 'w') as f:
        f.write(''.join(line + '\n' for line in lines[:count]))


def _config(config_file: str, overrides: dict):
  """The config that `config_file` ('configs/NAME.py[:variant]') and `overrides` give."""
  path, _, variant = config_file.partition(':')
  module = importlib.import_module('configs.' + os.path.basename(path)[:-len('.py')])
  config = module.get_config(variant) if variant else module.get_config()
  config.update_from_flattened_dict(overrides)
  return config


def _launch(config_file: str, workdir, overrides: dict, devices: int, mesh: tuple, *flags):
  """One `python -m t2t_jax.main` on `devices` simulated CPU devices split as `mesh`."""
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
  command = [sys.executable, '-m', 't2t_jax.main', f'--config={config_file}',
             f'--workdir={workdir}', f'--config.mesh.shape={mesh}',
             *(f'--config.{key}={value}' for key, value in overrides.items()), *flags]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def _train(config_file: str, workdir, overrides: dict, devices: int, mesh: tuple,
           caplog) -> str:
  """One launch to overrides['train.num_steps'] on `devices` simulated CPU devices split as
  `mesh`; what it logged. On this process's own count it trains here."""
  steps = overrides['train.num_steps']
  if devices != jax.device_count():
    run = _launch(config_file, workdir, overrides, devices, mesh)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f'] step {steps}: loss' in run.stderr, run.stderr[-3000:]
    return run.stderr
  caplog.clear()
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(_config(config_file, {**overrides, 'mesh.shape': mesh}),
                                       str(workdir))
  assert results['step'] == steps, results
  return '\n'.join(record.getMessage() for record in caplog.records)


def _shape(devices: int, mesh: tuple, accumulation: int) -> str:
  """How the resume line describes a shape (MESH_AXES with the expert axis 1)."""
  data, fsdp, tensor = mesh
  return (f'{devices} cpu devices in 1 process, mesh data={data} fsdp={fsdp} tensor={tensor} '
          f'expert=1, {accumulation} micro-batch{"es" * (accumulation > 1)}')


def _saved_resolved(workdir) -> dict:
  """What a workdir's config.json says the run resolved to."""
  with open(os.path.join(workdir, 'config.json')) as f:
    return json.load(f)['resolved']


def _moved_lines(log: str) -> list[str]:
  return [line for line in log.splitlines() if 'on another shape' in line]


def _data_position(workdir, step: int) -> dict:
  """The data iterator's state saved at `step` (epoch, batch, plan signature), read with
  plain orbax."""
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'))
  try:
    return manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']
  finally:
    manager.close()


def _stopped_copy(workdir, step: int, destination):
  """`workdir` copied as it stood after its save of `step` (a launch that stopped there), with
  no event files: the straight run's first steps, for a moved run to resume on another shape.
  Its first launch would have trained those steps on the same shape, to the same bits."""
  shutil.copytree(workdir, destination, ignore=shutil.ignore_patterns(
      'events.out.tfevents.*', workdir_layout.FINAL_JSON))
  later = [name for name in os.listdir(destination / 'checkpoints')
           if name.isdigit() and int(name) > step]
  assert later, later
  for name in later:
    shutil.rmtree(destination / 'checkpoints' / name)
  return destination


def _move_and_compare(config_file: str, overrides: dict, reference_mesh, start: int,
                      legs: list[tuple], tmp_path, caplog) -> None:
  """Trains `config_file` with `overrides` straight on 8 devices split as `reference_mesh`;
  from its step `start` on, again in `legs` of (devices, mesh, grad_accum_steps, last step),
  each resuming where the one before stopped; asserts the moved run's every step after
  `start` against the straight run's."""
  steps = legs[-1][-1]
  overrides = {**SAVE_EVERY_STEP, **overrides, 'train.num_steps': steps}
  straight = tmp_path / 'straight'
  assert not _moved_lines(_train(config_file, straight, overrides, 8, reference_mesh, caplog))
  moved = _stopped_copy(straight, start, tmp_path / 'moved')

  before = (8, reference_mesh, 1)
  for devices, mesh, accumulation, last in legs:
    log = _train(config_file, moved, {**overrides, 'train.num_steps': last,
                                      'opt.grad_accum_steps': accumulation},
                 devices, mesh, caplog)
    # One line, naming both shapes; the plan the run started with (rows in multiples of the
    # first mesh's 8 batch shards) goes on.
    lines = _moved_lines(log)
    assert len(lines) == 1, lines
    assert f'on another shape: {_shape(*before)} -> {_shape(devices, mesh, accumulation)}' \
        in lines[0], lines[0]
    assert 'rows in multiples of 8' in lines[0], lines[0]
    changed_masks = 'other micro-batches also draw other dropout masks' in lines[0]
    assert changed_masks == (before[2] != accumulation), lines[0]
    before = (devices, mesh, accumulation)

  # The same global batches: the iterator is at the same place of the same plan at each step,
  # one batch further at each.
  positions = [_data_position(straight, step) for step in range(1, steps + 1)]
  assert [_data_position(moved, step) for step in range(1, steps + 1)] == positions
  places = [(position['epoch'], position['batch']) for position in positions]
  assert places == sorted(set(places)), places

  expected, actual = (scalar_events(w)['train/loss'] for w in (straight, moved))
  assert sorted(expected) == list(range(1, steps + 1))
  assert sorted(actual) == list(range(start + 1, steps + 1))  # The moved launches' steps.
  np.testing.assert_allclose([actual[s] for s in actual], [expected[s] for s in actual],
                             rtol=1e-5)
  assert_moved_run_agrees(moved, straight, steps, _config(config_file, overrides))


@pytest.mark.slow
def test_bucketed_run_moved_over_three_shapes_follows_the_straight_run(tmp_path, caplog):
  """The tiny model with dropout, on length buckets of text: pairs of 1 to 16 number words
  are 2 to about 32 tokens, so the batches come from two buckets (about 13 batches of each an
  epoch), both of which every mesh must split; the copy task's pairs all fit the first. A
  budget of 300 tokens fits 18 rows of 16 tokens and 9 of 32: the plan's rows in multiples of
  8 (16 and 8) differ from those a mesh of 2 batch shards would start with (18 and 8). The
  moves: to 4 devices with the weights split over the tensor axis, then back to 8 on the batch
  axis alone (the fsdp split on 2 devices is the packed run's below)."""
  _write_corpus(tmp_path, {'train_src': 'train.src', 'train_tgt': 'train.tgt',
                           'eval_src': 'eval.src', 'eval_tgt': 'eval.tgt'}, 300, 16)
  overrides = {'data.source': 'text', 'data.vocab_size': 40, 'data.max_len': 32,
               'data.batch_tokens': 300,
               'data.data_dir': str(tmp_path), 'data.cache_dir': str(tmp_path / 'cache'),
               'data.train_src': 'train.src', 'data.train_tgt': 'train.tgt',
               'data.eval_src': 'eval.src', 'data.eval_tgt': 'eval.tgt'}
  legs = [(4, (2, 1, 2), 1, 6), (8, (8, 1, 1), 1, 9)]
  _move_and_compare('configs/tiny.py', overrides, (4, 2, 1), 3, legs, tmp_path, caplog)


@pytest.mark.slow
def test_packed_multi30k_shaped_run_moved_with_other_accumulation_follows_the_straight_run(
    tmp_path, caplog):
  """configs/multi30k.py's recipe shrunk to seconds: packed rows of 64 tokens, rotary
  positions, pre-LN, a BPE vocabulary, and a moving average of the weights; on 2 devices the
  batch goes through 2 micro-batches, on 8 through 1. 1,280 tokens fit 20 packed rows: the
  plan's rows in multiples of 8 (16) differ from those 2 shards x 2 micro-batches, or the last
  mesh's 4 batch shards, would start with (20)."""
  _write_corpus(tmp_path, {'train_src': 'train.en', 'train_tgt': 'train.de',
                           'eval_src': 'valid.en', 'eval_tgt': 'valid.de'}, 300, 16)
  overrides = {'data.data_dir': str(tmp_path), 'data.cache_dir': str(tmp_path / 'cache'),
               'data.vocab_size': 40, 'data.batch_tokens': 1280,
               'model.d_model': 32, 'model.d_ff': 64, 'model.num_heads': 2,
               'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1,
               'opt.warmup_steps': 20, 'opt.ema_decay': 0.9,
               # Each micro-batch draws its own dropout masks, so a run whose accumulation
               # changed draws other masks than the straight run: a change of random numbers
               # that would move the losses far beyond sum-order noise. Without dropout the
               # two compute the same sums in another order.
               'model.dropout': 0.0, 'model.attention_dropout': 0.0, 'model.relu_dropout': 0.0}
  legs = [(2, (1, 2, 1), 2, 8), (8, (2, 2, 2), 1, 12)]
  _move_and_compare('configs/multi30k.py:raw_rotary', overrides, (4, 2, 1), 4, legs, tmp_path,
                    caplog)


# A run that moves between processes, each launch through launch/local.py (several processes
# joined by jax.distributed, each its own slice) or one process alone: (processes, CPU devices
# in each, the step its launch trains to). It starts as the reference below, which stays in this
# process on its 8 devices (a copy of it at step START), and each move changes the process
# count (1 -> 2 -> 1): a checkpoint one process wrote is read by two, one two wrote by one. The
# first also changes the mesh (8 -> 4 devices).
START = 4
MOVES = ((2, 2, 8), (1, 4, 12))
MOVED_STEPS = MOVES[-1][2]
# Every step saved and kept: assert_moved_run_agrees reads the reference's steps 1..MOVED_STEPS.
EVERY_STEP = {'train.log_every': 1, 'train.eval_every': MOVED_STEPS, 'ckpt.every': 1,
              'ckpt.keep': MOVED_STEPS, 'eval.bleu_sentences': 0, 'eval.num_batches': 1}


def _launch_moved(workdir, processes: int, devices: int, steps: int) -> str:
  """One launch of the tiny config on `workdir` (each process its own slice); its output."""
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
             f'--workdir={workdir}', f'--config.mesh.dcn_data={processes}',
             f'--config.train.num_steps={steps}'] + [f'--config.{k}={v}'
                                                      for k, v in EVERY_STEP.items()]
  # launch/local.py sets each process's device count.
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS='')
  if processes == 1:  # As the run would be relaunched on one host: no coordinator.
    env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  else:
    command = [sys.executable, 'launch/local.py', f'--num_processes={processes}',
               f'--devices_per_process={devices}', '--', *command]
  run = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:]
  return run.stdout


def _process_shape(devices: int, processes: int) -> str:
  """How the resume line describes a launch of the tiny config: all devices on the data axis."""
  return (f'{devices} cpu devices in {processes} process{"es" if processes > 1 else ""}, '
          f'mesh data={devices} fsdp=1 tensor=1 expert=1, 1 micro-batch')


@pytest.mark.slow
@pytest.mark.multihost
def test_a_run_moved_from_one_process_to_two_and_back_agrees_with_one_that_stayed(
    tiny_config, tmp_path):
  for key, value in {**EVERY_STEP, 'train.num_steps': MOVED_STEPS}.items():
    section, name = key.split('.')
    tiny_config[section][name] = value
  reference = tmp_path / 'reference'
  assert train.train_and_evaluate(tiny_config, str(reference))['step'] == MOVED_STEPS
  moved = _stopped_copy(reference, START, tmp_path / 'moved')

  before = (1, jax.device_count(), START)
  for processes, devices, steps in MOVES:
    output = _launch_moved(moved, processes, devices, steps)
    line = (f'Resuming {moved}/checkpoints/{before[2]} on another shape: '
            f'{_process_shape(before[0] * before[1], before[0])} -> '
            f'{_process_shape(processes * devices, processes)}'
            '. The same global batches (rows in multiples of 8) and dropout masks follow')
    # Every process says it (launch/local.py prefixes the lines of each with its index).
    assert output.count(line) == processes, output[-3000:]
    before = (processes, devices, steps)
  with open(os.path.join(moved, 'config.json')) as f:  # The 8-device start's plan, kept.
    assert json.load(f)['resolved']['data.row_multiple'] == 8

  steps = range(1, MOVED_STEPS + 1)
  expected_data = [_data_position(reference, step) for step in steps]
  assert [(state['epoch'], state['batch']) for state in expected_data] == [(0, s) for s in steps]
  assert [_data_position(moved, step) for step in steps] == expected_data
  losses, expected_losses = (scalar_events(w)['train/loss'] for w in (moved, reference))
  assert sorted(expected_losses) == list(steps)
  assert sorted(losses) == list(range(START + 1, MOVED_STEPS + 1))  # The moved launches'.
  np.testing.assert_allclose([losses[s] for s in losses], [expected_losses[s] for s in losses],
                             rtol=1e-5)
  assert_moved_run_agrees(moved, reference, MOVED_STEPS, tiny_config)


def _files(directory) -> dict[str, tuple[str, int]]:
  """{path under `directory`: (sha256 of its bytes, mtime in ns)} of every file there."""
  found = {}
  for folder, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(folder, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, directory)] = (hashlib.sha256(f.read()).hexdigest(),
                                                   os.stat(path).st_mtime_ns)
  return found


def _error_line(run) -> str:
  """The one `error:` line a refused launch prints; it prints no traceback."""
  assert 'Traceback' not in run.stderr, run.stderr[-3000:]
  errors = [line for line in run.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, run.stderr[-3000:]
  return errors[0]


STARTED = {**SAVE_EVERY_STEP, 'train.num_steps': 2}  # The tiny copy task, two steps.


@pytest.fixture(scope='module')
def started(tmp_path_factory):
  """A tiny run of two steps on this process's 8 devices split (4,2,1): its rows are multiples
  of 8. Tests that resume it for real work on a copy."""
  workdir = tmp_path_factory.mktemp('started') / 'run'
  train.train_and_evaluate(_config('configs/tiny.py', {**STARTED, 'mesh.shape': (4, 2, 1)}),
                           str(workdir))
  return workdir


@pytest.mark.slow
def test_a_mesh_that_cannot_split_the_saved_batches_is_refused_with_ways_on_that_work(
    started, tmp_path):
  """16 devices on one batch axis cannot split the saved 8-row batches: one line, nothing
  touched; each way on that the line suggests then trains."""
  before = _files(started)
  where = os.path.join(started, 'checkpoints', '2')
  go_on = {**STARTED, 'train.num_steps': 3}
  run = _launch('configs/tiny.py', started, go_on, 16, (-1, 1, 1))
  line = _error_line(run)
  # A config that cannot work here (exit_codes.ERROR, docs/training.md), not a malformed
  # command line (USAGE): the same flags resume on another mesh.
  assert run.returncode == exit_codes.ERROR, run.stderr[-3000:]
  assert f'cannot resume the run saved at {where} on this mesh' in line, line
  # The copy task's buckets have 16 rows (length 16) and 8 (every longer one): 16 batch
  # shards cannot split the 8.
  assert re.search(r'have \[8, 16\] rows \(all multiples of 8\), which 16 batch shards x 1 '
                   r'micro-batch cannot split evenly', line), line
  assert _files(started) == before  # Refused before any work: nothing written or touched.

  # Way on 1: the same run on the suggested mesh, 8 batch shards of 16 devices.
  mesh = re.search(r'--config\.mesh\.shape=\((\d+),(\d+),(\d+),1\) \(8 batch shards', line)
  assert mesh and ' or 8 devices' in line, line
  mesh = tuple(int(size) for size in mesh.groups())
  resumed = shutil.copytree(started, tmp_path / 'resumed')
  run = _launch('configs/tiny.py', resumed, go_on, 16, mesh)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'Training from step 2 to 3' in run.stderr
  assert [f'{_shape(8, (4, 2, 1), 1)} -> {_shape(16, mesh, 1)}' in moved
          for moved in _moved_lines(run.stderr)] == [True]

  # Way on 2: a new run from the saved parameters, on the 16 devices, with rows in
  # multiples of 16.
  multiple = re.search(r'new --workdir with --config\.data\.row_multiple=(\d+) and '
                       r'--config\.ckpt\.init_from=(\S+) ', line)
  assert multiple and multiple.groups() == ('16', where), line
  fresh, fresh_run = tmp_path / 'fresh', {**STARTED, 'train.num_steps': 1}
  run = _launch('configs/tiny.py', fresh, fresh_run, 16, (-1, 1, 1),
                f'--config.data.row_multiple={multiple[1]}',
                f'--config.ckpt.init_from={multiple[2]}')
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'Training from step 0 to 1' in run.stderr
  assert _saved_resolved(fresh)['data.row_multiple'] == 16
  # It started from the saved parameters: Adam's first step moves a weight by at most the
  # first rate, while the seed's fresh weights are the saved run's steps 1 and 2 (the second
  # at twice the first rate) away from them.
  config = _config('configs/tiny.py', fresh_run)
  first_rate = float(optim.learning_rate_schedule(config.opt, config.model.d_model,
                                                  config.train.num_steps)(0))
  for after, saved in zip(*(jax.tree.leaves(saved_state_field(path)) for path in
                            (fresh / 'checkpoints' / '1', where)), strict=True):
    assert np.abs(after - saved).max() <= first_rate * (1 + 1e-5) + 1e-6  # + rounding.


@pytest.mark.slow
def test_a_resume_that_changes_what_the_run_trains_is_refused_naming_each_key(started):
  """Another seed and another warmup: both named in one error, before any work. (A refused
  resume's one `error:` line and exit status through the command line: the test above.)"""
  before = _files(started)
  changed = _config('configs/tiny.py', {**STARTED, 'train.num_steps': 3, 'mesh.shape': (4, 2, 1),
                                        'seed': 3, 'opt.warmup_steps': 10})
  with pytest.raises(ConfigError) as refused:
    train.train_and_evaluate(changed, str(started))
  line = str(refused.value)
  assert '\n' not in line and 'opt.warmup_steps: 20 -> 10' in line and 'seed: 0 -> 3' in line, line
  assert _files(started) == before
