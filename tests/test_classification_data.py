"""Labelled TSV files for classifiers: reading, label sets, encoding, truncation, their errors;
the encoder-only vocabulary's [CLS]/[SEP]/[MASK] and its word starts."""

import math
import random

import ml_collections
import numpy as np
import pytest

from conftest import write_lines
from t2t_jax import ConfigError
from t2t_jax.data import classification
from t2t_jax.data import tokenizer
from t2t_jax.errors import DataError

# Ids 2-5 are taken by stand-ins for unknown, [CLS], [SEP] and [MASK], so a=6, b=7, ... f=11.
VOCAB = tokenizer.SymbolVocabulary(['<unk>', '[CLS]', '[SEP]', '[MASK]', 'a', 'b', 'c', 'd',
                                    'e', 'f'])
CLS, SEP, EOS = 3, 4, 1
A, B, C, D, E, F = range(6, 12)


def _labelled(texts, labels, texts2=None, path='mem.tsv'):
  return classification.LabelledText(list(texts), None if texts2 is None else list(texts2),
                                     list(labels), list(range(1, len(labels) + 1)), path)


def test_headerless_single_texts_are_stripped_with_their_lines(tmp_path):
  path = write_lines(tmp_path / 'train.tsv', ['  a b \t pos \r', 'c\tneg', 'd e f\tpos'])
  data = classification.read_tsv(path, 'error')
  assert data.texts == ['a b', 'c', 'd e f']
  assert data.texts2 is None
  assert data.labels == ['pos', 'neg', 'pos']
  assert data.lines == [1, 2, 3]
  assert data.path == path


def test_headerless_pairs(tmp_path):
  path = write_lines(tmp_path / 'train.tsv', ['a\tb c\tyes', 'd\te\tno'])
  data = classification.read_tsv(path, 'error')
  assert (data.texts, data.texts2, data.labels) == (['a', 'd'], ['b c', 'e'], ['yes', 'no'])


def test_header_names_the_columns_and_others_are_ignored(tmp_path):
  path = write_lines(tmp_path / 'train.tsv', ['Index\tLabel\tsentence2\tSentence1',
                                              '0\t1\tsecond\tfirst', '1\t0\tfour\tthree'])
  data = classification.read_tsv(path, 'error')
  assert (data.texts, data.texts2, data.labels, data.lines) == (
      ['first', 'three'], ['second', 'four'], ['1', '0'], [2, 3])


def test_header_with_one_text_column_gives_single_texts(tmp_path):
  path = write_lines(tmp_path / 'train.tsv', ['sentence\tlabel', 'a b\t1'])
  data = classification.read_tsv(path, 'error')
  assert (data.texts, data.texts2, data.labels, data.lines) == (['a b'], None, ['1'], [2])


@pytest.mark.parametrize('labels, expected', [
    (['10', '2', '1', '2'], ['1', '2', '10']),
    (['pos', 'neg', 'neutral'], ['neg', 'neutral', 'pos']),
    (['2', 'b', '10'], ['10', '2', 'b']),  # Not all integers: sorted as text.
    (['-1', '1', '0'], ['-1', '0', '1']),
])
def test_label_names_are_sorted_numerically_when_all_are_integers(labels, expected):
  assert classification.label_names(_labelled(['x'] * len(labels), labels), False) == expected


def test_a_single_label_is_refused():
  with pytest.raises(DataError, match=r"mem.tsv: every example has the label 'pos'"):
    classification.label_names(_labelled(['x', 'y'], ['pos', 'pos']), False)


def test_unknown_label_names_file_and_line(tmp_path):
  train = classification.read_tsv(write_lines(tmp_path / 'train.tsv', ['a\tpos', 'b\tneg']),
                                  'error')
  names = classification.label_names(train, False)
  evaluation = classification.read_tsv(
      write_lines(tmp_path / 'eval.tsv', ['a\tpos', 'b\tneg', 'c\tmaybe']), 'error')
  with pytest.raises(DataError) as error:
    classification.encode(VOCAB, evaluation, names, False, 16)
  assert str(error.value) == (f"{tmp_path / 'eval.tsv'}:3: label 'maybe' is not one of the "
                              "training file's labels ['neg', 'pos'] (saved in the run)")


