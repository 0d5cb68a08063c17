"""The entry point in a process of its own (its absl flags clash with prepare.py's in one
process), stopped by a config error before any compile: the fast tier's one subprocess."""

import os
import subprocess
import sys

from conftest import ROOT
from t2t_jax import exit_codes


def test_main_parses_the_config_and_refuses_a_bad_key_before_any_work(tmp_path):
  run = subprocess.run(
      [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py:moe',
       f'--workdir={tmp_path}', '--config.model.moe_top_k=9'],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=300, stdin=subprocess.DEVNULL)
  assert run.returncode == exit_codes.ERROR, run.stderr[-2000:]
  assert 'config.model.moe_top_k=9' in run.stderr
  assert os.listdir(tmp_path) == []  # Refused before anything was written.
