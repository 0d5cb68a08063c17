"""Building and jitting: the model and optimiser of a config, the abstract state with its
shardings, and the jitted init/train/eval functions that trace under the mesh's rules."""

import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.model.decoder_only import make_model
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.training import optim
from t2t_jax.training import step
from t2t_jax.training import tasks


@dataclasses.dataclass
class Setup:
  """What the loop, the dry run and the tools share: model, optimiser, jitted functions."""
  mesh: jax.sharding.Mesh
  axis_rules: tuple
  model_config: TransformerConfig
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: step.TrainState  # ShapeDtypeStructs carrying their shardings.
  init: Callable
  train_step: Callable
  eval_step: Callable


def init_params(rng: jax.Array, *, model_config: TransformerConfig):
  """Fresh parameters, boxed with their logical axes."""
  dummy = jnp.ones((1, 1), jnp.int32)
  return make_model(dataclasses.replace(model_config, deterministic=True)).init(
      rng, dummy, dummy)['params']


def init_state(rng: jax.Array, *, model_config: TransformerConfig,
               optimizer: optax.GradientTransformation, ema: bool = False) -> step.TrainState:
  """Fresh parameters (boxed with their logical axes) and optimiser state at step 0; with
  `ema`, their moving average too (starting at them, boxed alike, so sharded alike)."""
  params = init_params(rng, model_config=model_config)
  return step.TrainState(step=jnp.array(0, jnp.int32), params=params,
                         opt_state=optimizer.init(params),
                         ema=optim.ema_init(params) if ema else None)


def abstract_tree(init: Callable, mesh, axis_rules) -> tuple:
  """What `init(rng)` gives, as ShapeDtypeStructs carrying their shardings, and the shardings.

  Nothing is materialised: the shapes come from `jax.eval_shape` of an abstract key (a
  concrete one would be an array on the mesh's devices, which a mesh of a compile-only
  target does not have), the shardings from the logical axes the parameters are boxed with.
  """
  with sharding.mesh_context(mesh, axis_rules):
    boxed = jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))
    shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
  return _placed(nn.meta.unbox(boxed), shardings), shardings


def _placed(shapes, shardings):
  """ShapeDtypeStructs of `shapes` carrying `shardings`."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def abstract_params(model_config: TransformerConfig, mesh, axis_rules):
  """Parameter shapes and dtypes with their shardings (what a params-only restore needs)."""
  init = functools.partial(init_params, model_config=model_config)
  return abstract_tree(init, mesh, axis_rules)[0]


def build(config, vocab_size: int, mesh=None, objective: Callable | None = None) -> Setup:
  """Model, optimiser and the jitted init/train/eval with shardings from the logical axes;
  the steps compute `objective` (a task's, training/task.py; None: the config's task's)."""
  objective = objective or tasks.for_config(config).objective
  mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  platform = mesh.devices.flat[0].platform
  model_config = TransformerConfig.from_config(config.model, vocab_size, platform=platform)
  optimizer = optim.make_optimizer(config.opt, config.model.d_model, config.train.num_steps)

  init = functools.partial(init_state, model_config=model_config, optimizer=optimizer,
                           ema=config.opt.ema_decay > 0)
  abstract_state, shardings = abstract_tree(init, mesh, axis_rules)
  update_shardings = None
  if splits_update(config, mesh):
    abstract_state, shardings, update_shardings = _split_update(abstract_state, shardings, mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  jit_init = jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings)
  jit_train = jax.jit(train_step_of(config, model_config, optimizer, objective=objective,
                                    update_shardings=update_shardings),
                      in_shardings=(shardings, batch_sharding, replicated),
                      out_shardings=(shardings, replicated), donate_argnums=0,
                      compiler_options=runtime.train_compiler_options(
                          config.mesh, platform,
                          scatter_devices=mesh.shape['fsdp'] * (
                              mesh.shape['data'] if update_shardings else 1),
                          weight_bytes=sharding.shard_bytes(abstract_state.params)
                          if mesh.size == 1 else 0) or None)
  jit_eval = jax.jit(
      functools.partial(step.eval_step, model=make_model(dataclasses.replace(
          model_config, deterministic=True)), label_smoothing=config.opt.label_smoothing,
                        loss_chunk_tokens=config.opt.loss_chunk_tokens, objective=objective),
      in_shardings=(shardings.params, batch_sharding), out_shardings=replicated)
  schedule = optim.learning_rate_schedule(config.opt, config.model.d_model,
                                          config.train.num_steps)
  return Setup(mesh, axis_rules, model_config, optimizer, schedule, abstract_state,
               traced(jit_init, mesh, axis_rules), traced(jit_train, mesh, axis_rules),
               traced(jit_eval, mesh, axis_rules))


def splits_update(config, mesh) -> bool:
  """Whether the step splits the optimiser's update over 'data' (mesh.shard_update, where
  the mesh splits the batch over 'data')."""
  return bool(config.mesh.get('shard_update', False)) and mesh.shape['data'] > 1


def _split_update(abstract_state, shardings, mesh):
  """mesh.shard_update: the optimiser's moments and the moving average split over 'data' as
  well; the params' shardings and those the step updates them in (split alike)."""
  split = lambda tree, shapes: sharding.split_over_data(tree, shapes, mesh)
  shardings = shardings.replace(
      opt_state=split(shardings.opt_state, abstract_state.opt_state),
      ema=split(shardings.ema, abstract_state.ema))  # None (no average) stays None.
  abstract_state = _placed(abstract_state, shardings)
  return abstract_state, shardings, step.UpdateShardings(
      shardings.params, split(shardings.params, abstract_state.params))


def train_step_of(config, model_config: TransformerConfig,
                  optimizer: optax.GradientTransformation, **overrides) -> Callable:
  """`step.train_step` with the model, optimiser and the config's step options bound."""
  options = dict(label_smoothing=config.opt.label_smoothing,
                 grad_accum_steps=config.opt.grad_accum_steps,
                 loss_chunk_tokens=config.opt.loss_chunk_tokens,
                 dropout_prng=config.model.dropout_prng,
                 moe_aux_loss_weight=config.model.moe_aux_loss_weight,
                 ema_decay=config.opt.ema_decay)
  return functools.partial(step.train_step, model=make_model(model_config), optimizer=optimizer,
                           **{**options, **overrides})


def traced(fn: Callable, mesh, axis_rules) -> Callable:
  """`fn` called (and `.lower`ed) under the mesh and the rules, which tracing must see."""
  @functools.wraps(fn)
  def wrapper(*args):
    with sharding.mesh_context(mesh, axis_rules):
      return fn(*args)

  def lower(*args):
    with sharding.mesh_context(mesh, axis_rules):
      return fn.lower(*args)
  wrapper.lower = lower
  return wrapper


def count_params(params) -> int:
  """The number of parameters (array elements) in a tree of arrays or shapes."""
  return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))
