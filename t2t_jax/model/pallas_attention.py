"""Fused attention on TPUs: the Pallas splash-attention kernel that JAX ships, in t2t_jax's layout.

Splash attention masks by a static pattern (full or causal, the same for every row) and by
segment ids: a query sees a key only where their ids are equal. Padded and packed rows are
both given as such ids (SplashRows), built here from what t2t_jax's masks are made of. On a
CPU the kernel runs in the Pallas interpreter (slow, for tests); on a TPU it compiles.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
import jax.numpy as jnp

Array = jax.Array
P = jax.sharding.PartitionSpec

LANES = 128  # The kernel's blocks along either length are multiples of this.
# The id of the keys the wrapper pads a row with to whole blocks: no query has it.
NO_QUERY_ID = int(jnp.iinfo(jnp.int32).min)


class SplashRows(NamedTuple):
  """Which keys each query sees: those whose id [B, K] equals its id [B, Q], and with `causal`
  only those at or before its own position (self-attention)."""
  query_ids_BQ: Array
  key_ids_BK: Array
  causal: bool


def padded_rows(key_valid_BK: Array, queries: int, causal: bool) -> SplashRows:
  """Right-padded (bucketed) rows: every query, padding ones too, sees the row's real keys.

  That is attention.attention_mask's rule. A row without a real key would leave every query
  seeing none, an empty softmax the kernel warns about (splash.SegmentIds): its queries see
  the row's padding keys instead (the einsum path weighs them uniformly; either output is
  unused).
  """
  has_keys_B1 = key_valid_BK.any(-1, keepdims=True).astype(jnp.int32)
  query_ids_BQ = jnp.broadcast_to(has_keys_B1, (key_valid_BK.shape[0], queries))
  return SplashRows(query_ids_BQ, key_valid_BK.astype(jnp.int32), causal)


def self_rows(valid_BL: Array, segments_BL: Array | None, causal: bool) -> SplashRows:
  """Self-attention's rows: right-padded, or packed with `segments_BL` (0: padding).

  A packed token sees the real tokens of its own segment. A padding query (segment 0) sees
  the padding keys, itself among them even when causal, so no query sees no key; the einsum
  path lets it see every real key instead, but a padding query's output is never used.
  """
  if segments_BL is None:
    return padded_rows(valid_BL, valid_BL.shape[1], causal)
  ids_BL = jnp.where(valid_BL, segments_BL, 0).astype(jnp.int32)
  return SplashRows(ids_BL, ids_BL, causal)


def cross_rows(mask_B1QK: Array, queries: int) -> SplashRows:
  """Cross-attention's rows from attention.attention_mask's mask: [B, 1, 1, K] for right-padded
  sources, [B, 1, Q, K] for packed rows, whose segment ids the mask implies.

  For packed rows a query's id is the first key it sees, and a key's the largest id among the
  queries that see it. A real query's first key is its segment's first; a padding query sees
  every real key, so its first is the first segment's, never a later one. Keys thus get their
  segment's first key as id, provided some real query sees them (each packed source has its
  target); padding queries see the first segment, masked keys get -1, and so do queries that
  see no key (in an empty row), which then see the masked keys, as in the einsum path.
  """
  if mask_B1QK.shape[2] == 1:
    return padded_rows(mask_B1QK[:, 0, 0, :], queries, causal=False)
  mask_BQK = mask_B1QK[:, 0]
  first_BQ = jnp.where(mask_BQK.any(-1), jnp.argmax(mask_BQK, -1), -1).astype(jnp.int32)
  key_ids_BK = jnp.max(jnp.where(mask_BQK, first_BQ[:, :, None], -1), axis=1)
  return SplashRows(first_BQ, key_ids_BK, causal=False)


def splash_attention(q_BQHD: Array, k_BKHD: Array, v_BKHD: Array,
                     rows: SplashRows | None) -> Array:
  """softmax(q k^T) v [B, Q, H, D] over the keys `rows` lets each query see (None: all).

  The queries come scaled (attention._Attention._queries), so the kernel does not scale them.
  Under a mesh (jax.set_mesh) the kernel, which XLA cannot partition, runs per device (see
  `per_device`).
  """
  rows = rows or every_key(q_BQHD.shape[0], q_BQHD.shape[1], k_BKHD.shape[1])
  attend = functools.partial(_attend, causal=rows.causal, interpret=kernel_platform() == 'cpu')
  return per_device(lambda *args, first_row, first_head: attend(*args), q_BQHD, k_BKHD, v_BKHD,
                    rows.query_ids_BQ, rows.key_ids_BK)


def every_key(batch: int, queries: int, keys: int) -> SplashRows:
  """Rows in which every query sees every key."""
  return SplashRows(jnp.zeros((batch, queries), jnp.int32), jnp.zeros((batch, keys), jnp.int32),
                    causal=False)


def kernel_platform() -> str:
  """Where a kernel traced now will run: the mesh's platform under one, else JAX's default."""
  mesh = jax.sharding.get_abstract_mesh()
  return (mesh.abstract_device.platform if not mesh.empty and mesh.abstract_device
          else jax.default_backend())


def per_device(attend, q_BQHD: Array, k_BKHD: Array, v_BKHD: Array, query_ids_BQ: Array,
               key_ids_BK: Array) -> Array:
  """attend(q, k, v, query_ids, key_ids, first_row=, first_head=) [B, Q, H, D] over the whole
  arrays, or under a mesh per device in a jax.shard_map split over the mesh axes the logical
  'batch' and 'heads' axes map to, with the global index of the device's first row and head.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend(q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, first_row=jnp.int32(0),
                  first_head=jnp.int32(0))
  batch_axes, _, head_axes, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  batch_axes = dividing(batch_axes, q_BQHD.shape[0], mesh)
  head_axes = dividing(head_axes, q_BQHD.shape[2], mesh)

  def on_device(q, k, v, query_ids, key_ids):
    first = lambda axes, size: (jnp.int32(0) if axes is None
                                else lax.axis_index(axes).astype(jnp.int32) * size)
    return attend(q, k, v, query_ids, key_ids, first_row=first(batch_axes, q.shape[0]),
                  first_head=first(head_axes, q.shape[2]))

  spec_BLHD, spec_BL = P(batch_axes, None, head_axes, None), P(batch_axes, None)
  # Unchecked: a pallas_call declares no per-axis variance of its outputs.
  return jax.shard_map(on_device, in_specs=(spec_BLHD,) * 3 + (spec_BL,) * 2,
                       out_specs=spec_BLHD, check_vma=False)(
                           q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK)


