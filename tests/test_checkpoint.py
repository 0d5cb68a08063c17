"""Checkpoints: keep policy, exact resume after kill -9, SIGTERM, damaged and failed saves,
config checks, averaging, export, and the README's plain-orbax snippet."""

import errno
import glob
import logging as std_logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import chaos
from conftest import ROOT
from t2t_jax import EOS_ID
from t2t_jax import average
from t2t_jax import checkpoint
from t2t_jax import data
from t2t_jax import decode
from t2t_jax import export
from t2t_jax import train


def _config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.train.num_steps = 20
  config.train.eval_every = 1000
  config.ckpt.every = 5
  config.ckpt.keep = 10
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A tiny run to step 20 with checkpoints at 5, 10, 15, 20, evaluating the average of the
  last 3 at the end; its workdir, config, built model and final figures."""
  workdir = str(tmp_path_factory.mktemp('trained'))
  config = _config()
  config.eval.average_last = 3
  results = train.train_and_evaluate(config, workdir)
  config.eval.average_last = 0
  return workdir, config, train.build(config, data.vocab_size(config)), results


def _copy(workdir, tmp_path):
  return shutil.copytree(workdir, tmp_path / 'copy')


def _leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _numpy_params(path):
  """Params of a checkpoint directory read with plain orbax, as numpy (independent reader)."""
  item = os.path.join(path, 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  saved = checkpointer.metadata(item).item_metadata.tree['params']
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
  return checkpointer.restore(item, args=ocp.args.PyTreeRestore(
      item={'params': saved}, restore_args={'params': args}, partial_restore=True))['params']


def _absl_messages(caplog):
  return '\n'.join(record.getMessage() for record in caplog.records)


def test_keeps_last_k_and_every_mth(tmp_path):
  config = _config()
  config.ckpt.keep, config.ckpt.keep_every = 2, 3
  checkpointer = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  state = {'w': jnp.arange(4.0)}
  for step in range(1, 9):
    assert checkpointer.save(step, state, jax.random.PRNGKey(0), {'next_index': step}, '{}')
  checkpointer.close()
  assert sorted(int(name) for name in os.listdir(tmp_path / 'checkpoints')) == [3, 6, 7, 8]


@pytest.mark.slow
def test_checkpoint_holds_state_rng_data_position_and_config(trained):
  workdir, config, setup, _ = trained
  restored = checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, config)
  assert restored.step == 20 and int(restored.state.step) == 20
  expected_rng = jax.random.split(jax.random.PRNGKey(config.seed))[1]
  assert np.array_equal(np.asarray(restored.rng), np.asarray(expected_rng))
  # One batch consumed per step; the tiny config's epoch has 128 batches.
  assert (restored.data_state['epoch'], restored.data_state['batch']) == (0, 20)
  assert checkpoint.config_differences(restored.config_json, config) == {
      'eval.average_last': (3, 0)}  # The fixture resets it after training.
  assert _leaves_equal(restored.state.params, _numpy_params(f'{workdir}/checkpoints/20'))


# The arrays live in state/d/ (the merged OCDBT data); ocdbt.process_*/ are not read back.
@pytest.mark.slow
@pytest.mark.parametrize('damage, pattern', [('truncate', 'state/d/*'), ('remove', 'state/d/*'),
                                             ('remove', 'state/manifest.ocdbt')])
def test_damaged_latest_checkpoint_falls_back_with_warning(trained, tmp_path, caplog, damage,
                                                           pattern):
  workdir, config, setup, _ = trained
  workdir = _copy(workdir, tmp_path)
  (path,) = glob.glob(f'{workdir}/checkpoints/20/{pattern}')
  if damage == 'truncate':
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    os.remove(path)
  caplog.set_level(std_logging.WARNING)
  params = checkpoint.restore_params(str(workdir), setup.abstract_state.params)  # translate's way
  assert _leaves_equal(params, _numpy_params(f'{workdir}/checkpoints/15'))
  restored = checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, config)
  assert restored.step == 15 and restored.data_state['batch'] == 15
  messages = _absl_messages(caplog)
  assert f'Checkpoint {workdir}/checkpoints/20 is damaged' in messages
  assert 'falling back to step 15' in messages
  assert 'tensorstore_spec' not in messages and '<' not in messages  # No library internals.
  assert sorted(os.listdir(f'{workdir}/checkpoints')) == ['10', '15', '5']
  assert len(os.listdir(f'{workdir}/damaged_checkpoints')) == 1

  # Training resumes from 15 and writes a fresh step 20 equal to the undamaged one.
  results = train.train_and_evaluate(config, str(workdir))
  assert results['step'] == 20
  assert _leaves_equal(_numpy_params(f'{workdir}/checkpoints/20'),
                       _numpy_params(f'{trained[0]}/checkpoints/20'))


def test_damage_description_is_a_sentence_without_pybind_or_spec_text():
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  method = ts.array(np.zeros(2)).read  # Its repr spans lines: '<bound method pybind11_...'.
  error = ValueError(f'NOT_FOUND: Error reading "params/w" via {method!r}')
  assert checkpoint._describe(error) == (  # pylint: disable=protected-access
      'ValueError: NOT_FOUND: Error reading "params/w" via')
  spec = ValueError('NOT_FOUND: Metadata at "w/.zarray" does not exist '
                    '[tensorstore_spec=\'{"context":{}}\']')
  assert checkpoint._describe(spec) == (  # pylint: disable=protected-access
      'ValueError: NOT_FOUND: Metadata at "w/.zarray" does not exist')
  assert checkpoint._describe(OSError()) == 'OSError'  # pylint: disable=protected-access


@pytest.mark.slow
def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(trained, tmp_path):
  workdir, config, setup, _ = trained
  workdir = _copy(workdir, tmp_path)
  for path in glob.glob(f'{workdir}/checkpoints/*/state/_METADATA'):
    os.remove(path)
  with pytest.raises(checkpoint.CheckpointError, match='Refusing to start from scratch'):
    checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, config)
  assert sorted(os.listdir(f'{workdir}/checkpoints')) == ['10', '15', '20', '5']  # Not moved.


@pytest.mark.slow
def test_shape_changing_config_is_refused_and_harmless_change_logged(trained, caplog):
  workdir, config, setup, _ = trained
  bigger = _config()
  bigger.model.d_ff = 128
  bigger_setup = train.build(bigger, data.vocab_size(bigger))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'other shapes.*model\.d_ff: 64 -> 128.*new --workdir'):
    checkpoint.Checkpointer(workdir, config.ckpt).restore(bigger_setup.abstract_state, bigger)
  longer = _config()
  longer.train.num_steps, longer.train.log_every, longer.opt.lr_scale = 40, 2, 1.0
  caplog.set_level(std_logging.INFO)
  restored = checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, longer)
  assert restored.step == 20
  messages = _absl_messages(caplog)
  assert ('changed settings: eval.average_last: 3 -> 0; train.log_every: 5 -> 2; '
          'train.num_steps: 20 -> 40') in messages
  assert 'differ from an uninterrupted run: opt.lr_scale: 2.0 -> 1.0' in messages


@pytest.mark.slow
def test_dropout_prng_with_another_key_size_is_refused_not_called_damaged(trained):
  workdir, _, setup, _ = trained
  rbg = _config()
  rbg.model.dropout_prng = 'rbg'
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'dropout: saved uint32\[2\], config gives uint32\[4\].*'
                     r"model\.dropout_prng: 'hash32' -> 'rbg'"):
    checkpoint.Checkpointer(workdir, rbg.ckpt).restore(setup.abstract_state, rbg, (4,))
  assert not os.path.exists(os.path.join(workdir, 'damaged_checkpoints'))


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
  config = _config()
  checkpointer = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  state = {'w': jnp.arange(4.0)}
  assert checkpointer.save(1, state, jax.random.PRNGKey(0), {'next_index': 1}, '{}')
  checkpointer.manager.wait_until_finished()

  async def disk_full(self, x, directory):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn', disk_full)
  caplog.set_level(std_logging.ERROR)
  checkpointer.save(2, {'w': jnp.arange(4.0) + 1}, jax.random.PRNGKey(0), {'next_index': 2},
                    '{}')
  with pytest.raises(checkpoint.CheckpointError, match=r'final checkpoint \(step 2\).*step 1'):
    checkpointer.close()
  messages = _absl_messages(caplog)
  assert 'Saving checkpoint 2' in messages and 'No space left on device' in messages
  assert 'previous checkpoint (step 1) is intact' in messages
  monkeypatch.undo()
  reopened = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  assert reopened.manager.all_steps() == [1]
  restored = reopened.manager.restore(1, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state)))
  assert np.array_equal(restored['state']['w'], np.arange(4.0))


@pytest.fixture(scope='module')
def averaged(trained):
  """The CLI's average of steps 10, 15 and 20."""
  workdir = trained[0]
  env = dict(os.environ, PYTHONPATH=ROOT)
  output = subprocess.run([sys.executable, '-m', 't2t_jax.average', f'--workdir={workdir}',
                           '--last=3'], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
  assert output.returncode == 0, output.stderr[-3000:]
  path = output.stdout.strip().splitlines()[-1]
  assert path == os.path.join(workdir, 'averaged', 'avg3_10-20')
  return path


@pytest.mark.slow
def test_averaged_params_equal_the_numpy_mean(trained, averaged):
  workdir = trained[0]
  inputs = [_numpy_params(f'{workdir}/checkpoints/{step}') for step in (10, 15, 20)]
  expected = jax.tree.map(lambda *xs: np.mean(np.stack(xs).astype(np.float64), 0), *inputs)
  result = checkpoint.load_params(averaged)  # numpy, as saved
  for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True):
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  assert checkpoint.read_json_item(averaged, 'info')['steps'] == [10, 15, 20]
  with pytest.raises(checkpoint.CheckpointError, match=r'no checkpoint of steps \[7\]'):
    average.choose_steps([5, 10, 15, 20], 0, ['7', '10'])


