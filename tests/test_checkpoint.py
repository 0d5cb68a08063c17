"""Checkpoints: keep policy, exact resume after kill -9, SIGTERM, damaged and failed saves,
config checks, averaging, export, and the plain-orbax snippet of docs/training.md."""

import errno
import gc
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
from conftest import ROOT, leaves_equal, saved_state_field
from t2t_jax import EOS_ID
from t2t_jax import average
from t2t_jax import ConfigError
from t2t_jax import export
from t2t_jax import sharding
from t2t_jax.checkpoints import checkpoint
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline as data
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.training import train


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
  assert leaves_equal(restored.state.params, saved_state_field(f'{workdir}/checkpoints/20'))


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
  params = saved_params.restore_params(str(workdir), setup.abstract_state.params)  # translate's way
  assert leaves_equal(params, saved_state_field(f'{workdir}/checkpoints/15'))
  restored = checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, config)
  assert restored.step == 15 and restored.data_state['batch'] == 15
  messages = _absl_messages(caplog)
  assert f'Checkpoint {workdir}/checkpoints/20 is damaged' in messages
  assert 'falling back to step 15' in messages
  assert 'tensorstore_spec' not in messages and '<' not in messages  # No library internals.
  assert sorted(os.listdir(f'{workdir}/checkpoints')) == ['10', '15', '5']
  assert len(os.listdir(f'{workdir}/damaged_checkpoints')) == 1
  if damage != 'truncate':  # What follows the fallback is the same whatever the damage was:
    return  # one case trains on from it.

  # Training resumes from 15 and writes a fresh step 20 equal to the undamaged one.
  results = train.train_and_evaluate(config, str(workdir))
  assert results['step'] == 20
  assert leaves_equal(saved_state_field(f'{workdir}/checkpoints/20'),
                       saved_state_field(f'{trained[0]}/checkpoints/20'))


def test_damage_description_is_a_sentence_without_pybind_or_spec_text():
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  method = ts.array(np.zeros(2)).read  # Its repr spans lines: '<bound method pybind11_...'.
  error = ValueError(f'NOT_FOUND: Error reading "params/w" via {method!r}')
  assert saved_params.describe_error(error) == (
      'ValueError: NOT_FOUND: Error reading "params/w" via')
  spec = ValueError('NOT_FOUND: Metadata at "w/.zarray" does not exist '
                    '[tensorstore_spec=\'{"context":{}}\']')
  assert saved_params.describe_error(spec) == (
      'ValueError: NOT_FOUND: Metadata at "w/.zarray" does not exist')
  assert saved_params.describe_error(OSError()) == 'OSError'


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
  longer.train.num_steps, longer.train.log_every, longer.mesh.shape = 40, 2, (4, 2, 1)
  caplog.set_level(std_logging.INFO)
  restored = checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, longer)
  assert restored.step == 20
  messages = _absl_messages(caplog)
  assert ('changed settings: eval.average_last: 3 -> 0; mesh.shape: [-1, 1, 1] -> [4, 2, 1]; '
          'train.log_every: 5 -> 2; train.num_steps: 20 -> 40') in messages
  # What the run trains may not change: each such key is named, in one line.
  retrained = _config()
  retrained.opt.lr_scale, retrained.seed, retrained.data.batch_tokens = 1.0, 7, 512
  with pytest.raises(ConfigError, match=r'^checkpoint \S+/20 was saved with other settings of '
                     r"what the run trains .*: data\.batch_tokens: 256 -> 512; opt\.lr_scale: "
                     r"2\.0 -> 1\.0; seed: 0 -> 7\. Rerun"):
    checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, retrained)
  # A schedule that ends at train.num_steps makes it part of every step's learning rate.
  cosine = _config()
  cosine.opt.cooldown_steps, cosine.train.num_steps = 5, 40
  with pytest.raises(ConfigError, match=r'opt\.cooldown_steps: 0 -> 5; train\.num_steps: 20 -> 40'):
    checkpoint.Checkpointer(workdir, config.ckpt).restore(setup.abstract_state, cosine)


