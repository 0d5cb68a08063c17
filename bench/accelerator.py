"""One command that measures an accelerator; the same command runs on CPU with tiny shapes.

  python bench/accelerator.py                    # full shapes off CPU, tiny on CPU (--size=auto)
  python bench/accelerator.py --size=tiny --parts=train_step,attention
  python bench/accelerator.py --out=/tmp/a.jsonl

Parts (--parts), each printing one JSON line per measurement and appending it to --out
(default bench/results/accelerator-<device>-<date>.jsonl):

  train_step  Transformer-big and -base train steps at about 12k, 25k and 50k target token
              slots per step (rows of 64; each row's source and target filled to a random
              length from 33 to 64 tokens, the rest padding): step seconds, non-padding target
              tokens/s, analytic model FLOPs (t2t_jax/model/flops.py, padding counted: the step does
              that work), XLA's cost-analysis FLOPs, MFU against the device's published peak.
  xla_ab      the base step at 25k slots under each flag set of t2t_jax/runtime.py's
              AB_FLAG_SETS, each in a subprocess of its own (XLA reads XLA_FLAGS once, at
              backend start), and which set was fastest.
  attention   einsum, xla, cudnn and flash attention in the base model at 64- and 256-token rows:
              train-step time, and logits and gradients against float32 einsum's on the
              same parameters and batch (relative L2 error; attention_lines says when an
              implementation counts as equal); an implementation that cannot run
              here gives a line with the reason. --size=tiny: one length, 32.
  loss        the base step at 25k slots with opt.loss_impl 'xla' (chunks of 4,096 tokens)
              and 'fused' (training/fused_loss.py's kernels), timed beside the prediction.
  decode      greedy and beam-4 sentences/s of a base-sized random-weight model
              (bench/decode_speed.py's search), 64 sources of 32 tokens, 40 output tokens.
  compare     the train step beside Flax's WMT example at base (bench/compare.py), 2 rounds.
  speedrun    configs/multi30k.py:speedrun: updates/s over 300 steps after 20 warm-up steps,
              the real input pipeline included.

Full shapes take longer than one 10-minute device call: on one H200 a train-step line took
about 70 s (28 s compiling) and compare 130 s (docs/results/accelerators.md, 2026-11-30);
--parts, --models and --token_slots choose a share. --size=tiny shrinks every part to seconds
(tests/test_bench.py runs it so); MFU is null with a reason where no peak is known.
Compute in bfloat16; parameters stay float32; attention dropout 0 (fused attention has none).
"""

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top
import compare  # pylint: disable=g-import-not-at-top
import decode_speed  # pylint: disable=g-import-not-at-top
import flax_reference  # pylint: disable=g-import-not-at-top

from configs import multi30k
from configs import tiny as tiny_configs
from t2t_jax import cli
from t2t_jax import ConfigError
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.compile import hlo_cost
from t2t_jax.compile import roofline
from t2t_jax.compile import targets
from t2t_jax.data import pipeline as data
from t2t_jax.model import flops
from t2t_jax.model.transformer import Transformer
from t2t_jax.training import train

PARTS = ('train_step', 'xla_ab', 'attention', 'loss', 'decode', 'compare', 'speedrun')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# XLA_FLAGS as the command found them, before t2t_jax's defaults: each A/B set starts here.
_USER_XLA_FLAGS = os.environ.get('XLA_FLAGS', '')

_SIZE = flags.DEFINE_enum('size', 'auto', ['auto', 'tiny', 'full'],
                          'auto: tiny on CPU, full on an accelerator.')
_PARTS = flags.DEFINE_list('parts', list(PARTS), f'Which to run, from {PARTS}.')
_OUT = flags.DEFINE_string('out', '', 'JSON lines file to append to; default '
                           'bench/results/accelerator-<device>-<date>.jsonl.')
_AB_SETS = flags.DEFINE_list('ab_sets', list(runtime.AB_FLAG_SETS),
                             'xla_ab: flag sets of t2t_jax/runtime.py to measure.')
