"""What a compiled program does per device, read from its optimised HLO text: each kernel's
FLOPs and memory traffic, and each collective with its bytes and its devices, with loops
counted as many times as they run.

XLA's own `cost_analysis()` counts a loop body once (a scanned stack of 6 layers as one layer)
and, on GPU targets without a GPU, is not available at all; the optimised HLO is the same
text on every backend. Counting:
  - a kernel is an instruction of the entry computation or of a computation it runs (loop
    bodies and conditions, calls, async wrappers); a fusion is one kernel, whatever it fuses;
  - its FLOPs are those of the dots and convolutions inside it (2 per multiply-add, only the
    taps of a convolution's window that meet real input), and of library calls (cuBLAS GEMMs)
    read from their dimension numbers and fused attention kernels from their shapes
    (kernel_flops.py);
  - its memory traffic is what it reads and writes in device memory (HBM): operands and
    results in memory space 0, a fused operand counted as the part of it the fusion's output
    needs (followed back through slices, reductions, casts and elementwise ops),
    a result written in place by a dynamic-update-slice counted as the update
    (fusion_bytes.py);
  - collectives (hlo_collectives.py) are found outside fusions and inside them (libtpu
    fuses a multi-chip program's collectives: an AsyncCollectiveStart fusion, compute
    fusions carrying the same channel, an AsyncCollectiveDone fusion), each counted once;
  - a loop runs its trip count: XLA's known_trip_count where the HLO has one, else the
    constant its condition compares the counter with (JAX's loops count from 0).
"""

import collections
import dataclasses
import re

from t2t_jax.compile import fusion_bytes
from t2t_jax.compile import hlo_collectives
from t2t_jax.compile import hlo_text
from t2t_jax.compile import kernel_flops

Collective = hlo_collectives.Collective
# Instructions that move no data themselves (the computations they run are counted instead).
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
         'add-dependency', 'opt-barrier', 'partition-id', 'replica-id', 'while', 'call',
         'conditional', 'async-start', 'async-update', 'async-done', 'domain'}
_FREE_CUSTOM_CALLS = ('Bitcast', 'AllocateBuffer', 'AssumeGatherIndicesInBound', 'Sharding',
                      'SPMDFullToShardShape', 'SPMDShardToFullShape', 'MoveToHost',
                      'MoveToDevice', 'Bitpacked')


# The parts of a train step that the bytes by part name, in the order tables list them.
PARTS = ('embedding', 'attention', 'feed-forward', 'layer norms', 'loss', 'optimiser', 'other')


def part_of(op_name: str) -> str:
  """The part of the model an instruction's metadata op_name says it came from: the first of
  the loss (its scope in training/step.py, or the output projection), the optimiser (its
  scope), layer norms, attention, feed-forward and embedding whose name a path segment holds.
  (A fused kernel is named by its largest matmul, else by the instruction it is rooted at:
  Kernel.op_name.)"""
  # 'jvp(loss)', 'transpose(jvp(Transformer.output_logits))': the name inside the transforms.
  segments = [re.sub(r'^(?:\w+\()+|\)+$', '', s) for s in op_name.lower().split('/')]
  tests = (('loss', lambda s: s == 'loss' or 'output_logits' in s or s == 'logits'),
           ('optimiser', lambda s: s == 'optimizer'),
           ('layer norms', lambda s: 'norm' in s and 'normal' not in s),
           ('attention', lambda s: 'attention' in s),
           ('feed-forward', lambda s: 'ffn' in s or 'mlp' in s or 'moe' in s or 'expert' in s),
           ('embedding', lambda s: 'embed' in s))
  for part, test in tests:
    if any(test(segment) for segment in segments):
      return part
  return 'other'


@dataclasses.dataclass
class Kernel:
  """One kernel launch (or instruction) of the program, run `count` times per step."""
  name: str
  opcode: str
  flops: float
  hbm_bytes: float
  dtype: str  # Of its largest dot's inputs ('' without one): which peak FLOP/s applies.
  count: int = 1
  # Its largest matmul's op_name, else its metadata's, or for an asynchronous copy (which
  # has none) that of the first kernel using what it copies; '' where none says.
  op_name: str = ''
  # Its HBM bytes (one run) by the op_name of what read or wrote them: inside a fusion, an
  # operand's first user and a result's root (a weight gradient's kernel may update Adam's
  # moments too); {} means all of them are op_name's.
  bytes_by_op_name: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def part(self) -> str:
    return part_of(self.op_name)

  def bytes_by_part(self) -> dict[str, float]:
    """Its HBM bytes (one run) by the part that read or wrote them."""
    parts = collections.Counter()
    for op_name, size in (self.bytes_by_op_name or {self.op_name: self.hbm_bytes}).items():
      parts[part_of(op_name)] += size
    return dict(parts)


