"""Multi-head self-attention and cross-attention modules, the attention masks, and the choice
of implementation. The arithmetic of each attention kind is in attention_variants.py, the
decode cache's bookkeeping in attention_cache.py.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import math
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax.model import attention_cache
from t2t_jax.model import attention_variants
from t2t_jax.model import flash_attention
from t2t_jax.model import pallas_attention
from t2t_jax.model import positions
from t2t_jax.model.attention_variants import ATTENTION_KINDS

Array = jax.Array
# The attention implementations that take their rows as segment ids (pallas_attention's
# SplashRows): splash attention and t2t_jax's flash kernels.
SEGMENT_ID_IMPLS = ('pallas', 'flash')


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

  In decode mode a decoder-only model's prefill passes one over its prompt, the first P keys
  of the cache (its right-padded source): `full_B1LL` [B, 1, Q, P] decides those keys for
  'full' layers (padding, and whether the prompt sees itself in full), `valid_BL` [B, P]
  marks the real ones for the other kinds. Its steps pass only `positions_BL` [B, 1]: each
  row's position, which is also the cache slot its token goes to; the slots before it hold
  the row's real tokens.
  """
  full_B1LL: Array | None
  valid_BL: Array | None  # False at padding.
  segments_BL: Array | None  # Packed rows: segment of each token (0: padding).
  positions_BL: Array | None  # Position of each token where it is not its index (relative).


def self_attention_mask(valid_BL: Array, segments_BL: Array | None, positions_BL: Array | None,
                        causal: bool, kinds: Sequence[str]) -> SelfMask:
  full_B1LL = (attention_mask(valid_BL, segments_BL, segments_BL, causal=causal)
               if 'full' in kinds else None)
  return SelfMask(full_B1LL, valid_BL, segments_BL, positions_BL)


class FusedLengths(NamedTuple):
  """Right-padded rows as fused attention takes them: real queries and keys per row [B]
  (None: every query), and whether a query sees only keys up to its own position."""
  query_B: Array | None
  key_B: Array
  causal: bool


def fused_lengths(key_valid_BK: Array, queries_too: bool, causal: bool) -> FusedLengths:
  """The lengths of rows whose real tokens come first (a bucketed, not packed, batch)."""
  key_B = key_valid_BK.sum(-1).astype(jnp.int32)
  return FusedLengths(key_B if queries_too else None, key_B, causal)


def attention_kinds(pattern: str) -> tuple[str, ...]:
  """config.model.attention_pattern as a tuple of kinds, repeated over the layers of a stack."""
  kinds = tuple(kind.strip() for kind in pattern.split(','))
  unknown = [kind for kind in kinds if kind not in ATTENTION_KINDS]
  if unknown:
    raise ConfigError(f'config.model.attention_pattern={pattern!r} names {unknown}: use a '
                      f'comma-separated list of {ATTENTION_KINDS}, e.g. \'local,compressed\'')
  return kinds


