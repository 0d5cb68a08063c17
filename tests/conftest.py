"""Eight simulated CPU devices and a persistent compilation cache, set before jax loads.

The suite runs on the CPU backend, also on a machine with a GPU. T2T_TEST_GPU=1 runs the tests
marked `gpu` instead, on the GPU with t2t_jax's XLA flags; either way the others are skipped
with the reason (docs/development.md).
"""

import os
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `configs` is importable from a plain checkout too.
GPU_RUN = os.environ.get('T2T_TEST_GPU') == '1'
if GPU_RUN:
  from t2t_jax import xla_flags  # pylint: disable=g-import-not-at-top
  xla_flags.apply()
else:  # Subprocesses inherit it: they too see only the CPU.
  os.environ['JAX_PLATFORMS'] = 'cpu'

import numpy as np  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

jax.config.update('jax_compilation_cache_dir',
                  os.path.expanduser(os.environ.get('T2T_JAX_TEST_CACHE', '~/.cache/t2t_jax/xla')))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def pytest_collection_modifyitems(items):
  for item in items:
    if 'gpu' in item.keywords and not GPU_RUN:
      item.add_marker(pytest.mark.skip(reason='a GPU test: run T2T_TEST_GPU=1 python -m pytest '
                                       '-m gpu tests on a machine with a GPU'))
    elif GPU_RUN and 'gpu' not in item.keywords:
      item.add_marker(pytest.mark.skip(reason='T2T_TEST_GPU=1 runs only the gpu tests; the '
                                       'others need the 8 simulated CPU devices: run without it'))


@pytest.fixture
def gpu_device():
  """The first GPU; the test is skipped where there is none."""
  gpus = [device for device in jax.devices() if device.platform == 'gpu']
  if not gpus:
    pytest.skip(f'no GPU here: jax.devices() is {jax.devices()}')
  return gpus[0]


@pytest.fixture
def tiny_config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  return tiny.get_config()


def write_lines(path, lines):
  """Writes text lines (str) or raw lines (bytes), each followed by a newline."""
  with open(path, 'wb') as f:
    for line in lines:
      f.write((line.encode('utf-8') if isinstance(line, str) else line) + b'\n')
  return str(path)


def text_config(tiny_config, tmp_path, count=200):
  """Points `tiny_config` at small generated parallel files in `tmp_path`."""
  rng = np.random.default_rng(0)
  words = ['haus', 'katze', 'hund', 'baum', 'auto', 'blume', 'stadt', 'fluss']
  english = ['house', 'cat', 'dog', 'tree', 'car', 'flower', 'city', 'river']
  picks = [rng.integers(0, 8, rng.integers(2, 7)) for _ in range(count)]
  src = [' '.join(english[i] for i in p) for p in picks]
  tgt = [' '.join(words[i] for i in p) for p in picks]
  cfg = tiny_config
  cfg.data.source = 'text'
  cfg.data.train_src = write_lines(tmp_path / 'train.src', src)
  cfg.data.train_tgt = write_lines(tmp_path / 'train.tgt', tgt)
  cfg.data.eval_src = write_lines(tmp_path / 'eval.src', src[:20])
  cfg.data.eval_tgt = write_lines(tmp_path / 'eval.tgt', tgt[:20])
  cfg.data.vocab_size = 40
  return cfg


def scalar_events(workdir) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} from a workdir's event files ({} when it has none)."""
  from t2t_jax import plot  # pylint: disable=g-import-not-at-top
  try:
    scalars = plot.read_scalars(str(workdir))
  except FileNotFoundError:
    return {}
  return {tag: dict(zip(series.steps, series.values)) for tag, series in scalars.items()}


def assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets):
  """Decoding one target token at a time through the cache gives the teacher-forced logits."""
  from t2t_jax import decode  # pylint: disable=g-import-not-at-top
  from t2t_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  full = model_lib.Transformer(config).apply({'params': params}, inputs, targets)
  step_model = model_lib.Transformer(decode.decode_config(config))
  encoded = step_model.apply({'params': params}, inputs, method=model_lib.Transformer.encode)
  length = targets.shape[1]
  cache = decode.init_cache(config, targets.shape[0], length)
  previous = model_lib.shift_right(targets)
  for t in range(length):
    logits, variables = step_model.apply(
        {'params': params, 'cache': cache}, encoded, inputs, previous[:, t:t + 1],
        mutable=['cache'], method=model_lib.Transformer.decode)
    cache = variables['cache']
    # GPUs multiply float32 matrices in TF32 by default (10-bit mantissa): 1e-3 relative.
    np.testing.assert_allclose(logits[:, 0], full[:, t],
                               atol=2e-3 if jax.devices()[0].platform == 'gpu' else 1e-5)
