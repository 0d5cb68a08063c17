"""Trains and evaluates a Transformer from an ml_collections config.

  python -m t2t_jax.main --config=configs/default.py --workdir=/tmp/t2t_default
  python -m t2t_jax.main --config=configs/wmt14_ende.py:big --dry_run
"""

import json
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (path[:variant]).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, events and config.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Compile the train step, print its size and '
                             'cost as JSON, and exit without training.')
_CACHE = flags.DEFINE_string('compilation_cache', '~/.cache/t2t_jax/xla',
                             'Persistent XLA compilation cache directory; empty disables it.')
flags.mark_flag_as_required('config')


def _quiet_libraries():
  """Keeps orbax's per-save INFO chatter out of the console; its warnings still show."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= std_logging.WARNING or '/orbax/' not in record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  _quiet_libraries()
  if _CACHE.value:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(_CACHE.value))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
  from t2t_jax import train  # After flag parsing, so --help stays fast.
  if _DRY_RUN.value:
    print(json.dumps(train.dry_run(_CONFIG.value)), flush=True)
    return
  if not _WORKDIR.value:
    raise app.UsageError('--workdir is required to train')
  logging.info('JAX devices: %s', jax.devices())
  from t2t_jax import checkpoint, preemption  # pylint: disable=g-import-not-at-top
  try:
    results = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except checkpoint.CheckpointError as e:
    sys.exit(f'error: {e}')  # Says which checkpoint and what to do; no traceback needed.
  except preemption.Preempted as e:
    logging.warning('%s', e)
    logging.flush()
    sys.exit(preemption.EXIT_CODE)  # Not 0, so schedulers requeue rather than finish the job.
  print(json.dumps(results), flush=True)


def run():
  app.run(main)


if __name__ == '__main__':
  run()
