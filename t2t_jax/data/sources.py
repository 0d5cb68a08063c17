"""Where translation pairs come from: parallel text files, TSV files or TFDS, read as streams.

Language modelling reads one text file as pairs with an empty source.

A `Source` names one split of one corpus. `read` yields stripped (source, target) text pairs
one at a time, so a corpus of millions of lines is never held in memory; bad lines raise a
`DataError` naming file and line, or are skipped and counted, per `config.data.bad_lines`.
TensorFlow Datasets (and with it TensorFlow) is imported only when a TFDS source is read.
"""

import collections
import dataclasses
import itertools
import math
import os
import random
from typing import Callable, Iterable, Iterator

from absl import logging

from t2t_jax import ConfigError
from t2t_jax.errors import DataError  # Defined with the other user errors.

SPLITS = ('train', 'eval', 'test')
BAD_LINE_POLICIES = ('error', 'skip')
SOURCES = ('synthetic', 'text', 'tsv', 'tfds', 'lm', 'labelled')  # config.data.source


@dataclasses.dataclass(frozen=True)
class Source:
  """One split of one corpus: an identity for cache keys and a reader of text pairs."""
  name: str  # For messages, e.g. 'train.en / train.de' or 'wmt14_translate/de-en[train]'.
  key: dict  # JSON-able identity: changes whenever the pairs it yields could change.
  reader: Callable[[collections.Counter], Iterator[tuple[str, str]]]

  def read(self, skipped: collections.Counter | None = None) -> Iterator[tuple[str, str]]:
    """Yields the pairs; counts skipped pairs by reason into `skipped` and logs them at the end.

    Raises DataError naming the files and what was read when no pair is left to yield.
    """
    skipped = collections.Counter() if skipped is None else skipped
    kept = 0
    for pair in self.reader(skipped):
      kept += 1
      yield pair
    read = kept + sum(skipped.values())
    if not kept:
      raise DataError(f'{self.name}: no pairs: ' + (
          f'all {read} read were skipped as bad lines ({describe(skipped)}) under '
          "config.data.bad_lines='skip'. Fix the data or point config.data at other files."
          if read else 'empty (0 pairs read). Point config.data at files with pairs.'))
    if skipped:
      logging.warning('%s: skipped %d of %d pairs (%s)', self.name, sum(skipped.values()),
                      read, describe(skipped))


def describe(skipped) -> str:
  """'1 empty, 2 undecodable': skip counts by reason."""
  return ', '.join(f'{count} {reason}' for reason, count in sorted(skipped.items()))


def _clean(raw: bytes, where: str, bad_lines: str, skipped: collections.Counter) -> str | None:
  """The stripped text of `raw`, or None (counted) if it is undecodable or empty and skipped."""
  try:
    text = raw.decode('utf-8').strip()
  except UnicodeDecodeError as e:
    problem, reason = f'{where}: not valid UTF-8 (byte {e.start})', 'undecodable'
  else:
    if text:
      return ' '.join(text.splitlines())  # A pair stays on one line in the cache.
    problem, reason = f'{where}: empty line', 'empty'
  if bad_lines == 'error':
    raise DataError(f"{problem}. Fix the data or set config.data.bad_lines='skip'.")
  skipped[reason] += 1
  return None


