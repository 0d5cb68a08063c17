"""A hyperparameter search file (launch/search.py) and the Optuna objects it names: what to
sample, what to optimise, the budget, the sampler, the pruner and the storage.

A search file defines `get_search()` returning a dict:

  params     {config key: range}, a range being one of
               ('uniform', low, high)      a float in [low, high]
               ('log_uniform', low, high)  a float, uniform in log (0 < low)
               ('int', low, high)          an integer in [low, high]; ('int', low, high, step)
               ('log_int', low, high)      an integer, uniform in log (0 < low)
               ('choice', [v1, v2, ...])   one of the values (strings, numbers, booleans)
  metric     what the runs' evaluations report: 'bleu', 'eval_loss', 'eval_accuracy',
             'eval_perplexity', 'exact_match'; a classifier's 'eval_macro_f1', 'eval_mcc' (a
             regressor's 'eval_pearson', 'eval_spearman'); and 'ema_...' / 'averaged_...'
             forms where the run keeps them
  direction  'maximize' or 'minimize' (default: maximize for BLEU, accuracy, exact match,
             F1 and the correlations)
  trials     how many trials the study holds when done (default: the grid's size for the
             grid sampler), and/or
  hours      start no trial once this long has passed since the study's first trial began
  sampler    'tpe' (default), 'random' or 'grid' (every combination of 'choice' and 'int'
             values)
  pruner     'median' (default), 'successive_halving' or 'none'; or (name, {keyword: value})
             with Optuna's keywords, e.g. ('median', {'n_startup_trials': 2})
  seed       the sampler's seed (default 0)

Everything here is checked before any trial starts; a mistake is a SearchError of one line.
"""

import math
import os

from t2t_jax import cli

KINDS = ('uniform', 'log_uniform', 'int', 'log_int', 'choice')
SAMPLERS = ('tpe', 'random', 'grid')
PRUNERS = ('median', 'successive_halving', 'none')
KEYS = ('params', 'metric', 'direction', 'trials', 'hours', 'sampler', 'pruner', 'seed')
HIGHER_IS_BETTER = ('bleu', 'accuracy', 'exact_match', 'macro_f1', 'mcc', 'pearson',
                    'spearman')
JOURNAL_PREFIX = 'journal:'  # --storage=journal:PATH: Optuna's journal file.


class SearchError(ValueError):
  """A search that cannot start: a bad file, key, range, metric or storage."""


def load(path: str) -> dict:
  """The checked search of a search file (defaults filled in)."""
  search = cli.call_file_function(path, 'get_search', SearchError, 'search')
  return check(search, path)


def check(search, path: str = 'search') -> dict:
  if not isinstance(search, dict):
    raise SearchError(f'{path}: get_search() must return a dict, got {type(search).__name__}')
  unknown = sorted(set(search) - set(KEYS))
  if unknown:
    raise SearchError(f'{path}: unknown entries {unknown}; a search has {list(KEYS)}')
  params = search.get('params')
  if not isinstance(params, dict) or not params:
    raise SearchError(f"{path}: 'params' must map config keys to ranges, e.g. "
                      "{'opt.lr_scale': ('log_uniform', 0.5, 4.0)}")
  checked = {key.removeprefix('--').removeprefix('config.'): _range(key, value, path)
             for key, value in params.items()}
  metric = search.get('metric')
  if not isinstance(metric, str) or not metric:
    raise SearchError(f"{path}: 'metric' must name what the evaluations report, e.g. 'bleu'")
  direction = search.get('direction', 'maximize' if metric.endswith(HIGHER_IS_BETTER)
                         else 'minimize')
  if direction not in ('maximize', 'minimize'):
    raise SearchError(f"{path}: direction {direction!r} must be 'maximize' or 'minimize'")
  sampler = search.get('sampler', 'tpe')
  if sampler not in SAMPLERS:
    raise SearchError(f'{path}: sampler {sampler!r} must be one of {SAMPLERS}')
  if sampler == 'grid':
    floats = [key for key, (kind, *_) in checked.items() if kind in ('uniform', 'log_uniform')]
    if floats:
      raise SearchError(f"{path}: the grid sampler needs 'choice' or 'int' ranges; {floats} "
                        'are continuous')
  pruner = search.get('pruner', 'median')
  name, options = (pruner, {}) if isinstance(pruner, str) else tuple(pruner)
  if name not in PRUNERS or not isinstance(options, dict):
    raise SearchError(f'{path}: pruner {pruner!r} must be one of {PRUNERS}, or (name, '
                      '{keyword: value})')
  trials, hours = search.get('trials'), search.get('hours')
  if trials is None and sampler == 'grid':
    trials = math.prod(len(grid_values(r)) for r in checked.values())
  if trials is None and hours is None:
    raise SearchError(f"{path}: give a budget: 'trials' (a count) and/or 'hours'")
  if trials is not None and (not isinstance(trials, int) or trials < 1):
    raise SearchError(f"{path}: 'trials' must be a positive integer, got {trials!r}")
  if hours is not None and (not isinstance(hours, (int, float)) or hours <= 0):
    raise SearchError(f"{path}: 'hours' must be a positive number, got {hours!r}")
  return {'params': checked, 'metric': metric, 'direction': direction, 'trials': trials,
          'hours': hours, 'sampler': sampler, 'pruner': [name, options],
          'seed': int(search.get('seed', 0))}


