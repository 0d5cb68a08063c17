"""A prediction of a compiled step's time on a target, from a roofline of its kernels.

Each kernel takes the longer of its FLOPs at the device's peak for its dtype and its memory
traffic at the memory bandwidth; the kernels run one after another; each collective moves its
bytes (ring algorithms) at the interconnect's bandwidth, or the network's when its devices
span several slices or hosts, one collective at a time. A collective the program waits for at
once runs in series with the kernels; an asynchronous one (XLA's start and done pair) runs
beside the kernels the compiler scheduled between its start and its done, and only the part
that outlasts them adds to the step. Everything a roofline leaves out makes a real step
slower: kernel launch and dispatch gaps, kernels that reach neither peak, collectives'
latency, and on GPUs the streaming multiprocessors that a collective's kernels take from the
kernels it overlaps. It is a prediction, labelled as one, and docs/accelerators.md compares it
with the steps measured.
"""

import dataclasses

from t2t_jax.compile import hlo_cost
from t2t_jax.compile import targets
from t2t_jax.model import flops as flops_lib

_DTYPE_NAMES = {'bf16': 'bfloat16', 'f16': 'float16', 'f32': 'float32', 'f64': 'float32',
                's8': 'bfloat16', 'u8': 'bfloat16', 'f8e4m3fn': 'bfloat16', 'f8e5m2': 'bfloat16'}


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Seconds of one step on one device, by where the time goes."""
  compute_seconds: float  # The kernels' FLOPs at peak, alone.
  memory_seconds: float  # Their memory traffic at full bandwidth, alone.
  kernel_seconds: float  # Sum over kernels of the longer of the two.
  collective_seconds: float  # Collectives' bytes over the links they cross.
  network_collective_seconds: float  # The part of that over the slow network.
  # The part of collective_seconds that runs beside kernels (asynchronous collectives).
  overlapped_collective_seconds: float = 0.0

  @property
  def step_seconds(self) -> float:
    return self.kernel_seconds + self.collective_seconds - self.overlapped_collective_seconds

  @property
  def bound(self) -> str:
    """What most of the predicted time goes to: 'compute', 'memory' or 'collectives'."""
    shares = {'compute': self.compute_seconds, 'memory': self.memory_seconds,
              'collectives': self.collective_seconds}
    return max(shares, key=shares.get)

  def as_dict(self) -> dict:
    return {**{k: float(f'{v:.4g}') for k, v in dataclasses.asdict(self).items()},
            'step_seconds': float(f'{self.step_seconds:.4g}'), 'bound': self.bound}


def peak(chip: targets.Chip, dtype: str) -> float:
  """Dense peak FLOP/s of the chip for an HLO dtype ('bf16', 'f32', ...)."""
  table = flops_lib.PEAK_FLOPS[chip.family]
  return table.get(_DTYPE_NAMES.get(dtype, 'float32'), table['float32'])


def predict(cost: hlo_cost.ProgramCost, target: targets.Target,
            granule_of_device: list[int]) -> Prediction:
  """The roofline of a compiled step; `granule_of_device[i]`: the slice or host of the
  program's i-th device."""
  chip = target.chip
  compute = memory = 0.0
  timed = []  # Each kernel's seconds per step, all its runs.
  for kernel in cost.kernels:
    flop_seconds = kernel.flops / peak(chip, kernel.dtype) if kernel.flops else 0.0
    byte_seconds = kernel.hbm_bytes / chip.memory_bandwidth
    compute += flop_seconds * kernel.count
    memory += byte_seconds * kernel.count
    timed.append(max(flop_seconds, byte_seconds) * kernel.count)
  kernels = sum(timed)
  collectives = network = 0.0
  collective_seconds = []
  for collective in cost.collectives:
    slow = bool(collective.slices) or any(
        len({granule_of_device[i] for i in group if i < len(granule_of_device)}) > 1
        for group in collective.groups)
    bandwidth = chip.network_bandwidth if slow else chip.interconnect_bandwidth
    seconds = collective.wire_bytes * collective.count / bandwidth
    collective_seconds.append(seconds)
    collectives += seconds
    network += seconds if slow else 0.0
  overlapped = 0.0
  if cost.schedule is not None and collectives:
    overlapped = max(0.0, kernels + collectives - _scheduled_seconds(
        cost.schedule, timed, collective_seconds))
  return Prediction(compute, memory, kernels, collectives, network, overlapped)


