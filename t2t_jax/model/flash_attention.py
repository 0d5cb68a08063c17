"""Flash attention with dropout on its weights, as Pallas kernels (`attention_impl='flash'`).

The fused kernels JAX ships apply no dropout to the attention weights (`jax.nn.
dot_product_attention`, splash attention) or take its seed as a compile-time constant
(cuDNN's), so a model trained with attention dropout, as the paper's is, kept the explicit
softmax(q k^T) v, whose [B, H, Q, K] scores, weights and masks cross memory forward and
backward. Here the three kernels (forward; backward for dk and dv; backward for dq) keep those
arrays in on-chip memory, a block at a time, and draw the dropout masks wherever they need
them, backward included, instead of storing them (flash_masks.py: a hash over (seed, row,
head, query, key), a few integer operations per weight). The arithmetic is the explicit
path's with those masks; they are not the ones flax's nn.Dropout would draw from the same key.

Which keys a query sees is given as in splash attention (pallas_attention.SplashRows): equal
ids, and with `causal` no later position. The kernels here compile through Triton for GPUs;
flash_attention_tpu.py has the same ones for TPUs (Mosaic), and `flash_attention` picks by the
platform. On a CPU either runs in the Pallas interpreter (slow, for tests). Shapes in names
follow the package legend (t2t_jax/__init__.py).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
import jax.numpy as jnp

from t2t_jax.model import flash_attention_tpu
from t2t_jax.model import flash_masks
from t2t_jax.model import pallas_attention

Array = jax.Array

MASKED = flash_masks.MASKED
SCALARS = 4  # seed, first row, first head, unused: a power of two, as Triton loads need.


_Settings = flash_masks.Settings  # What the kernels are compiled for.


def _scores(q, k, query_ids, key_ids, first_query, first_key, causal):
  """Block scores q k^T in float32, MASKED where the query does not see the key; the
  visibility and the positions come back too."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  shape = s.shape
  queries = first_query + lax.broadcasted_iota(jnp.int32, shape, 0)
  keys = first_key + lax.broadcasted_iota(jnp.int32, shape, 1)
  visible = query_ids[:, None] == key_ids[None, :]
  if causal:
    visible = visible & (keys <= queries)
  return jnp.where(visible, s, MASKED), visible, queries, keys


