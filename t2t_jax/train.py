"""Train state, pure train/eval steps, and the loop: mesh -> data -> init -> restore -> loop."""

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable

from absl import logging
import flax
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
import tensorboardX

from t2t_jax import NonFiniteLoss
from t2t_jax import checkpoint
from t2t_jax import cli
from t2t_jax import config_check
from t2t_jax import data
from t2t_jax import decode
from t2t_jax import evaluate
from t2t_jax import flops
from t2t_jax import hang_guard
from t2t_jax import moe
from t2t_jax import optim
from t2t_jax import preemption
from t2t_jax import prng
from t2t_jax import sharding
from t2t_jax import workdir_lock
from t2t_jax.decoder_only import make_model
from t2t_jax.model import TransformerConfig, output_params

FINAL_JSON = 'final.json'  # The final figures of a finished run, one strict JSON line.


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def apply_model(model: nn.Module, params, batch: dict, **kwargs) -> jax.Array:
  """Teacher-forced logits; packed batches carry positions and segment ids."""
  return model.apply({'params': params}, batch['inputs'], batch['targets'],
                     batch.get('inputs_positions'), batch.get('targets_positions'),
                     batch.get('inputs_segments'), batch.get('targets_segments'), **kwargs)


def model_metrics(model: nn.Module, params, batch: dict, label_smoothing: float,
                  loss_chunk_tokens: int = 0, **kwargs) -> dict[str, jax.Array]:
  """Metric sums of the model on a batch: from whole logits, or chunk by chunk of tokens.

  A model with experts adds 'moe_aux_loss' (the layers' mean load-balancing loss times the
  batch's target tokens, so sums over batches divide by 'weight' as the loss does),
  'moe_routed' and 'moe_dropped' (choices of real tokens sent to an expert, and dropped
  there for want of capacity).
  """
  with_experts = bool(model.config.moe_experts)
  if with_experts:
    kwargs['mutable'] = [moe.COLLECTION]
  if not loss_chunk_tokens:
    output = apply_model(model, params, batch, **kwargs)
    logits_BLV, sown = output if with_experts else (output, None)
    metrics = optim.compute_metrics(logits_BLV, batch['targets'], label_smoothing)
  else:
    output = apply_model(model, params, batch, return_hidden=True, **kwargs)
    hidden_BLE, sown = output if with_experts else (output, None)
    def project(weights, hidden_NE):
      return model.apply({'params': weights}, hidden_NE, method='output_logits')
    metrics = optim.chunked_metrics(project, output_params(params, model.config), hidden_BLE,
                                    batch['targets'], label_smoothing, loss_chunk_tokens)
  if with_experts:  # Outside the (chunked) token loss: the experts' loss is not from logits.
    sums = moe.metrics(sown[moe.COLLECTION])
    metrics.update(moe_aux_loss=sums['aux_loss'] * metrics['weight'],
                   moe_routed=sums['routed'], moe_dropped=sums['dropped'])
  return metrics


