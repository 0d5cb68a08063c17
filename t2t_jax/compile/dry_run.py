"""The dry run: compile the train step for the configured mesh without data, and report its
memory per device, its FLOPs and its collectives, so a run that cannot fit fails in seconds.

With a named target (`--dry_run_target=tpu:v5e-8`, targets.py) the mesh is built over that
target's compile-only devices and the target's own compiler (libtpu, or XLA's GPU compiler)
compiles the train step, the eval step and the search the in-loop evaluation runs; the report
then adds whether each fits the device's memory and a roofline prediction of the step
(roofline.py). Nothing here makes a concrete array: the state, the batch and the keys are
ShapeDtypeStructs.
"""

import contextlib
import dataclasses
import functools
import importlib.metadata
import re
import time

from absl import logging
import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import numpy as np

from t2t_jax import cli
from t2t_jax import ConfigError
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.compile import hlo_cost
from t2t_jax.compile import report as report_lib
from t2t_jax.compile.report import EVAL, SEARCH, TRAIN
from t2t_jax.compile import roofline
from t2t_jax.compile import targets
from t2t_jax.data import pipeline as data
from t2t_jax.decoding import decode
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.model import flops as flops_lib
from t2t_jax.model import prng
from t2t_jax.training import build as setup_lib
from t2t_jax.training import resolve
from t2t_jax.training import tasks


def dry_run(config, target: str = '', evaluation: bool = True) -> dict:
  """Compiles for the configured mesh (of `target`'s devices if named); returns size and cost.

  With a target and `evaluation`, also the eval step and the search of the in-loop evaluation.
  """
  runtime.start()  # Done already where a command called this; a library caller's first.
  task = tasks.for_config(config)
  if task.configure:  # A classifier's labels, from its training file (or config.data.labels).
    config = config.copy_and_resolve_references()
    task.configure(config)
  named = targets.parse(target) if target else None
  devices = targets.devices(named) if named else None
  if named and named.slices > 1 and config.mesh.dcn_data == 1:
    config = config.copy_and_resolve_references()  # Only the data axis crosses slices.
    config.mesh.dcn_data = named.slices
    logging.info('%s has %d slices: config.mesh.dcn_data=%d (the data axis spans them)',
                 named.name, named.slices, named.slices)
  resolved = resolve.resolve(config, devices)  # Every check; 'auto' for the target's devices.
  mesh = sharding.make_mesh(config.mesh, devices)
  setup = setup_lib.build(config, data.vocab_size(config), mesh=mesh, objective=task.objective)
  batch, rows, length = abstract_batch(config, setup.mesh)
  rng = jax.eval_shape(functools.partial(prng.dropout_key, name=config.model.dropout_prng),
                       jax.ShapeDtypeStruct((2,), jnp.uint32))
  train = _compile(lambda: setup.train_step.lower(setup.abstract_state, batch, rng), mesh)
  flops = global_flops(config, setup, batch, rng)
  source_length = batch['inputs'].shape[1]
  analytic = flops_lib.train_step_flops(setup.model_config, rows, source_length, length)
  result = {
      'config': config.name,
      'params': setup_lib.count_params(setup.abstract_state.params),
      'flops_per_step': flops,
      'flops_per_step_per_device': flops / setup.mesh.size,
      'analytic_flops_per_step': analytic,
      'batch_shape': [rows, length],
      'grad_accum_steps': config.opt.grad_accum_steps,
      'scan_layers': config.model.scan_layers,
      'remat': config.model.remat,
      'attention_pattern': config.model.attention_pattern,
      'attention_impl': setup.model_config.attention_impl,
      'positions': config.model.positions,
      'dtype': jnp.dtype(setup.model_config.dtype).name,
      'mesh': dict(setup.mesh.shape),
      'shard_update': setup_lib.splits_update(config, setup.mesh),
      'device_count': setup.mesh.size,
      'device_kind': setup.mesh.devices.flat[0].device_kind,
      'memory_per_device_bytes': train.memory,
      'compile_seconds': train.seconds,
      'resolved': resolved.as_dict(),
  }
  if named is None:
    return {**result, **_device_fit(train), **_collectives(train)}
  result.update(_target_report(config, setup, named, train, batch, evaluation))
  if train.cost is not None:
    result.update(_collectives(train))
    result.update(_prediction(train.cost, named, setup, rows * length, analytic))
  return result


