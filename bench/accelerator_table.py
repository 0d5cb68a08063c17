"""The accelerator table, compiled on this CPU: the paper's models on TPU slices and GPU hosts,
each with its best mesh, memory per device and predicted step (docs/results/accelerators.md).

  python bench/accelerator_table.py                       # every part, every target
  python bench/accelerator_table.py --parts=table --targets=tpu:v5e-8 --configs=base
  python bench/accelerator_table.py --markdown=bench/results/accelerator_table_cpu_DATE.jsonl

Parts (--parts), each printing one JSON line per result and appending it to --out:

  table       for each config (WMT14 base and big, 25k-token batches) and target: the mesh
              search of `t2t_jax.main --dry_run --search_mesh` (t2t_jax/compile/mesh_choice.py), its
              winner's memory, predicted step, target tokens/s and MFU, and the predicted wall
              time of the paper's schedule (100k steps for base, 300k for big) beside the
              paper's 12 hours and 3.5 days on 8 P100s.
  h100_point  the one measured accelerator point (docs/results/performance.md: Transformer-big in
              bfloat16, 384 x 64 tokens, one H100, 86.1-88.4 ms a step) predicted the same way.
  pallas      big on tpu:v5e-8 at the table's best mesh, with einsum and with Pallas splash
              attention (attention dropout 0 in both): what the kernel changes in the
              prediction and in memory.
  recheck     each table row of --rows (default --out; of --configs and --targets) compiled
              again at its winning mesh with this code (its eval step and search too), as a
              new row of --out naming the search's commit: after a change to the cost model,
              a chip's figures or the code, the table without a new search. With
              --override KEY=VALUE (repeatable) each row's config changes so, and the row
              names it (the GPU rows with flash attention and the fused loss, say).

Every line carries the matmul rate of this CPU, measured at the start, beside the compile
seconds: they are this machine's, on its day.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # Compile for the targets; run nothing anywhere.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from bench import common  # pylint: disable=wrong-import-position
from configs import wmt14_ende  # pylint: disable=wrong-import-position
from t2t_jax import runtime  # pylint: disable=wrong-import-position
from t2t_jax.compile import dry_run  # pylint: disable=wrong-import-position
from t2t_jax.compile import mesh_choice as mesh_search  # pylint: disable=wrong-import-position

TARGETS = ('tpu:v5e-8', 'tpu:v5e-16', 'tpu:v4-8', 'tpu:v5p-8', 'tpu:v6e-8', 'gpu:h100x8',
           'gpu:a100x8')
PAPER = {'base': (100_000, 12 * 3600.0), 'big': (300_000, 3.5 * 86400.0)}  # Steps, seconds.
H100_MEASURED = (0.0861, 0.0884)  # Step seconds, docs/results/performance.md, 2026-11-22.


def _emit(record: dict, out: str) -> None:
  line = json.dumps(record)
  print(line, flush=True)
  with open(out, 'a') as f:
    f.write(line + '\n')


def _config(name: str, **changes):
  config = wmt14_ende.get_config(name)
  for key, value in changes.items():
    section, field = key.split('.')
    setattr(getattr(config, section), field, value)
  return config


def table_part(configs, target_names, base_record, out) -> None:
  for name in configs:
    for target in target_names:
      ranked = mesh_search.search(_config(name), target, print_progress=True)
      best = ranked[0] if ranked and ranked[0].fits else None
      record = {**base_record, 'part': 'table', 'config': name, 'target': target,
                'candidates': [c.as_dict() for c in ranked]}
      if best:
        record.update(mesh=list(best.mesh), scan_layers=best.scan_layers, remat=best.remat,
                      shard_update=best.shard_update, **_winner_fields(name, best.result))
      _emit(record, out)


def recheck_part(configs, target_names, base_record, out, rows_from, overrides=()) -> None:
  rows = [json.loads(line) for line in open(rows_from or out) if '"part": "table"' in line]
  latest = {(row['config'], row['target']): row for row in rows if 'mesh' in row
            and not row.get('overrides') and row['config'] in configs
            and row['target'] in target_names}
  for (name, target), row in latest.items():
    config = _config(name, **{'mesh.shape': tuple(row['mesh']) + (1,),
                              'model.scan_layers': row['scan_layers'],
                              'model.remat': row['remat'],
                              'mesh.shard_update': row.get('shard_update', False)})
    for override in overrides:
      common.apply_override(config, override)
    result = dry_run.dry_run(config, target)
    _emit({**row, **base_record, **_winner_fields(name, result), 'overrides': list(overrides),
           'search_commit': row.get('search_commit', row['commit'])}, out)


def _winner_fields(name: str, result: dict) -> dict:
  """A table row's figures of the winning mesh's dry run."""
  steps, paper_seconds = PAPER[name]
  prediction = result['prediction']
  return dict(
      needs_bytes=result['programs']['train_step']['needs_bytes'],
      usable_memory_bytes=result['usable_memory_bytes'], programs=result['programs'],
      batch_shape=result['batch_shape'], step_seconds=prediction['step_seconds'],
      bound=prediction['bound'], prediction=prediction,
      target_tokens_per_second=prediction['target_tokens_per_second'], mfu=prediction['mfu'],
      compiler=result['compiler'], collectives=result['collectives'],
      predicted_schedule_hours=round(steps * prediction['step_seconds'] / 3600, 2),
      paper_schedule_hours=paper_seconds / 3600, paper_steps=steps)


def h100_point_part(base_record, out) -> None:
  config = _config('big', **{'model.dtype': 'bfloat16', 'model.attention_dropout': 0.0,
                             'opt.loss_chunk_tokens': 4096, 'data.max_len': 64,
                             'data.min_bucket': 64, 'data.batch_tokens': 384 * 64,
                             'eval.bleu_sentences': 0})
  result = dry_run.dry_run(config, 'gpu:h100x1', evaluation=False)
  predicted = result['prediction']['step_seconds']
  _emit({**base_record, 'part': 'h100_point', 'config': 'big', 'target': 'gpu:h100x1',
         'batch_shape': result['batch_shape'], 'prediction': result['prediction'],
         'measured_step_seconds': list(H100_MEASURED),
         'measured_over_predicted': [round(m / predicted, 3) for m in H100_MEASURED],
         'kernels_per_step': result['kernels_per_step'],
         'compile_seconds': result['compile_seconds']}, out)


def pallas_part(mesh, base_record, out) -> None:
  for impl in ('einsum', 'pallas'):
    config = _config('big', **{'model.attention_dropout': 0.0, 'model.attention_impl': impl,
                               'mesh.shape': tuple(mesh) + (1,), 'model.scan_layers': True,
                               'eval.bleu_sentences': 0})
    result = dry_run.dry_run(config, 'tpu:v5e-8', evaluation=False)
    train = result['programs']['train_step']
    _emit({**base_record, 'part': 'pallas', 'config': 'big', 'target': 'tpu:v5e-8',
           'attention_impl': impl, 'mesh': list(mesh), 'prediction': result['prediction'],
           'needs_bytes': train['needs_bytes'], 'compile_seconds': train['compile_seconds'],
           'compiled_flops_per_device': result['compiled_flops_per_device'],
           'hbm_bytes_per_device': result['hbm_bytes_per_device']}, out)


def _order(target: str) -> int:
  return TARGETS.index(target) if target in TARGETS else len(TARGETS)


def markdown(path: str) -> str:
  """The table of docs/results/accelerators.md from a results file."""
  # The last row of each model, target and overrides: a recheck replaces its search's row.
  latest = {}
  for line in open(path):
    if '"part": "table"' in line:
      row = json.loads(line)
      latest[(row['config'], row['target'], tuple(row.get('overrides', ())))] = row
  rows = sorted(latest.values(), key=lambda row: (row['config'], _order(row['target']),
                                                  len(row.get('overrides', ()))))
  lines = ['| model | target | best mesh (data, fsdp, tensor) | scan, remat | memory per device '
           '(of usable) | predicted step | target tokens/s | MFU | bound | paper schedule '
           '(predicted) | compiled at (searched at) |', '|' + '---|' * 11]
  for row in rows:
    if 'mesh' not in row:
      lines.append(f'| {row["config"]} | {row["target"]} | nothing fits | | | | | | | | '
                   f'{row.get("commit", "")} |')
      continue
    searched = row.get('search_commit', row['commit'])
    gib = lambda n: f'{n / 2**30:.1f}'
    settings = ''.join(f'<br>`{o}`' for o in row.get('overrides', ()))
    lines.append(
        f'| {row["config"]}{settings} | {row["target"]} | {tuple(row["mesh"])} | '
        f'{"scan" if row["scan_layers"] else "unrolled"}, {row["remat"]}'
        f'{", update split" if row.get("shard_update") else ""} | '
        f'{gib(row["needs_bytes"])} of {gib(row["usable_memory_bytes"])} GiB | '
        f'{1e3 * row["step_seconds"]:.3g} ms | {row["target_tokens_per_second"]:,} | '
        f'{100 * row["mfu"]:.0f}% | {row["bound"]} | {row["paper_steps"] // 1000}k steps: '
        f'{row["predicted_schedule_hours"]:.1f} h (paper: {row["paper_schedule_hours"]:.0f} h '
        f'on 8 P100) | {row["commit"]}' + (f' ({searched})' if searched != row['commit'] else '')
        + ' |')
  return '\n'.join(lines)


def main():
  runtime.reexec_with_huge_pages(sys.argv)  # As every command: its compiles run on this CPU.
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--parts', default='table,h100_point,pallas')
  parser.add_argument('--targets', default=','.join(TARGETS))
  parser.add_argument('--configs', default='base,big')
  parser.add_argument('--out', default=f'bench/results/accelerator_table_cpu_'
                      f'{datetime.date.today().isoformat()}.jsonl')
  parser.add_argument('--rows', default='', help='recheck: the searched rows to compile again '
                      '(a results file; default --out). The new rows go to --out.')
  parser.add_argument('--override', action='append', default=[],
                      help='recheck: KEY=VALUE set on each row\'s config (repeatable); the '
                      'rows name them and the table shows them beside the model.')
  parser.add_argument('--markdown', default='', help='Print the table of this results file.')
  args = parser.parse_args()
  if args.markdown:
    print(markdown(args.markdown))
    return
  runtime.start(cache_directory='')  # Compile times are fresh ones.
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True,
                          text=True, check=False).stdout.strip()
  base_record = {'date': datetime.date.today().isoformat(), 'commit': commit,
                 'jax': jax.__version__,
                 'cpu_matmul_flops_per_second': common.matmul_flops_per_second()}
  parts = args.parts.split(',')
  if 'table' in parts:
    table_part(args.configs.split(','), args.targets.split(','), base_record, args.out)
  if 'h100_point' in parts:
    h100_point_part(base_record, args.out)
  if 'recheck' in parts:
    recheck_part(args.configs.split(','), args.targets.split(','), base_record, args.out,
                 args.rows, args.override)
  if 'pallas' in parts:
    best = [json.loads(line) for line in open(args.out) if '"part": "table"' in line
            and '"config": "big"' in line and '"target": "tpu:v5e-8"' in line]
    pallas_part(best[-1]['mesh'] if best and 'mesh' in best[-1] else (8, 1, 1), base_record,
                args.out)
  if 'table' in parts:
    print(markdown(args.out))


if __name__ == '__main__':
  main()