class _Attention(nn.Module):
  """The parameters and products self- and cross-attention share: query, key, value and output
  projections ([E, H, D] and [H, D, E] kernels) and the 'full' attention of Q queries over K
  keys, explicit or fused."""
  config: Any  # model_config.TransformerConfig

  def _kernel(self, name: str, shape, names, in_axis, out_axis, batch_axis=()) -> Array:
    cfg = self.config
    init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis,
                                          batch_axis=batch_axis)
    return self.param(name, nn.with_logical_partitioning(init, names), shape,
                      cfg.param_dtype).astype(cfg.dtype)

  def _project(self, name: str, y_BKE: Array, layout: str = 'BKHD', scale: float = 1.0) -> Array:
    cfg = self.config
    shape = (cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)
    kernel_EHD = self._kernel(name, shape, ('embed', 'heads', 'kv'), 0, (1, 2))
    if scale != 1.0:
      kernel_EHD = kernel_EHD * scale  # A Python float: the kernel keeps its dtype.
    return jnp.einsum(f'BKE,EHD->{layout}', y_BKE.astype(cfg.dtype), kernel_EHD)

  def _queries(self, x_BQE: Array) -> Array:
    """The queries [B, Q, H, D] scaled by 1/sqrt(D). Where that is a power of two (D = 64 in
    the paper's models, 4, 16, 256) the [E, H, D] kernel is scaled instead of the product:
    bit for bit the same, and XLA does not fuse a scaling of a matmul's output into the
    matmul, so it spares a pass over every query in both directions. Other head sizes scale
    the product, which the kernel's rounding would change."""
    scale = (self.config.d_model // self.config.num_heads)**-0.5
    if math.frexp(scale)[0] == 0.5:  # A power of two.
      q_BQHD = self._project('query', x_BQE, scale=scale)
    else:
      q_BQHD = self._project('query', x_BQE) * scale
    return nn.with_logical_constraint(q_BQHD, ('batch', 'length', 'heads', 'kv'))

  def _output(self, out_BQHD: Array) -> Array:
    cfg = self.config
    w_HDE = self._kernel('out', (cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.d_model),
                         ('heads', 'kv', 'embed'), (0, 1), 2)
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_HDE)

  def _drop(self, weights: Array) -> Array:
    return nn.Dropout(self.config.attention_dropout)(weights, self.config.deterministic)

  def _full_attention(self, q_BQHD, k_BKHD, v_BKHD, mask_B1QK, relative=None,
                      buckets_BQKR=None, bias_BHQK=None, lengths=None) -> Array:
    """Every query over every unmasked key: the explicit product (with dropout on the weights,
    relative positions and ALiBi's bias), or a fused kernel (see `_fused_attention` for
    `lengths`)."""
    if (self.config.attention_impl == 'einsum' or relative is not None
        or bias_BHQK is not None):
      out_BQHD, weights_BHQK = attention_variants.dense_attention(
          q_BQHD, k_BKHD, v_BKHD, mask_B1QK, self._drop, relative, buckets_BQKR, bias_BHQK)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
      return out_BQHD
    return self._fused_attention(q_BQHD, k_BKHD, v_BKHD, mask_B1QK, lengths)

  def _fused_attention(self, q_BQHD, k_BKHD, v_BKHD, mask_B1QK, lengths=None):
    """jax.nn.dot_product_attention (XLA's or cuDNN's) or splash attention ('pallas', which
    takes `lengths` as pallas_attention.SplashRows, padded or packed), no weight dropout; or
    t2t_jax's flash kernels ('flash', SplashRows too), with dropout on the weights.

    `lengths` (FusedLengths), given for right-padded rows, replaces the mask by sequence
    lengths: cuDNN then skips the padding itself, where a boolean mask would become a
    -2^41 bias over both sequence axes (with fully masked query rows a known source of wrong
    gradients in cuDNN before 9.26 on Hopper). Packed rows keep the mask.
    """
    # One query per decoding step is no work for a flash kernel: XLA's path serves it.
    impl = 'xla' if self.config.decode else self.config.attention_impl
    if impl == 'pallas':
      return pallas_attention.splash_attention(q_BQHD, k_BKHD, v_BKHD, lengths)
    if impl == 'flash':
      rate = 0.0 if self.config.deterministic else self.config.attention_dropout
      seed = jax.random.bits(self.make_rng('dropout'), (), jnp.uint32) if rate else None
      return flash_attention.flash_attention(q_BQHD, k_BKHD, v_BKHD, lengths, rate, seed)
    if lengths is not None and not self.config.decode:
      return jax.nn.dot_product_attention(
          q_BQHD, k_BKHD, v_BKHD, scale=1.0, is_causal=lengths.causal,
          query_seq_lengths=lengths.query_B, key_value_seq_lengths=lengths.key_B,
          implementation=impl)
    if impl == 'cudnn' and mask_B1QK is not None:  # cuDNN takes it as a [.., Q, K] bias.
      mask_B1QK = jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:2] + (q_BQHD.shape[1],
                                                                     k_BKHD.shape[1]))
    return jax.nn.dot_product_attention(q_BQHD, k_BKHD, v_BKHD, mask=mask_B1QK, scale=1.0,
                                        implementation=impl)


