"""t2t_jax's train step beside Flax's WMT example (the reference), compiled for one chip of
each accelerator and read by the same cost model: bench/compare.py's question, without the
hardware.

  python bench/accelerator_compare.py                                 # base and big, 5 chips
  python bench/accelerator_compare.py --targets=tpu:v5e-1 --models=base
  python bench/accelerator_compare.py --size=tiny --targets=tpu:v5e-1  # seconds (the test)

Both train steps are compiled by the target's own compiler (libtpu, or XLA's GPU compiler in
JAX's CUDA plugin) for one compile-only device of t2t_jax/compile/targets.py: tpu:v5e-1,
tpu:v5p-2 (one chip: v5p sizes count its two TensorCores), tpu:v6e-1, gpu:h100x1 and
gpu:a100x1. Nothing runs. Each program is read by t2t_jax's cost model (compile/hlo_cost.py:
every kernel's FLOPs and HBM bytes, loops counted as often as they run) and its roofline
(compile/roofline.py), as `--dry_run_target` reads t2t_jax's own step, and beside that by the
target compiler's own `cost_analysis()`.

Shapes, per chip: the paper's base (configs/wmt14_ende.py:base: 37,000 shared tokens, d 512,
ff 2048, 6+6 layers, 8 heads) at 12 rows of 256 tokens a side, big (d 1024, ff 4096, 16
heads) at 6 x 256; --size=tiny: bench/common.py's tiny model at 4 x 16. The state, batch and
keys are ShapeDtypeStructs: no array is made.

Equal work, as bench/compare.py builds it (the reference's step is its `reference_step`):
pre-LN (the example is pre-LN), dropout 0.1 on every residual, on the attention weights (so
t2t_jax's attention is einsum, or with --attention_impl=flash on a GPU its flash kernels, the
ones with attention dropout; with --loss_impl=fused its output layer and loss are its fused
kernels) and on the feed-forward hidden
units (the example drops them at its residual rate), label smoothing 0.1, bfloat16 compute and
float32 parameters, one embedding matrix shared by source, target and output, Adam. t2t_jax
computes its loss in chunks of configs/wmt14_ende.py's 4096 tokens (one chunk at these
batches). Each side keeps its own defaults where the example has no knob: t2t_jax draws its
dropout masks with its 'hash32' PRNG, the example with JAX's threefry (its random bits are
most of its extra kernels); the example's loss multiplies a one-hot [B, L, V] matrix and
computes its cross-entropy a second time for its metrics (bench/compare.py lists the rest).

Output: per target and model, one JSON line per implementation (kernels per step, HBM bytes,
FLOPs, compute alone, memory alone, predicted step, predicted target tokens/s and MFU, the
time the roofline charges to asynchronous copies and slices and the compute-bound kernels'
slack (below), the compiler's 'flops', 'bytes accessed' and 'optimal_seconds' or null with
the reason, the gaps between the two counts and, above 20%, what makes them) and one ratio
line (t2t_jax's predicted tokens/s over the example's, and its HBM bytes over the example's),
each printed and appended to --out (default bench/results/accelerator-compare-<date>.jsonl);
then a table.

The gaps between hlo_cost and the TPU compiler's cost_analysis (gap = hlo_cost / XLA - 1):
  - bytes, -57% (v5p) to -75% (v5e) at base: XLA's 'bytes accessed' is not HBM traffic. It
    counts every memory space, the TPU's on-chip VMEM (S(1) in the HLO) too, where hlo_cost
    counts HBM only; and it counts asynchronous copies and slices again: a copy-start as
    writing its whole result (the copy and the source it aliases) and its copy-done as
    writing the copy once more, a slice-done as writing its slice once more. hlo_cost
    recounted with every memory space, plus those passes, comes within 0.2% of XLA's figure
    for both implementations at base on every TPU (`bytes_rebuilt` in each line). At
    --size=tiny the rebuild falls short (4.6 MB of XLA's 19 MB): there XLA also counts TPU
    arrays padded to their tiles ((8, 128) and the like), which multiplies small dims (32 ->
    128); counting tiles too reaches 17.1 of 18.9 MB (t2t_jax) and 18.6 of 20.4 MB (the
    example) on v5e (measured once, by hand; not done here).
  - FLOPs, -3% (t2t_jax) and -9% (the example) at base: hlo_cost counts matrix products only
    (dots and convolutions, which equal the analytic count), XLA elementwise work too: the
    softmaxes, layer norms, dropout masks, Adam and the loss over the vocabulary, which the
    example computes on a one-hot matrix and twice. At tiny dims elementwise work is a large
    share of all (gaps of -35% and -57%). No loop here runs more than once, so XLA counting a
    loop body once changes nothing.
  - step against 'optimal_seconds': libtpu's 'optimal_seconds' is negative for these
    programs at base and big (about -500 s), not a time, so that gap is null with the reason;
    at tiny it is its own estimate with fixed costs per op, far above a roofline of 0.6 MB.
The GPU compiler gives no cost analysis for a compile-only device (null, with the reason).

Asynchronous copies (`async_copy_seconds`): on a TPU the compiler prefetches weights,
activations and the optimiser's operands into on-chip memory with copy-start and slice-start
kernels, and the roofline adds their time to the kernels' as it adds every kernel's. The chip
runs them beside the kernels between their start and done, while those leave memory idle:
`compute_slack_seconds` sums each compute-bound kernel's compute time less its memory time.
With every copy fitted into that slack the roofline would give the prediction less the
smaller of the two; a roofline that overlaps them as the schedule allows lies between, and a
measured step, as ever, above it.
"""

