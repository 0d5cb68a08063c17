"""Flash attention with dropout on its weights, as Pallas kernels (`attention_impl='flash'`).

The fused kernels JAX ships apply no dropout to the attention weights (`jax.nn.
dot_product_attention`, splash attention) or take its seed as a compile-time constant
(cuDNN's), so a model trained with attention dropout, as the paper's is, kept the explicit
softmax(q k^T) v, whose [B, H, Q, K] scores, weights and masks cross memory forward and
backward. Here the three kernels (forward; backward for dk and dv; backward for dq) keep those
arrays in on-chip memory, a block at a time, and draw the dropout masks wherever they need
them, backward included, instead of storing them: prng.py's hash32 generator over (seed,
row, head, query, key), a few integer operations per weight. The arithmetic is the explicit
path's with the masks `keep_mask` draws; they are not the ones flax's nn.Dropout would draw
from the same key.

Which keys a query sees is given as in splash attention (pallas_attention.SplashRows): equal
ids, and with `causal` no later position. On a GPU the kernels compile through Triton; on a CPU
they run in the Pallas interpreter (slow, for tests). Shapes in names follow the package legend
(t2t_jax/__init__.py).
"""

import functools

import flax.linen as nn
import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
import jax.numpy as jnp

from t2t_jax.model import pallas_attention
from t2t_jax.model import prng

Array = jax.Array
P = jax.sharding.PartitionSpec

MASKED = -1e30  # A score no query may see: finite, so the online softmax stays NaN-free.
SCALARS = 4  # seed, first row, first head, unused: a power of two, as Triton loads need.


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


def _dropped(x, key, queries, keys, stride, rate):
  """x with dropout's mask and 1 / (1 - rate) scaling applied (x itself without dropout)."""
  if not rate:
    return x
  return jnp.where(keep_mask(key, queries, keys, stride, rate), x * (1.0 / (1.0 - rate)), 0.0)


def _stream_of(scalars_ref, heads):
  seed, row, head = scalars_ref[0], scalars_ref[1], scalars_ref[2]
  return stream(seed, row + pl.program_id(0), head + pl.program_id(1), heads)


