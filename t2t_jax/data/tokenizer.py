"""Vocabularies: a shared SentencePiece model for text, a fixed symbol table for synthetic tasks.

Both map text to ids without EOS and back, and agree on PAD_ID = 0 and EOS_ID = 1. A
SentencePiece model for an encoder-only model also reserves [CLS], [SEP] and [MASK] at ids 3-5.
"""

import heapq
import io
import os
import random
import tempfile
from typing import Callable, Iterable, Protocol, Sequence

from absl import logging
import numpy as np
import sentencepiece as spm

from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import workdir_lock

UNK_ID = 2
RESERVED_IDS = 3  # pad, EOS and unknown: a vocabulary needs more ids than these.
# The encoder-only model's pieces, trained in as user-defined symbols so that they take the ids
# after the reserved ones and the text '[MASK]' encodes to MASK_ID.
SPECIAL_PIECES = ('[CLS]', '[SEP]', '[MASK]')
CLS_ID, SEP_ID, MASK_ID = 3, 4, 5
WORD_START = '\u2581'  # SentencePiece's mark of a piece that begins a word.
MODEL_TYPES = ('unigram', 'bpe')  # config.data.vocab_type


class Vocabulary(Protocol):
  vocab_size: int

  def encode(self, texts: Sequence[str]) -> list[list[int]]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def piece(self, token_id: int) -> str: ...


def _strip(ids: Sequence[int]) -> list[int]:
  """Ids up to the first EOS, without padding."""
  out = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    if i != PAD_ID:
      out.append(i)
  return out


class SymbolVocabulary:
  """Whitespace-separated symbols, one id each, for the synthetic tasks."""

  def __init__(self, symbols: Sequence[str]):
    self.symbols = list(symbols)
    self._ids = {s: i + 2 for i, s in enumerate(self.symbols)}
    self.vocab_size = len(self.symbols) + 2

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    try:
      return [[self._ids[s] for s in text.split()] for text in texts]
    except KeyError as e:
      raise ValueError(f'unknown symbol {e.args[0]!r}; this task knows {self.symbols}') from None

  def decode(self, ids: Sequence[int]) -> str:
    return ' '.join(self.symbols[i - 2] for i in _strip(ids) if 2 <= i < self.vocab_size)

  def piece(self, token_id: int) -> str:
    """The text of one id, for display; PAD and EOS show as <pad> and </s>."""
    token_id = int(token_id)
    if token_id in (PAD_ID, EOS_ID):
      return ('<pad>', '</s>')[token_id]
    return self.symbols[token_id - 2] if token_id < self.vocab_size else f'<{token_id}>'


class SentencePieceVocabulary:
  """A SentencePiece model shared by source and target."""

  def __init__(self, path: str):
    self.path = path
    self._processor = spm.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._processor.get_piece_size()
    if (self._processor.pad_id(), self._processor.eos_id()) != (PAD_ID, EOS_ID):
      raise ValueError(f'{path}: SentencePiece model has pad id {self._processor.pad_id()} and '
                       f'eos id {self._processor.eos_id()}; t2t_jax needs {PAD_ID} and {EOS_ID}. '
                       'Delete it to train a new one, or point config.data.vocab_path elsewhere.')

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    return self._processor.encode(list(texts), num_threads=os.cpu_count() or 1)

  def decode(self, ids: Sequence[int]) -> str:
    return self._processor.decode(_strip(ids))

  def piece(self, token_id: int) -> str:
    """The SentencePiece piece of one id, for display."""
    return self._processor.id_to_piece(int(token_id))

  def piece_id(self, piece: str) -> int | None:
    """The id of a piece, or None if the vocabulary has no such piece."""
    token_id = self._processor.piece_to_id(piece)
    return None if token_id == self._processor.unk_id() and piece != self.piece(token_id) else token_id