def padded_to_blocks(q_BQHD: Array, k_BKHD: Array, v_BKHD: Array, query_ids_BQ: Array,
                     key_ids_BK: Array, padded_q: int, padded_k: int) -> tuple[Array, ...]:
  """The arrays padded along their lengths to `padded_q` queries and `padded_k` keys.

  Padding keys are seen by no query; padding queries copy the last real query's id, so they
  see what it sees and never an empty row (their outputs are sliced off: no gradient).
  """
  pad = lambda x, to, **kw: jnp.pad(x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2),
                                    **kw)
  return (pad(q_BQHD, padded_q), pad(k_BKHD, padded_k), pad(v_BKHD, padded_k),
          pad(query_ids_BQ.astype(jnp.int32), padded_q, mode='edge'),
          pad(key_ids_BK.astype(jnp.int32), padded_k, constant_values=NO_QUERY_ID))


def dividing(axes, size: int, mesh):
  """`axes` (a mesh axis, several or None) if they split `size` evenly, else None (replicated).

  Training batches and heads always split (sharding.check_batch_rows, the weights' shardings);
  the one-row dummy batch `setup.init_params` traces the model with does not.
  """
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  shards = 1
  for name in names:
    shards *= mesh.shape[name]
  return axes if size % shards == 0 else None


def _attend(q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, *, causal: bool,
            interpret: bool) -> Array:
  """The kernel over one device's rows and heads, the lengths padded to whole blocks.

  Head sizes below 128 (64 in Transformer-base, 32 or 16 in test configs) need no padding to
  128: a block spans the whole head dimension, and Mosaic compiles these (v5e, libtpu 0.0.42).
  """
  queries, keys, heads = q_BQHD.shape[1], k_BKHD.shape[1], q_BQHD.shape[2]
  block_q, block_k = _block(queries), _block(keys)
  padded_q, padded_k = -(-queries // block_q) * block_q, -(-keys // block_k) * block_k
  q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK = padded_to_blocks(
      q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, padded_q, padded_k)
  q_BHQD, k_BHKD, v_BHKD = (x.transpose(0, 2, 1, 3) for x in (q_BQHD, k_BKHD, v_BKHD))
  shape = (padded_q, padded_k)
  head_mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
  kernel = splash.make_splash_mha(
      masks.MultiHeadMask([head_mask] * heads),
      block_sizes=splash.BlockSizes(
          block_q=block_q, block_kv=block_k, block_q_dkv=block_q, block_kv_dkv=block_k,
          block_q_dq=block_q, block_kv_dq=block_k),
      head_shards=1, q_seq_shards=1, interpret=interpret)
  out_BHQD = jax.vmap(kernel)(q_BHQD, k_BHKD, v_BHKD,
                              splash.SegmentIds(query_ids_BQ, key_ids_BK))
  return out_BHQD.transpose(0, 2, 1, 3)[:, :queries]


def _block(length: int) -> int:
  """The block along a length: the largest of 512, 256 and 128 that pads it least."""
  padded = -(-length // LANES) * LANES
  return next(block for block in (512, 256, 128) if padded % block == 0)