def train_step(state: TrainState, batch: dict, rng: jax.Array, *, model: nn.Module,
               optimizer: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int = 1, loss_chunk_tokens: int = 0,
               dropout_prng: str = 'threefry2x32', moe_aux_loss_weight: float = 0.0):
  """One update on the loss per real target token of the whole (global) batch.

  With experts the objective is that loss plus `moe_aux_loss_weight` times the MoE layers'
  mean load-balancing loss; the 'loss' metric stays the token loss alone.

  `rng` is the raw key data of PRNG `dropout_prng` (`prng.dropout_key`); the step's dropout
  key is it folded with the step number, so a resumed run draws the same masks.
  With `grad_accum_steps` = A the batch is split into A micro-batches whose gradients and
  metrics are summed in a scan before the single division by the batch's target tokens, so
  A micro-batches of B/A rows give the update of one batch of B rows.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(rng, impl=prng.impl(dropout_prng)),
                                   state.step)
  rows = batch['targets'].shape[0]
  if rows % grad_accum_steps:
    raise ValueError(f'the batch has {rows} rows, which do not split into '
                     f'config.opt.grad_accum_steps={grad_accum_steps} equal micro-batches')

  def loss_sum_fn(params, micro_batch, micro_rng):
    metrics = model_metrics(model, params, micro_batch, label_smoothing, loss_chunk_tokens,
                            rngs={'dropout': micro_rng})
    objective = metrics['loss']
    if 'moe_aux_loss' in metrics:  # Scaled by the tokens like the loss: the same division.
      objective += moe_aux_loss_weight * metrics['moe_aux_loss']
    return objective, metrics

  grad_fn = jax.grad(loss_sum_fn, has_aux=True)
  if grad_accum_steps == 1:
    grad_sums, metrics = grad_fn(state.params, batch, dropout_rng)
  else:
    micro_batches = jax.tree.map(lambda x: _split_rows(x, grad_accum_steps), batch)

    def accumulate(carry, inputs):
      index, micro_batch = inputs
      grads, metrics = grad_fn(state.params, micro_batch, jax.random.fold_in(dropout_rng, index))
      return jax.tree.map(jnp.add, carry, (grads, metrics)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        grad_fn, state.params, jax.tree.map(lambda x: x[0], micro_batches), dropout_rng))
    (grad_sums, metrics), _ = jax.lax.scan(
        accumulate, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  grads = jax.tree.map(lambda g: g / jnp.maximum(metrics['weight'], 1.0), grad_sums)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _split_rows(x_BL: jax.Array, parts: int) -> jax.Array:
  """[B, ...] -> [parts, B / parts, ...], micro-batch i = rows i, i + parts, i + 2 parts, ...

  Strided rather than contiguous, so each micro-batch keeps the batch's split over the
  devices and no rows move between devices.
  """
  x = x_BL.reshape((x_BL.shape[0] // parts, parts) + x_BL.shape[1:]).swapaxes(0, 1)
  return nn.with_logical_constraint(x, (None, 'batch') + (None,) * (x_BL.ndim - 1))


def eval_step(params, batch: dict, *, model: nn.Module, label_smoothing: float,
              loss_chunk_tokens: int = 0):
  return model_metrics(model, params, batch, label_smoothing, loss_chunk_tokens)


@dataclasses.dataclass
class Setup:
  """What the loop, the dry run and the tools share: model, optimiser, jitted functions."""
  mesh: jax.sharding.Mesh
  axis_rules: tuple
  model_config: TransformerConfig
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings.
  init: Callable
  train_step: Callable
  eval_step: Callable


def init_state(rng: jax.Array, *, model_config: TransformerConfig,
               optimizer: optax.GradientTransformation) -> TrainState:
  """Fresh parameters (boxed with their logical axes) and optimiser state at step 0."""
  dummy = jnp.ones((1, 1), jnp.int32)
  params = make_model(dataclasses.replace(model_config, deterministic=True)).init(
      rng, dummy, dummy)['params']
  return TrainState(step=jnp.array(0, jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def build(config, vocab_size: int, mesh=None) -> Setup:
  """Model, optimiser and the jitted init/train/eval with shardings from the logical axes."""
  mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, vocab_size)
  model = make_model(model_config)
  optimizer = optim.make_optimizer(config.opt, config.model.d_model, config.train.num_steps)

  init = functools.partial(init_state, model_config=model_config, optimizer=optimizer)
  abstract_state, shardings = _abstract_state(init, mesh, axis_rules)
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  ls, chunk = config.opt.label_smoothing, config.opt.loss_chunk_tokens
  jit_init = jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings)
  jit_train = jax.jit(
      functools.partial(train_step, model=model, optimizer=optimizer, label_smoothing=ls,
                        grad_accum_steps=config.opt.grad_accum_steps, loss_chunk_tokens=chunk,
                        dropout_prng=config.model.dropout_prng,
                        moe_aux_loss_weight=config.model.moe_aux_loss_weight),
      in_shardings=(shardings, batch_sharding, replicated),
      out_shardings=(shardings, replicated), donate_argnums=0)
  jit_eval = jax.jit(
      functools.partial(eval_step, model=make_model(dataclasses.replace(
          model_config, deterministic=True)), label_smoothing=ls, loss_chunk_tokens=chunk),
      in_shardings=(shardings.params, batch_sharding), out_shardings=replicated)

  def traced(fn):  # Tracing (first call per shape) must see the mesh and the rules.
    @functools.wraps(fn)
    def wrapper(*args):
      with sharding.mesh_context(mesh, axis_rules):
        return fn(*args)
    wrapper.lower = lambda *args: _lower(fn, mesh, axis_rules, *args)
    return wrapper

  return Setup(mesh, axis_rules, model_config, optimizer,
               optim.learning_rate_schedule(config.opt, config.model.d_model,
                                            config.train.num_steps), abstract_state,
               traced(jit_init), traced(jit_train), traced(jit_eval))


def _abstract_state(init, mesh, axis_rules) -> tuple[TrainState, TrainState]:
  """The state `init` gives as ShapeDtypeStructs carrying their shardings, and the shardings."""
  with sharding.mesh_context(mesh, axis_rules):
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
    shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
  abstract_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                nn.meta.unbox(boxed), shardings)
  return abstract_state, shardings


def _lower(fn, mesh, axis_rules, *args):
  with sharding.mesh_context(mesh, axis_rules):
    return fn.lower(*args)


def count_params(params) -> int:
  return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))


def dry_run(config) -> dict:
  """Compiles the train step for the configured mesh without data; returns size and cost."""
  config_check.check(config)
  setup = build(config, data.vocab_size(config))
  shards = sharding.batch_shards(setup.mesh) * config.opt.grad_accum_steps
  if config.data.batching == 'packed':
    length = data.pack_length(config.data)
    keys = ('inputs', 'targets', 'inputs_positions', 'targets_positions', 'inputs_segments',
            'targets_segments')
  else:
    length = min(data.bucket_boundaries(config.data.max_len, config.data.min_bucket,
                                        config.data.bucket_scale)[-1], config.model.max_len)
    keys = ('inputs', 'targets')
  rows = max(shards, config.data.batch_tokens // length // shards * shards)
  source_length = 0 if config.data.source == 'lm' else length  # A language model: no source.
  batch = {key: jax.ShapeDtypeStruct((rows, source_length if key.startswith('inputs') else length),
                                     jnp.int32, sharding=sharding.batch_sharding(setup.mesh))
           for key in keys}
  rng = jax.ShapeDtypeStruct(prng.dropout_key(jnp.zeros((2,), jnp.uint32),
                                          config.model.dropout_prng).shape, jnp.uint32)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  flops = _global_flops(setup, config, batch, rng)
  memory = compiled.memory_analysis()
  per_device = {name: int(getattr(memory, f'{name}_size_in_bytes', 0))
                for name in ('argument', 'output', 'temp', 'alias', 'generated_code')}
  # Donated state is both argument and output: count it once.
  per_device['total'] = (per_device['argument'] + per_device['output'] + per_device['temp']
                         - per_device['alias'])
  return {
      'config': config.name,
      'params': count_params(setup.abstract_state.params),
      'flops_per_step': flops,
      'flops_per_step_per_device': flops / setup.mesh.size,
      'batch_shape': [rows, length],
      'grad_accum_steps': config.opt.grad_accum_steps,
      'scan_layers': config.model.scan_layers,
      'remat': config.model.remat,
      'attention_pattern': config.model.attention_pattern,
      'positions': config.model.positions,
      'dtype': jnp.dtype(setup.model_config.dtype).name,
      'mesh': dict(setup.mesh.shape),
      'device_count': setup.mesh.size,
      'device_kind': jax.devices()[0].device_kind,
      'memory_per_device_bytes': per_device,
      'compile_seconds': round(compile_seconds, 2),
      **_device_fit(per_device['total']),
  }


def _global_flops(setup: Setup, config, batch, rng) -> float:
  """FLOPs of one whole update, from XLA's cost analysis of the program before partitioning.

  Counted without accumulation, loss chunks or scanned layers: the analysis counts a loop body
  once, and A micro-batches (or C chunks) do the arithmetic of one batch of A times their rows
  (C chunks), as a scan over N layers does that of N layers. Recomputation asked for by
  config.model.remat counts.
  """
  model_config = dataclasses.replace(setup.model_config, scan_layers=False)
  step = jax.jit(functools.partial(train_step, model=make_model(model_config),
                                   optimizer=setup.optimizer,
                                   label_smoothing=config.opt.label_smoothing,
                                   dropout_prng=config.model.dropout_prng,
                                   moe_aux_loss_weight=config.model.moe_aux_loss_weight))
  state = setup.abstract_state
  if setup.model_config.scan_layers:
    state, _ = _abstract_state(functools.partial(
        init_state, model_config=model_config, optimizer=setup.optimizer), setup.mesh,
                               setup.axis_rules)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    cost = step.lower(state, batch, rng).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get('flops', 0.0))


def _device_fit(total_bytes: int) -> dict:
  """On an accelerator that reports its memory, whether the step fits in it."""
  limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit')
  return {'device_memory_bytes': int(limit), 'fits': total_bytes <= limit} if limit else {}


# The training loop.

def _batchers(config, task: data.TaskData, mesh) -> tuple:
  """(train, eval) batch plans; this process collates only its rows of each global batch."""
  if not len(task.train):
    raise data.DataError('no training pairs are left after reading and filtering the data')
  return data.make_batchers(config, task.train, task.eval, sharding.batch_shards(mesh),
                            jax.process_index(), jax.process_count())


def _load_data(config, workdir: str) -> data.TaskData:
  """Process 0 trains the vocabulary and fills the token cache (a shared folder); then all load."""
  if jax.process_count() == 1:
    return data.load(config, workdir)
  task = data.load(config, workdir) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('t2t_jax: vocabulary and token cache ready')
  return task or data.load(config, workdir)


def _write_config(config, workdir: str) -> str:
  """Writes the resolved config as text and JSON; returns the JSON."""
  config_json = config.to_json_best_effort(indent=2, sort_keys=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.txt'), 'w') as f:
      f.write(str(config))
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config_json)
  return config_json


def run_evaluation(setup: Setup, params, task: data.TaskData, eval_batches, config,
                   translator: decode.Translator, bleu_sentences: int | None = None
                   ) -> tuple[dict[str, float], evaluate.Bleu | None]:
  """Eval loss/accuracy on the eval set, and BLEU and exact match of `bleu_sentences` decodes
  (0 none, -1 all, N the first N; default `config.eval.bleu_sentences`)."""
  sums = None
  for batch in data.eval_batches(eval_batches, config.eval.num_batches):
    metrics = jax.device_get(setup.eval_step(params, sharding.global_batch(batch, setup.mesh)))
    sums = metrics if sums is None else jax.tree.map(np.add, sums, metrics)
  if sums is None:
    logging.warning('The eval set is empty: no eval figures.')
    return {}, None
  results = {f'eval_{k}': v for k, v in optim.summarize(sums).items()}
  bleu = None
  if bleu_sentences is None:
    bleu_sentences = config.eval.bleu_sentences
  if bleu_sentences and len(task.eval):
    scores, bleu = evaluate.validation_bleu(translator, params, task.eval, task.vocab,
                                            config.eval, config.eval.examples_to_print,
                                            bleu_sentences)
    results.update(scores)
  return results, bleu


class _MetricLog:
  """Accumulates per-step metric sums between logs, checks them, and writes one log line.

  Beside loss and speed it reports model FLOP/s (the analytic count of `flops`, padding
  included) and, where the devices' peak is known (not on CPU), MFU against that peak.
  """

  def __init__(self, writer, schedule, num_steps: int, start_step: int,
               peak_flops_per_second: float | None):
    self.writer, self.schedule, self.num_steps = writer, schedule, num_steps
    self.peak = peak_flops_per_second  # All devices of the mesh together; None if unknown.
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()
    self.last_good_step = start_step
    self.last_loss, self.intervals = None, []  # (steps, seconds, model FLOPs) each.

  def add(self, step: int, metrics, model_flops: float) -> None:
    metrics = jax.device_get(metrics)
    loss = float(metrics['loss']) / max(float(metrics['weight']), 1.0)
    if not math.isfinite(loss):
      raise NonFiniteLoss(
          f'training loss is {loss} at step {step}; stopping. Parameters after step '
          f'{self.last_good_step} were finite and the last checkpoint is intact: lower '
          'config.opt.lr_scale or set config.opt.grad_clip, then rerun to resume.')
    self.last_good_step = step
    self.sums = metrics if self.sums is None else jax.tree.map(np.add, self.sums, metrics)
    self.steps += 1
    self.model_flops += model_flops

  def write(self, step: int) -> None:
    if not self.steps:
      return
    elapsed = time.perf_counter() - self.start
    summary = optim.summarize(self.sums)
    steps_per_second = self.steps / elapsed
    summary.update(learning_rate=float(self.schedule(step - 1)),
                   target_tokens_per_second=float(self.sums['weight']) / elapsed,
                   steps_per_second=steps_per_second,
                   model_flops_per_second=self.model_flops / elapsed)
    if self.peak:
      summary['mfu'] = flops.mfu(self.model_flops, elapsed, self.peak)
    eta = (self.num_steps - step) / steps_per_second
    experts = (f', MoE aux loss {summary["moe_aux_loss"]:.4f}, dropped '
               f'{summary["moe_dropped_fraction"]:.2%}' if 'moe_aux_loss' in summary else '')
    logging.info('step %d: loss %.4f%s, accuracy %.4f, lr %.3g, %.0f target tokens/s, '
                 '%.2f steps/s, %.4g model TFLOP/s%s, ETA %s', step, summary['loss'], experts,
                 summary['accuracy'], summary['learning_rate'],
                 summary['target_tokens_per_second'], steps_per_second,
                 summary['model_flops_per_second'] / 1e12,
                 f', MFU {summary["mfu"]:.1%}' if self.peak else '',
                 time.strftime('%H:%M:%S', time.gmtime(eta)))
    for name, value in summary.items():
      self.writer.add_scalar(f'train/{name}', value, step)
    self.last_loss = summary['loss']
    self.intervals.append((self.steps, elapsed, self.model_flops))
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()

  def final(self) -> dict[str, Any]:
    """Last logged loss, steps/s, model FLOP/s and MFU, compiling left out; None says why."""
    if not self.intervals:
      return {'train_loss': None, 'steps_per_second': None, 'model_flops_per_second': None,
              'mfu': None, 'null_reasons': {
                  name: 'no training step ran in this launch' for name in
                  ('train_loss', 'steps_per_second', 'model_flops_per_second', 'mfu')}}
    intervals = self.intervals[1:] or self.intervals
    steps, seconds, model_flops = (sum(column) for column in zip(*intervals))
    seconds = max(seconds, 1e-9)
    figures = {'train_loss': self.last_loss, 'steps_per_second': steps / seconds,
               'model_flops_per_second': model_flops / seconds,
               'mfu': flops.mfu(model_flops, seconds, self.peak) if self.peak else None}
    if not self.peak:
      figures['null_reasons'] = {'mfu': 'the peak FLOP/s of this device kind is not known'}
    return figures


def _model_flops(model_config: TransformerConfig, host_batch: dict) -> float:
  """Analytic FLOPs of the step on this batch: every process's rows at the padded lengths."""
  rows, source_length = host_batch['inputs'].shape
  return flops.train_step_flops(model_config, rows * jax.process_count(), source_length,
                                host_batch['targets'].shape[1])


