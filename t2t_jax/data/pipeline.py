"""Translation pairs for training and evaluation: the vocabulary, the token cache, the splits.

Sources (synthetic tasks here; text, TSV and TFDS in `sources`) -> shared SentencePiece
vocabulary trained once on a streamed sample -> token ids cached on disk (`token_cache`) ->
length filter -> batch plans (`batching`).
"""

import dataclasses
import os

from absl import logging
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import EOS_ID
from t2t_jax.data import classification
from t2t_jax.data import sources
from t2t_jax.data import token_cache
from t2t_jax.data import tokenizer
# pylint: disable=unused-import
# The batching API, re-exported: train.py and the tools use it through this module.
from t2t_jax.data.batching import (bucket_boundaries, eval_batches, make_batchers, pack_length,
                              PackedBatches, plan_row_multiple, TokenBudgetBatches,
                              train_iterator)
from t2t_jax.data.sources import DataError
# pylint: enable=unused-import
from t2t_jax.data.token_cache import Ragged

SYNTHETIC_TASKS = ('copy', 'reverse', 'sort', 'addition')


@dataclasses.dataclass
class Split:
  """Encoded pairs (ids ending in EOS, as `Ragged` views) and, for evaluation, their text."""
  inputs: Ragged
  targets: Ragged
  sources: list[str]
  references: list[str]

  def __post_init__(self):
    if not isinstance(self.inputs, Ragged):
      self.inputs = Ragged.from_sequences(self.inputs)
    if not isinstance(self.targets, Ragged):
      self.targets = Ragged.from_sequences(self.targets)

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
    raise ConfigError(f'config.data.task must be one of {SYNTHETIC_TASKS}, '
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


# Parallel text, TSV and TFDS through the vocabulary and the token cache.

def read_parallel(source_path: str, target_path: str, bad_lines: str) -> tuple[list[str],
                                                                              list[str]]:
  """Line-aligned sentence pairs in memory (small files); see `sources.parallel_text`."""
  if bad_lines not in sources.BAD_LINE_POLICIES:
    raise ConfigError(f'config.data.bad_lines must be one of {sources.BAD_LINE_POLICIES}, '
                      f'got {bad_lines!r}')
  pairs = list(sources.parallel_text(source_path, target_path, bad_lines).read())
  return [p[0] for p in pairs], [p[1] for p in pairs]


def _encode(vocab, texts: tuple[list[str], list[str]], config, name: str) -> Split:
  """Encodes synthetic text pairs, appending EOS; see `_filter` for the length limit."""
  inputs, targets = ([np.asarray(ids + [EOS_ID], np.int32) for ids in vocab.encode(side)]
                     for side in texts)
  return _filter(Split(inputs, targets, list(texts[0]), list(texts[1])), config, name)


def _filter(split: Split, config, name: str) -> Split:
  """Drops (with a logged count) pairs longer than config.data.max_len tokens, EOS included.

  The encoder-decoder reads each side on its own, so the longer side counts; a decoder-only
  model reads one sequence of both (and its position table must cover it), so their sum does.
  """
  max_len = config.data.max_len
  if config.model.kind == 'decoder_only':
    lengths, what = split.inputs.lengths + split.targets.lengths, 'source + target'
  else:
    lengths, what = np.maximum(split.inputs.lengths, split.targets.lengths), 'either side'
  keep = np.flatnonzero(lengths <= max_len)
  if dropped := len(split) - len(keep):
    logging.warning('%s: dropped %d of %d pairs longer than config.data.max_len=%d tokens (%s)',
                    name, dropped, len(split), max_len, what)
  else:
    return split
  return Split(split.inputs.subset(keep), split.targets.subset(keep),
               [split.sources[i] for i in keep] if split.sources else [],
               [split.references[i] for i in keep] if split.references else [])


def cache_dir(config, workdir: str) -> str:
  """Where the vocabulary and the token cache live: config.data.cache_dir, else the workdir."""
  directory = config.data.cache_dir or workdir
  if not directory:
    raise ConfigError('set config.data.cache_dir (or pass a workdir) for the vocabulary and '
                      'the token cache')
  return os.path.abspath(os.path.expanduser(directory))


def vocab_path(config, workdir: str) -> str:
  """The shared SentencePiece model: config.data.vocab_path, else <cache_dir>/vocab.model."""
  return config.data.vocab_path or os.path.join(cache_dir(config, workdir), 'vocab.model')


def load_vocab(config, workdir: str) -> tokenizer.Vocabulary:
  """The vocabulary of `config`, trained on a sample of the training split on first use; an
  encoder-only model's has [CLS], [SEP] and [MASK] (tokenizer.SPECIAL_PIECES)."""
  if config.data.source == 'synthetic':
    return synthetic_vocabulary(config.data)
  train_source = sources.open_split(config.data, 'train')
  texts = lambda: (text for pair in train_source.read() for text in pair if text)
  tags = (config.data.extra_tag,) if config.data.extra_tag else ()
  return tokenizer.load_or_train(vocab_path(config, workdir), texts, config.data, config.seed,
                                 special=config.model.kind == 'encoder_only', tags=tags)


IS_NEXT, NOT_NEXT = 3, 4  # The [CLS] flag of a next-sentence pair (training/encoder_tasks.py).
_PAIR_SEED = 1211  # The pairs are one fixed draw, whatever config.seed.


def _sentence_pairs(split: Split, name: str) -> Split:
  """Next-sentence examples: line i, [SEP], then line i + 1 (the last line: line 0) or, with
  probability 1/2, another random line; each pair's kind marked for `_masked_lm_split` by a
  negative first token (-IS_NEXT or -NOT_NEXT, replaced by [CLS] there). One fixed draw per
  split: like BERT's data, the pairs do not change between epochs (the masks do)."""
  count = len(split.targets)
  rng = np.random.default_rng([_PAIR_SEED, sum(map(ord, name))])
  random_next = rng.random(count) < 0.5
  following = (np.arange(count) + 1) % count
  others = (following + rng.integers(1, max(count, 2), count)) % count  # Never the next line.
  second = np.where(random_next & (count > 2), others, following)
  old = split.targets
  rows = []
  for i in range(count):
    first = old.tokens[old.starts[i]:old.starts[i] + old.lengths[i] - 1]  # Without its EOS.
    other = old.tokens[old.starts[second[i]]:old.starts[second[i]] + old.lengths[second[i]]]
    marker = -NOT_NEXT if second[i] != following[i] else -IS_NEXT
    rows.append(np.concatenate([[marker], first, [tokenizer.SEP_ID], other]).astype(np.int32))
  logging.info('%s: %d next-sentence pairs, %d of them with a random second line', name,
               count, int((second != following).sum()))
  targets = Ragged.from_sequences(rows)
  return Split(Ragged(targets.tokens, targets.starts, np.zeros_like(targets.lengths)),
               targets, split.sources, split.references)


def _masked_lm_split(split: Split, vocab) -> Split:
  """A masked-LM split: each sentence (or next-sentence pair) in 'targets' after [CLS], and in
  'inputs' each token's word-start flag (2 at a word's first piece, [CLS] and EOS; 1 at its
  later pieces; a pair's [CLS] IS_NEXT or NOT_NEXT), laid out alike by every batching mode
  (training/encoder_tasks.py reads both)."""
  old = split.targets
  pairs = len(old) and old.tokens[old.starts[0]] < 0  # Marked by `_sentence_pairs`.
  lengths = old.lengths + (0 if pairs else 1)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[:len(lengths)].astype(
      old.starts.dtype)
  tokens = np.empty(int(lengths.sum()), np.int32)
  body = np.ones(len(tokens), bool)
  body[starts] = False
  skip = 1 if pairs else 0  # A pair's marker makes way for [CLS].
  tokens[body] = np.concatenate([old.tokens[s + skip:s + n] for s, n in zip(old.starts,
                                                                            old.lengths)]
                                ) if len(old) else np.zeros(0, np.int32)
  tokens[starts] = tokenizer.CLS_ID
  targets = Ragged(tokens, starts, lengths)
  flags = np.where(tokenizer.word_start_table(vocab)[tokens], 2, 1).astype(np.int32)
  if pairs:
    flags[starts] = -old.tokens[old.starts]  # IS_NEXT or NOT_NEXT at each [CLS].
  return Split(Ragged(flags, starts, lengths), targets, split.sources, split.references)


def _load_labelled(config, workdir: str) -> TaskData:
  """A classifier's train and eval splits from labelled TSV files; the label set is
  config.data.labels (the task fills it from the training file, training/tasks.py)."""
  vocab = load_vocab(config, workdir)
  regression = config.model.head == 'regression'
  names = list(config.data.labels)
  data_config = config.data
  whole = classification.read_tsv(sources.in_data_dir(data_config, 'train_tsv'),
                                  data_config.bad_lines)
  train, held_out = classification.split_train(whole, data_config.holdout,
                                               data_config.train_limit)
  if held_out or data_config.train_limit:
    logging.info('%s: %d examples train, %d held out for evaluation%s', whole.path,
                 len(train.texts), len(held_out.texts) if held_out else 0,
                 f' (config.data.train_limit={data_config.train_limit}, of '
                 f'{len(whole.texts) - (len(held_out.texts) if held_out else 0)})'
                 if data_config.train_limit else '')
  evaluation = held_out or classification.read_tsv(
      sources.in_data_dir(data_config, 'eval_tsv'), data_config.bad_lines)
  splits = []
  for labelled in (train, evaluation):
    encoded = classification.encode(vocab, labelled, names, regression, data_config.max_len)
    splits.append(Split(encoded.inputs, encoded.targets, encoded.texts, encoded.labels))
  return TaskData(vocab, *splits)


def load_split(config, workdir: str, split: str, vocab=None) -> tuple[Split, bool]:
  """One split ('train', 'eval' or 'test') from the token cache, building it if absent.

  Returns the split after the `max_len` filter and whether the cache entry was built now.
  """
  vocab = vocab or load_vocab(config, workdir)
  source = sources.open_split(config.data, split)
  cached = token_cache.load_or_build(cache_dir(config, workdir), source, split, vocab,
                                     keep_text=split != 'train')
  if not len(cached.inputs):
    raise DataError(f'{source.name} ({split}) yielded no pairs')
  inputs = cached.inputs
  if config.data.source == 'lm':  # The cache holds a lone EOS per empty source: no source.
    inputs = Ragged(inputs.tokens, inputs.starts, np.zeros_like(inputs.lengths))
  full = Split(inputs, cached.targets, cached.sources, cached.references)
  if config.data.source == 'lm' and config.model.kind == 'encoder_only':
    if config.model.next_sentence:
      full = _sentence_pairs(full, split)
    full = _masked_lm_split(full, vocab)
  return _filter(full, config, split), cached.built


def load(config, workdir: str) -> TaskData:
  """Builds the vocabulary and the encoded train and eval splits named by `config.data`."""
  data_config = config.data
  if data_config.source == 'synthetic':
    vocab = synthetic_vocabulary(data_config)
    train_text, eval_text = synthetic_text(data_config, config.seed)
    return TaskData(vocab, _encode(vocab, train_text, config, 'train'),
                    _encode(vocab, eval_text, config, 'eval'))
  sources.open_split(data_config, 'train')  # Refuses an unknown source before any work.
  if data_config.source == 'labelled':
    return _load_labelled(config, workdir)
  vocab = load_vocab(config, workdir)
  return TaskData(vocab, load_split(config, workdir, 'train', vocab)[0],
                  load_split(config, workdir, 'eval', vocab)[0])


def vocab_size(config) -> int:
  """The model's vocabulary size, known without reading any data."""
  if config.data.source == 'synthetic':
    return synthetic_vocabulary(config.data).vocab_size
  return config.data.vocab_size
