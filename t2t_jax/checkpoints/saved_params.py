"""Parameters-only checkpoints and the readers they share with training checkpoints: load the
params of either kind (whole or into a model's shardings), pick a checkpoint by step or path,
average, cast and write them.

A params-only checkpoint (averaged or exported) is a directory with the orbax items `params`,
`config` and `info`; a training checkpoint holds its params in the `state` item.
"""

import contextlib
import gc
import logging as std_logging
import os
import re

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from t2t_jax import CheckpointError
from t2t_jax import ConfigError
from t2t_jax import workdir_layout

STATE, CONFIG, PARAMS, INFO = 'state', 'config', 'params', 'info'  # Orbax item names.
# Which weights of a training checkpoint to read: the params, or their moving average.
WEIGHTS = ('params', 'ema')
WEIGHTS_HELP = ('params: the trained weights; ema: their moving average, which training '
                'checkpoints of runs with config.opt.ema_decay > 0 hold (export --weights=ema '
                'writes it as a params-only checkpoint, read back with the default).')


# Library detail in error texts that says nothing to a reader: cut from the first line.
_LIBRARY_NOISE = (re.compile(r'\s*\[tensorstore_spec=.*'),  # The JSON spec of the file read.
                  re.compile(r'\s*<(bound|built-in) method .*'),  # A pybind11 method's repr.
                  re.compile(r'\s*<[^<>]* object at 0x[0-9a-f]+>'))


def describe_error(error: BaseException) -> str:
  """'ValueError: NOT_FOUND: ...': the error's type and first line, without library reprs."""
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ''
  for noise in _LIBRARY_NOISE:
    text = noise.sub('', text)
  text = text.strip().rstrip('.:,;(')
  if len(text) > 300:
    text = text[:297] + '...'
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def path_name(path) -> str:
  """'opt_state/0/mu/embedding' for dict keys, sequence indices and attributes alike."""
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
                  for k in path)