def _target_report(config, setup, named: targets.Target, train: 'Program', batch,
                   evaluation: bool) -> dict:
  """The target, its compiler and memory, and each program's line: the train step, and with
  `evaluation` the eval step and the search (when the run decodes for BLEU)."""
  programs = {TRAIN: train}
  if evaluation:
    programs[EVAL] = _compile(lambda: setup.eval_step.lower(setup.abstract_state.params, batch),
                              setup.mesh)
  if evaluation and config.data.source != 'lm' and config.eval.bleu_sentences:
    programs[SEARCH] = _compile_search(config, setup, named.platform)
  # What evaluating leaves in memory besides its arguments: the optimiser state (and average).
  resident = (sharding.shard_bytes(setup.abstract_state)
              - sharding.shard_bytes(setup.abstract_state.params))
  reports = {name: program.report(named.usable_memory_bytes, 0 if name == TRAIN else resident)
             for name, program in programs.items()}
  for name, program in programs.items():
    if program.cost is not None:  # Where each program's bytes and kernel time go.
      reports[name]['cost_by_part'] = roofline.by_part(
          program.cost, named, roofline.predict(program.cost, named, _granule_order(
              named, setup)))
      reports[name]['heaviest_kernels'] = roofline.heaviest(program.cost, named)
  return {'target': named.name, 'platform': named.platform,
          'compiler': compiler_version(named), 'device_memory_bytes': named.chip.memory_bytes,
          'usable_memory_bytes': named.usable_memory_bytes, 'programs': reports,
          'fits': all(report['fits'] for report in reports.values())}


@dataclasses.dataclass
class Program:
  """One compiled program: its memory per device, compile time and HLO cost, or the
  compiler's refusal (a TPU program that does not fit is refused while compiling)."""
  seconds: float
  memory: dict[str, int]
  cost: hlo_cost.ProgramCost | None
  error: str = ''

  def report(self, usable_bytes: int, resident_bytes: int) -> dict:
    """Its line of the report; `resident_bytes`: the train state it does not take as an
    argument but that stays in memory while it runs (Adam's moments during evaluation)."""
    needs = self.memory.get('total', 0) + self.memory.get('generated_code', 0) + resident_bytes
    used = re.search(r'(?:Used |required for HLO temporaries \()([\d.]+)([KMGT])', self.error)
    if used:  # The compiler's own count of what the refused program needs (at least).
      needs = int(float(used.group(1)) * 1024**('KMGT'.index(used.group(2)) + 1))
    return {'compile_seconds': self.seconds, 'memory_per_device_bytes': self.memory,
            'needs_bytes': needs, 'fits': not self.error and needs <= usable_bytes,
            **({'compiler_error': self.error} if self.error else {})}


@contextlib.contextmanager
def persistent_cache(enabled: bool):
  """The persistent compilation cache on or off: JAX writes a compile-only target's programs
  to it but cannot read them back without that backend (it warns, then compiles again). JAX
  decides once per process whether to use the cache, so a change is reset both ways (and a
  compile that leaves the cache as it is resets nothing)."""
  previous = jax.config.jax_enable_compilation_cache
  if (enabled and previous) == previous:
    yield
    return
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', previous)
    compilation_cache.reset_cache()


def _compile(lower, mesh) -> Program:
  """Lowers and compiles; for a compile-only target's devices, past the persistent cache."""
  start = time.perf_counter()
  lowered = lower()
  compile_only = mesh.devices.flat[0] not in jax.devices()
  try:
    with persistent_cache(not compile_only):
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    first = str(e).strip().splitlines()[0].removeprefix('RESOURCE_EXHAUSTED: ').rstrip('.')
    return Program(round(time.perf_counter() - start, 2), {}, None, first)
  seconds = round(time.perf_counter() - start, 2)
  return Program(seconds, _memory_per_device(compiled),
                 hlo_cost.analyse(compiled.as_text(), mesh.size))