# One value per key a resume may change, and one per key of what the run trains.
MAY_CHANGE = {'name': 'moved', 'train.num_steps': 40, 'train.eval_every': 3, 'eval.beam_size': 2,
              'ckpt.every': 2, 'mesh.shape': (2, 2, 1), 'mesh.shard_update': True,
              'opt.grad_accum_steps': 2,
              'opt.loss_chunk_tokens': 0, 'opt.ema_decay': 0.999, 'model.remat': 'full',
              'model.dtype': 'bfloat16', 'model.attention_impl': 'xla',
              'data.data_dir': '/elsewhere', 'data.cache_dir': '/cache', 'data.row_multiple': 8}
MAY_NOT = {'seed': 1, 'data.batch_tokens': 512, 'data.vocab_size': 9000, 'data.train_src': 'x',
           'data.batching': 'packed', 'model.positions': 'rotary', 'model.dropout': 0.0,
           'model.dropout_prng': 'rbg', 'opt.lr_scale': 1.0, 'opt.warmup_steps': 10,
           'opt.schedule': 'cosine', 'opt.b2': 0.997, 'opt.label_smoothing': 0.0}


def _with(config, key, value):
  section, _, name = key.rpartition('.')
  (config[section] if section else config)[name] = value
  return config


@pytest.mark.parametrize('key', sorted(MAY_CHANGE))
def test_a_resume_may_change_where_and_how_the_run_computes(key):
  saved = _config().to_json_best_effort()
  changed = _with(_config(), key, MAY_CHANGE[key])
  assert list(checkpoint.refuse_changes('ckpt/20', saved, changed)) == [key]


@pytest.mark.parametrize('key', sorted(MAY_NOT))
def test_a_resume_may_not_change_what_the_run_trains(key):
  saved = _config().to_json_best_effort()
  with pytest.raises(ConfigError, match=rf'^checkpoint ckpt/20 was saved with other settings of '
                     rf'what the run trains .*: {re.escape(key)}: [^;]*\. Rerun with the saved '
                     r'values, or start a new --workdir \(--config\.ckpt\.init_from=ckpt/20'):
    checkpoint.refuse_changes('ckpt/20', saved, _with(_config(), key, MAY_NOT[key]))


def test_train_steps_may_change_unless_the_schedule_ends_at_them():
  for schedule, cooldown, refused in (('rsqrt', 0, False), ('rsqrt', 5, True),
                                      ('linear', 0, True), ('cosine', 0, True)):
    before = _with(_with(_config(), 'opt.schedule', schedule), 'opt.cooldown_steps', cooldown)
    after = _with(_with(_config(), 'opt.schedule', schedule), 'opt.cooldown_steps', cooldown)
    after.train.num_steps = 40
    if refused:
      with pytest.raises(ConfigError, match=r'train\.num_steps: 20 -> 40\. Rerun'):
        checkpoint.refuse_changes('ckpt/20', before.to_json_best_effort(), after)
    else:
      assert checkpoint.refuse_changes('ckpt/20', before.to_json_best_effort(), after) == {
          'train.num_steps': (20, 40)}


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


@pytest.mark.slow
def test_a_run_with_a_four_word_dropout_key_resumes_to_the_uninterrupted_result(tmp_path,
                                                                                caplog):
  """dropout_prng='rbg' (a uint32[4] key; the default hash32's is [2]): a run stopped at a
  checkpoint and resumed ends bitwise equal to one never stopped, dropout on."""
  config = _config()
  config.model.dropout_prng, config.train.num_steps = 'rbg', 10
  config.eval.bleu_sentences = 0  # The checkpoints are compared: decoding adds nothing.
  assert config.model.dropout > 0
  train.train_and_evaluate(config, str(tmp_path / 'straight'))  # Saves steps 5 and 10.
  # The same run stopped after its save of step 5 (a copy, its later checkpoint removed).
  resumed = shutil.copytree(tmp_path / 'straight', tmp_path / 'resumed')
  shutil.rmtree(resumed / 'checkpoints' / '10')
  with caplog.at_level(std_logging.INFO):
    assert train.train_and_evaluate(config, str(resumed))['step'] == 10
  assert 'Training from step 5 to 10' in _absl_messages(caplog)
  assert leaves_equal(saved_state_field(f'{tmp_path}/straight/checkpoints/10'),
                       saved_state_field(f'{resumed}/checkpoints/10'))


def _disk_full_in_background(monkeypatch):
  """Makes orbax's background writer of JSON items fail as a full disk does."""
  async def disk_full(self, x, directory):
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn', disk_full)