_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data/multi30k',
                                'speedrun: the Multi30k folder, relative to the cwd.')
_ANCHOR_DIR = flags.DEFINE_string('anchor_dir', '../shared/anchor/flax_wmt',
                                  "compare: Flax's examples/wmt, relative to the cwd.")
_MODELS = flags.DEFINE_list('models', [], 'train_step: shapes to measure (bench/common.py '
                            "SHAPES); default the size's own (full: big, base).")
_TOKEN_SLOTS = flags.DEFINE_list('token_slots', [], 'train_step: target token slots per step '
                                 "(rows of --size's length); default the size's own.")
_CHILD = flags.DEFINE_string('child_flag_set', '', 'Internal (xla_ab): measure the A/B step '
                             'under the XLA_FLAGS the parent set, print one line, write nothing.')


@dataclasses.dataclass(frozen=True)
class Plan:
  """The shapes and repetitions of every part at one size."""
  size: str
  dtype: str
  models: tuple[str, ...]  # bench/common.py SHAPES for the train step.
  token_slots: tuple[int, ...]  # Target token slots (rows x length) per step.
  length: int
  steps: int  # Timed steps per measurement (median).
  ab_model: str
  ab_slots: int
  attention_model: str
  attention_lengths: tuple[int, ...]
  attention_slots: int
  decode_shape: str
  decode_sources: tuple[int, int]  # Rows, tokens per source.
  decode_steps: int
  compare_shape: str
  compare_rows: int  # 0: the shape's own.
  speedrun_warmup: int
  speedrun_steps: int


FULL = Plan('full', 'bfloat16', ('big', 'base'), (12288, 24576, 49152), 64, 10,
            'base', 24576, 'base', (64, 256), 16384, 'base', (64, 32), 40,
            'base', 192, 20, 300)
TINY = Plan('tiny', 'bfloat16', ('tiny',), (64, 128), 16, 3, 'tiny', 64, 'tiny', (32,), 128,
            'tiny', (4, 8), 6, 'tiny', 0, 2, 4)
# Dropout as the paper's recipe for each shape, but none on the attention weights: the
# fused implementations have none, and the same setting keeps every part comparable.
_DROPOUT = {'big': 0.3, 'base': 0.1, 'tiny': 0.1}


def plan_for(size: str, platform: str, models=(), token_slots=()) -> Plan:
  """The size's plan; `models` and `token_slots`, where given, replace the train step's own."""
  plan = TINY if size == 'tiny' or (size == 'auto' and platform == 'cpu') else FULL
  return dataclasses.replace(plan, models=tuple(models) or plan.models,
                             token_slots=tuple(int(n) for n in token_slots) or plan.token_slots)


