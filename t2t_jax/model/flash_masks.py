"""What the flash attention kernels for GPUs (flash_attention.py) and TPUs
(flash_attention_tpu.py) share: their static settings and their dropout masks, prng.py's
hash32 generator over (seed, row, head, query, key), drawn wherever a kernel needs them,
backward included, and the same on every platform for the same padded key length.
"""

from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from t2t_jax.model import prng

Array = jax.Array

MASKED = -1e30  # A score no query may see: finite, so the online softmax stays NaN-free.


class Settings(NamedTuple):
  """What the kernels are compiled for (static): the mask pattern, the dropout rate, the global
  head count (for the masks' stream keys), the blocks along queries and keys, the Pallas
  interpreter or not, and the masks' counter stride (the padded key length)."""
  causal: bool
  rate: float
  heads: int
  block_q: int
  block_k: int
  interpret: bool
  stride: int


def stream(seed: Array, row: Array, head: Array, heads: int) -> tuple[Array, Array]:
  """The two uint32 key words of one (row, head): the seed, and the seed and the pair's index
  mixed (were the second word the pair's alone, two seeds' masks would be permutations of
  each other: the first word only flips counter bits)."""
  seed = seed.astype(jnp.uint32)
  pair = row.astype(jnp.uint32) * jnp.uint32(heads) + head.astype(jnp.uint32)
  return seed, prng.mix(prng.mix(seed ^ jnp.uint32(0x9E3779B9)) + pair)


def keep_mask(key: tuple[Array, Array], queries_QK: Array, keys_QK: Array, stride: int,
              rate: float) -> Array:
  """Which weights dropout keeps, for the query and key positions given, under the key words
  of one (row, head): each is kept with probability 1 - rate, independently of the others.
  The bits are prng.py's hash32 generator's, in a domain of their own."""
  counter = queries_QK.astype(jnp.uint32) * jnp.uint32(stride) + keys_QK.astype(jnp.uint32)
  bits = prng.hash_bits(counter, key, prng.ATTENTION_DROPOUT)
  return bits >= jnp.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def reference_keep(seed: int, rows: int, heads: int, queries: int, keys: int,
                   rate: float) -> Array:
  """The [B, H, Q, K] keep mask the kernels draw for `seed` (tests and the explicit check)."""
  q_QK = lax.broadcasted_iota(jnp.int32, (queries, keys), 0)
  k_QK = lax.broadcasted_iota(jnp.int32, (queries, keys), 1)
  def one(row, head):
    return keep_mask(stream(jnp.uint32(seed), row, head, heads), q_QK, k_QK, keys, rate)
  return jax.vmap(lambda b: jax.vmap(lambda h: one(b, h))(jnp.arange(heads)))(jnp.arange(rows))


def program_stream(scalars_ref, settings: Settings) -> tuple[Array, Array]:
  """Inside a kernel: the key words of the program's (row, head), from the scalars' seed, first
  row and first head offset by the program's place on the (B, H, blocks) grid."""
  return stream(scalars_ref[0], scalars_ref[1] + pl.program_id(0),
                scalars_ref[2] + pl.program_id(1), settings.heads)


def block_keep(key, queries: Array, keys: Array, settings: Settings) -> Array | None:
  """A block's dropout mask for the query and key positions given, or None without dropout."""
  if not settings.rate:
    return None
  return keep_mask(key, queries, keys, settings.stride, settings.rate)


def dropped(x: Array, keep: Array | None, settings: Settings) -> Array:
  """x with the dropout mask `keep` and 1 / (1 - rate) scaling applied (x itself without)."""
  if keep is None:
    return x
  return jnp.where(keep, x * (1.0 / (1.0 - settings.rate)), 0.0)