class CrossAttention(_Attention):
  """The decoder's attention over the encoder output `memory_BKE`, under `mask_B1QK`.

  In decode mode the memory is projected to keys and values on the first call only and read
  from the cache ('memory_key' [B, H, D, K], 'memory_value' [B, H, K, D]) afterwards, where
  `memory_BKE` may be None.
  Beam search keeps those entries at one row per sentence while the queries come one row per
  beam (N = B * W): the W beams of a sentence then share its keys and values.
  """

  @nn.compact
  def __call__(self, x_BQE: Array, memory_BKE: Array | None, mask_B1QK: Array | None) -> Array:
    q_BQHD = self._queries(x_BQE)
    if self.config.decode:
      # The init function runs only while the cache lacks the entry: once per batch.
      # Keys [B, H, D, K], as a step's product reads them (transposed once, not per step).
      k_BHDK = self.variable('cache', 'memory_key', lambda: self._project(
          'key', memory_BKE, 'BHKD').swapaxes(2, 3)).value
      v_BHKD = self.variable('cache', 'memory_value', self._project, 'value', memory_BKE,
                             'BHKD').value
      out_BQHD, weights_BHQK = attention_cache.shared_memory_attention(q_BQHD, k_BHDK, v_BHKD,
                                                                       mask_B1QK)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
      return self._output(out_BQHD)
    k_BKHD, v_BKHD = self._project('key', memory_BKE), self._project('value', memory_BKE)
    lengths = None
    if self.config.attention_impl in SEGMENT_ID_IMPLS and mask_B1QK is not None:
      lengths = pallas_attention.cross_rows(mask_B1QK, q_BQHD.shape[1])
    elif (self.config.attention_impl != 'einsum' and mask_B1QK is not None
          and mask_B1QK.shape[2] == 1):  # Source padding only: not packed.
      lengths = fused_lengths(mask_B1QK[:, 0, 0, :], queries_too=False, causal=False)
    return self._output(self._full_attention(q_BQHD, k_BKHD, v_BKHD, mask_B1QK,
                                             lengths=lengths))