@pytest.mark.slow
def test_averaged_checkpoint_loads_translates_and_starts_training(trained, averaged, tmp_path):
  workdir, config, setup, _ = trained
  params = checkpoint.restore_params(workdir, setup.abstract_state.params, averaged)
  assert _leaves_equal(params, checkpoint.load_params(averaged))
  assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(
      setup.abstract_state.params)[0].sharding
  task = data.load(config, '')
  translator = decode.Translator(setup.model_config, setup.mesh, setup.axis_rules,
                                 config.data.batch_tokens, config.data.min_bucket, 4)
  outputs = translator.translate(params, task.eval.inputs[:4])
  assert len(outputs) == 4 and all(EOS_ID in output for output in outputs)
  # A new run from the averaged params: with a zero learning rate its first checkpoint keeps
  # them exactly.
  fresh = _config()
  fresh.ckpt.init_from, fresh.opt.schedule, fresh.opt.lr_scale = averaged, 'constant', 0.0
  fresh.train.num_steps, fresh.ckpt.every, fresh.eval.bleu_sentences = 1, 1, 0
  train.train_and_evaluate(fresh, str(tmp_path / 'fresh'))
  assert _leaves_equal(_numpy_params(f'{tmp_path}/fresh/checkpoints/1'),
                       checkpoint.load_params(averaged))