@dataclasses.dataclass
class ProgramCost:
  kernels: list[Kernel]
  collectives: list[Collective]
  unknown_trip_counts: int  # Loops counted once for want of a trip count.
  # The order XLA scheduled them in (a loop's body once, its kernels and collectives carrying
  # the loop's count): ('kernel', i) and ('collective', i), which the next kernel waits for;
  # an asynchronous collective as ('start', i, key), then ('done', key) where the program
  # waits for it. None: no order known (the roofline then puts every collective in series).
  schedule: list[tuple] | None = None

  @property
  def flops(self) -> float:
    return sum(k.flops * k.count for k in self.kernels)

  @property
  def hbm_bytes(self) -> float:
    return sum(k.hbm_bytes * k.count for k in self.kernels)

  def collectives_by_kind(self) -> dict[str, dict]:
    """{kind: {'count', 'bytes', 'wire_bytes'}} per device and step."""
    table = collections.defaultdict(lambda: {'count': 0, 'bytes': 0.0, 'wire_bytes': 0.0})
    for c in self.collectives:
      row = table[c.kind]
      row['count'] += c.count
      row['bytes'] += c.operand_bytes * c.count
      row['wire_bytes'] += c.wire_bytes * c.count
    return {kind: {k: (int(v) if k == 'count' else float(v)) for k, v in row.items()}
            for kind, row in sorted(table.items())}


