"""Random bits for dropout: the choice of PRNG, and a cheap counter-based hash PRNG.

Dropout needs one uniform draw per activation, about 15 million per step of a base model.
JAX's default threefry2x32 spends 20 rounds of add/rotate/xor per 64 bits on that, which was
a fifth of the whole CPU train step. 'hash32' computes each 32-bit word from its position
and the key with two rounds of a multiply-xorshift integer hash: a few integer operations per
element, fused into the consumer, and split over devices like the array it feeds (the
counter is the element's position, as in threefry's partitionable mode), so a sharded run
draws exactly the bits of an unsharded one. It is meant for dropout masks, not cryptography.
"""

import jax
from jax import lax
import jax.extend.random
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError

# Dropout PRNGs offered by config.model.dropout_prng, the fastest on CPU first.
DROPOUT_PRNGS = ('hash32', 'threefry2x32', 'rbg', 'unsafe_rbg')

# Domain-separation constants (odd, arbitrary) so that bits, split keys, folded keys and
# seeds derived from one key never share a stream.
_BITS, _BITS_HIGH, _SPLIT, _FOLD, _SEED = 0x0, 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F
ATTENTION_DROPOUT = 0x165667B1  # flash_attention.py's masks.


def mix(x: jax.Array) -> jax.Array:
  """A bijective avalanche on uint32 (multiply-xorshift, constants of the 'lowbias32' hash)."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * np.uint32(0x735A2D97)
  return x ^ (x >> 15)


def hash_bits(counter: jax.Array, key, domain: int) -> jax.Array:
  """32 pseudo-random bits per counter: two keyed rounds, one per word of `key` (two uint32
  words: an array or a pair of scalars)."""
  x = mix(counter ^ (key[0] ^ np.uint32(domain)))
  return mix(x + key[1])


def _positions(shape) -> jax.Array:
  """Row-major element index as uint32, built from per-dimension iotas (partitionable)."""
  if int(np.prod(shape, dtype=np.int64)) >= 2**32:
    raise NotImplementedError(f'hash32 draws at most 2**32 values per call, not {shape}')
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
    stride *= shape[dim]
  return index


def _random_bits(key: jax.Array, bit_width: int, shape) -> jax.Array:
  counter = _positions(tuple(shape))
  bits = hash_bits(counter, key, _BITS)
  if bit_width == 64:
    high = hash_bits(counter, key, _BITS_HIGH).astype(jnp.uint64)
    return (high << np.uint64(32)) | bits.astype(jnp.uint64)
  return bits.astype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width])


def _split(key: jax.Array, shape) -> jax.Array:
  counter = _positions(tuple(shape) + (2,))
  return hash_bits(counter, key, _SPLIT)


def _fold_in(key: jax.Array, data) -> jax.Array:
  data = lax.convert_element_type(data, jnp.uint32)
  return jnp.stack([hash_bits(data, key, _FOLD), hash_bits(data, key, _FOLD + 1)])


def _seed(seed) -> jax.Array:
  seed = jnp.asarray(seed)
  low = lax.convert_element_type(seed, jnp.uint32)
  high = (lax.convert_element_type(seed >> 32, jnp.uint32) if seed.dtype.itemsize == 8
          else jnp.zeros_like(low))
  return _split(jnp.stack([low, high]) ^ np.uint32(_SEED), (1,))[0]


HASH32 = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in,
    name='hash32', tag='h32')


def impl(name: str):
  """The JAX PRNG implementation (spec or registered name) behind a dropout PRNG name."""
  if name not in DROPOUT_PRNGS:
    raise ConfigError(f'config.model.dropout_prng={name!r} must be one of {DROPOUT_PRNGS}')
  return HASH32 if name == 'hash32' else name


def dropout_key(key: jax.Array, name: str) -> jax.Array:
  """Raw key data of dropout PRNG `name`, derived from the raw threefry key `key`.

  PRNGs with a 2-word key take `key` as it is; rbg's 4 words are drawn from it.
  """
  # Traced only (not run): an eager key would compile each of the hash's operations apart.
  shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl(name)))).shape
  return key if shape == key.shape else jax.random.bits(key, shape, jnp.uint32)
