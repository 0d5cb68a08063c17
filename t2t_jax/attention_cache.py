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


def write(cache_BHKD: Array, new_BHQD: Array, index: Array, slots_BQ: Array | None) -> Array:
  """The cache with this call's Q keys (or values) written from `index` on, or row b's from
  `slots_BQ[b, 0]` on when given (a decoder-only model's steps)."""
  if slots_BQ is None:
    return jax.lax.dynamic_update_slice(cache_BHKD, new_BHQD, (0, 0, index, 0))
  return jax.vmap(lambda cache_HKD, new_HQD, slot: jax.lax.dynamic_update_slice(
      cache_HKD, new_HQD, (0, slot, 0)))(cache_BHKD, new_BHQD, slots_BQ[:, 0])


def cached_mask(kind: str, positions_BQ: Array, length: int, prompt, rows: int, window: int,
                stride: int) -> tuple[Array, Array | None, Array | None]:
  """The masks of queries at `positions_BQ` [1 or B, Q] over a cache of `length` slots, where
  a token's slot is its position: [B, 1, Q, K] over the raw keys, for 'compressed'
  [B, 1, Q, M] over the compressed ones (else None), and which keys are real [B, K] during a
  decoder-only prefill (`prompt`, an attention.SelfMask; else None)."""
  raw_BQK, compressed_BQM = attention_variants.cached_masks(kind, positions_BQ, length, window,
                                                            stride)
  mask_B1QK, key_valid_BK = raw_BQK[:, None], None
  if prompt is not None:  # Every row's prompt starts at slot 0: the positions agree.
    mask_B1QK, key_valid_BK = prompt_mask(raw_BQK[0], prompt, kind, rows)
  if compressed_BQM is None:
    return mask_B1QK, None, key_valid_BK
  compressed_B1QM = compressed_BQM[:, None]
  if key_valid_BK is not None:  # Blocks of padding only are hidden, as in training.
    blocks_BM = key_valid_BK.reshape(key_valid_BK.shape[0], -1, stride).any(-1)
    compressed_B1QM = compressed_B1QM & blocks_BM[:, None, None, :]
  return mask_B1QK, compressed_B1QM, key_valid_BK


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


