"""What the training loop is handed rather than imports: what a run trains, how it is judged and
who hears of it.

- **The objective** (`Task.objective`): the metric sums of a batch under the model, among them
  'loss' (what the train step differentiates) and 'weight' (what sums divide by); the train
  and eval steps call it (step.py). Today's is step.model_metrics, the label-smoothed token
  cross-entropy of translation and language modelling.
- **Evaluators** (`Task.evaluators`): each made once per launch from what the loop built
  (`EvalContext`), then called at each in-loop evaluation with the parameters to judge; their
  figures join the eval loss in the logs, TensorBoard and the final JSON line (a translation
  run's: validation BLEU and exact match, decoding/bleu.py).
- **Reporters** (`Reporter`): told the figures of each in-loop evaluation, and may stop the
  run there (a hyperparameter search's pruner: tuning/trial_report.py). The loop saves the
  step, has each reporter record why, and raises `Pruned`.

tasks.py builds the task of a config (translation, language model); a new kind of run adds its
own there, with no change to the loop (train.py).
"""

import dataclasses
from typing import Any, Callable, Protocol


class Pruned(Exception):
  """A reporter stopped the run (a search's pruner); its step is saved."""

  def __init__(self, step: int, why: str):
    super().__init__(f'{why}; step {step} is saved')
    self.step, self.why = step, why


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """What a launch of the loop built, for evaluators to be made from."""
  config: Any
  setup: Any  # build.Setup: the model config, mesh and rules.
  data: Any  # pipeline.TaskData: the eval split and the vocabulary.
  workdir: str
  eval_dtype: str  # The dtype evaluations decode in (resolve.py).


class Evaluator(Protocol):
  """Judges parameters at an in-loop evaluation."""

  def __call__(self, params, step: int, primary: bool) -> dict[str, float]:
    """Figures of `params` at `step` (maybe none: what is due at that step is the evaluator's
    to say). `primary`: the run's own parameters, not their moving average or an average of
    checkpoints."""

  def record(self, workdir: str, step: int) -> None:
    """Called on process 0 after the evaluation at `step`, outside its interruptible phase: a
    file to keep (the best BLEU's step)."""


@dataclasses.dataclass(frozen=True)
class Task:
  """What the loop is handed: the objective and the makers of its evaluators."""
  name: str
  objective: Callable  # (model, params, batch, label_smoothing, loss_chunk_tokens, **apply) -> sums
  evaluators: tuple[Callable[[EvalContext], Evaluator], ...] = ()
  # Fills what the task reads from its data into the config before anything is checked or
  # built (a classifier's label set), so the run saves it with the rest; None: nothing.
  configure: Callable[[Any], None] | None = None


class Reporter(Protocol):
  """Hears each in-loop evaluation's figures; may stop the run."""

  def decide(self, step: int, results: dict[str, float], last: bool) -> str | None:
    """Called on every process with the same figures after the evaluation at `step` (`last`:
    the run's final step, which is never stopped); why the run stops here, or None. Every
    process must get the same answer."""

  def record(self, workdir: str, step: int, why: str) -> None:
    """Called on process 0 once the step the run stopped at is saved."""


def first_stop(reporters, step: int, results: dict[str, float], last: bool) -> str | None:
  """Why the first reporter that stops the run at `step` stops it, or None; each is asked."""
  answers = [reporter.decide(step, results, last) for reporter in reporters]
  return next((why for why in answers if why), None)
