"""The collectives of a compiled program, read from its optimised HLO: each one's kind, bytes
per device and device groups, and what it sends over the links with ring algorithms.
`hlo_cost.py` finds them in the program and places them in its schedule.
"""

import dataclasses
import re

from t2t_jax.compile import hlo_text

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute',
               'ragged-all-to-all', 'collective-broadcast')


@dataclasses.dataclass
class Collective:
  """One collective instruction, run `count` times per step."""
  kind: str
  operand_bytes: float  # Per device, one run.
  groups: list[list[int]]  # Device ids (positions in the program's device assignment).
  count: int = 1
  # Between TPU slices: the runtime's (megascale) transfer over the data-centre network,
  # among `slices` slices, where the program's groups list no devices.
  slices: int = 0

  @property
  def group_size(self) -> int:
    return self.slices or max((len(g) for g in self.groups), default=1)

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends per run, with ring algorithms (n devices in a group)."""
    n, size = self.group_size, self.operand_bytes
    if n <= 1:
      return 0.0
    if self.kind == 'all-reduce':
      return 2 * (n - 1) / n * size
    if self.kind == 'all-gather':
      return (n - 1) * size  # Each device's piece goes to the n - 1 others.
    if self.kind in ('collective-permute', 'collective-broadcast', 'one-to-one'):
      return size  # Each device sends its operand once (one-to-one: a slice-to-slice send).
    return (n - 1) / n * size  # reduce-scatter, all-to-all.


def kind_of(opcode: str) -> str | None:
  """The collective an opcode is (its `-start` too), None for any other."""
  base = opcode[:-len('-start')] if opcode.endswith('-start') else opcode
  return base if base in COLLECTIVES else None


def read(ins: hlo_text.Instruction, table, count: int, num_devices: int) -> Collective:
  """The collective instruction `ins` of computation `table`, run `count` times."""
  size = sum(hlo_text.total_bytes(table[name].shape) for name in ins.operands if name in table)
  groups = hlo_text.replica_groups(ins.attributes, num_devices)
  return Collective(kind_of(ins.opcode), size, groups, count)


def read_across_slices(ins: hlo_text.Instruction, table, count: int) -> Collective:
  """A collective across TPU slices: the program sends its part to the runtime, which moves
  it over the data-centre network (`_xla_megascale_target="{1,2}x{0:7}"`: slices x chips)."""
  kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', ins.attributes).group(1)
  target = re.search(r'_xla_megascale_target="\{([^}]*)\}', ins.attributes)
  slices = 0
  for part in (target.group(1).split(',') if target else []):
    low, _, high = part.partition(':')
    slices += int(high) - int(low) + 1 if high else 1
  size = hlo_text.total_bytes(table[ins.operands[0]].shape) if ins.operands[0] in table else 0.0
  return Collective(kind.lower().replace('_', '-'), size, [], count, max(slices, 2))


def only_sliced(ins: hlo_text.Instruction, body: dict) -> bool:
  """Whether every use of `ins` in `body` (through get-tuple-element) is a dynamic-slice:
  libtpu's reduce-scatter is an all-reduce each device keeps one slice of."""
  uses = [u for u in body.values() if ins.name in u.operands]
  return bool(uses) and all(
      u.opcode == 'dynamic-slice' or (u.opcode == 'get-tuple-element' and only_sliced(u, body))
      for u in uses)