def _range(key: str, value, path: str) -> list:
  where = f'{path}: {key}'
  if not isinstance(value, (tuple, list)) or not value or value[0] not in KINDS:
    raise SearchError(f'{where}: a range is (kind, ...) with kind one of {KINDS}, got {value!r}')
  kind, *rest = value
  if kind == 'choice':
    if len(rest) != 1 or not isinstance(rest[0], (list, tuple)):
      raise SearchError(f"{where}: ('choice', [values]) takes one list")
    if not rest[0]:
      raise SearchError(f'{where}: the choice is empty: give at least one value')
    bad = [v for v in rest[0] if not isinstance(v, (str, int, float, bool))]
    if bad:
      raise SearchError(f'{where}: choices must be strings, numbers or booleans, got {bad}')
    return ['choice', list(rest[0])]
  step = None
  if kind == 'int' and len(rest) == 3:
    rest, step = rest[:2], rest[2]
  if len(rest) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               for v in rest):
    raise SearchError(f'{where}: ({kind!r}, low, high) takes two numbers, got {value!r}')
  low, high = rest
  integer = kind in ('int', 'log_int')
  if integer and not all(isinstance(v, int) for v in (low, high)):
    raise SearchError(f'{where}: an {kind!r} range takes integers, got {low!r}, {high!r}')
  if (low > high) if integer else (low >= high):
    raise SearchError(f'{where}: the range [{low}, {high}] is empty: low must be below high')
  if kind.startswith('log') and low <= 0:
    raise SearchError(f'{where}: a log range needs low > 0, got {low}')
  if step is not None and (not isinstance(step, int) or step < 1):
    raise SearchError(f'{where}: the step must be a positive integer, got {step!r}')
  return [kind, low, high] + ([step] if step else [])


def grid_values(value_range: list) -> list:
  kind, *rest = value_range
  if kind == 'choice':
    return list(rest[0])
  low, high, *step = rest
  return list(range(low, high + 1, step[0] if step else 1))


def suggest(trial, params: dict) -> dict:
  """{config key: value} of `trial`, asked of Optuna for each range."""
  values = {}
  for key, (kind, *rest) in params.items():
    if kind == 'choice':
      values[key] = trial.suggest_categorical(key, rest[0])
    elif kind in ('uniform', 'log_uniform'):
      values[key] = trial.suggest_float(key, rest[0], rest[1], log=kind == 'log_uniform')
    else:
      values[key] = trial.suggest_int(key, rest[0], rest[1], step=rest[2] if len(rest) > 2
                                      else 1, log=kind == 'log_int')
  return values


def sampler(search: dict):
  import optuna  # pylint: disable=g-import-not-at-top
  if search['sampler'] == 'grid':
    space = {key: grid_values(r) for key, r in search['params'].items()}
    return optuna.samplers.GridSampler(space, seed=search['seed'])
  if search['sampler'] == 'random':
    return optuna.samplers.RandomSampler(seed=search['seed'])
  return optuna.samplers.TPESampler(seed=search['seed'])


