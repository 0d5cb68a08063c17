"""Labelled text for classifiers: TSV files of text (or text pairs) and a label, as token ids.

A file has `text<TAB>label` or `text<TAB>text2<TAB>label` lines, or a header naming its columns
(GLUE's `sentence  label`, `sentence1  sentence2  label`). The training file's labels are the
run's label set (saved in its workdir as labels.txt); an example is encoded BERT-style as
[CLS] text [SEP] text2 EOS with its label as the target: the label's index + 1 (0 is padding),
or for regression [1, the float32's bits as an int32], so that every target is int32 ids.
"""

import collections
import dataclasses
import math
import os

from absl import logging
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import EOS_ID
from t2t_jax.data import sources
from t2t_jax.data import tokenizer
from t2t_jax.errors import DataError  # Defined with the other user errors.

# Header column names (lower-cased); other columns, e.g. GLUE's index, are ignored.
TEXT_COLUMNS = ('text', 'sentence', 'sentence1')
TEXT2_COLUMNS = ('text2', 'sentence2')
LABEL_COLUMN = 'label'
_FIX = "Fix the file or set config.data.bad_lines='skip'."


@dataclasses.dataclass
class LabelledText:
  """The examples of one file, in file order; texts2 is None for single texts."""
  texts: list[str]
  texts2: list[str] | None
  labels: list[str]
  lines: list[int]  # 1-based line of each example in `path`, for messages.
  path: str


@dataclasses.dataclass
class Encoded:
  """Examples as token ids and targets, with their text: the pieces of a pipeline.Split."""
  inputs: list[np.ndarray]
  targets: list[np.ndarray]
  texts: list[str]  # A pair's texts joined by a tab, as in the file.
  labels: list[str]


@dataclasses.dataclass(frozen=True)
class _Columns:
  """Where a line's fields go, and how to say what a line should hold."""
  count: int
  text: int
  text2: int | None
  label: int
  expected: str  # E.g. '2 (text, label)'.


def _plain_columns(count: int) -> _Columns:
  """The columns of a file without a header, from the field count of its first example."""
  if count == 2:
    return _Columns(2, 0, None, 1, '2 (text, label)')
  return _Columns(3, 0, 1, 2, '3 (text, text2, label)')


def _header_columns(fields: list[str], path: str) -> _Columns | None:
  """The columns a header line names, or None when the line is an example, not a header.

  A line naming a text column but no label column, or the reverse, is refused rather than
  read as an example (whose label would be a column name).
  """
  names = [field.strip().lower() for field in fields]
  text = next((i for i, name in enumerate(names) if name in TEXT_COLUMNS), None)
  label = names.index(LABEL_COLUMN) if LABEL_COLUMN in names else None
  if text is None and label is None:
    return None
  if text is None or label is None:
    missing = (f"text column ({', '.join(TEXT_COLUMNS)})" if text is None
               else f"'{LABEL_COLUMN}' column")
    raise DataError(f'{path}:1: the header {names} has no {missing}: rename that column, or '
                    'remove the header for text<TAB>label or text<TAB>text2<TAB>label lines')
  text2 = next((i for i, name in enumerate(names) if name in TEXT2_COLUMNS), None)
  return _Columns(len(names), text, text2, label,
                  f'{len(names)} (the columns of the header on line 1)')


def _plural(count: int, word: str) -> str:
  return f'{count} {word}' if count == 1 else f'{count} {word}s'