def array_shapes(tree) -> dict[str, tuple]:
  """{path: (shape, dtype)} of the array leaves of a tree (arrays, structs or metadata)."""
  return {path_name(path): (tuple(leaf.shape), np.dtype(leaf.dtype))
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def saved_shapes(item_path: str) -> dict[str, tuple]:
  """{path: (shape, dtype)} of the arrays saved in an orbax pytree item."""
  return array_shapes(saved_metadata(item_path))


def saved_metadata(item_path: str):
  """The tree of array metadata (shape, dtype) saved in an orbax pytree item."""
  metadata = ocp.StandardCheckpointHandler().metadata(ocp.path.step.epath.Path(item_path))
  return metadata.tree if hasattr(metadata, 'tree') else metadata


def _replicated(abstract):
  """Gives leaves without a sharding one replicated over all devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('all',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(
      lambda x: x if getattr(x, 'sharding', None) is not None else
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract)


def params_item(path: str) -> tuple[str, bool]:
  """(directory of the saved params tree, whether it is wrapped in a TrainState)."""
  if os.path.isdir(os.path.join(path, STATE)):
    return os.path.join(path, STATE), True
  if os.path.isdir(os.path.join(path, PARAMS)):
    return os.path.join(path, PARAMS), False
  raise CheckpointError(f'{path} is not a t2t_jax checkpoint: it has neither a "{STATE}" '
                        f'(training checkpoint) nor a "{PARAMS}" (averaged or exported) '
                        'subdirectory.')


class _UnretrievedTaskErrors(std_logging.Filter):
  """asyncio's 'Task exception was never retrieved': orbax's sibling reads (or writes) of a
  checkpoint whose first error was already raised, reported again, with the tensorstore spec,
  whenever the garbage collector finds them."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return 'exception was never retrieved' not in record.getMessage()


@contextlib.contextmanager
def unretrieved_task_errors_dropped():
  """Around one orbax read or write: the error a failed one raises is reported once, in
  t2t_jax's own words. After a failure the garbage collector runs before the filter goes, so
  that the sibling tasks report now, inside it; outside such a call every report is kept."""
  logger = std_logging.getLogger('asyncio')
  dropped = _UnretrievedTaskErrors()
  logger.addFilter(dropped)
  try:
    yield
  except BaseException:
    gc.collect()
    raise
  finally:
    logger.removeFilter(dropped)



def read_or_describe(read):
  """(read(), None), or (None, the error it raised described) for a read that fails other than
  with CheckpointError or ConfigError. The error, and with it the failed read's sibling tasks, is freed inside
  `unretrieved_task_errors_dropped`, so their late reports are dropped there, not logged later
  when the caller lets go of it."""
  with unretrieved_task_errors_dropped():
    try:
      return read(), None
    except (CheckpointError, ConfigError):  # A refusal, not damage.
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      description = describe_error(e)
    gc.collect()  # The failed tasks, unreachable now, report (and are dropped) here.
  return None, description


def load_params(path: str, abstract_params=None, weights: str = 'params'):
  """The params of a checkpoint directory (a training step or a params-only checkpoint), or
  with `weights`='ema' the moving average a training checkpoint holds beside them.

  With `abstract_params` (ShapeDtypeStructs, with or without shardings) they come back as
  jax.Arrays of those dtypes; without, as numpy arrays of the saved dtypes.
  """
  item, wrapped = params_item(path)
  saved = saved_shapes(item)
  _check_weights(path, weights, wrapped, saved)
  prefix = f'{weights}/' if wrapped else ''
  if abstract_params is None:
    tree = saved_metadata(item)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                          tree[weights] if wrapped else tree)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  else:
    target = _replicated(abstract_params)
    expected = {f'{prefix}{key}': value for key, value in array_shapes(target).items()}
    shapes = {k: v[0] for k, v in saved.items() if k.startswith(prefix)}
    wrong = [f'{key}: saved {shapes.get(key)}, expected {shape}'
             for key, (shape, _) in expected.items() if shapes.get(key) != shape]
    if wrong or len(shapes) != len(expected):
      raise CheckpointError(
          f'the params in {path} do not fit this model ({len(wrong)} of {len(expected)} '
          f'arrays differ, e.g. {wrong[0] if wrong else "a different set of arrays"}): use '
          'the config the checkpoint was trained with.')
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  if wrapped:
    target = {weights: target}
    restore_args = {weights: restore_args}
  with unretrieved_task_errors_dropped():
    restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True))
  return restored[weights] if wrapped else restored


def _check_weights(path: str, weights: str, wrapped: bool, saved: dict) -> None:
  """Refuses `weights` a checkpoint does not hold, saying what it holds instead."""
  if weights not in WEIGHTS:
    raise ValueError(f'weights must be one of {WEIGHTS}, got {weights!r}')
  if weights == 'params':
    return
  if not wrapped:
    raise CheckpointError(f'{path} is a params-only checkpoint (averaged or exported): it '
                          'holds one set of weights, read with --weights=params.')
  if not any(key.startswith(f'{weights}/') for key in saved):
    raise CheckpointError(f'{path} holds no moving average of the weights: its run trained '
                          'with config.opt.ema_decay=0. Use --weights=params, or train with '
                          'config.opt.ema_decay > 0.')


def checkpoint_path(workdir: str, checkpoint: str | None = None) -> str:
  """The directory named by `checkpoint`: None the latest step, digits a step, else a path."""
  directory = workdir_layout.checkpoints_dir(workdir)
  if checkpoint and not checkpoint.isdigit():
    if not os.path.isdir(checkpoint):
      raise CheckpointError(f'checkpoint directory {checkpoint} does not exist')
    return checkpoint
  steps = sorted(int(name) for name in (os.listdir(directory) if os.path.isdir(directory)
                                        else []) if name.isdigit())
  if not steps:
    raise CheckpointError(f'no checkpoint in {directory}: train first, or pass a checkpoint '
                          'directory (e.g. an averaged one)')
  if checkpoint is None:
    return os.path.join(directory, str(steps[-1]))
  if int(checkpoint) not in steps:
    raise CheckpointError(f'no checkpoint of step {checkpoint} in {directory}; it holds '
                          f'steps {steps}')
  return os.path.join(directory, str(int(checkpoint)))


