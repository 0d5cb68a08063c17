"""A dry run's result as readable lines (the table `--dry_run_target` prints; its JSON line
has it all), and the units they are written in."""

# The programs a target dry run compiles, by the names its result gives them.
TRAIN, EVAL, SEARCH = 'train_step', 'eval_step', 'search'


def _figures(x: float) -> str:
  """Three significant figures, without an exponent: '2.31', '816', '1000', '1010'."""
  text = f'{x:.3g}'
  return text if 'e' not in text else f'{x:.0f}'


def human_bytes(n: float) -> str:
  """'2.31 GiB', '816 KiB', '1010 MiB': binary units, three significant figures."""
  for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(n) >= size:
      return f'{_figures(n / size)} {unit}'
  return f'{n:.0f} B'


def _short_op_name(op_name: str, width: int = 90) -> str:
  """The end of an op_name, which says most: '.../decoder_3/ffn_block/ffn/wo/dot_general'."""
  name = op_name.removeprefix('jit(train_step)/')
  return name if len(name) <= width else '...' + name[-width + 3:]


def human_seconds(s: float) -> str:
  return f'{_figures(s * 1e3)} ms' if s >= 1e-3 else f'{_figures(s * 1e6)} us'


def table(result: dict) -> str:
  """The report of a target dry run as a few readable lines (the JSON line has it all)."""
  mesh = ' '.join(f'{axis}={size}' for axis, size in result['mesh'].items())
  lines = [f'{result["config"]} for {result["target"]} ({result["device_count"]} x '
           f'{result["device_kind"]}), compiled by {result["compiler"]}',
           f'mesh {mesh}; {result["dtype"]}; batch {result["batch_shape"][0]} x '
           f'{result["batch_shape"][1]}; scan_layers={result["scan_layers"]}, '
           f'remat={result["remat"]}, attention={result["attention_impl"]}',
           f'{"program":<11} {"compile":>8} {"arguments":>10} {"temporary":>10} {"outputs":>10} '
           f'{"code":>10} {"needs":>10} {"usable":>10}  fits']
  for name, program in result['programs'].items():
    memory = program['memory_per_device_bytes']
    compile_time = f'{program["compile_seconds"]:.1f} s'
    if program.get('compiler_error'):
      lines.append(f'{name:<11} {compile_time:>8}  refused by the compiler: '
                   f'{program["compiler_error"]}')
      continue
    sizes = (memory['argument'], memory['temp'], memory['output'] - memory['alias'],
             memory['generated_code'], program['needs_bytes'], result['usable_memory_bytes'])
    lines.append(f'{name:<11} {compile_time:>8} ' + ' '.join(f'{human_bytes(n):>10}'
                                                          for n in sizes)
                 + f'  {"yes" if program["fits"] else "NO"}')
  if 'collectives' in result:
    parts = [f'{kind} x{row["count"]} ({human_bytes(row["bytes"])})'
             for kind, row in result['collectives'].items()]
    lines.append('collectives per device and step: ' + (', '.join(parts) or 'none'))
    lines.append(f'FLOPs per step: XLA {result["flops_per_step"]:.3g} (before partitioning), '
                 f'analytic {result["analytic_flops_per_step"]:.3g}; compiled '
                 f'{result["compiled_flops_per_device"]:.3g} per device')
  train = result['programs'].get(TRAIN, {})
  if 'cost_by_part' in train:
    lines.append(f'train step by part (per device, predicted): {"part":<12} {"HBM bytes":>10} '
                 f'{"kernel time":>11} {"kernels":>8}')
    for part, row in train['cost_by_part'].items():
      lines.append(f'{"":<43}{part:<12} {human_bytes(row["hbm_bytes"]):>10} '
                   f'{human_seconds(row["seconds"]):>11} {row["kernels"]:>8}')
    lines.append('heaviest kernels of the train step (predicted time per step, all runs):')
    for kernel in train['heaviest_kernels']:
      lines.append(f'  {human_seconds(kernel["seconds"]):>9} '
                   f'{human_bytes(kernel["hbm_bytes"]):>10} x{kernel["runs"]:<4} '
                   f'{kernel["part"]:<12} {kernel["kernel"]}: '
                   f'{_short_op_name(kernel["op_name"])}')
  if 'prediction' in result:
    p = result['prediction']
    lines.append(f'predicted (a roofline, not a measurement): step '
                 f'{human_seconds(p["step_seconds"])} = kernels '
                 f'{human_seconds(p["kernel_seconds"])} (compute alone '
                 f'{human_seconds(p["compute_seconds"])}, memory alone '
                 f'{human_seconds(p["memory_seconds"])}) + collectives '
                 f'{human_seconds(p["collective_seconds"])}'
                 + (f' - {human_seconds(p["overlapped_collective_seconds"])} of them beside '
                    'the kernels' if p.get('overlapped_collective_seconds') else '')
                 + f'; {p["bound"]}-bound; '
                 f'{p["target_tokens_per_second"]:,} target tokens/s; MFU '
                 f'{100 * p["mfu"]:.1f}%')
  return '\n'.join(lines)