def _pairs(raw_pairs: Iterable[tuple[bytes, bytes, str, str]], bad_lines: str,
           skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  """Cleans (source bytes, target bytes, source place, target place); skips bad pairs."""
  for raw_source, raw_target, source_where, target_where in raw_pairs:
    source = _clean(raw_source, source_where, bad_lines, skipped)
    target = None if source is None else _clean(raw_target, target_where, bad_lines, skipped)
    if target is not None:
      yield source, target


def _file_key(path: str) -> dict:
  try:
    stat = os.stat(path)
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None
  return {'path': os.path.abspath(path), 'bytes': stat.st_size, 'mtime_ns': stat.st_mtime_ns}


def _open(path: str):
  try:
    return open(path, 'rb')
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None


def parallel_text(source_path: str, target_path: str, bad_lines: str) -> Source:
  """Two line-aligned files; files of different line counts are refused, naming both."""
  for path in (source_path, target_path):
    if not path:
      raise DataError('a text data path is empty: set config.data.train_src, train_tgt, '
                      'eval_src and eval_tgt')

  def reader(skipped):
    with _open(source_path) as sources, _open(target_path) as targets:
      def raw_pairs():
        for number, (source, target) in enumerate(itertools.zip_longest(sources, targets),
                                                  start=1):
          if source is None or target is None:
            source_lines = number - (source is None) + sum(1 for _ in sources)
            target_lines = number - (target is None) + sum(1 for _ in targets)
            raise DataError(
                f'{source_path} has {source_lines} lines but {target_path} has {target_lines}: '
                'line N of one must be the translation of line N of the other.')
          yield source, target, f'{source_path}:{number}', f'{target_path}:{number}'
      yield from _pairs(raw_pairs(), bad_lines, skipped)

  return Source(f'{source_path} / {target_path}',
                {'kind': 'text', 'files': [_file_key(source_path), _file_key(target_path)],
                 'bad_lines': bad_lines}, reader)


def tsv(path: str, bad_lines: str) -> Source:
  """One file of `source<TAB>target` lines; a line without exactly one tab is a bad line."""
  if not path:
    raise DataError('a TSV data path is empty: set config.data.train_tsv and eval_tsv')

  def reader(skipped):
    def raw_pairs():
      with _open(path) as f:
        for number, line in enumerate(f, start=1):
          fields = line.rstrip(b'\r\n').split(b'\t')
          if len(fields) != 2:
            if bad_lines == 'error':
              raise DataError(f'{path}:{number}: {len(fields)} tab-separated fields, expected 2 '
                              "(source, target). Fix the file or set "
                              "config.data.bad_lines='skip'.")
            skipped['malformed'] += 1
            continue
          yield fields[0], fields[1], f'{path}:{number} (source)', f'{path}:{number} (target)'
    yield from _pairs(raw_pairs(), bad_lines, skipped)

  return Source(path, {'kind': 'tsv', 'file': _file_key(path), 'bad_lines': bad_lines}, reader)


def monolingual_text(paths: str | list[str], bad_lines: str) -> Source:
  """Text files for language modelling or masked-LM pre-training, read in turn: pairs
  ('', line), a line being one sequence. Of a labelled file ('.tsv': text, then other
  columns) the first column is read, and a header line (its last column 'label') skipped."""
  paths = [paths] if isinstance(paths, str) else list(paths)
  if not paths or not all(paths):
    raise DataError("a language-modelling data path is empty: set config.data.train_text and "
                    'eval_text')

  def reader(skipped):
    for path in paths:
      labelled = path.endswith('.tsv')
      with _open(path) as f:
        for number, raw in enumerate(f, start=1):
          if labelled:  # Labelled text: its first column, without a header line.
            fields = raw.rstrip(b'\r\n').split(b'\t')
            if number == 1 and fields[-1].strip().lower() == b'label':
              continue
            raw = fields[0]
          text = _clean(raw, f'{path}:{number}', bad_lines, skipped)
          if text is not None:
            yield '', text

  files = [_file_key(path) for path in paths]
  key = ({'kind': 'lm', 'file': files[0], 'bad_lines': bad_lines} if len(paths) == 1 else
         {'kind': 'lm', 'files': files, 'bad_lines': bad_lines})  # One file: keys as before.
  return Source(' + '.join(paths), key, reader)


_MIX_SEED = 5113  # A fractional weight's share of pairs is one fixed draw, whatever config.seed.


def mixture(parts: list[Source], weights: list[float], tags: list[str]) -> Source:
  """Parallel sources trained on as one: part i read `weights[i]` times (a fraction: that share
  of its pairs, one fixed draw), each of its source lines after `tags[i]` and a space where the
  tag is not empty (tagged back-translation). Each part refuses to be empty, and logs its skipped
  pairs, under its own name; the mix's counts go to the log."""
  def reader(unused_skipped):  # Each part counts and logs its own.
    counts = []
    for index, (part, weight, tag) in enumerate(zip(parts, weights, tags)):
      whole, fraction = int(weight), weight - int(weight)
      read = kept = 0
      for copy in range(whole + (fraction > 0)):
        draw = random.Random(_MIX_SEED * 1000 + index)  # The same share on every read.
        pairs = part.read() if copy == 0 else part.reader(collections.Counter())
        for source, target in pairs:
          read += copy == 0
          if copy == whole and draw.random() >= fraction:
            continue
          kept += 1
          yield (f'{tag} {source}' if tag else source), target
      counts.append(f'{part.name}: {read} pairs x {weight:g} = {kept}' +
                    (f', sources tagged {tag!r}' if tag else ''))
    logging.info('Training mix: %s', '; '.join(counts))

  return Source(' + '.join(f'{part.name} x{weight:g}' + (f' tagged {tag!r}' if tag else '')
                           for part, weight, tag in zip(parts, weights, tags)),
                {'kind': 'mix', 'parts': [part.key for part in parts], 'weights': weights,
                 'tags': tags}, reader)


def _training_mix(data_config, main: Source) -> Source:
  """config.data.train_src/train_tgt with the extra_src/extra_tgt pairs, weighted and tagged."""
  extra_src = in_data_dir_list(data_config, 'extra_src')
  extra_tgt = in_data_dir_list(data_config, 'extra_tgt')
  if len(extra_src) != len(extra_tgt):
    raise ConfigError(f'config.data.extra_src names {len(extra_src)} files but extra_tgt '
                      f'{len(extra_tgt)}: give a target file for each source file')
  parts = [main] + [parallel_text(src, tgt, data_config.bad_lines)
                    for src, tgt in zip(extra_src, extra_tgt)]
  weights = [1.0] * len(parts)
  if data_config.mix_weights:
    try:
      weights = [float(w) for w in str(data_config.mix_weights).split(',')]
    except ValueError:
      raise ConfigError(f'config.data.mix_weights={data_config.mix_weights!r} must be '
                        'comma-separated numbers') from None
    if len(weights) != len(parts) or not all(0 < w < math.inf for w in weights):
      raise ConfigError(f'config.data.mix_weights={data_config.mix_weights!r} must give '
                        f'{len(parts)} numbers above 0: train_src\'s, then each extra_src\'s')
  tags = [''] + [data_config.extra_tag] * (len(parts) - 1)
  return mixture(parts, weights, tags)


def _tfds_split_name(data_config, split: str) -> tuple[str, str]:
  """(dataset name, TFDS split) of one of our splits."""
  name = data_config.tfds_name
  if split == 'train':
    return name, data_config.tfds_train_split
  name = data_config.tfds_eval_name or name
  return name, {'eval': data_config.tfds_eval_split, 'test': data_config.tfds_test_split}[split]


def tfds_split(data_config, split: str) -> Source:
  """One split of a TFDS translation dataset (e.g. wmt14_translate/de-en), in either direction."""
  name, tfds_split_name = _tfds_split_name(data_config, split)
  source_lang, target_lang = data_config.source_lang, data_config.target_lang
  data_dir = data_config.tfds_data_dir or None
  key = {'kind': 'tfds', 'name': name, 'split': tfds_split_name, 'data_dir': data_dir or '',
         'source_lang': source_lang, 'target_lang': target_lang,
         'bad_lines': data_config.bad_lines}
  where = f'{name}[{tfds_split_name}]'

  def reader(skipped):
    tfds = _import_tfds()
    builder = tfds.builder(name, data_dir=data_dir)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=data_config.tfds_manual_dir or None))
    languages = set(builder.info.features.keys()) if builder.info.features else set()
    if languages and {source_lang, target_lang} - languages:
      raise DataError(f'{where} has languages {sorted(languages)}; config.data.source_lang='
                      f'{source_lang!r} and target_lang={target_lang!r} must be among them')
    dataset = builder.as_dataset(split=tfds_split_name, shuffle_files=False)
    raw_pairs = ((example[source_lang], example[target_lang], f'{where} example {number} '
                  f'({source_lang})', f'{where} example {number} ({target_lang})')
                 for number, example in enumerate(tfds.as_numpy(dataset)))
    yield from _pairs(raw_pairs, data_config.bad_lines, skipped)

  return Source(where, key, reader)


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError("config.data.source='tfds' needs TensorFlow Datasets: "
                    "pip install 't2t_jax[tfds]'") from None
  return tfds


