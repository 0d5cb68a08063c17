"""The self-attention decode cache: its layouts, writes, masks and reads, and beam search's
cache (`BeamCache`), whose keys never move.

The modules in attention.py own the cache variables; what goes into them, which cached keys
each query may see and how a step reads them is here. Keys and values are cached heads-major
([B, H, K, D]), the layout a step's products read. Shapes in names follow the package legend
(t2t_jax/__init__.py); in beam search's functions B counts sentences, N = B * W query rows.
"""

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from t2t_jax.model import attention_variants

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


class RowCache(NamedTuple):
  """A cache with one row per query row, as a call reads it: keys and values [B, H, K, D]."""
  key_BHKD: Array
  value_BHKD: Array

  @property
  def length(self) -> int:
    return self.key_BHKD.shape[2]

  def attend(self, q_BQHD: Array, mask_B1QK: Array | None,
             relative: attention_variants.Relative | None = None,
             buckets_BQKR: Array | None = None,
             bias_BHQK: Array | None = None) -> tuple[Array, Array]:
    """attention_variants.dense_attention over the cache: the output [B, Q, H, D] and weights
    [B, H, Q, K]. Decoding is deterministic, so there is no dropout."""
    logits_BHQK = jnp.einsum('BQHD,BHKD->BHQK', q_BQHD, self.key_BHKD).astype(jnp.float32)
    weights_BHQK = attention_variants.attention_weights(
        q_BQHD, logits_BHQK, mask_B1QK, relative, buckets_BQKR, bias_BHQK)
    out_BQHD = jnp.einsum('BHQK,BHKD->BQHD', weights_BHQK, self.value_BHKD)
    return _with_relative_values(out_BQHD, weights_BHQK, relative, buckets_BQKR), weights_BHQK


def _with_relative_values(out_BQHD, weights_BHQK, relative, buckets_BQKR) -> Array:
  if relative is None:
    return out_BQHD
  per_distance_BHQR = jnp.einsum('...HQK,...QKR->...HQR', weights_BHQK, buckets_BQKR)
  return out_BQHD + jnp.einsum('BHQR,RD->BQHD', per_distance_BHQR, relative.value_RD)


BEAM_ENTRY = 'key_value'  # The name of a layer's BeamCache among its cache entries.


@flax.struct.dataclass
class BeamCache:
  """One self-attention layer's cache in beam search (decode.py): every key and value stays in
  the cache row that wrote it, and an origin table says which row holds each key of each
  beam's hypothesis. Reordering the beams moves only that table.

  Why the table is enough: row r's slot k is written once, by the step at position k
  (`write`), and never again, so it keeps the key of the hypothesis that was live in row r
  at that step for the rest of the search. A hypothesis's keys before position k are its
  ancestors', all written that way: a beam continuing parent p takes p's origins (`reorder`).

  For B sentences of W beams (N = B * W rows, a sentence's consecutive) and K slots, the
  fields keep these ranks whatever the step; a step's products read them as they lie.
  """
  # [H, B, D, W, K]: a sentence's W rows side by side behind the head dim, so a step scores
  # its W queries against all of them as one matrix product per head and sentence.
  key_HBDWK: Array
  origin_BWK: Array  # int32: the row, of its sentence's W, holding key k of beam w's.
  value_HNKD: Array

  @classmethod
  def start(cls, key_NHKD: Array, value_NHKD: Array, sentences: int) -> 'BeamCache':
    """The beam cache of caches with one row per beam: every beam reads its own row."""
    rows, _, length, _ = key_NHKD.shape
    beams = rows // sentences
    origin_BWK = jnp.broadcast_to(jnp.arange(beams, dtype=jnp.int32)[None, :, None],
                                  (sentences, beams, length))
    key_HBDWK, value_HNKD = _beam_layout(key_NHKD, value_NHKD, sentences)
    return cls(key_HBDWK, origin_BWK, value_HNKD)

  def write(self, key_NH1D: Array, value_NH1D: Array,
            slot: Array) -> tuple['BeamCache', 'BeamStep']:
    """The cache with this step's keys and values written at `slot` (its position), each
    beam's own; and what this step reads (BeamStep)."""
    sentences, beams, _ = self.origin_BWK.shape
    own_BW1 = jnp.broadcast_to(jnp.arange(beams, dtype=self.origin_BWK.dtype)[None, :, None],
                               (sentences, beams, 1))
    origin_BWK = jax.lax.dynamic_update_slice_in_dim(self.origin_BWK, own_BW1, slot, 2)
    key_HBDW1, value_HN1D = _beam_layout(key_NH1D, value_NH1D, sentences)
    written = BeamCache(jax.lax.dynamic_update_slice_in_dim(self.key_HBDWK, key_HBDW1, slot, 4),
                        origin_BWK,
                        jax.lax.dynamic_update_slice_in_dim(self.value_HNKD, value_HN1D, slot, 2))
    return written, BeamStep(self.key_HBDWK, origin_BWK, self.value_HNKD, key_NH1D, value_NH1D,
                             slot)

  def reorder(self, parent_BW: Array) -> 'BeamCache':
    """The cache after beam w of every sentence continues its parent_BW[b, w]."""
    return self.replace(origin_BWK=jnp.take_along_axis(self.origin_BWK, parent_BW[:, :, None],
                                                       axis=1))