class SelfAttention(_Attention):
  """Self-attention of one `kind` ('full', 'local', 'compressed', see attention_variants.py),
  with relative positions if asked, and (`cached`, in decode mode) a key/value cache.

  `mask` is the batch's SelfMask. In decode mode it is None, or a decoder-only model's (over
  its prompt in the prefill, each row's position in a step); each call writes its tokens (one
  step, or the whole prompt) to the cache and attends to everything cached so far under this
  kind's neighbourhood mask, which equals what teacher forcing computes.
  """
  kind: str = 'full'
  causal: bool = False  # The decoder's ('local' and 'compressed' need it).
  relative: bool = False  # config.model.positions='relative'.
  cached: bool = False  # The decoder's: keep a decode cache.

  @nn.compact
  def __call__(self, x_BQE: Array, mask: SelfMask | None) -> Array:
    cfg = self.config
    q_BQHD = self._queries(x_BQE)
    cached = cfg.decode and self.cached
    # Decode caches are heads-major ([B, H, K, D]), the layout the step's products read:
    # stored [B, K, H, D], every step would transpose every layer's whole cache first.
    # Rotary keys are turned first, in [B, K, H, D], then cached heads-major.
    layout = 'BHKD' if cached and cfg.positions != 'rotary' else 'BKHD'
    key, value = self._project('key', x_BQE, layout), self._project('value', x_BQE, layout)
    relative = self._relative_tables() if self.relative else None
    compression_ZHDD = ([self._kernel(f'compress_{name}', (
        cfg.compression_stride, cfg.num_heads, cfg.d_model // cfg.num_heads,
        cfg.d_model // cfg.num_heads), (None, 'heads', 'kv', None), (0, 2), 3, 1)
                         for name in ('key', 'value')] if self.kind == 'compressed' else None)
    if cached:
      out_BQHD = self._cached_attention(q_BQHD, key, value, mask, relative, compression_ZHDD)
    else:
      out_BQHD = self._training_attention(q_BQHD, key, value, mask, relative, compression_ZHDD)
    return self._output(out_BQHD)

  def _training_attention(self, q_BQHD, k_BKHD, v_BKHD, mask: SelfMask, relative,
                          compression_ZHDD) -> Array:
    """Teacher forcing (and the encoder): this kind's attention over the whole sequence."""
    cfg = self.config
    positions_BL = mask.positions_BL
    if positions_BL is None:  # Every row alike: one row of positions, broadcast.
      positions_BL = jnp.arange(q_BQHD.shape[1])[None]
    if cfg.positions == 'rotary':
      q_BQHD = positions.rotary(q_BQHD, positions_BL)
      k_BKHD = positions.rotary(k_BKHD, positions_BL)
    slopes_H = positions.alibi_slopes(cfg.num_heads) if cfg.positions == 'alibi' else None
    if self.kind == 'local':
      return attention_variants.local_attention(
          q_BQHD, k_BKHD, v_BKHD, mask.valid_BL, mask.segments_BL, mask.positions_BL,
          cfg.local_half_width, self.causal, self._drop, relative, slopes_H)
    if self.kind == 'compressed':
      return attention_variants.compressed_attention(
          q_BQHD, k_BKHD, v_BKHD, mask.valid_BL, mask.segments_BL, cfg.compression_stride,
          self.causal, *compression_ZHDD, self._drop)
    buckets_BQKR = bias_BHQK = None
    if relative is not None:
      buckets_BQKR = attention_variants.relative_buckets(
          positions_BL, positions_BL, relative.max_distance, cfg.dtype)
    if slopes_H is not None:
      bias_BHQK = positions.alibi_bias(positions_BL, positions_BL, slopes_H)
    lengths = None
    if cfg.attention_impl in SEGMENT_ID_IMPLS and not cfg.decode:  # Padded or packed, any kind.
      lengths = pallas_attention.self_rows(mask.valid_BL, mask.segments_BL, self.causal)
    elif (cfg.attention_impl != 'einsum' and mask.segments_BL is None
          and cfg.kind == 'encoder_decoder'):  # Right-padded rows.
      lengths = fused_lengths(mask.valid_BL, queries_too=True, causal=self.causal)
    return self._full_attention(q_BQHD, k_BKHD, v_BKHD, mask.full_B1LL, relative, buckets_BQKR,
                                bias_BHQK, lengths)

  def _relative_tables(self) -> attention_variants.Relative:
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    table_init = nn.with_logical_partitioning(nn.initializers.normal(head_dim**-0.5),
                                              (None, 'kv'))
    tables = [self.param(f'relative_{name}', table_init,
                         (2 * cfg.max_relative_distance + 1, head_dim),
                         cfg.param_dtype).astype(cfg.dtype) for name in ('key', 'value')]
    return attention_variants.Relative(*tables, cfg.max_relative_distance)

  def _cached_attention(self, q_BQHD, key, value, mask: SelfMask | None, relative,
                        compression_ZHDD) -> Array:
    """Decode mode: this call's Q tokens go into the cache, then attend to it.

    `key` and `value` are this call's projections, [B, H, Q, D], or [B, Q, H, D] under rotary
    positions: those keys are turned by their positions before they are cached heads-major.
    """
    cfg = self.config
    rotary = cfg.positions == 'rotary'
    if rotary:
      value = value.transpose(0, 2, 1, 3)
    initialised = self.has_variable('cache', 'index')
    slots_BQ = None if mask is None else mask.positions_BL
    index, positions_BQ = self._positions(value.shape[2], slots_BQ)
    key_BHQD = positions.rotary(key, positions_BQ).transpose(0, 2, 1, 3) if rotary else key
    if not initialised:  # The init call, which only sizes the caches.
      self._size_cache(key_BHQD, value)
      return attention_cache.RowCache(key_BHQD, value).attend(q_BQHD, None)[0]
    cached = self._update_cache(key_BHQD, value, index, slots_BQ)
    length = cached.length
    if rotary:
      q_BQHD = positions.rotary(q_BQHD, positions_BQ)
    prompt = mask if slots_BQ is None else None  # A decoder-only model's prefill.
    mask_B1QK, compressed_B1QM, key_valid_BK = attention_cache.cached_mask(
        self.kind, positions_BQ, length, prompt, q_BQHD.shape[0], cfg.local_half_width,
        cfg.compression_stride)
    if self.kind == 'compressed':
      entries = self._compressed_cache(cached.key_BHKD.shape)
      for entry, raw_BHKD, kernel_ZHDD in zip(entries, cached, compression_ZHDD):
        entry.value = attention_cache.recompress(entry.value, raw_BHKD, positions_BQ,
                                                 kernel_ZHDD, key_valid_BK, cfg.compression_stride)
      cached = attention_cache.RowCache(
          *(jnp.concatenate([entry.value, raw_BHKD], axis=2)
            for entry, raw_BHKD in zip(entries, cached)))
      mask_B1QK = jnp.concatenate([
          jnp.broadcast_to(compressed_B1QM, mask_B1QK.shape[:3] + compressed_B1QM.shape[-1:]),
          jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:3] + (mask_B1QK.shape[-1],))], axis=-1)
    buckets_BQKR = bias_BHQK = None
    key_positions_1K = jnp.arange(length)[None]  # A cached token's slot is its position.
    if relative is not None:
      buckets_BQKR = attention_variants.relative_buckets(
          positions_BQ, key_positions_1K, relative.max_distance, cfg.dtype)
    if cfg.positions == 'alibi':
      bias_BHQK = positions.alibi_bias(positions_BQ, key_positions_1K,
                                       positions.alibi_slopes(cfg.num_heads))
    out_BQHD, weights_BHQK = cached.attend(q_BQHD, mask_B1QK, relative, buckets_BQKR, bias_BHQK)
    self.sow('intermediates', 'attention_weights', weights_BHQK)
    return out_BQHD

  def _positions(self, queries: int, slots_BQ: Array | None):
    """The cache index (the variable counting the tokens cached so far) and this call's
    tokens' positions [1 or B, Q], which are also their cache slots: from the index on, or row
    b's from `slots_BQ[b, 0]` on (a decoder-only model's steps, rows of unequal sources)."""
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    return index, (index.value + jnp.arange(queries))[None] if slots_BQ is None else slots_BQ

  def _size_cache(self, key_BHQD: Array, value_BHQD: Array) -> None:
    """The init call's zeroed caches, one slot per token it was given (for 'compressed',
    whole blocks)."""
    length = attention_cache.cache_length(key_BHQD.shape[2], self.kind,
                                          self.config.compression_stride)
    shape = key_BHQD.shape[:2] + (length,) + key_BHQD.shape[3:]
    self.variable('cache', 'key', jnp.zeros, shape, key_BHQD.dtype)
    self.variable('cache', 'value', jnp.zeros, shape, value_BHQD.dtype)
    if self.kind == 'compressed':
      self._compressed_cache(shape)

  def _update_cache(self, key_BHQD: Array, value_BHQD: Array, index, slots_BQ: Array | None):
    """Writes this call's keys and values at their slots (`_positions`) and moves the index
    past them. Returns what the call reads: the written attention_cache.RowCache, or in beam
    search (an attention_cache.BeamCache entry, decode.py) the BeamStep of the cache as it was
    handed over, which the write then updates in place."""
    slot = index.value
    index.value = slot + key_BHQD.shape[2]
    if self.has_variable('cache', attention_cache.BEAM_ENTRY):
      beam = self.variable('cache', attention_cache.BEAM_ENTRY)
      beam.value, step = beam.value.write(key_BHQD, value_BHQD, slot)
      return step
    key, value = self.variable('cache', 'key'), self.variable('cache', 'value')
    key.value = attention_cache.write(key.value, key_BHQD, slot, slots_BQ)
    value.value = attention_cache.write(value.value, value_BHQD, slot, slots_BQ)
    return attention_cache.RowCache(key.value, value.value)

  def _compressed_cache(self, shape_BHKD):
    """The cache entries of compressed keys and values, one per block of the raw cache."""
    stride = self.config.compression_stride
    shape_BHMD = shape_BHKD[:2] + (-(-shape_BHKD[2] // stride), shape_BHKD[3])
    return [self.variable('cache', f'compressed_{name}', jnp.zeros, shape_BHMD,
                          self.config.dtype) for name in ('key', 'value')]