def train_sentencepiece(sentences: Iterable[str], path: str, vocab_size: int,
                        model_type: str = 'unigram', special: bool = False,
                        tags: Sequence[str] = ()) -> None:
  """Trains a model on `sentences` and writes it to `path` atomically.

  The model is trained in memory: a file-based model would record its temporary path, so the
  same sentences would give different bytes (and token-cache keys) on every run. `special`
  reserves SPECIAL_PIECES at CLS_ID, SEP_ID and MASK_ID, and `tags` (tagged back-translation's
  markers) are pieces of their own after them; without either the trainer gets exactly the
  options it always had, so a vocabulary trained before is trained again byte for byte.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  model = io.BytesIO()
  symbols = list(SPECIAL_PIECES if special else ()) + list(tags)
  options = {'user_defined_symbols': symbols} if symbols else {}
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, pad_id=PAD_ID, eos_id=EOS_ID,
        unk_id=UNK_ID, bos_id=-1, num_threads=os.cpu_count() or 1, minloglevel=2, **options)
  except RuntimeError as e:
    raise ConfigError(f'training a SentencePiece vocabulary of {vocab_size} ({model_type}) '
                      f'failed: {str(e).rstrip(".")}. A small corpus needs a smaller '
                      'config.data.vocab_size.') from None
  with tempfile.TemporaryDirectory(dir=directory,
                                   prefix=workdir_lock.scratch_prefix('.vocab')) as tmp:
    with open(os.path.join(tmp, 'spm.model'), 'wb') as f:
      f.write(model.getvalue())
    os.replace(os.path.join(tmp, 'spm.model'), path)


def sample_texts(texts: Iterable[str], max_chars: int, seed: int) -> list[str]:
  """A uniform random sample of `texts` totalling at most `max_chars`, in one streaming pass.

  Each text gets a random priority; a max-heap keeps the lowest-priority texts that fit the
  budget, so memory stays near `max_chars` however long the stream is.
  """
  rng = random.Random(seed)
  heap, chars = [], 0  # Entries (-priority, order, text): the root has the highest priority.
  for order, text in enumerate(texts):
    priority = rng.random()
    if chars + len(text) > max_chars and heap and -heap[0][0] < priority:
      continue  # Would be evicted at once.
    heapq.heappush(heap, (-priority, order, text))
    chars += len(text)
    while chars > max_chars and heap:
      chars -= len(heapq.heappop(heap)[2])
  return [text for _, _, text in sorted(heap, key=lambda entry: entry[1])]


def load_or_train(path: str, texts: Callable[[], Iterable[str]], data_config, seed: int,
                  special: bool = False, tags: Sequence[str] = ()) -> SentencePieceVocabulary:
  """Loads the vocabulary at `path`, first training it on a sample of `texts()` if absent.

  `special` (an encoder-only model) trains SPECIAL_PIECES in, and refuses a vocabulary at
  `path` that lacks them: its ids 3-5 are ordinary pieces the model would take for markers.
  So do `tags` (config.data.extra_tag), each a piece of its own.
  """
  # A run killed between writing the model and removing its scratch folder left that folder.
  workdir_lock.remove_dead_scratch(os.path.dirname(os.path.abspath(path)), '.vocab')
  if not os.path.exists(path):
    sample = sample_texts(texts(), data_config.vocab_sample_chars, seed)
    logging.info('Training a %d-piece %s SentencePiece vocabulary on %d sampled sentences '
                 '(%d characters) -> %s', data_config.vocab_size, data_config.vocab_type,
                 len(sample), sum(map(len, sample)), path)
    train_sentencepiece(sample, path, data_config.vocab_size, data_config.vocab_type, special,
                        tags)
  else:
    logging.info('Reusing the vocabulary %s', path)
  vocab = SentencePieceVocabulary(path)
  if special and _special_pieces(vocab) != SPECIAL_PIECES:
    raise ConfigError(f'{path} has no [CLS]/[SEP]/[MASK] at ids 3-5: it was not trained for an '
                      "encoder-only model (config.model.kind='encoder_only'); point "
                      "config.data.vocab_path at the pre-training run's vocabulary or delete it "
                      'to train a new one')
  for tag in tags:
    if vocab.piece_id(tag) is None:
      raise ConfigError(f"{path} has no piece {tag!r} (config.data.extra_tag): it would be split "
                        'into ordinary pieces; delete the file to train a vocabulary with it, '
                        'or point config.data.vocab_path at one that has it')
  if vocab.vocab_size != data_config.vocab_size:
    raise ConfigError(f'{path} has {vocab.vocab_size} pieces but config.data.vocab_size is '
                      f'{data_config.vocab_size}: use the matching size or another vocab_path '
                      '(or delete the file to train a new one).')
  return vocab


def _special_pieces(vocab: Vocabulary) -> tuple[str, ...]:
  """The pieces at CLS_ID, SEP_ID and MASK_ID (fewer when the vocabulary is that small)."""
  return tuple(vocab.piece(i) for i in range(CLS_ID, min(MASK_ID + 1, vocab.vocab_size)))


def word_start_table(vocab: Vocabulary) -> np.ndarray:
  """Whether each id begins a word: [vocab_size] bool, for masking whole words.

  A SentencePiece piece begins a word when it starts with WORD_START. Pad, EOS, unknown and
  the special pieces count as words of their own; ids 3-5 of a vocabulary trained without
  SPECIAL_PIECES are ordinary pieces and are judged by their text. Every symbol of a
  SymbolVocabulary is a word.
  """
  if isinstance(vocab, SymbolVocabulary):
    return np.ones(vocab.vocab_size, bool)
  own_word = RESERVED_IDS + (len(SPECIAL_PIECES) if _special_pieces(vocab) == SPECIAL_PIECES
                             else 0)
  return np.array([token_id < own_word or vocab.piece(token_id).startswith(WORD_START)
                   for token_id in range(vocab.vocab_size)], bool)