def train_and_evaluate(config, workdir: str, force_unlock: bool = False) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final figures.

  Process 0 holds the workdir's lock throughout: a second launch on it is refused, on every
  process, while this one lives (`force_unlock` takes the lock regardless).
  """
  config_check.check(config)
  workdir_lock.make_workdir(workdir)
  with workdir_lock.hold(workdir, force_unlock):
    return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  mesh = sharding.make_mesh(config.mesh)
  task = _load_data(config, workdir)
  train_batches, eval_batches = _batchers(config, task, mesh)
  setup = build(config, data.vocab_size(config), mesh)
  logging.info('Model: %d parameters; mesh %s; %d train / %d eval pairs; %d batches per epoch',
               count_params(setup.abstract_state.params), dict(mesh.shape), len(task.train),
               len(task.eval), len(train_batches))
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  dropout_rng = prng.dropout_key(dropout_rng, config.model.dropout_prng)
  train_iter = data.train_iterator(train_batches)
  checkpointer = checkpoint.Checkpointer(workdir, config.ckpt, config.eval.average_last)
  restored = checkpointer.restore(setup.abstract_state, config, dropout_rng.shape)
  if restored:
    state, dropout_rng = restored.state, restored.rng
    train_iter.set_state(restored.data_state)
  else:
    state = setup.init(init_rng)
    if config.ckpt.init_from:  # Fine-tune from averaged, exported or other run's params.
      state = state.replace(params=checkpoint.restore_params(
          workdir, setup.abstract_state.params, config.ckpt.init_from))
  config_json = _write_config(config, workdir)
  translator = decode.Translator(setup.model_config, setup.mesh, setup.axis_rules,
                                 config.data.batch_tokens, config.data.min_bucket,
                                 config.eval.max_extra_len, config.eval.beam_size,
                                 config.eval.alpha, config.eval.dtype)
  # A resumed run logs again the steps after its checkpoint: TensorBoard drops the earlier
  # launch's values from purge_step on, so each step shows once.
  purge_step = int(state.step) + 1 if restored else None
  writer = (tensorboardX.SummaryWriter(workdir, purge_step=purge_step)
            if jax.process_index() == 0 else _NullWriter())
  num_steps, start_step = config.train.num_steps, int(state.step)
  metric_log = _MetricLog(writer, setup.schedule, num_steps, start_step,
                          flops.devices_peak_flops_per_second(list(mesh.devices.flat),
                                                              setup.model_config.dtype))
  results, pending, train_start = {}, None, time.perf_counter()
  sigterm, preempted = preemption.Preemption(config.ckpt.preemption_grace_seconds,
                                             checkpointer.remove_unfinished), False
  logging.info('Training from step %d to %d', start_step, num_steps)
  seen_shapes = set()
  with hang_guard.HangGuard(config.train.step_timeout_seconds) as guard:
    for step in range(start_step + 1, num_steps + 1):
      guard.arm(f'training step {step} (or reading the metrics of step {step - 1})')
      host_batch = next(train_iter)
      if host_batch['targets'].shape not in seen_shapes:  # Compiles the step: not guarded.
        seen_shapes.add(host_batch['targets'].shape)
        guard.disarm()
      state, metrics = setup.train_step(state, sharding.global_batch(host_batch, mesh),
                                        dropout_rng)
      checkpointer.check()  # A save that failed in the background stops the run here.
      if pending:  # Read the previous step's metrics only now, so the device never waits.
        metric_log.add(*pending)
      pending = (step, metrics, _model_flops(setup.model_config, host_batch))
      is_last, preempted = step == num_steps, sigterm.requested(step)
      evaluate_now = is_last or step % config.train.eval_every == 0
      save_now = is_last or preempted or checkpointer.should_save(step)
      if is_last or evaluate_now or save_now or step % config.train.log_every == 0:
        metric_log.add(*pending)
        pending = None
        metric_log.write(step)
      guard.disarm()  # Saving and evaluating (which compiles decoding) are not steps.
      if save_now:
        checkpointer.save(step, state, dropout_rng, train_iter.get_state(), config_json)
      if preempted:
        break
      if evaluate_now:
        sentences = evaluate.bleu_sentences_due(step, num_steps, config.eval)
        results, bleu = run_evaluation(setup, state.params, task, eval_batches, config,
                                       translator, sentences)
        if bleu and jax.process_index() == 0:
          evaluate.record_best_bleu(workdir, step, bleu)
        if config.eval.average_last and save_now:
          averaged, steps = checkpointer.average_last(config.eval.average_last,
                                                      setup.abstract_state.params)
          averaged_results, _ = run_evaluation(setup, averaged, task, eval_batches, config,
                                               translator, sentences)
          results.update({f'averaged_{name}': value for name, value in averaged_results.items()})
          logging.info('Averaged checkpoints %s', steps)
        for name, value in results.items():
          writer.add_scalar(name.replace('eval_', 'eval/'), value, step)
        logging.info('step %d eval: %s', step, json.dumps(results))
  sigterm.close()
  if preempted:
    checkpointer.close()
    writer.close()
    raise preemption.Preempted(int(state.step), checkpointer.directory, sigterm.signum)
  saved = _read_final(workdir, int(state.step)) if not results else None
  if not results and not saved:  # Resumed at the end, figures unsaved: evaluate again.
    results, _ = run_evaluation(setup, state.params, task, eval_batches, config, translator)
  checkpointer.close()
  writer.close()
  if saved:  # Resumed a finished run: nothing trained; report what it reported.
    logging.info('The run had already finished at step %d; its final figures follow.',
                 saved['step'])
    return saved
  figures = {'config': config.name, 'step': int(state.step), **results, **metric_log.final(),
             'train_seconds': round(time.perf_counter() - train_start, 1)}
  if jax.process_index() == 0:  # Sweep summaries and a resumed finished run read it back.
    with open(os.path.join(workdir, FINAL_JSON), 'w') as f:
      f.write(cli.json_line(figures) + '\n')
  return figures


def _read_final(workdir: str, step: int) -> dict[str, Any] | None:
  """The figures a finished run saved at `step`, or None (none saved, or of another step)."""
  try:
    with open(os.path.join(workdir, FINAL_JSON)) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  return saved if saved.get('step') == step else None


class _NullWriter:
  def add_scalar(self, *args, **kwargs):
    pass

  def close(self):
    pass
