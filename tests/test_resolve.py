"""t2t_jax/training/resolve.py: one step checks a config and derives its values for the devices; config.json
records asked and resolved; a resume that resolves differently says so, and refuses a numeric
change the user did not ask for; nothing opens a device before training."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import pytest

from conftest import ROOT, text_config
from t2t_jax import as_asked
from t2t_jax import ConfigError
from t2t_jax.compile import targets
from t2t_jax.data import batching
from t2t_jax.decoding import translator
from t2t_jax.model import model_config as model_config_lib
from t2t_jax.training import resolve
from t2t_jax.training import train


def test_auto_settings_resolve_to_float32_on_the_cpus(tiny_config):
  tiny_config.model.dtype = 'auto'
  tiny_config.opt.grad_accum_steps = 2
  tiny_config.mesh.shape = (-1, 2, 1)
  resolved = resolve.resolve(tiny_config, jax.devices()[:8])
  # 8 devices, fsdp 2 given: the data axis takes the other 4; the batch splits over data and
  # fsdp (8 ways), each micro-batch of 2 too.
  assert resolved.as_dict() == {
      'platform': 'cpu', 'devices': 8, 'processes': 1, 'model.dtype': 'float32',
      'model.attention_impl': 'einsum', 'eval.dtype': 'float32', 'mesh.shape': [4, 2, 1, 1],
      'batch_shards': 8, 'data.row_multiple': 16}


def test_auto_settings_resolve_to_bfloat16_for_a_tpu_target_without_opening_it(tiny_config):
  tiny_config.model.dtype = 'auto'
  devices = targets.devices(targets.parse('tpu:v5e-8'))
  resolved = resolve.resolve(tiny_config, devices)
  assert (resolved.platform, resolved.devices, resolved.model_dtype, resolved.eval_dtype) == (
      'tpu', 8, 'bfloat16', 'bfloat16')
  tiny_config.eval.dtype = 'model'
  tiny_config.model.dtype = 'float32'
  assert resolve.resolve(tiny_config, devices).eval_dtype == 'float32'  # The model's dtype.


def test_resolve_runs_every_check_and_names_each_problem(tiny_config):
  tiny_config.ckpt.keep = 2
  tiny_config.eval.average_last = 3
  tiny_config.mesh.shape = (3, 1, 1)
  with pytest.raises(ConfigError) as raised:
    resolve.resolve(tiny_config, jax.devices()[:8])
  assert 'config.ckpt.keep=2 must be at least config.eval.average_last=3' in str(raised.value)
  assert 'config.mesh.shape=(3, 1, 1) needs a multiple of 3 devices' in str(raised.value)


def _saved(config, **resolved_changes) -> str:
  resolved = dataclasses.replace(resolve.resolve(config, jax.devices()[:8]), **resolved_changes)
  return resolve.config_json(config, resolved)


def test_config_json_holds_what_was_asked_and_what_it_resolved_to(tiny_config):
  tiny_config.model.dtype = 'auto'
  saved = json.loads(_saved(tiny_config))
  assert saved['model']['dtype'] == 'auto' and saved['eval']['dtype'] == 'auto'
  assert saved['resolved']['model.dtype'] == 'float32'
  assert saved['resolved']['eval.dtype'] == 'float32'


def test_a_resume_that_would_change_the_numerics_unasked_is_refused(tiny_config):
  tiny_config.model.dtype = 'auto'
  saved = _saved(tiny_config)
  # The same config on a GPU: 'auto' now means bfloat16.
  on_gpu = dataclasses.replace(resolve.resolve(tiny_config, jax.devices()[:8]), platform='gpu',
                               model_dtype='bfloat16', eval_dtype='bfloat16')
  with pytest.raises(ConfigError) as raised:
    resolve.check_resume(saved, tiny_config, on_gpu, 'checkpoints/20')
  message = str(raised.value)
  assert ("config.model.dtype='auto' resolved to 'float32' on cpu when checkpoints/20 was "
          "saved and resolves to 'bfloat16' on gpu here") in message
  assert '--config.model.dtype=float32 to resume as saved' in message
  assert '--config.eval.dtype=bfloat16 to change it' in message and '\n' not in message


def test_a_resume_the_user_overrode_or_that_only_moved_says_so_in_one_line(tiny_config, caplog):
  tiny_config.model.dtype = 'auto'
  saved = _saved(tiny_config)
  tiny_config.model.dtype = 'bfloat16'  # The user asks for the change.
  tiny_config.eval.dtype = 'bfloat16'
  on_gpu = dataclasses.replace(resolve.resolve(tiny_config, jax.devices()[:8]), platform='gpu')
  with caplog.at_level(logging.WARNING):
    resolve.check_resume(saved, tiny_config, on_gpu, 'checkpoints/20')
  said = [r.getMessage() for r in caplog.records if 'resolved for other devices' in
          r.getMessage()]
  assert len(said) == 1 and "platform: 'cpu' -> 'gpu'" in said[0]
  assert "model.dtype: 'float32' -> 'bfloat16'" in said[0]
  caplog.clear()
  tiny_config.model.dtype = 'auto'
  tiny_config.eval.dtype = 'auto'
  same = resolve.resolve(tiny_config, jax.devices()[:8])
  resolve.check_resume(saved, tiny_config, same, 'checkpoints/20')  # Nothing changed: silent.
  old = json.dumps(as_asked(json.loads(saved)))  # Saved before "resolved" existed.
  resolve.check_resume(old, tiny_config, on_gpu, 'checkpoints/20')
  assert not caplog.records


@pytest.mark.slow
def test_training_refuses_to_resume_where_auto_would_resolve_otherwise(tiny_run, tmp_path,
                                                                       monkeypatch, caplog):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  workdir = str(shutil.copytree(tiny_run[0], tmp_path / 'run'))
  saved = json.load(open(os.path.join(workdir, 'config.json')))
  assert saved['eval']['dtype'] == 'auto' and saved['resolved']['eval.dtype'] == 'float32'
  real = resolve.resolve

  def as_on_a_gpu(config, devices=None):  # What a GPU host resolves 'auto' to.
    return dataclasses.replace(real(config, devices), platform='gpu',
                               eval_dtype=translator.eval_dtype(
                                   config.eval.dtype, 'float32', 'gpu'))
  monkeypatch.setattr(train.resolve, 'resolve', as_on_a_gpu)
  config = tiny.get_config()
  config.train.num_steps = 22
  with pytest.raises(ConfigError, match=r"config.eval.dtype='auto' resolved to 'float32' on cpu"):
    train.train_and_evaluate(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['10', '20']
  config.eval.dtype = 'bfloat16'  # Asked: the run goes on, and says what moved.
  with caplog.at_level(logging.WARNING):
    assert train.train_and_evaluate(config, workdir)['step'] == 22
  assert any("platform: 'cpu' -> 'gpu'" in r.getMessage() for r in caplog.records)
  resumed = json.load(open(os.path.join(workdir, 'config.json')))
  assert resumed['eval']['dtype'] == 'bfloat16' and resumed['resolved']['platform'] == 'gpu'


def test_a_platform_not_known_yet_opens_no_device(tiny_config, monkeypatch):
  def no_device(*args, **kwargs):
    raise AssertionError('a device was asked for')
  monkeypatch.setattr(jax, 'devices', no_device)
  tiny_config.model.attention_impl = 'cudnn'  # Only a GPU can say; checked once it is known.
  tiny_config.model.attention_dropout = 0.0
  tiny_config.model.dtype = 'bfloat16'
  built = model_config_lib.TransformerConfig.from_config(tiny_config.model, 40)
  assert built.attention_impl == 'cudnn'
  with pytest.raises(ConfigError, match='the platform is cpu, not gpu'):
    model_config_lib.TransformerConfig.from_config(tiny_config.model, 40, platform='cpu')


@pytest.mark.slow
def test_prepare_starts_no_jax_backend(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  config.data.cache_dir = str(tmp_path / 'cache')
  code = ('import json, sys; import ml_collections; from t2t_jax import prepare; '
          'from jax._src import xla_bridge; '
          'config = ml_collections.ConfigDict(json.loads(sys.argv[1])); '
          'print([r["pairs"] for r in prepare.prepare(config, "")], '
          'xla_bridge.backends_are_initialized())')
  process = subprocess.run([sys.executable, '-c', code, config.to_json_best_effort()], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, check=False,
                           env=dict(os.environ, PYTHONPATH=ROOT))
  assert process.returncode == 0, process.stderr[-3000:]
  assert process.stdout.strip() == '[200, 20] False'


def test_the_model_configs_defaults_are_the_base_config_resolved_on_a_cpu():
  """TransformerConfig holds resolved values ('einsum', never 'auto'); its defaults must not
  drift from configs/base.py's, which every config starts from."""
  from configs import base  # pylint: disable=g-import-not-at-top
  built = model_config_lib.TransformerConfig.from_config(base.get_config().model, 100, 'cpu')
  assert built == model_config_lib.TransformerConfig(vocab_size=100)
  assert base.get_config().model.attention_impl == 'auto' and built.attention_impl == 'einsum'


