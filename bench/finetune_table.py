"""The fine-tuning table of docs/pretraining.md: per setting (a folder of seed runs made by
configs/sweeps/bert_seeds.py), the mean, spread and range of the final validation figures.

  python bench/finetune_table.py /tmp/bert          # every <root>/<setting>/<run>/final.json

One JSON line per setting, then a markdown table. The figures are the last step's (the best
step's, chosen on the same validation split, are in best_eval.json and would flatter).
"""

import json
import os
import statistics
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from t2t_jax import cli  # pylint: disable=wrong-import-position
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
    if not values:
      continue
    record[figure] = {'mean': statistics.fmean(values),
                      'std': statistics.stdev(values) if len(values) > 1 else 0.0,
                      'min': min(values), 'max': max(values)}
  return record


def main(argv):
  if len(argv) != 2:
    raise app.UsageError('pass one folder: the root holding a folder of seed runs per setting')
  if not os.path.isdir(argv[1]):
    raise DataError(f'{argv[1]} is not a folder')
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


if __name__ == '__main__':
  cli.run(main)
