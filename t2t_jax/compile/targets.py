"""Named accelerator targets that a dry run compiles for without the hardware: TPU slices and
GPU hosts, their compile-only devices from JAX's topology API, and the published figures of
each chip that a prediction needs (memory, memory bandwidth, interconnect bandwidth).

  tpu:v5e-8      one slice of 8 v5e chips (v5e and v6e count chips; v4 and v5p count
                 TensorCores, two per chip: tpu:v4-8 is 4 chips)
  tpu:2xv5e-16   two slices of 16, joined by the data-centre network (DCN)
  gpu:h100x8     one host of 8 H100 SXM; gpu:4xh100x8 four such hosts
"""

import dataclasses
import functools
import math
import os
import re

from t2t_jax import ConfigError
from t2t_jax.model import flops

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One device's published figures. Bandwidths are per device and one direction, bytes/s."""
  family: str  # The flops.PEAK_FLOPS key, for the peak FLOP/s.
  platform: str  # 'tpu' or 'gpu'.
  memory_bytes: int  # HBM per device.
  memory_bandwidth: float  # HBM bytes/s.
  interconnect_bandwidth: float  # ICI (TPU) or NVLink (GPU): half the bidirectional figure.
  network_bandwidth: float  # Between slices (DCN) or hosts (InfiniBand), per device.
  per_host: int  # Devices per host (TPU: chips a host drives; GPU: the host's GPUs).
  # The share of the memory a JAX program may use: on GPUs JAX preallocates 75% by default
  # (XLA_PYTHON_CLIENT_MEM_FRACTION); a TPU program gets the whole HBM.
  usable_fraction: float = 1.0
  tpu_name: str = ''  # TPU: the topology API's name ('v5e') and the accelerator type's prefix.
  accelerator_type: str = ''  # TPU: the runtime's name of the chip ('v5litepod').
  cores_per_chip: int = 1  # TPU: TensorCores a slice name counts per device (megacore: 2).
  gpu: dict | None = None  # GPU: the device description XLA's GPU compiler targets.


def _nvidia(family: str, name: str, memory_bytes: int, memory_gb_s: float, nvlink_gb_s: float,
            network_gb_s: float, capability: tuple[int, int], cores: int, clock_ghz: float,
            l2_mib: int, fpus_per_core: int = 128, shared_kib: int = 228) -> Chip:
  """An NVIDIA GPU in a host of 8: NVLink within the host, InfiniBand out of it; JAX takes 75%
  of its memory. `shared_kib`: shared memory per SM (a block may opt in to 1 KiB less)."""
  return Chip(family, 'gpu', memory_bytes, memory_gb_s * GB, nvlink_gb_s * GB, network_gb_s * GB,
              8, 0.75, gpu=dict(name=name, capability=capability, cores=cores,
                                fpus_per_core=fpus_per_core, clock_ghz=clock_ghz,
                                l2_bytes=l2_mib * 2**20, shared_per_core=shared_kib * 2**10,
                                shared_optin=(shared_kib - 1) * 2**10))


