"""FLOPs of the kernels in a compiled program's optimised HLO, for hlo_cost.py: dots and
convolutions from their dimension numbers, library calls the compiler emitted (cuBLAS GEMMs),
fused attention kernels (splash, cuDNN, t2t_jax's flash kernels) and t2t_jax's fused loss
kernels from their shapes.
"""

import math
import re

import numpy as np

from t2t_jax.compile import hlo_text


def dot_flops(ins: hlo_text.Instruction, table) -> tuple[float, str]:
  """2 x multiply-adds of a dot or convolution, and the dtype of its first operand."""
  if len(ins.operands) < 2 or ins.operands[0] not in table or ins.operands[1] not in table:
    return 0.0, ''
  lhs, rhs = (hlo_text.arrays(table[name].shape) for name in ins.operands[:2])
  if not lhs or not rhs:
    return 0.0, ''
  out_elements = sum(math.prod(dims) for _, dims, _ in hlo_text.arrays(ins.shape)[:1])
  if ins.opcode == 'dot':
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attributes)
    dims = [int(d) for d in contracting.group(1).split(',') if d] if contracting else []
    return 2.0 * out_elements * math.prod(lhs[0][1][d] for d in dims), lhs[0][0]
  return _convolution_flops(ins, lhs[0][1], rhs[0][1], hlo_text.arrays(ins.shape)[0][1]), lhs[0][0]


def _convolution_flops(ins: hlo_text.Instruction, lhs, rhs, out) -> float:
  """2 x (output batch x output features) x input features x (window taps meeting input)."""
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', ins.attributes)
  if not labels:
    return 0.0
  lhs_labels, rhs_labels, out_labels = labels.groups()
  window = re.search(r'window=\{([^}]*)\}', ins.attributes)
  fields = dict(re.findall(r'(\w+)=([\w_x\-]+)', window.group(1))) if window else {}
  spatial = sorted(c for c in rhs_labels if c.isdigit())

  def per_dim(key, default):
    values = fields.get(key)
    return [default] * len(spatial) if values is None else values.split('x')

  sizes = [int(s) for s in per_dim('size', 1)]
  strides = [int(s) for s in per_dim('stride', 1)]
  pads = [tuple(int(p) for p in s.split('_')) for s in per_dim('pad', '0_0')]
  lhs_dilations = [int(s) for s in per_dim('lhs_dilate', 1)]
  rhs_dilations = [int(s) for s in per_dim('rhs_dilate', 1)]
  taps = 1
  for i, dim in enumerate(spatial):
    n = lhs[lhs_labels.index(dim)]
    outputs = np.arange(out[out_labels.index(dim)])
    dilated = (n - 1) * lhs_dilations[i] + 1
    meeting = 0
    for t in range(sizes[i]):
      position = outputs * strides[i] + t * rhs_dilations[i] - pads[i][0]
      meeting += int(np.sum((position >= 0) & (position < dilated)
                            & (position % lhs_dilations[i] == 0)))
    taps *= meeting
  batch = out[out_labels.index('b')]
  features = out[out_labels.index('f')]
  return 2.0 * batch * features * rhs[rhs_labels.index('i')] * taps


# Fused attention kernels: matmuls of Q x K x D per head and row they do, 2 FLOPs each.
# Forward: scores and the weighted values. Backward, flash-style, recomputing the scores:
# splash's dq kernel (scores, dP, dQ) and dkv kernel (scores, dP, dV, dK); cuDNN's backward in
# one call (scores, dP, dV, dQ, dK); t2t_jax's flash kernels (flash_attention.py) like
# splash's, in [B, L, H, D] on GPUs and [B, H, L, D] on TPUs (flash_attention_tpu.py). Causal
# kernels skip some blocks: counted as full. Each kernel is known by what names it: the
# instruction (splash, flash on TPUs), the Triton call's config (flash on GPUs) or the custom
# call's target (cuDNN).
_ATTENTION_MATMULS = (
    ('name', re.compile(r'splash_m[hq]a_fwd'), 2, -2),
    ('name', re.compile(r'splash_m[hq]a_dq'), 3, -2),
    ('name', re.compile(r'splash_m[hq]a_dkv'), 4, -2),
    ('attributes', re.compile(r'name = \\?"t2t_flash_fwd'), 2, -3),
    ('attributes', re.compile(r'name = \\?"t2t_flash_dq'), 3, -3),
    ('attributes', re.compile(r'name = \\?"t2t_flash_dkv'), 4, -3),
    ('name', re.compile(r't2t_flash_fwd'), 2, -2),  # The TPU kernels, in [B, H, L, D].
    ('name', re.compile(r't2t_flash_dq'), 3, -2),
    ('name', re.compile(r't2t_flash_dkv'), 4, -2),
    ('target', re.compile(r'^__cudnn\$fmha\w*Backward$'), 5, -3),
    ('target', re.compile(r'^__cudnn\$fmha'), 2, -3))