def _compile_search(config, setup, platform: str) -> Program:
  """The search evaluation runs (translator.py), at its largest batch: the longest bucket
  the data's max_len needs, as many rows as config.data.batch_tokens gives across beams."""
  model_config = translator_lib.decoding_config(setup.model_config, config.eval.dtype, platform)
  buckets = translator_lib.bucket_lengths(config.data.min_bucket, model_config.max_len)
  longest = min(config.data.max_len, model_config.max_len)
  if model_config.kind == 'decoder_only':  # data.max_len bounds source and output together.
    longest //= 2
  length = next(b for b in buckets if b >= longest)
  beam = config.eval.beam_size
  shards = sharding.batch_shards(setup.mesh)
  rows = max(shards, config.data.batch_tokens // (length * beam) // shards * shards)
  max_len = decode.max_decode_length(length, config.eval.max_extra_len, model_config.max_len,
                                     model_config.kind == 'decoder_only')
  search = translator_lib.search_function(model_config, max_len, beam, config.eval.alpha,
                                          config.eval.length_penalty)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  inputs = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=batch_sharding)
  limits = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=batch_sharding)
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())

  def lower():
    with sharding.mesh_context(setup.mesh, setup.axis_rules):
      return runtime.jit_search(search, platform, out_shardings=replicated).lower(
          setup.abstract_state.params, inputs, max_lengths_B=limits)
  return _compile(lower, setup.mesh)


def abstract_batch(config, mesh) -> tuple[dict, int, int]:
  """The global batch the config trains on, as sharded ShapeDtypeStructs; its rows and length.

  The longest bucket (or the packed row length), with as many rows as the token budget
  allows, rounded down to a multiple of the plan's row multiple (data.row_multiple, or whole
  rows per batch shard and micro-batch).
  """
  shards = data.plan_row_multiple(config, sharding.batch_shards(mesh))
  if config.data.batching == 'packed':
    length = data.pack_length(config.data)
    keys = ('inputs', 'targets', 'inputs_positions', 'targets_positions', 'inputs_segments',
            'targets_segments')
  else:
    length = min(data.bucket_boundaries(config.data.max_len, config.data.min_bucket,
                                        config.data.bucket_scale)[-1], config.model.max_len)
    keys = ('inputs', 'targets')
  rows = max(shards, config.data.batch_tokens // length // shards * shards)
  # A language model has no source; a masked-LM row's 'inputs' are its word-start flags.
  source_length = (0 if config.data.source == 'lm' and config.model.kind != 'encoder_only'
                   else length)
  batch = {key: jax.ShapeDtypeStruct((rows, source_length if key.startswith('inputs') else length),
                                     jnp.int32, sharding=sharding.batch_sharding(mesh))
           for key in keys}
  return batch, rows, length


def global_flops(config, setup: setup_lib.Setup, batch, rng) -> float:
  """FLOPs of one whole update, from XLA's cost analysis of the program before partitioning.

  Analysed on one CPU device, which every JAX has (a compile-only target's backend may not
  analyse programs), with einsum attention (a fused kernel's arithmetic is the same, but the
  CPU cannot lower TPU or GPU kernels). Counted without accumulation, loss chunks or scanned
  layers: the analysis counts a loop body once, and A micro-batches (or U chunks) do the
  arithmetic of one batch of A times their rows (U chunks), as a scan over N layers does that
  of N layers. Recomputation asked for by config.model.remat counts.
  """
  model_config = dataclasses.replace(setup.model_config, scan_layers=False,
                                     attention_impl='einsum')
  mesh = jax.sharding.Mesh(np.array(jax.devices('cpu')[:1]).reshape((1,) * len(
      sharding.MESH_AXES)), sharding.MESH_AXES)
  train_step = jax.jit(setup_lib.train_step_of(config, model_config, setup.optimizer,
                                               grad_accum_steps=1, loss_chunk_tokens=0,
                                               objective=tasks.for_config(config).objective))
  state, _ = setup_lib.abstract_tree(functools.partial(
      setup_lib.init_state, model_config=model_config, optimizer=setup.optimizer,
      ema=config.opt.ema_decay > 0), mesh, setup.axis_rules)
  batch = {key: jax.ShapeDtypeStruct(value.shape, value.dtype) for key, value in batch.items()}
  with sharding.mesh_context(mesh, setup.axis_rules):
    cost = train_step.lower(state, batch, rng).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get('flops', 0.0))


def compiler_version(target: targets.Target) -> str:
  """The compiler that compiled for `target`, as its package names it."""
  package = 'libtpu' if target.platform == 'tpu' else 'jax-cuda12-plugin'
  try:
    return f'{package} {importlib.metadata.version(package)}, jaxlib {jax.lib.__version__}'
  except importlib.metadata.PackageNotFoundError:
    return f'jaxlib {jax.lib.__version__}'


