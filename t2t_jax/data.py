"""Translation pairs from built-in synthetic tasks or parallel text, batched by token budget."""

import bisect
import dataclasses
import math
import os
from typing import Iterator, Sequence

from absl import logging
import grain
import numpy as np

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import tokenizer

SYNTHETIC_TASKS = ('copy', 'reverse', 'sort', 'addition')


class DataError(ValueError):
  """Bad input data, with the file and line at fault."""


@dataclasses.dataclass
class Split:
  """Encoded pairs (ids ending in EOS) and the raw text they came from."""
  inputs: list[np.ndarray]
  targets: list[np.ndarray]
  sources: list[str]
  references: list[str]

  def __len__(self):
    return len(self.inputs)


@dataclasses.dataclass
class TaskData:
  vocab: tokenizer.Vocabulary
  train: Split
  eval: Split


# Synthetic tasks, in the spirit of tensor2tensor's algorithmic problems.

def _synthetic_pair(task: str, rng: np.random.Generator, data_config) -> tuple[str, str]:
  lo, hi = data_config.min_length, data_config.max_length
  if task == 'addition':
    a, b = (int(''.join(map(str, rng.integers(0, 10, rng.integers(lo, hi + 1)))))
            for _ in range(2))
    return ' '.join(f'{a}+{b}'), ' '.join(str(a + b))
  symbols = rng.integers(0, data_config.num_symbols, rng.integers(lo, hi + 1))
  target = {'copy': symbols, 'reverse': symbols[::-1], 'sort': np.sort(symbols)}[task]
  return ' '.join(map(str, symbols)), ' '.join(map(str, target))


def synthetic_vocabulary(data_config) -> tokenizer.SymbolVocabulary:
  if data_config.task == 'addition':
    return tokenizer.SymbolVocabulary([str(d) for d in range(10)] + ['+'])
  return tokenizer.SymbolVocabulary([str(i) for i in range(data_config.num_symbols)])


def synthetic_text(data_config, seed: int) -> tuple[tuple[list[str], list[str]],
                                                     tuple[list[str], list[str]]]:
  """(train, eval) text pairs; no eval source also occurs in training."""
  if data_config.task not in SYNTHETIC_TASKS:
    raise ValueError(f'config.data.task must be one of {SYNTHETIC_TASKS}, '
                     f'got {data_config.task!r}')
  rng = np.random.default_rng(seed)
  train = [_synthetic_pair(data_config.task, rng, data_config)
           for _ in range(data_config.num_train)]
  seen = {source for source, _ in train}
  eval_pairs, attempts = [], 0
  while len(eval_pairs) < data_config.num_eval and attempts < 100 * data_config.num_eval:
    attempts += 1
    pair = _synthetic_pair(data_config.task, rng, data_config)
    if pair[0] not in seen:
      seen.add(pair[0])
      eval_pairs.append(pair)
  if len(eval_pairs) < data_config.num_eval:
    logging.warning('Only %d held-out synthetic examples exist outside the training set '
                    '(asked for %d)', len(eval_pairs), data_config.num_eval)
  return tuple(map(list, zip(*train))), tuple(map(list, zip(*eval_pairs)))


# Parallel text files.

def read_parallel(source_path: str, target_path: str, bad_lines: str) -> tuple[list[str],
                                                                              list[str]]:
  """Line-aligned sentence pairs; empty or undecodable lines raise or are skipped and counted."""
  if bad_lines not in ('error', 'skip'):
    raise ValueError(f"config.data.bad_lines must be 'error' or 'skip', got {bad_lines!r}")
  sides = []
  for path in (source_path, target_path):
    if not path:
      raise DataError('a text data path is empty: set config.data.train_src, train_tgt, '
                      'eval_src and eval_tgt')
    try:
      with open(path, 'rb') as f:
        sides.append(f.read().split(b'\n'))
    except OSError as e:
      raise DataError(f'cannot read {path}: {e.strerror}') from None
    if sides[-1] and sides[-1][-1] == b'':
      sides[-1].pop()  # The newline ending the last line.
  if len(sides[0]) != len(sides[1]):
    raise DataError(f'{source_path} has {len(sides[0])} lines but {target_path} has '
                    f'{len(sides[1])}: line N of one must be the translation of line N of the '
                    'other.')
  sources, targets, skipped = [], [], {'empty': 0, 'undecodable': 0}
  for number, pair in enumerate(zip(*sides), start=1):
    texts, problem = [], None
    for path, raw in zip((source_path, target_path), pair):
      try:
        text = raw.decode('utf-8').strip()
      except UnicodeDecodeError as e:
        problem = ('undecodable', f'{path}:{number}: not valid UTF-8 (byte {e.start})')
        break
      if not text:
        problem = ('empty', f'{path}:{number}: empty line')
        break
      texts.append(text)
    if problem:
      if bad_lines == 'error':
        raise DataError(f"{problem[1]}. Fix the file or set config.data.bad_lines='skip'.")
      skipped[problem[0]] += 1
      continue
    sources.append(texts[0])
    targets.append(texts[1])
  if any(skipped.values()):
    logging.warning('%s / %s: skipped %d empty and %d undecodable pairs of %d', source_path,
                    target_path, skipped['empty'], skipped['undecodable'], len(sides[0]))
  return sources, targets


def _encode(vocab, sources: Sequence[str], references: Sequence[str], max_len: int,
            name: str) -> Split:
  """Appends EOS and drops (with a logged count) pairs longer than `max_len` on either side."""
  split = Split([], [], [], [])
  encoded = zip(vocab.encode(sources), vocab.encode(references), sources, references)
  for source_ids, target_ids, source, reference in encoded:
    if max(len(source_ids), len(target_ids)) + 1 > max_len:
      continue
    split.inputs.append(np.asarray(source_ids + [EOS_ID], np.int32))
    split.targets.append(np.asarray(target_ids + [EOS_ID], np.int32))
    split.sources.append(source)
    split.references.append(reference)
  if dropped := len(sources) - len(split):
    logging.warning('%s: dropped %d of %d pairs longer than config.data.max_len=%d tokens',
                    name, dropped, len(sources), max_len)
  return split


