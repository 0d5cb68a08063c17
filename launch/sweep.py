"""Expands a sweep file into one training run per point, and summarises a finished sweep.

  python launch/sweep.py configs/sweeps/tiny_grid.py -- \
      python -m t2t_jax.main --config=configs/tiny.py --workdir=/tmp/sweep
  python launch/sweep.py --mode=slurm configs/sweeps/wmt14_ende_lr.py -- \
      python -m t2t_jax.main --config=configs/wmt14_ende.py:big --workdir=/shared/sweep
  python launch/sweep.py --dry_run FILE -- <base command>     # print the commands only
  python launch/sweep.py --summarize /tmp/sweep                # table of final metrics
  python launch/sweep.py --summarize /tmp/sweep --sort=bleu --markdown  # best first, markdown

A sweep file defines `get_sweep()` returning {'product': {key: [values]}, 'zip': {key:
[values]}} (either or both), keys being config keys such as 'opt.lr_scale'. The points are
every combination of the 'product' values, each combined with every position of the 'zip'
lists. Each point runs as the base command with `--config.KEY=VALUE` appended and `--workdir`
replaced by `<workdir>/<point name>`; the point's overrides and command are written to
`sweep_point.json` there. Runs go one after another here (`--mode=local`), or as one SLURM
array job (`--mode=slurm`, one element per point, requeued when preempted like
launch/slurm.sbatch); an element that ends without success leaves `sweep_status.json` with its
exit status, which --summarize reports. No training logic lives here.
"""

import argparse
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAUNCH_DIR))  # The checkout's t2t_jax, installed or not.
from t2t_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import exit_codes  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import workdir_layout  # pylint: disable=g-import-not-at-top,wrong-import-position
STATUS_FILE = 'sweep_status.json'  # Left by a SLURM array element that ended without success.
PREEMPTED = exit_codes.PREEMPTED  # The element is requeued, not failed.
SUMMARY_COLUMNS = ('step', 'bleu', 'eval_loss', 'train_loss', 'steps_per_second',
                   'train_seconds')
DESCENDING = ('bleu', 'steps_per_second')  # --sort puts the highest first; others ascend.


class SweepError(ValueError):
  """A malformed sweep file or base command."""


def load_sweep(path: str) -> dict:
  return cli.call_file_function(path, 'get_sweep', SweepError, 'sweep')


def _key(key: str) -> str:
  key = key.removeprefix('--').removeprefix('config.')
  if not key or '=' in key:
    raise SweepError(f'bad sweep key {key!r}: use a config key such as "opt.lr_scale"')
  return key


def expand(sweep: dict, path: str = 'sweep') -> list[dict[str, object]]:
  """The points of a sweep, each an ordered {config key: value}."""
  unknown = set(sweep) - {'product', 'zip'}
  if unknown or not sweep:
    raise SweepError(f"{path}: get_sweep() must return 'product' and/or 'zip', got "
                     f'{sorted(sweep)}')
  product, zipped = sweep.get('product', {}), sweep.get('zip', {})
  for kind, axes in (('product', product), ('zip', zipped)):
    for key, values in axes.items():
      if not isinstance(values, (list, tuple)) or not values:
        raise SweepError(f'{path}: {kind} key {key!r} needs a non-empty list of values')
  lengths = {key: len(values) for key, values in zipped.items()}
  if len(set(lengths.values())) > 1:
    raise SweepError(f'{path}: zip lists must have equal lengths, got {lengths}')
  grid = [dict(zip(map(_key, product), values))
          for values in itertools.product(*product.values())]
  lines = [dict(zip(map(_key, zipped), values)) for values in zip(*zipped.values())] or [{}]
  return [{**point, **line} for point in grid for line in lines]


def point_name(point: dict[str, object]) -> str:
  """A directory name from the values: the last part of each key, '=' its value, joined by ','."""
  short = [key.rsplit('.', 1)[-1] for key in point]
  names = short if len(set(short)) == len(short) else list(point)
  text = ','.join(f'{name}={value}' for name, value in zip(names, point.values()))
  return ''.join(c if c.isalnum() or c in '=,.-_+' else '_' for c in text)


def _split_workdir(command: list[str]) -> tuple[list[str], str]:
  """The base command without its --workdir, and that workdir (the sweep's root)."""
  rest, root, skip = [], None, False
  for i, arg in enumerate(command):
    if skip:
      skip = False
    elif arg.startswith('--workdir='):
      root = arg.split('=', 1)[1]
    elif arg == '--workdir' and i + 1 < len(command):
      root, skip = command[i + 1], True
    else:
      rest.append(arg)
  if not root:
    raise SweepError('the base command needs --workdir=DIR: each run of the sweep gets '
                     'DIR/<point name>')
  return rest, root


