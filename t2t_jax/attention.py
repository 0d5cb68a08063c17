"""Multi-head attention with its parameters and decode caches, the attention masks, and the
choice of implementation; the arithmetic of each attention kind is in attention_variants.py.

Shapes in names: B batch, Q queries, K keys, H heads, D head dim, E d_model.
"""

import functools
from typing import Any, NamedTuple, Sequence

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax import attention_variants
from t2t_jax.attention_variants import ATTENTION_KINDS

Array = jax.Array


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


class SelfMask(NamedTuple):
  """What self-attention masks by, built once per batch: the whole mask of 'full' layers
  (None when no layer is full) and the per-token facts the other kinds build theirs from."""
  full_B1LL: Array | None
  valid_BL: Array  # False at padding.
  segments_BL: Array | None  # Packed rows: segment of each token (0: padding).
  positions_BL: Array | None  # Packed rows: position within the segment (relative attention).


def self_attention_mask(valid_BL: Array, segments_BL: Array | None, positions_BL: Array | None,
                        causal: bool, kinds: Sequence[str]) -> SelfMask:
  full_B1LL = (attention_mask(valid_BL, segments_BL, segments_BL, causal=causal)
               if 'full' in kinds else None)
  return SelfMask(full_B1LL, valid_BL, segments_BL, positions_BL)


def attention_kinds(pattern: str) -> tuple[str, ...]:
  """config.model.attention_pattern as a tuple of kinds, repeated over the layers of a stack."""
  kinds = tuple(kind.strip() for kind in pattern.split(','))
  unknown = [kind for kind in kinds if kind not in ATTENTION_KINDS]
  if unknown:
    raise ConfigError(f'config.model.attention_pattern={pattern!r} names {unknown}: use a '
                      f'comma-separated list of {ATTENTION_KINDS}, e.g. \'local,compressed\'')
  return kinds


def check_family(config) -> None:
  """Raises ConfigError when the attention keys of a model.TransformerConfig cannot run together."""
  kinds = attention_kinds(config.attention_pattern)
  for key in ('local_window', 'compression_stride', 'max_relative_distance'):
    if getattr(config, key) < 1:
      raise ConfigError(f'config.model.{key}={getattr(config, key)!r} must be at least 1')
  pattern = f'config.model.attention_pattern={config.attention_pattern!r}'
  if config.positions == 'relative' and 'compressed' in kinds:
    raise ConfigError(f"config.model.positions='relative' cannot be used with {pattern}: a "
                      "compressed key summarises several positions. Use 'full' or 'local' "
                      'layers, or other positions.')
  fused = f'config.model.attention_impl={config.attention_impl!r}'
  if config.attention_impl != 'einsum' and config.positions == 'relative':
    raise ConfigError(f"{fused} (fused) cannot add relative positions "
                      "(config.model.positions='relative'): set attention_impl to 'einsum' or "
                      "'auto'.")
  if config.attention_impl != 'einsum' and set(kinds) != {'full'}:
    raise ConfigError(f"{fused} (fused) runs 'full' attention only, and {pattern} asks for "
                      "others, which compute their own: set attention_impl to 'einsum' or "
                      "'auto'.")
  if config.scan_layers and len(set(kinds)) > 1:
    raise ConfigError(f'config.model.scan_layers=True compiles one layer for a whole stack, so '
                      f'every layer needs the same kind, but {pattern} mixes them: set '
                      'scan_layers=False or use one kind.')


def dense_init(names):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


