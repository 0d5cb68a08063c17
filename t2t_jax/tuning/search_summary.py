"""What a user looks at after a search (launch/search.py --summarize DIR [--plot=PNG_DIR]): the
trials best first with their overrides and the command that reproduces each, seeds as mean,
standard deviation and spread, Optuna's parameter importances, the training pruning saved,
and plots of the metric against each hyperparameter and of every trial's curve."""

import os
import statistics

import numpy as np

from t2t_jax import cli
from t2t_jax import workdir_layout
from t2t_jax.tuning.search_space import SearchError

STATE_ORDER = ('COMPLETE', 'PRUNED', 'RUNNING', 'WAITING', 'FAIL')


def overrides_text(params: dict) -> str:
  return ' '.join(f'--config.{key}={value}' for key, value in params.items())


def load_study(root: str):
  """(study, record of <root>/search.json)."""
  import optuna  # pylint: disable=g-import-not-at-top
  from t2t_jax.tuning import search_space  # pylint: disable=g-import-not-at-top
  record = workdir_layout.read_json(os.path.join(root, 'search.json'))
  if record is None:
    raise SearchError(f'{root}: no search.json: not the --workdir of a search')
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  study = optuna.load_study(study_name=record['study'],
                            storage=search_space.storage(record['storage']))
  return study, record


def seed_values(root: str, number: int, metric: str, first) -> list[float]:
  """The metric of a trial's runs: the trial's own (`first`), then each finished repeat's."""
  values = [] if first is None else [float(first)]
  prefix = workdir_layout.trial_name(number) + '_seed'
  for name in sorted(os.listdir(root)):
    if name.startswith(prefix):
      final = workdir_layout.read_final(os.path.join(root, name))
      if final and final.get(metric) is not None:
        values.append(float(final[metric]))
  return values


def aggregate(values: list[float]) -> dict:
  """n, mean, standard deviation (n - 1 in the denominator; 0 for one value) and spread."""
  if not values:
    return {'n': 0, 'mean': None, 'std': None, 'spread': None}
  return {'n': len(values), 'mean': statistics.fmean(values),
          'std': statistics.stdev(values) if len(values) > 1 else 0.0,
          'spread': max(values) - min(values)}


def rows(root: str, study, record: dict) -> list[dict]:
  """One dict per trial, best first: completed by their (seed-mean) metric, then the others."""
  metric, maximize = record['search']['metric'], record['search']['direction'] == 'maximize'
  out = []
  for trial in study.get_trials(deepcopy=False):
    steps = sorted(trial.intermediate_values)
    run = workdir_layout.read_json(os.path.join(root, workdir_layout.trial_name(trial.number),
                                                 'search_trial.json')) or {}
    final = workdir_layout.read_final(
        os.path.join(root, workdir_layout.trial_name(trial.number))) or {}
    stats = aggregate(seed_values(root, trial.number, metric, trial.value)
                      if trial.state.name == 'COMPLETE' else [])
    out.append({'trial': trial.number, 'state': trial.state.name, 'value': trial.value,
                **stats, 'params': dict(trial.params), 'command': run.get('command', ''),
                'step': final.get('step', steps[-1] if steps else None),
                'curve': [(s, trial.intermediate_values[s]) for s in steps],
                'train_seconds': final.get('train_seconds')})
  sign = -1 if maximize else 1
  out.sort(key=lambda r: (STATE_ORDER.index(r['state']) if r['state'] in STATE_ORDER else 9,
                          sign * r['mean'] if r['mean'] is not None else 0, r['trial']))
  return out


def pruning_savings(root: str, table: list[dict]) -> str:
  """How many training steps and minutes the pruned trials did not run."""
  pruned = [r for r in table if r['state'] == 'PRUNED' and r['step'] is not None]
  if not pruned:
    return 'Pruning: no trial was pruned.'
  num_steps = {}
  for r in pruned:
    config = workdir_layout.read_json(os.path.join(
        root, workdir_layout.trial_name(r['trial']), workdir_layout.CONFIG_JSON)) or {}
    num_steps[r['trial']] = config.get('train', {}).get('num_steps')
  done = [r for r in table if r['state'] == 'COMPLETE' and r['train_seconds'] and r['step']]
  skipped = sum(num_steps[r['trial']] - r['step'] for r in pruned if num_steps[r['trial']])
  total = sum(n for n in num_steps.values() if n)
  text = (f'Pruning: {len(pruned)} of {len(table)} trials stopped early; {skipped} of their '
          f'{total} training steps were not run')
  if done:
    rate = float(np.median([r['train_seconds'] / r['step'] for r in done]))
    text += (f', about {skipped * rate / 60:.1f} training minutes at the completed trials\' '
             f'median {rate:.3g} s per step')
  return text + '.'