def _moved(config, shape, devices=8, processes=1):
  """What `config` resolves to on `devices` devices in `processes` processes, mesh `shape`."""
  config.mesh.shape = shape
  resolved = resolve.resolve(config, jax.devices()[:devices])
  return dataclasses.replace(resolved, processes=processes)


def test_a_resume_keeps_the_saved_plan_whatever_mesh_it_lands_on(tiny_config):
  saved = _saved(tiny_config)  # 8 batch shards: rows in multiples of 8.
  assert json.loads(saved)['resolved']['data.row_multiple'] == 8
  for shape, devices in (((4, 1, 1), 4), ((1, 2, 2), 4), ((2, 1, 1), 2), ((1, 1, 1), 1)):
    moved = resolve.for_saved_run(tiny_config, _moved(tiny_config, shape, devices), saved,
                                  'checkpoints/20')
    assert moved.train_row_multiple == 8, shape  # Not the 4, 2 or 1 a new run there would get.
  # Two micro-batches of the 4 shards still split rows that are multiples of 8.
  tiny_config.opt.grad_accum_steps = 2
  assert resolve.for_saved_run(tiny_config, _moved(tiny_config, (4, 1, 1), 4), saved,
                               'checkpoints/20').train_row_multiple == 8


def test_a_mesh_that_cannot_split_the_saved_plan_is_refused_with_the_ways_on(tiny_config):
  tiny_config.mesh.shape = (4, 1, 1)
  saved = resolve.config_json(tiny_config, resolve.resolve(tiny_config, jax.devices()[:4]))
  with pytest.raises(ConfigError) as raised:  # Rows in multiples of 4 over 8 batch shards.
    resolve.for_saved_run(tiny_config, _moved(tiny_config, (-1, 1, 1)), saved, 'ckpt/20')
  message = str(raised.value)
  rows = batching.train_rows(tiny_config.data, 4)
  assert message.startswith(f'cannot resume the run saved at ckpt/20 on this mesh: the train '
                            f'batches have {sorted(set(rows))} rows (all multiples of 4), which '
                            '8 batch shards x 1 micro-batch cannot split evenly')
  assert '--config.mesh.shape=(4,1,2,1) (4 batch shards' in message
  assert '--config.data.row_multiple=8 and --config.ckpt.init_from=ckpt/20' in message
  assert '\n' not in message
  # With micro-batches, fewer of them is a way on too.
  tiny_config.opt.grad_accum_steps = 2
  with pytest.raises(ConfigError, match=r'Ways on: --config.opt.grad_accum_steps=1 \(more rows'):
    resolve.for_saved_run(tiny_config, _moved(tiny_config, (4, 1, 1), 4), saved, 'ckpt/20')
  # Asking for another plan than the saved one is refused too.
  tiny_config.opt.grad_accum_steps = 1
  tiny_config.data.row_multiple = 16
  with pytest.raises(ConfigError, match=r'config.data.row_multiple=16 asks for other global '
                     r'batches than those of the run saved at ckpt/20, whose rows are '
                     r'multiples of 4'):
    resolve.for_saved_run(tiny_config, _moved(tiny_config, (4, 1, 1), 4), saved, 'ckpt/20')
  tiny_config.data.row_multiple = 4  # The saved value itself is fine.
  assert resolve.for_saved_run(tiny_config, _moved(tiny_config, (4, 1, 1), 4), saved,
                               'ckpt/20').train_row_multiple == 4