def read_tsv(path: str, bad_lines: str) -> LabelledText:
  """The labelled examples of the TSV file at `path`, read line by line.

  Each field is stripped. A line with the wrong number of fields, an empty field or bytes
  that are not UTF-8 raises a DataError naming path:line under bad_lines='error'; under
  'skip' it is skipped, and the counts by reason are logged in one warning.
  """
  if bad_lines not in sources.BAD_LINE_POLICIES:
    raise ConfigError(f'config.data.bad_lines must be one of {sources.BAD_LINE_POLICIES}, '
                      f'got {bad_lines!r}')
  texts, texts2, labels, lines = [], [], [], []
  skipped = collections.Counter()
  columns, header = None, False

  def bad(problem: str, reason: str):
    if bad_lines == 'error':
      raise DataError(f'{problem}. {_FIX}')
    skipped[reason] += 1

  try:
    f = open(path, 'rb')
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None
  with f:
    for number, raw in enumerate(f, start=1):
      where = f'{path}:{number}'
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        bad(f'{where}: not valid UTF-8 (byte {e.start})', 'undecodable')
        continue
      if number == 1:
        line = line.removeprefix('\ufeff')  # The byte-order mark some spreadsheets write.
      fields = [field.strip() for field in line.rstrip('\r\n').split('\t')]
      if number == 1:
        columns = _header_columns(fields, path)
        header = columns is not None
        if header:
          continue
      if columns is None and len(fields) in (2, 3):
        columns = _plain_columns(len(fields))
      if columns is None or len(fields) != columns.count:
        expected = columns.expected if columns else '2 (text, label) or 3 (text, text2, label)'
        bad(f'{where}: {_plural(len(fields), "tab-separated field")}, expected {expected}',
            'malformed')
        continue
      example = {'text': fields[columns.text], 'label': fields[columns.label]}
      if columns.text2 is not None:
        example['text2'] = fields[columns.text2]
      if empty := [name for name, value in example.items() if not value]:
        bad(f'{where}: empty {" and ".join(empty)}', 'empty')
        continue
      texts.append(example['text'])
      texts2.append(example.get('text2'))
      labels.append(example['label'])
      lines.append(number)

  _report_read(path, len(labels), skipped, header)
  pairs = columns.text2 is not None
  return LabelledText(texts, texts2 if pairs else None, labels, lines, path)


def _report_read(path: str, kept: int, skipped: collections.Counter, header: bool) -> None:
  """A DataError when `path` gave no examples (saying why); else the skipped lines' counts by
  reason, in one warning."""
  read = kept + sum(skipped.values())
  if not kept:
    raise DataError(f'{path}: no labelled examples: ' + (
        f'all {read} read were skipped as bad lines ({sources.describe(skipped)}) under '
        "config.data.bad_lines='skip'. Fix the data or point config.data at another file."
        if read else ('only a header line' if header else 'the file is empty') +
        '. Point config.data at a file of text<TAB>label lines.'))
  if skipped:
    logging.warning('%s: skipped %d of %d examples (%s)', path, sum(skipped.values()), read,
                    sources.describe(skipped))


def _regression_value(data: LabelledText, index: int) -> np.float32:
  """The label of example `index` as a finite float32, or a DataError naming its line."""
  label = data.labels[index]
  try:
    value = float(label)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
    raise DataError(f'{data.path}:{data.lines[index]}: label {label!r} is not a finite number, '
                    'and a regression task needs one on every line')
  return np.float32(value)


def label_names(data: LabelledText, regression: bool) -> list[str]:
  """The label set of a training file: sorted, numerically when every label is an integer.

  A regression task has none ([]), but every label must be a number. A classifier needs at
  least two labels: one alone means the wrong column, or a file that cannot teach anything.
  """
  if regression:
    for index in range(len(data.labels)):
      _regression_value(data, index)
    return []
  names = set(data.labels)
  try:
    names = sorted(names, key=lambda name: (int(name), name))  # '2' before '10'.
  except ValueError:
    names = sorted(names)
  if len(names) < 2:
    raise DataError(f'{data.path}: every example has the label {names[0]!r}; a classifier '
                    'needs at least two labels (is the label the last column?)')
  return names


def _pair_lengths(first: int, second: int, budget: int) -> tuple[int, int]:
  """The lengths left after dropping tokens from the end of the longer text (the second on a
  tie), one at a time, until both fit in `budget` tokens: computed, not looped."""
  if first + second <= budget:
    return first, second
  shorter = min(first, second)
  if 2 * shorter <= budget:  # The shorter one is never trimmed.
    return (first, budget - first) if first == shorter else (budget - second, second)
  return budget - budget // 2, budget // 2  # Both trimmed, taking turns.