def in_data_dir(data_config, key: str) -> str:
  """config.data[key], read from config.data.data_dir when it is a relative path."""
  path = data_config[key]
  if path and data_config.get('data_dir'):
    path = os.path.join(os.path.expanduser(data_config.data_dir), path)
  return path


def in_data_dir_list(data_config, key: str) -> list[str]:
  """config.data[key] as a comma-separated list of paths, each read from data_dir when relative."""
  paths = [path.strip() for path in data_config[key].split(',')]
  if data_config.get('data_dir'):
    paths = [os.path.join(os.path.expanduser(data_config.data_dir), path) if path else path
             for path in paths]
  return paths


def labelled_placeholder(path: str) -> Source:
  """A labelled TSV file (data/classification.py reads it): its identity, and its text without
  labels for training a vocabulary (the first column; a header line is read as text too)."""
  if not path:
    raise DataError("a labelled data path is empty: set config.data.train_tsv and eval_tsv")

  def reader(skipped):
    with _open(path) as f:
      for number, raw in enumerate(f, start=1):
        text = _clean(raw.split(b'\t')[0], f'{path}:{number}', 'skip', skipped)
        if text is not None:
          yield '', text

  return Source(path, {'kind': 'labelled', 'file': _file_key(path)}, reader)


def open_split(data_config, split: str) -> Source:
  """The source of `split` ('train', 'eval' or 'test') named by `config.data`."""
  if data_config.bad_lines not in BAD_LINE_POLICIES:
    raise ConfigError(f'config.data.bad_lines must be one of {BAD_LINE_POLICIES}, '
                      f'got {data_config.bad_lines!r}')
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  kind = data_config.source
  if kind == 'tfds':
    return tfds_split(data_config, split)
  if split == 'test':
    raise DataError(f"config.data.source={kind!r} has no test split; evaluate a test set "
                    'by pointing the eval files at it')
  if (data_config.extra_src or data_config.extra_tgt) and kind != 'text':
    raise ConfigError("config.data.extra_src and extra_tgt add parallel text files to "
                      f"config.data.source='text', not to {kind!r}")
  if data_config.extra_tag and not data_config.extra_src:
    raise ConfigError(f'config.data.extra_tag={data_config.extra_tag!r} tags the sources of '
                      'config.data.extra_src, which is empty')
  if data_config.mix_weights and not data_config.extra_src:
    raise ConfigError('config.data.mix_weights weighs train_src against config.data.extra_src, '
                      'which is empty')
  if kind == 'text':
    main = parallel_text(in_data_dir(data_config, f'{split}_src'),
                         in_data_dir(data_config, f'{split}_tgt'), data_config.bad_lines)
    return _training_mix(data_config, main) if split == 'train' and data_config.extra_src else main
  if kind == 'tsv':
    return tsv(in_data_dir(data_config, f'{split}_tsv'), data_config.bad_lines)
  if kind == 'lm':
    return monolingual_text(in_data_dir_list(data_config, f'{split}_text'),
                            data_config.bad_lines)
  if kind == 'labelled':
    return labelled_placeholder(in_data_dir(data_config, f'{split}_tsv'))
  raise ConfigError(f'config.data.source must be one of {SOURCES}, got {kind!r}')
