"""Multi-head attention with its decode caches, the attention masks, and the implementations.

Shapes in names: B batch, Q queries, K keys, H heads, D head dim, E d_model.
"""

import functools
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError

Array = jax.Array
_NEG_INF = -1e9  # Large but finite, so rows with no visible key stay NaN-free.


ATTENTION_IMPLS = ('auto', 'einsum', 'xla', 'cudnn')


def resolve_attention_impl(impl: str, dtype, head_dim: int, attention_dropout: float,
                           platform: str) -> str:
  """The attention implementation to run: 'auto' picks the fastest verified one.

  'einsum' is the explicit softmax(QK^T)V with dropout on the weights; 'xla' and 'cudnn' go
  through `jax.nn.dot_product_attention` (cuDNN's fused flash attention on NVIDIA GPUs in
  bfloat16/float16 with head sizes up to 128 in multiples of 8). Neither fused one applies
  dropout to the attention weights, so they need config.model.attention_dropout=0. 'xla'
  runs the same arithmetic as 'einsum' (measured equal on CPU), so 'auto' is 'einsum' until
  cuDNN passes the equality test on a GPU (README, "Performance"); it logs why once.
  """
  if impl not in ATTENTION_IMPLS:
    raise ConfigError(f'config.model.attention_impl={impl!r} must be one of {ATTENTION_IMPLS}')
  cudnn_problem = (
      f'the platform is {platform}, not gpu' if platform != 'gpu' else
      f'config.model.dtype={jnp.dtype(dtype).name}, not bfloat16 or float16'
      if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) else
      f'the head size {head_dim} is not a multiple of 8 up to 128'
      if head_dim % 8 or head_dim > 128 else None)
  dropout_problem = (f'config.model.attention_dropout={attention_dropout} is not 0, and fused '
                     'attention has no dropout on its weights' if attention_dropout else None)
  if impl == 'auto':
    why_not = dropout_problem or cudnn_problem or (
        'cuDNN attention applies, but on an H100 with jax 0.11.2 it failed the equality test '
        "against einsum and was no faster at 64-token rows, so only an explicit 'cudnn' runs it")
    _log_once(f"config.model.attention_impl='auto' uses 'einsum' attention: {why_not}.")
    return 'einsum'
  problem = dropout_problem if impl != 'einsum' else None
  if impl == 'cudnn':
    problem = problem or cudnn_problem
  if problem:
    raise ConfigError(f'config.model.attention_impl={impl!r} cannot run: {problem}. Use '
                      "'auto' (which falls back) or change the setting named.")
  return impl


@functools.cache
def _log_once(message: str) -> None:
  logging.info('%s', message)


def attention_mask(key_valid_BK: Array, query_segments_BQ: Array | None = None,
                   key_segments_BK: Array | None = None, causal: bool = False) -> Array:
  """Boolean mask broadcastable to [B, 1, Q, K]: padded keys, other segments, later positions.

  Built once per batch, [B, 1, 1, K] when only padding matters. Padding queries are not
  masked: their outputs are never used, and a query (packed padding, segment 0) that sees
  some key keeps every softmax row well defined for the fused kernels.
  """
  mask_B11K = key_valid_BK[:, None, None, :]
  if query_segments_BQ is None and not causal:
    return mask_B11K
  mask_B1QK = mask_B11K
  if query_segments_BQ is not None:
    same_BQK = ((query_segments_BQ[:, :, None] == key_segments_BK[:, None, :])
                | (query_segments_BQ[:, :, None] == 0))
    mask_B1QK = mask_B1QK & same_BQK[:, None]
  if causal:
    length = key_valid_BK.shape[1]
    mask_B1QK = mask_B1QK & jnp.tril(jnp.ones((length, length), bool))[None, None]
  return mask_B1QK


def dense_init(names):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