def test_a_save_on_cpu_devices_writes_replicated_arrays_whole_and_compiles_nothing(
    tmp_path, caplog):
  """Orbax's default splits an array replicated over 8 devices into 8 slices, each a program
  compiled for its offset (about 2 s at a tiny model's first save); on CPU devices t2t_jax
  writes it whole. Shapes no other test uses (both split 8 ways by the default), so no slice
  program is already compiled."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {'w': jax.device_put(jnp.arange(8 * 13, dtype=jnp.float32).reshape(8, 13), replicated),
           'b': jax.device_put(jnp.arange(24, dtype=jnp.float32), replicated)}
  assert len(state['w'].sharding.device_set) == 8
  checkpointer, rng = checkpoint.Checkpointer(str(tmp_path), _config().ckpt), jax.random.PRNGKey(0)
  with caplog.at_level(std_logging.WARNING), jax.log_compiles():
    checkpointer.save(1, state, rng, {'next_index': 1}, '{}')
    checkpointer.close()
  said = [record.getMessage() for record in caplog.records]
  assert [line for line in said if 'Finished XLA compilation' in line] == []
  restored = checkpoint.Checkpointer(str(tmp_path), _config().ckpt).manager.restore(
      1, args=ocp.args.Composite(state=saved_params.arrays_restore(state)))
  assert all(np.array_equal(restored['state'][k], state[k]) for k in state)
  assert restored['state']['w'].sharding == replicated


def test_failed_save_stops_with_the_cause_and_keeps_the_previous_checkpoint(tmp_path,
                                                                             monkeypatch):
  config = _config()
  checkpointer = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  state = {'w': jnp.arange(4.0)}
  assert checkpointer.save(1, state, jax.random.PRNGKey(0), {'next_index': 1}, '{}')
  checkpointer.manager.wait_until_finished()

  _disk_full_in_background(monkeypatch)
  checkpointer.save(2, {'w': jnp.arange(4.0) + 1}, jax.random.PRNGKey(0), {'next_index': 2},
                    '{}')
  deadline = time.monotonic() + 60
  with pytest.raises(checkpoint.CheckpointError) as raised:
    while time.monotonic() < deadline:  # check() never waits: poll as the loop does per step.
      checkpointer.check()
      time.sleep(0.01)
  message = str(raised.value)
  assert (f'saving checkpoint 2 in {tmp_path}/checkpoints failed: the disk is full' in message
          and 'newest intact one is step 1' in message and 'Free space' in message), message
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1']  # The partial save is gone.
  checkpointer.close()  # Nothing more in flight: closes without raising again.
  monkeypatch.undo()
  reopened = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  assert reopened.manager.all_steps() == [1]
  restored = reopened.manager.restore(1, args=ocp.args.Composite(
      state=saved_params.arrays_restore(state)))
  assert np.array_equal(restored['state']['w'], np.arange(4.0))


def test_a_failed_save_reported_twice_by_orbax_closes_without_a_second_error(tmp_path,
                                                                             monkeypatch):
  """The checkpoint's metadata fails to write too (a full disk fails every write): orbax's
  finalize thread stops there, before it collects the items' failure, which its async
  checkpointer then raises again on closing. The run must still end with its one error."""
  from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata  # pylint: disable=g-import-not-at-top
  checkpointer = checkpoint.Checkpointer(str(tmp_path), _config().ckpt)
  _disk_full_in_background(monkeypatch)

  def disk_full(self, file_path, metadata):
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(orbax_metadata._MetadataStoreImpl, 'write', disk_full)  # pylint: disable=protected-access
  checkpointer.save(2, {'w': jnp.arange(4.0)}, jax.random.PRNGKey(0), {'next_index': 2}, '{}')
  deadline = time.monotonic() + 60
  with pytest.raises(checkpoint.CheckpointError, match='saving checkpoint 2 .*the disk is full'):
    while time.monotonic() < deadline:
      checkpointer.check()
      time.sleep(0.01)
  checkpointer.close()  # Before: orbax's second report, a bare OSError, came out here.
  assert os.listdir(tmp_path / 'checkpoints') == []


def _orphan_a_failed_task() -> None:
  """A task that failed with nobody retrieving its error, freed only by the garbage collector
  (held in a reference cycle), as orbax's sibling reads are when the first one fails."""
  import asyncio  # pylint: disable=import-outside-toplevel

  async def sibling_read():
    raise OSError('tensorstore: the shard is truncated')
  loop = asyncio.new_event_loop()
  cycle = {'task': loop.create_task(sibling_read())}
  cycle['self'] = cycle
  loop.run_until_complete(asyncio.sleep(0))  # The task runs and fails.
  loop.close()


