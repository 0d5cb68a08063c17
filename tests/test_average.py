"""Checkpoint averaging and export on a small saved checkpoint, without training (the end-to-end
runs through their command lines are in test_checkpoint.py)."""

import os
import shutil

from absl import app
import jax
import numpy as np
import pytest

from conftest import ROOT
from t2t_jax import average
from t2t_jax import export
from t2t_jax.checkpoints import checkpoint
from t2t_jax.checkpoints import saved_params

FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'before_restructure', 'checkpoints')


@pytest.fixture
def workdir(tmp_path):
  """A workdir holding checkpoint 10 (trained) and 20 (its parameters times 3, params only)."""
  shutil.copytree(FIXTURE, tmp_path / 'checkpoints')
  params = saved_params.load_params(str(tmp_path / 'checkpoints' / '10'))
  config_json = saved_params.read_json_item(str(tmp_path / 'checkpoints' / '10'),
                                          checkpoint.CONFIG)['config']
  saved_params.write_params(str(tmp_path / 'checkpoints' / '20'),
                          jax.tree.map(lambda x: np.asarray(x) * 3, params), config_json,
                          {'kind': 'test'})
  return str(tmp_path), jax.device_get(params)


def test_average_of_two_checkpoints_is_their_mean(workdir):
  workdir, params = workdir
  assert average.available_steps(workdir) == [10, 20]
  assert average.choose_steps([10, 20], 2, []) == [10, 20]
  assert average.choose_steps([10, 20], 0, ['20', '10', '20']) == [10, 20]
  written = average.average_checkpoints(workdir, [10, 20])
  assert written == os.path.join(workdir, 'averaged', 'avg2_10-20')
  averaged = jax.device_get(saved_params.load_params(written))
  assert jax.tree.structure(averaged) == jax.tree.structure(params)
  jax.tree.map(lambda a, p: np.testing.assert_allclose(a, 2 * p, rtol=1e-6), averaged, params)


@pytest.mark.parametrize('last, steps, error, message', [
    (0, [], app.UsageError, 'exactly one of --last=N and --steps'),
    (2, ['10'], app.UsageError, 'exactly one of --last=N and --steps'),
    (3, [], checkpoint.CheckpointError, r'--last=3, but the workdir holds 2'),
    (0, ['ten'], app.UsageError, '--steps must be integers'),
    (0, ['10', '15'], checkpoint.CheckpointError, r'no checkpoint of steps \[15\]'),
])
def test_choosing_steps_names_what_is_wrong(last, steps, error, message):
  with pytest.raises(error, match=message):
    average.choose_steps([10, 20], last, steps)


def test_a_directory_without_checkpoints_is_named(tmp_path):
  with pytest.raises(checkpoint.CheckpointError, match='does not exist: is --workdir'):
    average.available_steps(str(tmp_path))


def test_export_casts_every_parameter_and_keeps_the_values(workdir):
  workdir, params = workdir
  written = export.export(workdir, '10', 'bfloat16')
  assert written == os.path.join(workdir, 'export', '10_bfloat16')
  exported = jax.device_get(saved_params.load_params(written))
  assert {np.asarray(x).dtype.name for x in jax.tree.leaves(exported)} == {'bfloat16'}
  jax.tree.map(lambda e, p: np.testing.assert_array_equal(
      np.asarray(e, np.float32), np.asarray(p).astype(jax.numpy.bfloat16).astype(np.float32)),
               exported, params)
