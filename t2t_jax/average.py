"""Averages the parameters of several checkpoints (float32 sums) into a params-only checkpoint.

  python -m t2t_jax.average --workdir=/tmp/run --last=5
  python -m t2t_jax.average --workdir=/tmp/run --steps=90000,95000,100000

Writes `<workdir>/averaged/avg<N>_<first>-<last>` (or --output), which translate and evaluate
read with --checkpoint=<that dir>, and a new training run starts from with
--config.ckpt.init_from=<that dir>.
"""

import os

from absl import app
from absl import flags
from absl import logging

from t2t_jax import CheckpointError
from t2t_jax import cli
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import saved_params

def available_steps(workdir: str) -> list[int]:
  directory = workdir_layout.checkpoints_dir(workdir)
  if not os.path.isdir(directory):
    raise CheckpointError(f'{directory} does not exist: is --workdir a training '
                                     'workdir?')
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def choose_steps(available: list[int], last: int, steps: list[str]) -> list[int]:
  """The steps named by --last or --steps, checked against those on disk."""
  if bool(last) == bool(steps):
    raise app.UsageError('pass exactly one of --last=N and --steps=a,b,c')
  if last:
    if last < 1 or last > len(available):
      raise CheckpointError(f'--last={last}, but the workdir holds '
                                       f'{len(available)} checkpoints: {available}')
    return available[-last:]
  try:
    chosen = sorted({int(step) for step in steps})
  except ValueError:
    raise app.UsageError(f'--steps must be integers, got {",".join(steps)}') from None
  if missing := [step for step in chosen if step not in available]:
    raise CheckpointError(f'no checkpoint of steps {missing}; the workdir holds '
                                     f'{available}')
  return chosen


def average_checkpoints(workdir: str, steps: list[int], output: str = '',
                        dtype: str = '') -> str:
  """Averages `steps` of `workdir` on the host; returns the directory written."""
  paths = [saved_params.checkpoint_path(workdir, str(step)) for step in steps]
  output = output or os.path.join(workdir_layout.averaged_dir(workdir),
                                  f'avg{len(steps)}_{steps[0]}-{steps[-1]}')
  logging.info('Averaging steps %s of %s', steps, workdir)
  params = saved_params.average([saved_params.load_params(path) for path in paths])
  if dtype:
    params = saved_params.cast(params, dtype)
  config_json = saved_params.read_json_item(paths[-1], saved_params.CONFIG)['config']
  return saved_params.write_params(output, params, config_json,
                                 {'kind': 'average', 'workdir': os.path.abspath(workdir),
                                  'steps': steps, 'dtype': dtype or 'as saved'})


def _define_flags():
  """Defined only when run as a program, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'Training workdir holding checkpoints/.')
  flags.DEFINE_integer('last', 0, 'Average the last N checkpoints.')
  flags.DEFINE_list('steps', [], 'Average these steps (comma-separated) instead.')
  flags.DEFINE_string('output', '', 'Output directory; default '
                      '<workdir>/averaged/avg<N>_<first>-<last>.')
  flags.DEFINE_enum('dtype', '', ['', 'float32', 'bfloat16'],
                    'Storage dtype of the result; default: that of the checkpoints.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  args = flags.FLAGS
  if not args.workdir:
    raise app.UsageError('--workdir is required')
  steps = choose_steps(available_steps(args.workdir), args.last, args.steps)
  print(average_checkpoints(args.workdir, steps, args.output, args.dtype), flush=True)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
