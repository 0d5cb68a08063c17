"""The attention arithmetic of the model family: dense, restricted (local), memory-compressed,
and relative-position terms. Pure functions; attention.py owns the parameters and caches.

Shapes in names follow the package legend (t2t_jax/__init__.py): here G blocks of queries,
M compressed blocks of keys, Z tokens per compressed block (the stride), R relative distances
(2k + 1). A leading `...` stands for batch axes (B, or B and G).
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from t2t_jax.model import positions

Array = jax.Array
NEG_INF = -1e9  # Large but finite, so rows with no visible key stay NaN-free.
ATTENTION_KINDS = ('full', 'local', 'compressed')


class Relative(NamedTuple):
  """Shaw et al. (2018): learned embeddings of the clipped distance key - query, per layer."""
  key_RD: Array  # Added to the keys in the logits.
  value_RD: Array  # Added to the values in the output.
  max_distance: int  # k: distances beyond +-k share the embedding of +-k.


def relative_buckets(query_positions_xQ: Array, key_positions_xK: Array, max_distance: int,
                     dtype) -> Array:
  """One-hot [..., Q, K, R] of clip(key - query, -k, k): which embedding each pair adds."""
  distance_xQK = key_positions_xK[..., None, :] - query_positions_xQ[..., :, None]
  clipped_xQK = jnp.clip(distance_xQK, -max_distance, max_distance) + max_distance
  return jax.nn.one_hot(clipped_xQK, 2 * max_distance + 1, dtype=dtype)


def attention_weights(q_xQHD: Array, logits_xHQK: Array, mask_x1QK: Array | None,
                      relative: Relative | None, buckets_xQKR: Array | None,
                      bias_xHQK: Array | None) -> Array:
  """softmax of the query-key logits (float32) plus the relative and bias terms, masked, in the
  queries' dtype: the weights of `dense_attention` and of the decode caches' reads."""
  if relative is not None:
    q_xQHR = jnp.einsum('...QHD,RD->...QHR', q_xQHD, relative.key_RD)
    logits_xHQK += jnp.einsum('...QHR,...QKR->...HQK', q_xQHR,
                              buckets_xQKR).astype(jnp.float32)
  if bias_xHQK is not None:
    logits_xHQK += bias_xHQK
  if mask_x1QK is not None:
    logits_xHQK = jnp.where(mask_x1QK, logits_xHQK, NEG_INF)
  if q_xQHD.dtype == jnp.float32:
    return jax.nn.softmax(logits_xHQK)
  return narrow_softmax(logits_xHQK, q_xQHD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def narrow_softmax(logits_xK: Array, dtype) -> Array:
  """softmax(logits) over the last axis, computed in float32 and returned in `dtype`, whose
  backward reads the returned (narrow) weights instead of keeping the float32 ones: in
  bfloat16, the [..., Q, K] array an attention layer keeps for its backward is half as many
  bytes. The gradient is y (g - sum(y g)) in float32 from those weights.
  """
  return jax.nn.softmax(logits_xK.astype(jnp.float32)).astype(dtype)


def _narrow_softmax_forward(logits_xK, dtype):
  weights_xK = narrow_softmax(logits_xK, dtype)
  return weights_xK, (weights_xK, jnp.zeros((0,), logits_xK.dtype))  # (And the logits' dtype.)


def _narrow_softmax_backward(dtype, residuals, grad_xK):
  del dtype  # The weights' dtype: the residual has it.
  weights_xK, logits_dtype = residuals
  y_xK, g_xK = weights_xK.astype(jnp.float32), grad_xK.astype(jnp.float32)
  return ((y_xK * (g_xK - jnp.sum(y_xK * g_xK, axis=-1, keepdims=True))).astype(
      logits_dtype.dtype),)


narrow_softmax.defvjp(_narrow_softmax_forward, _narrow_softmax_backward)


def dense_attention(q_xQHD: Array, k_xKHD: Array, v_xKHD: Array, mask_x1QK: Array | None,
                    drop: Callable[[Array], Array], relative: Relative | None = None,
                    buckets_xQKR: Array | None = None,
                    bias_xHQK: Array | None = None) -> tuple[Array, Array]:
  """softmax(q k^T + relative + bias) (v + relative): the output [..., Q, H, D] and the weights.

  The batch axes of `buckets_xQKR` may be 1 where every row has the same positions; `bias_xHQK`
  (ALiBi's, float32) broadcasts likewise.

  The relative terms are computed as a one-hot contraction, so they cost about R/D of the
  query-key product and hold a [..., Q, K, R] one-hot.
  """
  logits_xHQK = jnp.einsum('...QHD,...KHD->...HQK', q_xQHD, k_xKHD).astype(jnp.float32)
  weights_xHQK = attention_weights(q_xQHD, logits_xHQK, mask_x1QK, relative, buckets_xQKR,
                                   bias_xHQK)
  dropped_xHQK = drop(weights_xHQK)
  out_xQHD = jnp.einsum('...HQK,...KHD->...QHD', dropped_xHQK, v_xKHD)
  if relative is not None:
    per_distance_xHQR = jnp.einsum('...HQK,...QKR->...HQR', dropped_xHQK, buckets_xQKR)
    out_xQHD += jnp.einsum('...HQR,RD->...QHD', per_distance_xHQR, relative.value_RD)
  return out_xQHD, weights_xHQK


def _to_blocks(x_BL: Array, size: int) -> Array:
  """[B, L, ...] -> [B, ceil(L / size), size, ...], the tail padded with zeros (False)."""
  blocks = -(-x_BL.shape[1] // size)
  padding = [(0, 0), (0, blocks * size - x_BL.shape[1])] + [(0, 0)] * (x_BL.ndim - 2)
  return jnp.pad(x_BL, padding).reshape((x_BL.shape[0], blocks, size) + x_BL.shape[2:])


def _neighbour_blocks(x_BG: Array, causal: bool) -> Array:
  """Each block's keys: the previous block, its own and (unless causal) the next, on axis 2."""
  if x_BG.shape[1] == 1:
    return x_BG
  padding = [(0, 0)] * x_BG.ndim
  before = jnp.pad(x_BG, [(0, 0), (1, 0)] + padding[2:])[:, :-1]
  after = jnp.pad(x_BG, [(0, 0), (0, 1)] + padding[2:])[:, 1:]
  return jnp.concatenate([before, x_BG] if causal else [before, x_BG, after], axis=2)


def local_attention(q_BLHD: Array, k_BLHD: Array, v_BLHD: Array, valid_BL: Array,
                    segments_BL: Array | None, positions_BL: Array | None, window: int,
                    causal: bool, drop: Callable[[Array], Array],
                    relative: Relative | None = None, alibi_slopes_H=None) -> Array:
  """Restricted self-attention: key j is visible to query i iff |i - j| <= window, or
  0 <= i - j <= window when causal (row indices), and j is not padding and in i's segment.

  The sequence is cut into blocks of `window` tokens (one block when the window covers the
  sequence); each block of queries attends to its own block and the previous one (and the
  next one unless causal), so memory grows as L * 3 * window, never L^2. Queries of
  segment 0 (packed padding) see every key in their window, as attention_mask allows.
  """
  batch, length = q_BLHD.shape[:2]
  size = min(window, length)
  q_BGQHD = _to_blocks(q_BLHD, size)
  k_BGKHD = _neighbour_blocks(_to_blocks(k_BLHD, size), causal)
  v_BGKHD = _neighbour_blocks(_to_blocks(v_BLHD, size), causal)
  # Block padding and the blocks before the first and after the last are not valid keys.
  valid_BGK = _neighbour_blocks(_to_blocks(valid_BL, size), causal)
  index_1NQ = _to_blocks(jnp.arange(length)[None], size)
  distance_GQK = index_1NQ[0, :, :, None] - _neighbour_blocks(index_1NQ, causal)[0, :, None, :]
  near_GQK = ((distance_GQK >= 0) & (distance_GQK <= window) if causal
              else jnp.abs(distance_GQK) <= window)
  mask_BGQK = valid_BGK[:, :, None, :] & near_GQK[None]
  if segments_BL is not None:
    query_segments_BGQ = _to_blocks(segments_BL, size)
    key_segments_BGK = _neighbour_blocks(query_segments_BGQ, causal)
    mask_BGQK &= ((query_segments_BGQ[..., None] == key_segments_BGK[:, :, None, :])
                  | (query_segments_BGQ[..., None] == 0))
  if positions_BL is None:  # Every row alike: one row of positions, broadcast.
    positions_BL = jnp.arange(length)[None]
  query_positions_BGQ = _to_blocks(positions_BL, size)
  key_positions_BGK = _neighbour_blocks(query_positions_BGQ, causal)
  buckets_BGQKR = bias_BGHQK = None
  if relative is not None:
    buckets_BGQKR = relative_buckets(query_positions_BGQ, key_positions_BGK,
                                     relative.max_distance, q_BLHD.dtype)
  if alibi_slopes_H is not None:
    bias_BGHQK = positions.alibi_bias(query_positions_BGQ, key_positions_BGK, alibi_slopes_H)
  out_BGQHD, _ = dense_attention(q_BGQHD, k_BGKHD, v_BGKHD, mask_BGQK[:, :, None], drop,
                                 relative, buckets_BGQKR, bias_BGHQK)
  return out_BGQHD.reshape((batch, -1) + q_BLHD.shape[2:])[:, :length]


def compress(x_BMZHD: Array, kernel_ZHDF: Array) -> Array:
  """Strided convolution, kernel = stride = Z, per head: one key (or value) per block of Z."""
  return jnp.einsum('BMSHD,SHDF->BMHF', x_BMZHD, kernel_ZHDF)


def compress_cached(x_BHMZD: Array, kernel_ZHDF: Array) -> Array:
  """`compress` on heads-major decode caches: [B, H, M, Z, D] -> [B, H, M, D]."""
  return jnp.einsum('BHMSD,SHDF->BHMF', x_BHMZD, kernel_ZHDF)


def compressed_attention(q_BLHD: Array, k_BLHD: Array, v_BLHD: Array, valid_BL: Array,
                         segments_BL: Array | None, stride: int, causal: bool,
                         key_kernel_ZHDD: Array, value_kernel_ZHDD: Array,
                         drop: Callable[[Array], Array]) -> Array:
  """Memory-compressed attention (Liu et al. 2018): keys and values of each block of `stride`
  tokens are merged by a learned strided convolution, so queries attend to L / stride keys.

  Query i (in block n = i // stride) sees the compressed blocks m != n (m < n when causal:
  every token a compressed key summarises is earlier than i) and, uncompressed, the keys of
  its own block (those j <= i when causal), so no query is left without a key. Padding is
  zeroed before the convolution and blocks of padding only are hidden. Packed rows
  (`segments_BL` given) cut each segment into blocks from its own first token
  (`segment_compressed_attention`), so a packed row is exactly its segments run one by one.
  """
  if segments_BL is not None:
    return segment_compressed_attention(q_BLHD, k_BLHD, v_BLHD, valid_BL, segments_BL, stride,
                                        causal, key_kernel_ZHDD, value_kernel_ZHDD, drop)
  length = q_BLHD.shape[1]
  valid_BGZ = _to_blocks(valid_BL, stride)
  keep_BGZ11 = valid_BGZ[..., None, None].astype(k_BLHD.dtype)
  k_BGZHD = _to_blocks(k_BLHD, stride) * keep_BGZ11
  v_BGZHD = _to_blocks(v_BLHD, stride) * keep_BGZ11
  compressed_k_BMHD = compress(k_BGZHD, key_kernel_ZHDD)
  compressed_v_BMHD = compress(v_BGZHD, value_kernel_ZHDD)
  blocks = valid_BGZ.shape[1]
  own_GM = jnp.arange(blocks)[:, None] - jnp.arange(blocks)[None, :]
  other_GM = own_GM > 0 if causal else own_GM != 0
  compressed_mask_BGQM = (valid_BGZ.any(-1)[:, None, None, :] & other_GM[None, :, None, :])
  raw_mask_BGQZ = valid_BGZ[:, :, None, :]
  if causal:
    raw_mask_BGQZ &= jnp.tril(jnp.ones((stride, stride), bool))[None, None]
  out_BGQHD = _compressed_and_raw(
      _to_blocks(q_BLHD, stride), compressed_k_BMHD, compressed_v_BMHD, compressed_mask_BGQM,
      k_BGZHD, v_BGZHD, raw_mask_BGQZ, drop)
  return out_BGQHD.reshape((q_BLHD.shape[0], -1) + q_BLHD.shape[2:])[:, :length]


def _compressed_and_raw(q_BGQHD: Array, compressed_k_BMHD: Array, compressed_v_BMHD: Array,
                        compressed_mask_BGQM: Array, k_BGKHD: Array, v_BGKHD: Array,
                        raw_mask_BGQK: Array, drop: Callable[[Array], Array]) -> Array:
  """Each block of queries over the compressed keys and its raw keys, in one softmax."""
  logits_BGHQK = jnp.concatenate([
      jnp.einsum('BNQHD,BMHD->BNHQM', q_BGQHD, compressed_k_BMHD),
      jnp.einsum('BNQHD,BNSHD->BNHQS', q_BGQHD, k_BGKHD)], axis=-1).astype(jnp.float32)
  shape_BGQ = q_BGQHD.shape[:3]
  blocks, raw = compressed_k_BMHD.shape[1], k_BGKHD.shape[2]
  mask_BG1QK = jnp.concatenate([
      jnp.broadcast_to(compressed_mask_BGQM, shape_BGQ + (blocks,)),
      jnp.broadcast_to(raw_mask_BGQK, shape_BGQ + (raw,))], axis=-1)[:, :, None]
  logits_BGHQK = jnp.where(mask_BG1QK, logits_BGHQK, NEG_INF)
  weights_BGHQK = drop(jax.nn.softmax(logits_BGHQK).astype(q_BGQHD.dtype))
  return (jnp.einsum('BNHQM,BMHD->BNQHD', weights_BGHQK[..., :blocks], compressed_v_BMHD)
          + jnp.einsum('BNHQS,BNSHD->BNQHD', weights_BGHQK[..., blocks:], v_BGKHD))


def segment_positions(segments_BL: Array) -> Array:
  """Each token's distance from the first token of its run of equal segment ids [B, L]."""
  index_L = jnp.arange(segments_BL.shape[1])
  starts_BL = jnp.concatenate([jnp.ones_like(segments_BL[:, :1], bool),
                               segments_BL[:, 1:] != segments_BL[:, :-1]], axis=1)
  return index_L - jax.lax.cummax(jnp.where(starts_BL, index_L, 0), axis=1)


class SegmentBlocks(NamedTuple):
  """The compressed blocks of a packed row's segments, in order, unused slots last."""
  key_BMHD: Array
  value_BMHD: Array
  segment_BM: Array  # The block's segment; -1 for an unused slot.
  index_BM: Array  # The block's number within its segment.


def segment_blocks(k_BLHD: Array, v_BLHD: Array, valid_BL: Array, segments_BL: Array,
                   positions_BL: Array, stride: int, key_kernel_ZHDD: Array,
                   value_kernel_ZHDD: Array) -> SegmentBlocks:
  """Blocks of `stride` tokens counted from each segment's first token, compressed.

  Only segments longer than one block need compressed keys (a query's own block is read
  raw), and their blocks number at most 2L / (stride + 1): each spans over a block, so
  ceil(n / Z) <= 2n / (Z + 1) for each. That bound sizes the slots.
  """
  length = segments_BL.shape[1]
  slots = max(1, 2 * length // (stride + 1))
  count_segments = functools.partial(jnp.bincount, length=length + 1)
  lengths_BS = jax.vmap(count_segments)(jnp.where(valid_BL, segments_BL, 0))
  long_BL = (valid_BL & (segments_BL != 0)
             & (jnp.take_along_axis(lengths_BS, segments_BL, axis=1) > stride))
  first_BL = long_BL & (positions_BL % stride == 0)
  slot_BL = jnp.where(long_BL, jnp.cumsum(first_BL, axis=1) - 1, slots)  # Out of range: dropped.
  offset_BL = positions_BL % stride

  def gather(x_LHD, slot_L, offset_L):
    empty_MZHD = jnp.zeros((slots, stride) + x_LHD.shape[1:], x_LHD.dtype)
    return empty_MZHD.at[slot_L, offset_L].set(x_LHD, mode='drop')

  k_BMZHD = jax.vmap(gather)(k_BLHD, slot_BL, offset_BL)
  v_BMZHD = jax.vmap(gather)(v_BLHD, slot_BL, offset_BL)
  first_slot_BL = jnp.where(first_BL, slot_BL, slots)  # Each block labelled by its first token.
  label_rows = jax.vmap(lambda value_L, slot_L: jnp.full((slots,), -1, jnp.int32).at[slot_L].set(
      value_L.astype(jnp.int32), mode='drop'))
  return SegmentBlocks(compress(k_BMZHD, key_kernel_ZHDD), compress(v_BMZHD, value_kernel_ZHDD),
                       label_rows(segments_BL, first_slot_BL),
                       label_rows(positions_BL // stride, first_slot_BL))


def segment_compressed_attention(q_BLHD: Array, k_BLHD: Array, v_BLHD: Array, valid_BL: Array,
                                 segments_BL: Array, stride: int, causal: bool,
                                 key_kernel_ZHDD: Array, value_kernel_ZHDD: Array,
                                 drop: Callable[[Array], Array]) -> Array:
  """`compressed_attention` of packed rows: each segment's blocks start at its first token.

  Query i sees the compressed blocks of its own segment other than its own (earlier ones
  when causal) and, raw, the keys of its own block, which lie within stride - 1 tokens of
  it: the previous, own and next row blocks of `stride` hold them. So every segment gets
  the blocks it would get alone, wherever the packer put it. Segment 0 (packing padding)
  is cut into blocks like a segment; its outputs are never read.
  """
  length = q_BLHD.shape[1]
  positions_BL = segment_positions(segments_BL)
  blocks = segment_blocks(k_BLHD, v_BLHD, valid_BL, segments_BL, positions_BL, stride,
                          key_kernel_ZHDD, value_kernel_ZHDD)
  block_BL = positions_BL // stride
  segments_BGQ, block_BGQ = _to_blocks(segments_BL, stride), _to_blocks(block_BL, stride)
  own_BGQM = block_BGQ[..., None] - blocks.index_BM[:, None, None, :]
  compressed_mask_BGQM = ((segments_BGQ[..., None] == blocks.segment_BM[:, None, None, :])
                          & ((own_BGQM > 0) if causal else (own_BGQM != 0)))
  key_segments_BGK = _neighbour_blocks(segments_BGQ, causal=False)
  key_valid_BGK = _neighbour_blocks(_to_blocks(valid_BL, stride), causal=False)
  key_positions_BGK = _neighbour_blocks(_to_blocks(positions_BL, stride), causal=False)
  query_positions_BGQ = _to_blocks(positions_BL, stride)
  raw_mask_BGQK = (key_valid_BGK[:, :, None, :]
                   & (segments_BGQ[..., None] == key_segments_BGK[:, :, None, :])
                   & (block_BGQ[..., None] == key_positions_BGK[:, :, None, :] // stride))
  if causal:
    raw_mask_BGQK &= key_positions_BGK[:, :, None, :] <= query_positions_BGQ[..., None]
  keep_BL11 = valid_BL[..., None, None].astype(k_BLHD.dtype)
  k_BGKHD = _neighbour_blocks(_to_blocks(k_BLHD * keep_BL11, stride), causal=False)
  v_BGKHD = _neighbour_blocks(_to_blocks(v_BLHD * keep_BL11, stride), causal=False)
  out_BGQHD = _compressed_and_raw(_to_blocks(q_BLHD, stride), blocks.key_BMHD,
                                  blocks.value_BMHD, compressed_mask_BGQM, k_BGKHD, v_BGKHD,
                                  raw_mask_BGQK, drop)
  return out_BGQHD.reshape((q_BLHD.shape[0], -1) + q_BLHD.shape[2:])[:, :length]


def cached_masks(kind: str, positions_BQ: Array, cache_length: int, window: int,
                 stride: int) -> tuple[Array, Array | None]:
  """Decode-mode masks [B, Q, cache_length] over the raw key cache and, for 'compressed',
  [B, Q, cache_length / stride] over the compressed one, of queries at `positions_BQ`
  (the batch axis may be 1) when a cached token's slot is its position: the same
  neighbourhoods as above."""
  key_index_K = jnp.arange(cache_length)
  distance_BQK = positions_BQ[..., None] - key_index_K
  raw_BQK = distance_BQK >= 0
  if kind == 'local':
    raw_BQK &= distance_BQK <= window
  if kind != 'compressed':
    return raw_BQK, None
  block_BQ = positions_BQ // stride
  raw_BQK &= key_index_K // stride == block_BQ[..., None]
  compressed_BQM = jnp.arange(cache_length // stride) < block_BQ[..., None]
  return raw_BQK, compressed_BQM