def restore_params(workdir: str, abstract_params, checkpoint: str | None = None,
                   weights: str = 'params'):
  """Params only, for translate/evaluate: latest step (None), a step ('1000') or a path;
  `weights`='ema' reads their moving average instead (`load_params`).

  Without an explicit checkpoint a damaged latest step is skipped with a warning.
  """
  path = checkpoint_path(workdir, checkpoint)
  if checkpoint is not None:
    return load_params(path, abstract_params, weights)
  steps = sorted((int(n) for n in os.listdir(os.path.dirname(path)) if n.isdigit()),
                 reverse=True)
  for step in steps:
    path = os.path.join(os.path.dirname(path), str(step))
    params, error = read_or_describe(lambda: load_params(path, abstract_params, weights))  # pylint: disable=cell-var-from-loop
    if error is None:
      return params
    logging.warning('Checkpoint %s is damaged (%s); trying the previous one.', path, error)
  raise CheckpointError(f'every checkpoint in {os.path.dirname(path)} is damaged')


def average(trees: list):
  """Elementwise mean of parameter trees (numpy or jax), summed in float32, in the first
  tree's dtypes."""
  if not trees:
    raise ValueError('no checkpoints to average')
  total = jax.tree.map(lambda x: x.astype(np.float32), trees[0])
  for tree in trees[1:]:
    total = jax.tree.map(lambda t, x: t + x.astype(np.float32), total, tree)
  return jax.tree.map(lambda t, x: (t / np.float32(len(trees))).astype(x.dtype), total,
                      trees[0])


def cast(params, dtype: str):
  """Floating-point leaves cast to `dtype` ('float32' or 'bfloat16'); others unchanged."""
  target = jax.numpy.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(target) if jax.numpy.issubdtype(
      x.dtype, jax.numpy.floating) else x, params)


def arrays_handler() -> ocp.PyTreeCheckpointHandler:
  """The orbax handler of an item of arrays (a training state, its dropout key, params).

  On CPU devices it writes each replicated array whole from one device. Orbax's default
  ("replica-parallel") may split an array replicated over several devices into slices, one per
  device, each writing its part: on accelerators that spreads the copies to the host over their
  links, but CPU devices share the host's memory, so there the split buys nothing, and each
  slice is a program compiled for its offset and device. On 8 CPU devices that made a tiny
  model's first save in a process take about 2 s instead of 0.05 s. Accelerators keep orbax's
  default. Either way the saved values are the same and both read back with either handler;
  the CPU handler keeps no per-array metadata file, which only typed PRNG keys would need (no
  item holds one: the dropout key is saved as its raw words).
  """
  if jax.default_backend() != 'cpu':
    return ocp.PyTreeCheckpointHandler()
  handlers = ocp.type_handlers
  return ocp.PyTreeCheckpointHandler(type_handler_registry=handlers.create_type_handler_registry(
      (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)),
      (np.ndarray, handlers.NumpyHandler()),
      *((kind, handlers.ScalarHandler()) for kind in (int, float, np.number))))


def arrays_restore(target) -> ocp.args.PyTreeRestore:
  """Restore arguments of an `arrays_handler` item into `target`: ShapeDtypeStructs with
  shardings (or jax.Arrays) come back as jax.Arrays of their shardings and dtypes; numpy arrays,
  and ShapeDtypeStructs without a sharding, as numpy arrays."""
  return ocp.args.PyTreeRestore(item=target,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def write_params(path: str, params, config_json: str, info: dict) -> str:
  """Writes a params-only checkpoint (items params, config, info) that load_params reads."""
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise CheckpointError(f'{path} already exists: remove it or choose another --output')
  handlers = {PARAMS: arrays_handler(), CONFIG: ocp.JsonCheckpointHandler(),
              INFO: ocp.JsonCheckpointHandler()}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as checkpointer:
    checkpointer.save(path, args=ocp.args.Composite(**{
        PARAMS: ocp.args.PyTreeSave(params),
        CONFIG: ocp.args.JsonSave({'config': config_json}),
        INFO: ocp.args.JsonSave(info)}))
  return path


def read_json_item(path: str, name: str) -> dict:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    return checkpointer.restore(path, args=ocp.args.Composite(**{
        name: ocp.args.JsonRestore()}))[name]