@pytest.mark.slow
def test_restore_params_by_step_and_its_errors(trained, tmp_path):
  workdir, _, setup, _ = trained
  params = checkpoint.restore_params(workdir, setup.abstract_state.params, '10')
  assert _leaves_equal(params, _numpy_params(f'{workdir}/checkpoints/10'))
  latest = checkpoint.restore_params(workdir, setup.abstract_state.params)
  assert _leaves_equal(latest, _numpy_params(f'{workdir}/checkpoints/20'))
  with pytest.raises(checkpoint.CheckpointError, match=r'no checkpoint of step 7 .*\[5, 10, '):
    checkpoint.restore_params(workdir, setup.abstract_state.params, '7')
  with pytest.raises(checkpoint.CheckpointError, match='is not a t2t_jax checkpoint'):
    checkpoint.restore_params(workdir, setup.abstract_state.params, str(tmp_path))
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in'):
    checkpoint.restore_params(str(tmp_path), setup.abstract_state.params)
  wider = _config()
  wider.model.d_model = 64
  wider_params = train.build(wider, data.vocab_size(wider)).abstract_state.params
  with pytest.raises(checkpoint.CheckpointError, match='do not fit this model'):
    checkpoint.restore_params(workdir, wider_params)


@pytest.mark.slow
def test_bf16_export_holds_only_cast_params(trained):
  workdir, _, setup, _ = trained
  path = export.export(workdir, '20', 'bfloat16')
  assert path == os.path.join(workdir, 'export', '20_bfloat16')
  assert sorted(os.listdir(path)) == sorted(
      ['params', 'config', 'info', '_CHECKPOINT_METADATA', 'commit_success.txt'])
  exported = checkpoint.load_params(path)
  original = _numpy_params(f'{workdir}/checkpoints/20')
  for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(original), strict=True):
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(got, want.astype(jnp.bfloat16))
  as_float32 = checkpoint.restore_params(workdir, setup.abstract_state.params, path)
  assert jax.tree.leaves(as_float32)[0].dtype == jnp.float32


