"""Every shipped config, each of its variants and each point of every shipped sweep is valid:
config_check passes, the model builds for the configured mesh, and the variant did change what
it names (an unknown variant is refused)."""

import importlib
import math
import os
import sys

import jax
import pytest

from conftest import ROOT
from t2t_jax.data import pipeline
from t2t_jax.training import config_check
from t2t_jax.training import train

sys.path.insert(0, os.path.join(ROOT, 'launch'))
import sweep as sweep_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

_MULTI30K_MEMBERS = ('decoder_only', 'relative', 'rotary', 'alibi', 'learned', 'predictive',
                     'local_compressed', 'moe', 'speedrun')
# Each shipped config file and the variants its get_config documents ('' = no argument).
VARIANTS = {
    'base': [''],
    'default': [''],
    'text': [''],
    'tiny': ['', 'moe'],
    'wmt14_ende': ['', 'base', 'big'],
    'lm': ['', 'base', 'tiny'],
    'bert': ['', 'base', 'large', 'small', 'tiny', 'small,finetune', 'tiny,finetune',
             'small,electra', 'base,electra'],
    'backtranslation': ['', 'reverse', 'parallel', 'mix', 'mix_tagged', 'all'],
    # Each file set and each member once (with either file set); the test below checks all.
    'multi30k': ['', 'raw', 'decoder_only', 'raw_decoder_only', 'raw_relative', 'rotary',
                 'raw_alibi', 'tok_learned', 'predictive', 'tok_local_compressed', 'raw_moe',
                 'speedrun', 'raw_speedrun'],
}
# The config each shipped sweep is run on (the command in its docstring), and the overrides
# that command passes before the sweep's own.
SWEEP_BASES = {
    'tiny_grid': ('tiny', '', {}),
    # Labels as the run reads them from SST-2's training file (a test reads no shared data).
    'bert_seeds': ('bert', 'small,finetune', {'data.labels': ('0', '1')}),
    'wmt14_ende_big': ('wmt14_ende', 'big', {}),
    'multi30k_schedule': ('multi30k', 'speedrun', {'train.num_steps': 1200,
                                                   'train.eval_every': 1200,
                                                   'model.dropout': 0.3,
                                                   'model.positions': 'sinusoidal'}),
    'multi30k_budget': ('multi30k', 'speedrun', {'opt.lr_scale': 2.0, 'opt.cooldown_steps': 400,
                                                 'train.num_steps': 1200,
                                                 'train.eval_every': 1200,
                                                 'model.dropout': 0.3,
                                                 'model.positions': 'sinusoidal'}),
    'multi30k_family': ('multi30k', 'speedrun', {'train.num_steps': 2300,
                                                 'opt.cooldown_steps': 767,
                                                 'train.eval_every': 2300, 'ckpt.keep': 10}),
}


def _load(name, variant):
  module = importlib.import_module(f'configs.{name}')
  config = module.get_config(variant) if variant else module.get_config()
  if variant.endswith('finetune'):  # The run reads its labels from its training file.
    config.data.labels = ('0', '1')
    config.model.num_labels = 2
  return config


def _override(config, overrides):
  for key, value in overrides.items():
    *sections, name = key.split('.')  # 'opt.lr_scale', or a top-level key such as 'seed'.
    parent = config
    for section in sections:
      parent = parent[section]
    assert name in parent, f'sweep key {key} is not a config key'
    parent[name] = value  # ConfigDict refuses a value of another type.
  return config


def _lookup(config, key):
  for part in key.split('.'):
    config = config[part]
  return config


def _assert_valid_and_builds(config):
  config_check.check(config)  # Against the 8 test devices, the mesh too.
  setup = train.build(config, pipeline.vocab_size(config))  # Abstract init, sharded: no FLOPs.
  params = jax.tree.leaves(setup.abstract_state.params)
  assert params and all(p.sharding is not None for p in params)
  return setup


def test_every_config_file_is_listed():
  shipped = {f[:-3] for f in os.listdir(os.path.join(ROOT, 'configs'))
             if f.endswith('.py') and f != '__init__.py'}
  assert shipped == set(VARIANTS)
  sweeps = {f[:-3] for f in os.listdir(os.path.join(ROOT, 'configs', 'sweeps'))
            if f.endswith('.py') and f != '__init__.py'}
  assert sweeps == set(SWEEP_BASES)


@pytest.mark.parametrize('name, variant',
                         [(name, variant) for name, variants in VARIANTS.items()
                          for variant in variants])
