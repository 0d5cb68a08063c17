"""Synthetic tasks, text reading and its errors, vocabulary caching, token-budget batches."""

import os

import numpy as np
import pytest

from conftest import text_config, write_lines
from t2t_jax import data
from t2t_jax import tokenizer


@pytest.mark.parametrize('task', data.SYNTHETIC_TASKS)
def test_synthetic_tasks_are_correct_and_held_out(tiny_config, task):
  tiny_config.data.task = task
  (train_src, train_tgt), (eval_src, eval_tgt) = data.synthetic_text(tiny_config.data, seed=0)
  assert len(train_src) == tiny_config.data.num_train
  assert not set(eval_src) & set(train_src)
  for source, target in zip(train_src[:50] + eval_src, train_tgt[:50] + eval_tgt):
    symbols = source.split()
    if task == 'copy':
      assert target.split() == symbols
    elif task == 'reverse':
      assert target.split() == symbols[::-1]
    elif task == 'sort':
      assert target.split() == sorted(symbols, key=int)
    else:
      a, b = ''.join(symbols).split('+')
      assert int(''.join(target.split())) == int(a) + int(b)


def test_synthetic_vocabulary_round_trip(tiny_config):
  vocab = data.synthetic_vocabulary(tiny_config.data)
  ids = vocab.encode(['3 1 7'])[0]
  assert min(ids) >= 2 and vocab.decode(ids + [1, 5, 6]) == '3 1 7'


def test_bucket_boundaries_cover_max_len():
  boundaries = data.bucket_boundaries(100, 8, 1.3)
  assert boundaries[0] == 8 and boundaries[-1] >= 100
  assert all(b % 8 == 0 for b in boundaries) and boundaries == sorted(set(boundaries))


def _split(lengths, seed=0):
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(2, 9, n).astype(np.int32) for n in lengths]
  return data.Split(seqs, [s[::-1].copy() for s in seqs], [''] * len(seqs), [''] * len(seqs))


def test_token_budget_batches_cover_each_example_once_per_epoch():
  lengths = np.random.default_rng(1).integers(1, 40, 300)
  split = _split(lengths)
  batches = data.TokenBudgetBatches(split, 256, data.bucket_boundaries(40, 8, 1.5), 4,
                                    shuffle=True, seed=3)
  for epoch in (0, 1):
    plan = batches.plan(epoch)
    seen = np.concatenate([indices for _, indices in plan])
    assert sorted(seen) == list(range(300))
    for bucket, indices in plan:
      rows, length = batches.rows[bucket], batches.boundaries[bucket]
      assert len(indices) <= rows and rows % 4 == 0
      assert rows * length <= 256 or rows == 4
      assert all(lengths[i] <= length for i in indices)
  assert [i.tolist() for _, i in batches.plan(0)] != [i.tolist() for _, i in batches.plan(1)]
  again = data.TokenBudgetBatches(split, 256, batches.boundaries, 4, shuffle=True, seed=3)
  assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(again.plan(1), batches.plan(1)))


def test_collated_batch_holds_the_examples():
  split = _split([3, 5])
  batches = data.TokenBudgetBatches(split, 64, [8], 2, shuffle=False, seed=0)
  batch = batches[0]
  assert batch['inputs'].shape == (8, 8)
  np.testing.assert_array_equal(batch['inputs'][1, :5], split.inputs[1])
  assert (batch['inputs'][1, 5:] == 0).all() and (batch['targets'][2:] == 0).all()


def test_train_iterator_resumes_from_its_state():
  split = _split(np.random.default_rng(2).integers(1, 20, 100))
  batches = data.TokenBudgetBatches(split, 64, [8, 16, 24], 1, shuffle=True, seed=0)
  iterator = data.train_iterator(batches)
  for _ in range(7):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(len(batches))]  # Crosses into the next epoch.
  resumed = data.train_iterator(batches)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    np.testing.assert_array_equal(got['inputs'], want['inputs'])


