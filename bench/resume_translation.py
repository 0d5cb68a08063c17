"""A large file translated twice by `python -m t2t_jax.translate`: once straight through, once
killed with SIGKILL after some chunks and run again; the two outputs compared byte for byte.

  python bench/resume_translation.py --workdir=/tmp/run --input=mono.txt --kill_after=4 \
      -- --sampling=sample --seed=1

Prints one JSON line: lines, seconds and lines/s of the uninterrupted run (its own log line),
the chunks done at the kill, whether the outputs are identical, and the matmul rate measured
before and after (.ci/matmul_rate.py's median). Arguments after `--` go to
both translate commands.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from t2t_jax import cli  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'The trained run that translates.')
flags.DEFINE_string('input', None, 'The file to translate.')
flags.DEFINE_integer('kill_after', 3, 'Chunks written before the SIGKILL.')
flags.DEFINE_integer('chunk_lines', 10000, 'translate --chunk_lines.')


def matmul_gflops() -> float:
  """.ci/matmul_rate.py's median, the yardstick printed beside every wall time."""
  spec = importlib.util.spec_from_file_location(
      'matmul_rate', os.path.join(ROOT, '.ci', 'matmul_rate.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main()['gflops_median']


def _command(output: str, extra: list[str]) -> list[str]:
  return [sys.executable, '-m', 't2t_jax.translate', f'--workdir={FLAGS.workdir}',
          f'--input={FLAGS.input}', f'--output={output}', f'--chunk_lines={FLAGS.chunk_lines}',
          *extra]


def main(argv):
  extra = argv[1:]
  env = dict(os.environ, PYTHONPATH=ROOT)
  before = matmul_gflops()
  with tempfile.TemporaryDirectory() as tmp:
    straight, killed = os.path.join(tmp, 'straight.txt'), os.path.join(tmp, 'killed.txt')
    result = subprocess.run(_command(straight, extra), env=env, capture_output=True, text=True,
                            check=True)
    speed = re.search(r'(\d+) lines in (\d+) chunks; this process translated \d+ of them in '
                      r'([\d.]+) s \(([\d.]+) lines/s\)', result.stderr)
    process = subprocess.Popen(_command(killed, extra), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    parts = killed + '.parts'
    while not (os.path.isdir(parts) and sum(n.startswith('chunk') for n in os.listdir(parts))
               >= FLAGS.kill_after):
      if process.poll() is not None:
        raise RuntimeError('the translation ended before it could be killed: lower --kill_after')
      time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = sum(n.startswith('chunk') for n in os.listdir(parts))
    resumed = subprocess.run(_command(killed, extra), env=env, capture_output=True, text=True,
                             check=True)
    with open(straight, 'rb') as a, open(killed, 'rb') as b:
      identical = a.read() == b.read()
  print(json.dumps({
      'bench': 'resume_translation', 'input': FLAGS.input, 'extra_flags': extra,
      'lines': int(speed.group(1)), 'chunks': int(speed.group(2)),
      'seconds': float(speed.group(3)), 'lines_per_second': float(speed.group(4)),
      'chunks_done_at_kill': done, 'resumed_log': 'Resuming:' in resumed.stderr,
      'identical': identical, 'matmul_gflops_before': round(before, 1),
      'matmul_gflops_after': round(matmul_gflops(), 1)}))


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir', 'input'])
  cli.run(main)
