"""Trains and evaluates a Transformer from an ml_collections config.

  python -m t2t_jax.main --config=configs/default.py --workdir=/tmp/t2t_default
  python -m t2t_jax.main --config=configs/wmt14_ende.py:big --dry_run --dry_run_devices=8 \
      --config.mesh.shape='(2,4,1)'
  python -m t2t_jax.main --config=configs/wmt14_ende.py:big --dry_run --dry_run_target=tpu:v5e-8
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
from t2t_jax import exit_codes

FLAGS = flags.FLAGS

def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  for name in ('dry_run_devices', 'dry_run_target', 'search_mesh'):
    if FLAGS[name].value and not FLAGS.dry_run:
      raise app.UsageError(f'--{name} only applies with --dry_run')
  if FLAGS.search_mesh and not FLAGS.dry_run_target:
    raise app.UsageError('--search_mesh needs --dry_run_target: the target whose meshes to rank')
  if FLAGS.dry_run_devices or FLAGS.dry_run_target:  # Before anything creates the devices.
    if FLAGS.dry_run_devices:
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_'
                                 f'device_count={FLAGS.dry_run_devices}')
    # A target is compiled for, never run on: no accelerator of this machine is opened.
    jax.config.update('jax_platforms', 'cpu')
  else:
    from t2t_jax import sharding  # pylint: disable=g-import-not-at-top
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                    FLAGS.distributed_timeout)
  from t2t_jax.compile import dry_run  # After flag parsing: --help stays fast.
  from t2t_jax.compile import mesh_choice  # After flag parsing: --help stays fast.
  from t2t_jax.training import train  # After flag parsing: --help stays fast.
  if FLAGS.dry_run:
    if FLAGS.search_mesh:
      mesh_choice.command(FLAGS.config, FLAGS.dry_run_target)
    else:
      dry_run.command(FLAGS.config, FLAGS.dry_run_target)
    return
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required to train')
  logging.info('JAX devices: %s', jax.devices())
  from t2t_jax.training import lifecycle, task  # pylint: disable=g-import-not-at-top
  from t2t_jax.tuning import trial_report  # pylint: disable=g-import-not-at-top
  trial = trial_report.from_environment()  # Set where launch/search.py started this run.
  try:
    results = train.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.force_unlock,
                                       reporters=[trial] if trial else [])
  except task.Pruned:  # Logged where it happened; launch/search.py reads the status.
    logging.flush()
    sys.exit(exit_codes.PRUNED)
  except lifecycle.Preempted as e:
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
  flags.DEFINE_string('dry_run_target', '', 'With --dry_run: compile for this accelerator '
                      'target without it, e.g. tpu:v5e-8, tpu:2xv5e-16, gpu:h100x8 '
                      '(docs/accelerators.md): memory and fit per device, collectives, and a '
                      'predicted step time.')
  flags.DEFINE_bool('search_mesh', False, 'With --dry_run_target: compile the candidate meshes '
                    '(data/fsdp/tensor splits, remat, scan, the update split over data) '
                    'and rank those that fit by '
                    'predicted step time.')
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
  flags.mark_flag_as_required('config')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
