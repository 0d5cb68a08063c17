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
import jax.numpy as jnp
import numpy as np
import optax
import tensorboardX

from t2t_jax import checkpoint
from t2t_jax import data
from t2t_jax import decode
from t2t_jax import evaluate
from t2t_jax import optim
from t2t_jax import sharding
from t2t_jax.model import Transformer, TransformerConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def apply_model(model: Transformer, params, batch: dict, **kwargs) -> jax.Array:
  """Teacher-forced logits; packed batches carry positions and segment ids."""
  return model.apply({'params': params}, batch['inputs'], batch['targets'],
                     batch.get('inputs_positions'), batch.get('targets_positions'),
                     batch.get('inputs_segments'), batch.get('targets_segments'), **kwargs)


def train_step(state: TrainState, batch: dict, rng: jax.Array, *, model: Transformer,
               optimizer: optax.GradientTransformation, label_smoothing: float):
  """One update on the loss per real target token of the whole (global) batch."""
  dropout_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits_BLV = apply_model(model, params, batch, rngs={'dropout': dropout_rng})
    metrics = optim.compute_metrics(logits_BLV, batch['targets'], label_smoothing)
    return metrics['loss'] / jnp.maximum(metrics['weight'], 1.0), metrics

  grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: dict, *, model: Transformer, label_smoothing: float):
  logits_BLV = apply_model(model, params, batch)
  return optim.compute_metrics(logits_BLV, batch['targets'], label_smoothing)


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


def build(config, vocab_size: int, mesh=None) -> Setup:
  """Model, optimiser and the jitted init/train/eval with shardings from the logical axes."""
  mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, vocab_size)
  model = Transformer(model_config)
  optimizer = optim.make_optimizer(config.opt, config.model.d_model)

  def init(rng):
    dummy = jnp.ones((1, 1), jnp.int32)
    params = Transformer(dataclasses.replace(model_config, deterministic=True)).init(
        rng, dummy, dummy)['params']
    return TrainState(step=jnp.array(0, jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  with sharding.mesh_context(mesh, axis_rules):
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
    shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
  abstract_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                nn.meta.unbox(boxed), shardings)
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  ls = config.opt.label_smoothing
  jit_init = jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings)
  jit_train = jax.jit(
      functools.partial(train_step, model=model, optimizer=optimizer, label_smoothing=ls),
      in_shardings=(shardings, batch_sharding, replicated),
      out_shardings=(shardings, replicated), donate_argnums=0)
  jit_eval = jax.jit(
      functools.partial(eval_step, model=Transformer(dataclasses.replace(
          model_config, deterministic=True)), label_smoothing=ls),
      in_shardings=(shardings.params, batch_sharding), out_shardings=replicated)

  def traced(fn):  # Tracing (first call per shape) must see the mesh and the rules.
    @functools.wraps(fn)
    def wrapper(*args):
      with sharding.mesh_context(mesh, axis_rules):
        return fn(*args)
    wrapper.lower = lambda *args: _lower(fn, mesh, axis_rules, *args)
    return wrapper

  return Setup(mesh, axis_rules, model_config, optimizer,
               optim.learning_rate_schedule(config.opt, config.model.d_model), abstract_state,
               traced(jit_init), traced(jit_train), traced(jit_eval))


def _lower(fn, mesh, axis_rules, *args):
  with sharding.mesh_context(mesh, axis_rules):
    return fn.lower(*args)


def count_params(params) -> int:
  return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))


def dry_run(config) -> dict:
  """Compiles the train step for the configured mesh without data; returns size and cost."""
  setup = build(config, data.vocab_size(config))
  shards = sharding.batch_shards(setup.mesh)
  length = min(data.bucket_boundaries(config.data.max_len, config.data.min_bucket,
                                      config.data.bucket_scale)[-1], config.model.max_len)
  rows = max(shards, config.data.batch_tokens // length // shards * shards)
  batch = {key: jax.ShapeDtypeStruct((rows, length), jnp.int32,
                                     sharding=sharding.batch_sharding(setup.mesh))
           for key in ('inputs', 'targets')}
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  per_device = {name: int(getattr(memory, f'{name}_size_in_bytes', 0))
                for name in ('argument', 'output', 'temp', 'generated_code')}
  return {
      'config': config.name,
      'params': count_params(setup.abstract_state.params),
      'flops_per_step': float(cost.get('flops', 0.0)),
      'batch_shape': [rows, length],
      'mesh': dict(setup.mesh.shape),
      'device_kind': jax.devices()[0].device_kind,
      'memory_per_device_bytes': per_device,
      'compile_seconds': round(compile_seconds, 2),
  }


# The training loop.

def _batchers(config, task: data.TaskData, mesh) -> tuple[data.TokenBudgetBatches, ...]:
  boundaries = data.bucket_boundaries(config.data.max_len, config.data.min_bucket,
                                      config.data.bucket_scale)
  shards = sharding.batch_shards(mesh)
  train = data.TokenBudgetBatches(task.train, config.data.batch_tokens, boundaries, shards,
                                  shuffle=True, seed=config.seed)
  evaluation = data.TokenBudgetBatches(task.eval, config.data.batch_tokens, boundaries, shards,
                                       shuffle=False, seed=config.seed)
  if not len(task.train):
    raise data.DataError('no training pairs are left after reading and filtering the data')
  return train, evaluation


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
                   translator: decode.Translator, with_bleu: bool = True
                   ) -> tuple[dict[str, float], evaluate.Bleu | None]:
  """Eval loss/accuracy on the eval set; with `with_bleu`, BLEU and exact match of decodes."""
  sums = None
  for batch in data.eval_batches(eval_batches, config.eval.num_batches):
    metrics = jax.device_get(setup.eval_step(params, sharding.global_batch(batch, setup.mesh)))
    sums = metrics if sums is None else jax.tree.map(np.add, sums, metrics)
  results = {f'eval_{k}': v for k, v in optim.summarize(sums).items()}
  bleu = None
  if with_bleu and config.eval.bleu_sentences and len(task.eval):
    scores, bleu = evaluate.validation_bleu(translator, params, task.eval, task.vocab,
                                            config.eval, config.eval.examples_to_print)
    results.update(scores)
  return results, bleu