def _beam_layout(key_NHKD: Array, value_NHKD: Array, sentences: int) -> tuple[Array, Array]:
  """Keys and values with one row per beam in BeamCache's layout (K may be 1)."""
  rows, heads, length, head_dim = key_NHKD.shape
  key_HBDWK = key_NHKD.reshape(sentences, rows // sentences, heads, length, head_dim).transpose(
      2, 0, 4, 1, 3)
  return key_HBDWK, value_NHKD.swapaxes(0, 1)


class BeamStep(NamedTuple):
  """What one step of beam search attends to: the cache's keys and values as the step was
  handed them, the origin table with the step's own slot, and the step's own keys and values,
  read apart at `slot`. (Reading the written cache instead would stop XLA writing it in place:
  it would copy every layer's cache at every step.)"""
  key_HBDWK: Array
  origin_BWK: Array
  value_HNKD: Array
  new_key_NH1D: Array
  new_value_NH1D: Array
  slot: Array

  @property
  def length(self) -> int:
    return self.origin_BWK.shape[2]

  def attend(self, q_NQHD: Array, mask_N1QK: Array | None,
             relative: attention_variants.Relative | None = None,
             buckets_NQKR: Array | None = None,
             bias_NHQK: Array | None = None) -> tuple[Array, Array]:
    """RowCache.attend through the origin table: the output [N, 1, H, D] and weights
    [N, H, 1, K]. Each query is scored against all W rows of its sentence, and the scores and
    weights of rows that do not hold its key are zeroed: an exact selection."""
    logits_NHQK, origin_one_hot = self._logits(q_NQHD)
    weights_NHQK = attention_variants.attention_weights(
        q_NQHD, logits_NHQK, mask_N1QK, relative, buckets_NQKR, bias_NHQK)
    out_NQHD = self._output(weights_NHQK, origin_one_hot)
    return _with_relative_values(out_NQHD, weights_NHQK, relative, buckets_NQKR), weights_NHQK

  def _logits(self, q_NQHD: Array) -> tuple[Array, Array]:
    """The logits [N, H, 1, K] and the origin table one-hot: [B, W, W, K], whether row r
    (third axis) holds key k of beam w's hypothesis, for the keys before this step's."""
    sentences, beams, length = self.origin_BWK.shape
    heads, head_dim = q_NQHD.shape[2:]
    older_K = jnp.arange(length) != self.slot
    origin_one_hot = (self.origin_BWK[:, :, None, :] == jnp.arange(beams)[:, None]) & older_K
    q_HBWD = q_NQHD.reshape(sentences, beams, heads, head_dim).transpose(2, 0, 1, 3)
    # [H, B, D, W * K] (I in the products): a sentence's W rows of keys as one matrix.
    keys = self.key_HBDWK.reshape(heads, sentences, head_dim, beams * length)
    # [H, B, W, W, K]: beam w's query (third axis) against row r's key k (fourth, fifth).
    every_row = jnp.einsum('HBWD,HBDI->HBWI', q_HBWD, keys).reshape(
        heads, sentences, beams, beams, length)
    new_HBW1 = jnp.einsum('HBWD,BWHD->HBW', q_HBWD, self.new_key_NH1D.reshape(
        sentences, beams, heads, head_dim))[..., None]
    logits_HBWK = jnp.where(older_K, jnp.where(origin_one_hot, every_row, 0).sum(3),
                            new_HBW1).astype(jnp.float32)
    return logits_HBWK.reshape(heads, -1, 1, length).transpose(1, 0, 2, 3), origin_one_hot

  def _output(self, weights_NHQK: Array, origin_one_hot: Array) -> Array:
    """The output [N, 1, H, D] under `weights_NHQK`, each key's value read from its origin."""
    sentences, beams, _, length = origin_one_hot.shape
    heads, head_dim = self.value_HNKD.shape[0], self.value_HNKD.shape[-1]
    weights_HBW1K = weights_NHQK.reshape(sentences, beams, heads, 1, length).transpose(
        2, 0, 1, 3, 4)
    # [H, B, W, W * K]: beam w's weight of each row's keys, zero where the row is not its origin.
    weights = jnp.where(origin_one_hot, weights_HBW1K, 0).reshape(heads, sentences, beams, -1)
    values = self.value_HNKD.reshape(heads, sentences, beams * length, head_dim)
    # Both parts sum in float32 and round once, as one product over every key would.
    out_HBWD = jnp.einsum('HBWI,HBID->HBWD', weights, values,
                          preferred_element_type=jnp.float32)
    new_weights_BWH1 = jax.lax.dynamic_index_in_dim(weights_NHQK, self.slot, 3).reshape(
        sentences, beams, heads, 1)
    new_BWHD = new_weights_BWH1.astype(jnp.float32) * self.new_value_NH1D.reshape(
        sentences, beams, heads, head_dim)
    return (out_HBWD.transpose(1, 2, 0, 3) + new_BWHD).astype(weights_NHQK.dtype).reshape(
        sentences * beams, 1, heads, head_dim)