def importances(study) -> str:
  import optuna  # pylint: disable=g-import-not-at-top
  done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
  if len(done) < 2:
    return 'Parameter importances: need two completed trials.'
  try:
    found = optuna.importance.get_param_importances(study)
  except (RuntimeError, ValueError) as e:  # E.g. one value of every parameter.
    return f'Parameter importances: not computed ({" ".join(str(e).split())}).'
  return 'Parameter importances (fANOVA): ' + ', '.join(f'{k} {v:.2f}' for k, v in found.items())


def summarize(root: str, plot_dir: str | None = None, markdown: bool = False,
              top: int = 5) -> str:
  study, record = load_study(root)
  table = rows(root, study, record)
  if not table:
    return f'{root}: the study has no trials yet'
  metric = record['search']['metric']
  keys = list(record['search']['params'])
  seeds = any(r['n'] > 1 for r in table)
  head = ['trial', 'state', metric + (' mean' if seeds else '')] + (
      ['seeds', 'std', 'spread'] if seeds else []) + ['step'] + keys
  cells = []
  for r in table:
    shown = r['mean'] if r['mean'] is not None else (r['curve'][-1][1] if r['curve'] else None)
    cell = cli.format_cell
    cells.append([str(r['trial']), r['state'].lower(), cell(shown)] +
                 ([str(r['n']), cell(r['std']), cell(r['spread'])] if seeds else []) +
                 [cell(r['step'])] + [cell(r['params'].get(k)) for k in keys])
  lines = [cli.text_table(head, cells, markdown)]
  best = [r for r in table if r['state'] == 'COMPLETE'][:top]
  lines += ['', f'Best {len(best)} ({record["search"]["direction"]} {metric}), reproduced by:']
  lines += [f'  trial {r["trial"]}: {r["command"]}' for r in best]
  lines += ['', importances(study), pruning_savings(root, table)]
  if plot_dir:
    lines.append('Plots: ' + ', '.join(plot(table, keys, metric, plot_dir, study)))
  return '\n'.join(lines)


def plot(table: list[dict], keys: list[str], metric: str, directory: str, study) -> list[str]:
  """PNGs: the metric against each hyperparameter, every trial's curve, the importances."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  written = []
  for key in keys:
    figure, axes = plt.subplots(figsize=(5, 3.5))
    for state, marker in (('COMPLETE', 'o'), ('PRUNED', 'x')):
      points = [(r['params'][key], r['mean'] if state == 'COMPLETE' else r['curve'][-1][1])
                for r in table if r['state'] == state and key in r['params'] and
                (r['mean'] is not None or r['curve'])]
      if points:
        xs, ys = zip(*points)
        axes.scatter([str(x) if isinstance(x, str) else x for x in xs], ys, marker=marker,
                     label=f'{state.lower()} ({"final" if state == "COMPLETE" else "last"})')
    values = [r['params'][key] for r in table if key in r['params']]
    if values and all(isinstance(v, float) for v in values) and min(values) > 0 and (
        max(values) / min(values) > 20):
      axes.set_xscale('log')
    axes.set_xlabel(key)
    axes.set_ylabel(metric)
    axes.legend()
    written.append(_save(figure, directory, f'{metric}_vs_{key}.png'))
  figure, axes = plt.subplots(figsize=(6, 4))
  for r in table:
    if r['curve']:
      steps, values = zip(*r['curve'])
      style = {'PRUNED': dict(linestyle='--', alpha=0.6),
               'FAIL': dict(linestyle=':', color='grey')}.get(r['state'], {})
      line, = axes.plot(steps, values, **style)
      axes.annotate(str(r['trial']), (steps[-1], values[-1]), fontsize=7,
                    xytext=(3, 0), textcoords='offset points')
      if r['state'] == 'PRUNED':
        axes.plot(steps[-1], values[-1], 'x', color=line.get_color(), markersize=9)
  axes.set_xlabel('step')
  axes.set_ylabel(metric)
  axes.set_title('trials by number (dashed, x: pruned there; dotted: failed)')
  written.append(_save(figure, directory, 'curves.png'))
  import optuna  # pylint: disable=g-import-not-at-top
  try:
    found = optuna.importance.get_param_importances(study)
  except (RuntimeError, ValueError):
    found = {}
  if found:
    figure, axes = plt.subplots(figsize=(5, 0.6 + 0.4 * len(found)))
    axes.barh(list(found)[::-1], list(found.values())[::-1])
    axes.set_xlabel('importance (fANOVA)')
    written.append(_save(figure, directory, 'importances.png'))
  return written


def _save(figure, directory: str, name: str) -> str:
  path = os.path.join(directory, name)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  plt.close(figure)
  return path
