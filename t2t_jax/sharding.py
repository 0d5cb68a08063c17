"""The device mesh, logical-axis rules, shardings of state and batches, multi-host start-up."""

import contextlib
import glob
import math
import os
import sys
import threading

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import exit_codes

MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')
# The devices of the expert axis hold different experts of a mixture-of-experts layer and
# split the batch of everything else (GShard), so the batch spreads over them too.
BATCH_AXES = ('data', 'fsdp', 'expert')


def mesh_shape(shape, device_count: int) -> tuple[int, ...]:
  """Resolves one -1 in `shape` from the device count; refuses shapes that do not fit.

  Three sizes are (data, fsdp, tensor) with no expert parallelism, as before the expert axis.
  """
  given = tuple(int(n) for n in shape)  # As written, for the messages.
  shape = given + (1,) if len(given) == len(MESH_AXES) - 1 else given
  if len(shape) != len(MESH_AXES) or shape.count(-1) > 1 or any(
      n == 0 or n < -1 for n in shape):
    raise ConfigError(f'config.mesh.shape={given} must give {len(MESH_AXES)} sizes for '
                      f'{MESH_AXES} (or 3, without expert), positive or a single -1')
  known = math.prod(n for n in shape if n != -1)
  if device_count % known:
    raise ConfigError(f'config.mesh.shape={given} needs a multiple of {known} devices, '
                      f'but there are {device_count}')
  shape = tuple(device_count // known if n == -1 else n for n in shape)
  if math.prod(shape) != device_count:
    raise ConfigError(f'config.mesh.shape={shape} covers {math.prod(shape)} devices, but there '
                      f'are {device_count}; use -1 on one axis to take the rest')
  return shape


def make_mesh(mesh_config, devices=None) -> Mesh:
  """The ('data', 'fsdp', 'tensor', 'expert') mesh; with `dcn_data` > 1 data spans slices."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config.shape, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = mesh_config.dcn_data
  tpu_slices = (len({getattr(d, 'slice_index', 0) for d in devices})
                if devices[0].platform == 'tpu' else 1)
  if slices == 1 and tpu_slices > 1:
    raise ConfigError(f'the devices form {tpu_slices} TPU slices, joined by the data-centre '
                      f'network: set config.mesh.dcn_data={tpu_slices} so that only the data '
                      'axis crosses them')
  if slices == 1:
    return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=axis_types)
  if slices < 1 or shape[0] % slices:
    raise ConfigError(f'config.mesh.dcn_data={slices} must be a positive divisor of the data '
                      f'axis size {shape[0]} (config.mesh.shape={tuple(mesh_config.shape)})')
  # Slices talk over the data-centre network (DCN), so only the data axis crosses them: each
  # slice holds a full (data/slices, fsdp, tensor, expert) sub-mesh on its fast interconnect. TPU
  # devices know their slice; elsewhere (GPU hosts) each process counts as one slice.
  per_slice = (shape[0] // slices,) + shape[1:]
  by_process = devices[0].platform != 'tpu'
  granules = len({d.process_index for d in devices} if by_process
                 else {d.slice_index for d in devices})
  if granules != slices:
    raise ConfigError(f'config.mesh.dcn_data={slices} slices were asked for, but the devices '
                      f'form {granules} ({"processes" if by_process else "TPU slices"}); set '
                      f'config.mesh.dcn_data={granules}' + (' or 1' if granules > 1 else ''))
  grid = mesh_utils.create_hybrid_device_mesh(per_slice, (slices, 1, 1, 1), devices,
                                              process_is_granule=by_process)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def rules(mesh_config) -> tuple[tuple[str, object], ...]:
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
               for name, axes in mesh_config.rules)


def batch_shards(mesh: Mesh) -> int:
  """How many ways the batch dimension is split."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def logical_shardings(abstract_boxed_tree, mesh: Mesh, axis_rules):
  """NamedShardings for a tree whose leaves carry logical axis names (unnamed: replicated)."""
  specs = nn.get_partition_spec(abstract_boxed_tree)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, axis_rules)
  is_boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)
  shapes = jax.tree.map(lambda x: x.value if is_boxed(x) else x, abstract_boxed_tree,
                        is_leaf=is_boxed)
  jax.tree_util.tree_map_with_path(_check_divisible, shapes, specs, shardings)
  return shardings


def split_over_data(shardings, shapes, mesh: Mesh):
  """`shardings` with each array's first dimension that still splits evenly also split over
  'data', after the axes that split it already (arrays split over 'data' already, scalars and
  arrays no dimension of which splits: unchanged). What mesh.shard_update gives the
  optimiser's moments and the moving average.

  The first dimension, not the largest: gathering the updated parameters back along it needs
  no transposing copy on a TPU, whose arrays are laid out with the first dimension major.
  """
  ways = mesh.shape['data']

  def split(named_sharding, shape):
    spec = tuple(named_sharding.spec) + (None,) * (len(shape.shape) - len(named_sharding.spec))
    axes = [(entry,) if isinstance(entry, str) else tuple(entry or ()) for entry in spec]
    if ways == 1 or any('data' in dim for dim in axes):
      return named_sharding
    splits = [d for d, size in enumerate(shape.shape)
              if size % (math.prod(mesh.shape[a] for a in axes[d]) * ways) == 0]
    if not splits:
      return named_sharding
    dim = splits[0]
    spec = spec[:dim] + (axes[dim] + ('data',),) + spec[dim + 1:]
    return NamedSharding(mesh, P(*spec))

  return jax.tree.map(split, shardings, shapes)


