"""The fine-tuning table of docs/pretraining.md: per setting (a folder of seed runs made by
configs/sweeps/bert_seeds.py), the mean, spread and range of the final validation figures.

  python bench/finetune_table.py /tmp/bert          # every <root>/<setting>/<run>/final.json
  python bench/finetune_table.py /tmp/bert --curves=curves.png --only=sst2_1k_pre,sst2_1k_scratch

One JSON line per setting, then a markdown table. The figures are the last step's (the best
step's, chosen on the same validation split, are in best_eval.json and would flatter).
--curves draws each setting's validation accuracy against updates (every seed's run thin, their
mean thick), from the runs' event files.
"""

import json
import os
import statistics
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # pylint: disable=wrong-import-position
from t2t_jax import cli  # pylint: disable=wrong-import-position
from t2t_jax import plot  # pylint: disable=wrong-import-position
from t2t_jax import workdir_layout  # pylint: disable=wrong-import-position
from t2t_jax.errors import DataError  # pylint: disable=wrong-import-position

FIGURES = ('eval_accuracy', 'eval_macro_f1', 'eval_mcc')


def settings(root: str) -> dict[str, list[dict]]:
  """{setting folder: [final figures of each finished run below it]}."""
  found = {}
  for setting in sorted(os.listdir(root)):
    folder = os.path.join(root, setting)
    if not os.path.isdir(folder):
      continue
    finals = [workdir_layout.read_final(os.path.join(folder, run))
              for run in sorted(os.listdir(folder))
              if os.path.isdir(os.path.join(folder, run))]
    finals = [final for final in finals if final and 'eval_accuracy' in final]
    if finals:
      found[setting] = finals
  return found


def row(setting: str, finals: list[dict]) -> dict:
  """Mean, sample standard deviation (0 for one run), minimum and maximum of each figure."""
  record = {'setting': setting, 'runs': len(finals)}
  for figure in FIGURES + ('train_seconds',):
    values = [final[figure] for final in finals if final.get(figure) is not None]
    if values:
      record[figure] = common.spread(values)
  return record


def draw_curves(root: str, chosen: list[str], output: str) -> None:
  """Validation accuracy against updates, a colour per setting: its seeds thin, their mean thick."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  figure, axis = plt.subplots(figsize=(7, 4.5))
  for colour, setting in enumerate(chosen):
    folder = os.path.join(root, setting)
    if not os.path.isdir(folder):
      raise DataError(f'{folder}: no such setting')
    runs = [plot.read_scalars(os.path.join(folder, run)).get('eval/accuracy')
            for run in sorted(os.listdir(folder)) if os.path.isdir(os.path.join(folder, run))]
    runs = [series for series in runs if series]
    for series in runs:
      axis.plot(series.steps, [100 * v for v in series.values], color=f'C{colour}', alpha=0.35,
                linewidth=0.8)
    steps = sorted(set.intersection(*(set(series.steps) for series in runs)))
    means = [100 * statistics.fmean(series.values[series.steps.index(step)] for series in runs)
             for step in steps]
    axis.plot(steps, means, 'o-', color=f'C{colour}', label=f'{setting} ({len(runs)} runs)')
  axis.set_xlabel('fine-tuning updates')
  axis.set_ylabel('validation accuracy (%)')
  axis.grid(alpha=0.3)
  axis.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(output, dpi=120)
  plt.close(figure)
  print(f'wrote {output}')


def main(argv):
  if len(argv) != 2:
    raise app.UsageError('pass one folder: the root holding a folder of seed runs per setting')
  if not os.path.isdir(argv[1]):
    raise DataError(f'{argv[1]} is not a folder')
  if FLAGS.curves:
    draw_curves(argv[1], FLAGS.only or sorted(settings(argv[1])), FLAGS.curves)
  rows = [row(setting, finals) for setting, finals in settings(argv[1]).items()]
  if not rows:
    raise DataError(f'{argv[1]}: no finished fine-tuning run (<setting>/<run>/final.json with '
                    'eval_accuracy) below it')
  for record in rows:
    print(json.dumps(record))
  print('\n| setting | runs | accuracy (mean ± std) | min-max | macro F1 | MCC | seconds/run |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    acc = r['eval_accuracy']
    print(f"| {r['setting']} | {r['runs']} | {100 * acc['mean']:.1f} ± {100 * acc['std']:.1f} | "
          f"{100 * acc['min']:.1f}-{100 * acc['max']:.1f} | "
          f"{100 * r['eval_macro_f1']['mean']:.1f} | {r['eval_mcc']['mean']:.3f} | "
          f"{r.get('train_seconds', {}).get('mean', 0):.0f} |")


FLAGS = flags.FLAGS

if __name__ == '__main__':
  flags.DEFINE_string('curves', '', 'Also draw validation accuracy against updates to this PNG.')
  flags.DEFINE_list('only', [], 'With --curves: these settings only (default: every one).')
  cli.run(main)
