"""flash_attention.py's kernels for TPUs: Pallas kernels that Mosaic compiles.

The arithmetic and the dropout masks are flash_attention.py's (the same hash over (seed, row,
head, query, key)); what differs is the layout Mosaic wants. A TPU vector is 8 sublanes by 128
lanes, and a block's last two dimensions are tiled that way, so each kernel works on the
transposed scores s_KQ = k q^T: the per-query statistics (running maximum, sum, log-sum-exp,
delta) are then [1, Q] rows, lane-dense in memory, instead of [Q] columns that Mosaic would pad
to 128 lanes each. Queries and keys come as [B, H, L, D] (the caller's transposes become
layouts XLA gives the projections), the output and its gradient as [B, H, D, Q]. Lengths are
padded to whole blocks of 128 to 512 by the caller; on a CPU the kernels run in the Pallas
interpreter (tests).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from t2t_jax.model import flash_masks

Array = jax.Array
MASKED = flash_masks.MASKED
Settings = flash_masks.Settings  # What the kernels are compiled for, as the GPU kernels'.
# The longest padded row the kernels take: each program holds a row's whole keys (forward, dq)
# or queries (dk, dv) in VMEM; 8,192 at a head size of 64 compiled for a v5e, 16,384 did not.
MOST_TOKENS = 8192


def _scores(k_KD, q_QD, key_ids_K1, query_ids_1Q, first_key, first_query, causal):
  """Block scores k q^T [K, Q] in float32, MASKED where the query does not see the key; the
  visibility and the positions come back too."""
  s_KQ = lax.dot_general(k_KD, q_QD, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
  keys_KQ = first_key + lax.broadcasted_iota(jnp.int32, s_KQ.shape, 0)
  queries_KQ = first_query + lax.broadcasted_iota(jnp.int32, s_KQ.shape, 1)
  visible_KQ = key_ids_K1 == query_ids_1Q
  if causal:
    visible_KQ = visible_KQ & (keys_KQ <= queries_KQ)
  return jnp.where(visible_KQ, s_KQ, MASKED), visible_KQ, queries_KQ, keys_KQ


def _forward_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, out_ref,
                    lse_ref, *, settings: Settings):
  block_q, depth = q_ref.shape
  block_k = settings.block_k
  first_query = pl.program_id(2) * block_q
  key = flash_masks.program_stream(scalars_ref, settings)
  q_QD, query_ids_1Q = q_ref[...], query_ids_ref[...]

  def step(j, carry):
    m_1Q, l_1Q, acc_DQ = carry
    first_key = pl.multiple_of(j * block_k, block_k)
    part = pl.ds(first_key, block_k)
    s_KQ, _, queries_KQ, keys_KQ = _scores(k_ref[part, :], q_QD, key_ids_ref[part, :],
                                           query_ids_1Q, first_key, first_query,
                                           settings.causal)
    m_next_1Q = jnp.maximum(m_1Q, s_KQ.max(axis=0, keepdims=True))
    p_KQ = jnp.exp(s_KQ - m_next_1Q)
    scale_1Q = jnp.exp(m_1Q - m_next_1Q)
    v_KD = v_ref[part, :]
    keep_KQ = flash_masks.block_keep(key, queries_KQ, keys_KQ, settings)
    p_used_KQ = flash_masks.dropped(p_KQ, keep_KQ, settings).astype(v_KD.dtype)
    acc_DQ = acc_DQ * scale_1Q + lax.dot_general(v_KD, p_used_KQ, (((0,), (0,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
    return m_next_1Q, l_1Q * scale_1Q + p_KQ.sum(axis=0, keepdims=True), acc_DQ

  init = (jnp.full((1, block_q), MASKED, jnp.float32), jnp.zeros((1, block_q), jnp.float32),
          jnp.zeros((depth, block_q), jnp.float32))
  m_1Q, l_1Q, acc_DQ = lax.fori_loop(0, k_ref.shape[0] // block_k, step, init)
  sees = m_1Q > 0.5 * MASKED  # As flash_attention.py: a query that sees no key gives 0.
  out_ref[...] = jnp.where(sees, acc_DQ / l_1Q, 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(sees, m_1Q + jnp.log(l_1Q), -MASKED)


def _key_grads_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, dout_ref,
                      lse_ref, delta_ref, dk_ref, dv_ref, *, settings: Settings):
  block_k, depth = k_ref.shape
  block_q = settings.block_q
  first_key = pl.program_id(2) * block_k
  key = flash_masks.program_stream(scalars_ref, settings)
  k_KD, v_KD, key_ids_K1 = k_ref[...], v_ref[...], key_ids_ref[...]

  def step(i, carry):
    dk_KD, dv_KD = carry
    first_query = pl.multiple_of(i * block_q, block_q)
    part = pl.ds(first_query, block_q)
    q_QD, dout_DQ = q_ref[part, :], dout_ref[:, part]
    s_KQ, visible_KQ, queries_KQ, keys_KQ = _scores(k_KD, q_QD, key_ids_K1,
                                                    query_ids_ref[:, part], first_key,
                                                    first_query, settings.causal)
    p_KQ = jnp.exp(s_KQ - lse_ref[:, part])
    keep_KQ = flash_masks.block_keep(key, queries_KQ, keys_KQ, settings)  # Once for dP and dV.
    dp_KQ = flash_masks.dropped(jnp.dot(v_KD, dout_DQ, preferred_element_type=jnp.float32),
                                keep_KQ, settings)
    dropped_KQ = flash_masks.dropped(p_KQ, keep_KQ, settings).astype(dout_DQ.dtype)
    dv_KD += lax.dot_general(dropped_KQ, dout_DQ, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ds_KQ = jnp.where(visible_KQ, p_KQ * (dp_KQ - delta_ref[:, part]), 0.0)
    dk_KD += jnp.dot(ds_KQ.astype(q_QD.dtype), q_QD, preferred_element_type=jnp.float32)
    return dk_KD, dv_KD

  zeros = jnp.zeros((block_k, depth), jnp.float32)
  dk_KD, dv_KD = lax.fori_loop(0, q_ref.shape[0] // block_q, step, (zeros, zeros))
  dk_ref[...] = dk_KD.astype(dk_ref.dtype)
  dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _query_grads_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, dout_ref,
                        lse_ref, delta_ref, dq_ref, *, settings: Settings):
  block_q, depth = q_ref.shape
  block_k = settings.block_k
  first_query = pl.program_id(2) * block_q
  key = flash_masks.program_stream(scalars_ref, settings)
  q_QD, dout_DQ, query_ids_1Q = q_ref[...], dout_ref[...], query_ids_ref[...]
  lse_1Q, delta_1Q = lse_ref[...], delta_ref[...]

  def step(j, dq_QD):
    first_key = pl.multiple_of(j * block_k, block_k)
    part = pl.ds(first_key, block_k)
    k_KD, v_KD = k_ref[part, :], v_ref[part, :]
    s_KQ, visible_KQ, queries_KQ, keys_KQ = _scores(k_KD, q_QD, key_ids_ref[part, :],
                                                    query_ids_1Q, first_key, first_query,
                                                    settings.causal)
    p_KQ = jnp.exp(s_KQ - lse_1Q)
    keep_KQ = flash_masks.block_keep(key, queries_KQ, keys_KQ, settings)
    dp_KQ = flash_masks.dropped(jnp.dot(v_KD, dout_DQ, preferred_element_type=jnp.float32),
                                keep_KQ, settings)
    ds_KQ = jnp.where(visible_KQ, p_KQ * (dp_KQ - delta_1Q), 0.0)
    return dq_QD + lax.dot_general(ds_KQ.astype(k_KD.dtype), k_KD, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

  dq_QD = lax.fori_loop(0, k_ref.shape[0] // block_k, step,
                        jnp.zeros((block_q, depth), jnp.float32))
  dq_ref[...] = dq_QD.astype(dq_ref.dtype)


def _rows_specs(length: int, block: int | None, depth: int):
  """BlockSpecs on the grid (B, H, blocks) of a [B, H, L, D] array, its [B, H, D, L] transpose,
  the [B, 1, L] ids read as a row, the [B, L, 1] ids read as a column and a [B, H, 1, L]
  statistic: blocks of `block` along L, or (None) the whole length at every step."""
  size = length if block is None else block
  at = (lambda b, h, i: 0) if block is None else (lambda b, h, i: i)
  return (pl.BlockSpec((None, None, size, depth), lambda b, h, i: (b, h, at(b, h, i), 0)),
          pl.BlockSpec((None, None, depth, size), lambda b, h, i: (b, h, 0, at(b, h, i))),
          pl.BlockSpec((None, 1, size), lambda b, h, i: (b, 0, at(b, h, i))),
          pl.BlockSpec((None, size, 1), lambda b, h, i: (b, at(b, h, i), 0)),
          pl.BlockSpec((None, None, 1, size), lambda b, h, i: (b, h, 0, at(b, h, i))))


_SCALARS_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)


def _call(kernel, settings: Settings, name, grid, in_specs, out_specs, out_shape, *args):
  return pl.pallas_call(
      functools.partial(kernel, settings=settings), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, name=name, interpret=settings.interpret,
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel',) * 3))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(settings: Settings, scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q, key_ids_BK1):
  return _flash_forward(settings, scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q,
                        key_ids_BK1)[0]


def _flash_forward(settings: Settings, scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q,
                   key_ids_BK1):
  batch, local_heads, queries, depth = q_BHQD.shape
  keys = k_BHKD.shape[2]
  q_block, out_block, query_ids_block, _, stats_block = _rows_specs(queries, settings.block_q,
                                                                    depth)
  k_all, _, _, key_ids_all, _ = _rows_specs(keys, None, depth)
  out_BHDQ, lse_BH1Q = _call(
      _forward_kernel, settings, 't2t_flash_fwd',
      (batch, local_heads, queries // settings.block_q),
      [_SCALARS_SPEC, q_block, k_all, k_all, query_ids_block, key_ids_all],
      [out_block, stats_block],
      [jax.ShapeDtypeStruct((batch, local_heads, depth, queries), q_BHQD.dtype),
       jax.ShapeDtypeStruct((batch, local_heads, 1, queries), jnp.float32)],
      scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q, key_ids_BK1)
  return out_BHDQ, (scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q, key_ids_BK1, out_BHDQ,
                    lse_BH1Q)


def _flash_backward(settings: Settings, saved, dout_BHDQ):
  scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q, key_ids_BK1, out_BHDQ, lse_BH1Q = saved
  batch, local_heads, queries, depth = q_BHQD.shape
  keys = k_BHKD.shape[2]
  # As in flash_attention.py: sum_k P_qk dP_qk of each query is dout_q . out_q.
  delta_BH1Q = jnp.einsum('BHDQ,BHDQ->BHQ', dout_BHDQ.astype(jnp.float32),
                          out_BHDQ.astype(jnp.float32))[:, :, None, :]
  args = (scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_B1Q, key_ids_BK1, dout_BHDQ, lse_BH1Q,
          delta_BH1Q)
  # dk, dv: a grid over key blocks, each reading every query.
  q_all, dout_all, query_ids_all, _, stats_all = _rows_specs(queries, None, depth)
  k_block, _, _, key_ids_block, _ = _rows_specs(keys, settings.block_k, depth)
  dk_BHKD, dv_BHKD = _call(
      _key_grads_kernel, settings, 't2t_flash_dkv',
      (batch, local_heads, keys // settings.block_k),
      [_SCALARS_SPEC, q_all, k_block, k_block, query_ids_all, key_ids_block, dout_all,
       stats_all, stats_all],
      [k_block, k_block],
      [jax.ShapeDtypeStruct(k_BHKD.shape, k_BHKD.dtype),
       jax.ShapeDtypeStruct(v_BHKD.shape, v_BHKD.dtype)], *args)
  # dq: a grid over query blocks, each reading every key.
  q_block, dout_block, query_ids_block, _, stats_block = _rows_specs(queries, settings.block_q,
                                                                     depth)
  k_all, _, _, key_ids_all, _ = _rows_specs(keys, None, depth)
  dq_BHQD = _call(
      _query_grads_kernel, settings, 't2t_flash_dq',
      (batch, local_heads, queries // settings.block_q),
      [_SCALARS_SPEC, q_block, k_all, k_all, query_ids_block, key_ids_all, dout_block,
       stats_block, stats_block],
      q_block, jax.ShapeDtypeStruct(q_BHQD.shape, q_BHQD.dtype), *args)
  return None, dq_BHQD, dk_BHKD, dv_BHKD, None, None


_flash.defvjp(_flash_forward, _flash_backward)


def attend(settings: Settings, scalars: Array, q_BQHD: Array, k_BKHD: Array, v_BKHD: Array,
           query_ids_BQ: Array, key_ids_BK: Array) -> Array:
  """The kernels over one device's rows and heads, [B, Q, H, D] in and out, the lengths whole
  blocks; `scalars` as flash_attention.py's (seed, first row, first head, 0)."""
  q_BHQD, k_BHKD, v_BHKD = (x.transpose(0, 2, 1, 3) for x in (q_BQHD, k_BKHD, v_BKHD))
  out_BHDQ = _flash(settings, scalars, q_BHQD, k_BHKD, v_BHKD, query_ids_BQ[:, None, :],
                    key_ids_BK[:, :, None])
  return out_BHDQ.transpose(0, 3, 1, 2)


def block(length: int) -> int:
  """The block along a length: the largest of 512, 256 and 128 that pads it least."""
  padded = -(-length // 128) * 128
  return next(size for size in (512, 256, 128) if padded % size == 0)
