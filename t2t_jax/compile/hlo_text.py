"""Reading XLA's optimised HLO text: its computations and instructions, the arrays of a shape
(dtype, dimensions, memory space) and their bytes, and the device groups of a collective in
each form XLA prints them. What they cost is `hlo_cost.py`'s.

The text is XLA's printed module: `ENTRY` marks the program's computation, an instruction is
`%name = shape opcode(operands), attributes` (its metadata may span lines), and a layout's
`S(n)` names the memory space of an array (0 is the device's main memory, HBM).
"""

import collections
import dataclasses
import math
import re

import numpy as np

DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
                'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16,
                's4': 0.5, 'u4': 0.5, 'token': 0,
                **dict.fromkeys(('f8e4m3fn', 'f8e5m2', 'f8e4m3', 'f8e3m4', 'f8e4m3fnuz',
                                 'f8e5m2fnuz', 'f8e4m3b11fnuz'), 1)}
_ARRAY = re.compile(r'\b([a-z]+[0-9a-z]*)\[([0-9,]*)\](\{[^{}]*\})?')
_HEADER = re.compile(r'^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$')
_INSTRUCTION = re.compile(r'^\s*(ROOT )?%([\w.\-]+) = ')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # The result shape as printed: an array, or a tuple of them.
  opcode: str
  operands: list[str]
  arguments: str  # The text between the parentheses: operands, or a constant's value.
  attributes: str
  root: bool = False


def parse_module(text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
  """{computation: {instruction name: Instruction}} (in order) and the entry's name."""
  computations, entry, current, pending = {}, None, None, []

  def finish():  # An instruction may span lines (a kernel's metadata holds line breaks).
    if pending and current is not None:
      instruction = _parse_instruction('\n'.join(pending))
      if instruction:
        current[instruction.name] = instruction
    pending.clear()

  for line in text.splitlines():
    header = _HEADER.match(line)
    if header or line.strip() == '}' or _INSTRUCTION.match(line):
      finish()
    if header:
      current = computations.setdefault(header.group(2), {})
      if header.group(1):
        entry = header.group(2)
    elif line.strip() == '}':
      current = None
    elif _INSTRUCTION.match(line) or pending:
      pending.append(line)
  finish()
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return computations, entry


def _parse_instruction(line: str) -> Instruction | None:
  head = _INSTRUCTION.match(line)
  if not head:
    return None
  rest = line[head.end():]
  shape_end = balanced_end(rest, 0) if rest.startswith('(') else rest.index(' ')
  shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
  paren = rest.index('(')
  opcode = rest[:paren]
  operands_end = balanced_end(rest, paren)
  arguments = rest[paren + 1:operands_end - 1]
  operands = re.findall(r'%([\w.\-]+)', arguments)
  return Instruction(head.group(2), shape, opcode, operands, arguments, rest[operands_end:],
                     bool(head.group(1)))


def balanced_end(text: str, start: int) -> int:
  """The index after the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '({[':
      depth += 1
    elif text[i] in ')}]':
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f'unbalanced brackets in HLO: {text[start:start + 80]!r}')


def arrays(shape: str) -> list[tuple[str, tuple[int, ...], int]]:
  """(dtype, dims, memory space) of each array in a shape string (tuples flattened)."""
  found = []
  for dtype, dims, layout in _ARRAY.findall(shape):
    if dtype not in DTYPE_BYTES:
      continue
    space = re.search(r'S\((\d+)\)', layout or '')
    found.append((dtype, tuple(int(d) for d in dims.split(',') if d),
                  int(space.group(1)) if space else 0))
  return found


def hbm_bytes(shape: str) -> float:
  """Bytes of the arrays of a shape that live in device memory (memory space 0)."""
  return float(sum(DTYPE_BYTES[dtype] * math.prod(dims)
                   for dtype, dims, space in arrays(shape) if space == 0))


def total_bytes(shape: str) -> float:
  return float(sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims, _ in arrays(shape)))


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape (the shape itself if it is not a tuple)."""
  if not shape.startswith('('):
    return [shape]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(shape):
    if char in '({[':
      depth += 1
    elif char in ')}]':
      depth -= 1
    if (char == ',' and depth == 1) or (depth == 0 and char == ')'):
      elements.append(shape[start:i].strip())
      start = i + 1
  return [re.sub(r'^/\*index=\d+\*/', '', e) for e in elements if e]


def root_of(computation: dict[str, Instruction]) -> Instruction:
  return next((ins for ins in computation.values() if ins.root),
              list(computation.values())[-1])


def op_name(attributes: str) -> str:
  """The op_name of an instruction's metadata (the JAX source it came from), '' without one."""
  found = _OP_NAME.search(attributes)
  return found.group(1) if found else ''


def called(attributes: str) -> dict[str, list[str]]:
  """Computations an instruction names: {'calls': [...], 'body': [...], ...}."""
  found = collections.defaultdict(list)
  for key, value in re.findall(r'\b(calls|body|condition|to_apply|branch_computations|'
                               r'true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)',
                               attributes):
    found[key] += re.findall(r'%?([\w.\-]+)', value.strip('{}'))
  return found


def replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective, in each of the forms XLA prints them."""
  pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', attributes)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)', pairs.group(1) + '}')]
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((\[[\d,]*\](?:T\([\d,]*\))?)"
                   r"\))? \{([^}]*)\}", attributes)
  if mesh:
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    ids = _iota_ids(mesh.group(2)) if mesh.group(2) else np.arange(
        math.prod(int(n) for _, n in axes))
    names = [name for name, _ in axes]
    grid = ids.reshape([int(n) for _, n in axes])
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(3))]
    rest = [i for i in range(len(names)) if i not in chosen]
    size = math.prod(grid.shape[i] for i in chosen)
    return grid.transpose(rest + chosen).reshape(-1, size).tolist()
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]*\](?:T\([\d,]*\))?)', attributes)
  if iota:
    return _iota_ids(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
  start = attributes.find('replica_groups={')
  if start >= 0:
    start += len('replica_groups=')
    groups = re.findall(r'\{([\d,]*)\}', attributes[start + 1:balanced_end(attributes, start) - 1])
    if groups:
      return [[int(i) for i in group.split(',') if i] for group in groups]
  return [list(range(num_devices))]  # No groups: every device of the program.


def _iota_ids(spec: str) -> np.ndarray:
  """Device ids of an iota list such as '[2,4]T(1,0)' or '[8]', flattened."""
  dims = [int(d) for d in re.search(r'\[([\d,]*)\]', spec).group(1).split(',') if d]
  ids = np.arange(math.prod(dims)).reshape(dims)
  transpose = re.search(r'T\(([\d,]*)\)', spec)
  if transpose:
    ids = ids.transpose([int(d) for d in transpose.group(1).split(',')])
  return ids.reshape(-1)