def test_classification_targets_are_label_index_plus_one():
  data = _labelled(['a', 'b c', 'd'], ['pos', 'neg', 'neutral'])
  encoded = classification.encode(VOCAB, data, ['neg', 'neutral', 'pos'], False, 16)
  assert [t.tolist() for t in encoded.targets] == [[3], [1], [2]]
  assert all(t.dtype == np.int32 for t in encoded.targets + encoded.inputs)
  assert [i.tolist() for i in encoded.inputs] == [[CLS, A, EOS], [CLS, B, C, EOS],
                                                  [CLS, D, EOS]]
  assert encoded.texts == ['a', 'b c', 'd']
  assert encoded.labels == ['pos', 'neg', 'neutral']


def test_pairs_are_joined_by_sep():
  data = _labelled(['a b'], ['1'], texts2=['c'])
  encoded = classification.encode(VOCAB, data, ['0', '1'], False, 16)
  assert encoded.inputs[0].tolist() == [CLS, A, B, SEP, C, EOS]
  assert encoded.targets[0].tolist() == [2]
  assert encoded.texts == ['a b\tc']


@pytest.mark.parametrize('lines, message', [
    (['a\tpos', 'just text'], ':2: 1 tab-separated field, expected 2 (text, label)'),
    (['a\tb\tpos', 'c\tpos'], ':2: 2 tab-separated fields, expected 3 (text, text2, label)'),
    (['a\tb\tc\tpos'], ':1: 4 tab-separated fields, expected 2 (text, label) or 3 '
                       '(text, text2, label)'),
    (['text\tlabel', 'a\tb\tpos'], ':2: 3 tab-separated fields, expected 2 (the columns of '
                                   'the header on line 1)'),
    (['a\tpos', '\tneg'], ':2: empty text'),
    (['a\tpos', 'b\t '], ':2: empty label'),
    (['a\tb\tpos', 'c\t\tneg'], ':2: empty text2'),
    ([b'a\tpos', b'\xff\tneg'], ':2: not valid UTF-8 (byte 0)'),
], ids=['one_field', 'two_of_three', 'four', 'header_count', 'empty_text', 'empty_label',
        'empty_text2', 'undecodable'])
def test_bad_lines_are_errors_naming_file_and_line(tmp_path, lines, message):
  path = write_lines(tmp_path / 'bad.tsv', lines)
  with pytest.raises(DataError) as error:
    classification.read_tsv(path, 'error')
  assert str(error.value) == f"{path}{message}. Fix the file or set config.data.bad_lines='skip'."
  assert '\n' not in str(error.value)


def test_bad_lines_are_skipped_and_counted_in_one_warning(tmp_path, caplog):
  path = write_lines(tmp_path / 'train.tsv', [
      b'a\tpos', b'only text', b'\tneg', b'b\t', b'\xfe\xff\tpos', b'c d\tneg'])
  with caplog.at_level('WARNING'):
    data = classification.read_tsv(path, 'skip')
  assert (data.texts, data.labels, data.lines) == (['a', 'c d'], ['pos', 'neg'], [1, 6])
  warnings = [r.getMessage() for r in caplog.records if 'skipped' in r.getMessage()]
  assert warnings == [f'{path}: skipped 4 of 6 examples (2 empty, 1 malformed, 1 undecodable)']


@pytest.mark.parametrize('lines, bad_lines, message', [
    ([], 'error', 'no labelled examples: the file is empty.'),
    (['sentence\tlabel'], 'error', 'no labelled examples: only a header line.'),
    (['x', '\tpos'], 'skip', 'no labelled examples: all 2 read were skipped as bad lines '
                             "(1 empty, 1 malformed) under config.data.bad_lines='skip'."),
    (['sentence\tscore', 'a\t1'], 'error',
     ":1: the header ['sentence', 'score'] has no 'label' column"),
    (['question\tlabel', 'a\t1'], 'error',
     ":1: the header ['question', 'label'] has no text column (text, sentence, sentence1)"),
], ids=['empty', 'header_only', 'all_skipped', 'no_label_column', 'no_text_column'])
def test_files_without_examples_or_usable_header(tmp_path, lines, bad_lines, message):
  path = write_lines(tmp_path / 'train.tsv', lines)
  with pytest.raises(DataError) as error:
    classification.read_tsv(path, bad_lines)
  assert str(error.value).startswith(f'{path}{message}' if message[0] == ':'
                                     else f'{path}: {message}')
  assert '\n' not in str(error.value)