import dataclasses
import datetime
import functools
import os
import subprocess
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # Compile for the targets; run nothing anywhere.

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top,wrong-import-position
import compare  # pylint: disable=g-import-not-at-top,wrong-import-position
import flax_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

from configs import wmt14_ende  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import dry_run  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import hlo_cost  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import hlo_text  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import report  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import roofline  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.compile import targets  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.model import flops  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.model import prng  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.training import build  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ('tpu:v5e-1', 'tpu:v5p-2', 'tpu:v6e-1', 'gpu:h100x1', 'gpu:a100x1')
MODELS = ('base', 'big')
ROWS = {'base': 12, 'big': 6}  # Per chip, of LENGTH tokens on each side.
LENGTH = 256
DROPOUT = dict(dropout=0.1, attention_dropout=0.1, relu_dropout=0.1)
DTYPE = 'bfloat16'
GAP = 0.2  # Gaps between the two cost counts larger than this are explained in the line.


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command's flags, in `flag_values` (absl's global ones when run as a command)."""
  flags.DEFINE_list('targets', list(TARGETS), 'Comma-separated one-chip targets '
                    '(t2t_jax/compile/targets.py names).', flag_values=flag_values)
  flags.DEFINE_list('models', list(MODELS), f'From {MODELS}; --size=tiny runs the tiny model '
                    'instead.', flag_values=flag_values)
  flags.DEFINE_enum('size', 'full', ['full', 'tiny'], 'tiny: bench/common.py\'s tiny model at '
                    '4 x 16 tokens, for tests.', flag_values=flag_values)
  flags.DEFINE_string('out', '', 'JSON lines file to append to; default '
                      'bench/results/accelerator-compare-<date>.jsonl.', flag_values=flag_values)
  flags.DEFINE_string('hlo_dir', '', 'Also write each compiled program\'s optimised HLO here '
                      '(<target>_<model>_<implementation>.hlo), to read kernel by kernel.',
                      flag_values=flag_values)
  flags.DEFINE_enum('attention_impl', 'einsum', ['einsum', 'flash'], "t2t_jax's attention: "
                    "einsum, or 'flash' (its Pallas kernels with attention dropout; GPU "
                    'targets).', flag_values=flag_values)
  flags.DEFINE_enum('loss_impl', 'xla', ['xla', 'fused'], "t2t_jax's output layer and loss: "
                    "'xla' (in chunks), or 'fused' (its Pallas kernels, no logits stored; GPU "
                    'targets).', flag_values=flag_values)
  flags.DEFINE_string('reference_dir', '../shared/anchor/flax_wmt',
                      "Flax's examples/wmt (models.py, train.py); relative to the cwd.",
                      flag_values=flag_values)

  def known_models(names):
    if set(names) - set(MODELS):
      raise flags.ValidationError(f'unknown {sorted(set(names) - set(MODELS))}; choose from '
                                  f'{MODELS}')
    return True
  flags.register_validator('models', known_models, flag_values=flag_values)


def parse_flags(argv: list[str]) -> flags.FlagValues:
  """`argv` (flags only) parsed into flag values of their own, absl's global ones untouched."""
  return common.own_flags(define_flags, 'accelerator_compare.py', argv)


