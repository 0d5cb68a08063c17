"""Filters a parallel corpus (e.g. back-translated text beside its monolingual original): pairs
with an empty side, too few or too many words, too uneven lengths, or seen before are removed,
and the log counts each kind.

  python -m t2t_jax.filter_pairs --source=mono.bt.en --target=mono.de \\
      --output_source=bt.en --output_target=bt.de --max_words=100 --max_ratio=2.0

The files are streamed (millions of lines); the outputs are written whole under temporary
names, then renamed. docs/backtranslation.md has the workflow.
"""

import collections
import dataclasses
import hashlib
import os

from absl import app
from absl import flags
from absl import logging

from t2t_jax import cli
from t2t_jax.data import sources

FLAGS = flags.FLAGS
DEDUP = ('pairs', 'source', 'target', 'none')


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a pair must meet to be kept: each side `min_words` to `max_words` words, the longer
  side at most `max_ratio` times the shorter (0: no limit), and not a repeat (by `dedup`)."""
  min_words: int = 1
  max_words: int = 250
  max_ratio: float = 0.0
  dedup: str = 'pairs'


def _reason(source: str, target: str, limits: Limits) -> str | None:
  """Why a pair is removed (the first rule it breaks), or None."""
  lengths = len(source.split()), len(target.split())
  if min(lengths) < limits.min_words:
    return f'shorter than {limits.min_words} words'
  if max(lengths) > limits.max_words:
    return f'longer than {limits.max_words} words'
  if limits.max_ratio and max(lengths) > limits.max_ratio * min(lengths):
    return f'length ratio above {limits.max_ratio:g}'
  return None


def filter_pairs(source_path: str, target_path: str, output_source: str, output_target: str,
                 limits: Limits) -> collections.Counter:
  """Writes the kept pairs; returns the counts: 'read', 'kept' and one per reason removed."""
  counts, skipped = collections.Counter(), collections.Counter()
  temporaries = [f'{path}.{os.getpid()}.tmp' for path in (output_source, output_target)]
  try:
    _write_kept(sources.parallel_text(source_path, target_path, 'skip').reader(skipped),
                temporaries, limits, counts)
  except BaseException:  # Nothing half-written is left behind.
    for temporary in temporaries:
      if os.path.exists(temporary):
        os.remove(temporary)
    raise
  for path in (output_source, output_target):  # Never a new side beside an old one.
    if os.path.exists(path):
      os.remove(path)
  for temporary, path in zip(temporaries, (output_source, output_target)):
    os.replace(temporary, path)
  for reason, count in skipped.items():  # Empty or undecodable on either side.
    counts[reason] += count
  counts['read'] = sum(counts.values())
  return counts


def _write_kept(pairs, paths: list[str], limits: Limits, counts: collections.Counter) -> None:
  """Writes the pairs that meet `limits` to `paths`, counting the others by reason."""
  seen = set()
  with open(paths[0], 'w', encoding='utf-8') as out_source, \
       open(paths[1], 'w', encoding='utf-8') as out_target:
    for source, target in pairs:
      reason = _reason(source, target, limits)
      if reason is None and limits.dedup != 'none':
        key = {'pairs': f'{source}\t{target}', 'source': source, 'target': target}[limits.dedup]
        digest = hashlib.blake2b(key.encode('utf-8'), digest_size=12).digest()
        reason = 'duplicates' if digest in seen else None
        seen.add(digest)
      if reason:
        counts[reason] += 1
        continue
      counts['kept'] += 1
      out_source.write(source + '\n')
      out_target.write(target + '\n')


def describe(counts: collections.Counter) -> str:
  removed = {reason: n for reason, n in counts.items() if reason not in ('read', 'kept')}
  return (f"kept {counts['kept']} of {counts['read']} pairs; removed " +
          (', '.join(f'{n} {reason}' for reason, n in sorted(removed.items())) or 'none'))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  for name in ('source', 'target', 'output_source', 'output_target'):
    if not FLAGS[name].value:
      raise app.UsageError(f'--{name} is required')
  for name in ('output_source', 'output_target'):
    cli.check_output_path(FLAGS[name].value, f'--{name}')
  paths = [os.path.abspath(FLAGS[name].value)
           for name in ('source', 'target', 'output_source', 'output_target')]
  if len(set(paths)) < 4:
    raise app.UsageError('--source, --target, --output_source and --output_target must be four '
                         'different files')
  limits = Limits(FLAGS.min_words, FLAGS.max_words, FLAGS.max_ratio, FLAGS.dedup)
  counts = filter_pairs(FLAGS.source, FLAGS.target, FLAGS.output_source, FLAGS.output_target,
                        limits)
  logging.info('%s / %s: %s', FLAGS.source, FLAGS.target, describe(counts))


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('source', None, 'Source side, one sentence per line.')
  flags.DEFINE_string('target', None, 'Target side, line-aligned with --source.')
  flags.DEFINE_string('output_source', None, 'Where the kept source lines go.')
  flags.DEFINE_string('output_target', None, 'Where the kept target lines go.')
  flags.DEFINE_integer('min_words', 1, 'Fewest words on either side.', lower_bound=1)
  flags.DEFINE_integer('max_words', 250, 'Most words on either side.', lower_bound=1)
  flags.DEFINE_float('max_ratio', 0.0, 'Most words of the longer side per word of the shorter; '
                     '0: no limit.', lower_bound=0.0)
  flags.DEFINE_enum('dedup', 'pairs', list(DEDUP), 'Keep the first of equal pairs, sources or '
                    'targets; none keeps repeats.')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
