"""The device mesh, logical-axis rules, and the shardings of state and batches."""

import contextlib
import math

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')


def mesh_shape(shape, device_count: int) -> tuple[int, ...]:
  """Resolves one -1 in `shape` from the device count; refuses shapes that do not fit."""
  shape = tuple(int(n) for n in shape)
  if len(shape) != len(MESH_AXES) or shape.count(-1) > 1 or any(
      n == 0 or n < -1 for n in shape):
    raise ValueError(f'config.mesh.shape={shape} must give {len(MESH_AXES)} sizes for '
                     f'{MESH_AXES}, positive or a single -1')
  known = math.prod(n for n in shape if n != -1)
  if device_count % known:
    raise ValueError(f'config.mesh.shape={shape} needs a multiple of {known} devices, '
                     f'but there are {device_count}')
  shape = tuple(device_count // known if n == -1 else n for n in shape)
  if math.prod(shape) != device_count:
    raise ValueError(f'config.mesh.shape={shape} covers {math.prod(shape)} devices, but there '
                     f'are {device_count}; use -1 on one axis to take the rest')
  return shape


def make_mesh(mesh_config, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config.shape, len(devices))
  return jax.make_mesh(shape, MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


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
  return nn.logical_to_mesh_sharding(specs, mesh, axis_rules)


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """One global array per field from this process's rows, split over the batch axes."""
  sharding = batch_sharding(mesh)
  return {key: jax.make_array_from_process_local_data(sharding, value)
          for key, value in batch.items()}


@contextlib.contextmanager
def mesh_context(mesh: Mesh, axis_rules):
  """Mesh and logical-axis rules visible to the model's sharding annotations while tracing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
    yield
