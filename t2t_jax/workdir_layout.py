"""A run's workdir, named once: every module that writes or reads its files and folders takes
their names and readers from here.

  <workdir>/config.json      the config as asked and as resolved for the devices
  <workdir>/config.txt       the same as text
  <workdir>/final.json       a finished run's final figures, one strict JSON line
  <workdir>/pruned.json      a run a search's pruner stopped: its step and why
  <workdir>/best_bleu.json   the step with the best validation BLEU
  <workdir>/best_eval.json   a classifier's step with the best eval.best_metric, and its figures
  <workdir>/best_params/     that step's parameters (a params-only checkpoint)
  <workdir>/checkpoints/N    training checkpoints, by step
  <workdir>/averaged/NAME    averaged checkpoints (python -m t2t_jax.average)
  <workdir>/export/NAME      exported parameters (python -m t2t_jax.export)
  <workdir>/ctranslate2/     CTranslate2 models exported for translate --engine=ctranslate2
  <workdir>/profile/         jax.profiler traces of config.train.profile_steps
                             (plugins/profile/<time>/<host>.xplane.pb, .trace.json.gz)
  <root>/trial_NNNN[_seedK]  a hyperparameter search's trials (launch/search.py)
"""

import json
import os

CONFIG_JSON = 'config.json'
CONFIG_TEXT = 'config.txt'
FINAL_JSON = 'final.json'
PRUNED_JSON = 'pruned.json'
BEST_BLEU_JSON = 'best_bleu.json'
BEST_EVAL_JSON = 'best_eval.json'
BEST_PARAMS = 'best_params'
CHECKPOINTS = 'checkpoints'
AVERAGED = 'averaged'
EXPORT = 'export'
CTRANSLATE2 = 'ctranslate2'
PROFILE = 'profile'


def checkpoints_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS)


def averaged_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), AVERAGED)


def export_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), EXPORT)


def ctranslate2_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CTRANSLATE2)


def profile_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), PROFILE)


def trial_name(number: int, seed: int = 0) -> str:
  """A search trial's folder under the search's root: trial_0007, or trial_0007_seed2 for a
  repeat of its point with another seed."""
  return f'trial_{number:04d}' + (f'_seed{seed}' if seed else '')


def read_json(path: str) -> dict | None:
  """A JSON file, or the last record of a JSON-lines file; None where it is missing or not
  JSON."""
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  try:
    return json.loads(text)
  except ValueError:
    try:
      return json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
      return None


def read_final(workdir: str) -> dict | None:
  """A finished run's final figures (final.json), or None."""
  return read_json(os.path.join(workdir, FINAL_JSON))