def test_unretrieved_task_errors_are_dropped_only_around_a_failed_orbax_call(tmp_path, caplog):
  checkpoint.Checkpointer(str(tmp_path), _config().ckpt)  # Installs nothing for the process.
  unretrieved = lambda: [r for r in caplog.records if 'never retrieved' in r.getMessage()]
  with caplog.at_level(std_logging.ERROR, logger='asyncio'):
    with pytest.raises(OSError, match='the read failed'):
      with saved_params.unretrieved_task_errors_dropped():
        _orphan_a_failed_task()
        raise OSError('the read failed')
    assert unretrieved() == []  # Collected, and dropped, before the call returned.
    _orphan_a_failed_task()
    gc.collect()
    assert len(unretrieved()) == 1  # Outside such a call, asyncio's report is kept.
  assert std_logging.getLogger('asyncio').filters == []


def test_late_writer_wakeups_of_a_closed_loop_are_dropped_and_other_reports_kept(
    tmp_path, monkeypatch):
  """Writes still in flight after a failed save wake orbax's closed event loop from a thread
  with no Python caller: Python reports each through sys.unraisablehook. Only those go."""
  reported = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda report: reported.append(report.exc_value))
  checkpoint.Checkpointer(str(tmp_path), _config().ckpt)
  import asyncio  # pylint: disable=import-outside-toplevel
  loop = asyncio.new_event_loop()
  loop.close()

  class LateWakeup:  # An exception in __del__ has no caller either: it goes the same way.
    def __init__(self, wake):
      self.wake = wake

    def __del__(self):
      self.wake()

  LateWakeup(lambda: loop.call_soon_threadsafe(print))
  assert reported == []
  LateWakeup(lambda: loop.call_soon(print))  # The same error, but not a thread's wake-up...
  LateWakeup(lambda: 1 / 0)  # ...and another error: both still reported.
  assert [type(error) for error in reported] == [RuntimeError, ZeroDivisionError]
  assert str(reported[0]) == 'Event loop is closed'


def test_failed_final_save_raises_at_close(tmp_path, monkeypatch):
  checkpointer = checkpoint.Checkpointer(str(tmp_path), _config().ckpt)
  _disk_full_in_background(monkeypatch)
  checkpointer.save(7, {'w': jnp.arange(4.0)}, jax.random.PRNGKey(0), {'next_index': 7}, '{}')
  with pytest.raises(checkpoint.CheckpointError) as raised:
    checkpointer.close()
  message = str(raised.value)
  assert 'saving checkpoint 7 ' in message and 'None' not in message, message
  assert message.endswith('the unfinished checkpoint was removed and there is no intact '
                          'checkpoint yet. Free space (or use a --workdir on another disk, '
                          'copying the checkpoints) and rerun the same command to start again.')
  assert os.listdir(tmp_path / 'checkpoints') == []


def test_a_synchronous_save_failure_stops_too(tmp_path, monkeypatch):
  checkpointer = checkpoint.Checkpointer(str(tmp_path), _config().ckpt)

  def refused(*args, **kwargs):
    raise PermissionError(errno.EACCES, 'Permission denied', str(tmp_path / 'checkpoints'))
  monkeypatch.setattr(checkpointer.manager, 'save', refused)
  with pytest.raises(checkpoint.CheckpointError, match=r'saving checkpoint 3 .*PermissionError'
                     r'.*Fix the cause'):
    checkpointer.save(3, {'w': jnp.arange(4.0)}, jax.random.PRNGKey(0), {}, '{}')


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
  inputs = [saved_state_field(f'{workdir}/checkpoints/{step}') for step in (10, 15, 20)]
  expected = jax.tree.map(lambda *xs: np.mean(np.stack(xs).astype(np.float64), 0), *inputs)
  result = saved_params.load_params(averaged)  # numpy, as saved
  for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True):
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  assert saved_params.read_json_item(averaged, 'info')['steps'] == [10, 15, 20]
  with pytest.raises(checkpoint.CheckpointError, match=r'no checkpoint of steps \[7\]'):
    average.choose_steps([5, 10, 15, 20], 0, ['7', '10'])