def test_a_resume_that_moved_says_from_where_to_where_in_one_line(tiny_config, caplog):
  tiny_config.mesh.shape = (4, 2, 1)
  saved = _saved(tiny_config)
  moved = resolve.for_saved_run(tiny_config, _moved(tiny_config, (1, 2, 1), 2, 1), saved, 'c/6')
  with caplog.at_level(logging.WARNING):
    resolve.check_resume(saved, tiny_config, moved, 'c/6')
  said = [r.getMessage() for r in caplog.records]
  assert said == [
      'Resuming c/6 on another shape: 8 cpu devices in 1 process, mesh data=4 fsdp=2 tensor=1 '
      'expert=1, 1 micro-batch -> 2 cpu devices in 1 process, mesh data=1 fsdp=2 tensor=1 '
      'expert=1, 1 micro-batch. The same global batches (rows in multiples of 8) and dropout '
      'masks follow; only the order of floating-point sums changes (gradients are reduced over '
      'other shards), so values leave those of a run that did not move in the last bits and '
      'drift slowly']
  caplog.clear()
  tiny_config.opt.grad_accum_steps = 2  # Each micro-batch draws its own dropout masks.
  with caplog.at_level(logging.WARNING):
    resolve.check_resume(saved, tiny_config, moved, 'c/6')
  [said] = [r.getMessage() for r in caplog.records]
  assert '1 micro-batch -> 2 cpu devices' in said and ', 2 micro-batches.' in said
  assert 'The same global batches (rows in multiples of 8) follow' in said
  assert 'other micro-batches also draw other dropout masks' in said


def test_an_explicit_row_multiple_is_the_plan_and_must_split_over_the_mesh(tiny_config):
  tiny_config.data.row_multiple = 16
  assert resolve.resolve(tiny_config, jax.devices()[:8]).train_row_multiple == 16
  tiny_config.data.row_multiple = 12  # Not a multiple of the 8 batch shards.
  with pytest.raises(ConfigError, match=r'config.data.row_multiple=12: the train batches have '
                     r'\[12\] rows \(all multiples of 12\), which 8 batch shards x 1 '
                     r'micro-batch cannot split evenly: 8 must divide 12; use a multiple of 8'):
    resolve.resolve(tiny_config, jax.devices()[:8])