def _scheduled_seconds(schedule: list[tuple], kernel_seconds_: list[float],
                       collective_seconds: list[float]) -> float:
  """The step's seconds in schedule order: the kernels on one stream; collectives one at a
  time on the links, each starting when both the kernels before it and the collective before
  it are done; a done waits for its collective."""
  now = links = 0.0  # When the kernels' stream and the links are next free.
  ends = {}
  for event in schedule:
    if event[0] == 'kernel':
      now += kernel_seconds_[event[1]]
    elif event[0] == 'collective':
      now = links = max(now, links) + collective_seconds[event[1]]
    elif event[0] == 'start':
      links = max(now, links) + collective_seconds[event[1]]
      ends[event[2]] = links
    elif event[0] == 'done':
      now = max(now, ends.pop(event[1], now))
  return max(now, links)


def kernel_seconds(kernel: hlo_cost.Kernel, chip: targets.Chip) -> float:
  """One run of a kernel on the roofline: the longer of its FLOPs at peak and its bytes."""
  flop_seconds = kernel.flops / peak(chip, kernel.dtype) if kernel.flops else 0.0
  return max(flop_seconds, kernel.hbm_bytes / chip.memory_bandwidth)


def by_part(cost: hlo_cost.ProgramCost, target: targets.Target,
            prediction: Prediction | None = None) -> dict[str, dict]:
  """{part: HBM bytes, FLOPs, kernel launches and predicted kernel seconds per step} for the
  parts of hlo_cost.PARTS that have kernels, and 'collectives' (the bytes of their operands;
  seconds from `prediction`) where the program has any.

  A kernel's bytes go to the parts that read or wrote them (Kernel.bytes_by_part); its FLOPs
  and launches to its own part (its largest matmul's); its time, where its bytes bound it, is
  shared as its bytes are, else is its own part's."""
  table = {}

  def row(part):
    return table.setdefault(part, {'hbm_bytes': 0.0, 'flops': 0.0, 'kernels': 0,
                                   'seconds': 0.0})
  for kernel in cost.kernels:
    seconds = kernel_seconds(kernel, target.chip) * kernel.count
    memory_bound = kernel.hbm_bytes / target.chip.memory_bandwidth * kernel.count >= seconds
    main = row(kernel.part)  # Its matmul's part: its FLOPs, its launches, a compute-bound time.
    main['flops'] += kernel.flops * kernel.count
    main['kernels'] += kernel.count
    if not memory_bound or not kernel.hbm_bytes:
      main['seconds'] += seconds
    for part, size in kernel.bytes_by_part().items():
      row(part)['hbm_bytes'] += size * kernel.count
      if memory_bound and kernel.hbm_bytes:  # Its time shared as its bytes are.
        row(part)['seconds'] += seconds * size / kernel.hbm_bytes
  ordered = {part: table[part] for part in hlo_cost.PARTS if part in table}
  if cost.collectives:
    ordered['collectives'] = {
        'hbm_bytes': sum(c.operand_bytes * c.count for c in cost.collectives), 'flops': 0.0,
        'kernels': sum(c.count for c in cost.collectives),
        'seconds': prediction.collective_seconds if prediction else 0.0}
  return {part: {key: (value if key == 'kernels' else float(f'{value:.4g}'))
                 for key, value in row.items()} for part, row in ordered.items()}


def heaviest(cost: hlo_cost.ProgramCost, target: targets.Target, n: int = 10) -> list[dict]:
  """The `n` kernels with the most predicted time per step (all their runs), heaviest first."""
  timed = sorted(cost.kernels, key=lambda k: -kernel_seconds(k, target.chip) * k.count)
  return [{'kernel': k.name, 'opcode': k.opcode, 'part': k.part, 'runs': k.count,
           'seconds': float(f'{kernel_seconds(k, target.chip) * k.count:.4g}'),
           'hbm_bytes': k.hbm_bytes * k.count, 'flops': k.flops * k.count,
           'op_name': k.op_name} for k in timed[:n]]


def throughput(prediction: Prediction, target_tokens: int, model_flops: float,
               target: targets.Target, dtype) -> dict:
  """Tokens/s and MFU that the predicted step time implies for the whole target."""
  seconds = prediction.step_seconds
  peak_all = flops_lib.PEAK_FLOPS[target.chip.family].get(
      _DTYPE_NAMES.get(str(dtype), str(dtype)), None)
  if peak_all is None:
    peak_all = flops_lib.PEAK_FLOPS[target.chip.family]['float32']
  return {'target_tokens_per_second': round(target_tokens / seconds) if seconds else None,
          'mfu': round(model_flops / seconds / (peak_all * target.num_devices), 4)
                 if seconds else None}
