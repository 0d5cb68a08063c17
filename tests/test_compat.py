"""Checkpoints written before the modules were split by concept still load and mean the same.

tests/fixtures/before_restructure holds what the code before the split wrote (commit 0d732d6):
a tiny training checkpoint at step 10, the logits and greedy output its params gave on a fixed
batch, and the parameter paths, shapes and dtypes of nine family members.
"""

import dataclasses
import json
import logging as std_logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline
from t2t_jax.decoding import decode
from t2t_jax.model.decoder_only import make_model
from t2t_jax.training import build as setup_lib
from t2t_jax.training import train

FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'before_restructure')
MANIFEST = json.load(open(os.path.join(FIXTURE, 'param_manifest.json')))


def _config(overrides):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config('moe' if overrides.get('moe') else '')
  for key, value in overrides.items():
    if key != 'moe':
      section, name = key.split('.')
      setattr(config[section], name, value)
  return config


@pytest.mark.parametrize('member', sorted(MANIFEST))
def test_parameter_paths_shapes_and_dtypes_are_unchanged(member):
  config = _config(MANIFEST[member]['overrides'])
  abstract = setup_lib.build(config, pipeline.vocab_size(config)).abstract_state.params
  now = {jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
         for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  assert now == MANIFEST[member]['params']


def _fixture_params():
  config = _config({})
  setup = setup_lib.build(config, pipeline.vocab_size(config))
  path = os.path.join(FIXTURE, 'checkpoints', '10')
  return setup, jax.device_get(saved_params.load_params(path, setup.abstract_state.params))


def test_old_checkpoint_gives_the_logits_and_translations_it_gave_before():
  setup, params = _fixture_params()
  expected = np.load(os.path.join(FIXTURE, 'expected.npz'))
  model = make_model(dataclasses.replace(setup.model_config, deterministic=True))
  logits = model.apply({'params': params}, expected['inputs'], expected['targets'])
  np.testing.assert_allclose(logits, expected['logits'], rtol=1e-5, atol=1e-5)
  greedy = decode.greedy_search(params, jnp.asarray(expected['inputs']), setup.model_config, 12)
  np.testing.assert_array_equal(greedy, expected['greedy'])


@pytest.mark.slow
def test_training_resumes_from_an_old_checkpoint(tmp_path, caplog):
  caplog.set_level(std_logging.INFO)
  workdir = tmp_path / 'run'
  shutil.copytree(os.path.join(FIXTURE, 'checkpoints'), workdir / 'checkpoints')
  config = _config({})
  config.train.num_steps = 12
  config.eval.bleu_sentences = 0
  results = train.train_and_evaluate(config, str(workdir))
  assert results['step'] == 12 and np.isfinite(results['eval_loss'])
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['10', '12']
  restored = [r.getMessage() for r in caplog.records if 'Restored checkpoint' in r.getMessage()]
  assert restored == [f'Restored checkpoint {workdir / "checkpoints" / "10"}']
  _, before = _fixture_params()
  after = saved_params.load_params(str(workdir / 'checkpoints' / '12'))
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       before, after)
  assert max(jax.tree.leaves(moved)) > 0  # Two more steps ran from the restored state.
