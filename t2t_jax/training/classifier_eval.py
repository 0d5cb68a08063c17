"""A classifier's (or regressor's) in-loop evaluator (training/task.py): predictions on the
eval split, scored by scikit-learn (accuracy, macro F1, Matthews correlation) or SciPy (Pearson
and Spearman correlation of a regression); the parameters of the best step by
config.eval.best_metric are kept in <workdir>/best_params (a params-only checkpoint that
ckpt.init_from, the predict command and export read like an averaged one) and the step and
figures in <workdir>/best_eval.json.
"""

import dataclasses
import json
import os
import shutil

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from t2t_jax import sharding
from t2t_jax import workdir_layout
from t2t_jax import workdir_lock
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import classification
from t2t_jax.data import pipeline as data
from t2t_jax.model.decoder_only import make_model

CLASSIFIER_METRICS = ('accuracy', 'macro_f1', 'mcc')
REGRESSION_METRICS = ('pearson', 'spearman')


def scores(labels: np.ndarray, predictions: np.ndarray, regression: bool) -> dict[str, float]:
  """The figures of predictions against gold labels (label indices, or values)."""
  # Imported here: SciPy and scikit-learn take about 0.7 s to import, which every command
  # (training included, through the task seam) would pay at start for a classifier's scores.
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from sklearn import metrics as sk_metrics  # pylint: disable=g-import-not-at-top
  if regression:
    if len(labels) < 2 or np.ptp(labels) == 0 or np.ptp(predictions) == 0:
      return {'pearson': 0.0, 'spearman': 0.0}  # Undefined for constant values.
    return {'pearson': float(stats.pearsonr(labels, predictions)[0]),
            'spearman': float(stats.spearmanr(labels, predictions)[0])}
  return {'accuracy': float(sk_metrics.accuracy_score(labels, predictions)),
          'macro_f1': float(sk_metrics.f1_score(labels, predictions, average='macro')),
          'mcc': float(sk_metrics.matthews_corrcoef(labels, predictions))}


def predictor(setup):
  """A jitted (params, inputs [B, L]) -> float32 outputs [B, C], replicated on every process."""
  model = make_model(dataclasses.replace(setup.model_config, deterministic=True))
  params_sharding = jax.tree.map(lambda s: s.sharding, setup.abstract_state.params)
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  apply = jax.jit(lambda params, inputs: model.apply({'params': params}, inputs,
                                                     method='head_outputs'),
                  in_shardings=(params_sharding, sharding.batch_sharding(setup.mesh)),
                  out_shardings=replicated)

  def predict(params, inputs_BL):
    with sharding.mesh_context(setup.mesh, setup.axis_rules):
      return np.asarray(jax.device_get(apply(params, inputs_BL)))
  return predict


def outputs_and_labels(predict, params, batches, mesh, regression: bool
                       ) -> tuple[np.ndarray, np.ndarray]:
  """(outputs [N, C], gold labels [N]) of every real row of the eval batches, in batch order."""
  outputs, labels = [], []
  for batch in data.eval_batches(batches):
    out_BC = predict(params, sharding.global_batch(batch, mesh)['inputs'])
    targets = multihost_utils.process_allgather(batch['targets'], tiled=True)
    real = targets[:, 0] != 0
    outputs.append(out_BC[real])
    labels.append(classification.decode_regression(targets[real]) if regression
                  else targets[real, 0] - 1)
  if not outputs:
    return np.zeros((0, 1), np.float32), np.zeros(0)
  return np.concatenate(outputs), np.concatenate(labels)


class ClassifierEval:
  """Scores of the eval split at every evaluation; keeps the best step's parameters."""

  def __init__(self, predict, batches, mesh, regression: bool, best_metric: str):
    self.predict, self.batches, self.mesh = predict, batches, mesh
    self.regression, self.best_metric = regression, best_metric
    self._primary = None  # (step, figures, params) of the run's own params' latest evaluation.

  @classmethod
  def for_run(cls, context) -> 'ClassifierEval':
    config, setup = context.config, context.setup
    data_config = config.data
    batches = data.TokenBudgetBatches(
        context.data.eval, data_config.batch_tokens,
        data.bucket_boundaries(data_config.max_len, data_config.min_bucket,
                               data_config.bucket_scale),
        sharding.batch_shards(setup.mesh), shuffle=False, seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())
    return cls(predictor(setup), batches, setup.mesh, config.model.head == 'regression',
               config.eval.best_metric)

  def __call__(self, params, step: int, primary: bool = True) -> dict[str, float]:
    outputs, labels = outputs_and_labels(self.predict, params, self.batches, self.mesh,
                                         self.regression)
    if not len(labels):
      return {}
    predictions = outputs[:, 0] if self.regression else outputs.argmax(-1)
    figures = {f'eval_{name}': value for name, value in
               scores(labels, predictions, self.regression).items()}
    if primary:
      self._primary = (step, figures, params)
    return figures

  def record(self, workdir: str, step: int) -> None:
    if not self._primary or self._primary[0] != step:
      return
    _, figures, params = self._primary
    self._primary = None
    path = os.path.join(workdir, workdir_layout.BEST_EVAL_JSON)
    key = f'eval_{self.best_metric}'
    if os.path.exists(path):
      with open(path) as f:
        best = json.load(f)
      if best['figures'][key] >= figures[key] and best['step'] != step:
        return
    if jax.process_count() == 1:  # One process holds every shard of the params.
      _replace_params(workdir, params, step)
    with open(path + '.tmp', 'w') as f:
      json.dump({'step': step, 'metric': self.best_metric, 'figures': figures}, f)
    os.replace(path + '.tmp', path)
    logging.info('step %d: best %s so far (%.4f)', step, self.best_metric, figures[key])


def _replace_params(workdir: str, params, step: int) -> None:
  """Writes `params` as <workdir>/best_params, replacing the previous best only once whole."""
  final = os.path.join(workdir, workdir_layout.BEST_PARAMS)
  scratch = os.path.join(workdir, workdir_lock.scratch_prefix('.best_params') + str(step))
  with open(os.path.join(workdir, workdir_layout.CONFIG_JSON)) as f:
    config_json = f.read()
  saved_params.write_params(scratch, jax.device_get(params), config_json,
                            {'kind': 'best', 'step': step})
  previous = final + '.previous'
  if os.path.exists(final):
    os.replace(final, previous)
  os.replace(scratch, final)
  if os.path.exists(previous):
    shutil.rmtree(previous)
