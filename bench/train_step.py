"""Tokens/s, FLOP/s and MFU of the compiled train step, against a matmul in the same run.

FLOPs are counted two ways: XLA's cost analysis (every op of the compiled step) and the
analytic model FLOPs of t2t_jax.model.flops (matmuls only), which MFU and the matmul share use.

  python bench/train_step.py --config=configs/default.py
  python bench/train_step.py --config=configs/wmt14_ende.py:base --rows=8 --length=64

Prints one JSON line.
"""

import os
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax import sharding
from t2t_jax.data import pipeline
from t2t_jax.model import flops
from t2t_jax.training import train

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to measure.')
_ROWS = flags.DEFINE_integer('rows', 0, 'Batch rows; 0: batch_tokens // length.')
_LENGTH = flags.DEFINE_integer('length', 32, 'Padded length of source and target.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps (median reported).')


def main(_):
  config = _CONFIG.value
  setup = train.build(config, pipeline.vocab_size(config))
  shards = sharding.batch_shards(setup.mesh)
  length = _LENGTH.value
  rows = _ROWS.value or max(shards, config.data.batch_tokens // length // shards * shards)
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, setup.model_config.vocab_size, (rows, length), dtype=np.int32)
  batch = sharding.global_batch({'inputs': tokens, 'targets': tokens}, setup.mesh)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, batch,
                                    jax.random.PRNGKey(0)).compile()
  compile_seconds = time.perf_counter() - start
  xla_flops = common.xla_flops(compiled)
  model_flops = flops.train_step_flops(setup.model_config, rows, length, length)
  state = [setup.init(jax.random.PRNGKey(0))]
  dropout_rng = jax.random.PRNGKey(1)

  def step():
    state[0], metrics = compiled(state[0], batch, dropout_rng)
    jax.block_until_ready(metrics)

  seconds = common.median_seconds(step, _STEPS.value)
  matmul = common.matmul_flops_per_second()
  achieved = xla_flops / seconds
  model_achieved = model_flops / seconds
  print(cli.json_line({
      'benchmark': 'train_step', 'config': config.name, **common.device_info(),
      'batch_shape': [rows, length], 'dtype': jnp.dtype(setup.model_config.dtype).name,
      'step_seconds': round(seconds, 5), 'target_tokens_per_second': round(rows * length / seconds),
      'flops_per_step': xla_flops, 'achieved_flops_per_second': achieved,
      'model_flops_per_step': model_flops, 'model_flops_per_second': model_achieved,
      'mfu': common.mfu(model_achieved, setup.model_config.dtype, list(setup.mesh.devices.flat)),
      'matmul_flops_per_second': matmul, 'ratio_to_matmul': round(achieved / matmul, 3),
      'share_of_matmul': round(model_achieved / matmul, 4),
      'compile_seconds': round(compile_seconds, 2)}), flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