def pruner(spec):
  """Optuna's pruner of a search's ['name', {options}]."""
  import optuna  # pylint: disable=g-import-not-at-top
  name, options = spec
  kinds = {'median': optuna.pruners.MedianPruner,
           'successive_halving': optuna.pruners.SuccessiveHalvingPruner,
           'none': optuna.pruners.NopPruner}
  try:
    return kinds[name](**options)
  except (TypeError, ValueError) as e:
    raise SearchError(f'pruner {name!r} with {options}: {e}') from None


def storage(url: str):
  """Optuna storage of --storage: an SQLAlchemy URL (sqlite:///PATH, postgresql://...), or
  journal:PATH for Optuna's journal file. Connects now: an unreachable one is a SearchError."""
  import optuna  # pylint: disable=g-import-not-at-top
  if url.startswith(JOURNAL_PREFIX):
    path = url[len(JOURNAL_PREFIX):]
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
      raise SearchError(f'--storage={url}: the directory of {path} does not exist')
    from optuna.storages import journal  # pylint: disable=g-import-not-at-top
    return optuna.storages.JournalStorage(journal.JournalFileBackend(path))
  engine = {}
  if url.startswith('sqlite'):  # Writers wait for each other instead of failing.
    engine = {'connect_args': {'timeout': 120}}
  try:
    return optuna.storages.RDBStorage(url, engine_kwargs=engine)
  except Exception as e:  # pylint: disable=broad-except  # SQLAlchemy's and drivers' errors.
    cause = str(getattr(e, 'orig', None) or e).splitlines()[0]
    raise SearchError(f'--storage={_hide_password(url)}: cannot open the database '
                      f'({type(e).__name__}: {cause})') from None


def _hide_password(url: str) -> str:
  head, at, tail = url.partition('@')
  if not at or ':' not in head.split('//', 1)[-1]:
    return url
  scheme, _, credentials = head.partition('//')
  return f'{scheme}//{credentials.split(":", 1)[0]}:***@{tail}'


def reported_metrics(config) -> set[str]:
  """What the in-loop evaluations of a run of `config` report, at some step."""
  from t2t_jax.decoding import bleu as bleu_lib  # pylint: disable=g-import-not-at-top
  names = {'eval_loss', 'eval_accuracy', 'eval_perplexity'}
  if config.model.kind == 'encoder_only' and config.data.source == 'labelled':
    names |= ({'eval_pearson', 'eval_spearman'} if config.model.head == 'regression' else
              {'eval_macro_f1', 'eval_mcc'})  # training/classifier_eval.py's figures.
  num_steps, every = config.train.num_steps, config.train.eval_every
  steps = set(range(every, num_steps + 1, every)) if every > 0 else set()
  if any(bleu_lib.bleu_sentences_due(step, num_steps, config.eval)
         for step in steps | {num_steps}):
    names |= {'bleu', 'exact_match'}
  if config.opt.get('ema_decay', 0):
    names |= {f'ema_{name}' for name in names}
  if config.eval.get('average_last', 0):
    names |= {f'averaged_{name}' for name in names if not name.startswith('ema_')}
  return names


def check_against_config(search: dict, config, where: str) -> None:
  """Refuses keys the base config lacks and a metric its runs never report."""
  for key in search['params']:
    node, parts = config, key.split('.')
    for depth, part in enumerate(parts):
      try:
        node = node[part]
      except (KeyError, TypeError):
        known = sorted(node.keys()) if hasattr(node, 'keys') else []
        near = [k for k in known if k.startswith(part[:3])]
        raise SearchError(
            f'{where}: no such config key {key!r} ({".".join(parts[:depth + 1])!r} is not in '
            f'the config{"; did you mean " + repr(near[0]) + "?" if near else ""})') from None
  reported = reported_metrics(config)
  if search['metric'] not in reported:
    raise SearchError(f"{where}: metric {search['metric']!r} is never reported by these runs' "
                      f'evaluations, which report {sorted(reported)}')