def _forward_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, out_ref,
                    lse_ref, *, block_k, causal, rate, heads, stride):
  block_q, depth = q_ref.shape
  first_query = pl.program_id(2) * block_q
  key = _stream_of(scalars_ref, heads)
  q, query_ids = q_ref[...], query_ids_ref[...]

  def step(j, carry):
    m, l, acc = carry
    first_key = j * block_k
    part = pl.ds(first_key, block_k)
    s, _, queries, keys = _scores(q, k_ref[part, :], query_ids, key_ids_ref[part], first_query,
                                  first_key, causal)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    scale = jnp.exp(m - m_next)
    p_used = _dropped(p, key, queries, keys, stride, rate)
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
                      lse_ref, delta_ref, dk_ref, dv_ref, *, block_q, causal, rate, heads,
                      stride):
  block_k, depth = k_ref.shape
  first_key = pl.program_id(2) * block_k
  key = _stream_of(scalars_ref, heads)
  k, v, key_ids = k_ref[...], v_ref[...], key_ids_ref[...]

  def step(i, carry):
    dk, dv = carry
    first_query = i * block_q
    part = pl.ds(first_query, block_q)
    q, dout = q_ref[part, :], dout_ref[part, :]
    s, visible, queries, keys = _scores(q, k, query_ids_ref[part], key_ids, first_query,
                                        first_key, causal)
    p = jnp.exp(s - lse_ref[part][:, None])
    dp = _dropped(lax.dot_general(dout, v, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32),
                  key, queries, keys, stride, rate)
    p_used = _dropped(p, key, queries, keys, stride, rate)
    dv += lax.dot_general(p_used.astype(dout.dtype), dout, (((0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    ds = jnp.where(visible, p * (dp - delta_ref[part][:, None]), 0.0)
    dk += lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return dk, dv

  zeros = jnp.zeros((block_k, depth), jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, step, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _query_grads_kernel(scalars_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, dout_ref,
                        lse_ref, delta_ref, dq_ref, *, block_k, causal, rate, heads, stride):
  block_q, depth = q_ref.shape
  first_query = pl.program_id(2) * block_q
  key = _stream_of(scalars_ref, heads)
  q, dout, query_ids = q_ref[...], dout_ref[...], query_ids_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def step(j, dq):
    first_key = j * block_k
    part = pl.ds(first_key, block_k)
    k, v = k_ref[part, :], v_ref[part, :]
    s, visible, queries, keys = _scores(q, k, query_ids, key_ids_ref[part], first_query,
                                        first_key, causal)
    p = jnp.exp(s - lse[:, None])
    dp = _dropped(lax.dot_general(dout, v, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32),
                  key, queries, keys, stride, rate)
    ds = jnp.where(visible, p * (dp - delta[:, None]), 0.0)
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, step,
                     jnp.zeros((block_q, depth), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _specs(block_q: int, block_k: int, queries: int, keys: int, depth: int):
  """BlockSpecs over [B, L, H, D] arrays and [B, L] ids, grid (B, H, blocks along L)."""
  def rows(length, over):  # `over`: this grid's blocks are along this length (else whole).
    block = over or length
    along = (lambda b, h, i: (b, i, h, 0)) if over else (lambda b, h, i: (b, 0, h, 0))
    ids = (lambda b, h, i: (b, i)) if over else (lambda b, h, i: (b, 0))
    return (pl.BlockSpec((None, block, None, depth), along), pl.BlockSpec((None, block), ids))
  stats = lambda length, over: pl.BlockSpec(
      (None, None, over or length),
      (lambda b, h, i: (b, h, i)) if over else (lambda b, h, i: (b, h, 0)))
  return rows, stats


def _call(kernel, name, grid, in_specs, out_specs, out_shape, interpret, *args):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      name=name, interpret=interpret,
      compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=2))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _flash(scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, causal, rate, heads,
           blocks, interpret, stride):
  return _flash_forward(scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, causal, rate,
                        heads, blocks, interpret, stride)[0]


def _flash_forward(scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, causal, rate,
                   heads, blocks, interpret, stride):
  (batch, queries, local_heads, depth), keys = q_BQHD.shape, k_BKHD.shape[1]
  block_q, block_k = blocks
  rows, stats = _specs(block_q, block_k, queries, keys, depth)
  q_spec, query_id_spec = rows(queries, block_q)
  k_spec, key_id_spec = rows(keys, None)
  kernel = functools.partial(_forward_kernel, block_k=block_k, causal=causal, rate=rate,
                             heads=heads, stride=stride)
  out_BQHD, lse_BHQ = _call(
      kernel, 't2t_flash_fwd', (batch, local_heads, queries // block_q),
      [pl.BlockSpec((SCALARS,), lambda b, h, i: (0,)), q_spec, k_spec, k_spec, query_id_spec,
       key_id_spec],
      [q_spec, stats(queries, block_q)],
      [jax.ShapeDtypeStruct(q_BQHD.shape, q_BQHD.dtype),
       jax.ShapeDtypeStruct((batch, local_heads, queries), jnp.float32)],
      interpret, scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK)
  return out_BQHD, (scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, out_BQHD, lse_BHQ)


def _flash_backward(causal, rate, heads, blocks, interpret, stride, saved, dout_BQHD):
  scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, out_BQHD, lse_BHQ = saved
  (batch, queries, local_heads, depth), keys = q_BQHD.shape, k_BKHD.shape[1]
  block_q, block_k = blocks
  # sum_k P_qk dP_qk of each query (dP the gradient of the weights before dropout) is
  # dout_q . out_q: dropout's scaling is inside out.
  delta_BHQ = jnp.einsum('BQHD,BQHD->BHQ', dout_BQHD.astype(jnp.float32),
                         out_BQHD.astype(jnp.float32))
  rows, stats = _specs(block_q, block_k, queries, keys, depth)
  scalar_spec = pl.BlockSpec((SCALARS,), lambda b, h, i: (0,))
  args = (scalars, q_BQHD, k_BKHD, v_BKHD, query_ids_BQ, key_ids_BK, dout_BQHD, lse_BHQ,
          delta_BHQ)
  settings = dict(causal=causal, rate=rate, heads=heads, stride=stride)
  # dk, dv: a grid over key blocks, each reading every query.
  q_all, query_ids_all = rows(queries, None)
  k_block, key_ids_block = rows(keys, block_k)
  dk_BKHD, dv_BKHD = _call(
      functools.partial(_key_grads_kernel, block_q=block_q, **settings), 't2t_flash_dkv',
      (batch, local_heads, keys // block_k),
      [scalar_spec, q_all, k_block, k_block, query_ids_all, key_ids_block, q_all,
       stats(queries, None), stats(queries, None)],
      [k_block, k_block],
      [jax.ShapeDtypeStruct(k_BKHD.shape, k_BKHD.dtype),
       jax.ShapeDtypeStruct(v_BKHD.shape, v_BKHD.dtype)], interpret, *args)
  # dq: a grid over query blocks, each reading every key.
  q_block, query_ids_block = rows(queries, block_q)
  k_all, key_ids_all = rows(keys, None)
  dq_BQHD = _call(
      functools.partial(_query_grads_kernel, block_k=block_k, **settings), 't2t_flash_dq',
      (batch, local_heads, queries // block_q),
      [scalar_spec, q_block, k_all, k_all, query_ids_block, key_ids_all, q_block,
       stats(queries, block_q), stats(queries, block_q)],
      q_block, jax.ShapeDtypeStruct(q_BQHD.shape, q_BQHD.dtype), interpret, *args)
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
                    seed: Array | None = None) -> Array:
  """softmax(q k^T) v [B, Q, H, D] over the keys `rows` lets each query see (None: all), with
  dropout at `rate` on the weights, its masks drawn from `seed` (a uint32 scalar; needed when
  rate > 0). The queries come scaled.

  Under a mesh the kernels run per device (jax.shard_map over the axes the logical 'batch' and
  'heads' axes map to); each device draws its rows' and heads' masks by their global indices,
  so the masks do not depend on the mesh.
  """
  batch, queries, heads, _ = q_BQHD.shape
  keys = k_BKHD.shape[1]
  if rows is None:
    rows = pallas_attention.SplashRows(jnp.zeros((batch, queries), jnp.int32),
                                       jnp.zeros((batch, keys), jnp.int32), causal=False)
  if rate and seed is None:
    raise ValueError('flash_attention: dropout (rate > 0) needs a seed')
  block_q, block_k = _block(queries, 64), _block(keys, 64)
  padded_q, padded_k = -(-queries // block_q) * block_q, -(-keys // block_k) * block_k
  if padded_q * padded_k >= 2**32:  # The masks' uint32 counters would repeat.
    raise ValueError(f'flash_attention: {padded_q} x {padded_k} (padded) queries and keys is '
                     'too many for the dropout masks\' 32-bit counters')
  pad = lambda x, to, **kw: jnp.pad(x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2),
                                    **kw)
  # Padding keys are seen by no query; padding queries see what the last real one sees.
  query_ids_BQ = pad(rows.query_ids_BQ.astype(jnp.int32), padded_q, mode='edge')
  key_ids_BK = pad(rows.key_ids_BK.astype(jnp.int32), padded_k,
                   constant_values=pallas_attention.NO_QUERY_ID)
  args = (pad(q_BQHD, padded_q), pad(k_BKHD, padded_k), pad(v_BKHD, padded_k), query_ids_BQ,
          key_ids_BK)
  seed = jnp.zeros((), jnp.uint32) if seed is None else seed
  seed_i32 = lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32), jnp.int32)
  mesh = jax.sharding.get_abstract_mesh()
  platform = (mesh.abstract_device.platform if not mesh.empty and mesh.abstract_device
              else jax.default_backend())
  settings = dict(causal=rows.causal, rate=float(rate), heads=heads, blocks=(block_q, block_k),
                  interpret=platform == 'cpu', stride=padded_k)

  def attend(q, k, v, query_ids, key_ids, first_row, first_head):
    scalars = jnp.stack([seed_i32, first_row, first_head, jnp.int32(0)])
    return _flash(scalars, q, k, v, query_ids, key_ids, *settings.values())

  if mesh.empty:
    out_BQHD = attend(*args, jnp.int32(0), jnp.int32(0))
  else:
    batch_axes, _, head_axes, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
    batch_axes = pallas_attention.dividing(batch_axes, batch, mesh)
    head_axes = pallas_attention.dividing(head_axes, heads, mesh)

    def per_device(q, k, v, query_ids, key_ids):
      first = lambda axes, size: (jnp.int32(0) if axes is None
                                  else lax.axis_index(axes).astype(jnp.int32) * size)
      return attend(q, k, v, query_ids, key_ids, first(batch_axes, q.shape[0]),
                    first(head_axes, q.shape[2]))

    spec_BLHD, spec_BL = P(batch_axes, None, head_axes, None), P(batch_axes, None)
    out_BQHD = jax.shard_map(per_device, in_specs=(spec_BLHD,) * 3 + (spec_BL,) * 2,
                             out_specs=spec_BLHD, check_vma=False)(*args)
  return out_BQHD[:, :queries]