@pytest.mark.slow
def test_training_evaluates_the_average_of_the_last_checkpoints(trained):
  workdir, config, setup, results = trained
  for name in ('eval_loss', 'bleu', 'exact_match'):
    assert f'averaged_{name}' in results and np.isfinite(results[f'averaged_{name}'])
  # Independently: the eval loss of the numpy mean of steps 10, 15 and 20.
  inputs = [_numpy_params(f'{workdir}/checkpoints/{step}') for step in (10, 15, 20)]
  mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *inputs)
  config = _config()
  config.eval.bleu_sentences = 0
  task = data.load(config, '')
  _, eval_batches = train._batchers(config, task, setup.mesh)  # pylint: disable=protected-access
  expected, _ = train.run_evaluation(setup, mean, task, eval_batches, config, None)
  np.testing.assert_allclose(results['averaged_eval_loss'], expected['eval_loss'], rtol=1e-5)
  assert results['averaged_eval_loss'] != results['eval_loss']


@pytest.mark.slow
def test_readme_snippet_restores_params_with_plain_orbax(trained, caplog, capfd):
  workdir = trained[0]
  export.export(workdir, '20', 'bfloat16', os.path.join(workdir, 'export', 'snippet'))
  readme = open(os.path.join(ROOT, 'README.md')).read()
  snippet = re.search(r'<!-- plain-orbax -->\s*```python\n(.*?)```', readme, re.S).group(1)
  snippet = (snippet.replace("'/tmp/t2t_default'", repr(workdir))
             .replace('3000_bfloat16', 'snippet').replace('3000', '20'))
  namespace = {}
  capfd.readouterr()
  with caplog.at_level(std_logging.INFO):
    exec(compile(snippet, 'README.md', 'exec'), namespace)  # pylint: disable=exec-used
  said = capfd.readouterr()
  assert said.out == "{'embedding': (10, 32)}\n"  # The tiny copy task: 8 symbols, pad and EOS.
  assert 'WARNING' not in caplog.text + said.err, caplog.text + said.err
  assert _leaves_equal(namespace['params'], _numpy_params(f'{workdir}/checkpoints/20'))
  assert _leaves_equal(namespace['exported'], checkpoint.load_params(f'{workdir}/export/snippet'))


# End to end through the CLI, in subprocesses.

def _command(workdir, *flags):
  return [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
          f'--workdir={workdir}', '--config.train.log_every=1', '--config.train.eval_every=1000',
          '--config.eval.bleu_sentences=0', '--config.ckpt.keep=20', *flags]


