"""The self-attention decode cache's bookkeeping, as pure functions of arrays.

The modules in attention.py own the cache variables; these functions say what goes into them
and which cached keys each query may see. Keys and values are cached heads-major
([B, H, K, D]), the layout a step's products read. Shapes in names follow the package legend
(t2t_jax/__init__.py).
"""

import jax
import jax.numpy as jnp

from t2t_jax import attention_variants

Array = jax.Array


def cache_length(length: int, kind: str, stride: int) -> int:
  """Cache entries for `length` tokens: whole blocks for 'compressed', so the last one compresses."""
  return -(-length // stride) * stride if kind == 'compressed' else length


def write(cache_BHKD: Array, new_BHQD: Array, index: Array) -> Array:
  """The cache with this call's Q keys (or values) written from `index` on."""
  return jax.lax.dynamic_update_slice(cache_BHKD, new_BHQD, (0, 0, index, 0))


def prompt_mask(raw_QK: Array, prompt, kind: str, cache_rows: int) -> tuple[Array, Array]:
  """The [B, 1, Q, K] mask over a cache whose first P keys are a decoder-only model's prompt,
  and which of the K keys are real [B, K].

  `prompt` (an attention.SelfMask) decides the prompt's keys: for 'full' layers its own mask
  (padding, and whether the prompt sees itself in full), otherwise this kind's neighbourhood
  mask `raw_QK` with the prompt's padding hidden. The keys after the prompt are real, and
  `raw_QK` decides them.
  """
  rows, prompt_length = prompt.valid_BL.shape
  queries, length = raw_QK.shape
  key_valid_BK = jnp.concatenate([prompt.valid_BL, jnp.ones((rows, length - prompt_length), bool)],
                                 axis=1)
  if kind == 'full':
    prompt_B1QP = prompt.full_B1LL
  else:
    prompt_B1QP = raw_QK[None, None, :, :prompt_length] & prompt.valid_BL[:, None, None, :]
  rows = max(rows, cache_rows)
  later_B1QK = jnp.broadcast_to(raw_QK[None, None, :, prompt_length:],
                                (rows, 1, queries, length - prompt_length))
  mask_B1QK = jnp.concatenate([
      jnp.broadcast_to(prompt_B1QP, (rows, 1, queries, prompt_length)), later_B1QK], axis=-1)
  return mask_B1QK, key_valid_BK


def with_compressed_keys(mask_B1QK: Array, compressed_QM: Array, key_valid_BK: Array | None,
                         stride: int) -> Array:
  """The mask over [compressed keys | raw keys]: blocks of padding only are hidden, as in
  training."""
  compressed_B1QM = compressed_QM[None, None]
  if key_valid_BK is not None:
    blocks_BM = key_valid_BK.reshape(key_valid_BK.shape[0], -1, stride).any(-1)
    compressed_B1QM = compressed_B1QM & blocks_BM[:, None, None, :]
  return jnp.concatenate([
      jnp.broadcast_to(compressed_B1QM, mask_B1QK.shape[:3] + compressed_QM.shape[-1:]),
      jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:3] + (mask_B1QK.shape[-1],))], axis=-1)


def recompress(compressed_BHMD: Array, raw_BHKD: Array, query_index_Q: Array, kernel_ZHDD: Array,
               key_valid_BK: Array | None, stride: int) -> Array:
  """The compressed cache after this call's writes to `raw_BHKD`.

  One step recompresses only its own block (a partial block stays masked until it is
  complete); several steps (a prompt) recompress them all. Padded prompt keys
  (`key_valid_BK` False) are zeroed first, as training zeroes them.
  """
  batch, heads, length, head_dim = raw_BHKD.shape
  if key_valid_BK is not None:
    raw_BHKD = raw_BHKD * key_valid_BK[:, None, :, None].astype(raw_BHKD.dtype)
  if query_index_Q.shape[0] > 1:
    blocks_BHMZD = raw_BHKD.reshape(batch, heads, length // stride, stride, head_dim)
    return attention_variants.compress_cached(blocks_BHMZD, kernel_ZHDD)
  block = query_index_Q[0] // stride
  raw_BHZD = jax.lax.dynamic_slice_in_dim(raw_BHKD, block * stride, stride, 2)
  return jax.lax.dynamic_update_slice_in_dim(
      compressed_BHMD, attention_variants.compress_cached(raw_BHZD[:, :, None], kernel_ZHDD),
      block, 2)


def cached_positions(query_index_Q: Array, length: int, prompt) -> tuple[Array, Array]:
  """Positions of the queries [1 or B, Q] and of the cached keys [1 or B, K] (relative, rotary,
  ALiBi): indices, except that after a right-padded prompt the tokens follow its last real
  token."""
  query_positions_BQ, key_positions_BK = query_index_Q[None], jnp.arange(length)[None]
  if prompt is not None:
    prompt_length = prompt.valid_BL.shape[1]
    padding_B1 = prompt_length - prompt.valid_BL.sum(-1, keepdims=True)
    key_positions_BK -= jnp.where(key_positions_BK >= prompt_length, padding_B1, 0)
    query_positions_BQ -= jnp.where(query_positions_BQ >= prompt_length, padding_B1, 0)
  return query_positions_BQ, key_positions_BK


def shared_memory_attention(q_NQHD: Array, k_BHKD: Array, v_BHKD: Array,
                            mask_B1QK: Array | None) -> tuple[Array, Array]:
  """Cached cross-attention where each of the B memory rows serves W = N / B query rows (a
  sentence's beams, consecutive): their queries attend together, as W * Q queries of one
  row. Returns the output [N, Q, H, D] and weights [N, H, Q, K].

  `mask_B1QK` has B or N rows (then each beam's is its sentence's) and one query row.
  """
  rows, queries, heads, head_dim = q_NQHD.shape
  batch_size = k_BHKD.shape[0]
  beams = rows // batch_size
  if mask_B1QK is not None and mask_B1QK.shape[0] != batch_size:
    mask_B1QK = mask_B1QK[::beams]
  q_BQHD = q_NQHD.reshape(batch_size, beams * queries, heads, head_dim)
  out_BQHD, weights_BHQK = attention_variants.cached_attention(q_BQHD, k_BHKD, v_BHKD,
                                                               mask_B1QK)
  weights_NHQK = weights_BHQK.reshape(batch_size, heads, beams, queries, -1).swapaxes(
      1, 2).reshape(rows, heads, queries, -1)
  return out_BQHD.reshape(rows, queries, heads, head_dim), weights_NHQK
