"""Token ids on disk: each split tokenised once, then memory-mapped by every later run.

A cache entry is a folder `<cache_dir>/tokens/<split>-<key>/` where the key hashes the source's
identity (paths, sizes and mtimes, or the TFDS name and split), the split, the bad-line policy
and the vocabulary file's bytes, so a changed input or vocabulary never reads stale ids. It
holds each side's ids (EOS-terminated, concatenated, int32) with their offsets, the raw text
for evaluation splits, and `meta.json` with the counts. Entries are written to a temporary
folder and renamed into place, so a killed build never leaves a half-written entry.
"""

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from typing import Iterable, Sequence

from absl import logging
import numpy as np

from t2t_jax import EOS_ID
from t2t_jax import workdir_lock
from t2t_jax.data import sources

FORMAT_VERSION = 1
_CHUNK_PAIRS = 20_000  # Pairs tokenised per call: SentencePiece spreads each call over all cores.


@dataclasses.dataclass
class Ragged:
  """A list of int32 sequences as views into one flat array (possibly memory-mapped)."""
  tokens: np.ndarray  # [total] int32
  starts: np.ndarray  # [n] int64: where each sequence starts in `tokens`
  lengths: np.ndarray  # [n] int32

  @classmethod
  def from_sequences(cls, sequences: Sequence[Sequence[int]]) -> 'Ragged':
    lengths = np.array([len(s) for s in sequences], np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype(np.int64)
    tokens = (np.concatenate([np.asarray(s, np.int32) for s in sequences]) if len(sequences)
              else np.zeros(0, np.int32))
    return cls(tokens, starts[:len(lengths)], lengths)

  def subset(self, indices: np.ndarray) -> 'Ragged':
    return Ragged(self.tokens, self.starts[indices], self.lengths[indices])

  def __len__(self):
    return len(self.lengths)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    start = self.starts[index]
    return np.asarray(self.tokens[start:start + self.lengths[index]])

  def __iter__(self):
    return (self[i] for i in range(len(self)))


@dataclasses.dataclass
class CachedSplit:
  """One split's token ids, the raw text when kept, and how the entry was obtained."""
  inputs: Ragged
  targets: Ragged
  sources: list[str]
  references: list[str]
  path: str
  built: bool  # False: read from an existing entry.
  skipped: dict[str, int]


def _sha256_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def entry_path(cache_dir: str, source: sources.Source, split: str, vocab_path: str) -> str:
  """The folder of the cache entry for this source, split and vocabulary."""
  identity = {'format': FORMAT_VERSION, 'source': source.key, 'split': split,
              'vocab': _sha256_file(vocab_path)}
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cache_dir, 'tokens', f'{split}-{key}')


def _with_eos(ids: Iterable[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Flat EOS-terminated ids and their lengths."""
  ids = list(ids)
  lengths = np.fromiter((len(x) + 1 for x in ids), np.int32, count=len(ids))
  flat = np.fromiter(itertools.chain.from_iterable(x + [EOS_ID] for x in ids), np.int32,
                     count=int(lengths.sum()))
  return flat, lengths


def _build(path: str, source: sources.Source, vocab, keep_text: bool) -> None:
  """Streams the source through the vocabulary into a new entry at `path`."""
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  workdir_lock.remove_dead_scratch(parent, '.building')
  tmp = tempfile.mkdtemp(dir=parent, prefix=workdir_lock.scratch_prefix('.building'))
  try:
    skipped, lengths, start = collections.Counter(), {'inputs': [], 'targets': []}, time.time()
    with contextlib.ExitStack() as stack:
      files = {side: stack.enter_context(open(os.path.join(tmp, f'{side}.bin'), 'wb'))
               for side in lengths}
      text_files = ({side: stack.enter_context(
          open(os.path.join(tmp, f'{side}.txt'), 'w', encoding='utf-8'))
                     for side in ('sources', 'references')} if keep_text else {})
      pairs = source.read(skipped)
      while chunk := list(itertools.islice(pairs, _CHUNK_PAIRS)):
        texts = list(zip(*chunk))
        for side, side_texts in zip(('inputs', 'targets'), texts):
          flat, side_lengths = _with_eos(vocab.encode(side_texts))
          flat.tofile(files[side])
          lengths[side].append(side_lengths)
        for side, side_texts in zip(('sources', 'references'), texts):
          if side in text_files:
            text_files[side].write(''.join(text + '\n' for text in side_texts))
    count = 0
    for side, parts in lengths.items():
      side_lengths = np.concatenate(parts) if parts else np.zeros(0, np.int32)
      np.save(os.path.join(tmp, f'{side}_lengths.npy'), side_lengths)
      count = len(side_lengths)
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
      json.dump({'source': source.name, 'key': source.key, 'pairs': count,
                 'skipped': dict(skipped), 'vocab': vocab.path, 'keep_text': keep_text,
                 'seconds': round(time.time() - start, 2)}, f, indent=2)
    try:
      os.rename(tmp, path)
    except OSError:  # Another process finished the same entry first; both are identical.
      if not os.path.exists(os.path.join(path, 'meta.json')):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _side(path: str, side: str) -> Ragged:
  lengths = np.load(os.path.join(path, f'{side}_lengths.npy'))
  starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype(np.int64)
  bin_path = os.path.join(path, f'{side}.bin')
  tokens = (np.memmap(bin_path, np.int32, mode='r') if os.path.getsize(bin_path)
            else np.zeros(0, np.int32))
  if len(tokens) != int(lengths.sum()):
    raise sources.DataError(f'{bin_path} holds {len(tokens)} ids but its lengths add up to '
                            f'{int(lengths.sum())}: delete {path} to rebuild it')
  return Ragged(tokens, starts[:len(lengths)], lengths)


def _read_lines(path: str) -> list[str]:
  with open(path, encoding='utf-8') as f:
    return f.read().splitlines()


def load_or_build(cache_dir: str, source: sources.Source, split: str, vocab,
                  keep_text: bool) -> CachedSplit:
  """The cached ids of `source` under `vocab`, tokenising it first if no entry exists."""
  path = entry_path(cache_dir, source, split, vocab.path)
  meta_path = os.path.join(path, 'meta.json')
  built = not os.path.exists(meta_path) or (
      keep_text and not os.path.exists(os.path.join(path, 'sources.txt')))
  if built:
    if os.path.exists(path):  # Built without text, now needed with it.
      shutil.rmtree(path)
    logging.info('Tokenising %s (%s) into %s', source.name, split, path)
    _build(path, source, vocab, keep_text)
  with open(meta_path) as f:
    meta = json.load(f)
  if not built:
    logging.info('Token cache hit: %s (%s) from %s, %d pairs', source.name, split, path,
                 meta['pairs'])
    if meta['skipped']:
      logging.warning('%s: %s pairs were skipped when this cache entry was built', source.name,
                      sources.describe(meta['skipped']))
  inputs, targets = _side(path, 'inputs'), _side(path, 'targets')
  texts = ([], [])
  if keep_text:
    texts = tuple(_read_lines(os.path.join(path, f'{side}.txt'))
                  for side in ('sources', 'references'))
  return CachedSplit(inputs, targets, *texts, path=path, built=built, skipped=meta['skipped'])