# Sources: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} (peak, HBM, ICI, host NICs); NVIDIA's
# H100, H200, A100 and HGX B200 datasheets (HBM, NVLink); 400 Gb/s (A100: 200 Gb/s)
# InfiniBand per GPU as in DGX systems. ICI one way is half Cloud's bidirectional figure per
# chip (v5e 400, v5p 1200, v6e 800 GB/s), which is also each pod's all-reduce bandwidth over
# its chips (v5e 51.2 TB/s / 256, v6e 102.4 TB/s / 256); v4's table gives only the latter,
# 1.1 PB/s over 4096 chips. TPU DCN: 2 x 100 Gb/s NICs per v5e host (the same per host is
# assumed for v4 and v6e); v5p: 50 Gb/s per chip.
_TPU_DCN_PER_HOST = 25 * GB
CHIPS = {
    'v4': Chip('tpu_v4', 'tpu', 32 * 2**30, 1200 * GB, 1.1e15 / 4096, _TPU_DCN_PER_HOST / 4, 4,
               tpu_name='v4', accelerator_type='v4', cores_per_chip=2),
    'v5e': Chip('tpu_v5e', 'tpu', 16 * 2**30, 819 * GB, 200 * GB, _TPU_DCN_PER_HOST / 8, 8,
                tpu_name='v5e', accelerator_type='v5litepod'),
    'v5p': Chip('tpu_v5p', 'tpu', 95 * 2**30, 2765 * GB, 600 * GB, 50e9 / 8, 4,
                tpu_name='v5p', accelerator_type='v5p', cores_per_chip=2),
    'v6e': Chip('tpu_v6e', 'tpu', 32 * GB, 1640 * GB, 400 * GB, _TPU_DCN_PER_HOST / 8, 8,
                tpu_name='v6e', accelerator_type='v6e'),
    'a100': _nvidia('a100', 'NVIDIA A100-SXM4-80GB', 85_100_068_864, 2039, 300, 25, (8, 0),
                    cores=108, clock_ghz=1.41, l2_mib=40, fpus_per_core=64, shared_kib=164),
    'h100': _nvidia('h100_sxm', 'NVIDIA H100 80GB HBM3', 84_978_434_048, 3352, 450, 50, (9, 0),
                    cores=132, clock_ghz=1.98, l2_mib=50),
    'h200': _nvidia('h200', 'NVIDIA H200', 150_754_820_096, 4800, 450, 50, (9, 0), cores=132,
                    clock_ghz=1.98, l2_mib=50),
    'b200': _nvidia('b200', 'NVIDIA B200', 191_514_673_152, 8000, 900, 50, (10, 0), cores=148,
                    clock_ghz=1.965, l2_mib=126),
}
# The cuDNN version the compiler is told the GPUs have: the oldest jax-cuda12-plugin accepts.
CUDNN_VERSION = (9, 8)

_TPU_NAME = re.compile(r'^tpu:(?:(\d+)x)?(v\d+[a-z]?)-(\d+)$')
_GPU_NAME = re.compile(r'^gpu:(?:(\d+)x)?([a-z]\d+)x(\d+)$')
EXAMPLES = ('tpu:v5e-8', 'tpu:v4-8', 'tpu:v5p-8', 'tpu:v6e-8', 'tpu:2xv5e-16', 'gpu:h100x8',
            'gpu:h200x8', 'gpu:a100x8', 'gpu:b200x8', 'gpu:4xh100x8')


@dataclasses.dataclass(frozen=True)
class Target:
  """A named slice or set of GPU hosts: `slices` groups of `per_slice` devices."""
  name: str
  chip_name: str
  chip: Chip
  per_slice: int  # Devices in one slice (TPU) or one host (GPU).
  slices: int  # TPU slices, or GPU hosts, joined by the slower network.

  @property
  def platform(self) -> str:
    return self.chip.platform

  @property
  def num_devices(self) -> int:
    return self.per_slice * self.slices

  @property
  def usable_memory_bytes(self) -> int:
    return int(self.chip.memory_bytes * self.chip.usable_fraction)


def parse(name: str) -> Target:
  """The Target of a name such as 'tpu:v5e-8' or 'gpu:2xh100x8'; ConfigError otherwise."""
  tpu, gpu = _TPU_NAME.match(name), _GPU_NAME.match(name)
  match = tpu or gpu
  chip_name = match.group(2) if match else ''
  chip = CHIPS.get(chip_name)
  if chip is None or chip.platform != ('tpu' if tpu else 'gpu'):
    known = ', '.join(f'{c.platform}:{n}' for n, c in CHIPS.items())
    raise ConfigError(f'--dry_run_target={name!r} is not a target t2t_jax knows: use '
                      f'tpu:<chip>-<size> or gpu:<chip>x<count>, with an optional N x for '
                      f'several slices or hosts, for the chips {known} (e.g. '
                      f'{", ".join(EXAMPLES[:6])})')
  slices, size = int(match.group(1) or 1), int(match.group(3))
  if slices < 1 or size < 1:
    raise ConfigError(f'--dry_run_target={name!r}: sizes must be positive')
  per_slice = size // chip.cores_per_chip if tpu else size
  if tpu and size % chip.cores_per_chip:
    raise ConfigError(f'--dry_run_target={name!r}: a {chip_name} slice\'s size counts its '
                      f'TensorCores, {chip.cores_per_chip} a chip, so it is even')
  if tpu:
    _tpu_grid(name, chip, per_slice, size)  # Refuses sizes no slice has.
  elif size > chip.per_host:
    raise ConfigError(f'--dry_run_target={name!r}: a host has at most {chip.per_host} '
                      f'{chip_name} GPUs; ask for several hosts as gpu:<hosts>x{chip_name}x'
                      f'{chip.per_host}')
  return Target(name, chip_name, chip, per_slice, slices)


