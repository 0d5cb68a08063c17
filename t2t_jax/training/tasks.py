"""The tasks t2t_jax trains (task.py says what a task is), chosen by the config: translation,
judged by validation BLEU and exact match, and language modelling, judged by its loss and
perplexity alone. A new kind of run adds its task here; the loop does not change."""

from t2t_jax.decoding import bleu
from t2t_jax.training import step
from t2t_jax.training.task import Task

TRANSLATION = Task('translation', objective=step.model_metrics,
                   evaluators=(bleu.ValidationBleu.for_run,))
LANGUAGE_MODEL = Task('language_model', objective=step.model_metrics)


def for_config(config) -> Task:
  """The task of a config: a language model for config.data.source='lm', else translation."""
  return LANGUAGE_MODEL if config.data.source == 'lm' else TRANSLATION