@pytest.mark.slow
def test_averaged_checkpoint_loads_translates_and_starts_training(trained, averaged, tmp_path,
                                                                caplog):
  workdir, config, setup, _ = trained
  params = saved_params.restore_params(workdir, setup.abstract_state.params, averaged)
  assert leaves_equal(params, saved_params.load_params(averaged))
  assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(
      setup.abstract_state.params)[0].sharding
  task = data.load(config, '')
  translator = translator_lib.Translator(setup.model_config, setup.mesh, setup.axis_rules,
                                 config.data.batch_tokens, config.data.min_bucket, 4)
  outputs = translator.translate(params, task.eval.inputs[:4])
  assert len(outputs) == 4 and all(EOS_ID in output for output in outputs)
  # A new run from the averaged params: with a zero learning rate its first checkpoint keeps
  # them exactly.
  fresh = _config()
  fresh.ckpt.init_from, fresh.opt.schedule, fresh.opt.lr_scale = averaged, 'constant', 0.0
  fresh.train.num_steps, fresh.ckpt.every, fresh.eval.bleu_sentences = 1, 1, 0
  with caplog.at_level(std_logging.INFO):
    train.train_and_evaluate(fresh, str(tmp_path / 'fresh'))
  assert leaves_equal(saved_state_field(f'{tmp_path}/fresh/checkpoints/1'),
                       saved_params.load_params(averaged))
  arrays = len(jax.tree.leaves(params))
  assert (f'Initialised from {averaged}: loaded the whole model ({arrays} arrays); the '
          'optimiser state, step and schedule start fresh') in _absl_messages(caplog)


@pytest.mark.slow
def test_restore_params_by_step_and_its_errors(trained, tmp_path):
  workdir, _, setup, _ = trained
  params = saved_params.restore_params(workdir, setup.abstract_state.params, '10')
  assert leaves_equal(params, saved_state_field(f'{workdir}/checkpoints/10'))
  latest = saved_params.restore_params(workdir, setup.abstract_state.params)
  assert leaves_equal(latest, saved_state_field(f'{workdir}/checkpoints/20'))
  with pytest.raises(checkpoint.CheckpointError, match=r'no checkpoint of step 7 .*\[5, 10, '):
    saved_params.restore_params(workdir, setup.abstract_state.params, '7')
  with pytest.raises(checkpoint.CheckpointError, match='is not a t2t_jax checkpoint'):
    saved_params.restore_params(workdir, setup.abstract_state.params, str(tmp_path))
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in'):
    saved_params.restore_params(str(tmp_path), setup.abstract_state.params)
  wider = _config()
  wider.model.d_model = 64
  wider_params = train.build(wider, data.vocab_size(wider)).abstract_state.params
  with pytest.raises(checkpoint.CheckpointError, match='do not fit this model'):
    saved_params.restore_params(workdir, wider_params)


@pytest.mark.slow
def test_bf16_export_holds_only_cast_params(trained):
  workdir, _, setup, _ = trained
  path = export.export(workdir, '20', 'bfloat16')
  assert path == os.path.join(workdir, 'export', '20_bfloat16')
  assert sorted(os.listdir(path)) == sorted(
      ['params', 'config', 'info', '_CHECKPOINT_METADATA', 'commit_success.txt'])
  exported = saved_params.load_params(path)
  original = saved_state_field(f'{workdir}/checkpoints/20')
  for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(original), strict=True):
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(got, want.astype(jnp.bfloat16))
  as_float32 = saved_params.restore_params(workdir, setup.abstract_state.params, path)
  assert jax.tree.leaves(as_float32)[0].dtype == jnp.float32


@pytest.mark.slow
def test_training_evaluates_the_average_of_the_last_checkpoints(trained):
  workdir, config, setup, results = trained
  for name in ('eval_loss', 'bleu', 'exact_match'):
    assert f'averaged_{name}' in results and np.isfinite(results[f'averaged_{name}'])
  # Independently: the eval loss of the numpy mean of steps 10, 15 and 20.
  inputs = [saved_state_field(f'{workdir}/checkpoints/{step}') for step in (10, 15, 20)]
  mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *inputs)
  config = _config()
  config.eval.bleu_sentences = 0
  task = data.load(config, '')
  _, eval_batches = data.make_batchers(config, task.train, task.eval,
                                       sharding.batch_shards(setup.mesh))
  expected = train.run_evaluation(setup, mean, eval_batches, config, evaluators=[],
                                  step=config.train.num_steps)
  np.testing.assert_allclose(results['averaged_eval_loss'], expected['eval_loss'], rtol=1e-5)
  assert results['averaged_eval_loss'] != results['eval_loss']