def model_shape(name: str) -> common.Shape:
  """The dims of configs/wmt14_ende.py's `name` ('tiny': bench/common.py's) and the batch."""
  if name == 'tiny':
    return common.SHAPES['tiny']
  config = wmt14_ende.get_config(name)
  model = config.model
  return common.Shape(config.data.vocab_size, model.d_model, model.d_ff,
                      model.num_encoder_layers, model.num_heads, ROWS[name], LENGTH)


def t2t_config(shape: common.Shape, attention_impl: str = 'einsum', loss_impl: str = 'xla'):
  """The t2t_jax config of `shape`: pre-LN, dropout 0.1 everywhere, bfloat16, one device."""
  chunk = wmt14_ende.get_config().opt.loss_chunk_tokens
  return common.t2t_config(shape, DROPOUT, 'pre', DTYPE, (
      f'opt.loss_chunk_tokens={chunk}', f'model.attention_impl={attention_impl}',
      f'opt.loss_impl={loss_impl}'))


@dataclasses.dataclass
class Program:
  """One implementation's train step, compiled for a target's device."""
  name: str
  compiled: object
  compile_seconds: float
  params: int
  model_flops: float  # Analytic (t2t_jax/model/flops.py).
  dropout_prng: str


def _compile(lower) -> tuple[object, float]:
  start = time.perf_counter()
  compiled = lower().compile()
  return compiled, round(time.perf_counter() - start, 2)


def t2t_program(config, shape: common.Shape, device) -> Program:
  """t2t_jax's jitted step (training/build.py) lowered on a one-device mesh, as a dry run."""
  mesh = sharding.make_mesh(config.mesh, [device])
  setup = build.build(config, shape.vocab, mesh=mesh)
  batch = {side: jax.ShapeDtypeStruct((shape.rows, shape.length), jnp.int32,
                                      sharding=sharding.batch_sharding(mesh))
           for side in ('inputs', 'targets')}
  rng = jax.eval_shape(functools.partial(prng.dropout_key, name=config.model.dropout_prng),
                       jax.ShapeDtypeStruct((2,), jnp.uint32))
  compiled, seconds = _compile(lambda: setup.train_step.lower(setup.abstract_state, batch, rng))
  return Program('t2t_jax', compiled, seconds, build.count_params(setup.abstract_state.params),
                 flops.train_step_flops(setup.model_config, shape.rows, shape.length,
                                        shape.length), config.model.dropout_prng)


def reference_program(reference, config, shape: common.Shape, device) -> Program:
  """The example's train step (compare.reference_step: no pmap, its 'batch' axis bound by a
  vmap of size 1) jitted for `device`, its state from jax.eval_shape of its own init."""
  step = compare.reference_step(reference, config, shape)
  on_device = jax.sharding.SingleDeviceSharding(device)

  def placed(tree):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on_device),
                        tree)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  state = placed(jax.eval_shape(functools.partial(step.init_state, reference,
                                                  length=shape.length), key))
  batch = placed({side: jax.ShapeDtypeStruct((shape.rows, shape.length), jnp.int32)
                  for side in ('inputs', 'targets')})
  jitted = jax.jit(step.step, donate_argnums=0)
  compiled, seconds = _compile(lambda: jitted.lower(state, batch, placed(key)))
  model_config = step.model_config
  tokens = shape.rows * shape.length
  model_flops = flops.model_flops_per_step(
      d_model=model_config.emb_dim, d_ff=model_config.mlp_dim,
      num_encoder_layers=model_config.num_layers, num_decoder_layers=model_config.num_layers,
      vocab_size=model_config.output_vocab_size, source_tokens=tokens, target_tokens=tokens,
      source_length=shape.length, target_length=shape.length)
  return Program('reference', compiled, seconds, build.count_params(state.params), model_flops,
                 'threefry2x32')


