"""The output layer and the label-smoothed loss fused into Pallas kernels (`opt.loss_impl='fused'`).

The XLA path (optim.chunked_metrics) writes each chunk's [T, V] logits, reads them in the
softmax's passes and writes d loss / d logits for the projection's backward: on a GPU the
loss over a 37,000-token vocabulary is then a fifth of the paper's base model's HBM traffic
(docs/results/accelerators.md). Here a forward kernel multiplies a block of hidden states
by the output matrix a block of vocabulary at a time and keeps only running per-token
statistics (the maximum, the sum of exponentials, the sum of logits, the target's logit), so
no logits reach memory. The backward kernel computes the logits again, turns them into
d loss / d logits, w (p - q), and writes those once in the compute dtype; two matrix products
from the library (cuBLAS on a GPU) then give the gradients of the hidden states and of the
matrix. One more [T, V] matrix product than the XLA path buys about two thirds of its bytes.

The vocabulary is split into a few spans, one program per (token block, span), so a device's
few token blocks still fill the GPU; the spans' statistics combine in float32 outside the
kernel. The sums equal optim.compute_metrics of float32 logits up to rounding (the XLA path
rounds its logits to the compute dtype first). On a GPU the kernels compile through Triton;
on a CPU they run in the Pallas interpreter (slow, for tests); TPUs are refused
(config_check). Shapes in names follow the package legend (t2t_jax/__init__.py); T tokens.
"""

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
import jax.numpy as jnp

from t2t_jax import PAD_ID
from t2t_jax.model import pallas_attention
from t2t_jax.training import optim

Array = jax.Array
P = jax.sharding.PartitionSpec

MASKED = -1e30  # A vocabulary entry past the end: finite, so the running maximum stays NaN-free.
# At least this many (token block, span) programs per device: H100 has 132 SMs.
PROGRAMS = 256


class _Settings(NamedTuple):
  """What the kernels are compiled for (static)."""
  vocab: int  # V, the real entries; the matrix is padded past it to whole spans.
  span: int  # Vocabulary entries per program: whole blocks.
  block_t: int
  block_v: int
  block_e: int  # The hidden width is multiplied a slice of this many at a time.
  confidence: float  # The target's smoothed probability, every other entry's `low`.
  low: float
  entropy: float  # The smoothed target's: a prediction equal to it scores 0.
  interpret: bool
  padded_vocab: int  # The matrix's rows in the kernels: whole spans.
  weight_dtype: str  # The matrix parameter's, which its gradient comes back in.


