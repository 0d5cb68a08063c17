"""Translating a large file in chunks: each process its share of them, every chunk saved the
moment it is done, the output put together in the input's order once all are there.

`<output>.parts/` holds a manifest (what is being translated, and how) and one file per
finished chunk, each written whole under a temporary name and renamed into place, so a
`kill -9` loses at most the chunks in flight. Running the same command again skips the
chunks already there; outputs depend only on each line and its index (sampling.py), so the
resumed output is the uninterrupted one, byte for byte. With several processes (a SLURM
array, or one process per accelerator) process i of n takes chunks i, i + n, ...; the
process that finds every chunk done writes `<output>` (and its manifest beside it,
`<output>.manifest.json`), then retires the parts: renamed away first, so a kill while they
are deleted leaves nothing a later run could take for chunks in flight.
"""

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterator

from absl import logging
import tqdm

from t2t_jax import ConfigError
from t2t_jax.errors import DataError

MANIFEST = 'manifest.json'


@dataclasses.dataclass(frozen=True)
class Plan:
  """One file's translation: where from and to, its chunking, this process's share, and the
  options its outputs depend on (recorded, and compared when a run resumes)."""
  input_path: str
  output_path: str
  chunk_lines: int
  process_index: int = 0
  process_count: int = 1
  outputs_per_line: int = 1
  options: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.chunk_lines < 1:
      raise ConfigError(f'--chunk_lines={self.chunk_lines} must be at least 1')
    if not 0 <= self.process_index < self.process_count:
      raise ConfigError(f'--process_index={self.process_index} must be in [0, '
                        f'--process_count={self.process_count})')

  @property
  def parts(self) -> str:
    return self.output_path + '.parts'

  def chunk_file(self, chunk: int) -> str:
    return os.path.join(self.parts, f'chunk-{chunk:07d}.txt')


@dataclasses.dataclass
class Outcome:
  """What one process did: the file's lines and chunks, the lines it translated now (not
  those found done), the seconds that took, and whether it wrote the output."""
  lines: int
  chunks: int
  translated: int
  seconds: float
  merged: bool


def count_lines(path: str) -> int:
  """Lines as `for line in file` reads them: newlines, plus an unterminated last line."""
  count, last = 0, b'\n'
  try:
    with open(path, 'rb') as f:
      for block in iter(lambda: f.read(1 << 24), b''):
        count += block.count(b'\n')
        last = block[-1:]
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None
  return count + (last != b'\n')


def read_chunks(path: str, chunk_lines: int, wanted: set[int]
                ) -> Iterator[tuple[int, int, list[str]]]:
  """(chunk, index of its first line, its lines) for the `wanted` chunks, streamed in order."""
  chunk, lines = None, []
  with open(path, 'rb') as f:
    for index, raw in enumerate(f):
      if index // chunk_lines != chunk:
        if lines:
          yield chunk, chunk * chunk_lines, lines
        chunk, lines = index // chunk_lines, []
      if chunk in wanted:
        try:
          lines.append(raw.decode('utf-8').rstrip('\r\n'))
        except UnicodeDecodeError as e:
          raise DataError(f'{path}:{index + 1}: not valid UTF-8 (byte {e.start})') from None
  if lines:
    yield chunk, chunk * chunk_lines, lines


def _manifest(plan: Plan, lines: int) -> dict:
  return {'input': os.path.abspath(plan.input_path),
          'input_bytes': os.path.getsize(plan.input_path), 'lines': lines,
          'chunk_lines': plan.chunk_lines, 'outputs_per_line': plan.outputs_per_line,
          'options': plan.options}


def _differences(path: str, expected: dict) -> list[str] | None:
  """How the manifest at `path` differs from `expected` ([] if not at all); None if absent."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      found = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'cannot read the manifest {path} ({e}): delete it and what it describes '
                      'to start again') from None
  return [f'{key} {found.get(key)!r}, now {value!r}'
          for key, value in expected.items() if found.get(key) != value]


def _start(plan: Plan, expected: dict) -> None:
  """Creates the parts directory and its manifest, or checks a resumed run's against it."""
  path = os.path.join(plan.parts, MANIFEST)
  try:
    os.makedirs(plan.parts, exist_ok=True)
  except OSError as e:
    raise ConfigError(f'cannot create {plan.parts} for --output={plan.output_path}: '
                      f'{e.strerror}') from None
  differences = _differences(path, expected)
  if differences:
    raise ConfigError(f'{plan.parts} holds chunks of another translation ('
                      f'{"; ".join(differences)}): run the command that started it, or '
                      'delete the directory to start again')
  if differences is None:
    _write_whole(path, json.dumps(expected, indent=1, sort_keys=True) + '\n')