def compiler_cost(compiled, platform: str) -> tuple[dict, dict]:
  """What the target's compiler says the program costs, and why a figure is null."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  keys = {'flops': 'flops', 'bytes_accessed': 'bytes accessed',
          'optimal_seconds': 'optimal_seconds'}
  if not cost:
    why = (f'cost_analysis() returned {cost!r}: the {platform.upper()} compiler gives none for a '
           'compile-only device')
    return dict.fromkeys(keys), {f'compiler_{key}': why for key in keys}
  values = {key: (float(cost[name]) if name in cost else None) for key, name in keys.items()}
  return values, {f'compiler_{key}': f'the compiler\'s cost_analysis() has no {name!r}'
                  for key, name in keys.items() if name not in cost}


def bytes_rebuilt(text: str) -> dict:
  """XLA's TPU 'bytes accessed' rebuilt from hlo_cost: its HBM bytes, the traffic in the other
  memory spaces (on-chip VMEM), and the passes XLA counts again for asynchronous copies (the
  source aliased in copy-start's result, and copy-done's result: twice the copy) and slices
  (slice-done's result: once the slice)."""
  hbm = hlo_cost.analyse(text, 1).hbm_bytes
  every = hlo_cost.analyse(text, 1, every_memory=True)
  computations, _ = hlo_text.parse_module(text)
  table_of = {name: table for table in computations.values() for name in table}
  again = 0.0
  for kernel in every.kernels:
    if kernel.opcode in ('copy-start', 'slice-start'):
      copy = kernel.opcode == 'copy-start'
      # copy-start: (destination, source alias, context); slice-start: ((operand), slice, ...).
      result = hlo_text.tuple_elements(table_of[kernel.name][kernel.name].shape)[0 if copy else 1]
      again += kernel.count * (2 if copy else 1) * hlo_text.total_bytes(result)
  return {'hbm': hbm, 'other_memory': every.hbm_bytes - hbm, 'async_counted_again': again,
          'rebuilt': every.hbm_bytes + again}


def _gap(ours: float, theirs: float | None) -> float | None:
  return round(ours / theirs - 1, 4) if theirs else None


def gaps_and_notes(line: dict, cost: hlo_cost.ProgramCost, rebuilt: dict,
                   target: targets.Target) -> tuple[dict, dict, list[str]]:
  """hlo_cost's figures against the compiler's (hlo_cost / compiler - 1), why any is null,
  and for each one above GAP what makes it, with this program's figures."""
  compiler = line['compiler_cost_analysis']
  optimal = compiler['optimal_seconds']
  gaps = {'flops': _gap(line['flops_per_step'], compiler['flops']),
          'bytes': _gap(line['hbm_bytes_per_step'], compiler['bytes_accessed']),
          'step_vs_optimal_seconds': _gap(line['predicted_step_seconds'],
                                          optimal if optimal and optimal > 0 else None)}
  reasons = {f'gap_{key}': 'the compiler gave no figure to compare with'
             for key, value in gaps.items() if value is None}
  if optimal is not None and optimal <= 0:
    reasons['gap_step_vs_optimal_seconds'] = (f'the compiler\'s optimal_seconds is {optimal:.4g}: '
                                              'not a time')
  notes = []
  if gaps['flops'] is not None and abs(gaps['flops']) > GAP:
    extra = compiler['flops'] - line['flops_per_step']
    looped = sum(k.flops * (k.count - 1) for k in cost.kernels)
    notes.append(f'flops: hlo_cost counts matrix products only ({line["flops_per_step"]:.4g}; '
                 f'analytic {line["analytic_flops_per_step"]:.4g}), XLA elementwise work too '
                 f'(softmax, layer norm, dropout, the loss over the vocabulary, Adam): {extra:.4g} '
                 f'FLOPs, {extra / compiler["flops"]:.0%} of its count'
                 + (f'; XLA counts a loop body once, hlo_cost {looped:.4g} FLOPs more for the '
                    'further trips' if looped else ''))
  if gaps['bytes'] is not None and abs(gaps['bytes']) > GAP:
    rest = compiler['bytes_accessed'] - rebuilt['rebuilt']
    notes.append(f'bytes: hlo_cost counts HBM traffic; XLA\'s bytes accessed also counts the '
                 f'other memory spaces (on-chip VMEM: {rebuilt["other_memory"]:.4g} B here) and '
                 'asynchronous copies and slices again (the source a copy-start aliases, the '
                 f'copy-done\'s and slice-done\'s results: {rebuilt["async_counted_again"]:.4g} '
                 f'B); hlo_cost with both is {rebuilt["rebuilt"]:.4g} B, '
                 f'{rebuilt["rebuilt"] / compiler["bytes_accessed"] - 1:+.1%} from XLA\'s'
                 + (f'; the rest, {rest:.4g} B, is mostly TPU tile padding at small dims '
                    '(module docstring)' if abs(rest) > GAP * compiler['bytes_accessed'] else ''))
  step_gap = gaps['step_vs_optimal_seconds']
  if step_gap is not None and abs(step_gap) > GAP:
    charged = compiler['bytes_accessed'] / target.chip.memory_bandwidth
    notes.append(f'step: optimal_seconds ({optimal:.4g} s) is libtpu\'s own estimate; its bytes '
                 f'accessed over the HBM bandwidth alone take {charged:.4g} s, the on-chip and '
                 'repeated bytes above charged as HBM traffic, where the roofline of HBM bytes '
                 f'and peak FLOP/s predicts {line["predicted_step_seconds"]:.4g} s')
  return gaps, reasons, notes


# The kernels of asynchronous copies: hlo_cost charges a copy's bytes to its start, and
# its done is free.
ASYNC_COPIES = ('copy-start', 'slice-start')


def copies_and_slack(cost: hlo_cost.ProgramCost, target: targets.Target) -> dict:
  """The roofline's seconds a step in asynchronous copies, and in compute-bound slack."""
  copies = slack = 0.0
  for kernel in cost.kernels:
    seconds = roofline.kernel_seconds(kernel, target.chip) * kernel.count
    if kernel.opcode in ASYNC_COPIES:
      copies += seconds
    slack += seconds - kernel.hbm_bytes / target.chip.memory_bandwidth * kernel.count
  return {'async_copy_seconds': copies, 'compute_slack_seconds': slack}


def program_line(program: Program, target: targets.Target, tokens: int) -> dict:
  """One implementation's line: hlo_cost's figures, the roofline's, the compiler's, the gaps."""
  text = program.compiled.as_text()
  cost = hlo_cost.analyse(text, 1)
  prediction = roofline.predict(cost, target, [0])
  rates = roofline.throughput(prediction, tokens, program.model_flops, target, DTYPE)
  compiler, reasons = compiler_cost(program.compiled, target.platform)
  line = {'implementation': program.name, 'params': program.params,
          'dropout_prng': program.dropout_prng,
          'kernels_per_step': sum(k.count for k in cost.kernels),
          'hbm_bytes_per_step': cost.hbm_bytes, 'flops_per_step': cost.flops,
          'analytic_flops_per_step': program.model_flops,
          'compute_seconds': prediction.compute_seconds,
          'memory_seconds': prediction.memory_seconds,
          'predicted_step_seconds': prediction.step_seconds, 'bound': prediction.bound,
          'predicted_target_tokens_per_second': rates['target_tokens_per_second'],
          'mfu': rates['mfu'], **copies_and_slack(cost, target),
          'unknown_trip_counts': cost.unknown_trip_counts,
          'compiler_cost_analysis': compiler, 'compile_seconds': program.compile_seconds}
  rebuilt = bytes_rebuilt(text) if target.platform == 'tpu' else None
  gaps, gap_reasons, notes = gaps_and_notes(line, cost, rebuilt, target)
  return {**line, 'gaps': gaps, 'gap_notes': notes, 'bytes_rebuilt': rebuilt,
          'null_reasons': {**reasons, **gap_reasons, **(
              {} if rebuilt else {'bytes_rebuilt': 'TPU only: the GPU compiler has no bytes '
                                                   'accessed to rebuild here'})}}


def ratio_line(t2t: dict, reference: dict) -> dict:
  """t2t_jax over the example: predicted tokens/s (above 1: t2t_jax faster), HBM bytes."""
  def over(key, a=t2t, b=reference):
    return a[key] / b[key] if a[key] and b[key] else None
  compiled_bytes = over('bytes_accessed', t2t['compiler_cost_analysis'],
                        reference['compiler_cost_analysis'])
  return {'implementation': 'ratio',
          'tokens_per_second_ratio': over('predicted_target_tokens_per_second'),
          'hbm_bytes_ratio': over('hbm_bytes_per_step'),
          'kernels_ratio': over('kernels_per_step'),
          'compiler_bytes_accessed_ratio': compiled_bytes,
          'null_reasons': {} if compiled_bytes else {
              'compiler_bytes_accessed_ratio': 'the compiler gave no bytes accessed'}}


def compare_on(target_name: str, model: str, reference, record: dict,
               hlo_dir: str = '', attention_impl: str = 'einsum',
               loss_impl: str = 'xla') -> list[dict]:
  """The lines of one model on one target: t2t_jax's, the example's, their ratio."""
  target = targets.parse(target_name)
  if target.num_devices != 1:
    raise ValueError(f'--targets={target_name}: {target.num_devices} devices; this compares one '
                     'chip (tpu:v5e-1, tpu:v5p-2, gpu:h100x1, ...)')
  [device] = targets.devices(target)
  shape = model_shape(model)
  config = t2t_config(shape, attention_impl, loss_impl)
  head = {**record, 'attention_impl': attention_impl, 'loss_impl': loss_impl,
          'target': target.name,
          'device_kind': device.device_kind,
          'compiler': dry_run.compiler_version(target), 'model': model,
          **{key: value for key, value in dataclasses.asdict(shape).items()
             if key not in ('packed_segments', 'accelerator_rows')},
          'dtype': DTYPE, 'norm': 'pre', **DROPOUT,
          'label_smoothing': config.opt.label_smoothing,
          'loss_chunk_tokens': config.opt.loss_chunk_tokens}
  lines = []
  for compile_program in (lambda: t2t_program(config, shape, device),
                          lambda: reference_program(reference, config, shape, device)):
    program = compile_program()
    lines.append({**head, **program_line(program, target, shape.rows * shape.length)})
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      name = f'{target.name.replace(":", "_")}_{model}_{program.name}.hlo'
      with open(os.path.join(hlo_dir, name), 'w') as f:
        f.write(program.compiled.as_text())
  return lines + [{**head, **ratio_line(*lines)}]


def default_out() -> str:
  return os.path.join(ROOT, 'bench', 'results',
                      f'accelerator-compare-{datetime.date.today().isoformat()}.jsonl')


def run(args) -> list[dict]:
  """Every model on every target of the parsed flags `args`: prints and appends each line to
  --out, then prints the table; returns the lines."""
  jax.config.update('jax_enable_compilation_cache', False)  # Compile-only programs: JAX could
  # write them to the cache but not read them back without the target's backend.
  reference = flax_reference.import_reference(args.reference_dir)
  out = args.out or default_out()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                          text=True, check=False).stdout.strip()
  record = {'benchmark': 'accelerator_compare', 'size': args.size,
            'date': datetime.date.today().isoformat(), 'commit': commit,
            'jax_version': jax.__version__,
            'cpu_matmul_flops_per_second': common.matmul_flops_per_second()}
  models = ['tiny'] if args.size == 'tiny' else args.models
  lines = []
  for target_name in args.targets:
    for model in models:
      for line in compare_on(target_name, model, reference, record, args.hlo_dir,
                             args.attention_impl, args.loss_impl):
        text = cli.json_line(line)
        print(text, flush=True)
        with open(out, 'a') as f:
          f.write(text + '\n')
        lines.append(line)
  print(table(lines), flush=True)
  return lines


