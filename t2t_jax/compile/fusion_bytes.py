"""The memory traffic of one fused kernel, read from its optimised HLO: what it reads of each
operand and what it writes of each result, each with the op_name (the JAX source) that read or
wrote it. `hlo_cost.py` adds these up over the program.

XLA emits a fusion per output element, so an operand the fused code only slices (or reduces,
converts, reshapes... on the way to a slice) is read only where the output needs it; a buffer
updated in place by a dynamic-update-slice is not read, and its write is the update.
"""

import collections
import math
from collections.abc import Callable

from t2t_jax.compile import hlo_text

_SLICING = ('dynamic-slice', 'slice', 'gather')
# Fused ops whose operands are read where their output is (a fraction f of the output needs
# about f of each operand): elementwise arithmetic, converts, layout changes, reductions.
_PASSES_SHARE = {'convert', 'bitcast', 'copy', 'reshape', 'transpose', 'reduce', 'tuple',
                 'add', 'subtract', 'multiply', 'divide', 'maximum', 'minimum', 'negate', 'abs',
                 'exponential', 'log', 'sqrt', 'rsqrt', 'tanh', 'select', 'compare', 'and', 'or',
                 'xor', 'not', 'power', 'clamp', 'sign', 'floor', 'ceil', 'round-nearest-even',
                 'exponential-minus-one', 'log-plus-one', 'logistic', 'cosine', 'sine',
                 'shift-left', 'shift-right-logical', 'shift-right-arithmetic', 'remainder',
                 'atan2', 'is-finite', 'bitcast-convert', 'reduce-precision'}


class FusionBytes:
  """Counts fusions' traffic in a parsed module (`hlo_text.parse_module`'s computations).

  `memory_bytes(shape)`: the bytes of a shape that count as traffic (HBM only, or every
  memory space)."""

  def __init__(self, computations: dict[str, dict[str, hlo_text.Instruction]],
               memory_bytes: Callable[[str], float]):
    self.computations = computations
    self.memory_bytes = memory_bytes
    self._utilisations = {}  # {fused computation: utilisation's answer}, as needed.

  def reads(self, ins: hlo_text.Instruction, table, computation: str) -> list[tuple[str, float]]:
    """(op_name of its first user inside, bytes) of each operand of fusion `ins` in HBM,
    counted as the part of it the fused code needs (`utilisation`)."""
    body = self.computations[computation]
    parameters = {int(p.arguments): p.name for p in body.values() if p.opcode == 'parameter'}
    users = collections.defaultdict(list)
    for inner in body.values():
      for operand in inner.operands:
        users[operand].append(inner)
    read = []
    for index, name in enumerate(ins.operands):
      if name not in table:
        continue
      full = self.memory_bytes(table[name].shape)
      parameter = parameters.get(index, '')
      uses = users.get(parameter, [])
      if uses and all(u.opcode == 'dynamic-update-slice' and u.operands[0] == parameter
                      for u in uses):
        continue  # The buffer updated in place: not read.
      size = full * min(1.0, self.utilisation(computation).get(parameter, 1.0))
      read.append((self.first_named(uses, body), size))
    return read

  def writes(self, ins: hlo_text.Instruction, computation: str) -> list[tuple[str, float]]:
    """(op_name of the root that made it, bytes) of each result of fusion `ins` in HBM; a root
    that updates a buffer in place counts as the update."""
    body = self.computations[computation]
    root = hlo_text.root_of(body)
    roots = [body[name] for name in root.operands] if root.opcode == 'tuple' else [root]
    written = []
    for i, element in enumerate(hlo_text.tuple_elements(ins.shape)):
      inner = roots[i] if i < len(roots) else None
      if inner is not None and inner.opcode == 'dynamic-update-slice' and \
          inner.operands[1] in body:
        update = body[inner.operands[1]].shape
        size = min(self.memory_bytes(element), hlo_text.total_bytes(update))
      else:
        size = self.memory_bytes(element)
      written.append((hlo_text.op_name(inner.attributes) if inner is not None else '', size))
    return written

  def utilisation(self, computation: str) -> dict[str, float]:
    """{instruction: the fraction of its elements the fused computation reads}, from the
    root back. Elementwise ops, converts, layout changes and reductions pass their own
    fraction on; a slice scales it by its share of the operand; a broadcast or pad passes on
    at least as much as the output needs, and anything else reads its operands whole. Several
    users add up (capped at the whole)."""
    if computation in self._utilisations:
      return self._utilisations[computation]
    body = self.computations[computation]
    needed = collections.defaultdict(float)
    needed[hlo_text.root_of(body).name] = 1.0
    for ins in reversed(list(body.values())):
      share = min(1.0, needed.get(ins.name, 0.0))
      if not share:
        continue
      out = _elements(ins.shape)
      for position, name in enumerate(ins.operands):
        if name not in body:
          continue
        if ins.opcode in _PASSES_SHARE:
          part = share
        elif ins.opcode in _SLICING or ins.opcode in ('broadcast', 'pad'):
          part = share * out / max(_elements(body[name].shape), 1) if position == 0 else 1.0
        else:
          part = 1.0
        needed[name] += part
    self._utilisations[computation] = dict(needed)
    return self._utilisations[computation]

  def parameter_user(self, fusion: hlo_text.Instruction, index: int) -> str:
    """The op_name of the first instruction inside `fusion` that uses its operand `index`."""
    body = self.computations[hlo_text.called(fusion.attributes)['calls'][0]]
    parameter = next((p.name for p in body.values()
                      if p.opcode == 'parameter' and p.arguments == str(index)), None)
    return self.first_named([u for u in body.values() if parameter in u.operands], body)

  @staticmethod
  def first_named(uses: list[hlo_text.Instruction], body) -> str:
    """The op_name of the first of `uses` (or of their users, breadth first) that has one."""
    frontier, seen = list(uses), set()
    while frontier:
      inner = frontier.pop(0)
      found = hlo_text.op_name(inner.attributes)
      if found:
        return found
      if inner.name not in seen:
        seen.add(inner.name)
        frontier.extend(u for u in body.values() if inner.name in u.operands)
    return ''


def _elements(shape: str) -> int:
  return sum(math.prod(dims) for _, dims, _ in hlo_text.arrays(shape))
