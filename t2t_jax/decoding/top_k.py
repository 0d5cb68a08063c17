"""Beam search's top-k for a vocabulary-wide last axis, in two vectorised stages.

Shapes in names follow the package legend (t2t_jax/__init__.py): V vocabulary.
"""

import jax
import jax.numpy as jnp

TOP_K_BLOCK = 64  # Entries per block in `top_k`'s first stage.


def top_k(x_xV: jax.Array, count: int, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """lax.top_k's values and indices [..., count] (ties: the lower index first), in two stages
  when the last axis holds at least 4 * count blocks of `block` (default TOP_K_BLOCK) entries.

  XLA:CPU's top-k walks every entry of a row one at a time. Here a row's maximum per block
  of `block` entries is one vectorised pass; the `count` blocks with the largest maxima hold
  the row's `count` largest entries (a block holding one of them has a maximum at least as
  large as it, and fewer than `count` blocks beat it; equal maxima rank the lower block
  first, as equal entries rank the lower index first); the top `count` of those
  count * block entries is the answer. Both small selections are `count` rounds of a max and
  a first-index-of-max, which XLA vectorises (a top-k there became a sort). NaN is not
  supported (it ranks first in lax.top_k, here nowhere in particular).
  """
  vocab, block = x_xV.shape[-1], block or TOP_K_BLOCK
  blocks = -(-vocab // block)
  if blocks < 4 * count:
    return jax.lax.top_k(x_xV, count)
  lead = x_xV.shape[:-1]
  # The leading axes flattened into rows: [rows, blocks, block], padded with -inf.
  blocked = jnp.pad(x_xV.reshape(-1, vocab), [(0, 0), (0, blocks * block - vocab)],
                    constant_values=-jnp.inf).reshape(-1, blocks, block)
  _, chosen = _rounds_of_max(blocked.max(-1), count)  # [rows, count] block indices.
  chosen = jnp.sort(chosen, axis=-1)  # Token order, so ties keep resolving by index.
  candidates = jnp.take_along_axis(blocked, chosen[:, :, None], axis=1)  # [rows, count, block]
  values, at = _rounds_of_max(candidates.reshape(candidates.shape[0], -1), count)
  index = jnp.take_along_axis(chosen, at // block, axis=1) * block + at % block
  return values.reshape(lead + (count,)), index.reshape(lead + (count,))


def _rounds_of_max(x: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """top_k of a [rows, entries] array's short last axis as `count` rounds: the maximum, the
  first index holding it, that entry then set to -inf."""
  entry = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  values, indices = [], []
  for _ in range(count):
    best = x.max(-1, keepdims=True)
    at = jnp.where(x == best, entry, x.shape[1]).min(-1, keepdims=True)
    values.append(best)
    indices.append(at)
    x = jnp.where(entry == at, -jnp.inf, x)
  return jnp.concatenate(values, axis=1), jnp.concatenate(indices, axis=1)