def _forward_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, out_ref,
                    lse_ref, *, settings: _Settings):
  block_q, depth = q_ref.shape
  block_k = settings.block_k
  first_query = pl.program_id(2) * block_q
  key = flash_masks.program_stream(scalars_ref, settings)
  q, query_ids = q_ref[...], query_ids_ref[...]

  def step(j, carry):
    m, l, acc = carry
    first_key = j * block_k
    part = pl.ds(first_key, block_k)
    s, _, queries, keys = _scores(q, k_ref[part, :], query_ids, key_ids_ref[part], first_query,
                                  first_key, settings.causal)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    scale = jnp.exp(m - m_next)
    keep = flash_masks.block_keep(key, queries, keys, settings)
    p_used = flash_masks.dropped(p, keep, settings)
    v = v_ref[part, :]
    acc = acc * scale[:, None] + jnp.dot(p_used.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32)
    return m_next, l * scale + p.sum(axis=1), acc

  init = (jnp.full((block_q,), MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q, depth), jnp.float32))
  m, l, acc = lax.fori_loop(0, k_ref.shape[0] // block_k, step, init)
  # A query that sees no key (m still MASKED): output 0, and a log-sum-exp that gives its
  # weights 0 in the backward kernels.
  sees = m > 0.5 * MASKED
  out_ref[...] = jnp.where(sees[:, None], acc / l[:, None], 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(sees, m + jnp.log(l), -MASKED)


def _key_grads_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, dout_ref,
                      lse_ref, delta_ref, dk_ref, dv_ref, *, settings: _Settings):
  block_k, depth = k_ref.shape
  block_q = settings.block_q
  first_key = pl.program_id(2) * block_k
  key = flash_masks.program_stream(scalars_ref, settings)
  k, v, key_ids = k_ref[...], v_ref[...], key_ids_ref[...]

  def step(i, carry):
    dk, dv = carry
    first_query = i * block_q
    part = pl.ds(first_query, block_q)
    q, dout = q_ref[part, :], dout_ref[part, :]
    s, visible, queries, keys = _scores(q, k, query_ids_ref[part], key_ids, first_query,
                                        first_key, settings.causal)
    keep = flash_masks.block_keep(key, queries, keys, settings)  # Drawn once for dP and dV.
    p = jnp.exp(s - lse_ref[part][:, None])
    dp = flash_masks.dropped(lax.dot_general(dout, v, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32), keep, settings)
    dv += lax.dot_general(flash_masks.dropped(p, keep, settings).astype(dout.dtype), dout,
                          (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    ds = jnp.where(visible, p * (dp - delta_ref[part][:, None]), 0.0)
    dk += lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return dk, dv

  zeros = jnp.zeros((block_k, depth), jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, step, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _query_grads_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, dout_ref,
                        lse_ref, delta_ref, dq_ref, *, settings: _Settings):
  block_q, depth = q_ref.shape
  block_k = settings.block_k
  first_query = pl.program_id(2) * block_q
  key = flash_masks.program_stream(scalars_ref, settings)
  q, dout, query_ids = q_ref[...], dout_ref[...], query_ids_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def step(j, dq):
    first_key = j * block_k
    part = pl.ds(first_key, block_k)
    k, v = k_ref[part, :], v_ref[part, :]
    s, visible, queries, keys = _scores(q, k, query_ids, key_ids_ref[part], first_query,
                                        first_key, settings.causal)
    p = jnp.exp(s - lse[:, None])
    keep = flash_masks.block_keep(key, queries, keys, settings)
    dp = flash_masks.dropped(lax.dot_general(dout, v, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32), keep, settings)
    ds = jnp.where(visible, p * (dp - delta[:, None]), 0.0)
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, step,
                     jnp.zeros((block_q, depth), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _rows_spec(length: int, block: int | None, depth: int):
  """BlockSpecs of a [B, L, H, D] array and its [B, L] ids on the grid (B, H, blocks): blocks
  of `block` along L, or (None) the whole length at every step."""
  if block is None:
    return (pl.BlockSpec((None, length, None, depth), lambda b, h, i: (b, 0, h, 0)),
            pl.BlockSpec((None, length), lambda b, h, i: (b, 0)))
  return (pl.BlockSpec((None, block, None, depth), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, block), lambda b, h, i: (b, i)))


def _stats_spec(length: int, block: int | None):
  """The BlockSpec of a [B, H, Q] per-query statistic, as `_rows_spec`."""
  if block is None:
    return pl.BlockSpec((None, None, length), lambda b, h, i: (b, h, 0))
  return pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))


_SCALARS_SPEC = pl.BlockSpec((SCALARS,), lambda b, h, i: (0,))


def _call(kernel, settings: _Settings, name, grid, in_specs, out_specs, out_shape, *args):
  return pl.pallas_call(
      functools.partial(kernel, settings=settings), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, name=name, interpret=settings.interpret,
      compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=2))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(settings: _Settings, scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK):
  return _flash_forward(settings, scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK)[0]


