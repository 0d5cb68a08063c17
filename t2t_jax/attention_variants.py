"""The attention arithmetic of the model family: dense, restricted (local), memory-compressed,
and relative-position terms. Pure functions; attention.py owns the parameters and caches.

Shapes in names follow the package legend (t2t_jax/__init__.py): here G blocks of queries,
M compressed blocks of keys, Z tokens per compressed block (the stride), R relative distances
(2k + 1). A leading `...` stands for batch axes (B, or B and G).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from t2t_jax import positions

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
  if relative is not None:
    q_xQHR = jnp.einsum('...QHD,RD->...QHR', q_xQHD, relative.key_RD)
    logits_xHQK += jnp.einsum('...QHR,...QKR->...HQK', q_xQHR,
                              buckets_xQKR).astype(jnp.float32)
  if bias_xHQK is not None:
    logits_xHQK += bias_xHQK
  if mask_x1QK is not None:
    logits_xHQK = jnp.where(mask_x1QK, logits_xHQK, NEG_INF)
  weights_xHQK = jax.nn.softmax(logits_xHQK).astype(q_xQHD.dtype)
  dropped_xHQK = drop(weights_xHQK)
  out_xQHD = jnp.einsum('...HQK,...KHD->...QHD', dropped_xHQK, v_xKHD)
  if relative is not None:
    per_distance_xHQR = jnp.einsum('...HQK,...QKR->...HQR', dropped_xHQK, buckets_xQKR)
    out_xQHD += jnp.einsum('...HQR,RD->...QHD', per_distance_xHQR, relative.value_RD)
  return out_xQHD, weights_xHQK


def cached_attention(q_BQHD: Array, k_BHKD: Array, v_BHKD: Array, mask_B1QK: Array | None,
                     relative: Relative | None = None, buckets_BQKR: Array | None = None,
                     bias_BHQK: Array | None = None) -> tuple[Array, Array]:
  """dense_attention against heads-major decode caches [B, H, K, D]: the output and weights.

  Decoding is deterministic, so there is no dropout.
  """
  logits_BHQK = jnp.einsum('BQHD,BHKD->BHQK', q_BQHD, k_BHKD).astype(jnp.float32)
  if relative is not None:
    q_BQHR = jnp.einsum('BQHD,RD->BQHR', q_BQHD, relative.key_RD)
    # The buckets' batch axis may be 1 (every row alike): '...' broadcasts it.
    logits_BHQK += jnp.einsum('...QHR,...QKR->...HQK', q_BQHR,
                              buckets_BQKR).astype(jnp.float32)
  if bias_BHQK is not None:
    logits_BHQK += bias_BHQK
  if mask_B1QK is not None:
    logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, NEG_INF)
  weights_BHQK = jax.nn.softmax(logits_BHQK).astype(q_BQHD.dtype)
  out_BQHD = jnp.einsum('BHQK,BHKD->BQHD', weights_BHQK, v_BHKD)
  if relative is not None:
    per_distance_BHQR = jnp.einsum('...HQK,...QKR->...HQR', weights_BHQK, buckets_BQKR)
    out_BQHD += jnp.einsum('BHQR,RD->BQHD', per_distance_BHQR, relative.value_RD)
  return out_BQHD, weights_BHQK


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
  zeroed before the convolution and blocks of padding only are hidden. In packed rows a
  block that mixes segments is hidden from everyone (each segment loses at most one block
  at each of its ends), so a packed row is not exactly its segments run one by one.
  """
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
  if segments_BL is not None:
    segments_BGZ = _to_blocks(segments_BL, stride)
    highest_BM = jnp.where(valid_BGZ, segments_BGZ, -1).max(-1)
    lowest_BM = jnp.where(valid_BGZ, segments_BGZ, jnp.iinfo(jnp.int32).max).min(-1)
    block_segment_BM = jnp.where(highest_BM == lowest_BM, highest_BM, -1)  # -1: mixed.
    anywhere_BGQ1 = segments_BGZ[..., None] == 0
    compressed_mask_BGQM &= ((segments_BGZ[..., None] == block_segment_BM[:, None, None, :])
                             | anywhere_BGQ1)
    raw_mask_BGQZ &= (segments_BGZ[..., None] == segments_BGZ[:, :, None, :]) | anywhere_BGQ1
  q_BGQHD = _to_blocks(q_BLHD, stride)
  logits_BGHQK = jnp.concatenate([
      jnp.einsum('BNQHD,BMHD->BNHQM', q_BGQHD, compressed_k_BMHD),
      jnp.einsum('BNQHD,BNSHD->BNHQS', q_BGQHD, k_BGZHD)], axis=-1).astype(jnp.float32)
  shape_BGQ = valid_BGZ.shape
  mask_BG1QK = jnp.concatenate([
      jnp.broadcast_to(compressed_mask_BGQM, shape_BGQ + (blocks,)),
      jnp.broadcast_to(raw_mask_BGQZ, shape_BGQ + (stride,))], axis=-1)[:, :, None]
  logits_BGHQK = jnp.where(mask_BG1QK, logits_BGHQK, NEG_INF)
  weights_BGHQK = drop(jax.nn.softmax(logits_BGHQK).astype(q_BLHD.dtype))
  out_BGQHD = (
      jnp.einsum('BNHQM,BMHD->BNQHD', weights_BGHQK[..., :blocks], compressed_v_BMHD)
      + jnp.einsum('BNHQS,BNSHD->BNQHD', weights_BGHQK[..., blocks:], v_BGZHD))
  return out_BGQHD.reshape((q_BLHD.shape[0], -1) + q_BLHD.shape[2:])[:, :length]


def cached_masks(kind: str, query_index_Q: Array, cache_length: int, window: int,
                 stride: int) -> tuple[Array, Array | None]:
  """Decode-mode masks [Q, cache_length] over the raw key cache and, for 'compressed',
  [Q, cache_length / stride] over the compressed one: the same neighbourhoods as above."""
  key_index_K = jnp.arange(cache_length)
  distance_QK = query_index_Q[:, None] - key_index_K[None, :]
  raw_QK = distance_QK >= 0
  if kind == 'local':
    raw_QK &= distance_QK <= window
  if kind != 'compressed':
    return raw_QK, None
  block_Q = query_index_Q // stride
  raw_QK &= (key_index_K // stride)[None, :] == block_Q[:, None]
  compressed_QM = jnp.arange(cache_length // stride)[None, :] < block_Q[:, None]
  return raw_QK, compressed_QM