class _MetricLog:
  """Accumulates per-step metric sums between logs, checks them, and writes one log line."""

  def __init__(self, writer, schedule, num_steps: int, start_step: int):
    self.writer, self.schedule, self.num_steps = writer, schedule, num_steps
    self.sums, self.steps, self.start = None, 0, time.perf_counter()
    self.last_good_step = start_step

  def add(self, step: int, metrics) -> None:
    metrics = jax.device_get(metrics)
    loss = float(metrics['loss']) / max(float(metrics['weight']), 1.0)
    if not math.isfinite(loss):
      raise FloatingPointError(
          f'training loss is {loss} at step {step}; stopping. Parameters after step '
          f'{self.last_good_step} were finite and the last checkpoint is intact: lower '
          'config.opt.lr_scale or set config.opt.grad_clip, then rerun to resume.')
    self.last_good_step = step
    self.sums = metrics if self.sums is None else jax.tree.map(np.add, self.sums, metrics)
    self.steps += 1

  def write(self, step: int) -> None:
    if not self.steps:
      return
    elapsed = time.perf_counter() - self.start
    summary = optim.summarize(self.sums)
    steps_per_second = self.steps / elapsed
    summary.update(learning_rate=float(self.schedule(step - 1)),
                   target_tokens_per_second=float(self.sums['weight']) / elapsed,
                   steps_per_second=steps_per_second)
    eta = (self.num_steps - step) / steps_per_second
    logging.info('step %d: loss %.4f, accuracy %.4f, lr %.3g, %.0f target tokens/s, '
                 '%.2f steps/s, ETA %s', step, summary['loss'], summary['accuracy'],
                 summary['learning_rate'], summary['target_tokens_per_second'],
                 steps_per_second, time.strftime('%H:%M:%S', time.gmtime(eta)))
    for name, value in summary.items():
      self.writer.add_scalar(f'train/{name}', value, step)
    self.sums, self.steps, self.start = None, 0, time.perf_counter()


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final figures."""
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh)
  task = data.load(config, workdir)
  train_batches, eval_batches = _batchers(config, task, mesh)
  setup = build(config, data.vocab_size(config), mesh)
  logging.info('Model: %d parameters; mesh %s; %d train / %d eval pairs; %d batches per epoch',
               count_params(setup.abstract_state.params), dict(mesh.shape), len(task.train),
               len(task.eval), len(train_batches))
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  train_iter = data.train_iterator(train_batches)
  checkpointer = checkpoint.Checkpointer(workdir, config.ckpt)
  restored = checkpointer.restore(setup.abstract_state)
  if restored:
    state, data_state = restored
    train_iter.set_state(data_state)
  else:
    state = setup.init(init_rng)
  config_json = _write_config(config, workdir)
  translator = decode.Translator(setup.model_config, setup.mesh, setup.axis_rules,
                                 config.data.batch_tokens, config.data.min_bucket,
                                 config.eval.max_extra_len, config.eval.beam_size,
                                 config.eval.alpha)
  writer = tensorboardX.SummaryWriter(workdir) if jax.process_index() == 0 else _NullWriter()
  num_steps, start_step = config.train.num_steps, int(state.step)
  metric_log = _MetricLog(writer, setup.schedule, num_steps, start_step)
  results, pending, train_start = {}, None, time.perf_counter()
  logging.info('Training from step %d to %d', start_step, num_steps)
  for step in range(start_step + 1, num_steps + 1):
    batch = sharding.global_batch(next(train_iter), mesh)
    state, metrics = setup.train_step(state, batch, dropout_rng)
    if pending:  # Read the previous step's metrics only now, so the device never waits.
      metric_log.add(*pending)
    pending = (step, metrics)
    is_last = step == num_steps
    evaluate_now = is_last or step % config.train.eval_every == 0
    save_now = is_last or checkpointer.should_save(step)
    if is_last or evaluate_now or save_now or step % config.train.log_every == 0:
      metric_log.add(*pending)
      pending = None
      metric_log.write(step)
    if save_now:
      checkpointer.save(step, state, train_iter.get_state(), config_json)
    if evaluate_now:
      results, bleu = run_evaluation(setup, state.params, task, eval_batches, config, translator,
                                     evaluate.bleu_due(step, num_steps, config.eval))
      if bleu and jax.process_index() == 0:
        evaluate.record_best_bleu(workdir, step, bleu)
      for name, value in results.items():
        writer.add_scalar(name.replace('eval_', 'eval/'), value, step)
      logging.info('step %d eval: %s', step, json.dumps(results))
  if not results:  # Resumed at the end: nothing left to train, but report the figures.
    results, _ = run_evaluation(setup, state.params, task, eval_batches, config, translator)
  checkpointer.close()
  writer.close()
  return {'config': config.name, 'step': int(state.step), **results,
          'train_seconds': round(time.perf_counter() - train_start, 1)}


class _NullWriter:
  def add_scalar(self, *args, **kwargs):
    pass

  def close(self):
    pass