class MultiHeadAttention(nn.Module):
  """Scaled dot-product attention with decode-mode caches.

  In decode mode self-attention keeps a key/value cache of the tokens so far, and
  cross-attention projects the encoder output to keys/values on its first call only and
  reads them from the cache afterwards (`memory_BKE` may then be None).
  """
  config: Any  # model.TransformerConfig
  self_attention_cache: bool = False
  memory_cache: bool = False  # Decoder cross-attention: cache the projected encoder output.

  @nn.compact
  def __call__(self, x_BQE: Array, memory_BKE: Array | None, mask_B1QK: Array | None) -> Array:
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    def kernel(name, shape, names, in_axis, out_axis):
      init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)
      return self.param(name, nn.with_logical_partitioning(init, names), shape,
                        cfg.param_dtype).astype(cfg.dtype)

    qkv_shape, qkv_names = (cfg.d_model, cfg.num_heads, head_dim), ('embed', 'heads', 'kv')
    def project(name, y_BKE):
      return jnp.einsum('BKE,EHD->BKHD', y_BKE.astype(cfg.dtype),
                        kernel(name, qkv_shape, qkv_names, 0, (1, 2)))

    q_BQHD = project('query', x_BQE) * head_dim**-0.5
    q_BQHD = nn.with_logical_constraint(q_BQHD, ('batch', 'length', 'heads', 'kv'))
    if cfg.decode and self.memory_cache:
      # The init function runs only while the cache lacks the entry: once per batch.
      k_BKHD = self.variable('cache', 'memory_key', project, 'key', memory_BKE).value
      v_BKHD = self.variable('cache', 'memory_value', project, 'value', memory_BKE).value
    else:
      k_BKHD, v_BKHD = project('key', memory_BKE), project('value', memory_BKE)

    if cfg.decode and self.self_attention_cache:
      k_BKHD, v_BKHD, mask_B1QK = self._update_cache(k_BKHD, v_BKHD, mask_B1QK)

    if cfg.attention_impl == 'einsum':
      logits_BHQK = jnp.einsum('BQHD,BKHD->BHQK', q_BQHD, k_BKHD).astype(jnp.float32)
      if mask_B1QK is not None:
        logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, _NEG_INF)
      weights_BHQK = jax.nn.softmax(logits_BHQK).astype(cfg.dtype)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
      weights_BHQK = nn.Dropout(cfg.attention_dropout)(weights_BHQK, cfg.deterministic)
      out_BQHD = jnp.einsum('BHQK,BKHD->BQHD', weights_BHQK, v_BKHD)
    else:
      # One query per decoding step is no work for a flash kernel: XLA's path serves it.
      impl = 'xla' if cfg.decode else cfg.attention_impl
      if impl == 'cudnn' and mask_B1QK is not None:  # cuDNN takes it as a [.., Q, K] bias.
        mask_B1QK = jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:2] + (q_BQHD.shape[1],
                                                                       k_BKHD.shape[1]))
      out_BQHD = jax.nn.dot_product_attention(q_BQHD, k_BKHD, v_BKHD, mask=mask_B1QK,
                                              scale=1.0, implementation=impl)
    w_out_HDE = kernel('out', (cfg.num_heads, head_dim, cfg.d_model), ('heads', 'kv', 'embed'),
                       (0, 1), 2)
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out_HDE)

  def _update_cache(self, k_B1HD, v_B1HD, mask_B1QK):
    """Writes this step's key/value at the cache index; returns the whole cache and its mask."""
    initialised = self.has_variable('cache', 'key')
    key = self.variable('cache', 'key', jnp.zeros, k_B1HD.shape, k_B1HD.dtype)
    value = self.variable('cache', 'value', jnp.zeros, v_B1HD.shape, v_B1HD.dtype)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not initialised:  # The init call only sizes the cache, from a full-length input.
      return k_B1HD, v_B1HD, mask_B1QK
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_B1HD, (0, i, 0, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_B1HD, (0, i, 0, 0))
    index.value = i + 1
    max_len = key.value.shape[1]
    mask_B1QK = (jnp.arange(max_len) <= i)[None, None, None, :]
    return key.value, value.value, mask_B1QK