def recompress(compressed_BHMD: Array, raw_BHKD: Array, positions_BQ: Array,
               kernel_ZHDD: Array, key_valid_BK: Array | None, stride: int) -> Array:
  """The compressed cache after this call's writes to `raw_BHKD` at `positions_BQ`.

  One step recompresses only its own block, each row's own when the rows' positions differ
  (a partial block stays masked until it is complete); several steps (a prompt) recompress
  them all. Padded prompt keys (`key_valid_BK` False) are zeroed first, as training zeroes
  them.
  """
  batch, heads, length, head_dim = raw_BHKD.shape
  if key_valid_BK is not None:
    raw_BHKD = raw_BHKD * key_valid_BK[:, None, :, None].astype(raw_BHKD.dtype)
  if positions_BQ.shape[1] > 1:
    blocks_BHMZD = raw_BHKD.reshape(batch, heads, length // stride, stride, head_dim)
    return attention_variants.compress_cached(blocks_BHMZD, kernel_ZHDD)

  def own_block(compressed_BHMD, raw_BHKD, position):
    block = position // stride
    raw_BHZD = jax.lax.dynamic_slice_in_dim(raw_BHKD, block * stride, stride, 2)
    return jax.lax.dynamic_update_slice_in_dim(
        compressed_BHMD, attention_variants.compress_cached(raw_BHZD[:, :, None], kernel_ZHDD),
        block, 2)

  if positions_BQ.shape[0] == 1:  # Every row at the same position.
    return own_block(compressed_BHMD, raw_BHKD, positions_BQ[0, 0])
  per_row = jax.vmap(lambda compressed_HMD, raw_HKD, position: own_block(
      compressed_HMD[None], raw_HKD[None], position)[0])
  return per_row(compressed_BHMD, raw_BHKD, positions_BQ[:, 0])


def shared_memory_attention(q_NQHD: Array, k_BHDK: Array, v_BHKD: Array,
                            mask_B1QK: Array | None) -> tuple[Array, Array]:
  """Cached cross-attention where each of the B memory rows serves W = N / B query rows (a
  sentence's beams, consecutive): their queries attend together, as W * Q queries of one
  row. Returns the output [N, Q, H, D] and weights [N, H, Q, K].

  The keys come transposed, [B, H, D, K], so that both products are plain batched matrix
  products ([W * Q, D] x [D, K] and [W * Q, K] x [K, D] per row and head), which XLA:CPU runs
  without laying anything out again. `mask_B1QK` has B or N rows (then each beam's is its
  sentence's) and one query row.
  """
  rows, queries, heads, head_dim = q_NQHD.shape
  batch_size = k_BHDK.shape[0]
  beams = rows // batch_size
  if mask_B1QK is not None and mask_B1QK.shape[0] != batch_size:
    mask_B1QK = mask_B1QK[::beams]
  q_BHQD = q_NQHD.reshape(batch_size, beams * queries, heads, head_dim).swapaxes(1, 2)
  logits_BHQK = jnp.einsum('BHQD,BHDK->BHQK', q_BHQD, k_BHDK).astype(jnp.float32)
  if mask_B1QK is not None:
    logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, attention_variants.NEG_INF)
  weights_BHQK = jax.nn.softmax(logits_BHQK).astype(q_NQHD.dtype)
  out_BHQD = jnp.einsum('BHQK,BHKD->BHQD', weights_BHQK, v_BHKD)
  weights_NHQK = weights_BHQK.reshape(batch_size, heads, beams, queries, -1).swapaxes(
      1, 2).reshape(rows, heads, queries, -1)
  return out_BHQD.swapaxes(1, 2).reshape(rows, queries, heads, head_dim), weights_NHQK


def beam_layout(k_BHKD: Array, v_BHKD: Array, sentences: int) -> tuple[Array, Array]:
  """Beam search's layout of keys and values whose B rows are S sentences of V beams: keys
  [H, S, D, V, K], values heads-first [H, B, K, D]. Each step's products then read them as
  they lie, with the batch axes (H, S) leading and the contracted axis where a matrix product
  wants it (attention_variants.cached_attention), instead of copying every layer's cache into
  that order at every step."""
  rows, heads, length, head_dim = k_BHKD.shape
  k_HSDVK = k_BHKD.reshape(sentences, rows // sentences, heads, length, head_dim).transpose(
      2, 0, 4, 1, 3)
  return k_HSDVK, v_BHKD.swapaxes(0, 1)


def write_beams(k_HSDVK: Array, v_HBKD: Array, k_BHQD: Array, v_BHQD: Array, index: Array,
                sentences: int) -> tuple[Array, Array]:
  """Caches in beam_layout's layout with this step's keys and values written at `index`."""
  k_HSDVQ, v_HBQD = beam_layout(k_BHQD, v_BHQD, sentences)
  return (jax.lax.dynamic_update_slice_in_dim(k_HSDVK, k_HSDVQ, index, 4),
          jax.lax.dynamic_update_slice_in_dim(v_HBKD, v_HBQD, index, 2))


def own_slot(origin_SWK: Array, positions_1Q: Array) -> Array:
  """Beam search's ancestry after a step wrote each row's key at `positions_1Q` [1, 1]: every
  beam finds that key in its own cache row."""
  sentences, beams, _ = origin_SWK.shape
  own_SW1 = jnp.broadcast_to(jnp.arange(beams, dtype=origin_SWK.dtype)[None, :, None],
                             (sentences, beams, 1))
  return jax.lax.dynamic_update_slice_in_dim(origin_SWK, own_SW1, positions_1Q[0, 0], 2)
