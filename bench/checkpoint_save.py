"""How long a checkpoint save blocks the training loop, and how long the write takes in all.

  python bench/checkpoint_save.py --config=configs/wmt14_ende.py:base

Builds the config's train state (random init, no data), then times Checkpointer.save (the
part the loop waits for: the device-to-host copy) and the background write after it.
Prints one JSON line.
"""

import os
import statistics
import sys
import tempfile
import time

from absl import flags
import jax
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax.checkpoints import checkpoint
from t2t_jax.data import pipeline as data
from t2t_jax.training import train

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/wmt14_ende.py:base',
                                          'Config whose train state is saved.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Saves timed (median reported).')


def main(_):
  config = _CONFIG.value
  setup = train.build(config, data.vocab_size(config))
  state = jax.block_until_ready(setup.init(jax.random.PRNGKey(0)))
  rng = jax.random.PRNGKey(1)
  blocking, total = [], []
  with tempfile.TemporaryDirectory() as workdir:
    checkpointer = checkpoint.Checkpointer(workdir, config.ckpt)
    for step in range(1, _REPEATS.value + 2):
      start = time.perf_counter()
      checkpointer.save(step, state, rng, {'next_index': step}, '{}')
      returned = time.perf_counter()
      checkpointer.manager.wait_until_finished()
      if step > 1:  # The first save also creates directories and warms orbax up.
        blocking.append(returned - start)
        total.append(time.perf_counter() - start)
    checkpointer.close()
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  print(cli.json_line({
      'benchmark': 'checkpoint_save', 'config': config.name, **common.device_info(),
      'params': train.count_params(state.params), 'state_bytes': int(state_bytes),
      'save_blocking_seconds': round(statistics.median(blocking), 4),
      'save_total_seconds': round(statistics.median(total), 4),
      'repeats': len(blocking)}), flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
