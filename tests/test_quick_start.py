"""The README's quick start keeps its promise: the default run ends near its final JSON line."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

# How far a run may land from the README's figures (same code, another CPU or XLA build).
# The default cools down to lr 0 (configs/default.py), so its final figures sit at their ceiling
# and seeds or rounding move them by far less than this (docs/training.md, "The default run").
TOLERANCE = {'exact_match': 1.0, 'bleu': 0.5, 'eval_accuracy': 0.002}  # Lower bounds, absolute.
EVAL_LOSS_MARGIN = 0.001  # eval_loss at most this much above the README's.


def readme_final_line() -> dict:
  """The JSON line the README's quick start says the default run ends with."""
  with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
  line = re.search(r'^(\{"config": "default".*\})$', text, re.MULTILINE).group(1)
  return json.loads(line)


@pytest.mark.slow
def test_the_default_run_ends_at_the_readmes_figures(tmp_path):
  expected = readme_final_line()
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop('XLA_FLAGS', None)  # One CPU device, as a user's plain run has.
  run = subprocess.run([sys.executable, '-m', 't2t_jax.main', '--config=configs/default.py',
                        f'--workdir={tmp_path}'], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800, stdin=subprocess.DEVNULL)
  assert run.returncode == 0, run.stderr[-3000:]
  final = json.loads(run.stdout.strip().splitlines()[-1])
  assert final['step'] == expected['step']
  for key, below in TOLERANCE.items():
    assert final[key] >= expected[key] - below, (key, final, expected)
  assert final['eval_loss'] <= expected['eval_loss'] + EVAL_LOSS_MARGIN, (final, expected)
  assert expected['exact_match'] >= 99.0  # The promise itself: the default learns the task.