def commands(points: list[dict], base_command: list[str]) -> tuple[str, list[tuple[str, list]]]:
  """The sweep root and (workdir, command) per point."""
  rest, root = _split_workdir(base_command)
  runs = []
  for point in points:
    workdir = os.path.join(root, point_name(point))
    overrides = [f'--config.{key}={value}' for key, value in point.items()]
    runs.append((workdir, rest + overrides + [f'--workdir={workdir}']))
  return root, runs


def _record(workdir: str, point: dict, command: list[str]) -> None:
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'sweep_point.json'), 'w') as f:
    json.dump({'overrides': point, 'command': shlex.join(command)}, f, indent=2)


def run_local(points, runs) -> int:
  """Runs the points one after another; returns how many failed."""
  failed = 0
  for index, (point, (workdir, command)) in enumerate(zip(points, runs), start=1):
    _record(workdir, point, command)
    print(f'=== sweep run {index}/{len(runs)}: {workdir}', flush=True)
    code = subprocess.call(command)
    if code:
      failed += 1
      print(f'=== sweep run {workdir} exited with status {code}', flush=True)
  return failed


def slurm_script(root: str, runs, sbatch_options: list[str]) -> str:
  """An sbatch array script: element i runs line i of the command list in workdir line i."""
  options = '\n'.join(f'#SBATCH {option}' for option in sbatch_options)
  step = shlex.quote(os.path.join(LAUNCH_DIR, 'slurm_step.sh'))
  return f'''#!/bin/bash
#SBATCH --job-name=t2t_sweep
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --output={root}/slurm-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=TERM@300
{options}
set -uo pipefail
mapfile -t COMMANDS < {shlex.quote(os.path.join(root, 'sweep_commands.txt'))}
mapfile -t WORKDIRS < {shlex.quote(os.path.join(root, 'sweep_workdirs.txt'))}
STATUS="${{WORKDIRS[$SLURM_ARRAY_TASK_ID]}}/{STATUS_FILE}"
rm -f "$STATUS"
# slurm_step.sh runs the command with srun and requeues the element when it was preempted.
eval "{step} ${{COMMANDS[$SLURM_ARRAY_TASK_ID]}}"
status=$?
if (( status != 0 && status != {PREEMPTED} )); then
  printf '{{"exit_status": %d, "job": "%s_%s"}}\n' "$status" "$SLURM_ARRAY_JOB_ID" \
      "$SLURM_ARRAY_TASK_ID" > "$STATUS"
fi
exit "$status"
'''


def run_slurm(points, root, runs, sbatch_options, dry_run: bool) -> int:
  script = slurm_script(root, runs, sbatch_options)
  if dry_run:
    print(script)
    return 0
  if shutil.which('sbatch') is None:
    raise SweepError("--mode=slurm submits with SLURM's sbatch, which is not on PATH: run "
                     'this on a SLURM login node (or install slurm-client)')
  for point, (workdir, command) in zip(points, runs):
    _record(workdir, point, command)
  with open(os.path.join(root, 'sweep_commands.txt'), 'w') as f:
    f.write(''.join(shlex.join(command) + '\n' for _, command in runs))
  with open(os.path.join(root, 'sweep_workdirs.txt'), 'w') as f:
    f.write(''.join(workdir + '\n' for workdir, _ in runs))
  path = os.path.join(root, 'sweep.sbatch')
  with open(path, 'w') as f:
    f.write(script)
  return subprocess.call(['sbatch', path])


def _short_names(keys: list[str]) -> dict[str, str]:
  """{config key: column name}: the last part of each key, as point_name shortens it."""
  short = [key.rsplit('.', 1)[-1] for key in keys]
  clash = len(set(short)) < len(short) or set(short) & {'run', *SUMMARY_COLUMNS}
  return dict(zip(keys, keys if clash else short))


