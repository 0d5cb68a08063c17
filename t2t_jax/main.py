"""Trains and evaluates a Transformer from an ml_collections config.

  python -m t2t_jax.main --config=configs/default.py --workdir=/tmp/t2t_default
  python -m t2t_jax.main --config=configs/wmt14_ende.py:big --dry_run --dry_run_devices=8 \
      --config.mesh.shape='(2,4,1)'
  python -m t2t_jax.main ... --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from t2t_jax import cli

FLAGS = flags.FLAGS

def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from t2t_jax import xla_flags  # pylint: disable=g-import-not-at-top
  xla_flags.apply()  # Before anything starts a backend, which reads XLA_FLAGS once.
  if FLAGS.dry_run_devices:  # Before anything creates the devices.
    if not FLAGS.dry_run:
      raise app.UsageError('--dry_run_devices only applies with --dry_run')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_'
                               f'device_count={FLAGS.dry_run_devices}')
    jax.config.update('jax_platforms', 'cpu')
  else:
    from t2t_jax import sharding  # pylint: disable=g-import-not-at-top
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                    FLAGS.distributed_timeout)
  if FLAGS.compilation_cache:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(FLAGS.compilation_cache))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
  from t2t_jax import dry_run, train  # After flag parsing, so --help stays fast.
  if FLAGS.dry_run:
    result = dry_run.dry_run(FLAGS.config)
    print(cli.json_line(result), flush=True)
    if not result.get('fits', True):
      raise SystemExit(f'The train step needs {result["memory_per_device_bytes"]["total"]} bytes '
                       f'per device but the device has {result["device_memory_bytes"]}: shard '
                       'more (config.mesh), lower config.data.batch_tokens, raise '
                       'config.opt.grad_accum_steps or use config.model.dtype=bfloat16.')
    return
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required to train')
  logging.info('JAX devices: %s', jax.devices())
  from t2t_jax import preemption  # pylint: disable=g-import-not-at-top
  try:
    results = train.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.force_unlock)
  except preemption.Preempted as e:
    logging.warning('%s', e)
    logging.flush()
    sys.exit(e.exit_code)  # 143 or 130, not 0, so schedulers requeue rather than finish.
  print(cli.json_line(results), flush=True)


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  config_flags.DEFINE_config_file('config', None, 'Config file (path[:variant]).',
                                  lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints, events and config.')
  flags.DEFINE_bool('dry_run', False, 'Compile the train step, print its size and cost as JSON, '
                    'and exit without training.')
  flags.DEFINE_integer('dry_run_devices', 0, 'With --dry_run: simulate this many CPU devices, to '
                       'check a mesh larger than this machine (memory figures then come from '
                       'the CPU compiler).')
  flags.DEFINE_string('coordinator_address', '', 'host:port of process 0 for a multi-process run '
                      '(env T2T_COORDINATOR_ADDRESS); not needed on TPU VMs and SLURM, which are '
                      'detected.')
  flags.DEFINE_integer('num_processes', 0, 'Processes in the run (env T2T_NUM_PROCESSES), with '
                       '--coordinator_address.')
  flags.DEFINE_integer('process_id', -1, 'This process, 0..num_processes-1 (env T2T_PROCESS_ID), '
                       'with --coordinator_address.')
  flags.DEFINE_integer('distributed_timeout', 300, 'Seconds to wait for every process to join a '
                       'multi-process run.')
  flags.DEFINE_bool('force_unlock', False, 'Take the workdir lock even if the run named in it '
                    'looks alive (e.g. a node that is gone but whose heartbeat is recent). Never '
                    'with a live run.')
  flags.DEFINE_string('compilation_cache', '~/.cache/t2t_jax/xla', 'Persistent XLA compilation '
                      'cache directory; empty disables it.')
  flags.mark_flag_as_required('config')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