def test_misaligned_files_name_both(tmp_path):
  src = write_lines(tmp_path / 'a.en', ['one', 'two', 'three'])
  tgt = write_lines(tmp_path / 'a.de', ['eins', 'zwei'])
  with pytest.raises(data.DataError, match=r'a\.en has 3 lines but .*a\.de has 2'):
    data.read_parallel(src, tgt, 'error')


@pytest.mark.parametrize('bad, message', [(b'\xff\xfe oops', r'b\.de:2: not valid UTF-8'),
                                          (b'   ', r'b\.de:2: empty line')])
def test_bad_lines_error_names_file_and_line(tmp_path, bad, message):
  src = write_lines(tmp_path / 'b.en', ['one', 'two', 'three'])
  tgt = write_lines(tmp_path / 'b.de', [b'eins', bad, b'drei'])
  with pytest.raises(data.DataError, match=message):
    data.read_parallel(src, tgt, 'error')


def test_bad_lines_skipped_and_counted(tmp_path, caplog):
  src = write_lines(tmp_path / 'c.en', ['one', '', 'three', 'four'])
  tgt = write_lines(tmp_path / 'c.de', [b'eins', b'zwei', b'\xc3(', b'vier'])
  with caplog.at_level('WARNING'):
    sources, targets = data.read_parallel(src, tgt, 'skip')
  assert sources == ['one', 'four'] and targets == ['eins', 'vier']
  assert 'skipped 2 of 4 pairs (1 empty, 1 undecodable)' in caplog.text


def test_missing_file_is_named(tmp_path):
  with pytest.raises(data.DataError, match='cannot read .*nope.en'):
    data.read_parallel(str(tmp_path / 'nope.en'), str(tmp_path / 'nope.de'), 'error')


def test_vocabulary_is_trained_once_then_reused(tiny_config, tmp_path, caplog):
  config = text_config(tiny_config, tmp_path)
  task = data.load(config, str(tmp_path))
  path = tmp_path / 'vocab.model'
  assert task.vocab.vocab_size == 40 and path.exists()
  mtime = os.path.getmtime(path)
  with caplog.at_level('INFO'):
    again = data.load(config, str(tmp_path))
  assert os.path.getmtime(path) == mtime and 'Reusing the vocabulary' in caplog.text
  assert again.vocab.decode(again.eval.inputs[0]) == task.eval.sources[0]
  assert task.train.inputs[0][-1] == 1  # EOS ends every sequence.


def test_vocabulary_size_mismatch_is_refused(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  data.load(config, str(tmp_path))
  config.data.vocab_size = 48
  with pytest.raises(ValueError, match='vocab.model has 40 pieces but config.data.vocab_size'):
    data.load(config, str(tmp_path))


def test_too_large_vocabulary_for_corpus_is_explained(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path, count=20)
  config.data.vocab_size = 5000
  with pytest.raises(ValueError, match='smaller config.data.vocab_size'):
    data.load(config, str(tmp_path))


def test_long_pairs_are_dropped_and_counted(tiny_config, tmp_path, caplog):
  config = text_config(tiny_config, tmp_path)
  config.data.max_len = 4
  with caplog.at_level('WARNING'):
    task = data.load(config, str(tmp_path))
  assert all(len(seq) <= 4 for seq in list(task.train.inputs) + list(task.train.targets))
  assert 'longer than config.data.max_len=4' in caplog.text
  assert len(task.train) < 200


def test_sentencepiece_decode_stops_at_eos(tmp_path):
  path = str(tmp_path / 'v.model')
  tokenizer.train_sentencepiece(['a small test sentence'] * 50 + ['another line'] * 50, path,
                                20)
  vocab = tokenizer.SentencePieceVocabulary(path)
  ids = vocab.encode(['a small test'])[0]
  assert vocab.decode(ids + [1] + ids) == 'a small test'