def _read_runs(root: str) -> tuple[list[str], list[dict], dict[str, str]]:
  """The swept columns, one {column: value} per run under `root`, and {run: why no figures}
  for the runs without final.json."""
  if not os.path.isdir(root):
    raise SweepError(f'{root}: no such sweep directory')
  runs = []
  for name in sorted(os.listdir(root)):
    workdir = os.path.join(root, name)
    point_path = os.path.join(workdir, 'sweep_point.json')
    final_path = os.path.join(workdir, workdir_layout.FINAL_JSON)
    if not (os.path.exists(point_path) or os.path.exists(final_path)):
      continue
    overrides, final, status = {}, None, None
    if os.path.exists(point_path):
      with open(point_path) as f:
        overrides = json.load(f)['overrides']
    if os.path.exists(final_path):
      final = workdir_layout.read_final(workdir)
    elif os.path.exists(os.path.join(workdir, STATUS_FILE)):
      with open(os.path.join(workdir, STATUS_FILE)) as f:
        status = json.load(f)
    runs.append({'name': name, 'overrides': overrides, 'final': final, 'status': status})
  if not runs:
    raise SweepError(f'{root}: no runs found (no subdirectory holds final.json or '
                     'sweep_point.json)')
  keys = list(dict.fromkeys(key for run in runs for key in run['overrides']))
  names = _short_names(keys)
  rows = []
  for run in runs:
    row = {'run': run['name']}
    row.update({names[key]: run['overrides'].get(key) for key in keys})
    row.update({column: (run['final'] or {}).get(column) for column in SUMMARY_COLUMNS})
    rows.append(row)
  unfinished = {run['name']: _why_unfinished(run['status']) for run in runs
                if run['final'] is None}
  return list(names.values()), rows, unfinished


def _why_unfinished(status: dict | None) -> str:
  if status is None:
    return '(no final.json: running or failed)'
  return (f'(failed: exit status {status["exit_status"]}, SLURM job {status["job"]}; see '
          f'slurm-{status["job"]}.out)')


def _sorted(rows: list[dict], column: str, columns: list[str]) -> list[dict]:
  """Rows by `column`: best first for DESCENDING columns, else ascending; blanks last."""
  if column not in columns:
    raise SweepError(f'--sort={column}: no such column; the table has {", ".join(columns)}')
  present = [row for row in rows if row[column] is not None]
  numbers = all(isinstance(row[column], (int, float)) for row in present)
  present.sort(key=lambda row: row[column] if numbers else str(row[column]),
               reverse=column in DESCENDING)
  return present + [row for row in rows if row[column] is None]


def summarize(root: str, sort: str | None = None, markdown: bool = False) -> str:
  """A table of every run under `root`: its swept values, then its final figures (final.json)."""
  swept, rows, unfinished = _read_runs(root)
  columns = ['run'] + swept + list(SUMMARY_COLUMNS)
  if sort:
    rows = _sorted(rows, sort, columns)
  cells = []
  for row in rows:
    # Swept values as the run names write them (1.0, not 1).
    cells.append([row['run']] + ['-' if row[column] is None else str(row[column])
                                 for column in swept])
    if row['run'] in unfinished:
      cells[-1] += [unfinished[row['run']]] + [''] * (len(SUMMARY_COLUMNS) - 1)
    else:
      cells[-1] += [cli.format_cell(row[column]) for column in SUMMARY_COLUMNS]
  return cli.text_table(columns, cells, markdown)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   usage='%(prog)s [options] SWEEP_FILE -- command ... | '
                                         '%(prog)s --summarize DIR [--sort=COLUMN] '
                                         '[--markdown]')
  parser.add_argument('--mode', choices=('local', 'slurm'), default='local',
                      help='Run the points here one after another, or as a SLURM array.')
  parser.add_argument('--dry_run', action='store_true', help='Print the commands (or the '
                      'SLURM script) and write nothing.')
  parser.add_argument('--sbatch', action='append', default=[],
                      help='Extra #SBATCH option for --mode=slurm, e.g. --sbatch=--gpus=8.')
  parser.add_argument('--summarize', metavar='DIR', help='Print a table of all runs: swept '
                      'values, then final metrics.')
  parser.add_argument('--sort', metavar='COLUMN', help='With --summarize: order the runs by '
                      f'this column, highest first for {" and ".join(DESCENDING)}, lowest '
                      'first for any other (eval_loss, a swept key, ...); runs without it last.')
  parser.add_argument('--markdown', action='store_true', help='With --summarize: print a '
                      'GitHub markdown table.')
  parser.add_argument('rest', nargs=argparse.REMAINDER, help='SWEEP_FILE -- base command')
  args = parser.parse_args()
  if (args.sort or args.markdown) and not args.summarize:
    parser.error('--sort and --markdown go with --summarize DIR')
  try:
    if args.summarize:
      print(summarize(args.summarize, args.sort, args.markdown))
      return
    if '--' not in args.rest or args.rest.index('--') != 1:
      parser.error('give the sweep file, then -- and the base command')
    sweep_file, base_command = args.rest[0], args.rest[2:]
    points = expand(load_sweep(sweep_file), sweep_file)
    root, runs = commands(points, base_command)
    if args.mode == 'slurm':
      sys.exit(run_slurm(points, root, runs, args.sbatch, args.dry_run))
    if args.dry_run:
      for _, command in runs:
        print(shlex.join(command))
      return
    failed = run_local(points, runs)
    print(summarize(root))
    sys.exit(1 if failed else 0)
  except SweepError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  main()