def padded_batch(rng: np.random.Generator, vocab: int, rows: int, length: int) -> dict:
  """Random ids (from 3) in rows filled to a random length in (length/2, length], then PAD."""
  batch = {}
  for side in ('inputs', 'targets'):
    filled = rng.integers(length // 2 + 1, length + 1, rows)
    tokens = rng.integers(3, vocab, (rows, length), dtype=np.int32)
    batch[side] = np.where(np.arange(length)[None] < filled[:, None], tokens, 0).astype(np.int32)
  return batch


def step_config(shape_name: str, dtype: str, overrides=()):
  dropout = dict(dropout=_DROPOUT[shape_name], attention_dropout=0.0, relu_dropout=0.1)
  return common.t2t_config(common.SHAPES[shape_name], dropout, 'post', dtype,
                           ('opt.loss_chunk_tokens=4096', *overrides))


def _peak_and_reasons(dtype, mfu_value) -> dict:
  peak = flops.peak_flops_per_second(jax.devices()[0].device_kind, dtype)
  reasons = {} if peak else {'mfu': f'no published peak for device kind '
                                    f'{jax.devices()[0].device_kind!r} (t2t_jax/model/flops.py)'}
  return {'peak_flops_per_second': peak, 'mfu': mfu_value if peak else None,
          'null_reasons': reasons}


def measure_step(config, shape_name: str, rows: int, length: int, steps: int) -> dict:
  """Compiles the train step of `config` on one device and times it on a padded batch."""
  shape = common.SHAPES[shape_name]
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  setup = train.build(config, shape.vocab, mesh)
  host = padded_batch(np.random.default_rng(0), shape.vocab, rows, length)
  batch = sharding.global_batch(host, mesh)
  rng = jax.random.PRNGKey(1)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  state = [setup.init(jax.random.PRNGKey(0))]

  def step():
    state[0], metrics = compiled(state[0], batch, rng)
    jax.block_until_ready(metrics)

  seconds = common.median_seconds(step, steps)
  target_tokens = int((host['targets'] > 0).sum())
  model_flops = flops.train_step_flops(setup.model_config, rows, length, length)
  peak = flops.peak_flops_per_second(jax.devices()[0].device_kind, config.model.dtype)
  return {
      'model': shape_name, 'dtype': config.model.dtype,
      'attention_impl': setup.model_config.attention_impl, 'loss_impl': config.opt.loss_impl,
      'rows': rows, 'length': length,
      'target_slots': rows * length, 'target_tokens': target_tokens,
      'step_seconds': seconds, 'target_tokens_per_second': target_tokens / seconds,
      'model_flops_per_step': model_flops, 'model_flops_per_second': model_flops / seconds,
      'xla_flops_per_step': common.xla_flops(compiled),
      **_with_prediction(_peak_and_reasons(config.model.dtype,
                                           peak and flops.mfu(model_flops, seconds, peak)),
                         compiled, seconds),
      'compile_seconds': round(compile_seconds, 2), 'timed_steps': steps}


def _with_prediction(fields: dict, compiled, seconds: float) -> dict:
  """`fields` and the roofline prediction of the very program timed (what `--dry_run_target`
  predicts for this device without it, docs/accelerators.md), beside the measurement."""
  target = targets.of_device(jax.devices()[0])
  if target is None:
    return {**fields, 'predicted_step_seconds': None, 'null_reasons': {
        **fields['null_reasons'], 'predicted_step_seconds': f'no figures for device kind '
        f'{jax.devices()[0].device_kind!r} (t2t_jax/compile/targets.py)'}}
  predicted = roofline.predict(hlo_cost.analyse(compiled.as_text(), 1), target, [0])
  return {**fields, 'predicted_step_seconds': predicted.step_seconds,
          'measured_over_predicted': seconds / predicted.step_seconds,
          'prediction': predicted.as_dict()}


def train_step_lines(plan: Plan):
  for shape_name in plan.models:
    for slots in plan.token_slots:
      yield 'train_step', lambda s=shape_name, n=slots: measure_step(
          step_config(s, plan.dtype), s, n // plan.length, plan.length, plan.steps)


def _ab_step(plan: Plan) -> dict:
  return measure_step(step_config(plan.ab_model, plan.dtype), plan.ab_model,
                      plan.ab_slots // plan.length, plan.length, plan.steps)


def _run_flag_set(name: str, size: str) -> dict:
  """One A/B flag set's step, measured by this command in a subprocess under those flags."""
  flags_set = runtime.AB_FLAG_SETS[name]
  env = dict(os.environ, XLA_FLAGS=' '.join(_USER_XLA_FLAGS.split() + list(flags_set)),
             T2T_JAX_XLA_FLAGS='0',  # Exactly this set: runtime.start adds nothing to it.
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  process = subprocess.run([sys.executable, os.path.abspath(__file__), f'--size={size}',
                            f'--child_flag_set={name}'], env=env, capture_output=True,
                           text=True, check=False)
  line = {'flag_set': name, 'xla_flags': list(flags_set)}
  if process.returncode:
    return {**line, 'error': f'exit {process.returncode}: '
                             + ' | '.join(process.stderr.strip().splitlines()[-3:])}
  return {**line, **json.loads(process.stdout.strip().splitlines()[-1])}


def xla_ab_lines(plan: Plan):
  results = []

  def one(name):
    results.append(_run_flag_set(name, plan.size))
    return results[-1]

  for name in _AB_SETS.value:
    yield 'xla_ab', lambda n=name: one(n)

  def summary():
    timed = {r['flag_set']: r['step_seconds'] for r in results if 'step_seconds' in r}
    if not timed:
      return {'error': 'no flag set ran', 'failed': [r['flag_set'] for r in results]}
    fastest = min(timed, key=timed.get)
    base = timed.get('xla_defaults')
    return {'fastest': fastest, 'step_seconds': timed,
            'speedup_over_xla_defaults': {
                k: base / v for k, v in timed.items()} if base else None,
            'project_defaults': list(runtime.GPU_XLA_FLAGS),
            'failed': [r['flag_set'] for r in results if 'error' in r]}
  yield 'xla_ab_summary', summary


def _loss_and_grads(model_config, params, batch):
  """Mean next-token NLL of the non-padding targets, the logits, and the gradients."""
  def loss(p):
    logits = Transformer(model_config).apply({'params': p}, batch['inputs'], batch['targets'])
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(log_probs, batch['targets'][..., None], -1)[..., 0]
    weights = (batch['targets'] > 0).astype(jnp.float32)
    return (nll * weights).sum() / weights.sum(), logits.astype(jnp.float32)
  (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return logits, grads


def _relative_error(tree, reference) -> float:
  diff = sum(float(jnp.sum((a.astype(jnp.float32) - b.astype(jnp.float32))**2))
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)))
  norm = sum(float(jnp.sum(b.astype(jnp.float32)**2)) for b in jax.tree.leaves(reference))
  return (diff / norm)**0.5


def _outputs(config, shape_name: str, host: dict, params=None):
  """Logits and gradients of `config`'s model on `host`, at `params` (default: its init)."""
  setup = train.build(config, common.SHAPES[shape_name].vocab,
                      sharding.make_mesh(config.mesh, jax.devices()[:1]))
  params = setup.init(jax.random.PRNGKey(0)).params if params is None else params
  model_config = dataclasses.replace(setup.model_config, deterministic=True)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    return params, jax.jit(lambda p, b: _loss_and_grads(model_config, p, b))(
        params, sharding.global_batch(host, setup.mesh))


def attention_lines(plan: Plan):
  """Each implementation's step time, and its logits and gradients against float32 einsum's.

  Rounding to bfloat16 moves einsum's own outputs away from float32 einsum's by some error
  e (measured in the same run); an implementation counts as equal to einsum when its error
  against float32 einsum is at most 2 e for logits and gradients alike (no bound on bfloat16
  attention's error holds a priori: softmax's backward subtracts nearly equal terms, which
  magnifies relative error by an amount that depends on the data).
  """
  float32_outputs = {}

  def one(impl: str, length: int) -> dict:
    shape_name, rows = plan.attention_model, plan.attention_slots // length
    config = step_config(shape_name, plan.dtype, (f'model.attention_impl={impl}',))
    line = {'impl': impl, 'model': shape_name, 'rows': rows, 'length': length,
            'dtype': plan.dtype}
    try:
      measured = measure_step(config, shape_name, rows, length, plan.steps)
    except ConfigError as e:  # The implementation cannot run here: say why, measure the rest.
      return {**line, 'skipped': str(e)}
    host = padded_batch(np.random.default_rng(1), common.SHAPES[shape_name].vocab, rows, length)
    if length not in float32_outputs:  # einsum runs first at each length.
      float32_config = step_config(shape_name, 'float32', ('model.attention_impl=einsum',))
      float32_outputs[length] = {'reference': _outputs(float32_config, shape_name, host)}
    params, reference = float32_outputs[length]['reference']
    _, (logits, grads) = _outputs(config, shape_name, host, params)
    # Only positions that predict a real target: what padded query rows hold is never read,
    # and the fused implementations, given sequence lengths, leave them as they like.
    real = (host['targets'] != 0)[..., None]
    errors = {'logits_relative_error': _relative_error(logits * real, reference[0] * real),
              'grads_relative_error': _relative_error(grads, reference[1])}
    if impl == 'einsum':
      float32_outputs[length]['einsum'] = errors
    baseline = float32_outputs[length]['einsum']
    return {**line, **measured, 'errors_against_float32_einsum': errors,
            'einsum_errors_against_float32_einsum': baseline,
            'equal_to_einsum': all(errors[k] <= 2 * baseline[k] for k in errors)}

  for length in plan.attention_lengths:
    # einsum first: the others compare against it.
    for impl in ('einsum', 'xla', 'cudnn', 'flash'):
      yield 'attention', lambda i=impl, n=length: one(i, n)


def loss_lines(plan: Plan):
  """The base step with each opt.loss_impl (the fused kernels' equality is tests/test_gpu.py's
  and tests/test_fused_loss.py's to check)."""
  def one(impl: str) -> dict:
    config = step_config(plan.ab_model, plan.dtype, (f'opt.loss_impl={impl}',))
    return measure_step(config, plan.ab_model, plan.ab_slots // plan.length, plan.length,
                        plan.steps)
  for impl in ('xla', 'fused'):
    yield 'loss', lambda i=impl: one(i)


def decode_lines(plan: Plan):
  def one(beam_size: int) -> dict:
    shape = common.SHAPES[plan.decode_shape]
    rows, length = plan.decode_sources
    sources = np.random.default_rng(0).integers(3, shape.vocab, (rows, length)).astype(np.int32)
    search = decode_speed.t2t_search(shape, sources, beam_size, plan.decode_steps, 0.6,
                                     plan.dtype)
    seconds = common.median_seconds(search, plan.steps, warmup=1)
    return {'model': plan.decode_shape, 'search': 'greedy' if beam_size == 1 else 'beam',
            'beam_size': beam_size, 'alpha': 0.6, 'dtype': plan.dtype, 'sentences': rows,
            'source_length': length, 'output_length': plan.decode_steps,
            'seconds': seconds, 'sentences_per_second': rows / seconds,
            'first_call_seconds': round(search.first_call_seconds, 2), 'timed_calls': plan.steps}
  for beam_size in (1, 4):
    yield 'decode', lambda b=beam_size: one(b)


def compare_lines(plan: Plan):
  def one() -> dict:
    if not os.path.isfile(os.path.join(_ANCHOR_DIR.value, 'models.py')):
      return {'skipped': f"Flax's WMT example is not at --anchor_dir={_ANCHOR_DIR.value}"}
    args = compare.parse_flags([
        f'--shapes={plan.compare_shape}', f'--rows={plan.compare_rows}', '--rounds=2',
        '--steps=2', '--warmup=1', f'--dtype={plan.dtype}', '--attention_dropout=0',
        f'--reference_dir={_ANCHOR_DIR.value}'])
    reference = flax_reference.import_reference(args.reference_dir)
    result = compare.compare_shape(plan.compare_shape, args, reference,
                                   common.Matmul(256 if plan.size == 'tiny' else 2048))
    return {key: value for key, value in result.items()
            if key not in ('benchmark', *common.device_info())}
  yield 'compare', one


def speedrun_config(plan: Plan):
  if plan.size == 'tiny':
    config = tiny_configs.get_config()
  else:
    config = multi30k.get_config('speedrun')
    config.data.data_dir = _DATA_DIR.value
  config.mesh.shape = (1, 1, 1)
  return config


def speedrun_lines(plan: Plan):
  def one() -> dict:
    config = speedrun_config(plan)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    with tempfile.TemporaryDirectory(prefix='t2t_accelerator_') as workdir:
      task = data.load(config, workdir)
      train_batches, _ = data.make_batchers(config, task.train, task.eval,
                                            sharding.batch_shards(mesh))
      setup = train.build(config, data.vocab_size(config), mesh)
      state = setup.init(jax.random.PRNGKey(0))
      iterator = data.train_iterator(train_batches)
      rng = jax.random.PRNGKey(1)

      def run(count):
        nonlocal state
        tokens = 0
        for _ in range(count):
          host = next(iterator)
          tokens += int((host['targets'] > 0).sum())
          state, metrics = setup.train_step(state, sharding.global_batch(host, mesh), rng)
        jax.block_until_ready((state, metrics))
        return tokens

      start = time.perf_counter()
      run(plan.speedrun_warmup)
      warmup_seconds = time.perf_counter() - start
      start = time.perf_counter()
      tokens = run(plan.speedrun_steps)
      seconds = time.perf_counter() - start
    return {'config': config.name, 'batching': config.data.batching,
            'batch_tokens': config.data.batch_tokens, 'dtype': config.model.dtype,
            'warmup_updates': plan.speedrun_warmup,
            'warmup_seconds': round(warmup_seconds, 2), 'timed_updates': plan.speedrun_steps,
            'seconds': seconds, 'updates_per_second': plan.speedrun_steps / seconds,
            'target_tokens': tokens, 'target_tokens_per_second': tokens / seconds}
  yield 'speedrun', one


_PART_LINES = {'train_step': train_step_lines, 'xla_ab': xla_ab_lines,
               'attention': attention_lines, 'loss': loss_lines, 'decode': decode_lines,
               'compare': compare_lines, 'speedrun': speedrun_lines}


def default_out() -> str:
  kind = ''.join(c if c.isalnum() else '_' for c in jax.devices()[0].device_kind.lower())
  return os.path.join(ROOT, 'bench', 'results',
                      f'accelerator-{kind}-{datetime.date.today().isoformat()}.jsonl')


def run(plan: Plan, parts, out: str) -> list[dict]:
  """Runs `parts`, printing each line and appending it to `out`; returns the lines."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  common_fields = {'benchmark': 'accelerator', 'size': plan.size, **common.device_info(),
                   'jax_version': jax.__version__,
                   'xla_flags': os.environ.get('XLA_FLAGS', '').split(),
                   'date': datetime.date.today().isoformat()}
  lines = []
  for part in parts:
    for name, measure in _PART_LINES[part](plan):
      start = time.perf_counter()
      try:
        result = measure()
      except Exception as e:  # pylint: disable=broad-except
        # One part failing (memory, a missing kernel) must not cost the other measurements of
        # a timed session; the failure is recorded in its line, not hidden.
        result = {'error': f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'}
      line = {**common_fields, 'part': name, **result,
              'wall_seconds': round(time.perf_counter() - start, 2)}
      lines.append(line)
      text = cli.json_line(line)
      print(text, flush=True)
      with open(out, 'a') as f:
        f.write(text + '\n')
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  unknown = set(_PARTS.value) - set(PARTS)
  if unknown:
    raise app.UsageError(f'--parts: unknown {sorted(unknown)}; choose from {PARTS}')
  if _CHILD.value:  # The parent set XLA_FLAGS for this flag set: add nothing to them.
    plan = plan_for(_SIZE.value, jax.devices()[0].platform)
    print(cli.json_line(_ab_step(plan)), flush=True)
    return
  unknown = set(_MODELS.value) - set(common.SHAPES)
  if unknown:
    raise app.UsageError(f'--models: unknown {sorted(unknown)}; '
                         f'choose from {sorted(common.SHAPES)}')
  if not all(n.isdigit() and int(n) > 0 for n in _TOKEN_SLOTS.value):
    raise app.UsageError(f'--token_slots: {",".join(_TOKEN_SLOTS.value)} is not a list of '
                         'whole numbers above 0')
  plan = plan_for(_SIZE.value, jax.devices()[0].platform, _MODELS.value, _TOKEN_SLOTS.value)
  run(plan, _PARTS.value, _OUT.value or default_out())


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