# The fused output layer and loss (training/fused_loss.py): each kernel multiplies the hidden
# states [T, E] by the (padded) output matrix [V, E] once.
_OUTPUT_LAYER_KERNEL = re.compile(r'name = \\?"t2t_fused_loss_(fwd|grad)')


def _output_layer_flops(ins: hlo_text.Instruction, table) -> tuple[float, str] | None:
  """2 T V E of a fused loss kernel, from its first two operands; None if it is not one."""
  if not _OUTPUT_LAYER_KERNEL.search(ins.attributes):
    return None
  arrays = [hlo_text.arrays(table[name].shape)[0] for name in ins.operands[:2] if name in table]
  if len(arrays) < 2 or any(len(dims) != 2 for _, dims, _ in arrays):
    return None
  (dtype, (tokens, width), _), (_, (vocab, _), _) = arrays
  return 2.0 * tokens * vocab * width, dtype


def _attention_flops(ins: hlo_text.Instruction, table, target: str) -> tuple[float, str] | None:
  """FLOPs of a fused attention kernel, from its query and key shapes ([B, H, Q, D] and
  [B, H, K, D] for splash, whose B goes where a device holds one row, and for t2t_jax's flash
  kernels on TPUs; [B, Q, H, D] and [B, K, H, D] for cuDNN and t2t_jax's flash kernels on
  GPUs); None if it is not one."""
  texts = {'name': ins.name, 'attributes': ins.attributes, 'target': target}
  for where, pattern, matmuls, key_axis in _ATTENTION_MATMULS:
    if pattern.search(texts[where]):
      operands = [hlo_text.arrays(table[name].shape)[0] for name in ins.operands if name in table
                  and hlo_text.arrays(table[name].shape)]
      arrays = [a for a in operands if len(a[1]) >= 3 and a[0][0] in 'fb']
      if len(arrays) < 2:
        return None  # Not the query and key this layout expects: not counted.
      q, k = arrays[:2]
      return 2.0 * matmuls * math.prod(q[1]) * k[1][key_axis], q[0]
  return None


def library_call_flops(ins: hlo_text.Instruction, table) -> tuple[float, str]:
  """FLOPs of a library call or kernel the compiler emitted: cuBLAS GEMMs (their dot
  dimensions are in the backend config), fused attention (splash, cuDNN); 0 for calls whose
  arithmetic is not known here."""
  target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
  fused = (_attention_flops(ins, table, target.group(1) if target else '')
           or _output_layer_flops(ins, table))
  if fused is not None:
    return fused
  if not target or not any(word in target.group(1).lower() for word in ('gemm', 'matmul')):
    return 0.0, ''
  first = table.get(ins.operands[0]) if ins.operands else None
  lhs = hlo_text.arrays(first.shape) if first else []
  contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attributes)
  if not lhs or not contracting:
    return 0.0, ''
  dims = [int(d) for d in re.findall(r'\d+', contracting.group(1))]
  out = hlo_text.arrays(hlo_text.tuple_elements(ins.shape)[0])
  out_elements = math.prod(out[0][1]) if out else 0
  return 2.0 * out_elements * math.prod(lhs[0][1][d] for d in dims), lhs[0][0]
