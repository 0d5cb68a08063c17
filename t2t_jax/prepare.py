"""Trains the vocabulary and fills the token cache, without touching an accelerator.

  python -m t2t_jax.prepare --config=configs/wmt14_ende.py:base --config.data.cache_dir=/data/wmt

Run it on a data-preparation machine; the training job (same config, same cache_dir) then
finds the vocabulary and every split already tokenised and starts in seconds. Prints one JSON
line per split.
"""

import time

from absl import app
from absl import flags
from ml_collections import config_flags

from t2t_jax import cli
from t2t_jax.data import pipeline as data
from t2t_jax.training import config_check

FLAGS = flags.FLAGS


def prepare(config, workdir: str, splits=('train', 'eval')) -> list[dict]:
  """Loads or trains the vocabulary and loads or builds each split's cache entry."""
  if config.data.source == 'synthetic':
    raise app.UsageError("config.data.source='synthetic' is generated in memory; there is "
                         'nothing to prepare')
  if config.data.source == 'labelled':
    raise app.UsageError("config.data.source='labelled' is read and encoded at start-up, with "
                         'no token cache; its vocabulary is the pre-training run\'s: prepare '
                         'that run instead (docs/pretraining.md)')
  config_check.check(config, mesh=False)  # Preparing data needs no accelerator.
  start = time.perf_counter()
  vocab = data.load_vocab(config, workdir)
  results = []
  for split in splits:
    loaded, built = data.load_split(config, workdir, split, vocab)
    results.append({'split': split, 'pairs': len(loaded), 'cache': 'built' if built else 'hit',
                    'vocab': vocab.path, 'cache_dir': data.cache_dir(config, workdir),
                    'seconds': round(time.perf_counter() - start, 2)})
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not (FLAGS.config.data.cache_dir or FLAGS.workdir):
    raise app.UsageError('set --config.data.cache_dir (or --workdir) to say where the '
                         'vocabulary and the token cache go')
  for result in prepare(FLAGS.config, FLAGS.workdir or '', FLAGS.splits):
    print(cli.json_line(result), flush=True)


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  config_flags.DEFINE_config_file('config', None, 'Config file (path[:variant]).',
                                  lock_config=True)
  flags.DEFINE_string('workdir', None, 'Used as the cache directory when config.data.cache_dir '
                      'is empty, as in training.')
  flags.DEFINE_list('splits', ['train', 'eval'], "Splits to cache: 'train', 'eval', 'test' "
                    '(TFDS only).')
  flags.mark_flag_as_required('config')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
