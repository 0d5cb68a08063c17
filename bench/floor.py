"""The matrix products any search of a batch must do, and nothing else: a floor under its time.

bench/decode_speed.py --profile times this beside both searches. For `sentences` sources of
`source_length` (S) tokens, `beam_size` (W) hypotheses per sentence and `steps` output tokens:
  - once per batch, the encoder: per layer the four [E, E] attention projections and the
    feed-forward pair on every source token, and each sentence's attention scores and
    weighted values over its own S positions;
  - once per batch, each decoder layer's cross-attention keys and values ([E, E] each, on
    every source token: once per sentence, never per beam);
  - per step, on one row per sentence at the first step (its W beams are alike until then)
    and one per hypothesis after, per decoder layer: the self-attention's four projections,
    the cross-attention's query and output projections, the feed-forward pair, one query per
    head against the i + 1 positions written so far at step i (not a whole max-length
    cache) and against the sentence's S positions (its W beams' queries sharing its keys
    and values); then the tied [V, E] output projection.
Nothing else runs: no embeddings, norms or softmax, no cache writes or reordering, no top-k.
The steps after the first run in a loop; the self-attention products, whose length grows, are
unrolled, each of its own shape. `floor_flops` counts the work (XLA's count of the function
counts the loop's body once). A search doing this work on the same device cannot take less
time than this function.
"""

import jax
import jax.numpy as jnp


def floor_flops(shape, sentences: int, beam_size: int, source_length: int, steps: int) -> int:
  """The multiply-adds (x2) of the products listed in the module docstring."""
  e, f, layers, s = shape.d_model, shape.d_ff, shape.layers, source_length
  tokens = sentences * s
  encoder = layers * (4 * 2 * tokens * e * e + 2 * 2 * tokens * e * f + 2 * 2 * tokens * s * e)
  cross_keys_values = layers * 2 * 2 * tokens * e * e
  decoder = 0
  for i in range(steps):
    rows = sentences * (1 if i == 0 else beam_size)
    decoder += layers * 2 * rows * e * (6 * e + 2 * f + 2 * s + 2 * (i + 1))
    decoder += 2 * rows * e * shape.vocab
  return encoder + cross_keys_values + decoder


def _encoder(weights, x_BSE):
  """The encoder's products on every source token; returns its output [B, S, E]."""
  batch, length, e = x_BSE.shape
  heads = weights['heads']
  for layer in range(weights['layers']):
    q, k, v = (x_BSE @ w for w in weights['encoder'][layer][:3])
    split = lambda y: y.reshape(batch, length, heads, e // heads)
    scores_BHSS = jnp.einsum('bqhd,bkhd->bhqk', split(q), split(k))
    out_BSE = jnp.einsum('bhqk,bkhd->bqhd', scores_BHSS, split(v)).reshape(batch, length, e)
    x_BSE = x_BSE + out_BSE @ weights['encoder'][layer][3]
    x_BSE = x_BSE + jax.nn.relu(x_BSE @ weights['encoder_ffn_in'][layer]) @ (
        weights['encoder_ffn_out'][layer])
  return x_BSE


def _step(weights, x_RE, cross_kv):
  """One decoding step's products for R rows (R / B beams per sentence), self-attention's
  scores and values aside (`_self_attention`: their shapes change every step)."""
  rows, e = x_RE.shape
  heads = weights['heads']
  batch = cross_kv[0][0].shape[0]
  for layer in range(weights['layers']):
    q, k, v, o, cross_q, cross_o = weights['decoder'][layer]
    # The query and the new token's key and value, written to no cache.
    x_RE = x_RE + (x_RE @ q + x_RE @ k + x_RE @ v) @ o
    cross_q_BHWD = (x_RE @ cross_q).reshape(batch, -1, heads, e // heads).swapaxes(1, 2)
    key_BHSD, value_BHSD = cross_kv[layer]
    scores_BHWS = jnp.einsum('bhwd,bhsd->bhws', cross_q_BHWD, key_BHSD)
    cross_BHWD = jnp.einsum('bhws,bhsd->bhwd', scores_BHWS, value_BHSD)
    x_RE = x_RE + cross_BHWD.swapaxes(1, 2).reshape(rows, e) @ cross_o
    x_RE = x_RE + jax.nn.relu(x_RE @ weights['ffn_in'][layer]) @ weights['ffn_out'][layer]
  logits_RV = x_RE @ weights['embedding'].T
  return x_RE + 1e-3 * logits_RV.max(-1, keepdims=True)  # Keeps every logit live.


def _self_attention(weights, sentences: int, beam_size: int, steps: int):
  """Every step's self-attention scores and values: step i's query per head and row against
  the i + 1 positions written so far. One key/value history serves every row (the work per
  row is the same); the steps are unrolled, so each product has its own length."""
  total_HRD = 0
  for position in range(steps):
    rows = sentences * (1 if position == 0 else beam_size)
    for layer in range(weights['layers']):
      q_HRD = weights['self_q'][layer, :, :rows]
      k_HLD, v_HLD = (history[:, :position + 1] for history in weights['self_kv'][layer])
      scores_HRL = jnp.einsum('hrd,hld->hrl', q_HRD, k_HLD)
      total_HRD = total_HRD + jnp.einsum('hrl,hld->hrd', scores_HRL, v_HLD).sum()
  return total_HRD


def _weights(shape, sentences: int, beam_size: int, steps: int) -> dict:
  e, f, layers, heads = shape.d_model, shape.d_ff, shape.layers, shape.heads
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 12))
  def normal(dims, fan_in):
    return jax.random.normal(next(keys), dims) * fan_in**-0.5
  return {
      'heads': heads, 'layers': layers,
      'encoder': normal((layers, 4, e, e), e), 'encoder_ffn_in': normal((layers, e, f), e),
      'encoder_ffn_out': normal((layers, f, e), f), 'decoder': normal((layers, 6, e, e), e),
      'cross_kv': normal((layers, 2, e, e), e), 'ffn_in': normal((layers, e, f), e),
      'ffn_out': normal((layers, f, e), f), 'embedding': normal((shape.vocab, e), e),
      'self_q': normal((layers, heads, sentences * beam_size, e // heads), 1),
      'self_kv': normal((layers, 2, heads, steps, e // heads), 1),
      'start': normal((sentences, e), 1)}


def search_floor(shape, sentences: int, beam_size: int, source_length: int, steps: int):
  """The jitted floor and its input (the embedded sources [B, S, E])."""
  weights = _weights(shape, sentences, beam_size, steps)

  def floor(sources_BSE):
    encoded_BSE = _encoder(weights, sources_BSE)
    # Heads-major once, the layout the steps read.
    cross_kv = [[(encoded_BSE @ w).reshape(sentences, source_length, shape.heads, -1).swapaxes(
        1, 2) for w in weights['cross_kv'][layer]] for layer in range(shape.layers)]
    x_RE = jnp.repeat(_step(weights, weights['start'], cross_kv), beam_size, axis=0)
    x_RE = jax.lax.fori_loop(1, steps, lambda _, x_RE: _step(weights, x_RE, cross_kv), x_RE)
    return x_RE + 1e-3 * _self_attention(weights, sentences, beam_size, steps)

  sources_BSE = jax.random.normal(jax.random.PRNGKey(1), (sentences, source_length,
                                                          shape.d_model))
  return jax.jit(floor), sources_BSE