def _temporary_beside(path: str) -> str:
  """A new file's name in `path`'s folder, unique across processes and hosts, with the
  permissions a plain `open` would give it (mkstemp's are the owner's only)."""
  handle, name = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                  prefix=os.path.basename(path) + '.', suffix='.tmp')
  os.close(handle)
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(name, 0o666 & ~mask)
  return name


def _write_whole(path: str, text: str) -> None:
  """`text` in `path`, or nothing there: written under another name, then renamed."""
  temporary = _temporary_beside(path)
  with open(temporary, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def translate_file(plan: Plan, translate: Callable[[list[str], int], list[str]],
                   progress: bool = True) -> Outcome:
  """Translates this process's chunks not yet done with `translate(lines, first_line)` (which
  returns plan.outputs_per_line texts per line, in order), then writes the output if every
  chunk is there."""
  start = time.perf_counter()
  for retired in glob.glob(glob.escape(plan.parts) + RETIRED + '*'):  # A kill left them.
    shutil.rmtree(retired, ignore_errors=True)
  lines = count_lines(plan.input_path)
  chunks = -(-lines // plan.chunk_lines)
  expected = _manifest(plan, lines)
  if (plan.process_count > 1 and os.path.exists(plan.output_path) and
      not os.path.exists(plan.parts)):  # One process alone translates again, as any command.
    differences = _differences(plan.output_path + '.manifest.json', expected)
    if differences or differences is None:
      raise ConfigError(f'{plan.output_path} is there already, from another translation ('
                        f'{"; ".join(differences or ["no manifest beside it"])}): delete it, '
                        'or choose another --output')
    logging.info('%s was written by the processes sharing it, and no chunks are in flight: '
                 'nothing to do (delete it to translate again)', plan.output_path)
    return Outcome(lines, chunks, 0, 0.0, False)
  _start(plan, expected)
  mine = range(plan.process_index, chunks, plan.process_count)
  todo = {c for c in mine if not os.path.exists(plan.chunk_file(c))}
  size = lambda c: min(plan.chunk_lines, lines - c * plan.chunk_lines)
  if len(todo) < len(mine):
    logging.info('Resuming: %d of this process\'s %d chunks are done already', len(mine) - len(todo),
                 len(mine))
  translated = 0
  with tqdm.tqdm(total=sum(size(c) for c in mine), initial=sum(size(c) for c in mine
                                                               if c not in todo),
                 desc=f'translating (process {plan.process_index} of {plan.process_count})',
                 unit=' lines', file=sys.stderr, disable=not progress, smoothing=0.1) as bar:
    for chunk, first_line, texts in read_chunks(plan.input_path, plan.chunk_lines, todo):
      outputs = translate(texts, first_line)
      if len(outputs) != len(texts) * plan.outputs_per_line:
        raise AssertionError(f'chunk {chunk}: {len(outputs)} outputs for {len(texts)} lines')
      _write_whole(plan.chunk_file(chunk), ''.join(o.replace('\n', ' ') + '\n' for o in outputs))
      translated += len(texts)
      bar.update(len(texts))
  merged = _merge_if_complete(plan, chunks)
  return Outcome(lines, chunks, translated, time.perf_counter() - start, merged)


RETIRED = '.retired-'  # A finished run's parts are renamed to <parts>.retired-<unique>.


def _complete(plan: Plan, chunks: int) -> bool:
  return os.path.isdir(plan.parts) and all(os.path.exists(plan.chunk_file(c))
                                           for c in range(chunks))


def _merge_if_complete(plan: Plan, chunks: int) -> bool:
  """Writes the output from the chunks if all are done and no other process is doing it or
  has done it; then retires the parts."""
  if not _complete(plan, chunks):
    return False
  lock_path = plan.output_path + '.lock'
  with open(lock_path, 'w') as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return False  # Another process is writing it.
    except OSError as e:  # A file system without locks: renames below still keep it whole.
      logging.warning('cannot lock %s (%s): merging without a lock', lock_path, e.strerror)
    if not _complete(plan, chunks):  # Another process merged while this one waited.
      return False
    temporary = _temporary_beside(plan.output_path)
    with open(temporary, 'wb') as out:
      for c in range(chunks):
        with open(plan.chunk_file(c), 'rb') as part:
          shutil.copyfileobj(part, out)
      out.flush()
      os.fsync(out.fileno())
    os.replace(temporary, plan.output_path)
    # Until the parts are retired, a run killed here and run again merges them again.
    with open(os.path.join(plan.parts, MANIFEST), encoding='utf-8') as f:
      _write_whole(plan.output_path + '.manifest.json', f.read())
    retired = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(plan.parts)),
                               prefix=os.path.basename(plan.parts) + RETIRED)
    os.replace(plan.parts, retired)  # Gone at once from where later runs look.
  with contextlib.suppress(FileNotFoundError):
    os.remove(lock_path)
  shutil.rmtree(retired, ignore_errors=True)
  return True