def _run_until(command, kill_at_step: int, sig=signal.SIGKILL):
  """Starts training, sends `sig` once it logs step `kill_at_step`; returns (rc, log, step)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
  lines, signalled_at = [], None
  for line in process.stderr:
    lines.append(line)
    match = re.search(r'\] step (\d+): loss', line)
    if match and signalled_at is None and int(match.group(1)) >= kill_at_step:
      signalled_at = int(match.group(1))
      process.send_signal(sig)
      if sig == signal.SIGKILL:
        break
  process.wait(timeout=120)
  return process.returncode, ''.join(lines), signalled_at


@pytest.mark.slow
@pytest.mark.parametrize('dropout_prng', ['hash32', 'rbg'])  # The default; a 4-word key.
def test_kill9_twice_then_resume_equals_an_uninterrupted_run(tmp_path, dropout_prng):
  steps = ['--config.train.num_steps=24', '--config.ckpt.every=3',
           f'--config.model.dropout_prng={dropout_prng}']
  env = dict(os.environ, PYTHONPATH=ROOT)
  subprocess.run(_command(tmp_path / 'straight', *steps), cwd=ROOT, env=env, check=True,
                 capture_output=True, timeout=300)
  first, second = random.randint(4, 10), random.randint(14, 20)
  interrupted = tmp_path / 'interrupted'
  starts = []
  for kill_at in (first, second, None):
    rc, log, _ = _run_until(_command(interrupted, *steps), kill_at or 10**9)
    assert rc == (0 if kill_at is None else -signal.SIGKILL), log[-3000:]
    starts.append(int(re.search(r'Training from step (\d+) to 24', log).group(1)))
  # Each launch resumed from the newest checkpoint the previous one finished writing (saves
  # are asynchronous, so one in flight at the kill is absent), and the last one did resume.
  assert starts[0] == 0 and starts[1] <= first and 0 < starts[2] <= second, (
      first, second, starts)
  assert starts[1] <= starts[2], (first, second, starts)

  for step in (24,) + tuple(s for s in range(3, 24, 3) if s > second):
    a, b = (checkpoint.Checkpointer(str(w), _config().ckpt).manager for w in
            (tmp_path / 'straight', interrupted))
    assert _leaves_equal(_numpy_params(f'{tmp_path}/straight/checkpoints/{step}'),
                         _numpy_params(f'{interrupted}/checkpoints/{step}')), (first, second)
    data_items = [m.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']
                  for m in (a, b)]
    assert data_items[0] == data_items[1]
    assert (data_items[0]['epoch'], data_items[0]['batch']) == (0, step)


@pytest.mark.slow
def test_sigterm_saves_at_the_signalled_step_and_exits_in_time(tmp_path):
  command = _command(tmp_path, '--config.train.num_steps=100000', '--config.ckpt.every=0',
                     '--config.ckpt.preemption_grace_seconds=60')
  start = time.perf_counter()
  rc, log, signalled_at = _run_until(command, 5, signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM, log[-3000:]
  saved = int(re.search(r'saved a checkpoint at step (\d+)', log).group(1))
  # The signal lands while step `signalled_at` + 1 or + 2 is already dispatched.
  assert signalled_at <= saved <= signalled_at + 3
  assert os.listdir(tmp_path / 'checkpoints') == [str(saved)]
  assert time.perf_counter() - start < 120

  # Too short a grace period: the watchdog exits, the previous checkpoint stays intact.
  command[-1] = '--config.ckpt.preemption_grace_seconds=0.001'
  rc, log, _ = _run_until(command, saved + 2, signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM and 'grace period after SIGTERM ran out' in log
  assert f'Restored checkpoint {tmp_path}/checkpoints/{saved}' in log
  restored = checkpoint.Checkpointer(str(tmp_path), _config().ckpt).manager.all_steps()
  assert saved in restored


@pytest.mark.slow
def test_chaos_kills_during_vocab_cache_steps_and_saves_then_sigterm_equal_a_straight_run(
    tmp_path):
  seed = random.randrange(2**31)
  result = chaos.run(kills=4, seed=seed, root=str(tmp_path))
  # Rerun with `python tests/chaos.py --kills=4 --seed=<seed>`.
  assert result['ok'], (f'seed {seed}', result['problems'], result['launches'])
  kinds = [launch['kind'] for launch in result['launches']]
  assert sorted(kinds, key=str) == sorted(['vocab', 'cache', 'step', 'save', 'sigterm', None],
                                          key=str)
  assert result['launches'][-1]['left_behind'] == []  # No run.lock after a clean exit either.