# Chips in the largest single slice (a v4 pod; v5p's largest job; v5e and v6e pods).
_LARGEST_SLICE = {'v4': 4096, 'v5e': 256, 'v5p': 6144, 'v6e': 256}


def _tpu_grid(name: str, chip: Chip, chips: int, size: int) -> tuple[int, ...]:
  """The chip grid of a slice of `chips` chips: 2D for v5e/v6e, 3D for v4/v5p."""
  if chips < 1 or chips & (chips - 1):
    counting = ' (the size counts 2 TensorCores a chip)' if chip.cores_per_chip > 1 else ''
    raise ConfigError(f'--dry_run_target={name!r}: a {chip.tpu_name} slice has a power of two '
                      f'chips{counting}, and {size} gives {chips}')
  largest = _LARGEST_SLICE[chip.tpu_name]
  if chips > largest:
    raise ConfigError(f'--dry_run_target={name!r}: a {chip.tpu_name} slice has at most '
                      f'{largest} chips (Cloud TPU); ask for several slices as '
                      f'tpu:<slices>x{chip.tpu_name}-<size>')
  dims = [1, 1] if chip.cores_per_chip == 1 else [1, 1, 1]
  if chip.cores_per_chip > 1 and chips >= 4:
    dims = [2, 2, 1]
    chips //= 4
  axis = 0 if chip.cores_per_chip == 1 else 2
  while chips > 1:
    dims[axis % len(dims)] *= 2
    chips //= 2
    axis += 1
  if len(dims) == 2:
    return tuple(sorted(dims))  # Cloud's names: 2x2, 2x4, 4x8, ...
  # 3D as Cloud names them: ascending, a flat slice's 1 last (2x2x1, 2x2x4, 2x4x4, 4x4x8).
  return tuple(sorted(d for d in dims if d > 1)) + (1,) * dims.count(1)


def of_device(device) -> Target | None:
  """The one-device Target of a real device (`jax.Device`), to predict a program that runs on
  it beside its measurement; None where its kind is not one of CHIPS (a CPU)."""
  family = flops.device_family(device.device_kind)
  name = next((n for n, chip in CHIPS.items() if chip.family == family), None) if family else None
  if name is None:
    return None
  chip = CHIPS[name]
  return Target(f'gpu:{name}x1' if chip.platform == 'gpu' else
                f'tpu:{name}-{chip.cores_per_chip}', name, chip, 1, 1)


def devices(target: Target) -> list:
  """The target's devices, compile-only: no TPU or GPU is opened, none needs to be here."""
  if target.platform == 'tpu':
    return _tpu_devices(target.chip_name, target.per_slice, target.slices)
  return _gpu_devices(target.chip_name, target.per_slice, target.slices)


@functools.cache
def _tpu_devices(chip_name: str, chips: int, slices: int) -> list:
  chip = CHIPS[chip_name]
  prepare_libtpu(f'{chip.accelerator_type}-{chips * chip.cores_per_chip}')
  grid = _tpu_grid(f'tpu:{chip_name}', chip, chips, chips * chip.cores_per_chip)
  host = (2, 2, 1) if chip.per_host == 4 else (2, 4, 1)
  host = tuple(min(h, g) for h, g in zip(host, grid + (1,) * (3 - len(grid))))
  return _compile_only_devices(
      f'tpu:{chip_name}', 'libtpu (the TPU compiler, which runs on a CPU)', 'tpu', platform='tpu',
      topology_name=f'{chip.tpu_name}:{"x".join(map(str, grid))}',
      chip_config_name='megacore' if chip.cores_per_chip > 1 else 'default',
      chips_per_host_bounds=host, num_slices=slices, wrap=(False, False, False))


