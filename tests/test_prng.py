"""Dropout PRNGs: the hash32 generator's statistics, determinism and sharding invariance."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax.model import prng


def _key(seed=0):
  return jax.random.wrap_key_data(prng.dropout_key(jax.random.PRNGKey(seed), 'hash32'),
                                  impl=prng.HASH32)


def test_bits_are_uniform_and_bit_positions_unbiased():
  bits = np.asarray(jax.random.bits(_key(), (1 << 20,), jnp.uint32))
  # Each of the 32 bit positions is set half the time: 4 standard deviations of 2**20 draws.
  ones = np.unpackbits(bits.view(np.uint8)).reshape(-1, 32).mean(0)
  assert np.all(np.abs(ones - 0.5) < 4 * 0.5 / 2**10)
  # 16 equal bins of the value are equally full (chi-square, 15 degrees of freedom, p ~ 1e-4).
  counts = np.bincount(bits >> 28, minlength=16)
  expected = len(bits) / 16
  assert ((counts - expected)**2 / expected).sum() < 45
  assert len(np.unique(bits)) > 0.999 * len(bits)


def test_dropout_keeps_the_right_fraction_and_scales_by_it():
  x = jnp.ones((256, 1024))
  y = nn.Dropout(0.1).apply({}, x, False, rngs={'dropout': _key(3)})
  kept = np.asarray(y != 0)
  assert abs(kept.mean() - 0.9) < 4 * np.sqrt(0.09 / kept.size)
  np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.9, rtol=1e-6)


def test_keys_from_fold_in_and_split_draw_uncorrelated_streams():
  key = _key(1)
  streams = [jax.random.uniform(k, (1 << 16,)) for k in
             (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1), *jax.random.split(key, 2))]
  streams.append(jax.random.uniform(key, (1 << 16,)))
  correlation = np.corrcoef(np.stack([np.asarray(s) for s in streams]))
  off_diagonal = correlation[~np.eye(len(streams), dtype=bool)]
  assert np.all(np.abs(off_diagonal) < 4 / np.sqrt(1 << 16))
  # Same key, same bits; neighbouring seeds differ everywhere but by chance.
  np.testing.assert_array_equal(streams[0], jax.random.uniform(jax.random.fold_in(key, 0),
                                                               (1 << 16,)))
  same = np.asarray(jax.random.bits(_key(1), (4096,)) == jax.random.bits(_key(2), (4096,)))
  assert same.mean() < 0.01


def test_sharded_draws_equal_unsharded_draws():
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  draw = lambda key: jax.random.bits(key, (64, 24, 5), jnp.uint32)
  sharded = jax.jit(draw, out_shardings=sharding)(_key())
  assert len(sharded.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(sharded), np.asarray(jax.jit(draw)(_key())))


@pytest.mark.parametrize('name', prng.DROPOUT_PRNGS)
def test_every_dropout_prng_is_deterministic_keyed_and_uniform(name):
  seed_key = jax.random.PRNGKey(0)
  data = prng.dropout_key(seed_key, name)
  key = jax.random.wrap_key_data(data, impl=prng.impl(name))
  words = 4 if name in ('rbg', 'unsafe_rbg') else 2
  assert data.shape == (words,) and data.dtype == jnp.uint32
  if words == 2:  # A 2-word PRNG takes the threefry key as it is (prng.dropout_key).
    np.testing.assert_array_equal(data, seed_key)
  # The same raw key gives the same key data and the same bits; another seed other bits.
  np.testing.assert_array_equal(prng.dropout_key(jax.random.PRNGKey(0), name), data)
  draw = lambda k: np.asarray(jax.random.bits(k, (1 << 14,), jnp.uint32))
  bits = draw(key)
  np.testing.assert_array_equal(draw(jax.random.wrap_key_data(data, impl=prng.impl(name))),
                                bits)
  other = draw(jax.random.wrap_key_data(prng.dropout_key(jax.random.PRNGKey(1), name),
                                        impl=prng.impl(name)))
  assert (other == bits).mean() < 0.01
  # fold_in with different data, and the halves of a split, give different streams.
  folded = [draw(jax.random.fold_in(key, i)) for i in range(2)]
  halves = [draw(k) for k in jax.random.split(key)]
  # (threefry's split(key)[i] is its fold_in(key, i), so those two are not compared.)
  for a, b in [(bits, folded[0]), (bits, halves[0]), (folded[0], folded[1]),
               (halves[0], halves[1])]:
    assert (a == b).mean() < 0.01
  # Uniform on [0, 1): the mean within 4 standard deviations of 1/2, every decile filled.
  uniform = np.asarray(jax.random.uniform(key, (1 << 14,)))
  assert uniform.min() >= 0.0 and uniform.max() < 1.0
  assert abs(uniform.mean() - 0.5) < 4 * np.sqrt(1 / 12 / uniform.size)
  counts = np.bincount((uniform * 10).astype(int), minlength=10)
  assert np.all(np.abs(counts - uniform.size / 10) < 5 * np.sqrt(uniform.size * 0.09))


def test_hash32_bits_depend_only_on_the_element_position():
  """The counter is the row-major index: any shape draws the same stream, and a prefix of a
  longer draw equals a shorter draw."""
  key = _key(5)
  flat = np.asarray(jax.random.bits(key, (24,), jnp.uint32))
  np.testing.assert_array_equal(np.asarray(jax.random.bits(key, (4, 6), jnp.uint32)),
                                flat.reshape(4, 6))
  np.testing.assert_array_equal(np.asarray(jax.random.bits(key, (2, 3, 4), jnp.uint32)),
                                flat.reshape(2, 3, 4))
  np.testing.assert_array_equal(np.asarray(jax.random.bits(key, (10,), jnp.uint32)), flat[:10])
  # 8-bit draws are the low byte of each word; no two positions share a word by chance here.
  np.testing.assert_array_equal(np.asarray(jax.random.bits(key, (24,), jnp.uint8)),
                                (flat & 0xFF).astype(np.uint8))
  assert len(set(flat.tolist())) == 24


def test_hash32_seeds_differ_and_keep_the_high_word():
  keys = [np.asarray(jax.random.key_data(jax.random.key(seed, impl=prng.HASH32)))
          for seed in (0, 1, 2)]
  assert len({tuple(k) for k in keys}) == 3
  np.testing.assert_array_equal(
      keys[1], np.asarray(jax.random.key_data(jax.random.key(1, impl=prng.HASH32))))


def test_unknown_dropout_prng_is_refused_naming_the_key():
  with pytest.raises(ValueError, match=r"config.model.dropout_prng='philox' must be one of"):
    prng.impl('philox')
