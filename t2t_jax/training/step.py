"""The train state and the pure step functions: one update, and the eval metrics of a batch.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

from typing import Any, Callable, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t2t_jax.model import moe
from t2t_jax.model import prng
from t2t_jax.model.transformer import output_matrix
from t2t_jax.model.transformer import output_params
from t2t_jax.training import fused_loss
from t2t_jax.training import optim

# How the output layer and the loss over the vocabulary run (config.opt.loss_impl).
LOSS_IMPLS = ('xla', 'fused')


class UpdateShardings(NamedTuple):
  """mesh.shard_update (training/build.py): the params' own shardings, and those of the split
  the optimiser's state is kept in (split over 'data' as well)."""
  params: Any
  split: Any


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # float32 moving average of params (opt.ema_decay > 0), sharded like them; else None, and
  # checkpoints hold no entry for it (checkpoint.saved_tree).
  ema: Any = None


def apply_model(model: nn.Module, params, batch: dict, **kwargs) -> jax.Array:
  """Teacher-forced logits; packed batches carry positions and segment ids."""
  return model.apply({'params': params}, batch['inputs'], batch['targets'],
                     batch.get('inputs_positions'), batch.get('targets_positions'),
                     batch.get('inputs_segments'), batch.get('targets_segments'), **kwargs)