def _compile_only_devices(what: str, needed: str, extra: str, **topology) -> list:
  """The devices of `jax.experimental.topologies.get_topology_desc(**topology)`; a missing
  compiler is one ConfigError saying which extra installs it."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return list(topologies.get_topology_desc(**topology).devices)
  except (NotImplementedError, RuntimeError) as e:
    if any(sign in str(e) for sign in ('not installed', 'topology not implemented',
                                       'Unknown backend')):
      raise ConfigError(f'compiling for {what} needs {needed}, which is not installed here: '
                        f"pip install -e '.[{extra}]' (no accelerator is needed)") from None
    raise


def prepare_libtpu(accelerator_type: str) -> None:
  """Tells libtpu, before it loads, that this process only compiles.

  Without a TPU VM's metadata server libtpu cannot learn the accelerator type or the worker
  hosts and says so; for compiling these facts come from the topology asked for, so they
  are set to this one slice and this host where the environment leaves them unset. libtpu
  also takes a lock file against a second process using the same TPUs; there are none here,
  so several compiling processes (parallel test workers) may load it.
  """
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator_type)
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', 'true')


@functools.cache
def _gpu_devices(chip_name: str, per_host: int, hosts: int) -> list:
  return _compile_only_devices(
      f'gpu:{chip_name}', "JAX's CUDA plugin (XLA's GPU compiler)", 'gpu-compile', platform='cuda',
      target_config=gpu_target_config(CHIPS[chip_name]), topology=f'1x{hosts}x{per_host}')


def gpu_target_config(chip: Chip) -> str:
  """The GPU as XLA's GPU compiler takes a target it cannot query: a GpuTargetConfigProto in
  text form, written from the chip's published figures."""
  gpu = chip.gpu
  major, minor = gpu['capability']
  fields = {
      'threads_per_block_limit': 1024, 'threads_per_warp': 32,
      'shared_memory_per_block': 48 * 2**10, 'shared_memory_per_core': gpu['shared_per_core'],
      'threads_per_core_limit': 2048, 'core_count': gpu['cores'],
      'fpus_per_core': gpu['fpus_per_core'], 'block_dim_limit_x': 2**31 - 1,
      'block_dim_limit_y': 65535, 'block_dim_limit_z': 65535,
      'memory_bandwidth': int(chip.memory_bandwidth), 'l2_cache_size': gpu['l2_bytes'],
      'clock_rate_ghz': gpu['clock_ghz'], 'device_memory_size': chip.memory_bytes,
      'shared_memory_per_block_optin': gpu['shared_optin'],
      'registers_per_core_limit': 65536, 'registers_per_block_limit': 65536,
  }
  info = ' '.join(f'{key}: {value}' for key, value in fields.items())
  return (f'gpu_device_info {{ {info} cuda_compute_capability {{ major: {major} minor: {minor} '
          f'}} }} platform_name: "CUDA" dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: '
          f'{CUDNN_VERSION[1]} }} device_description_str: "{gpu["name"]}"')


def granule_of(target: Target, devices_list) -> dict[int, int]:
  """Device id -> its slice (TPU) or host (GPU): devices in different ones talk over the slow
  network."""
  if target.platform == 'tpu':
    return {d.id: getattr(d, 'slice_index', 0) or 0 for d in devices_list}
  return {d.id: d.process_index for d in devices_list}


def describe(target: Target) -> str:
  """One line for logs and tables: '8 x TPU v5e (1 slice of 8)'."""
  unit = 'slice' if target.platform == 'tpu' else 'host'
  return (f'{target.num_devices} x {target.chip_name} ({target.slices} {unit}'
          f'{"s" if target.slices > 1 else ""} of {target.per_slice})')


def hosts(target: Target) -> int:
  """Processes a real run on the target would have: one per host."""
  return target.slices * math.ceil(target.per_slice / target.chip.per_host)
