"""The moving average of the weights (config.opt.ema_decay): its arithmetic, that it leaves
training and checkpoints without it untouched, exact resume, and reading it back. Its config
check is in test_config_check.py."""

import logging as std_logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, leaves_equal, saved_state_field
from t2t_jax import CheckpointError
from t2t_jax import export
from t2t_jax import sharding
from t2t_jax.checkpoints import checkpoint
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import trained_run
from t2t_jax.training import train

OLD_CHECKPOINT = os.path.join(ROOT, 'tests', 'fixtures', 'before_restructure', 'checkpoints')


def _config(ema_decay=0.0):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.opt.ema_decay = ema_decay
  return config


def _numpy(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def _state_fields(step_dir) -> set:
  return set(saved_params.saved_metadata(os.path.join(step_dir, 'state')))


def test_ema_is_the_closed_form_over_the_params_and_leaves_training_unchanged(tmp_path):
  """Four steps with decay d and without: the same params bit for bit; the average equals
  d^n p_0 + (1 - d) sum_k d^(n-k) p_k over the params recorded after each step."""
  decay, steps = 0.8, 4
  states, setups = {}, {}
  for d in (0.0, decay):
    config = _config(d)
    config.opt.schedule, config.opt.lr_scale = 'constant', 1e-2
    setups[d] = train.build(config, pipeline.vocab_size(config))
    states[d] = setups[d].init(jax.random.PRNGKey(0))
  assert states[0.0].ema is None
  ema = states[decay].ema
  assert all(e.dtype == np.float32 and e.sharding == p.sharding for e, p in zip(
      jax.tree.leaves(ema), jax.tree.leaves(states[decay].params), strict=True))
  task = pipeline.load(_config(), '')
  batches = pipeline.TokenBudgetBatches(task.train, 256, [16], sharding.batch_shards(
      setups[0.0].mesh), shuffle=True, seed=0)
  iterator = pipeline.train_iterator(batches)
  recorded = [_numpy(states[decay].params)]
  for _ in range(steps):
    batch = next(iterator)
    for d, setup in setups.items():
      states[d], _ = setup.train_step(states[d], sharding.global_batch(batch, setup.mesh),
                                      jax.random.PRNGKey(1))
    recorded.append(_numpy(states[decay].params))
  assert leaves_equal(states[0.0].params, states[decay].params)
  assert states[0.0].ema is None
  expected = jax.tree.map(lambda p: decay**steps * p, recorded[0])
  for k in range(1, steps + 1):
    expected = jax.tree.map(lambda e, p: e + (1 - decay) * decay**(steps - k) * p, expected,
                            recorded[k])
  for got, want, last in zip(jax.tree.leaves(_numpy(states[decay].ema)),
                             jax.tree.leaves(expected), jax.tree.leaves(recorded[-1])):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert max(np.abs(got - last).max() for got, last in zip(
      jax.tree.leaves(_numpy(states[decay].ema)), jax.tree.leaves(recorded[-1]))) > 1e-4

  # Saved: without the average the state item holds the fields it held before the average
  # existed (as the checkpoint in tests/fixtures, written then, does); with it, 'ema' too.
  for d, name in ((0.0, 'plain'), (decay, 'ema')):
    saver = checkpoint.Checkpointer(str(tmp_path / name), _config(d).ckpt)
    saver.save(steps, states[d], jax.random.PRNGKey(0), {}, '{}')
    saver.close()
  before = _state_fields(os.path.join(OLD_CHECKPOINT, '10'))
  assert _state_fields(tmp_path / 'plain' / 'checkpoints' / str(steps)) == before
  assert _state_fields(tmp_path / 'ema' / 'checkpoints' / str(steps)) == before | {'ema'}
  assert leaves_equal(saved_state_field(tmp_path / 'ema' / 'checkpoints' / str(steps), 'ema'),
                        states[decay].ema)


@pytest.fixture(scope='module')
def ema_run(tmp_path_factory):
  """A tiny run with decay 0.5 to step 6, checkpoints at 3 and 6: (workdir, config, figures)."""
  workdir = str(tmp_path_factory.mktemp('ema_run'))
  config = _config(0.5)
  config.train.num_steps, config.ckpt.every, config.train.eval_every = 6, 3, 1000
  config.eval.bleu_sentences = 4
  return workdir, config, train.train_and_evaluate(config, workdir)


def test_training_evaluates_the_average_beside_the_params(ema_run):
  _, _, results = ema_run
  for name in ('eval_loss', 'eval_accuracy', 'bleu'):
    assert np.isfinite(results[name]) and np.isfinite(results[f'ema_{name}'])
  assert results['ema_eval_loss'] != results['eval_loss']


def test_resume_gives_the_average_and_params_of_an_uninterrupted_run(ema_run, tmp_path):
  workdir, config, _ = ema_run
  resumed = tmp_path / 'resumed'
  shutil.copytree(os.path.join(workdir, 'checkpoints', '3'), resumed / 'checkpoints' / '3')
  assert train.train_and_evaluate(config, str(resumed))['step'] == 6  # From step 3.
  assert sorted(os.listdir(resumed / 'checkpoints')) == ['3', '6']
  straight, again = (os.path.join(w, 'checkpoints', '6') for w in (workdir, resumed))
  for name in ('params', 'ema', 'opt_state'):
    assert leaves_equal(saved_state_field(straight, name), saved_state_field(again, name)), name
  # Turning the average off on resume would drop it: refused, naming the key.
  with pytest.raises(CheckpointError, match=r'opt\.ema_decay: 0\.5 -> 0\.0'):
    train.train_and_evaluate(_config(0.0), str(resumed))


@pytest.mark.parametrize('split', [False, True], ids=['whole', 'shard_update'])
def test_resuming_a_checkpoint_without_an_average_starts_it_from_the_params(tmp_path, caplog,
                                                                            split):
  """With mesh.shard_update on the tiny config's 8-way data axis the average starts split
  over it, as the step keeps it, and is evaluated in the params' layout."""
  caplog.set_level(std_logging.INFO)
  workdir = tmp_path / 'run'
  shutil.copytree(OLD_CHECKPOINT, workdir / 'checkpoints')  # Step 10, written without one.
  config = _config(0.75)
  config.train.num_steps, config.eval.bleu_sentences = 11, 0
  config.mesh.shard_update = split
  results = train.train_and_evaluate(config, str(workdir))
  assert np.isfinite(results['ema_eval_loss'])
  assert 'holds no moving average of the weights (written with opt.ema_decay=0): starting it ' \
         'from the restored params' in caplog.text
  before = _numpy(saved_state_field(workdir / 'checkpoints' / '10', 'params'))
  after = _numpy(saved_state_field(workdir / 'checkpoints' / '11', 'params'))
  expected = jax.tree.map(lambda p, q: 0.75 * p + 0.25 * q, before, after)
  for got, want in zip(jax.tree.leaves(saved_state_field(workdir / 'checkpoints' / '11', 'ema')),
                       jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_translate_and_export_read_the_average_when_asked(ema_run, tmp_path):
  workdir, config, _ = ema_run
  step_dir = os.path.join(workdir, 'checkpoints', '6')
  raw, ema = (trained_run.load(workdir, weights=w) for w in ('params', 'ema'))
  assert leaves_equal(ema.params, saved_state_field(step_dir, 'ema'))
  assert leaves_equal(raw.params, saved_state_field(step_dir, 'params'))
  assert not leaves_equal(raw.params, ema.params)
  inputs = pipeline.load(config, '').eval.inputs[:8]
  mesh = sharding.make_mesh(config.mesh)  # A translator of its own, fed numpy weights.
  direct = translator_lib.from_config(config, ema.model_config, mesh, sharding.rules(
      config.mesh)).translate(saved_state_field(step_dir, 'ema'), inputs)
  assert [list(o) for o in ema.translator.translate(ema.params, inputs)] == [
      list(o) for o in direct]
  exported = export.export(workdir, '6', output=str(tmp_path / 'ema_export'), weights='ema')
  assert leaves_equal(saved_params.load_params(exported), saved_state_field(step_dir, 'ema'))
  with pytest.raises(CheckpointError, match='params-only checkpoint'):
    saved_params.load_params(exported, weights='ema')
  with pytest.raises(CheckpointError, match=r'no moving average.*ema_decay=0'):
    saved_params.load_params(os.path.join(OLD_CHECKPOINT, '10'), weights='ema')


@pytest.mark.slow
def test_cli_trains_with_an_average_then_translates_and_scores_with_it(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  run = lambda *args: subprocess.run([sys.executable, '-m', *args], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=300)
  workdir = str(tmp_path / 'run')
  trained = run('t2t_jax.main', '--config=configs/tiny.py', f'--workdir={workdir}',
                '--config.train.num_steps=4', '--config.ckpt.every=4',
                '--config.opt.ema_decay=0.5', '--config.eval.bleu_sentences=4')
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert '"ema_eval_loss"' in trained.stderr and '"ema_bleu"' in trained.stderr
  (tmp_path / 'src.txt').write_text('3 1 4\n1 5 2 6\n')
  # --weights=ema only: the params, the flag's default, are what every other translate reads.
  translated = run('t2t_jax.translate', f'--workdir={workdir}', '--weights=ema',
                   f'--input={tmp_path / "src.txt"}')
  assert translated.returncode == 0, translated.stderr[-3000:]
  expected = trained_run.translate_lines(trained_run.load(workdir, weights='ema'),
                                       ['3 1 4', '1 5 2 6'])[0]
  assert translated.stdout.splitlines() == expected
  scored = run('t2t_jax.evaluate', f'--workdir={workdir}', '--weights=ema',
               f'--src={tmp_path / "src.txt"}', f'--ref={tmp_path / "src.txt"}')
  assert scored.returncode == 0 and 'moving average of the weights' in scored.stdout, (
      scored.stderr[-3000:])
  exported = run('t2t_jax.export', f'--workdir={workdir}', '--weights=ema')
  assert exported.returncode == 0 and exported.stdout.strip().endswith('4_ema_float32')
