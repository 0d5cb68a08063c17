"""Translating a file in chunks: shares of processes, resuming after a crash or `kill -9` with
the output byte for byte an uninterrupted run's, and the manifest that refuses a mismatch."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from t2t_jax import ConfigError
from t2t_jax.deploy import file_translation
from t2t_jax.errors import DataError


def _reverse(lines, first_line):
  """A stand-in translation that depends on the line and its index, as sampled ones do."""
  return [f'{first_line + n}:{line[::-1]}' for n, line in enumerate(lines)]


def _write(path, text: str):
  path.write_bytes(text.encode('utf-8'))
  return str(path)


def _plan(tmp_path, source, **kw):
  kw.setdefault('chunk_lines', 3)
  return file_translation.Plan(source, str(tmp_path / 'out.txt'), **kw)


LINES = [f'line {n} ' + 'x' * (n % 4) for n in range(10)] + ['', 'last']


def test_a_file_is_translated_in_chunks_in_the_inputs_order(tmp_path):
  source = _write(tmp_path / 'in.txt', '\n'.join(LINES))  # No newline after the last line.
  assert file_translation.count_lines(source) == 12
  outcome = file_translation.translate_file(_plan(tmp_path, source), _reverse, progress=False)
  assert (outcome.lines, outcome.chunks, outcome.translated, outcome.merged) == (12, 4, 12, True)
  assert (tmp_path / 'out.txt').read_text().splitlines() == _reverse(LINES, 0)
  assert not os.path.exists(str(tmp_path / 'out.txt') + '.parts')
  mask = os.umask(0)
  os.umask(mask)
  assert os.stat(tmp_path / 'out.txt').st_mode & 0o777 == 0o666 & ~mask  # As open() gives.
  # Run again by one process, it translates again (and overwrites), as any command would; a
  # process of several finds the output the group wrote and nothing in flight: nothing to do.
  again = file_translation.translate_file(_plan(tmp_path, source), _reverse, progress=False)
  assert again.translated == 12 and again.merged
  late = file_translation.translate_file(_plan(tmp_path, source, process_index=1,
                                               process_count=2), _reverse, progress=False)
  assert late.translated == 0 and not late.merged
  assert sorted(os.listdir(tmp_path)) == ['in.txt', 'out.txt', 'out.txt.manifest.json']
  # Another translation into the same output is refused rather than taken for done.
  with pytest.raises(ConfigError, match=r"out.txt is there already, from another translation "
                                        r"\(options \{\}, now \{'seed': 2\}\)"):
    file_translation.translate_file(_plan(tmp_path, source, process_index=1, process_count=2,
                                          options={'seed': 2}), _reverse, progress=False)
  with pytest.raises(DataError, match='cannot read .*: Is a directory'):
    file_translation.translate_file(_plan(tmp_path, str(tmp_path)), _reverse, progress=False)


def test_a_run_that_dies_mid_file_resumes_with_the_same_bytes(tmp_path):
  source = _write(tmp_path / 'in.txt', ''.join(line + '\n' for line in LINES))
  file_translation.translate_file(_plan(tmp_path, source, chunk_lines=5), _reverse,
                                  progress=False)
  expected = (tmp_path / 'out.txt').read_bytes()
  os.remove(tmp_path / 'out.txt')
  calls = []

  def dies_at_the_third_chunk(lines, first_line):
    calls.append(first_line)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return _reverse(lines, first_line)

  plan = _plan(tmp_path, source)
  with pytest.raises(KeyboardInterrupt):
    file_translation.translate_file(plan, dies_at_the_third_chunk, progress=False)
  assert not (tmp_path / 'out.txt').exists()
  assert sorted(os.listdir(plan.parts)) == ['chunk-0000000.txt', 'chunk-0000001.txt',
                                            'manifest.json']
  calls.clear()
  outcome = file_translation.translate_file(plan, _reverse, progress=False)
  assert outcome.translated == 6  # Chunks 2 and 3 only.
  assert (tmp_path / 'out.txt').read_bytes() == expected


def test_processes_share_the_chunks_and_the_last_to_finish_writes_the_output(tmp_path):
  source = _write(tmp_path / 'in.txt', ''.join(line + '\n' for line in LINES))
  seen = {0: [], 1: []}

  def translate_as(index):
    def translate(lines, first_line):
      seen[index].append(first_line)
      return _reverse(lines, first_line)
    return translate

  second = file_translation.translate_file(_plan(tmp_path, source, process_index=1,
                                                 process_count=2), translate_as(1),
                                           progress=False)
  assert seen[1] == [3, 9] and not second.merged and not (tmp_path / 'out.txt').exists()
  first = file_translation.translate_file(_plan(tmp_path, source, process_index=0,
                                                process_count=2), translate_as(0),
                                          progress=False)
  assert seen[0] == [0, 6] and first.merged
  assert (tmp_path / 'out.txt').read_text().splitlines() == _reverse(LINES, 0)


def test_samples_per_line_and_their_count_are_held(tmp_path):
  source = _write(tmp_path / 'in.txt', 'a\nb\nc\n')
  plan = _plan(tmp_path, source, outputs_per_line=2)
  twice = lambda lines, first: [f'{x}{s}' for x in lines for s in range(2)]
  file_translation.translate_file(plan, twice, progress=False)
  assert (tmp_path / 'out.txt').read_text() == 'a0\na1\nb0\nb1\nc0\nc1\n'
  os.remove(tmp_path / 'out.txt')
  with pytest.raises(AssertionError, match='chunk 0: 3 outputs for 3 lines'):
    file_translation.translate_file(plan, _reverse, progress=False)


def test_a_resumed_run_with_other_options_or_input_is_refused(tmp_path):
  source = _write(tmp_path / 'in.txt', ''.join(line + '\n' for line in LINES))
  plan = _plan(tmp_path, source, options={'seed': 1})
  with pytest.raises(KeyboardInterrupt):
    file_translation.translate_file(plan, _interrupt_after_one(), progress=False)
  other_seed = _plan(tmp_path, source, options={'seed': 2})
  with pytest.raises(ConfigError, match=r"out.txt.parts holds chunks of another translation "
                                        r"\(options \{'seed': 1\}, now \{'seed': 2\}\)"):
    file_translation.translate_file(other_seed, _reverse, progress=False)
  with open(source, 'a', encoding='utf-8') as f:
    f.write('one more\n')
  with pytest.raises(ConfigError, match='input_bytes .*; lines 12, now 13'):
    file_translation.translate_file(plan, _reverse, progress=False)
  with pytest.raises(ConfigError, match='chunk_lines=0 must be at least 1'):
    _plan(tmp_path, source, chunk_lines=0)
  with pytest.raises(ConfigError, match=r'process_index=2 must be in \[0, --process_count=2\)'):
    _plan(tmp_path, source, process_index=2, process_count=2)


def _interrupt_after_one():
  calls = []

  def translate(lines, first_line):
    calls.append(1)
    if len(calls) > 1:
      raise KeyboardInterrupt
    return _reverse(lines, first_line)
  return translate


def test_undecodable_input_names_its_line(tmp_path):
  path = tmp_path / 'in.txt'
  path.write_bytes(b'fine\nfine\nbad \xff here\n')
  with pytest.raises(DataError, match=r'in.txt:3: not valid UTF-8 \(byte 4\)'):
    file_translation.translate_file(_plan(tmp_path, str(path)), _reverse, progress=False)


@pytest.mark.slow
def test_translate_after_kill_9_gives_an_uninterrupted_runs_bytes(tiny_run, tmp_path):
  """The command itself, killed with SIGKILL once some chunks are saved, then run again; and
  two processes sharing the file. Sampled, so each line's draws must not depend on chunks,
  batches or processes."""
  rng = np.random.default_rng(0)
  source = tmp_path / 'mono.txt'
  source.write_text(''.join(' '.join(map(str, rng.integers(2, 8, rng.integers(0, 9)))) + '\n'
                            for _ in range(3000)))

  def command(output, *extra):
    return [sys.executable, '-m', 't2t_jax.translate', f'--workdir={tiny_run[0]}',
            f'--input={source}', f'--output={output}', '--sampling=sample', '--top_k=3',
            '--seed=5', '--samples=2', *extra]

  env = dict(os.environ, PYTHONPATH=ROOT)
  whole = tmp_path / 'whole.txt'
  subprocess.run(command(whole, '--chunk_lines=1000'), env=env, cwd=ROOT, check=True,
                 capture_output=True, timeout=300)
  killed = tmp_path / 'killed.txt'
  parts = str(killed) + '.parts'
  process = subprocess.Popen(command(killed, '--chunk_lines=100', '--batch_tokens=64'),
                             env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 240
  while (not os.path.isdir(parts) or
         sum(name.startswith('chunk') for name in os.listdir(parts)) < 3):
    assert process.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  done = sum(name.startswith('chunk') for name in os.listdir(parts))
  assert not killed.exists() and 3 <= done < 30
  resumed = subprocess.run(command(killed, '--chunk_lines=100', '--batch_tokens=64'), env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr
  assert 'Resuming:' in resumed.stderr and 'lines/s' in resumed.stderr
  assert killed.read_bytes() == whole.read_bytes()
  assert len(whole.read_text().splitlines()) == 6000
  # Processes: the usage mistakes are one line each.
  alone = subprocess.run(command(tmp_path / 'x.txt', '--chunk_lines=0', '--process_count=2'),
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert alone.returncode != 0
  assert 'error: --process_index and --process_count share' in alone.stderr
  assert 'Traceback' not in alone.stderr
  from t2t_jax.deploy import trained_run  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match='not a language model: sample translations with'):
    trained_run.load(tiny_run[0], language_model=True)


def test_filters_remove_short_long_uneven_and_repeated_pairs_counting_each(tmp_path):
  from t2t_jax import filter_pairs  # pylint: disable=import-outside-toplevel
  pairs = [('a b c', 'x y z'),  # Kept.
           ('a b c', 'x y z'),  # A repeated pair.
           ('a b c', 'x y w'),  # Same source, other target: kept under 'pairs'.
           ('', 'x'),  # Empty source.
           ('a', 'x y z w v'),  # Ratio 5.
           (' '.join('a' * 1 for _ in range(12)), ' '.join('b' for _ in range(12))),  # Too long.
           ('d e', 'u v')]  # Kept.
  source = _write(tmp_path / 's.txt', ''.join(s + '\n' for s, _ in pairs))
  target = _write(tmp_path / 't.txt', ''.join(t + '\n' for _, t in pairs))
  out = str(tmp_path / 'out.s'), str(tmp_path / 'out.t')
  counts = filter_pairs.filter_pairs(source, target, *out, filter_pairs.Limits(
      min_words=1, max_words=10, max_ratio=3.0, dedup='pairs'))
  assert counts == {'read': 7, 'kept': 3, 'duplicates': 1, 'empty': 1,
                    'length ratio above 3': 1, 'longer than 10 words': 1}
  assert open(out[0]).read().splitlines() == ['a b c', 'a b c', 'd e']
  assert open(out[1]).read().splitlines() == ['x y z', 'x y w', 'u v']
  assert filter_pairs.describe(counts) == (
      'kept 3 of 7 pairs; removed 1 duplicates, 1 empty, 1 length ratio above 3, 1 longer than '
      '10 words')
  by_source = filter_pairs.filter_pairs(source, target, *out, filter_pairs.Limits(
      max_words=10, max_ratio=3.0, dedup='source'))
  assert by_source['duplicates'] == 2 and by_source['kept'] == 2
  # Misaligned files are one error naming both.
  short = _write(tmp_path / 'short.txt', 'a\n')
  with pytest.raises(DataError, match=r's.txt has 7 lines but .*short.txt has 1'):
    filter_pairs.filter_pairs(source, short, *out, filter_pairs.Limits())
  assert sorted(os.listdir(tmp_path)) == ['out.s', 'out.t', 's.txt', 'short.txt', 't.txt']


def test_a_kill_between_writing_the_output_and_retiring_the_parts_merges_again(tmp_path,
                                                                              monkeypatch):
  source = _write(tmp_path / 'in.txt', ''.join(line + '\n' for line in LINES))
  plan = _plan(tmp_path, source)

  def killed(*unused_args, **unused_kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(file_translation.tempfile, 'mkdtemp', killed)
  with pytest.raises(KeyboardInterrupt):
    file_translation.translate_file(plan, _reverse, progress=False)
  assert os.path.isdir(plan.parts) and (tmp_path / 'out.txt').exists()
  monkeypatch.undo()
  outcome = file_translation.translate_file(plan, _reverse, progress=False)
  assert outcome.translated == 0 and outcome.merged and not os.path.exists(plan.parts)
  assert (tmp_path / 'out.txt').read_text().splitlines() == _reverse(LINES, 0)
  assert not [name for name in os.listdir(tmp_path) if 'retired' in name or 'tmp' in name]