class _Walker:
  """Walks the computations a program runs, multiplying by loop trip counts."""

  def __init__(self, text: str, num_devices: int, every_memory: bool = False):
    self.computations, self.entry = hlo_text.parse_module(text)
    self.num_devices = num_devices
    # The bytes of a shape that count as memory traffic.
    self.memory_bytes = hlo_text.total_bytes if every_memory else hlo_text.hbm_bytes
    self.kernels, self.collectives, self.unknown_trip_counts = [], [], 0
    self.schedule = []
    self._users = {}  # {computation: {instruction: the instructions using it}}, as needed.
    self._fusions = fusion_bytes.FusionBytes(self.computations, self.memory_bytes)
    # Asynchronous collectives: (computation, start's name) for a start, its async-update
    # chain and, while its wrapped computation is walked, `_async_key`.
    self._async = {}
    self._async_key = None
    self._open = set()  # Fused asynchronous collectives started and not yet waited for.

  def run(self) -> ProgramCost:
    self._walk(self.entry, 1)
    return ProgramCost(self.kernels, self.collectives, self.unknown_trip_counts, self.schedule)

  def _walk(self, computation: str, count: int) -> None:
    table = self.computations[computation]
    for ins in table.values():
      called = hlo_text.called(ins.attributes)
      if ins.opcode.endswith('-done') or ins.opcode == 'async-update':
        key = self._async.get((computation, ins.operands[0] if ins.operands else ''))
        if key is not None and ins.opcode == 'async-update':
          self._async[(computation, ins.name)] = key
        elif key is not None:
          self.schedule.append(('done', key))
      if ins.opcode == 'while':
        trips = self._trip_count(ins)
        self._walk(called['body'][0], count * trips)
        self._walk(called['condition'][0], count * (trips + 1))
      elif ins.opcode in ('call', 'async-start'):
        outer, started = self._async_key, len(self.schedule)
        if ins.opcode == 'async-start':
          self._async_key = (computation, ins.name)
        for name in called.get('calls', called.get('to_apply', [])):
          self._walk(name, count)
        self._async_key = outer
        if any(event[0] == 'start' for event in self.schedule[started:]):
          self._async[(computation, ins.name)] = (computation, ins.name)
      elif ins.opcode == 'conditional':
        branches = (called.get('branch_computations', []) + called.get('true_computation', [])
                    + called.get('false_computation', []))
        for name in branches:
          self._walk(name, count)  # Every branch counted: an upper bound.
      elif hlo_collectives.kind_of(ins.opcode):
        self.collectives.append(hlo_collectives.read(ins, table, count, self.num_devices))
        if ins.opcode.endswith('-start'):
          self._async[(computation, ins.name)] = (computation, ins.name)
          self.schedule.append(('start', len(self.collectives) - 1, (computation, ins.name)))
        elif self._async_key is not None:  # Wrapped by an async-start.
          self.schedule.append(('start', len(self.collectives) - 1, self._async_key))
        else:
          self.schedule.append(('collective', len(self.collectives) - 1))
      elif ins.opcode == 'send' and '_xla_megascale_transfer_type' in ins.attributes:
        self.collectives.append(hlo_collectives.read_across_slices(ins, table, count))
        self.schedule.append(('collective', len(self.collectives) - 1))
      elif not self._free(ins):
        kernel = self._kernel(ins, table, count)
        kernel.op_name = self._op_name(ins, computation)
        if kernel.bytes_by_op_name:  # A fusion: what has no name of its own is the kernel's.
          named = collections.Counter()
          for op_name, size in kernel.bytes_by_op_name.items():
            named[op_name or kernel.op_name] += size
          kernel.bytes_by_op_name = dict(named)
        self.kernels.append(kernel)
        self.schedule.append(('kernel', len(self.kernels) - 1))
        if ins.opcode == 'fusion' and called.get('calls'):
          self._fused_collectives(called['calls'][0], computation, count)

  def _fused_collectives(self, fused: str, computation: str, count: int) -> None:
    """The collectives a fusion holds (libtpu compiles a multi-chip program's collectives
    into fusions): one whose root is an AsyncCollectiveStart custom call starts them, one
    whose root is AsyncCollectiveDone waits for them, and the compute fusions between that
    hold the same collective (its channel) only carry it on. A collective in any other fusion
    is counted where it stands, as one the program waits for."""
    body = self.computations[fused]
    inner = [ins for ins in body.values() if hlo_collectives.kind_of(ins.opcode)]
    if not inner:
      return
    target = re.search(r'custom_call_target="([^"]*)"', hlo_text.root_of(body).attributes)
    target = target.group(1) if target else ''
    for collective in inner:
      channel = re.search(r'channel_id=(\d+)', collective.attributes)
      key = (computation, 'channel', channel.group(1) if channel else collective.name)
      if target == 'AsyncCollectiveDone':
        if key in self._open:
          self._open.discard(key)
          self.schedule.append(('done', key))
      elif key in self._open:
        continue  # Carried on by a compute fusion.
      else:
        self.collectives.append(hlo_collectives.read(collective, body, count, self.num_devices))
        if collective.opcode == 'all-reduce' and hlo_collectives.only_sliced(collective, body):
          # libtpu's reduce-scatter: an all-reduce each device keeps one slice of.
          self.collectives[-1].kind = 'reduce-scatter'
        if target == 'AsyncCollectiveStart':
          self._open.add(key)
          self.schedule.append(('start', len(self.collectives) - 1, key))
        else:
          self.schedule.append(('collective', len(self.collectives) - 1))

  def _largest_dot(self, computation: str) -> str:
    """The op_name of the fused computation's dot or convolution with the most FLOPs."""
    table, best, name = self.computations[computation], 0.0, ''
    for inner in table.values():
      if inner.opcode in ('fusion', 'call') and 'calls' in hlo_text.called(inner.attributes):
        nested = self._largest_dot(hlo_text.called(inner.attributes)['calls'][0])
        flops = self._fused_flops(hlo_text.called(inner.attributes)['calls'][0])[0]
      elif inner.opcode in ('dot', 'convolution'):
        flops = kernel_flops.dot_flops(inner, table)[0]
        nested = hlo_text.op_name(inner.attributes)
      else:
        continue
      if nested and flops > best:
        best, name = flops, nested
    return name

  def _op_name(self, ins: hlo_text.Instruction, computation: str) -> str:
    """The op_name of a fusion's largest matmul, else the instruction's own, else (an
    asynchronous copy) its first named user's, followed through the instructions that only
    pass the copy on, else its producer's."""
    called = hlo_text.called(ins.attributes).get('calls', [])
    if ins.opcode == 'fusion' and called:  # A kernel with a matmul is that matmul's.
      dot = self._largest_dot(called[0])
      if dot:
        return dot
    named = hlo_text.op_name(ins.attributes)
    if named:
      return named
    if computation not in self._users:
      users = collections.defaultdict(list)
      for inner in self.computations[computation].values():
        for operand in inner.operands:
          users[operand].append(inner)
      self._users[computation] = users
    users, frontier, seen = self._users[computation], [ins.name], set()
    while frontier:
      name = frontier.pop(0)
      for user in users.get(name, []):
        if user.opcode == 'fusion' and 'calls' in hlo_text.called(user.attributes):
          inside = self._fusions.parameter_user(user, user.operands.index(name))
          if inside:
            return inside
        found = hlo_text.op_name(user.attributes)
        if found and not self._free(user):
          return found
        if user.name not in seen and (self._free(user) or user.opcode.endswith('-done')):
          seen.add(user.name)
          frontier.append(user.name)
    # No kernel uses it here (an eviction of a result): the kernel that made what it copies.
    table, frontier = self.computations[computation], list(ins.operands)
    while frontier:
      producer = table.get(frontier.pop(0))
      if producer is None or producer.name in seen:
        continue
      seen.add(producer.name)
      found = hlo_text.op_name(producer.attributes)
      if found and not self._free(producer):
        return found
      if self._free(producer):
        frontier.extend(producer.operands)
    return ''

  @staticmethod
  def _free(ins: hlo_text.Instruction) -> bool:
    if ins.opcode in _FREE or ins.opcode.endswith('-done') or ins.opcode.endswith('-update'):
      return True
    if ins.opcode == 'custom-call':
      target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
      return bool(target) and any(free in target.group(1) for free in _FREE_CUSTOM_CALLS)
    return False

  def _trip_count(self, ins: hlo_text.Instruction) -> int:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attributes)
    if known:
      return int(known.group(1))
    condition = self.computations[hlo_text.called(ins.attributes)['condition'][0]]
    root = hlo_text.root_of(condition)
    if root.opcode == 'compare' and 'direction=LT' in root.attributes and len(root.operands) == 2:
      bound = condition.get(root.operands[1])
      if bound is not None and bound.opcode == 'constant' and re.fullmatch(r'-?\d+',
                                                                           bound.arguments):
        return max(int(bound.arguments), 0)
    self.unknown_trip_counts += 1
    return 1

  def _kernel(self, ins: hlo_text.Instruction, table, count: int) -> Kernel:
    flops, dtype = 0.0, ''
    called = hlo_text.called(ins.attributes).get('calls', [])
    if ins.opcode == 'fusion' and called:
      flops, dtype = self._fused_flops(called[0])
      read = self._fusions.reads(ins, table, called[0])
      written = self._fusions.writes(ins, called[0])
      by_op_name = collections.Counter()
      for op_name, size in read + written:
        by_op_name[op_name] += size
      return Kernel(ins.name, ins.opcode, flops, sum(size for _, size in read + written), dtype,
                    count, bytes_by_op_name=dict(by_op_name))
    else:
      if ins.opcode in ('dot', 'convolution'):
        flops, dtype = kernel_flops.dot_flops(ins, table)
      elif ins.opcode == 'custom-call':
        flops, dtype = kernel_flops.library_call_flops(ins, table)
      reads = sum(self.memory_bytes(table[name].shape) for name in ins.operands if name in table)
      writes = self.memory_bytes(ins.shape)
      if ins.opcode == 'copy-start':  # (destination, source alias, context): the destination.
        writes = self.memory_bytes(hlo_text.tuple_elements(ins.shape)[0])
      elif ins.opcode == 'slice-start':  # ((source alias), slice, context): only the slice moves.
        outputs = hlo_text.tuple_elements(ins.shape)[1:]
        reads = min(reads, hlo_text.total_bytes(outputs[0]))
        writes = sum(self.memory_bytes(e) for e in outputs)
      elif ins.opcode.endswith('-start'):  # (operand aliases, outputs..., context).
        writes = sum(self.memory_bytes(e) for e in hlo_text.tuple_elements(ins.shape)[1:])
      elif ins.opcode == 'dynamic-update-slice':  # In place: the update is read and written.
        reads = writes = self.memory_bytes(table[ins.operands[1]].shape)
    return Kernel(ins.name, ins.opcode, flops, reads + writes, dtype, count)

  def _fused_flops(self, computation: str) -> tuple[float, str]:
    flops, dtype, largest = 0.0, '', 0.0
    table = self.computations[computation]
    for ins in table.values():
      if ins.opcode in ('dot', 'convolution'):
        f, d = kernel_flops.dot_flops(ins, table)
      elif ins.opcode == 'fusion' or ins.opcode == 'call':
        f, d = self._fused_flops(hlo_text.called(ins.attributes)['calls'][0]) if 'calls' in \
            hlo_text.called(ins.attributes) else (0.0, '')
      elif ins.opcode == 'custom-call':
        f, d = kernel_flops.library_call_flops(ins, table)
      else:
        continue
      flops += f
      if f > largest:
        largest, dtype = f, d
    return flops, dtype


def analyse(hlo_text: str, num_devices: int, every_memory: bool = False) -> ProgramCost:
  """The per-device kernels and collectives of one step of a compiled (SPMD) program.

  `every_memory`: count traffic in every memory space as `hbm_bytes` (a TPU's on-chip VMEM,
  S(1), too), as XLA's TPU cost analysis counts its 'bytes accessed'; not a roofline's input.
  """
  return _Walker(hlo_text, num_devices, every_memory).run()
