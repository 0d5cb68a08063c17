"""The back-translation table of docs/results/backtranslation.md: per setting, the valid BLEU of
its seeds' runs (the last 10 checkpoints averaged, beam 5), and the share of the gap between the
parallel third and all real pairs that each setting recovers.

  python bench/backtranslation_table.py /tmp/bt/runs

Each run is a folder <root>/<setting>_s<seed> holding eval_avg10_beam5.txt, the output of

  python -m t2t_jax.evaluate --workdir=<run> --checkpoint=<run>/avg10 --beam_size=5

whose last line is the figure the recipe reports (tokenised BLEU as configured). The lower and
upper bounds are the settings named by --lower (parallel) and --upper (all). A bound measured
by another command (the upper one is configs/multi30k.py:speedrun on the same files) is given
by its seeds' figures instead, e.g. --upper_bleu=42.70,42.46,41.86. One JSON line per setting,
then a markdown table; its minutes average the runs trained by one process (a resumed run's
final.json times only its last process).
"""

import json
import os
import re
import statistics
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # pylint: disable=wrong-import-position
from t2t_jax import cli  # pylint: disable=wrong-import-position
from t2t_jax import workdir_layout  # pylint: disable=wrong-import-position
from t2t_jax.errors import DataError  # pylint: disable=wrong-import-position

EVALUATION = 'eval_avg10_beam5.txt'
RUN_NAME = re.compile(r'^(?P<setting>.+)_s(?P<seed>\d+)$')
SCORE = re.compile(r' (?P<bleu>\d+\.\d+) \(nrefs:')


def bleu_of(path: str) -> float:
  """The BLEU on the last line of an `evaluate` output."""
  with open(path, encoding='utf-8') as f:
    lines = f.read().splitlines()
  found = SCORE.search(lines[-1]) if lines else None
  if not found:
    raise DataError(f'{path}: the last line holds no BLEU figure ("... NN.NN (nrefs:...")')
  return float(found['bleu'])


def resumed(run: str) -> bool:
  """Whether more than one training process wrote to the run (each writes its own TensorBoard
  events file): its final.json's train_seconds then counts only the last one's."""
  return len([name for name in os.listdir(run) if name.startswith('events.out.tfevents')]) > 1


def settings(root: str) -> dict[str, list[dict]]:
  """{setting: [{seed, bleu, train_seconds} of each evaluated run]}, seeds in order; a resumed
  run's train_seconds is None (final.json has only its last process's)."""
  found = {}
  for name in sorted(os.listdir(root)):
    match = RUN_NAME.match(name)
    evaluation = os.path.join(root, name, EVALUATION)
    if not match or not os.path.isfile(evaluation):
      continue
    run = os.path.join(root, name)
    final = {} if resumed(run) else workdir_layout.read_final(run) or {}
    found.setdefault(match['setting'], []).append(
        {'seed': int(match['seed']), 'bleu': bleu_of(evaluation),
         'train_seconds': final.get('train_seconds'), 'resumed': resumed(run)})
  return {setting: sorted(runs, key=lambda run: run['seed']) for setting, runs in found.items()}


def given_runs(figures: list[str]) -> list[dict]:
  """Runs measured elsewhere, from their BLEU figures: seeds 0, 1, ... in the order given."""
  try:
    return [{'seed': seed, 'bleu': float(figure), 'train_seconds': None, 'resumed': False}
            for seed, figure in enumerate(figures)]
  except ValueError as e:
    raise DataError(f'--upper_bleu={",".join(figures)}: each figure must be a number') from e


def summary(runs: list[dict]) -> dict:
  """Mean, sample standard deviation (0 for one run), minimum and maximum BLEU."""
  return {'runs': len(runs), 'seeds': [run['seed'] for run in runs],
          **common.spread(run['bleu'] for run in runs),
          'train_seconds': [run['train_seconds'] for run in runs],
          'resumed': sum(run['resumed'] for run in runs)}


def recovered(mean: float, lower: float | None, upper: float | None) -> float | None:
  """The share of the lower-to-upper gap that a mean BLEU closes (None without both bounds)."""
  if lower is None or upper is None or upper == lower:
    return None
  return (mean - lower) / (upper - lower)


def main(argv):
  if len(argv) != 2:
    raise app.UsageError('pass one folder: the root holding a <setting>_s<seed> folder per run')
  if not os.path.isdir(argv[1]):
    raise DataError(f'{argv[1]} is not a folder')
  found = settings(argv[1])
  if FLAGS.upper_bleu:
    found[FLAGS.upper] = given_runs(FLAGS.upper_bleu)
  order = sorted(found, key=lambda setting: (setting == FLAGS.upper, setting != FLAGS.lower,
                                             setting))  # The lower bound first, the upper last.
  rows = {setting: summary(found[setting]) for setting in order}
  if not rows:
    raise DataError(f'{argv[1]}: no evaluated run (<setting>_s<seed>/{EVALUATION}) below it')
  lower = rows.get(FLAGS.lower, {}).get('mean')
  upper = rows.get(FLAGS.upper, {}).get('mean')
  for setting, row in rows.items():
    row['gap_recovered'] = recovered(row['mean'], lower, upper)
    print(json.dumps({'setting': setting, **row}))
  print('\n| setting | seeds | valid BLEU (mean ± std) | min-max | share of the gap | '
        'minutes of training/run |')
  print('|---|---|---|---|---|---|')
  for setting, row in rows.items():
    share = row['gap_recovered']
    minutes = [seconds / 60 for seconds in row['train_seconds'] if seconds]
    timed = (f'{statistics.fmean(minutes):.1f}' if minutes
             else 'resumed' if row['resumed'] else 'elsewhere')
    print(f"| {setting} | {row['runs']} | {row['mean']:.2f} ± {row['std']:.2f} | "
          f"{row['min']:.2f}-{row['max']:.2f} | "
          f"{'' if share is None else f'{100 * share:.0f}%'} | "
          f"{timed} |")


FLAGS = flags.FLAGS

if __name__ == '__main__':
  flags.DEFINE_string('lower', 'parallel', 'The setting trained on the parallel third alone.')
  flags.DEFINE_string('upper', 'all', 'The setting trained on all the real pairs.')
  flags.DEFINE_list('upper_bleu', [], 'The upper bound measured by another command: its '
                    "seeds' BLEU figures, replacing the runs of the --upper setting.")
  cli.run(main)