def _collectives(program: Program) -> dict:
  if program.cost is None:
    return {}
  return {'collectives': program.cost.collectives_by_kind(),
          'compiled_flops_per_device': program.cost.flops,
          'hbm_bytes_per_device': program.cost.hbm_bytes,
          'kernels_per_step': sum(k.count for k in program.cost.kernels)}


def _granule_order(target, setup) -> list[int]:
  """The slice or host of each of the mesh's devices, in the program's device order."""
  granules = targets.granule_of(target, setup.mesh.devices.flat)
  return [granules[d.id] for d in setup.mesh.devices.flat]


def _prediction(cost, target, setup, target_tokens: int, model_flops: float) -> dict:
  prediction = roofline.predict(cost, target, _granule_order(target, setup))
  rates = roofline.throughput(prediction, target_tokens, model_flops, target,
                              jnp.dtype(setup.model_config.dtype).name)
  return {'prediction': {**prediction.as_dict(), **rates,
                         'unknown_trip_counts': cost.unknown_trip_counts,
                         'what': 'roofline of the compiled step: a prediction, not a '
                                 'measurement'}}


def _memory_per_device(compiled) -> dict[str, int]:
  """XLA's memory analysis of the compiled step, with the donated state counted once."""
  memory = compiled.memory_analysis()
  per_device = {name: int(getattr(memory, f'{name}_size_in_bytes', 0))
                for name in ('argument', 'output', 'temp', 'alias', 'generated_code')}
  # Donated state is both argument and output: count it once.
  per_device['total'] = (per_device['argument'] + per_device['output'] + per_device['temp']
                         - per_device['alias'])
  return per_device


def _device_fit(train: 'Program') -> dict:
  """On an accelerator that reports its memory, whether the step fits in it (a step its
  compiler refused does not, with the compiler's words)."""
  if train.error:
    return {'fits': False, 'compiler_error': train.error}
  limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit')
  return ({'device_memory_bytes': int(limit), 'fits': train.memory['total'] <= limit}
          if limit else {})


def fit_advice(config, result: dict) -> str:
  """One line: which program does not fit, by how much, and the settings that shrink it."""
  program, report = next((name, p) for name, p in result['programs'].items() if not p['fits'])
  gib = lambda n: f'{n / 2**30:.1f} GiB'
  needs = (f'the compiler refused it ({report["compiler_error"]})'
           if report.get('compiler_error') else
           f'it needs {gib(report["needs_bytes"])} per device')
  mesh = result['mesh']
  ideas = []
  if mesh['data'] > 1:
    ideas.append(f'more fsdp (config.mesh.shape=({mesh["data"] // 2},{mesh["fsdp"] * 2},'
                 f'{mesh["tensor"]}))')
  if config.model.remat != 'full':
    ideas.append('config.model.remat=full' + ('' if config.model.scan_layers else
                                               ' with config.model.scan_layers=True'))
  ideas.append(f'config.opt.grad_accum_steps={config.opt.grad_accum_steps * 2}')
  ideas.append(f'a smaller batch per device (config.data.batch_tokens='
               f'{config.data.batch_tokens // 2})')
  if program == SEARCH:
    ideas = [f'config.eval.beam_size or config.data.batch_tokens (the search batch holds '
             f'{config.data.batch_tokens} tokens across beams)', 'more fsdp']
  return (f'the {program} does not fit a {result["target"]} device: {needs}, and '
          f'{gib(result["usable_memory_bytes"])} are usable. Try: {"; ".join(ideas)}')


def command(config, target: str = '') -> None:
  """`--dry_run [--dry_run_target=...]`: the report (a table for a target) and its JSON line;
  a step that does not fit ends the command with one line saying what to change."""
  result = dry_run(config, target)
  if target:
    print(report_lib.table(result), flush=True)
  print(cli.json_line(result), flush=True)
  if result.get('programs') and not result['fits']:
    raise ConfigError(fit_advice(config, result))
  if not result.get('fits', True):  # A real accelerator of this machine, no target named.
    human = report_lib.human_bytes
    needs = (f'the compiler refused it: {result["compiler_error"]}' if 'compiler_error' in
             result else f'it needs {human(result["memory_per_device_bytes"]["total"])} '
             f'per device but the device has {human(result["device_memory_bytes"])}')
    raise ConfigError(f'the train step does not fit: {needs}; shard more (config.mesh), lower '
                      'config.data.batch_tokens, raise config.opt.grad_accum_steps or use '
                      'config.model.dtype=bfloat16.')