def test_each_shipped_config_and_variant_is_valid_and_builds(name, variant):
  config = _load(name, variant)
  setup = _assert_valid_and_builds(config)
  model = setup.model_config
  # The variant is what its name says: checked on the built model, not on the config keys.
  if name == 'wmt14_ende':
    assert (model.d_model, model.num_heads) == ((1024, 16) if variant == 'big' else (512, 8))
  if (name, variant) == ('wmt14_ende', 'big'):  # The abstract state (jax.eval_shape): no compile.
    params = sum(math.prod(p.shape) for p in jax.tree.leaves(setup.abstract_state.params))
    assert 200e6 < params < 220e6  # Transformer big with its 37000-token shared vocabulary.
  if name == 'tiny':
    assert model.moe_experts == (4 if variant == 'moe' else 0)
  if name == 'bert':
    size = variant.partition(',')[0] or 'small'
    assert model.kind == 'encoder_only'
    assert (model.num_encoder_layers, model.d_model) == {
        'base': (12, 768), 'large': (24, 1024), 'small': (4, 256), 'tiny': (2, 32)}[size]
    mode = variant.partition(',')[2]
    assert model.head == {'finetune': 'classification', 'electra': 'electra'}.get(mode, 'mlm')
    if mode == 'electra':  # A quarter of the discriminator's depth.
      assert model.generator_layers == {'base': 3, 'small': 1}[size]
  if name == 'backtranslation':
    data = config.data
    reverse, mixed = variant == 'reverse', variant.startswith('mix')
    assert (data.train_src, data.train_tgt) == (
        ('parallel.de', 'parallel.en') if reverse else
        ('train.en', 'train.de') if variant == 'all' else ('parallel.en', 'parallel.de'))
    assert data.eval_src == ('valid.de' if reverse else 'valid.en')
    assert (data.extra_src, data.extra_tgt) == (
        ('synthetic.en', 'synthetic.de') if mixed else ('', ''))
    assert data.extra_tag == ('<BT>' if variant == 'mix_tagged' else '')
    assert (config.train.num_steps, model.positions) == (9200, 'rotary')  # :speedrun's recipe.
  if name == 'lm':
    assert model.kind == 'decoder_only' and config.data.source == 'lm'
    assert model.d_model == (32 if variant == 'tiny' else 128)
  if name == 'multi30k':
    expected = {'decoder_only': ('decoder_only', 'sinusoidal', 'full', 0),
                'relative': ('encoder_decoder', 'relative', 'full', 0),
                'rotary': ('encoder_decoder', 'rotary', 'full', 0),
                'alibi': ('encoder_decoder', 'alibi', 'full', 0),
                'learned': ('encoder_decoder', 'learned', 'full', 0),
                'predictive': ('encoder_decoder', 'predictive', 'full', 0),
                'local_compressed': ('encoder_decoder', 'sinusoidal', 'local,compressed', 0),
                'moe': ('encoder_decoder', 'sinusoidal', 'full', 4),
                'speedrun': ('encoder_decoder', 'rotary', 'full', 0)}
    member = next((m for m in expected if variant.endswith(m)), None)
    assert (model.kind, model.positions, model.attention_pattern, model.moe_experts) == (
        expected.get(member, ('encoder_decoder', 'sinusoidal', 'full', 0)))
    assert config.data.train_src.startswith('train' if variant.startswith('raw') else 'tok/')
    assert (config.train.num_steps == 9200) == variant.endswith('speedrun')


def test_every_multi30k_combination_passes_the_checks_and_is_named_by_it():
  for files in ('', 'tok', 'raw'):
    for member in ('',) + _MULTI30K_MEMBERS:
      variant = '_'.join(part for part in (files, member) if part)
      config = _load('multi30k', variant)
      config_check.check(config, mesh=False)
      assert config.name == '_'.join(part for part in ('multi30k', files or 'tok', member)
                                     if part)


@pytest.mark.parametrize('name, variant', [('tiny', 'dense'), ('wmt14_ende', 'huge'),
                                           ('lm', 'small'), ('multi30k', 'cased'),
                                           ('multi30k', 'tok_sparse'), ('backtranslation', 'both')])
def test_an_unknown_variant_is_refused_naming_it(name, variant):
  with pytest.raises(ValueError, match=f'configs/{name}.py.*{variant}'):
    _load(name, variant)


@pytest.mark.parametrize('sweep_name', sorted(SWEEP_BASES))
def test_every_point_of_each_shipped_sweep_is_a_valid_config(sweep_name):
  name, variant, base_overrides = SWEEP_BASES[sweep_name]
  path = os.path.join(ROOT, 'configs', 'sweeps', f'{sweep_name}.py')
  points = sweep_lib.expand(sweep_lib.load_sweep(path), path)
  assert len(points) > 1
  seen = set()
  for point in points:
    config = _override(_override(_load(name, variant), base_overrides), point)
    config_check.check(config)
    for key, value in point.items():  # The point's values are the ones in force.
      assert _lookup(config, key) == value
    seen.add(tuple(sorted(point.items())))
    if sweep_name == 'multi30k_family':  # Each point another member: each one builds.
      _assert_valid_and_builds(config)
  assert len(seen) == len(points)  # No two points are the same run.
  # One build per sweep otherwise: the points change no shape (multi30k_budget's vocabulary
  # changes only the embedding's size).
  _assert_valid_and_builds(config)