def _size(n: float | None, unit: str = '') -> str:
  if n is None:
    return '-'
  for prefix, scale in (('T', 1e12), ('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(n) >= scale:
      return f'{n / scale:.3g}{prefix}{unit}'
  return f'{n:.3g}{unit}'


def _percent(x: float | None) -> str:
  return '-' if x is None else f'{100 * x:+.0f}%'


def table(lines: list[dict]) -> str:
  """The lines as a table: per target and model, both implementations, the ratio, then the
  explanations of the gaps above 20%."""
  header = (f'{"target":<11} {"model":<5} {"impl":<9} {"kernels":>7} {"HBM/step":>9} '
            f'{"FLOPs":>8} {"compute":>9} {"memory":>9} {"step":>9} {"copies":>9} '
            f'{"slack":>9} {"tokens/s":>9} '
            f'{"MFU":>6} | {"XLA FLOPs":>9} {"XLA bytes":>9} {"optimal":>9} | {"gap F":>6} '
            f'{"gap B":>6} {"gap t":>6}')
  rows, notes = [header, '-' * len(header)], []

  def seconds(s: float | None) -> str:
    return '-' if s is None else report.human_seconds(s) if s > 0 else f'{s:.3g} s'
  for line in lines:
    start = f'{line["target"]:<11} {line["model"]:<5} {line["implementation"]:<9}'
    if line['implementation'] == 'ratio':
      rows.append(f'{start} t2t_jax / example: tokens/s {line["tokens_per_second_ratio"]:.3f}, '
                  f'HBM bytes {line["hbm_bytes_ratio"]:.3f}, kernels '
                  f'{line["kernels_ratio"]:.3f}' + (
                      f', XLA bytes accessed {line["compiler_bytes_accessed_ratio"]:.3f}'
                      if line['compiler_bytes_accessed_ratio'] else ''))
      continue
    compiler, gaps = line['compiler_cost_analysis'], line['gaps']
    rows.append(
        f'{start} {line["kernels_per_step"]:>7} {_size(line["hbm_bytes_per_step"], "B"):>9} '
        f'{_size(line["flops_per_step"]):>8} {seconds(line["compute_seconds"]):>9} '
        f'{seconds(line["memory_seconds"]):>9} {seconds(line["predicted_step_seconds"]):>9} '
        f'{seconds(line["async_copy_seconds"]):>9} {seconds(line["compute_slack_seconds"]):>9} '
        f'{_size(line["predicted_target_tokens_per_second"]):>9} {100 * line["mfu"]:>5.1f}% | '
        f'{_size(compiler["flops"]):>9} {_size(compiler["bytes_accessed"], "B"):>9} '
        f'{seconds(compiler["optimal_seconds"]):>9} | {_percent(gaps["flops"]):>6} '
        f'{_percent(gaps["bytes"]):>6} {_percent(gaps["step_vs_optimal_seconds"]):>6}')
    notes += [f'{line["target"]} {line["model"]} {line["implementation"]}: {note}'
              for note in line['gap_notes']]
  legend = ('HBM/step, FLOPs, compute, memory, step, tokens/s, MFU: t2t_jax\'s cost model '
            '(hlo_cost) and roofline, a prediction; copies: the time the roofline charges to '
            'asynchronous copies and slices; slack: the compute-bound kernels\' compute time '
            'less their memory time; XLA: the target compiler\'s '
            'cost_analysis(); gap: hlo_cost / XLA - 1 (F FLOPs, B bytes, t step against '
            'optimal_seconds)')
  return '\n'.join(rows + ['', legend] + ([''] + notes if notes else []))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  run(flags.FLAGS)


if __name__ == '__main__':
  define_flags()  # Only when run as a command, so importing this module defines no flags.
  cli.run(main, compilation_cache=None)