def model_metrics(model: nn.Module, params, batch: dict, label_smoothing: float,
                  loss_chunk_tokens: int = 0, loss_impl: str = 'xla',
                  **kwargs) -> dict[str, jax.Array]:
  """Metric sums of the model on a batch: from whole logits, chunk by chunk of tokens, or
  with `loss_impl='fused'` from the kernels of fused_loss.py, which store no logits.

  A model with experts adds 'moe_aux_loss' (the layers' mean load-balancing loss times the
  batch's target tokens, so sums over batches divide by 'weight' as the loss does),
  'moe_routed' and 'moe_dropped' (choices of real tokens sent to an expert, and dropped
  there for want of capacity).
  """
  with_experts = bool(model.config.moe_experts)
  if with_experts:
    kwargs['mutable'] = [moe.COLLECTION]
  # The loss over the vocabulary (the output projection with it) under the scope 'loss': the
  # dry run's bytes by part read it from the compiled program's metadata.
  if loss_impl == 'fused':
    output = apply_model(model, params, batch, return_hidden=True, **kwargs)
    hidden_BLE, sown = output if with_experts else (output, None)
    with jax.named_scope('loss'):
      metrics = fused_loss.fused_metrics(hidden_BLE, output_matrix(params, model.config),
                                         batch['targets'], label_smoothing)
  elif not loss_chunk_tokens:
    output = apply_model(model, params, batch, **kwargs)
    logits_BLV, sown = output if with_experts else (output, None)
    with jax.named_scope('loss'):
      metrics = optim.compute_metrics(logits_BLV, batch['targets'], label_smoothing)
  else:
    output = apply_model(model, params, batch, return_hidden=True, **kwargs)
    hidden_BLE, sown = output if with_experts else (output, None)
    def project(weights, hidden_NE):  # In the compute dtype: the loss reduces in float32.
      return model.apply({'params': weights}, hidden_NE, float32=False, method='output_logits')
    with jax.named_scope('loss'):
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
               dropout_prng: str = 'threefry2x32', moe_aux_loss_weight: float = 0.0,
               ema_decay: float = 0.0, objective: Callable = model_metrics,
               update_shardings: UpdateShardings | None = None):
  """One update on the loss per real target token of the whole (global) batch.

  `objective` gives the batch's metric sums ('loss' and 'weight' among them) from the model,
  the params, the batch, `label_smoothing` and `loss_chunk_tokens` (training/task.py); the
  default is the token cross-entropy of `model_metrics`.

  With experts the objective is that loss plus `moe_aux_loss_weight` times the MoE layers'
  mean load-balancing loss; the 'loss' metric stays the token loss alone.

  `rng` is the raw key data of PRNG `dropout_prng` (`prng.dropout_key`); the step's dropout
  key is it folded with the step number, so a resumed run draws the same masks.
  With `grad_accum_steps` = A the batch is split into A micro-batches whose gradients and
  metrics are summed in a scan before the single division by the batch's target tokens, so
  A micro-batches of B/A rows give the update of one batch of B rows.

  With `update_shardings` (mesh.shard_update) the gradients are reduced and scattered to
  the split the optimiser's state is kept in (each micro-batch's, when accumulating), each
  device updates its share of the parameters, and the new parameters are gathered back to
  their own shardings (the jit's out_shardings): the same arithmetic on a data-th of the
  optimiser's arrays.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(rng, impl=prng.impl(dropout_prng)),
                                   state.step)
  rows = batch['targets'].shape[0]
  if rows % grad_accum_steps:
    raise ValueError(f'the batch has {rows} rows, which do not split into '
                     f'config.opt.grad_accum_steps={grad_accum_steps} equal micro-batches')

  def loss_sum_fn(params, micro_batch, micro_rng):
    metrics = objective(model, params, micro_batch, label_smoothing, loss_chunk_tokens,
                        rngs={'dropout': micro_rng})
    loss = metrics['loss']
    if 'moe_aux_loss' in metrics:  # Scaled by the tokens like the loss: the same division.
      loss += moe_aux_loss_weight * metrics['moe_aux_loss']
    return loss, metrics

  grad_fn = jax.grad(loss_sum_fn, has_aux=True)
  grad_sums, metrics = _gradient_sums(grad_fn, state.params, batch, dropout_rng,
                                      grad_accum_steps, update_shardings)
  # The scope names the update's kernels in the compiled program's metadata: the dry run's
  # bytes by part (compile/hlo_cost.py) read it.
  with jax.named_scope('optimizer'):
    grads = jax.tree.map(lambda g: g / jnp.maximum(metrics['weight'], 1.0), grad_sums)
    params = state.params if update_shardings is None else (  # This device's share: a slice.
        jax.lax.with_sharding_constraint(state.params, update_shardings.split))
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    ema = None if state.ema is None else optim.ema_update(state.ema, params, ema_decay)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                       ema=ema), metrics


def _gradient_sums(grad_fn: Callable, params, batch: dict, dropout_rng: jax.Array,
                   grad_accum_steps: int, update_shardings: UpdateShardings | None):
  """`grad_fn`'s gradient and metric sums over the batch: at once, or over `grad_accum_steps`
  micro-batches in a scan, each drawing the dropout key folded with its index. With
  `update_shardings` the gradients come reduced and scattered to their split."""
  if grad_accum_steps == 1:
    grads, metrics = grad_fn(params, batch, dropout_rng)
    return _scattered(grads, update_shardings), metrics
  micro_batches = jax.tree.map(lambda x: _split_rows(x, grad_accum_steps), batch)

  def accumulate(carry, inputs):
    index, micro_batch = inputs
    grads, metrics = grad_fn(params, micro_batch, jax.random.fold_in(dropout_rng, index))
    return jax.tree.map(jnp.add, carry, (_scattered(grads, update_shardings), metrics)), None

  grad_zeros, metric_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
      grad_fn, params, jax.tree.map(lambda x: x[0], micro_batches), dropout_rng))
  if update_shardings is not None:  # The sum kept in the split from the start.
    grad_zeros = jax.lax.with_sharding_constraint(grad_zeros, update_shardings.split)
  (grad_sums, metrics), _ = jax.lax.scan(
      accumulate, (grad_zeros, metric_zeros), (jnp.arange(grad_accum_steps), micro_batches))
  return grad_sums, metrics


def _scattered(grads, update_shardings: UpdateShardings | None):
  """`grads` reduced and scattered to the split of mesh.shard_update (as they are without it).

  First pinned to the params' own shardings, so that the backward pass is partitioned as
  without the split (the second constraint alone reaches back into it); XLA then turns the
  reduction and the slice into a reduce-scatter.
  """
  if update_shardings is None:
    return grads
  grads = jax.lax.with_sharding_constraint(grads, update_shardings.params)
  return jax.lax.with_sharding_constraint(grads, update_shardings.split)


def _split_rows(x_BL: jax.Array, parts: int) -> jax.Array:
  """[B, ...] -> [parts, B / parts, ...], micro-batch i = rows i, i + parts, i + 2 parts, ...

  Strided rather than contiguous, so each micro-batch keeps the batch's split over the
  devices and no rows move between devices.
  """
  x = x_BL.reshape((x_BL.shape[0] // parts, parts) + x_BL.shape[1:]).swapaxes(0, 1)
  return nn.with_logical_constraint(x, (None, 'batch') + (None,) * (x_BL.ndim - 1))


def eval_step(params, batch: dict, *, model: nn.Module, label_smoothing: float,
              loss_chunk_tokens: int = 0, objective: Callable = model_metrics):
  """The objective's metric sums of the deterministic model on one batch (no update)."""
  return objective(model, params, batch, label_smoothing, loss_chunk_tokens)