@pytest.mark.slow
def test_readme_snippet_restores_params_with_plain_orbax(trained, caplog, capfd):
  workdir = trained[0]
  export.export(workdir, '20', 'bfloat16', os.path.join(workdir, 'export', 'snippet'))
  page = open(os.path.join(ROOT, 'docs', 'training.md')).read()
  snippet = re.search(r'<!-- plain-orbax -->\s*```python\n(.*?)```', page, re.S).group(1)
  snippet = (snippet.replace("'/tmp/t2t_default'", repr(workdir))
             .replace('3000_bfloat16', 'snippet').replace('3000', '20'))
  namespace = {}
  capfd.readouterr()
  with caplog.at_level(std_logging.INFO):
    exec(compile(snippet, 'docs/training.md', 'exec'), namespace)  # pylint: disable=exec-used
  said = capfd.readouterr()
  assert said.out == "{'embedding': (10, 32)}\n"  # The tiny copy task: 8 symbols, pad and EOS.
  assert 'WARNING' not in caplog.text + said.err, caplog.text + said.err
  assert leaves_equal(namespace['params'], saved_state_field(f'{workdir}/checkpoints/20'))
  assert leaves_equal(namespace['exported'], saved_params.load_params(f'{workdir}/export/snippet'))


# End to end through the CLI, in subprocesses: one per way a run ends (a signal, a full disk).
# What a test then checks of the saved run (a resume, a straight run to compare with) runs in
# this process: the same config trains to the same bits there (the damaged-checkpoint test
# resumes in process too).

# What every run below sets beyond configs/tiny.py, on the command line or in process.
COMMON = {'train.log_every': 1, 'train.eval_every': 1000, 'eval.bleu_sentences': 0,
          'ckpt.keep': 20}


def _command(workdir, *flags):
  return [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
          f'--workdir={workdir}', *(f'--config.{key}={value}' for key, value in COMMON.items()),
          *flags]


def _steps_flags(num_steps: int, every: int) -> list[str]:
  return [f'--config.train.num_steps={num_steps}', f'--config.ckpt.every={every}']


def _train_here(workdir, num_steps: int, every: int) -> dict:
  """Trains what `_command(workdir, *_steps_flags(num_steps, every))` would, in this process;
  its final figures."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.update_from_flattened_dict({**COMMON, 'train.num_steps': num_steps, 'ckpt.every': every})
  return train.train_and_evaluate(config, str(workdir))


def _resume_here(workdir, caplog, start: int, num_steps: int, every: int) -> None:
  """_train_here on a workdir a signalled or failed launch left: it trains on from `start`."""
  with caplog.at_level(std_logging.INFO):
    assert _train_here(workdir, num_steps, every)['step'] == num_steps
  assert f'Training from step {start} to {num_steps}' in _absl_messages(caplog)


def _run_until(command, kill_at_step: int, sig=signal.SIGKILL,
               pattern=r'\] step (\d+): loss'):
  """Starts training, sends `sig` once it logs a line matching `pattern` (holding a step) of
  step `kill_at_step` or later; returns (rc, log, step)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
  lines, signalled_at = [], None
  for text in process.stderr:
    lines.append(text)
    match = re.search(pattern, text)
    if match and signalled_at is None and int(match.group(1)) >= kill_at_step:
      signalled_at = int(match.group(1))
      process.send_signal(sig)
      if sig == signal.SIGKILL:
        break
  process.wait(timeout=600)
  return process.returncode, ''.join(lines), signalled_at


STRAIGHT = (24, 3)  # Steps, and a save every 3.


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """The tiny config trained to step 24, saving every 3 steps: what the interrupted runs below
  must end equal to (how often a run saves does not change what it computes)."""
  workdir = tmp_path_factory.mktemp('straight')
  _train_here(workdir, *STRAIGHT)
  return workdir


