"""Where a compiled train step's HBM bytes and predicted time go, by part of the model: the
dry run's `cost_by_part` for the train step alone, from a fresh compile or from HLO text kept
by an earlier one (so a program compiled at another commit is read by this commit's cost
model, the same way as today's).

  python bench/bytes_by_part.py --config=configs/wmt14_ende.py:base --target=tpu:v5e-8 \
      --override='mesh.shape=(4,2,1)' --hlo_out=/tmp/base_v5e8.hlo
  python bench/bytes_by_part.py --hlo_in=/tmp/base_v5e8.hlo --target=tpu:v5e-8

Prints one JSON line (bytes, kernel seconds and launches per part, the prediction, and the
commit that read it) and a table. A program compiled before the train step named its loss
and optimiser scopes (commit 15f8930) has those parts under 'other'.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # pylint: disable=wrong-import-position
from t2t_jax import runtime  # pylint: disable=wrong-import-position
from t2t_jax.compile import dry_run  # pylint: disable=wrong-import-position
from t2t_jax.compile import hlo_cost  # pylint: disable=wrong-import-position
from t2t_jax.compile import report as report_lib  # pylint: disable=wrong-import-position
from t2t_jax.compile import roofline  # pylint: disable=wrong-import-position
from t2t_jax.compile import targets  # pylint: disable=wrong-import-position


def _commit() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=root, capture_output=True,
                       text=True, check=False)
  return run.stdout.strip() or 'unknown'


def compiled_text(config_arg: str, target: str, overrides: list[str]) -> tuple[str, int]:
  """The optimised HLO text of the config's train step compiled for the target, and the
  program's device count."""
  path, _, variant = config_arg.partition(':')
  spec = importlib.util.spec_from_file_location('bench_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant) if variant else module.get_config()
  for override in overrides:
    common.apply_override(config, override)
  kept = {}
  analyse = hlo_cost.analyse

  def keep(text, num_devices):
    kept.setdefault('text', (text, num_devices))  # The train step is compiled first.
    return analyse(text, num_devices)
  dry_run.hlo_cost.analyse = keep
  try:
    dry_run.dry_run(config, target, evaluation=False)
  finally:
    dry_run.hlo_cost.analyse = analyse
  return kept['text']


def report(text: str, num_devices: int, target_name: str) -> dict:
  target = targets.parse(target_name)
  cost = hlo_cost.analyse(text, num_devices)
  prediction = roofline.predict(cost, target, [0] * num_devices)
  return {'bench': 'bytes_by_part', 'target': target_name, 'read_by': _commit(),
          'hbm_bytes_per_device': cost.hbm_bytes,
          'kernels_per_step': sum(k.count for k in cost.kernels),
          'prediction': prediction.as_dict(),
          'cost_by_part': roofline.by_part(cost, target, prediction),
          'heaviest_kernels': roofline.heaviest(cost, target)}


def table(result: dict) -> str:
  size, seconds = report_lib.human_bytes, report_lib.human_seconds
  lines = [f'{"part":<13} {"HBM bytes":>10} {"kernel time":>11} {"kernels":>8}']
  for part, row in result['cost_by_part'].items():
    lines.append(f'{part:<13} {size(row["hbm_bytes"]):>10} '
                 f'{seconds(row["seconds"]):>11} {row["kernels"]:>8}')
  p = result['prediction']
  lines.append(f'{"all":<13} {size(result["hbm_bytes_per_device"]):>10}; '
               f'predicted step {seconds(p["step_seconds"])} (compute alone '
               f'{seconds(p["compute_seconds"])}, memory alone '
               f'{seconds(p["memory_seconds"])}, collectives '
               f'{seconds(p["collective_seconds"])}, of which '
               f'{seconds(p["overlapped_collective_seconds"])} beside the kernels)')
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/wmt14_ende.py:base')
  parser.add_argument('--target', required=True, help='tpu:v5e-8, gpu:h100x8, ...')
  parser.add_argument('--override', action='append', default=[],
                      help="A config setting, 'mesh.shape=(4,2,1)'; repeatable.")
  parser.add_argument('--hlo_in', default='', help='Read this HLO text instead of compiling.')
  parser.add_argument('--hlo_out', default='', help='Keep the compiled HLO text here.')
  parser.add_argument('--devices', type=int, default=0,
                      help='With --hlo_in: the program\'s device count (default: the target\'s).')
  args = parser.parse_args()
  runtime.start()
  if args.hlo_in:
    with open(args.hlo_in) as f:
      text = f.read()
    num_devices = args.devices or targets.parse(args.target).num_devices
  else:
    text, num_devices = compiled_text(args.config, args.target, args.override)
    if args.hlo_out:
      with open(args.hlo_out, 'w') as f:
        f.write(text)
  result = report(text, num_devices, args.target)
  # What was compiled, so that a kept line says which program it reads.
  result.update({'hlo_in': args.hlo_in} if args.hlo_in else
                {'config': args.config, 'overrides': args.override})
  print(table(result), flush=True)
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  main()