def test_missing_file(tmp_path):
  with pytest.raises(DataError, match=r'^cannot read .*nowhere\.tsv: No such file'):
    classification.read_tsv(str(tmp_path / 'nowhere.tsv'), 'error')


def test_single_texts_are_truncated_keeping_cls_and_eos(caplog):
  data = _labelled(['a b c d e', 'f', 'a b c'], ['x', 'y', 'x'])
  with caplog.at_level('WARNING'):
    encoded = classification.encode(VOCAB, data, ['x', 'y'], False, 5)
  assert [i.tolist() for i in encoded.inputs] == [[CLS, A, B, C, EOS], [CLS, F, EOS],
                                                  [CLS, A, B, C, EOS]]
  assert 'mem.tsv: truncated 1 of 3 examples to config.data.max_len=5 tokens' in caplog.text


def test_pairs_are_truncated_longer_text_first(caplog):
  # max_len 8 leaves 5 tokens for the two texts.
  data = _labelled(['a b c d e f', 'a b c', 'a b', 'a b c d', 'a'],
                   ['x'] * 5, texts2=['f', 'd e f', 'c d e f a b', 'c d e f', 'b'])
  with caplog.at_level('WARNING'):
    encoded = classification.encode(VOCAB, data, ['x', 'y'], False, 8)
  assert [i.tolist() for i in encoded.inputs] == [
      [CLS, A, B, C, D, SEP, F, EOS],  # 6 + 1: the first loses 2.
      [CLS, A, B, C, SEP, D, E, EOS],  # 3 + 3: a tie trims the second.
      [CLS, A, B, SEP, C, D, E, EOS],  # 2 + 6: the second loses 3.
      [CLS, A, B, C, SEP, C, D, EOS],  # 4 + 4: turn by turn, the second first.
      [CLS, A, SEP, B, EOS],  # Fits.
  ]
  assert 'mem.tsv: truncated 4 of 5 examples to config.data.max_len=8 tokens' in caplog.text


def _trim_one_at_a_time(first: int, second: int, budget: int) -> tuple[int, int]:
  """The rule as stated: drop a token from the longer text (the second on a tie) until both
  fit."""
  while first + second > budget:
    if first > second:
      first -= 1
    else:
      second -= 1
  return first, second


def test_pair_truncation_matches_trimming_token_by_token():
  texts = ['a b c d e f'[:2 * n].strip() for n in range(7)]  # 0 to 6 tokens.
  for max_len in range(4, 12):
    for first in texts:
      for second in texts:
        data = _labelled([first], ['x'], texts2=[second])
        inputs = classification.encode(VOCAB, data, ['x', 'y'], False, max_len).inputs[0]
        kept = _trim_one_at_a_time(len(first.split()), len(second.split()), max_len - 3)
        expected = [CLS, *VOCAB.encode([first])[0][:kept[0]], SEP,
                    *VOCAB.encode([second])[0][:kept[1]], EOS]
        assert inputs.tolist() == expected, (max_len, first, second)
        assert len(inputs) <= max_len


def test_max_len_without_room_for_text_is_refused():
  with pytest.raises(ConfigError, match=r'config.data.max_len=3 leaves no room'):
    classification.encode(VOCAB, _labelled(['a'], ['x'], texts2=['b']), ['x', 'y'], False, 3)


def test_regression_targets_round_trip_through_their_bits():
  data = _labelled(['a', 'b', 'c', 'd'], ['0.5', '-2', '0.1', '1e30'])
  assert classification.label_names(data, True) == []
  encoded = classification.encode(VOCAB, data, [], True, 16)
  targets_B2 = np.stack(encoded.targets)
  # IEEE 754 single precision: 0.5 = 0x3f000000, -2 = 0xc0000000, 0.1 = 0x3dcccccd.
  assert targets_B2.dtype == np.int32
  assert targets_B2.tolist() == [[1, 0x3f000000], [1, 0xc0000000 - 2**32], [1, 0x3dcccccd],
                                 [1, 0x7149f2ca]]
  values = classification.decode_regression(targets_B2)
  assert values.dtype == np.float32
  assert values.tolist() == [0.5, -2.0, float(np.float32(0.1)), float(np.float32(1e30))]


@pytest.mark.parametrize('label', ['high', 'nan', 'inf', '1e39'])
def test_regression_labels_must_be_finite_float32_numbers(label):
  data = _labelled(['a', 'b', 'c'], ['1.5', label, '2'])
  with pytest.raises(DataError, match=rf"^mem.tsv:2: label '{label}' is not a finite number"):
    classification.label_names(data, True)


