"""The tasks t2t_jax trains (task.py says what a task is), chosen by the config: translation,
judged by validation BLEU and exact match; language modelling, judged by its loss and
perplexity alone; masked-LM or ELECTRA pre-training of an encoder, judged by the masked tokens'
loss and accuracy (ELECTRA's also by its replaced-token detection's); and classification or
regression, judged by scikit-learn's and SciPy's figures. A new kind of run adds its task
here; the loop does not change."""

import dataclasses
import functools

from t2t_jax.data import classification
from t2t_jax.data import sources
from t2t_jax.decoding import bleu
from t2t_jax.training import classifier_eval
from t2t_jax.training import encoder_tasks
from t2t_jax.training import step
from t2t_jax.training.task import Task

TRANSLATION = Task('translation', objective=step.model_metrics,
                   evaluators=(bleu.ValidationBleu.for_run,))
LANGUAGE_MODEL = Task('language_model', objective=step.model_metrics)
CLASSIFIER = Task('classifier', objective=encoder_tasks.head_metrics,
                  evaluators=(classifier_eval.ClassifierEval.for_run,),
                  configure=lambda config: fill_labels(config))


def for_config(config) -> Task:
  """The task of a config: the encoder-only model's head's, a language model for
  config.data.source='lm', else translation."""
  if config.model.kind == 'encoder_only':
    masking = {'rate': config.data.mlm_rate, 'whole_word': config.data.whole_word_masking}
    if config.model.head == 'mlm':
      return Task('masked_lm', objective=functools.partial(encoder_tasks.mlm_metrics, **masking))
    if config.model.head == 'electra':
      return Task('electra', objective=functools.partial(
          encoder_tasks.electra_metrics, replaced_weight=config.opt.replaced_weight, **masking))
    return CLASSIFIER
  task = LANGUAGE_MODEL if config.data.source == 'lm' else TRANSLATION
  if config.opt.loss_impl != 'xla':
    task = dataclasses.replace(task, objective=functools.partial(
        step.model_metrics, loss_impl=config.opt.loss_impl))
  return task


def fill_labels(config) -> None:
  """A classifier's label set, read from its training file when config.data.labels is empty,
  and its size in config.model.num_labels, so the run saves both in its config."""
  if config.model.head == 'regression':
    config.model.num_labels = 1
    return
  if not config.data.labels:
    path = sources.in_data_dir(config.data, 'train_tsv')
    labelled = classification.read_tsv(path, config.data.bad_lines)
    config.data.labels = tuple(classification.label_names(labelled, regression=False))
  config.model.num_labels = len(config.data.labels)
