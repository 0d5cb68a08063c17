"""Greedy and beam search over the decoder's key/value cache: pure functions, which callers compile
with `runtime.jit_search` (jax.jit with the search's compiler options; tracing one any other
way logs a warning once where those options matter).

Shapes in names follow the package legend (t2t_jax/__init__.py): B sentences, W beam width,
N = B*W rows of beams, S source length, L output length, V vocabulary, C = 2*W candidates
per step.

The encoder runs once per batch, and so do the cross-attention key/value projections: the
first decoding step stores them in the cache, later steps only read them. A decoder-only
model reads its (right-padded) sources once too, in a prefill pass that fills every layer's
self-attention cache at [0, S); its steps then write each row's token at its position, the
row's source length plus the steps so far (`start_search`), over the source's padding.
Output lengths count generated tokens, EOS included; a hypothesis that reaches the maximum
length without EOS ends there. PAD is never generated. Batched translation of many sentences
is translator.py's.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import runtime
from t2t_jax.decoding.top_k import top_k
from t2t_jax.model import attention_cache
from t2t_jax.model.decoder_only import make_model
from t2t_jax.model.model_config import TransformerConfig

_NEG = -1.0e9  # Log-probability of an impossible hypothesis; finite, so sums stay ordered.


def decode_config(config: TransformerConfig) -> TransformerConfig:
  return dataclasses.replace(config, decode=True, deterministic=True)


def init_cache(config: TransformerConfig, batch_size: int, max_len: int,
               source_length: int = 1):
  """Zeroed self-attention caches for `batch_size` rows and up to `max_len` output tokens.

  The cross-attention entries are absent: the first decoding step computes them. A
  decoder-only model's caches also hold the `source_length` source positions first.
  """
  model = make_model(decode_config(config))
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, source_length), jnp.int32),
                         jnp.ones((batch_size, max_len), jnp.int32))['cache'])
  return _without_memory(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def _without_memory(tree):
  return {name: _without_memory(value) if isinstance(value, dict) else value
          for name, value in tree.items() if name not in _MEMORY_ENTRIES}


_MEMORY_ENTRIES = ('memory_key', 'memory_value')  # Cross-attention keys/values in the cache.
_COUNTERS = ('index', 'position')  # Steps decoded so far, shared by all rows.


def _named(path, names: tuple[str, ...]) -> bool:
  return any(getattr(key, 'key', None) in names for key in path)


def max_decode_length(source_length: int, extra: int, model_max_len: int,
                      decoder_only: bool = False) -> int:
  """Source length + `extra`, capped by the position table.

  A decoder-only model's output positions follow its source's, so the source takes its
  share of the table first.
  """
  room = model_max_len - source_length if decoder_only else model_max_len
  return min(source_length + extra, room)


LENGTH_PENALTIES = ('gnmt', 'length')  # config.eval.length_penalty: `length_penalty`'s kinds.


def length_penalty(length, alpha: float, kind: str = 'gnmt'):
  """What a finished hypothesis's log-probability is divided by, for `length` tokens (EOS
  included): 'gnmt' ((5 + length) / 6) ** alpha, the penalty of GNMT, tensor2tensor and the
  paper; 'length' length ** alpha, CTranslate2's (and fairseq's). Both are 1 at alpha 0."""
  if kind == 'gnmt':
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha
  if kind == 'length':
    return jnp.asarray(length, jnp.float32) ** alpha
  raise ValueError(f'length penalty {kind!r} must be one of {LENGTH_PENALTIES}')


def search_step(model, params, cache, encoded_BSE, inputs_BS, previous_B):
  """Next-token logits [B, V] in float32 and the updated cache.

  Logits, not log-probabilities: greedy search needs only their argmax, and beam search
  normalises just the few candidates it keeps. Both model kinds take the same arguments
  (a decoder-only model has no `encoded_BSE`).
  """
  logits_B1V, variables = model.apply({'params': params, 'cache': cache}, encoded_BSE,
                                      inputs_BS, previous_B[:, None], mutable=['cache'],
                                      method='decode')
  return logits_B1V[:, 0], variables['cache']


def start_search(model, params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int):
  """The first step's logits [B, V] and cache: the sources read once, then the start token.

  Encoder-decoder: the encoder runs, and the first step caches the cross-attention
  projections. Decoder-only: one prefill pass fills the self-attention caches with the
  sources' keys and values, then the start token (0, as in training) goes in after them.
  """
  batch_size, source_length = inputs_BS.shape
  start_B = jnp.zeros((batch_size,), jnp.int32)
  if config.kind == 'decoder_only':
    cache = init_cache(config, batch_size, max_len, source_length)
    _, variables = model.apply({'params': params, 'cache': cache}, inputs_BS,
                               mutable=['cache'], method='prefill')
    return search_step(model, params, variables['cache'], None, inputs_BS, start_B)
  encoded_BSE = model.apply({'params': params}, inputs_BS, method='encode')
  return search_step(model, params, init_cache(config, batch_size, max_len), encoded_BSE,
                      inputs_BS, start_B)


def without_pad(logits_BV: jax.Array) -> jax.Array:
  """PAD is never generated (its probability still counts in the softmax's normaliser).

  An elementwise select, not an update of a copy: it fuses into the reduction that reads it.
  """
  token_V = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
  return jnp.where(token_V == PAD_ID, _NEG, logits_BV)


def best_token(logits_BV: jax.Array) -> jax.Array:
  """The argmax [B] over every token but PAD: the first of equal maxima, or the first NaN.

  Two plain reductions, the largest logit then the first token that reaches it: XLA's CPU
  argmax is a (value, index) reduction that does not vectorise and took as long as the
  output projection. A NaN counts as the largest, as in argmax (the max is then NaN too).
  """
  logits_BV = without_pad(logits_BV)
  best_B1 = logits_BV.max(-1, keepdims=True)
  token_BV = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
  hits_BV = (logits_BV == best_B1) | jnp.isnan(logits_BV)
  return jnp.where(hits_BV, token_BV, logits_BV.shape[-1]).min(-1)


def row_limits(max_lengths_B: jax.Array | None, batch_size: int, max_len: int) -> jax.Array:
  """Each row's longest output: `max_lengths_B` capped by `max_len` (the cache size)."""
  if max_lengths_B is None:
    return jnp.full((batch_size,), max_len, jnp.int32)
  return jnp.minimum(jnp.asarray(max_lengths_B, jnp.int32), max_len)


def greedy_search(params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int,
                  max_lengths_B: jax.Array | None = None) -> jax.Array:
  """Argmax decoding; returns [B, max_len] tokens, EOS included, PAD after it.

  Row b generates at most `max_lengths_B[b]` tokens (default: `max_len` for every row).
  """
  runtime.check_search_compiled_here('greedy_search')
  return token_loop(params, inputs_BS, config, max_len, max_lengths_B,
                    lambda logits_BV, unused_index: best_token(logits_BV))


def token_loop(params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int,
               max_lengths_B: jax.Array | None, choose) -> jax.Array:
  """One token per row and step, `choose(logits_BV, index)` picking output position `index`'s,
  until every row has its EOS or its limit; returns [B, max_len] tokens, PAD after EOS. Greedy
  search and sampling (sampling.py) are this loop with their own `choose`."""
  model = make_model(decode_config(config))
  batch_size = inputs_BS.shape[0]
  limit_B = row_limits(max_lengths_B, batch_size, max_len)
  logits_BV, cache = start_search(model, params, inputs_BS, config, max_len)
  first_B = choose(logits_BV, 0)
  tokens_BL = jnp.zeros((batch_size, max_len), jnp.int32).at[:, 0].set(first_B)

  def step(carry):
    i, cache, tokens_BL, finished_B = carry
    logits_BV, cache = search_step(model, params, cache, None, inputs_BS, tokens_BL[:, i - 1])
    next_B = jnp.where(finished_B, PAD_ID, choose(logits_BV, i))
    tokens_BL = jax.lax.dynamic_update_slice_in_dim(tokens_BL, next_B[:, None], i, 1)
    return i + 1, cache, tokens_BL, finished_B | (next_B == EOS_ID) | (i + 1 >= limit_B)

  def not_done(carry):
    i, _, _, finished_B = carry
    return (i < max_len) & ~finished_B.all()

  carry = (jnp.array(1), cache, tokens_BL, (first_B == EOS_ID) | (limit_B <= 1))
  return jax.lax.while_loop(not_done, step, carry)[2]


class BeamState(NamedTuple):
  """Live hypotheses (still growing) and finished ones (ended by EOS or the length limit)."""
  step: jax.Array  # Tokens generated so far by every live hypothesis.
  live_tokens_BWL: jax.Array
  live_log_probs_BW: jax.Array  # Sorted, best first.
  finished_tokens_BWL: jax.Array
  finished_scores_BW: jax.Array  # Log-probability / length penalty; sorted, best first.


def _top_log_probs(logits_BWV: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """The `count` largest log-softmax entries [B, W, count] of each row, and their tokens.

  Log-softmax shifts a row's logits by one constant, so its largest entries are those of the
  largest logits: only they are normalised, never the whole [B, W, V] array. (A top-k of
  `count` + 1 on the raw logits, giving the maximum and dropping PAD, would save a pass, but
  XLA's CPU top-k of 9 or more entries is a full sort: 20 times slower.)
  """
  max_BW1 = jax.lax.stop_gradient(logits_BWV.max(-1, keepdims=True))
  log_norm_BW1 = jnp.log(jnp.exp(logits_BWV - max_BW1).sum(-1, keepdims=True))
  top_logits_BWC, token_BWC = top_k(without_pad(logits_BWV), count)
  return (top_logits_BWC - max_BW1) - log_norm_BW1, token_BWC


def _beam_update(state: BeamState, logits_BWV: jax.Array, limit_B: jax.Array,
                 alpha: float, penalty: str = 'gnmt') -> tuple[BeamState, jax.Array]:
  """Extends every live hypothesis by one token; returns the new state and live parents [B, W].

  A row whose length limit this step reaches ends all its candidates, and its live
  hypotheses die (log-probability _NEG), so nothing longer can enter its finished set.
  """
  batch_size, beam_size, vocab_size = logits_BWV.shape
  i = state.step
  # Two stages: each beam's best 2W tokens, then the best 2W of those W * 2W candidates. A
  # candidate among the best 2W overall is among its own beam's best 2W, and ties resolve
  # as one top-k over [W * V] would (lower beam, then lower token, first).
  per_beam = min(2 * beam_size, vocab_size)
  log_probs_BWC, token_BWC = _top_log_probs(logits_BWV, per_beam)
  candidates_BWC = state.live_log_probs_BW[:, :, None] + log_probs_BWC
  log_probs_BC, flat_BC = jax.lax.top_k(candidates_BWC.reshape(batch_size, -1), 2 * beam_size)
  parent_BC = flat_BC // per_beam
  token_BC = jnp.take_along_axis(token_BWC.reshape(batch_size, -1), flat_BC, axis=1)
  tokens_BCL = jnp.take_along_axis(state.live_tokens_BWL, parent_BC[:, :, None], axis=1)
  tokens_BCL = tokens_BCL.at[:, :, i].set(token_BC)
  is_last_B1 = (i + 1 >= limit_B)[:, None]
  # EOS ends a hypothesis only if it ranks among the best W candidates (so beam 1 is greedy);
  # at the length limit every candidate ends.
  ends_BC = ((token_BC == EOS_ID) & (jnp.arange(2 * beam_size) < beam_size)) | is_last_B1
  scores_BC = jnp.where(ends_BC, log_probs_BC / length_penalty(i + 1, alpha, penalty),
                        _NEG)
  finished_scores_BW, keep_BW = jax.lax.top_k(
      jnp.concatenate([state.finished_scores_BW, scores_BC], axis=1), beam_size)
  finished_tokens_BWL = jnp.take_along_axis(
      jnp.concatenate([state.finished_tokens_BWL, tokens_BCL], axis=1), keep_BW[:, :, None],
      axis=1)
  live_log_probs_BW, keep_BW = jax.lax.top_k(
      jnp.where((token_BC == EOS_ID) | is_last_B1, _NEG, log_probs_BC), beam_size)
  live_tokens_BWL = jnp.take_along_axis(tokens_BCL, keep_BW[:, :, None], axis=1)
  parent_BW = jnp.take_along_axis(parent_BC, keep_BW, axis=1)
  return BeamState(i + 1, live_tokens_BWL, live_log_probs_BW, finished_tokens_BWL,
                   finished_scores_BW), parent_BW


def _can_improve(state: BeamState, limit_B: jax.Array, alpha: float,
                 penalty: str = 'gnmt') -> jax.Array:
  """Whether any row's best live hypothesis could still enter its finished top W."""
  # A live hypothesis of log-probability p <= 0 can finish at any length n from step + 1 to
  # its row's limit, with a log-probability q <= p (every token adds a log-probability <= 0),
  # so its score q / P(n) is at most p / P(n) <= p / max_n P(n) (P(n) > 0 for n >= 1, and
  # p <= 0 gains most from the largest divisor). Both penalties are monotonic in n (a power
  # of (5 + n) / 6, or of n), so that maximum is P at an end of the range: the larger of
  # P(step + 1) and P(limit). (A padding row's limit is 0: P(0) is (5 / 6)^alpha for 'gnmt',
  # 0 or 1 for 'length', at most 1 <= P(step + 1) either way, for alpha >= 0.)
  largest_penalty_B = jnp.maximum(length_penalty(state.step + 1, alpha, penalty),
                                  length_penalty(limit_B, alpha, penalty))
  best_live_B = state.live_log_probs_BW[:, 0] / largest_penalty_B
  return ~jnp.all(state.finished_scores_BW[:, -1] >= best_live_B)


def _reorder_cache(cache, parent_BW: jax.Array, config: TransformerConfig):
  """Each beam's self-attention cache follows its parent (the encoder-side entries agree).

  A layer with an attention_cache.BeamCache (`_with_beam_caches`) moves only its origin table.
  """
  batch_size, beam_size = parent_BW.shape
  rows_N = (jnp.arange(batch_size)[:, None] * beam_size + parent_BW).reshape(-1)
  row_axis = 1 if config.scan_layers else 0

  def move(tree):
    return {name: move(value) if isinstance(value, dict)
            else value.reorder(parent_BW) if isinstance(value, attention_cache.BeamCache)
            else value if name in _COUNTERS + _MEMORY_ENTRIES
            else value[(slice(None),) * row_axis + (rows_N,)] for name, value in tree.items()}
  return move(cache)


def _with_beam_caches(cache, batch_size: int, config: TransformerConfig):
  """The cache with an attention_cache.BeamCache for each self-attention cache that can read
  its keys through an origin table (not compressed layers, whose blocks mix a row's keys,
  nor scanned layers or the decoder-only model), in place of its keys and values."""
  if config.scan_layers or config.kind != 'encoder_decoder':
    return cache

  def convert(tree):
    if 'key' in tree and 'index' in tree and 'compressed_key' not in tree:
      rows = {name: value for name, value in tree.items() if name not in ('key', 'value')}
      return {**rows, attention_cache.BEAM_ENTRY: attention_cache.BeamCache.start(
          tree['key'], tree['value'], batch_size)}
    return {name: convert(value) if isinstance(value, dict) else value
            for name, value in tree.items()}
  return convert(cache)


def _map_rows(fn, cache, config: TransformerConfig, skip: tuple[str, ...] = ()):
  """`fn(entry, row_axis)` on every cache entry with one row per sentence or beam.

  The step counters have no rows; scanned layers stack their entries behind a layer axis.
  """
  row_axis = 1 if config.scan_layers else 0
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if _named(path, _COUNTERS + skip) else fn(x, row_axis), cache)


def beam_search(params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int,
                beam_size: int, alpha: float, max_lengths_B: jax.Array | None = None,
                penalty: str = 'gnmt') -> tuple[jax.Array, jax.Array]:
  """The `beam_size` best hypotheses [B, W, max_len] (EOS included, PAD after) and scores [B, W].

  Scores are log-probability / `length_penalty(length, alpha, penalty)` (GNMT's
  ((5 + length) / 6) ** alpha by default, length ** alpha for 'length'), best first. Row b's
  hypotheses end by `max_lengths_B[b]` tokens (default: `max_len`, the cache size, for every
  row). A row stops when its W finished hypotheses all beat what its best live one could still
  reach (`_can_improve`).
  """
  runtime.check_search_compiled_here('beam_search')
  model = make_model(decode_config(config))
  batch_size, beam_size = inputs_BS.shape[0], int(beam_size)
  limit_B = row_limits(max_lengths_B, batch_size, max_len)
  # The first step sees one row per sentence; its cache is then copied to every beam.
  logits_BV, cache = start_search(model, params, inputs_BS, config, max_len)
  empty_BWL = jnp.zeros((batch_size, beam_size, max_len), jnp.int32)
  only_first_beam_BW = jnp.where(jnp.arange(beam_size) == 0, 0.0, _NEG)[None].repeat(
      batch_size, 0)
  state = BeamState(jnp.array(0), empty_BWL, only_first_beam_BW, empty_BWL,
                    jnp.full((batch_size, beam_size), _NEG))
  state, _ = _beam_update(state, jnp.broadcast_to(logits_BV[:, None], (
      batch_size, beam_size, logits_BV.shape[-1])), limit_B, alpha, penalty)
  # The cross-attention keys and values stay one row per sentence, shared by its beams
  # (attention.CrossAttention); a decoder-only model's prompt mask wants a row per beam.
  cache = _map_rows(lambda x, axis: jnp.repeat(x, beam_size, axis=axis), cache, config,
                    skip=_MEMORY_ENTRIES)
  cache = _with_beam_caches(cache, batch_size, config)
  inputs_NS = (inputs_BS if config.kind == 'encoder_decoder'
               else jnp.repeat(inputs_BS, beam_size, axis=0))

  def step(carry):
    state, cache = carry
    previous_N = state.live_tokens_BWL[:, :, state.step - 1].reshape(-1)
    logits_NV, cache = search_step(model, params, cache, None, inputs_NS, previous_N)
    state, parent_BW = _beam_update(state, logits_NV.reshape(batch_size, beam_size, -1),
                                    limit_B, alpha, penalty)
    return state, _reorder_cache(cache, parent_BW, config)

  def not_done(carry):
    state, _ = carry
    return (state.step < max_len) & _can_improve(state, limit_B, alpha, penalty)

  state, _ = jax.lax.while_loop(not_done, step, (state, cache))
  return state.finished_tokens_BWL, state.finished_scores_BW