def test_label_set_round_trip(tmp_path):
  names = ['entailment', 'neutral', 'contradiction', 'ja ✓', 'x y']
  classification.write_labels(str(tmp_path / 'labels.txt'), names)
  assert (tmp_path / 'labels.txt').read_bytes() == '\n'.join(names).encode('utf-8') + b'\n'
  assert classification.read_labels(str(tmp_path / 'labels.txt')) == names
  with pytest.raises(DataError, match=r'^cannot read the label set .*missing\.txt'):
    classification.read_labels(str(tmp_path / 'missing.txt'))


# The encoder-only vocabulary.

def _sentences(count: int = 300) -> list[str]:
  rng = random.Random(0)
  words = 'the cat dog sat on mat a big small red house tree ran fast slow'.split()
  return [' '.join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def _data_config(vocab_size: int = 30) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({'vocab_size': vocab_size, 'vocab_type': 'unigram',
                                    'vocab_sample_chars': 10**6})


@pytest.fixture(scope='module')
def special_vocab(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('vocab') / 'special.model')
  return tokenizer.load_or_train(path, _sentences, _data_config(), seed=0, special=True)


def test_special_pieces_take_ids_3_to_5(special_vocab):
  assert [special_vocab.piece(i) for i in range(6)] == [
      '<pad>', '</s>', '<unk>', '[CLS]', '[SEP]', '[MASK]']
  assert (tokenizer.CLS_ID, tokenizer.SEP_ID, tokenizer.MASK_ID) == (3, 4, 5)
  pieces = {special_vocab.piece(i): i for i in range(special_vocab.vocab_size)}
  # The word mark SentencePiece puts before the first word, then [MASK] whole.
  assert special_vocab.encode(['[MASK]'])[0] == [pieces['\u2581'], 5]
  assert 5 in special_vocab.encode(['the [MASK] sat'])[0]
  # Reloading checks the pieces again and accepts them.
  again = tokenizer.load_or_train(special_vocab.path, _sentences, _data_config(), seed=0,
                                  special=True)
  assert again.piece(5) == '[MASK]'


def test_a_vocabulary_without_special_pieces_is_refused_for_an_encoder(tmp_path):
  path = str(tmp_path / 'plain.model')
  plain = tokenizer.load_or_train(path, _sentences, _data_config(), seed=0)
  assert '[MASK]' not in [plain.piece(i) for i in range(plain.vocab_size)]
  with pytest.raises(ConfigError) as error:
    tokenizer.load_or_train(path, _sentences, _data_config(), seed=0, special=True)
  assert str(error.value).startswith(f'{path} has no [CLS]/[SEP]/[MASK] at ids 3-5: it was not '
                                     'trained for an encoder-only model')


def test_word_start_table_of_a_special_vocabulary(special_vocab):
  table = tokenizer.word_start_table(special_vocab)
  assert table.dtype == bool and table.shape == (special_vocab.vocab_size,)
  pieces = {special_vocab.piece(i): i for i in range(special_vocab.vocab_size)}
  assert table[:6].all()  # Pad, EOS, unknown and the three special pieces.
  for starts_a_word in ('\u2581the', '\u2581cat', '\u2581'):
    if starts_a_word in pieces:
      assert table[pieces[starts_a_word]], starts_a_word
  for inside_a_word in ('s', 't', 'a', 'e'):
    assert not table[pieces[inside_a_word]], inside_a_word
  assert table.sum() == 6 + sum(p.startswith('\u2581') for p in pieces if pieces[p] >= 6)


def test_word_start_table_of_a_plain_vocabulary_judges_ids_3_to_5_by_their_text(tmp_path):
  path = str(tmp_path / 'plain.model')
  tokenizer.train_sentencepiece(_sentences(), path, 30)
  plain = tokenizer.SentencePieceVocabulary(path)
  table = tokenizer.word_start_table(plain)
  assert table[:3].all()
  assert [bool(t) for t in table[3:]] == [plain.piece(i).startswith('\u2581')
                                          for i in range(3, plain.vocab_size)]
  assert not table[3:].all() and table[3:].any()


def test_word_start_table_of_symbols():
  assert tokenizer.word_start_table(VOCAB).tolist() == [True] * 12