def encode(vocab: tokenizer.Vocabulary, data: LabelledText, names: list[str], regression: bool,
           max_len: int) -> Encoded:
  """Token ids [CLS] text EOS, or [CLS] text [SEP] text2 EOS, and each example's target.

  An example longer than max_len is truncated to it, EOS kept (a pair's longer text first);
  the count is logged once. A label not in `names` (the training file's) is a DataError.
  """
  pairs = data.texts2 is not None
  if max_len < (4 if pairs else 3):
    raise ConfigError(f'config.data.max_len={max_len} leaves no room for text between '
                      '[CLS]' + (', [SEP]' if pairs else '') + ' and EOS')
  if regression:
    targets = [np.array([1, _regression_value(data, i).view(np.int32)], np.int32)
               for i in range(len(data.labels))]
  else:
    index = {name: i for i, name in enumerate(names)}
    for label, line in zip(data.labels, data.lines):
      if label not in index:
        raise DataError(f"{data.path}:{line}: label {label!r} is not one of the training "
                        f"file's labels {names} (saved in the run)")
    targets = [np.array([index[label] + 1], np.int32) for label in data.labels]

  ids = vocab.encode(data.texts + (data.texts2 if pairs else []))
  inputs, truncated = [], 0
  if pairs:
    budget = max_len - 3
    for first, second in zip(ids[:len(data.texts)], ids[len(data.texts):]):
      keep_first, keep_second = _pair_lengths(len(first), len(second), budget)
      truncated += (keep_first, keep_second) != (len(first), len(second))
      inputs.append(np.array([tokenizer.CLS_ID, *first[:keep_first], tokenizer.SEP_ID,
                              *second[:keep_second], EOS_ID], np.int32))
    texts = [f'{text}\t{text2}' for text, text2 in zip(data.texts, data.texts2)]
  else:
    budget = max_len - 2
    for text_ids in ids:
      truncated += len(text_ids) > budget
      inputs.append(np.array([tokenizer.CLS_ID, *text_ids[:budget], EOS_ID], np.int32))
    texts = list(data.texts)
  if truncated:
    logging.warning('%s: truncated %d of %d examples to config.data.max_len=%d tokens',
                    data.path, truncated, len(inputs), max_len)
  return Encoded(inputs, targets, texts, list(data.labels))


def subset(data: LabelledText, indices) -> LabelledText:
  """The examples of `data` at `indices`, in that order."""
  pick = lambda values: [values[i] for i in indices]
  return LabelledText(pick(data.texts), None if data.texts2 is None else pick(data.texts2),
                      pick(data.labels), pick(data.lines), data.path)


def split_train(data: LabelledText, holdout: float, limit: int
                ) -> tuple[LabelledText, LabelledText | None]:
  """(training examples, held-out examples or None): a fraction `holdout` of the file held out
  for evaluation, then at most `limit` of the rest kept (0: all), both drawn by a fixed seed,
  the same in every run, whatever its config.seed; the examples keep their file order."""
  order = np.random.default_rng(20191128).permutation(len(data.texts))
  held = int(round(holdout * len(order)))
  kept = order[held:]
  if limit:
    kept = kept[:limit]
  return (subset(data, np.sort(kept)),
          subset(data, np.sort(order[:held])) if held else None)


def decode_regression(targets_B2: np.ndarray) -> np.ndarray:
  """The float32 values of regression targets [B, 2] ([1, bits] each): the inverse of encode."""
  targets_B2 = np.asarray(targets_B2)
  if targets_B2.ndim != 2 or targets_B2.shape[1] != 2:
    raise ValueError(f'regression targets are [B, 2], got shape {targets_B2.shape}')
  return np.ascontiguousarray(targets_B2[:, 1], np.int32).view(np.float32)


def write_labels(path: str, names: list[str]) -> None:
  """Saves a run's label set, one per line, replacing the file whole: a run resumed after a
  crash mid-write must not read part of the set."""
  with open(path + '.tmp', 'w', encoding='utf-8', newline='\n') as f:
    f.writelines(f'{name}\n' for name in names)
  os.replace(path + '.tmp', path)


def read_labels(path: str) -> list[str]:
  """The label set `write_labels` saved at `path`."""
  try:
    with open(path, encoding='utf-8') as f:
      return [line.rstrip('\r\n') for line in f]
  except OSError as e:
    raise DataError(f'cannot read the label set {path}: {e.strerror}. A classifier run saves '
                    'it in its workdir when training starts.') from None
