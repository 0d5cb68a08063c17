"""Synthetic tasks; text, TSV and their errors; vocabulary sampling and reuse; the token cache."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, text_config, write_lines
from t2t_jax.data import pipeline as data
from t2t_jax.data import tokenizer


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
  assert boundaries[0] == 8 and boundaries[-1] == 100
  assert all(b % 8 == 0 for b in boundaries[:-1]) and boundaries == sorted(set(boundaries))
  assert data.bucket_boundaries(256, 8, 1.1)[-1] == 256


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


def test_vocab_sample_is_spread_over_the_whole_stream_within_budget():
  texts = (f'line{i:05d}' for i in range(20_000))  # A generator: read once, never stored.
  sample = tokenizer.sample_texts(texts, max_chars=9_000, seed=0)
  assert 8_000 < sum(map(len, sample)) <= 9_000
  numbers = [int(text[4:]) for text in sample]
  assert numbers == sorted(set(numbers))  # Distinct, in corpus order.
  quarters = np.histogram(numbers, bins=4, range=(0, 20_000))[0]
  assert quarters.min() > 150  # About 225 per quarter: not the first lines.
  again = tokenizer.sample_texts((f'line{i:05d}' for i in range(20_000)), 9_000, seed=0)
  assert again == sample


def test_vocabulary_learns_from_late_lines_of_a_large_corpus(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path, count=2000)
  late = ['zyx wvu'] * 200  # Characters that occur only at the end of the corpus.
  for key in ('train_src', 'train_tgt'):
    with open(config.data[key], 'a', encoding='utf-8') as f:
      f.write(''.join(line + '\n' for line in late))
  config.data.vocab_sample_chars = 3000  # About a tenth of the corpus.
  vocab = data.load_vocab(config, str(tmp_path))
  assert tokenizer.UNK_ID not in vocab.encode(['zyx wvu'])[0]


def test_token_cache_is_hit_and_keyed_by_data_and_vocab(tiny_config, tmp_path, caplog):
  config = text_config(tiny_config, tmp_path)
  workdir = str(tmp_path / 'work')
  first, built = data.load_split(config, workdir, 'train')
  assert built
  with caplog.at_level('INFO'):
    second, built = data.load_split(config, workdir, 'train')
  assert not built and 'Token cache hit' in caplog.text
  assert [list(s) for s in second.inputs] == [list(s) for s in first.inputs]
  assert isinstance(second.inputs.tokens, np.memmap)  # Read from disk, not re-tokenised.
  with open(config.data.train_src, 'a', encoding='utf-8') as f:
    f.write('cat dog\n')
  with open(config.data.train_tgt, 'a', encoding='utf-8') as f:
    f.write('katze hund\n')
  changed, built = data.load_split(config, workdir, 'train')
  assert built and len(changed) == len(first) + 1
  config.data.vocab_size = 36
  config.data.vocab_path = str(tmp_path / 'other.model')
  _, built = data.load_split(config, workdir, 'train')
  assert built and len(os.listdir(os.path.join(workdir, 'tokens'))) == 3


def test_failed_build_leaves_no_cache_entry(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  workdir = str(tmp_path / 'work')
  vocab = data.load_vocab(config, workdir)
  with open(config.data.train_src, 'a', encoding='utf-8') as f:
    f.write('one more line\n')
  with pytest.raises(data.DataError, match=r'train\.src has 201 lines but .*train\.tgt has 200'):
    data.load_split(config, workdir, 'train', vocab)
  assert os.listdir(os.path.join(workdir, 'tokens')) == []


def test_skip_counts_are_logged_again_on_a_cache_hit(tiny_config, tmp_path, caplog):
  config = text_config(tiny_config, tmp_path)
  config.data.bad_lines = 'skip'
  for key, bad in (('train_src', b'\xff oops\n'), ('train_tgt', b'\n')):
    with open(config.data[key], 'ab') as f:
      f.write(b'fine line\n' + bad)
  with caplog.at_level('WARNING'):
    task = data.load(config, str(tmp_path))
  assert len(task.train) == 201 and 'skipped 1 of 202 pairs (1 undecodable)' in caplog.text
  caplog.clear()
  with caplog.at_level('WARNING'):
    data.load(config, str(tmp_path))
  assert '1 undecodable pairs were skipped when this cache entry was built' in caplog.text


def test_tsv_source_and_its_bad_lines(tiny_config, tmp_path, caplog):
  config = text_config(tiny_config, tmp_path)
  for split in ('train', 'eval'):
    with open(config.data[f'{split}_src']) as s, open(config.data[f'{split}_tgt']) as t:
      lines = [f'{a.strip()}\t{b.strip()}' for a, b in zip(s, t)]
    config.data[f'{split}_tsv'] = write_lines(tmp_path / f'{split}.tsv', lines)
  config.data.source = 'tsv'
  task = data.load(config, str(tmp_path / 'tsv'))
  text = data.load(text_config(tiny_config, tmp_path), str(tmp_path / 'text'))
  assert task.eval.sources == text.eval.sources and len(task.train) == len(text.train) == 200
  with open(config.data.train_tsv, 'a', encoding='utf-8') as f:
    f.write('no tab here\n')
  config.data.source = 'tsv'
  with pytest.raises(data.DataError, match=r'train\.tsv:201: 1 tab-separated fields, expected 2'):
    data.load(config, str(tmp_path / 'tsv'))
  config.data.bad_lines = 'skip'
  with caplog.at_level('WARNING'):
    assert len(data.load(config, str(tmp_path / 'tsv')).train) == 200
  assert 'skipped 1 of 201 pairs (1 malformed)' in caplog.text


def test_unknown_source_and_batching_are_refused(tiny_config, tmp_path):
  tiny_config.data.source = 'csv'
  with pytest.raises(ValueError, match="config.data.source must be .* got 'csv'"):
    data.load(tiny_config, str(tmp_path))
  tiny_config.data.source = 'synthetic'
  tiny_config.data.batching = 'bins'
  task = data.load(tiny_config, str(tmp_path))
  with pytest.raises(ValueError, match="config.data.batching must be one of .* got 'bins'"):
    data.make_batchers(tiny_config, task.train, task.eval, 1)


@pytest.mark.slow
def test_prepare_cli_builds_then_hits_the_cache(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  command = [sys.executable, '-m', 't2t_jax.prepare', '--config=configs/tiny.py',
             '--config.data.source=text', f'--config.data.cache_dir={tmp_path / "cache"}',
             '--config.data.vocab_size=40'] + [
                 f'--config.data.{key}={config.data[key]}'
                 for key in ('train_src', 'train_tgt', 'eval_src', 'eval_tgt')]
  runs = []
  for _ in range(2):
    output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True,
                            timeout=300, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    runs.append([json.loads(line) for line in output.strip().splitlines()])
  assert [(r['split'], r['pairs'], r['cache']) for r in runs[0]] == [('train', 200, 'built'),
                                                                      ('eval', 20, 'built')]
  assert [r['cache'] for r in runs[1]] == ['hit', 'hit']
  assert (tmp_path / 'cache' / 'vocab.model').exists()
  # Training with the same cache_dir finds everything ready.
  config.data.cache_dir = str(tmp_path / 'cache')
  task = data.load(config, str(tmp_path / 'run'))
  assert task.vocab.path == str(tmp_path / 'cache' / 'vocab.model')
  assert not (tmp_path / 'run').exists()



def _main_on_training_lines(tmp_path, source_lines, target_lines):
  """`python -m t2t_jax.main` training on these lines (bad ones skipped); (exit code, stderr)."""
  paths = {key: write_lines(tmp_path / key, lines) for key, lines in [
      ('train_src', source_lines), ('train_tgt', target_lines), ('eval_src', ['cat dog']),
      ('eval_tgt', ['katze hund'])]}
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
             f'--workdir={tmp_path / "run"}', '--config.data.source=text',
             '--config.data.vocab_size=40', '--config.data.bad_lines=skip'] + [
                 f'--config.data.{key}={path}' for key, path in paths.items()]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL)
  return result.returncode, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize('source_lines, target_lines, told', [
    ([], [], 'empty (0 pairs read)'),
    (['', 'cat', b'\xff dog'], ['katze', '', 'hund'],
     "all 3 read were skipped as bad lines (2 empty, 1 undecodable) under "
     "config.data.bad_lines='skip'"),
], ids=['empty', 'all_skipped'])
def test_empty_or_all_skipped_training_data_names_the_files_in_one_line(
    tmp_path, source_lines, target_lines, told):
  code, stderr = _main_on_training_lines(tmp_path, source_lines, target_lines)
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert code == 1 and 'Traceback' not in stderr and len(errors) == 1, stderr
  assert errors[0] == f'error: {tmp_path}/train_src / {tmp_path}/train_tgt: no pairs: {told}' + (
      '. Point config.data at files with pairs.' if not source_lines else
      '. Fix the data or point config.data at other files.')
  assert 'sentences_' not in stderr  # SentencePiece never saw the empty corpus.


def test_vocabulary_bytes_depend_only_on_the_sentences_and_training_is_quiet(tmp_path, capfd):
  sentences = [f'{a} {b}' for a in ('cat', 'dog', 'tree') for b in ('house', 'car', 'city')]
  for name in ('a.model', 'b.model'):
    tokenizer.train_sentencepiece(sentences * 20, str(tmp_path / name), 18)
  assert (tmp_path / 'a.model').read_bytes() == (tmp_path / 'b.model').read_bytes()
  assert 'deprecated' not in capfd.readouterr().err
  assert sorted(os.listdir(tmp_path)) == ['a.model', 'b.model']  # No scratch left.
