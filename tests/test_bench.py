"""bench/: compare.py end to end on a tiny shape against the reference (if it is here), the
helpers it shares, and its flags."""

import importlib.util
import json
import math
import os

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT

REFERENCE_DIR = os.path.join(ROOT, '..', 'shared', 'anchor', 'flax_wmt')


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, 'bench', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.skipif(not os.path.isfile(os.path.join(REFERENCE_DIR, 'models.py')),
                    reason=f"Flax's WMT example (the reference) is not at {REFERENCE_DIR}")
def test_compare_runs_one_round_on_a_tiny_packed_shape(capsys):
  compare = _load('compare')
  [result] = compare.compare_shapes(compare.parse_flags([
      '--shapes=tiny_packed', '--rounds=1', '--steps=1', '--warmup=1',
      f'--reference_dir={REFERENCE_DIR}']))
  assert json.loads(capsys.readouterr().out.strip()) == result
  assert {'shape', 'vocab', 'd_model', 'rows', 'length', 'device_kind', 'device_count', 'dtype',
          'ratio_per_round', 'ratio_median', 'ratio_min', 'ratio_max',
          'matmul_flops_per_second', 't2t_jax', 'reference'} <= set(result)
  for ratio in result['ratio_per_round'] + [result['ratio_median']]:
    assert 0 < ratio < math.inf
  t2t, reference = result['t2t_jax'], result['reference']
  for side in (t2t, reference):
    assert {'step_seconds', 'tokens_per_second', 'xla_flops_per_step', 'model_flops_per_step',
            'share_of_matmul', 'mfu', 'compile_seconds'} <= set(side)
    assert 0 < side['share_of_matmul'] < math.inf and side['mfu'] is None  # No CPU peak.
    # XLA counts the matmuls and the elementwise rest: more than the model FLOPs, not double.
    assert 1 < side['xla_flops_per_step'] / side['model_flops_per_step'] < 2
  # Equal work: the same parameters and model FLOPs on both sides.
  assert t2t['params'] == reference['params']
  assert t2t['model_flops_per_step'] == reference['model_flops_per_step']


def test_packing_cuts_rows_into_segments_with_restarting_positions():
  batch = _load('compare').make_batch(_load('common').SHAPES['m30k_packed'], rows=5, length=64)
  segments, positions = batch['inputs_segments'], batch['inputs_positions']
  assert (segments[:, 0] == 1).all() and (segments[:, -1] == 4).all()
  assert (segments[:, 1:] - segments[:, :-1] >= 0).all()
  starts = segments[:, 1:] != segments[:, :-1]
  assert (positions[:, 1:][starts] == 0).all()
  assert (positions[:, 1:][~starts] == positions[:, :-1][~starts] + 1).all()


def test_t2t_config_takes_the_recipe_dropout_and_overrides():
  compare, common = _load('compare'), _load('common')
  args = compare.parse_flags(['--recipe=m30k', '--t2t_override', 'model.norm=post',
                              '--t2t_override', 'opt.warmup_steps=100'])
  config = compare.shape_config(common.SHAPES['m30k'], args)
  assert (config.model.dropout, config.model.attention_dropout,
          config.model.relu_dropout) == (0.3, 0.0, 0.0)
  assert config.model.norm == 'post' and config.opt.warmup_steps == 100
  assert (config.model.d_model, config.model.num_encoder_layers) == (128, 4)
  with pytest.raises(ValueError, match='model.no_such_key'):
    common.apply_override(config, 'model.no_such_key=1')


def test_compare_flags_keep_their_names_and_defaults():
  compare = _load('compare')
  args = compare.parse_flags([])
  assert {name: args[name].value for name in args} == {
      'shapes': ['small', 'm30k', 'm30k_packed', 'base'], 'rows': 0, 'length': 0,
      'dtype': 'float32', 'dropout': 0.1, 'attention_dropout': 0.1, 'relu_dropout': 0.1,
      'recipe': 'none', 'norm': 'pre', 't2t_override': [], 'rounds': 5, 'steps': 3,
      'warmup': 2, 'reference_dir': '../shared/anchor/flax_wmt'}
  args = compare.parse_flags(['--shapes=tiny,m30k', '--rounds', '7', '--steps=2'])
  assert (args.shapes, args.rounds, args.steps) == (['tiny', 'm30k'], 7, 2)
  with pytest.raises(flags.IllegalFlagValueError, match='no_such_shape'):
    compare.parse_flags(['--shapes=small,no_such_shape'])


@pytest.mark.parametrize('rows, source_length, steps', [(4, 5, 3), (12, 7, 6)])
def test_matmul_floor_does_the_matrix_products_it_claims(rows, source_length, steps):
  """XLA's count of the loop body's FLOPs is the formula's, plus a little elementwise work."""
  floor, shape = _load('floor'), _load('common').Shape(96, 32, 80, 2, 4, 0, 0)
  loop, x = floor.decoder_matmul_loop(shape, rows, source_length, steps)
  counted = _load('common').xla_flops(loop.lower(x).compile())
  e, f, layers = 32, 80, 2
  by_hand = layers * (
      6 * 2 * rows * e * e + 2 * 2 * rows * e * f  # Projections and the feed-forward pair.
      + 2 * 2 * rows * e * (steps + source_length)) + 2 * rows * e * 96  # Attention; output.
  assert 1 <= counted / by_hand < 1.1
  assert loop(x).shape == (rows, e)


def test_op_profile_splits_matrix_products_from_other_ops():
  common = _load('common')
  a = jnp.ones((256, 256))
  matmuls = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda _, y: (y @ a) * 1e-3, a))
  elementwise = jax.jit(lambda a: jnp.tanh(jnp.exp(a * 0.5) + 1.0))
  for fn in (matmuls, elementwise):
    fn(a).block_until_ready()  # Compiled before the traced call.
  heavy = common.op_profile(lambda: matmuls(a).block_until_ready())
  light = common.op_profile(lambda: elementwise(a).block_until_ready())
  assert heavy['matmul_op_seconds'] > 0.5 * heavy['op_seconds'] > 0
  assert light['matmul_op_seconds'] == 0 < light['op_seconds']
  assert not any(kind.startswith(('dot', 'ynn_fusion')) for kind in light['top_op_kinds'])
  for profile in (heavy, light):
    assert profile['wall_seconds'] > 0 and len(profile['top_op_kinds']) <= 5

