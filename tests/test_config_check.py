"""Config validation before any work: ranges, choices, vocabulary, model shape, mesh."""

import pytest

from t2t_jax import ConfigError
from t2t_jax.training import config_check


@pytest.mark.parametrize('key, value, message', [
    ('train.num_steps', 0, 'config.train.num_steps=0 is outside the allowed range [1, inf)'),
    ('train.num_steps', -5, 'config.train.num_steps=-5 is outside the allowed range [1, inf)'),
    ('train.eval_every', 0, 'config.train.eval_every=0 is outside'),
    ('ckpt.keep', 0, 'config.ckpt.keep=0 is outside the allowed range [1, inf)'),
    ('opt.lr_scale', -1e-3, 'config.opt.lr_scale=-0.001 is outside the allowed range [0.0, inf)'),
    ('opt.b2', 1.0, 'config.opt.b2=1.0 is outside the allowed range [0.0, 1.0)'),
    ('model.dropout', 1.5, 'config.model.dropout=1.5 is outside the allowed range [0.0, 1.0)'),
    ('opt.label_smoothing', -0.1, 'config.opt.label_smoothing=-0.1 is outside'),
    ('data.batch_tokens', 0, 'config.data.batch_tokens=0 is outside'),
    ('eval.beam_size', 0, 'config.eval.beam_size=0 is outside the allowed range [1, inf)'),
    ('eval.length_penalty', 'wu', "config.eval.length_penalty='wu' must be one of ('gnmt', "
     "'length')"),
    ('data.batching', 'pack', "config.data.batching='pack' must be one of ('buckets', 'packed')"),
    ('data.source', 'csv', "config.data.source='csv' must be one of"),
    ('data.vocab_type', 'word', "config.data.vocab_type='word' must be one of"),
    ('model.norm', 'mid', "config.model.norm must be 'post' or 'pre', got 'mid'"),
    ('model.remat', 'all', 'config.model.remat must be one of'),
    ('model.dtype', 'int8', "config.model.dtype='int8' must be"),
    ('model.attention_impl', 'triton', "config.model.attention_impl='triton' must be one of"),
    ('model.dropout_prng', 'mt', "config.model.dropout_prng='mt' must be one of"),
    ('opt.schedule', 'noam', 'config.opt.schedule must be'),
    ('opt.cooldown_steps', 10**9, 'config.opt.cooldown_steps=1000000000 must not exceed '
     'config.train.num_steps'),
    ('opt.cooldown_steps', -1, 'config.opt.cooldown_steps=-1 is outside'),
    ('opt.final_lr_fraction', 1.5, 'config.opt.final_lr_fraction=1.5 is outside'),
    ('opt.ema_decay', 1.0, 'config.opt.ema_decay=1.0 is outside the allowed range [0.0, 1.0)'),
    ('opt.ema_decay', -0.1, 'config.opt.ema_decay=-0.1 is outside the allowed range [0.0, 1.0)'),
    ('opt.ema_decay', float('nan'), 'config.opt.ema_decay=nan is outside'),
    ('model.num_heads', 3, 'config.model.d_model=32 is not divisible by config.model.num_heads=3'),
    ('mesh.shape', (3, -1, 1), 'config.mesh.shape=(3, -1, 1) needs a multiple of 3 devices, but '
     'there are 8'),
])
def test_each_violation_names_the_key_and_the_allowed_values(tiny_config, key, value, message):
  section, name = key.split('.')
  tiny_config[section][name] = value
  with pytest.raises(ConfigError) as error:
    config_check.check(tiny_config)
  assert message in str(error.value)


def test_vocabulary_must_exceed_the_reserved_ids_and_all_problems_are_listed(tiny_config):
  tiny_config.data.source = 'text'
  tiny_config.data.vocab_size = 3
  tiny_config.train.log_every = 0
  with pytest.raises(ConfigError) as error:
    config_check.check(tiny_config)
  assert 'config.data.vocab_size=3 must exceed the 3 reserved ids' in str(error.value)
  assert 'config.train.log_every=0' in str(error.value)


def test_mesh_false_leaves_out_only_the_device_check(tiny_config):
  """Every shipped config is checked in test_configs.py; here the `mesh` switch."""
  config_check.check(tiny_config)
  tiny_config.mesh.shape = (2, 2, 4)  # Twice the devices: only the data side is checked.
  config_check.check(tiny_config, mesh=False)
  with pytest.raises(ConfigError, match=r'needs a multiple of 16 devices, but there are 8'):
    config_check.check(tiny_config)
  tiny_config.train.num_steps = 0  # Everything else is still checked.
  with pytest.raises(ConfigError, match='config.train.num_steps=0'):
    config_check.check(tiny_config, mesh=False)


@pytest.mark.parametrize('steps, message', [
    ((5,), 'must be (first, last), two whole steps with 1 <= first <= last'),
    ((5, 6, 7), 'must be (first, last)'),
    ((0, 3), 'config.train.profile_steps=(0, 3) must be (first, last)'),
    ((6, 5), 'config.train.profile_steps=(6, 5) must be (first, last)'),
    ((2.5, 4), 'must be (first, last)'),
    (('',), "config.train.profile_steps=('',) must be"),  # --config.train.profile_steps=''
    ((5, 21), 'config.train.profile_steps=(5, 21) ends after config.train.num_steps=20'),
])
def test_profile_steps_are_a_window_of_the_run(tiny_config, steps, message):
  tiny_config.train.profile_steps = steps
  with pytest.raises(ConfigError) as error:
    config_check.check(tiny_config)
  assert message in str(error.value)
  assert str(error.value).count('config.train.profile_steps=(') == 1  # One problem, said once.


@pytest.mark.parametrize('steps', [(), (1, 1), (3, 20)])
def test_profile_steps_off_or_inside_the_run_pass(tiny_config, steps):
  tiny_config.train.profile_steps = steps
  config_check.check(tiny_config)