def _flash_forward(settings: _Settings, scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ,
                   key_ids_BK):
  (batch, queries, local_heads, depth), keys = q_BQHD.shape, k_BKHD.shape[1]
  q_spec, query_id_spec = _rows_spec(queries, settings.block_q, depth)
  k_spec, key_id_spec = _rows_spec(keys, None, depth)
  out_BQHD, lse_BHQ = _call(
      _forward_kernel, settings, 't2t_flash_fwd', (batch, local_heads, queries // settings.block_q),
      [_SCALARS_SPEC, q_spec, k_spec, k_spec, query_id_spec, key_id_spec],
      [q_spec, _stats_spec(queries, settings.block_q)],
      [jax.ShapeDtypeStruct(q_BQHD.shape, q_BQHD.dtype),
       jax.ShapeDtypeStruct((batch, local_heads, queries), jnp.float32)],
      scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK)
  return out_BQHD, (scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, out_BQHD, lse_BHQ)


def _flash_backward(settings: _Settings, saved, dout_BQHD):
  scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, out_BQHD, lse_BHQ = saved
  (batch, queries, local_heads, depth), keys = q_BQHD.shape, k_BKHD.shape[1]
  block_q, block_k = settings.block_q, settings.block_k
  # sum_k P_qk dP_qk of each query (dP the gradient of the weights before dropout) is
  # dout_q . out_q: dropout's scaling is inside out.
  delta_BHQ = jnp.einsum('BQHD,BQHD->BHQ', dout_BQHD.astype(jnp.float32),
                         out_BQHD.astype(jnp.float32))
  args = (scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, dout_BQHD, lse_BHQ,
          delta_BHQ)
  # dk, dv: a grid over key blocks, each reading every query.
  q_all, query_ids_all = _rows_spec(queries, None, depth)
  k_block, key_ids_block = _rows_spec(keys, block_k, depth)
  dk_BKHD, dv_BKHD = _call(
      _key_grads_kernel, settings, 't2t_flash_dkv', (batch, local_heads, keys // block_k),
      [_SCALARS_SPEC, q_all, k_block, k_block, query_ids_all, key_ids_block, q_all,
       _stats_spec(queries, None), _stats_spec(queries, None)],
      [k_block, k_block],
      [jax.ShapeDtypeStruct(k_BKHD.shape, k_BKHD.dtype),
       jax.ShapeDtypeStruct(v_BKHD.shape, v_BKHD.dtype)], *args)
  # dq: a grid over query blocks, each reading every key.
  q_block, query_ids_block = _rows_spec(queries, block_q, depth)
  k_all, key_ids_all = _rows_spec(keys, None, depth)
  dq_BQHD = _call(
      _query_grads_kernel, settings, 't2t_flash_dq', (batch, local_heads, queries // block_q),
      [_SCALARS_SPEC, q_block, k_all, k_all, query_ids_block, key_ids_all, q_block,
       _stats_spec(queries, block_q), _stats_spec(queries, block_q)],
      q_block, jax.ShapeDtypeStruct(q_BQHD.shape, q_BQHD.dtype), *args)
  return None, dq_BQHD, dk_BKHD, dv_BKHD, None, None


_flash.defvjp(_flash_forward, _flash_backward)


def _block(length: int, most: int) -> int:
  """A power-of-two block along a length (Triton's blocks are), at most `most`, at least 16."""
  block = 16
  while block < most and block < length:
    block *= 2
  return block


def flash_attention(q_BQHD: Array, k_BKHD: Array, v_BKHD: Array,
                    rows: 'pallas_attention.SplashRows | None', rate: float = 0.0,
                    seed: Array | None = None, kernels: str | None = None) -> Array:
  """softmax(q k^T) v [B, Q, H, D] over the keys `rows` lets each query see (None: all), with
  dropout at `rate` on the weights, its masks drawn from `seed` (a uint32 scalar; needed when
  rate > 0). The queries come scaled. `kernels`: 'triton' (this module's, for GPUs) or
  'mosaic' (flash_attention_tpu.py's, for TPUs); None picks by the platform they will run on.
  Off their platform they run in the Pallas interpreter (tests).

  Under a mesh the kernels run per device (pallas_attention.per_device); each device draws its
  rows' and heads' masks by their global indices, so the masks do not depend on the mesh.
  """
  batch, queries, heads, _ = q_BQHD.shape
  keys = k_BKHD.shape[1]
  rows = rows or pallas_attention.every_key(batch, queries, keys)
  if rate and seed is None:
    raise ValueError('flash_attention: dropout (rate > 0) needs a seed')
  platform = pallas_attention.kernel_platform()
  kernels = kernels or ('mosaic' if platform == 'tpu' else 'triton')
  if kernels not in ('triton', 'mosaic'):
    raise ValueError(f"flash_attention: kernels={kernels!r} is not 'triton' or 'mosaic'")
  if kernels == 'mosaic':
    block_q, block_k = flash_attention_tpu.block(queries), flash_attention_tpu.block(keys)
  else:
    block_q, block_k = _block(queries, 64), _block(keys, 64)
  padded_q, padded_k = -(-queries // block_q) * block_q, -(-keys // block_k) * block_k
  if kernels == 'mosaic' and max(padded_q, padded_k) > flash_attention_tpu.MOST_TOKENS:
    raise ValueError(f'flash_attention: the TPU kernels hold a row\'s whole keys (and, for dk '
                     f'and dv, queries) in on-chip memory, which {max(padded_q, padded_k)} '
                     f'(padded) outgrow: at most {flash_attention_tpu.MOST_TOKENS}; use '
                     "attention_impl='einsum' for longer rows")
  if padded_q * padded_k >= 2**32:  # The masks' uint32 counters would repeat.
    raise ValueError(f'flash_attention: {padded_q} x {padded_k} (padded) queries and keys is '
                     'too many for the dropout masks\' 32-bit counters')
  interpret = platform != ('tpu' if kernels == 'mosaic' else 'gpu')
  settings = _Settings(rows.causal, float(rate), heads, block_q, block_k, interpret, padded_k)
  seed = jnp.zeros((), jnp.uint32) if seed is None else seed
  seed_i32 = lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32), jnp.int32)

  def attend(q, k, v, query_ids, key_ids, first_row, first_head):
    scalars = jnp.stack([seed_i32, first_row, first_head, jnp.int32(0)])
    if kernels == 'mosaic':
      return flash_attention_tpu.attend(settings, scalars, q, k, v, query_ids, key_ids)
    return _flash(settings, scalars, q, k, v, query_ids, key_ids)

  padded = pallas_attention.padded_to_blocks(q_BQHD, k_BKHD, v_BKHD, rows.query_ids_BQ,
                                             rows.key_ids_BK, padded_q, padded_k)
  return pallas_attention.per_device(attend, *padded)[:, :queries]
