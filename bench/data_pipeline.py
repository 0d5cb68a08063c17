"""Throughput and padding of the input pipeline, from the token cache, in both batching modes.

  python bench/data_pipeline.py
  python bench/data_pipeline.py --corpora=multi30k --batch_tokens=25000 --epochs=5

For each corpus (train.en -> train.de under ../shared/data/<corpus>), trains a vocabulary and
fills the token cache in a temporary folder (never in the repository), then times the training
iterator (plans, collation and grain prefetch; what a training process would consume) over
whole epochs. Bad lines are skipped and counted. Prints one JSON line per corpus and mode with
the median epoch's target tokens/s and examples/s and the padding fraction of all batches.
"""

import collections
import os
import statistics
import sys
import tempfile
import time

from absl import flags
from absl import logging
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax.data import batching
from t2t_jax.data import pipeline as data
from t2t_jax.data import sources

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file('config', os.path.join(_ROOT, 'configs/text.py'),
                                          'Config whose data section is measured.')
_DATA = flags.DEFINE_string(
    'data_root', next((path for path in (os.path.join(_ROOT, '..', 'shared', 'data'),
                                         os.path.join(_ROOT, '..', '..', 'shared', 'data'))
                       if os.path.isdir(path)), '../shared/data'),
    'Folder holding the corpora (../shared/data from the project root, or a worktree).')
_CORPORA = flags.DEFINE_list('corpora', ['multi30k', 'wmt-sample'], 'Corpora to measure.')
_EPOCHS = flags.DEFINE_integer('epochs', 3, 'Timed epochs per mode (median reported).')
_ROW_MULTIPLE = flags.DEFINE_integer('row_multiple', 8, 'Rows per batch are a multiple of this '
                                     '(the mesh batch shards).')


def _epoch_figures(epoch_batches: list[dict]) -> collections.Counter:
  """Real and total token slots per side, and examples, over a list of batches."""
  counts = collections.Counter()
  for batch in epoch_batches:
    for side in ('inputs', 'targets'):
      counts[f'{side}_real'] += int(np.count_nonzero(batch[side]))
      counts[f'{side}_all'] += batch[side].size
    if 'targets_segments' in batch:  # Segments count 1, 2, ... in each row.
      counts['examples'] += int(batch['targets_segments'].max(1).sum())
    else:
      counts['examples'] += int(np.count_nonzero(batch['targets'][:, 0]))
  return counts


def _measure(config, split, mode: str) -> dict:
  config.data.batching = mode
  train, _ = data.make_batchers(config, split, split, _ROW_MULTIPLE.value)
  iterator = data.train_iterator(train)
  next(iterator)  # Starts grain's prefetch thread; then time whole epochs from epoch 1 on.
  for _ in range(train.epoch_length(0) - 1):
    next(iterator)
  seconds, counts = [], collections.Counter()
  for epoch in range(1, _EPOCHS.value + 1):
    start = time.perf_counter()
    epoch_batches = [next(iterator) for _ in range(train.epoch_length(epoch))]
    seconds.append(time.perf_counter() - start)
    counts += _epoch_figures(epoch_batches)
  median = statistics.median(seconds)
  epochs = _EPOCHS.value
  real = counts['inputs_real'] + counts['targets_real']
  every = counts['inputs_all'] + counts['targets_all']
  return {
      'mode': mode, 'batch_tokens': config.data.batch_tokens, 'max_len': config.data.max_len,
      'pack_length': batching.pack_length(config.data) if mode == 'packed' else None,
      'row_multiple': _ROW_MULTIPLE.value, 'batches_per_epoch': train.epoch_length(1),
      'epoch_seconds_median': round(median, 3),
      'target_tokens_per_second': round(counts['targets_real'] / epochs / median),
      'examples_per_second': round(counts['examples'] / epochs / median),
      'padding_fraction': round(1 - real / every, 4),
      'target_padding_fraction': round(1 - counts['targets_real'] / counts['targets_all'], 4),
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  for corpus in _CORPORA.value:
    config = _CONFIG.value
    folder = os.path.join(_DATA.value, corpus)
    config.data.source = 'text'
    config.data.bad_lines = 'skip'
    config.data.train_src, config.data.train_tgt = (os.path.join(folder, f'train.{lang}')
                                                    for lang in ('en', 'de'))
    with tempfile.TemporaryDirectory(prefix='t2t_jax_bench_') as cache_dir:
      config.data.cache_dir = cache_dir
      start = time.perf_counter()
      vocab = data.load_vocab(config, '')
      vocab_seconds = time.perf_counter() - start
      skipped = collections.Counter()
      list(sources.open_split(config.data, 'train').read(skipped))
      start = time.perf_counter()
      split, built = data.load_split(config, '', 'train', vocab)
      build_seconds = time.perf_counter() - start
      start = time.perf_counter()
      split, hit = data.load_split(config, '', 'train', vocab)
      load_seconds = time.perf_counter() - start
      assert built and not hit
      for mode in batching.BATCHING_MODES:
        print(cli.json_line({
            'benchmark': 'data_pipeline', 'config': config.name, 'corpus': corpus,
            **common.device_info(), 'vocab_size': vocab.vocab_size,
            'pairs': len(split), 'skipped': dict(skipped),
            'vocab_seconds': round(vocab_seconds, 2),
            'cache_build_seconds': round(build_seconds, 2),
            'cache_load_seconds': round(load_seconds, 3),
            **_measure(config, split, mode)}), flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
