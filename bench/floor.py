"""The decoder's matrix products alone, in a loop: a floor under any search that does them.

bench/decode_speed.py --profile times this loop beside both searches. Per step and decoder layer,
for `rows` hypotheses of one token each: the self-attention's four [E, E] projections and the
cross-attention's two (its keys and values are computed once per batch, before the loop), the
feed-forward pair, and one query per head against `steps` cached keys and values and against
the `source_length` encoder positions; then the tied [V, E] output projection. Nothing else
runs: no cache writes or reordering, no top-k, no encoder. A search doing this work on the
same device cannot take less time than this loop.
"""

import jax
import jax.numpy as jnp


def decoder_matmul_loop(shape, rows: int, source_length: int, steps: int):
  """The jitted loop of `steps` steps and its input ([rows, d_model])."""
  e, f, h, layers = shape.d_model, shape.d_ff, shape.heads, shape.layers
  d = e // h
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))
  weights = {
      'attention': jax.random.normal(next(keys), (layers, 6, e, e)) * e**-0.5,
      'ffn_in': jax.random.normal(next(keys), (layers, e, f)) * e**-0.5,
      'ffn_out': jax.random.normal(next(keys), (layers, f, e)) * f**-0.5,
      'embedding': jax.random.normal(next(keys), (shape.vocab, e)) * e**-0.5,
      'self_kv': jax.random.normal(next(keys), (layers, 2, rows, h, steps, d)),
      'cross_kv': jax.random.normal(next(keys), (layers, 2, rows, h, source_length, d))}

  def attend(q_RE, kv_2RHLD):
    k_RHLD, v_RHLD = kv_2RHLD
    p_RHL = jax.nn.softmax(jnp.einsum('rhd,rhld->rhl', q_RE.reshape(rows, h, d), k_RHLD), -1)
    return jnp.einsum('rhl,rhld->rhd', p_RHL, v_RHLD).reshape(rows, e)

  def step(_, x_RE):
    for layer in range(layers):
      q, k, v, o, cross_q, cross_o = weights['attention'][layer]
      new_kv_RE = x_RE @ k + x_RE @ v  # The new token's key and value (written to no cache).
      x_RE = x_RE + attend(x_RE @ q, weights['self_kv'][layer]) @ o + new_kv_RE
      x_RE = x_RE + attend(x_RE @ cross_q, weights['cross_kv'][layer]) @ cross_o
      x_RE = x_RE + jax.nn.relu(x_RE @ weights['ffn_in'][layer]) @ weights['ffn_out'][layer]
    logits_RV = x_RE @ weights['embedding'].T
    return x_RE + 1e-3 * logits_RV[:, :e]  # Keeps the output projection live.

  x = jax.random.normal(next(keys), (rows, e))
  return jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x)), x