class MultiHeadAttention(nn.Module):
  """Scaled dot-product attention of one `kind` ('full', 'local', 'compressed', see
  attention_variants.py), with relative positions if asked, and decode-mode caches.

  In decode mode self-attention keeps a key/value cache of the tokens so far (and, for
  'compressed', the compressed blocks), and cross-attention projects the encoder output to
  keys/values on its first call only and reads them from the cache afterwards (`memory_BKE`
  may then be None). `mask` is a SelfMask for self-attention (None in decode mode) and a
  [B, 1, Q, K] array for cross-attention.
  """
  config: Any  # model.TransformerConfig
  self_attention_cache: bool = False
  memory_cache: bool = False  # Decoder cross-attention: cache the projected encoder output.
  kind: str = 'full'
  causal: bool = False  # Self-attention of the decoder ('local' and 'compressed' need it).
  relative: bool = False  # Self-attention with config.model.positions='relative'.

  @nn.compact
  def __call__(self, x_BQE: Array, memory_BKE: Array | None,
               mask: SelfMask | Array | None) -> Array:
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    def kernel(name, shape, names, in_axis, out_axis, batch_axis=()):
      init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis,
                                            batch_axis=batch_axis)
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

    relative = None
    if self.relative:
      table_init = nn.with_logical_partitioning(nn.initializers.normal(head_dim**-0.5),
                                                (None, 'kv'))
      tables = [self.param(f'relative_{name}', table_init,
                           (2 * cfg.max_relative_distance + 1, head_dim),
                           cfg.param_dtype).astype(cfg.dtype) for name in ('key', 'value')]
      relative = attention_variants.Relative(*tables, cfg.max_relative_distance)
    compression = None
    if self.kind == 'compressed':
      shape = (cfg.compression_stride, cfg.num_heads, head_dim, head_dim)
      compression = [kernel(f'compress_{name}', shape, (None, 'heads', 'kv', None), (0, 2), 3,
                            1) for name in ('key', 'value')]
    drop = lambda w: nn.Dropout(cfg.attention_dropout)(w, cfg.deterministic)
    mask_B1QK = mask.full_B1LL if isinstance(mask, SelfMask) else mask

    query_index_Q = None
    if cfg.decode and self.self_attention_cache:
      k_BKHD, v_BKHD, query_index_Q = self._update_cache(k_BKHD, v_BKHD)
      if query_index_Q is None:  # The init call, which only sizes the caches.
        mask = SelfMask(None, jnp.ones(k_BKHD.shape[:2], bool), None, None)
        if self.kind == 'compressed':
          self._compressed_cache(k_BKHD.shape)
    if query_index_Q is not None:
      out_BQHD = self._cached_attention(q_BQHD, k_BKHD, v_BKHD, query_index_Q, relative,
                                        compression, drop)
    elif self.kind == 'local':
      out_BQHD = attention_variants.local_attention(
          q_BQHD, k_BKHD, v_BKHD, mask.valid_BL, mask.segments_BL, mask.positions_BL,
          cfg.local_window, self.causal, drop, relative)
    elif self.kind == 'compressed':
      out_BQHD = attention_variants.compressed_attention(
          q_BQHD, k_BKHD, v_BKHD, mask.valid_BL, mask.segments_BL, cfg.compression_stride,
          self.causal, *compression, drop)
    elif cfg.attention_impl == 'einsum' or relative:
      buckets_BQKR = None
      if relative:
        positions_BL = mask.positions_BL
        if positions_BL is None:  # Every row alike: one row of buckets, broadcast.
          positions_BL = jnp.arange(q_BQHD.shape[1])[None]
        buckets_BQKR = attention_variants.relative_buckets(
            positions_BL, positions_BL, relative.max_distance, cfg.dtype)
      out_BQHD, weights_BHQK = attention_variants.dense_attention(
          q_BQHD, k_BKHD, v_BKHD, mask_B1QK, drop, relative, buckets_BQKR)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
    else:
      out_BQHD = self._fused_attention(q_BQHD, k_BKHD, v_BKHD, mask_B1QK)
    w_out_HDE = kernel('out', (cfg.num_heads, head_dim, cfg.d_model), ('heads', 'kv', 'embed'),
                       (0, 1), 2)
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out_HDE)

  def _fused_attention(self, q_BQHD, k_BKHD, v_BKHD, mask_B1QK):
    """jax.nn.dot_product_attention: XLA's or cuDNN's, no dropout on the weights."""
    # One query per decoding step is no work for a flash kernel: XLA's path serves it.
    impl = 'xla' if self.config.decode else self.config.attention_impl
    if impl == 'cudnn' and mask_B1QK is not None:  # cuDNN takes it as a [.., Q, K] bias.
      mask_B1QK = jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:2] + (q_BQHD.shape[1],
                                                                     k_BKHD.shape[1]))
    return jax.nn.dot_product_attention(q_BQHD, k_BKHD, v_BKHD, mask=mask_B1QK, scale=1.0,
                                        implementation=impl)

  def _cached_attention(self, q_BQHD, k_BKHD, v_BKHD, query_index_Q, relative, compression,
                        drop):
    """Decode mode: the queries at `query_index_Q` attend to the whole cache under the
    neighbourhood mask of this kind, which equals what teacher forcing computes."""
    cfg = self.config
    raw_QK, compressed_QM = attention_variants.cached_masks(
        self.kind, query_index_Q, k_BKHD.shape[1], cfg.local_window, cfg.compression_stride)
    if self.kind == 'compressed':
      compressed_k_BMHD, compressed_v_BMHD = self._update_compressed_cache(
          k_BKHD, v_BKHD, query_index_Q, compression)
      k_BKHD = jnp.concatenate([compressed_k_BMHD, k_BKHD], axis=1)
      v_BKHD = jnp.concatenate([compressed_v_BMHD, v_BKHD], axis=1)
      raw_QK = jnp.concatenate([compressed_QM, raw_QK], axis=1)
    buckets_BQKR = None
    if relative:
      buckets_BQKR = attention_variants.relative_buckets(
          query_index_Q[None], jnp.arange(k_BKHD.shape[1])[None], relative.max_distance,
          cfg.dtype)
    if cfg.attention_impl != 'einsum' and not relative and self.kind == 'full':
      return self._fused_attention(q_BQHD, k_BKHD, v_BKHD, raw_QK[None, None])
    out_BQHD, _ = attention_variants.dense_attention(q_BQHD, k_BKHD, v_BKHD, raw_QK[None, None],
                                                     drop, relative, buckets_BQKR)
    return out_BQHD

  def _update_cache(self, k_BQHD, v_BQHD):
    """Writes these steps' keys/values at the cache index; returns the whole cache and the
    steps' indices, or, in the init call that only sizes the cache, the inputs and None."""
    initialised = self.has_variable('cache', 'key')
    length, stride = k_BQHD.shape[1], self.config.compression_stride
    if self.kind == 'compressed':  # Whole blocks, so the last one can be compressed.
      length = -(-length // stride) * stride
    shape = k_BQHD.shape[:1] + (length,) + k_BQHD.shape[2:]
    key = self.variable('cache', 'key', jnp.zeros, shape, k_BQHD.dtype)
    value = self.variable('cache', 'value', jnp.zeros, shape, v_BQHD.dtype)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not initialised:
      return k_BQHD, v_BQHD, None
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_BQHD, (0, i, 0, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BQHD, (0, i, 0, 0))
    index.value = i + k_BQHD.shape[1]
    return key.value, value.value, i + jnp.arange(k_BQHD.shape[1])

  def _compressed_cache(self, shape_BKHD):
    """The cache entries of compressed keys and values, one per block of the raw cache."""
    stride = self.config.compression_stride
    shape_BMHD = (shape_BKHD[0], -(-shape_BKHD[1] // stride)) + tuple(shape_BKHD[2:])
    return [self.variable('cache', f'compressed_{name}', jnp.zeros, shape_BMHD,
                          self.config.dtype) for name in ('key', 'value')]

  def _update_compressed_cache(self, k_BKHD, v_BKHD, query_index_Q, compression):
    """Compresses the blocks just written to: one step recompresses only its own block (a
    partial block stays masked until it is complete); several steps recompress them all."""
    stride = self.config.compression_stride
    blocks_shape = (k_BKHD.shape[0], k_BKHD.shape[1] // stride, stride) + k_BKHD.shape[2:]
    entries = self._compressed_cache(k_BKHD.shape)
    for entry, raw_BKHD, kernel_SHDD in zip(entries, (k_BKHD, v_BKHD), compression):
      if query_index_Q.shape[0] > 1:
        entry.value = attention_variants.compress(raw_BKHD.reshape(blocks_shape), kernel_SHDD)
      else:
        block = query_index_Q[0] // stride
        raw_B1SHD = jax.lax.dynamic_slice_in_dim(raw_BKHD, block * stride, stride, 1)[:, None]
        entry.value = jax.lax.dynamic_update_slice_in_dim(
            entry.value, attention_variants.compress(raw_B1SHD, kernel_SHDD), block, 1)
    return [entry.value for entry in entries]