def _block_logits(h_ref, w_ref, first_token, first_entry, settings: _Settings) -> Array:
  """[block_t, block_v] float32 logits of one token block and one vocabulary block."""
  rows, entries = pl.ds(first_token, settings.block_t), pl.ds(first_entry, settings.block_v)
  def add_slice(k, acc):
    width = pl.ds(k * settings.block_e, settings.block_e)
    return acc + lax.dot_general(h_ref[rows, width], w_ref[entries, width],
                                 (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return lax.fori_loop(0, h_ref.shape[1] // settings.block_e, add_slice,
                       jnp.zeros((settings.block_t, settings.block_v), jnp.float32))


def _entries(first_entry, settings: _Settings) -> Array:
  return first_entry + lax.broadcasted_iota(jnp.int32, (settings.block_t, settings.block_v), 1)


def _stats_kernel(h_ref, w_ref, targets_ref, max_ref, sum_exp_ref, sum_ref, target_ref, *,
                  settings: _Settings):
  first_token = pl.program_id(0) * settings.block_t
  span = pl.program_id(1)
  targets = targets_ref[pl.ds(first_token, settings.block_t)]

  def step(j, carry):
    m, l, total, target = carry
    first_entry = span * settings.span + j * settings.block_v
    logits = _block_logits(h_ref, w_ref, first_token, first_entry, settings)
    entries = _entries(first_entry, settings)
    real = entries < settings.vocab
    m_next = jnp.maximum(m, jnp.where(real, logits, MASKED).max(axis=1))
    exp = jnp.where(real, jnp.exp(logits - m_next[:, None]), 0.0)
    return (m_next, l * jnp.exp(m - m_next) + exp.sum(axis=1),
            total + jnp.where(real, logits, 0.0).sum(axis=1),
            target + jnp.where(entries == targets[:, None], logits, 0.0).sum(axis=1))

  zeros = jnp.zeros((settings.block_t,), jnp.float32)
  m, l, total, target = lax.fori_loop(0, settings.span // settings.block_v, step,
                                      (jnp.full_like(zeros, MASKED), zeros, zeros, zeros))
  out = pl.ds(first_token, settings.block_t)
  max_ref[span, out], sum_exp_ref[span, out] = m, l
  sum_ref[span, out], target_ref[span, out] = total, target


def _logits_grad_kernel(h_ref, w_ref, targets_ref, lse_ref, scale_ref, grad_ref, *,
                        settings: _Settings):
  first_token = pl.program_id(0) * settings.block_t
  first_of_span = pl.program_id(1) * settings.span
  rows = pl.ds(first_token, settings.block_t)
  targets, lse = targets_ref[rows], lse_ref[rows]
  # d loss / d logits of a token is w (p - q), times the cotangent of the summed loss.
  weight = jnp.where(targets != PAD_ID, scale_ref[0], 0.0)

  def step(j, _):
    first_entry = first_of_span + j * settings.block_v
    logits = _block_logits(h_ref, w_ref, first_token, first_entry, settings)
    entries = _entries(first_entry, settings)
    q = jnp.where(entries == targets[:, None], settings.confidence, settings.low)
    grad = jnp.where(entries < settings.vocab,
                     (jnp.exp(logits - lse[:, None]) - q) * weight[:, None], 0.0)
    grad_ref[rows, pl.ds(first_entry, settings.block_v)] = grad.astype(grad_ref.dtype)
    return 0

  lax.fori_loop(0, settings.span // settings.block_v, step, 0)


def _whole(shape):
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, settings: _Settings, name: str, grid, out_shape, *args):
  return pl.pallas_call(
      functools.partial(kernel, settings=settings), grid=grid,
      in_specs=[_whole(x.shape) for x in args],
      out_specs=jax.tree.map(lambda s: _whole(s.shape), out_shape), out_shape=out_shape,
      name=name, interpret=settings.interpret,
      compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=2))(*args)


def _token_stats(settings: _Settings, hidden_TE, weight_VE, targets_T):
  """Per token: log-sum-exp, maximum, sum and target's entry of its float32 logits."""
  tokens, spans = hidden_TE.shape[0], weight_VE.shape[0] // settings.span
  shape = jax.ShapeDtypeStruct((spans, tokens), jnp.float32)
  max_ST, sum_exp_ST, sum_ST, target_ST = _call(
      _stats_kernel, settings, 't2t_fused_loss_fwd', (tokens // settings.block_t, spans),
      (shape,) * 4, hidden_TE, weight_VE, targets_T)
  max_T = max_ST.max(axis=0)
  lse_T = max_T + jnp.log((sum_exp_ST * jnp.exp(max_ST - max_T)).sum(axis=0))
  return lse_T, max_T, sum_ST.sum(axis=0), target_ST.sum(axis=0)


def _logits_grad(settings: _Settings, hidden_TE, weight_VE, targets_T, lse_T, scale):
  tokens, spans = hidden_TE.shape[0], weight_VE.shape[0] // settings.span
  return _call(_logits_grad_kernel, settings, 't2t_fused_loss_grad',
               (tokens // settings.block_t, spans),
               jax.ShapeDtypeStruct((tokens, weight_VE.shape[0]), hidden_TE.dtype),
               hidden_TE, weight_VE, targets_T, lse_T, jnp.reshape(scale, (1,)))


def _per_device(fn, settings: _Settings, rows_out: int, hidden_TE, weight_VE, token_args,
                scalars=()):
  """fn(settings, hidden, weight, *token_args, *scalars) on each device's tokens under a mesh,
  split as the batch is: `hidden_TE` and the [T] `token_args` (targets first) split by
  tokens, padded to whole token blocks and the outputs sliced back; the matrix and the
  scalars whole on every device. The outputs: [T] arrays, and [T, V] if `rows_out` is 2."""
  def padded(hidden, weight, *rest):
    tokens = hidden.shape[0]
    extra = -tokens % settings.block_t
    pad = lambda x, value=0: jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1),
                                     constant_values=value)
    targets, others = rest[0], rest[1:len(token_args)]
    out = fn(settings, pad(hidden), weight, pad(targets, PAD_ID), *map(pad, others),
             *rest[len(token_args):])
    return jax.tree.map(lambda x: x[:tokens], out)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return padded(hidden_TE, weight_VE, *token_args, *scalars)
  axes = _batch_axes(hidden_TE.shape[0], mesh)
  tokens, whole = P(axes), lambda x: P(*(None,) * jnp.ndim(x))
  in_specs = (P(axes, None), whole(weight_VE), *(tokens,) * len(token_args),
              *map(whole, scalars))
  out_specs = P(axes, None) if rows_out == 2 else (tokens,) * 4
  # Unchecked: a pallas_call declares no per-axis variance of its outputs.
  return jax.shard_map(padded, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      hidden_TE, weight_VE, *token_args, *scalars)


def _batch_axes(tokens: int, mesh):
  """The mesh axes the logical 'batch' maps to, if they split `tokens` evenly, else None."""
  return pallas_attention.dividing(nn.logical_to_mesh_axes(('batch',))[0], tokens, mesh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sums(settings: _Settings, hidden_TE, weight_VE, targets_T):
  return _sums_forward(settings, hidden_TE, weight_VE, targets_T)[0]


def _sums_forward(settings: _Settings, hidden_TE, weight_VE, targets_T):
  # The matrix as the kernels and the backward's products read it: in the hidden states'
  # dtype, padded to whole spans (cast and padded in one pass, kept for the backward).
  weight_VE = jnp.pad(weight_VE.astype(hidden_TE.dtype),
                      ((0, settings.padded_vocab - settings.vocab), (0, 0)))
  lse_T, max_T, sum_T, target_T = _per_device(_token_stats, settings, 1, hidden_TE, weight_VE,
                                              (targets_T,))
  weights_T = (targets_T != PAD_ID).astype(jnp.float32)
  nll_T = lse_T - target_T
  sum_log_probs_T = sum_T - settings.vocab * lse_T
  loss_T = (-(settings.low * sum_log_probs_T - (settings.confidence - settings.low) * nll_T)
            - settings.entropy)
  sums = {'loss': (loss_T * weights_T).sum(), 'nll': (nll_T * weights_T).sum(),
          'correct': ((target_T >= max_T) * weights_T).sum(), 'weight': weights_T.sum()}
  return sums, (hidden_TE, weight_VE, targets_T, lse_T)


def _sums_backward(settings: _Settings, saved, sums_grad):
  hidden_TE, weight_VE, targets_T, lse_T = saved
  with jax.named_scope('loss'):
    # Only 'loss' is differentiated (fused_metrics stops the other sums' gradients).
    grad_TV = _per_device(_logits_grad, settings, 2, hidden_TE, weight_VE, (targets_T, lse_T),
                          (sums_grad['loss'],))
    hidden_grad_TE = jnp.einsum('TV,VE->TE', grad_TV, weight_VE,
                                preferred_element_type=jnp.float32).astype(hidden_TE.dtype)
    # In the compute dtype, as the XLA path's projection backward has it (so the devices'
    # shares are reduced in it, as there), then in the parameter's; the padding's rows dropped.
    weight_grad_VE = jnp.einsum('TV,TE->VE', grad_TV, hidden_TE)[:settings.vocab]
    weight_grad_VE = weight_grad_VE.astype(settings.weight_dtype)
  return hidden_grad_TE, weight_grad_VE, None


_sums.defvjp(_sums_forward, _sums_backward)


def _power_of_two_at_most(n: int, most: int) -> int:
  block = 1
  while block * 2 <= min(n, most):
    block *= 2
  return block


def supported_width(width: int) -> bool:
  """Whether the kernels take hidden states this wide: a multiple of 16, multiplied a
  power-of-two slice at a time (Triton's blocks are)."""
  return width > 0 and width % 16 == 0


def _width_block(width: int, dtype) -> int:
  """The slice of the hidden width multiplied at a time: the largest power of two dividing it,
  at most 128 in a 16-bit dtype and 64 in float32 (two pipeline stages of both operands'
  tiles must fit a GPU's shared memory)."""
  return min(128 if jnp.dtype(dtype).itemsize <= 2 else 64, width & -width)


def fused_metrics(hidden_BLE: Array, weight_VE: Array, targets_BL: Array,
                  label_smoothing: float) -> dict[str, Array]:
  """optim.compute_metrics of the logits hidden weight^T, with no [tokens, V] logits stored.

  `weight_VE` is the output layer's matrix as a parameter (the tied embedding, or the output
  kernel transposed); it is multiplied in the hidden states' dtype, and its gradient comes
  back in its own. Only 'loss' is differentiable, as in optim.chunked_metrics.
  Under a mesh each device runs the kernels on its share of the tokens, the matrix whole.
  """
  (vocab, width), tokens = weight_VE.shape, targets_BL.size
  if not supported_width(width):
    raise ValueError(f'fused_metrics: a hidden width of {width} is not a multiple of 16')
  platform = pallas_attention.kernel_platform()
  if platform == 'tpu':
    raise ValueError("fused_metrics: the kernels are Triton's (GPU) and the Pallas "
                     "interpreter's (CPU); on a TPU use opt.loss_impl='xla'")
  hidden_TE = hidden_BLE.reshape(tokens, width)
  targets_T = targets_BL.reshape(tokens).astype(jnp.int32)
  mesh = jax.sharding.get_abstract_mesh()
  axes = None if mesh.empty else _batch_axes(tokens, mesh)
  shards = math.prod(mesh.shape[name] for name in
                     ((axes,) if isinstance(axes, str) else tuple(axes or ())))
  block_t = _power_of_two_at_most(max(16, tokens // shards), 64)
  block_v = min(64, max(16, 1 << (vocab - 1).bit_length()))
  blocks = -(-vocab // block_v)
  spans = min(blocks, -(-PROGRAMS // -(-tokens // shards // block_t)))
  span = -(-blocks // spans) * block_v
  spans = -(-vocab // span)  # No span of padding only.
  confidence, low, entropy = optim.smoothed_target(vocab, label_smoothing)
  settings = _Settings(vocab, span, block_t, block_v, _width_block(width, hidden_BLE.dtype),
                       float(confidence), float(low), float(entropy), platform == 'cpu',
                       spans * span, jnp.dtype(weight_VE.dtype).name)
  sums = _sums(settings, hidden_TE, weight_VE, targets_T)
  return {'loss': sums['loss'], **jax.lax.stop_gradient(
      {name: sums[name] for name in ('nll', 'correct', 'weight')})}
