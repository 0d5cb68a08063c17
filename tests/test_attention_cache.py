"""Tests of attention_cache: beam search's BeamCache against a cache that moves its rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax.decoding import decode
from t2t_jax.model import attention_cache
from t2t_jax.model import attention_variants
from t2t_jax.model.attention_cache import BeamCache, RowCache
from t2t_jax.model.model_config import TransformerConfig

SENTENCES, BEAMS, HEADS, HEAD_DIM, LENGTH = 2, 3, 2, 4, 6
ROWS = SENTENCES * BEAMS


def _random(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _moved_rows(parent_BW: np.ndarray) -> np.ndarray:
  """The cache rows each beam continues: sentence b's beam w takes row b * W + parent."""
  return (np.arange(SENTENCES)[:, None] * BEAMS + parent_BW).reshape(-1)


def _reference_attention(q_N1HD, key_NHKD, value_NHKD, slot: int):
  """softmax(q k) v over slots 0..slot of caches with one row per beam, in float64 numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q_N1HD, key_NHKD, value_NHKD))
  logits_NHK = np.einsum('NHD,NHKD->NHK', q[:, 0], k)
  logits_NHK[:, :, slot + 1:] = -np.inf
  weights_NHK = np.exp(logits_NHK - logits_NHK.max(-1, keepdims=True))
  weights_NHK /= weights_NHK.sum(-1, keepdims=True)
  return np.einsum('NHK,NHKD->NHD', weights_NHK, v)[:, None], weights_NHK


def _search_like_steps(seed: int, first_slot: int = 1):
  """Steps of a search's shape: start from per-row caches holding `first_slot` tokens, then
  at each slot write a random key and value per row, attend, and reorder by random parents.
  Yields (slot, BeamStep, new cache, reference caches after the write, query)."""
  rng = np.random.default_rng(seed)
  key_NHKD = np.array(_random(rng, ROWS, HEADS, LENGTH, HEAD_DIM))
  value_NHKD = np.array(_random(rng, ROWS, HEADS, LENGTH, HEAD_DIM))
  key_NHKD[:, :, first_slot:] = value_NHKD[:, :, first_slot:] = 0  # Not written yet.
  cache = BeamCache.start(jnp.asarray(key_NHKD), jnp.asarray(value_NHKD), SENTENCES)
  for slot in range(first_slot, LENGTH):
    new_key_NH1D, new_value_NH1D = _random(rng, ROWS, HEADS, 1, HEAD_DIM), _random(
        rng, ROWS, HEADS, 1, HEAD_DIM)
    cache, step = cache.write(new_key_NH1D, new_value_NH1D, jnp.int32(slot))
    key_NHKD[:, :, slot] = new_key_NH1D[:, :, 0]
    value_NHKD[:, :, slot] = new_value_NH1D[:, :, 0]
    yield slot, step, cache, (key_NHKD.copy(), value_NHKD.copy()), _random(rng, ROWS, 1, HEADS,
                                                                           HEAD_DIM)
    parent_BW = rng.integers(0, BEAMS, (SENTENCES, BEAMS))
    cache = cache.reorder(jnp.asarray(parent_BW))
    rows_N = _moved_rows(parent_BW)
    key_NHKD, value_NHKD = key_NHKD[rows_N], value_NHKD[rows_N]


def _through_origins(cache: BeamCache) -> tuple[np.ndarray, np.ndarray]:
  """Each beam's keys and values [N, H, K, D], each slot's read from the row its origin names."""
  key_BWHKD = np.asarray(cache.key_HBDWK).transpose(1, 3, 0, 4, 2)
  value_BWHKD = np.asarray(cache.value_HNKD).swapaxes(0, 1).reshape(
      SENTENCES, BEAMS, HEADS, LENGTH, HEAD_DIM)
  origin_BWK = np.asarray(cache.origin_BWK)
  sentence_BWK = np.arange(SENTENCES)[:, None, None]
  slot_BWK = np.arange(LENGTH)[None, None]
  keys = key_BWHKD[sentence_BWK, origin_BWK, :, slot_BWK].transpose(0, 1, 3, 2, 4)
  values = value_BWHKD[sentence_BWK, origin_BWK, :, slot_BWK].transpose(0, 1, 3, 2, 4)
  return keys.reshape(ROWS, HEADS, LENGTH, HEAD_DIM), values.reshape(ROWS, HEADS, LENGTH, HEAD_DIM)


def test_a_beam_cache_read_through_its_origins_is_the_cache_whose_rows_move():
  for slot, _, cache, (key_NHKD, value_NHKD), _ in _search_like_steps(seed=0):
    keys, values = _through_origins(cache)
    np.testing.assert_array_equal(keys[:, :, :slot + 1], key_NHKD[:, :, :slot + 1])
    np.testing.assert_array_equal(values[:, :, :slot + 1], value_NHKD[:, :, :slot + 1])


def test_beam_attention_equals_attention_over_moved_rows():
  for slot, step, _, (key_NHKD, value_NHKD), q_N1HD in _search_like_steps(seed=1):
    mask_N1QK = jnp.arange(LENGTH)[None, None, None] <= slot
    out_N1HD, weights_NH1K = step.attend(q_N1HD, mask_N1QK)
    expected_out, expected_weights = _reference_attention(q_N1HD, key_NHKD, value_NHKD, slot)
    np.testing.assert_allclose(out_N1HD, expected_out, atol=1e-5)
    np.testing.assert_allclose(weights_NH1K[:, :, 0], expected_weights, atol=1e-6)
    assert step.length == LENGTH


def test_beam_attention_with_relative_positions_and_a_bias_equals_the_row_caches():
  rng = np.random.default_rng(2)
  relative = attention_variants.Relative(_random(rng, 5, HEAD_DIM), _random(rng, 5, HEAD_DIM), 2)
  for slot, step, _, (key_NHKD, value_NHKD), q_N1HD in _search_like_steps(seed=3, first_slot=2):
    mask_N1QK = jnp.arange(LENGTH)[None, None, None] <= slot
    buckets_1QKR = attention_variants.relative_buckets(
        jnp.full((1, 1), slot), jnp.arange(LENGTH)[None], 2, jnp.float32)
    bias_NHQK = _random(rng, ROWS, HEADS, 1, LENGTH)
    got = step.attend(q_N1HD, mask_N1QK, relative, buckets_1QKR, bias_NHQK)
    expected = RowCache(jnp.asarray(key_NHKD), jnp.asarray(value_NHKD)).attend(
        q_N1HD, mask_N1QK, relative, buckets_1QKR, bias_NHQK)
    for got_part, expected_part in zip(got, expected):
      np.testing.assert_allclose(got_part, expected_part, atol=1e-5)


def test_each_row_and_slot_is_written_once_at_the_step_of_its_position():
  written = {}  # (row, slot) -> the step that changed it.
  previous = None
  for slot, step, cache, _, _ in _search_like_steps(seed=4):
    # The step reads the cache as it was handed over, and reordering moved none of it.
    if previous is not None:
      np.testing.assert_array_equal(step.key_HBDWK, previous.key_HBDWK)
      np.testing.assert_array_equal(step.value_HNKD, previous.value_HNKD)
    changed_NK = ((np.asarray(cache.value_HNKD) != np.asarray(step.value_HNKD)).any((0, 3))
                  | (np.asarray(cache.key_HBDWK) != np.asarray(step.key_HBDWK)).any(
                      (0, 2)).reshape(ROWS, LENGTH))
    for row, changed_slot in zip(*np.nonzero(changed_NK)):
      assert (row, changed_slot) not in written
      written[row, changed_slot] = slot
    # A beam reads its own new key: the origin of its slot is its own row.
    np.testing.assert_array_equal(cache.origin_BWK[:, :, slot],
                                  np.broadcast_to(np.arange(BEAMS), (SENTENCES, BEAMS)))
    previous = cache
  assert written == {(row, slot): slot for row in range(ROWS) for slot in range(1, LENGTH)}


def test_reorder_moves_only_the_origin_table():
  rng = np.random.default_rng(5)
  cache = BeamCache.start(_random(rng, ROWS, HEADS, LENGTH, HEAD_DIM),
                          _random(rng, ROWS, HEADS, LENGTH, HEAD_DIM), SENTENCES)
  parent_BW = np.array([[2, 2, 0], [1, 0, 1]])
  moved = cache.reorder(jnp.asarray(parent_BW))
  assert moved.key_HBDWK is cache.key_HBDWK and moved.value_HNKD is cache.value_HNKD
  np.testing.assert_array_equal(moved.origin_BWK[:, :, 0], parent_BW)


CONFIG = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=2,
                           num_encoder_layers=1, num_decoder_layers=2, max_len=16,
                           attention_dropout=0.0, deterministic=True)


def _ranks(tree) -> dict:
  return {jax.tree_util.keystr(path): len(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize('pattern', ['full', 'full,compressed'])
def test_the_search_cache_keeps_each_entry_name_at_one_rank(pattern):
  config = dataclasses.replace(CONFIG, attention_pattern=pattern, compression_stride=2)
  rows = decode.init_cache(config, ROWS, 8)
  beams = decode._with_beam_caches(rows, SENTENCES, config)  # pylint: disable=protected-access
  ranks = _ranks(beams)
  # Keys and values with one row per beam are [N, H, K, D] wherever they are, before and after;
  # a BeamCache's fields have their own names and ranks.
  for name, rank in {**_ranks(rows), **ranks}.items():
    if name.endswith(("['key']", "['value']")):
      assert rank == 4, name
  layers = {'full': ['decoder_0', 'decoder_1'], 'full,compressed': ['decoder_0']}[pattern]
  for layer in layers:
    entry = beams[layer]['self_attention']
    assert set(entry) == {'index', attention_cache.BEAM_ENTRY}
    assert isinstance(entry[attention_cache.BEAM_ENTRY], BeamCache)
    assert [ranks[f"['{layer}']['self_attention']['{attention_cache.BEAM_ENTRY}'].{field}"]
            for field in ('key_HBDWK', 'origin_BWK', 'value_HNKD')] == [5, 3, 4]
  if pattern == 'full,compressed':  # Compressed blocks mix a row's keys: rows move instead.
    assert 'key' in beams['decoder_1']['self_attention']
  # A reorder keeps every entry's shape.
  moved = decode._reorder_cache(  # pylint: disable=protected-access
      beams, jnp.zeros((SENTENCES, BEAMS), jnp.int32), config)
  assert jax.tree.map(jnp.shape, moved) == jax.tree.map(jnp.shape, beams)
