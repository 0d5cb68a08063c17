"""Exports the parameters of one checkpoint for inference: no optimiser state, optionally bf16.

  python -m t2t_jax.export --workdir=/tmp/run                      # latest step
  python -m t2t_jax.export --workdir=/tmp/run --checkpoint=3000 --dtype=bfloat16

Writes `<workdir>/export/<name>_<dtype>` (or --output): a params-only orbax checkpoint with
the items `params`, `config` and `info`, readable with plain orbax (see docs/training.md).
"""

import os

from absl import app
from absl import flags

from t2t_jax import cli
from t2t_jax import saved_params

def export(workdir: str, checkpoint_name: str | None = None, dtype: str = 'float32',
           output: str = '') -> str:
  """Writes the params of one checkpoint in `dtype`; returns the directory written."""
  path = saved_params.resolve(workdir, checkpoint_name)
  params = saved_params.cast(saved_params.load_params(path), dtype)
  output = output or os.path.join(os.path.abspath(workdir), 'export',
                                  f'{os.path.basename(os.path.normpath(path))}_{dtype}')
  config_json = saved_params.read_json_item(path, saved_params.CONFIG)['config']
  return saved_params.write_params(output, params, config_json,
                                 {'kind': 'export', 'source': path, 'dtype': dtype})


def _define_flags():
  """Defined only when run as a program, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'Training workdir holding checkpoints/.')
  flags.DEFINE_string('checkpoint', None, 'A step number or a checkpoint directory (e.g. an '
                      'averaged one); default: the latest step.')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                    'Storage dtype of the exported parameters.')
  flags.DEFINE_string('output', '', 'Output directory; default '
                      '<workdir>/export/<step or name>_<dtype>.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  args = flags.FLAGS
  if not args.workdir:
    raise app.UsageError('--workdir is required')
  print(export(args.workdir, args.checkpoint, args.dtype, args.output), flush=True)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