def _saved_after_signal(log: str, what: str) -> int:
  """The step a signalled run saved, checked against the step its own log says the signal
  arrived in: that step, or the next where the signal came after the step's save decision."""
  arrived = int(re.search(r'received during (?:the [\w ]+ of )?step (\d+)', log).group(1))
  saved = int(re.search(rf'{what}: saved a checkpoint at step (\d+)', log).group(1))
  assert arrived <= saved <= arrived + 1, (arrived, saved)
  return saved


@pytest.mark.slow
def test_sigterm_saves_at_the_signalled_step_and_exits_in_time(tmp_path):
  command = _command(tmp_path, '--config.train.num_steps=100000', '--config.ckpt.every=0',
                     '--config.ckpt.preemption_grace_seconds=600')
  rc, log, signalled_at = _run_until(command, 5, signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM, log[-3000:]
  saved = _saved_after_signal(log, r'preempted \(SIGTERM\)')
  assert saved >= signalled_at
  assert os.listdir(tmp_path / 'checkpoints') == [str(saved)]
  assert 'grace period' not in log and 'Traceback' not in log, log[-3000:]  # Saved in time.
  assert _unfinished(tmp_path) == []  # The run.lock too.

  # Too short a grace period: the watchdog exits, the previous checkpoint stays intact.
  command[-1] = '--config.ckpt.preemption_grace_seconds=0.001'
  rc, log, _ = _run_until(command, saved + 2, signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM and 'grace period after SIGTERM ran out' in log
  assert f'Restored checkpoint {tmp_path}/checkpoints/{saved}' in log
  restored = checkpoint.Checkpointer(str(tmp_path), _config().ckpt).manager.all_steps()
  assert saved in restored


def _unfinished(workdir) -> list[str]:
  """What only an unfinished save or a live run leaves: orbax temporaries and the lock."""
  return sorted(glob.glob(f'{workdir}/checkpoints/*{checkpoint.TMP_MARK}*') +
                glob.glob(f'{workdir}/run.lock'))


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_the_resumed_run_equals_a_straight_one(straight, tmp_path,
                                                                         caplog):
  interrupted = tmp_path / 'interrupted'
  rc, log, signalled_at = _run_until(_command(interrupted, *_steps_flags(24, 0)), 6,
                                     signal.SIGINT)
  assert rc == 128 + signal.SIGINT, log[-3000:]
  assert 'KeyboardInterrupt' not in log and 'Traceback' not in log, log[-3000:]
  saved = _saved_after_signal(log, r'interrupted \(Ctrl-C\)')
  assert saved >= signalled_at
  assert os.listdir(interrupted / 'checkpoints') == [str(saved)]
  assert _unfinished(interrupted) == []
  _resume_here(interrupted, caplog, saved, 24, 0)
  assert leaves_equal(saved_state_field(f'{straight}/checkpoints/24'),
                       saved_state_field(f'{interrupted}/checkpoints/24'))


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_leaving_only_whole_checkpoints(tmp_path, caplog):
  """The second Ctrl-C is sent once the run has logged that it took the first (two sent
  together can reach Python's handler as one); a launch that finished saving and exited
  before the second could be sent proves nothing and is tried again."""
  command = _command(tmp_path, '--config.train.num_steps=100000', '--config.ckpt.every=2')
  for _ in range(3):
    shutil.rmtree(tmp_path / 'checkpoints', ignore_errors=True)
    process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, second_sent = [], False
    for line in process.stderr:
      lines.append(line)
      if re.search(r'\] step 7: loss', line):  # Saves of steps 2, 4, 6 started; 8 is next.
        process.send_signal(signal.SIGINT)
      elif 'Ctrl-C (SIGINT) received during' in line:
        if process.poll() is None:
          process.send_signal(signal.SIGINT)
          second_sent = True
        break
    lines += process.stderr.readlines()
    log = ''.join(lines)
    rc = process.wait(timeout=600)
    if second_sent:
      break
  assert second_sent, log[-3000:]
  assert rc == 128 + signal.SIGINT, log[-3000:]
  assert re.search(r'Second Ctrl-C during [^:]+: exiting without saving', log), log[-3000:]
  assert 'Traceback' not in log, log[-3000:]
  assert _unfinished(tmp_path) == []
  # Every checkpoint left is whole: the latest restores, and training resumes from it.
  latest = max(int(name) for name in os.listdir(tmp_path / 'checkpoints'))
  saved_state_field(f'{tmp_path}/checkpoints/{latest}')
  _resume_here(tmp_path, caplog, latest, latest + 2, 2)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_a_disk_with_room_resumes_it(straight, tmp_path, caplog):
  """A real full disk: a roomy tmpfs, filled to the last byte once the first checkpoint is
  whole. The run is paused (SIGSTOP) at each step it logs until then, so it cannot run past
  the next save before the disk is full; what orbax writes on the way does not matter."""
  disk = tmp_path / 'disk'
  if not chaos.mount_tmpfs(str(disk), '256m'):
    pytest.skip('mounting a tmpfs is not allowed here (not root?)')
  try:
    workdir = disk / 'run'
    process = subprocess.Popen(_command(workdir, *_steps_flags(*STRAIGHT)), cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    lines, filled = [], False
    for line in process.stderr:
      lines.append(line)
      if not filled and re.search(r'\] step \d+: loss', line):
        process.send_signal(signal.SIGSTOP)
        if os.path.isdir(workdir / 'checkpoints' / '3'):  # Orbax renames a save when whole.
          chaos.fill_disk(str(disk))
          filled = True
        process.send_signal(signal.SIGCONT)
    rc, log = process.wait(timeout=600), ''.join(lines)
    assert filled, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith('error: ')]
    assert rc == 1 and len(errors) == 1, log[-3000:]
    assert 'Traceback' not in log and 'Event loop is closed' not in log, log[-3000:]
    failed = int(re.search(r'saving checkpoint (\d+) in ', errors[0]).group(1))
    assert failed >= 6, errors[0]  # The first checkpoint was whole before the disk filled.
    assert f'in {workdir}/checkpoints failed: the disk is full' in errors[0], errors[0]
    assert f'newest intact one is step {failed - 3}' in errors[0], errors[0]
    last_step = max(int(step) for step in re.findall(r'\] step (\d+): loss', log))
    # Found by the per-step check once the background write failed, at the latest by the next
    # save, which waits for it: never trained on to the end.
    assert last_step <= failed + 3 < 24, (failed, last_step)
    # Every save before the failed one is intact (keep=20 keeps them all); nothing else is left.
    assert sorted(os.listdir(workdir / 'checkpoints'), key=int) == [
        str(step) for step in range(3, failed, 3)]
    assert _unfinished(workdir) == []
    os.remove(disk / chaos.FILLER)
    _resume_here(workdir, caplog, failed - 3, *STRAIGHT)
    assert leaves_equal(saved_state_field(f'{straight}/checkpoints/24'),
                         saved_state_field(f'{workdir}/checkpoints/24'))
  finally:
    subprocess.run(['umount', str(disk)], check=False)


@pytest.mark.slow
def test_chaos_kills_sigterm_ctrl_c_a_full_disk_and_a_move_then_resume_agree_with_a_straight_run(
    tmp_path):
  seed = int(os.environ.get('T2T_CHAOS_SEED') or random.randrange(2**31))
  print(f'chaos seed {seed}: replay with T2T_CHAOS_SEED={seed} (this test) or '
        f'`python tests/chaos.py --kills=4 --seed={seed}`')  # pytest shows it on failure.
  result = chaos.run(kills=4, seed=seed, root=str(tmp_path))
  assert result['ok'], (f'seed {seed}', result['problems'], result['launches'])
  launches = result['launches']
  kinds = [launch['kind'] for launch in launches]
  expected = ['vocab', 'cache', 'step', 'save', 'sigterm', 'sigint', None] + (
      ['diskfull'] if result['disk_full'] is True else [])
  assert sorted(kinds, key=str) == sorted(expected, key=str)
  assert launches[-1]['left_behind'] == []  # No run.lock after a clean exit either.
  # The later signal's launch ran on 4 devices and saved; it and the next, back on 8, said so,
  # no launch before it did (chaos.run checks each launch against the checkpoint it resumed).
  move = result['move']
  assert kinds[move['launch'] - 1] == max(('sigterm', 'sigint'), key=kinds.index)
  assert move['from_step'] >= 1 and move['saved'], move
  said = [launch['said_moved'] for launch in launches]
  assert said[:move['launch'] + 1] == [False] * (move['launch'] - 1) + [True, True], said
  # The steps taken there reach the end: the parameters differ from the straight run's, inside
  # the bound; the losses by less than chaos.LOSS_RTOL.
  assert 0 < move['share_of_bound'] <= 1 and move['loss_change'] <= chaos.LOSS_RTOL, move
