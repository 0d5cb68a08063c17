"""Exports one checkpoint for inference: no optimiser state, optionally bf16, or a CTranslate2
model.

  python -m t2t_jax.export --workdir=/tmp/run                      # latest step
  python -m t2t_jax.export --workdir=/tmp/run --checkpoint=3000 --dtype=bfloat16
  python -m t2t_jax.export --workdir=/tmp/run --weights=ema   # the moving average of the weights
  python -m t2t_jax.export --format=ctranslate2 --workdir=/tmp/run --output=/tmp/run_ct2

--format=orbax (the default) writes `<workdir>/export/<name>_<dtype>` (or --output): a
params-only orbax checkpoint with the items `params`, `config` and `info`, readable with plain
orbax (see docs/training.md). --format=ctranslate2 writes a CTranslate2 model directory
(`<workdir>/export/<name>_ctranslate2_<quantization>` by default; export_ctranslate2.py,
docs/translation.md).
"""

import os

from absl import app
from absl import flags

from t2t_jax import cli
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import saved_params
from t2t_jax.deploy import optional

FORMATS = ('orbax', 'ctranslate2')


def export(workdir: str, checkpoint_name: str | None = None, dtype: str = 'float32',
           output: str = '', weights: str = 'params') -> str:
  """Writes the params (or with `weights`='ema' their moving average) of one checkpoint in
  `dtype`; returns the directory written."""
  path = saved_params.checkpoint_path(workdir, checkpoint_name)
  params = saved_params.cast(saved_params.load_params(path, weights=weights), dtype)
  name = os.path.basename(os.path.normpath(path)) + ('_ema' if weights == 'ema' else '')
  output = output or os.path.join(workdir_layout.export_dir(workdir), f'{name}_{dtype}')
  config_json = saved_params.read_json_item(path, saved_params.CONFIG)['config']
  return saved_params.write_params(output, params, config_json,
                                   {'kind': 'export', 'source': path, 'dtype': dtype,
                                    'weights': weights})


def _define_flags():
  """Defined only when run as a program, so importing this module defines no flags."""
  flags.DEFINE_enum('format', 'orbax', list(FORMATS), 'orbax: a params-only checkpoint; '
                    'ctranslate2: a CTranslate2 model directory.')
  flags.DEFINE_string('workdir', None, 'Training workdir holding checkpoints/.')
  flags.DEFINE_string('checkpoint', None, 'A step number or a checkpoint directory (e.g. an '
                      'averaged one); default: the latest step.')
  flags.DEFINE_enum('weights', 'params', list(saved_params.WEIGHTS), 'Which weights of the '
                    f'checkpoint to write. {saved_params.WEIGHTS_HELP}')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                    'orbax: storage dtype of the exported parameters.')
  flags.DEFINE_string('quantization', None, 'ctranslate2: weight type of the model (int8, '
                      'int8_float16, float16, bfloat16, ...); default float32. The compute '
                      'type is chosen when CTranslate2 loads it.')
  flags.DEFINE_string('output', '', 'Output directory; default '
                      '<workdir>/export/<step or name>_<dtype>.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  args = flags.FLAGS
  if not args.workdir:
    raise app.UsageError('--workdir is required')
  if args.format == 'ctranslate2':
    if args.dtype != 'float32':
      raise app.UsageError('--dtype applies to --format=orbax; CTranslate2 models take '
                           '--quantization')
    print(optional.export_ctranslate2(args.workdir, args.checkpoint, args.output,
                                      args.quantization, args.weights), flush=True)
    return
  if args.quantization:
    raise app.UsageError('--quantization applies to --format=ctranslate2')
  print(export(args.workdir, args.checkpoint, args.dtype, args.output, args.weights),
        flush=True)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