def load(config, workdir: str) -> TaskData:
  """Builds the vocabulary and the encoded train and eval splits named by `config.data`."""
  data_config = config.data
  if data_config.source == 'synthetic':
    vocab = synthetic_vocabulary(data_config)
    train_text, eval_text = synthetic_text(data_config, config.seed)
  elif data_config.source == 'text':
    train_text = read_parallel(data_config.train_src, data_config.train_tgt,
                               data_config.bad_lines)
    eval_text = read_parallel(data_config.eval_src, data_config.eval_tgt, data_config.bad_lines)
    vocab = tokenizer.load_or_train(
        data_config.vocab_path or os.path.join(workdir, 'vocab.model'), train_text,
        data_config, config.seed)
  else:
    raise ValueError(f"config.data.source must be 'synthetic' or 'text', "
                     f'got {data_config.source!r}')
  return TaskData(vocab, _encode(vocab, *train_text, data_config.max_len, 'train'),
                  _encode(vocab, *eval_text, data_config.max_len, 'eval'))


def vocab_size(config) -> int:
  """The model's vocabulary size, known without reading any data."""
  if config.data.source == 'synthetic':
    return synthetic_vocabulary(config.data).vocab_size
  return config.data.vocab_size


# Batching by token budget.

def bucket_boundaries(max_len: int, min_bucket: int, scale: float) -> list[int]:
  """Bucket lengths: multiples of `min_bucket` growing by about `scale`, the last = max_len."""
  boundaries = [min(min_bucket, max_len)]
  while boundaries[-1] < max_len:
    grown = math.ceil(boundaries[-1] * scale / min_bucket) * min_bucket
    boundaries.append(min(max(grown, boundaries[-1] + min_bucket), max_len))
  return boundaries


class TokenBudgetBatches:
  """Deterministic batch plans: pairs grouped into length buckets, rows x length <= budget.

  Every bucket has a fixed row count (a multiple of `row_multiple`, for the mesh), so each
  bucket compiles once; a bucket's last, partial batch is filled with empty rows rather
  than dropped. Training plans reshuffle every epoch from (seed, epoch).
  """

  def __init__(self, split: Split, batch_tokens: int, boundaries: Sequence[int],
               row_multiple: int, shuffle: bool, seed: int):
    self.split, self.shuffle, self.seed = split, shuffle, seed
    lengths = np.array([max(len(i), len(t)) for i, t in zip(split.inputs, split.targets)])
    self.boundaries = list(boundaries)
    self.bucket_of = np.array([bisect.bisect_left(self.boundaries, n) for n in lengths], int)
    if len(lengths) and self.bucket_of.max() >= len(self.boundaries):
      raise ValueError(f'a pair of length {lengths.max()} exceeds the longest bucket '
                       f'{self.boundaries[-1]}')
    self.rows = [max(row_multiple, batch_tokens // b // row_multiple * row_multiple)
                 for b in self.boundaries]
    self.batches_per_epoch = sum(
        math.ceil(np.sum(self.bucket_of == k) / self.rows[k]) for k in range(len(self.rows)))
    self._cached_epoch, self._cached_plan = None, None

  def plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """The epoch's batches as (bucket, example indices)."""
    if epoch == self._cached_epoch:
      return self._cached_plan
    rng = np.random.default_rng([self.seed, epoch])
    batches = []
    for k, rows in enumerate(self.rows):
      members = np.flatnonzero(self.bucket_of == k)
      if self.shuffle:
        members = rng.permutation(members)
      batches += [(k, members[i:i + rows]) for i in range(0, len(members), rows)]
    if self.shuffle:
      batches = [batches[i] for i in rng.permutation(len(batches))]
    self._cached_epoch, self._cached_plan = epoch, batches
    return batches

  def collate(self, bucket: int, indices: np.ndarray) -> dict[str, np.ndarray]:
    length, rows = self.boundaries[bucket], self.rows[bucket]
    batch = {key: np.full((rows, length), PAD_ID, np.int32) for key in ('inputs', 'targets')}
    for row, index in enumerate(indices):
      for key, seq in (('inputs', self.split.inputs[index]),
                       ('targets', self.split.targets[index])):
        batch[key][row, :len(seq)] = seq
    return batch

  def __len__(self):
    return self.batches_per_epoch

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    epoch, position = divmod(index, self.batches_per_epoch)
    return self.collate(*self.plan(epoch)[position])


class _Epochs:
  """Indexable view of `num_epochs` consecutive epochs of a batch plan."""

  def __init__(self, batches: TokenBudgetBatches, num_epochs: int):
    self.batches, self.num_epochs = batches, num_epochs

  def __len__(self):
    return len(self.batches) * self.num_epochs

  def __getitem__(self, index):
    return self.batches[index]


def train_iterator(batches: TokenBudgetBatches, prefetch: int = 2) -> grain.DatasetIterator:
  """An endless, checkpointable iterator (`get_state`/`set_state`) over training batches."""
  dataset = grain.MapDataset.source(_Epochs(batches, num_epochs=1_000_000))
  options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
  return iter(dataset.to_iter_dataset(options))


def eval_batches(batches: TokenBudgetBatches, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """One pass over the evaluation batches (all of them when `limit` is 0)."""
  count = len(batches) if limit <= 0 else min(limit, len(batches))
  for index in range(count):
    yield batches[index]
