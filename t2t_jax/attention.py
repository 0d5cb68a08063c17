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
  cuDNN passes the equality test on a GPU (docs/performance.md); it logs why once.
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
  (None when no layer is full) and the per-token facts the other kinds build theirs from.

  In decode mode a decoder-only model passes one over its prompt, the first P keys of the
  cache (its right-padded source): `full_B1LL` [B, 1, Q, P] decides those keys for 'full'
  layers (padding, and whether the prompt sees itself in full), `valid_BL` [B, P] marks the
  real ones for the other kinds; the keys after the prompt are real and causal.
  """
  full_B1LL: Array | None
  valid_BL: Array  # False at padding.
  segments_BL: Array | None  # Packed rows: segment of each token (0: padding).
  positions_BL: Array | None  # Position of each token where it is not its index (relative).


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
  if (config.kind == 'decoder_only' and config.prefix_attention == 'full'
      and set(kinds) != {'full'}):
    raise ConfigError(f"config.model.prefix_attention='full' (the source sees later source "
                      f"positions) needs 'full' layers, and {pattern} asks for others, which "
                      "are causal throughout the decoder-only stack: set prefix_attention to "
                      "'causal' or attention_pattern to 'full'.")
  if config.scan_layers and len(set(kinds)) > 1:
    raise ConfigError(f'config.model.scan_layers=True compiles one layer for a whole stack, so '
                      f'every layer needs the same kind, but {pattern} mixes them: set '
                      'scan_layers=False or use one kind.')


def dense_init(names):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


class MultiHeadAttention(nn.Module):
  """Scaled dot-product attention of one `kind` ('full', 'local', 'compressed', see
  attention_variants.py), with relative positions if asked, and decode-mode caches.

  In decode mode self-attention keeps a heads-major key/value cache of the tokens so far
  (and, for 'compressed', the compressed blocks); a call writes one token (a step) or
  several (a decoder-only model's prompt). Cross-attention projects the encoder output to
  keys/values on its first call only and reads them from the cache afterwards (`memory_BKE`
  may then be None). `mask` is a SelfMask for self-attention (in decode mode None, or one
  over a decoder-only model's prompt) and a [B, 1, Q, K] array for cross-attention.
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
    def project(name, y_BKE, layout='BKHD'):
      return jnp.einsum(f'BKE,EHD->{layout}', y_BKE.astype(cfg.dtype),
                        kernel(name, qkv_shape, qkv_names, 0, (1, 2)))

    q_BQHD = project('query', x_BQE) * head_dim**-0.5
    q_BQHD = nn.with_logical_constraint(q_BQHD, ('batch', 'length', 'heads', 'kv'))
    w_out = lambda: kernel('out', (cfg.num_heads, head_dim, cfg.d_model),
                           ('heads', 'kv', 'embed'), (0, 1), 2)
    if cfg.decode and self.memory_cache:
      # The init function runs only while the cache lacks the entry: once per batch.
      k_BHKD = self.variable('cache', 'memory_key', project, 'key', memory_BKE, 'BHKD').value
      v_BHKD = self.variable('cache', 'memory_value', project, 'value', memory_BKE,
                             'BHKD').value
      out_BQHD, weights_BHQK = attention_variants.cached_attention(q_BQHD, k_BHKD, v_BHKD, mask)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
      return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out())
    cached = cfg.decode and self.self_attention_cache
    if cached:
      # Decode caches are heads-major ([B, H, K, D]), the layout the step's products read:
      # stored [B, K, H, D], every step would transpose every layer's whole cache first.
      k_BHQD = project('key', memory_BKE, 'BHKD')
      v_BHQD = project('value', memory_BKE, 'BHKD')
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

    if cached:
      out_BQHD = self._cached_attention(q_BQHD, k_BHQD, v_BHQD, mask, relative, compression)
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
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out())

  def _fused_attention(self, q_BQHD, k_BKHD, v_BKHD, mask_B1QK):
    """jax.nn.dot_product_attention: XLA's or cuDNN's, no dropout on the weights."""
    # One query per decoding step is no work for a flash kernel: XLA's path serves it.
    impl = 'xla' if self.config.decode else self.config.attention_impl
    if impl == 'cudnn' and mask_B1QK is not None:  # cuDNN takes it as a [.., Q, K] bias.
      mask_B1QK = jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:2] + (q_BQHD.shape[1],
                                                                     k_BKHD.shape[1]))
    return jax.nn.dot_product_attention(q_BQHD, k_BKHD, v_BKHD, mask=mask_B1QK, scale=1.0,
                                        implementation=impl)

  def _cached_attention(self, q_BQHD, k_BHQD, v_BHQD, prompt: SelfMask | None, relative,
                        compression) -> Array:
    """Decode mode: this call's Q tokens (one step, or a decoder-only model's whole prompt)
    go into the cache, then attend to it under this kind's neighbourhood mask, which equals
    what teacher forcing computes. `prompt` governs the first keys (see SelfMask)."""
    cfg = self.config
    k_BHKD, v_BHKD, query_index_Q = self._update_cache(k_BHQD, v_BHQD)
    if query_index_Q is None:  # The init call, which only sizes the caches.
      return attention_variants.cached_attention(q_BQHD, k_BHKD, v_BHKD, None)[0]
    rows, cache_length = k_BHKD.shape[0], k_BHKD.shape[2]
    raw_QK, compressed_QM = attention_variants.cached_masks(
        self.kind, query_index_Q, cache_length, cfg.local_window, cfg.compression_stride)
    mask_B1QK, key_valid_BK = raw_QK[None, None], None
    if prompt is not None:
      prompt_length, queries = prompt.valid_BL.shape[1], query_index_Q.shape[0]
      rows = max(rows, prompt.valid_BL.shape[0])
      key_valid_BK = jnp.concatenate([
          prompt.valid_BL, jnp.ones((prompt.valid_BL.shape[0], cache_length - prompt_length),
                                    bool)], axis=1)
      if self.kind == 'full':  # The caller's mask: padding, and a prompt seen in full or not.
        prompt_B1QP = prompt.full_B1LL
      else:
        prompt_B1QP = raw_QK[None, None, :, :prompt_length] & prompt.valid_BL[:, None, None, :]
      later_B1QK = jnp.broadcast_to(raw_QK[None, None, :, prompt_length:],
                                    (rows, 1, queries, cache_length - prompt_length))
      mask_B1QK = jnp.concatenate([
          jnp.broadcast_to(prompt_B1QP, (rows, 1, queries, prompt_length)), later_B1QK], axis=-1)
    if self.kind == 'compressed':
      compressed_k_BHMD, compressed_v_BHMD = self._update_compressed_cache(
          k_BHKD, v_BHKD, query_index_Q, compression, key_valid_BK)
      k_BHKD = jnp.concatenate([compressed_k_BHMD, k_BHKD], axis=2)
      v_BHKD = jnp.concatenate([compressed_v_BHMD, v_BHKD], axis=2)
      compressed_B1QM = compressed_QM[None, None]
      if key_valid_BK is not None:  # Blocks of padding only are hidden, as in training.
        blocks_BM = key_valid_BK.reshape(rows, -1, cfg.compression_stride).any(-1)
        compressed_B1QM = compressed_B1QM & blocks_BM[:, None, None, :]
      mask_B1QK = jnp.concatenate([
          jnp.broadcast_to(compressed_B1QM, mask_B1QK.shape[:3] + compressed_QM.shape[-1:]),
          jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:3] + (cache_length,))], axis=-1)
    buckets_BQKR = None
    if relative:
      query_positions_BQ, key_positions_BK = query_index_Q[None], jnp.arange(cache_length)[None]
      if prompt is not None:
        # Right-padded prompts: the tokens after the prompt follow its last real token.
        padding_B1 = prompt_length - prompt.valid_BL.sum(-1, keepdims=True)
        key_positions_BK -= jnp.where(key_positions_BK >= prompt_length, padding_B1, 0)
        query_positions_BQ -= jnp.where(query_positions_BQ >= prompt_length, padding_B1, 0)
      buckets_BQKR = attention_variants.relative_buckets(
          query_positions_BQ, key_positions_BK, relative.max_distance, cfg.dtype)
    out_BQHD, weights_BHQK = attention_variants.cached_attention(
        q_BQHD, k_BHKD, v_BHKD, mask_B1QK, relative, buckets_BQKR)
    self.sow('intermediates', 'attention_weights', weights_BHQK)
    return out_BQHD

  def _update_cache(self, k_BHQD, v_BHQD):
    """Writes this call's Q keys/values from the cache index on; returns the whole cache and
    their indices, or, in the init call that only sizes the caches, the inputs and None."""
    initialised = self.has_variable('cache', 'key')
    length, stride = k_BHQD.shape[2], self.config.compression_stride
    if self.kind == 'compressed':  # Whole blocks, so the last one can be compressed.
      length = -(-length // stride) * stride
    shape = k_BHQD.shape[:2] + (length,) + k_BHQD.shape[3:]
    key = self.variable('cache', 'key', jnp.zeros, shape, k_BHQD.dtype)
    value = self.variable('cache', 'value', jnp.zeros, shape, v_BHQD.dtype)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not initialised:
      if self.kind == 'compressed':
        self._compressed_cache(shape)
      return k_BHQD, v_BHQD, None
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_BHQD, (0, 0, i, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BHQD, (0, 0, i, 0))
    index.value = i + k_BHQD.shape[2]
    return key.value, value.value, i + jnp.arange(k_BHQD.shape[2])

  def _compressed_cache(self, shape_BHKD):
    """The cache entries of compressed keys and values, one per block of the raw cache."""
    stride = self.config.compression_stride
    shape_BHMD = shape_BHKD[:2] + (-(-shape_BHKD[2] // stride), shape_BHKD[3])
    return [self.variable('cache', f'compressed_{name}', jnp.zeros, shape_BHMD,
                          self.config.dtype) for name in ('key', 'value')]

  def _update_compressed_cache(self, k_BHKD, v_BHKD, query_index_Q, compression,
                               key_valid_BK):
    """Compresses the blocks just written to: one step recompresses only its own block (a
    partial block stays masked until it is complete); several steps recompress them all.
    Padded prompt keys (`key_valid_BK` False) are zeroed first, as training zeroes them."""
    stride = self.config.compression_stride
    batch, heads, length, head_dim = k_BHKD.shape
    entries = self._compressed_cache(k_BHKD.shape)
    for entry, raw_BHKD, kernel_SHDD in zip(entries, (k_BHKD, v_BHKD), compression):
      if key_valid_BK is not None:
        raw_BHKD = raw_BHKD * key_valid_BK[:, None, :, None].astype(raw_BHKD.dtype)
      if query_index_Q.shape[0] > 1:
        blocks_BHMSD = raw_BHKD.reshape(batch, heads, length // stride, stride, head_dim)
        entry.value = attention_variants.compress_cached(blocks_BHMSD, kernel_SHDD)
      else:
        block = query_index_Q[0] // stride
        raw_BHSD = jax.lax.dynamic_slice_in_dim(raw_BHKD, block * stride, stride, 2)
        entry.value = jax.lax.dynamic_update_slice_in_dim(
            entry.value, attention_variants.compress_cached(raw_BHSD[:, :, None], kernel_SHDD),
            block, 2)
    return [entry.value for entry in entries]
