"""The training side of a hyperparameter search (launch/search.py): a run started as a trial
reports its metric at each in-loop evaluation to the study, and stops when the pruner says so,
through the reporter seam of the training loop (training/task.py).

launch/search.py sets the environment variable T2T_JAX_TRIAL to a JSON object: the storage,
the study's name, the trial's id, the metric and the pruner ('median', {...}). Without it
training is unchanged. Only process 0 talks to the study; every process gets its answer.
"""

import json
import os

from absl import logging
import numpy as np

from t2t_jax import workdir_layout

ENV = 'T2T_JAX_TRIAL'


class _Study:
  """Process 0's connection to the trial: reports its evaluations and asks the pruner."""

  def __init__(self, spec: dict):
    import optuna  # pylint: disable=g-import-not-at-top
    from t2t_jax.tuning import search_space  # pylint: disable=g-import-not-at-top
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    self.metric, self.pruner_name = spec['metric'], spec['pruner'][0]
    self.study = optuna.load_study(study_name=spec['study'],
                                   storage=search_space.storage(spec['storage']),
                                   pruner=search_space.pruner(spec['pruner']))
    self.trial = optuna.trial.Trial(self.study, spec['trial_id'])

  def report(self, step: int, results: dict, last: bool = False) -> str | None:
    """Reports `results[metric]` at `step`; why the run should stop there (never at its
    `last` step), or None."""
    value = results.get(self.metric)
    if value is None:
      return None
    self.trial.report(float(value), step)
    if last or not self.trial.should_prune():
      return None
    return self._why(step, float(value))

  def _why(self, step: int, value: float) -> str:
    import optuna  # pylint: disable=g-import-not-at-top
    # The completed trials' values at this step, which the median pruner compares with.
    done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    others = [t.intermediate_values[step] for t in done if step in t.intermediate_values]
    best = (max if self._higher() else min)(others) if others else None
    compared = (f'; the {len(others)} completed trials at this step: median '
                f'{np.median(others):.4g}, best {best:.4g}' if others else '')
    return (f'trial {self.trial.number} pruned at step {step} by the {self.pruner_name} pruner: '
            f'{self.metric} {value:.4g}{compared}')

  def _higher(self) -> bool:
    import optuna  # pylint: disable=g-import-not-at-top
    return self.study.direction == optuna.study.StudyDirection.MAXIMIZE


class TrialReporter:
  """A run as a search's trial: a reporter of the training loop (training/task.py)."""

  def __init__(self, spec: dict):
    import jax  # pylint: disable=g-import-not-at-top
    self._study = _Study(spec) if jax.process_index() == 0 else None

  def decide(self, step: int, results: dict, last: bool) -> str | None:
    """Process 0's answer, on every process: why the run stops here, or None."""
    import jax  # pylint: disable=g-import-not-at-top
    why = self._study.report(step, results, last) if self._study else None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      stop = multihost_utils.broadcast_one_to_all(np.int32(why is not None))
      if stop and why is None:
        why = 'pruned by the search (process 0 logged why)'
    return why

  def record(self, workdir: str, step: int, why: str) -> None:
    """Writes pruned.json, which the search reads if it missed the exit status."""
    with open(os.path.join(workdir, workdir_layout.PRUNED_JSON), 'w') as f:
      json.dump({'step': step, 'why': why}, f)
    logging.warning('%s', why)


def from_environment() -> TrialReporter | None:
  """The trial's reporter where launch/search.py started this run (every process), else None."""
  text = os.environ.get(ENV)
  return TrialReporter(json.loads(text)) if text else None