def _check_divisible(path, leaf, logical_spec, named_sharding) -> None:
  """Refuses a weight whose size along a sharded dimension does not split evenly."""
  for dim, (size, axes) in enumerate(zip(leaf.shape, named_sharding.spec)):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    ways = math.prod(named_sharding.mesh.shape[axis] for axis in axes)
    if size % ways:
      raise ConfigError(
          f'{jax.tree_util.keystr(path)} of shape {leaf.shape}: dimension {dim} (logical axis '
          f'{logical_spec[dim]!r}) has size {size}, which does not split {ways} ways over mesh '
          f'axes {axes}. Make the size a multiple of {ways} (e.g. config.data.vocab_size), or '
          'change config.mesh.shape or config.mesh.rules.')


def check_batch_rows(rows: int, mesh: Mesh, accumulation: int = 1, what: str = 'batch') -> None:
  """Refuses a batch whose rows do not split evenly over the batch shards (x micro-batches)."""
  multiple = batch_shards(mesh) * accumulation
  if rows % multiple:
    parts = [f'{axis}={mesh.shape[axis]}' for axis in BATCH_AXES if mesh.shape[axis] > 1]
    if accumulation > 1:
      parts.append(f'config.opt.grad_accum_steps={accumulation}')
    split = ' x '.join(parts)
    raise ConfigError(f'the {what} has {rows} rows, which do not divide into {multiple} equal '
                      f'parts ({split}); use a row count that is a multiple of {multiple}')


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh,
                 whole: bool = False) -> dict[str, jax.Array]:
  """One global array per field, split over the batch axes.

  By default each process passes its own contiguous block of rows (process p the p-th of
  `jax.process_count()` blocks), as the batch plans collate them; with `whole=True` every
  process passes the whole global batch and places only the rows its devices hold.
  """
  sharding = batch_sharding(mesh)
  arrays = {}
  for key, value in batch.items():
    rows = value.shape[0] * (1 if whole else jax.process_count())
    check_batch_rows(rows, mesh, what=f'batch field {key!r}')
    arrays[key] = jax.make_array_from_process_local_data(sharding, value,
                                                         (rows,) + value.shape[1:])
  return arrays


@contextlib.contextmanager
def mesh_context(mesh: Mesh, axis_rules):
  """Mesh and logical-axis rules visible to the model's sharding annotations while tracing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
    yield


# Multi-host start-up.

def _on_multi_task_slurm() -> bool:
  return 'SLURM_JOB_ID' in os.environ and int(os.environ.get('SLURM_NTASKS', '1')) > 1


def _on_tpu_vm() -> bool:
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def initialize_distributed(coordinator_address: str = '', num_processes: int = 0,
                           process_id: int = -1, timeout_seconds: int = 300) -> bool:
  """Joins this process to a multi-process run; returns whether one was started.

  An explicit coordinator (flags, or T2T_COORDINATOR_ADDRESS / T2T_NUM_PROCESSES /
  T2T_PROCESS_ID) wins; otherwise TPU VMs and multi-task SLURM jobs are detected and JAX reads
  the topology from their environment; otherwise this is a single-process run. Must run
  before anything touches the devices.
  """
  coordinator_address = coordinator_address or os.environ.get('T2T_COORDINATOR_ADDRESS', '')
  num_processes = num_processes or int(os.environ.get('T2T_NUM_PROCESSES', '0'))
  if process_id < 0:
    process_id = int(os.environ.get('T2T_PROCESS_ID', '-1'))
  if coordinator_address:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ConfigError(f'--coordinator_address={coordinator_address} needs --num_processes >= 1 '
                        f'and 0 <= --process_id < num_processes, got {num_processes} and '
                        f'{process_id}')
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
    where = f'the coordinator {coordinator_address} (process {process_id} of {num_processes})'
  elif _on_multi_task_slurm() or _on_tpu_vm():
    kwargs, where = {}, 'the coordinator detected from the SLURM/TPU environment'
  else:
    return False
  # CPU devices of different processes need a collectives backend to talk to each other.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  message = (f'could not join {where} within --distributed_timeout={timeout_seconds} s: a peer '
             'never joined. Start every process with the same --coordinator_address and '
             '--num_processes and its own --process_id, and check that the coordinator is '
             'reachable from every host.')
  logging.info('Waiting up to %d s for all processes to join %s', timeout_seconds, where)
  # JAX aborts the process from C++ when the deadline passes; say why first, in plain words.
  watchdog = threading.Timer(timeout_seconds, _exit_with, (message,))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(initialization_timeout=timeout_seconds, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f'{message} ({type(e).__name__}: {e})') from None
  finally:
    watchdog.cancel()
  logging.info('Process %d of %d joined %s; %d local / %d global devices', jax.process_index(),
               jax.process_count(), where, jax.local_device_count(), jax.device_count())
  return True


def _exit_with(message: str) -> None:
  logging.error(message)
  print(f'error: {message}', file=sys.stderr, flush=True)
  os._exit(exit_codes.USAGE)  # pylint: disable=protected-access


def shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (or arrays)."""
  return sum(jax.numpy.dtype(leaf.dtype).itemsize * math.prod(
      leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape)
             for leaf in jax.tree.leaves(tree))
