"""Greedy and beam search over the decoder's key/value cache, and batched translation.

Shapes in names: B batch, K beam, N = B*K rows of beams, S source length, L output length,
V vocabulary, C = 2*K candidates per step.

The encoder runs once per batch, and so do the cross-attention key/value projections: the
first decoding step stores them in the cache, later steps only read them. Output lengths
count generated tokens, EOS included; a hypothesis that reaches the maximum length without
EOS ends there. PAD is never generated.
"""

import collections
import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.model import Transformer, TransformerConfig

_NEG = -1.0e9  # Log-probability of an impossible hypothesis; finite, so sums stay ordered.


def decode_config(config: TransformerConfig) -> TransformerConfig:
  return dataclasses.replace(config, decode=True, deterministic=True)


def init_cache(config: TransformerConfig, batch_size: int, max_len: int):
  """Zeroed self-attention caches for `batch_size` rows and up to `max_len` output tokens.

  The cross-attention entries are absent: the first decoding step computes them.
  """
  model = Transformer(decode_config(config))
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, 1), jnp.int32),
                         jnp.ones((batch_size, max_len), jnp.int32))['cache'])
  return _without_memory(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def _without_memory(tree):
  return {name: _without_memory(value) if isinstance(value, dict) else value
          for name, value in tree.items() if name not in _MEMORY_ENTRIES}


_MEMORY_ENTRIES = ('memory_key', 'memory_value')  # Cross-attention keys/values in the cache.
_COUNTERS = ('index', 'position')  # Steps decoded so far, shared by all rows.


def _named(path, names: tuple[str, ...]) -> bool:
  return any(getattr(key, 'key', None) in names for key in path)


def max_decode_length(source_length: int, extra: int, model_max_len: int) -> int:
  """Source length + `extra`, capped by the position table."""
  return min(source_length + extra, model_max_len)


def length_penalty(length, alpha: float):
  """((5 + length) / 6) ** alpha, the GNMT penalty tensor2tensor and the paper use."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _decode_step(model: Transformer, params, cache, encoded_BSE, inputs_BS, previous_B):
  """Log-probabilities [B, V] of the next token (PAD excluded) and the updated cache."""
  logits_B1V, variables = model.apply({'params': params, 'cache': cache}, encoded_BSE,
                                      inputs_BS, previous_B[:, None], mutable=['cache'],
                                      method=Transformer.decode)
  log_probs_BV = jax.nn.log_softmax(logits_B1V[:, 0])
  return log_probs_BV.at[:, PAD_ID].set(_NEG), variables['cache']


def greedy_search(params, inputs_BS: jax.Array, config: TransformerConfig,
                  max_len: int) -> jax.Array:
  """Argmax decoding; returns [B, max_len] tokens, EOS included, PAD after it."""
  model = Transformer(decode_config(config))
  batch_size = inputs_BS.shape[0]
  encoded_BSE = model.apply({'params': params}, inputs_BS, method=Transformer.encode)
  log_probs_BV, cache = _decode_step(model, params, init_cache(config, batch_size, max_len),
                                     encoded_BSE, inputs_BS, jnp.zeros((batch_size,), jnp.int32))
  first_B = log_probs_BV.argmax(-1)
  tokens_BL = jnp.zeros((batch_size, max_len), jnp.int32).at[:, 0].set(first_B)

  def step(carry):
    i, cache, tokens_BL, finished_B = carry
    log_probs_BV, cache = _decode_step(model, params, cache, None, inputs_BS,
                                       tokens_BL[:, i - 1])
    next_B = jnp.where(finished_B, PAD_ID, log_probs_BV.argmax(-1))
    tokens_BL = jax.lax.dynamic_update_slice_in_dim(tokens_BL, next_B[:, None], i, 1)
    return i + 1, cache, tokens_BL, finished_B | (next_B == EOS_ID)

  def not_done(carry):
    i, _, _, finished_B = carry
    return (i < max_len) & ~finished_B.all()

  carry = (jnp.array(1), cache, tokens_BL, first_B == EOS_ID)
  return jax.lax.while_loop(not_done, step, carry)[2]


class BeamState(NamedTuple):
  """Live hypotheses (still growing) and finished ones (ended by EOS or the length limit)."""
  step: jax.Array  # Tokens generated so far by every live hypothesis.
  live_tokens_BKL: jax.Array
  live_log_probs_BK: jax.Array  # Sorted, best first.
  finished_tokens_BKL: jax.Array
  finished_scores_BK: jax.Array  # Log-probability / length penalty; sorted, best first.


def _beam_update(state: BeamState, log_probs_BKV: jax.Array, max_len: int,
                 alpha: float) -> tuple[BeamState, jax.Array]:
  """Extends every live hypothesis by one token; returns the new state and live parents [B, K]."""
  batch_size, beam_size, vocab_size = log_probs_BKV.shape
  i = state.step
  candidates_BKV = state.live_log_probs_BK[:, :, None] + log_probs_BKV
  log_probs_BC, flat_BC = jax.lax.top_k(candidates_BKV.reshape(batch_size, -1), 2 * beam_size)
  parent_BC, token_BC = flat_BC // vocab_size, flat_BC % vocab_size
  tokens_BCL = jnp.take_along_axis(state.live_tokens_BKL, parent_BC[:, :, None], axis=1)
  tokens_BCL = tokens_BCL.at[:, :, i].set(token_BC)
  is_last = i + 1 >= max_len
  # EOS ends a hypothesis only if it ranks among the best K candidates (so beam 1 is greedy);
  # at the length limit every candidate ends.
  ends_BC = ((token_BC == EOS_ID) & (jnp.arange(2 * beam_size) < beam_size)) | is_last
  scores_BC = jnp.where(ends_BC, log_probs_BC / length_penalty(i + 1, alpha), _NEG)
  finished_scores_BK, keep_BK = jax.lax.top_k(
      jnp.concatenate([state.finished_scores_BK, scores_BC], axis=1), beam_size)
  finished_tokens_BKL = jnp.take_along_axis(
      jnp.concatenate([state.finished_tokens_BKL, tokens_BCL], axis=1), keep_BK[:, :, None],
      axis=1)
  live_log_probs_BK, keep_BK = jax.lax.top_k(
      jnp.where(token_BC == EOS_ID, _NEG, log_probs_BC), beam_size)
  live_tokens_BKL = jnp.take_along_axis(tokens_BCL, keep_BK[:, :, None], axis=1)
  parent_BK = jnp.take_along_axis(parent_BC, keep_BK, axis=1)
  return BeamState(i + 1, live_tokens_BKL, live_log_probs_BK, finished_tokens_BKL,
                   finished_scores_BK), parent_BK


def _can_improve(state: BeamState, max_len: int, alpha: float) -> jax.Array:
  """Whether any row's best live hypothesis could still enter its finished top K."""
  # Log-probabilities only fall as a hypothesis grows, so its best reachable score divides
  # today's by the largest penalty of the lengths still open (the penalty is monotonic).
  largest_penalty = jnp.maximum(length_penalty(state.step + 1, alpha),
                                length_penalty(max_len, alpha))
  best_live_B = state.live_log_probs_BK[:, 0] / largest_penalty
  return ~jnp.all(state.finished_scores_BK[:, -1] >= best_live_B)


def _reorder_cache(cache, parent_BK: jax.Array, config: TransformerConfig):
  """Each beam's self-attention cache follows its parent (the encoder-side entries agree)."""
  batch_size, beam_size = parent_BK.shape
  rows_N = (jnp.arange(batch_size)[:, None] * beam_size + parent_BK).reshape(-1)
  return _map_rows(lambda x, axis: x[(slice(None),) * axis + (rows_N,)], cache, config,
                   skip=_MEMORY_ENTRIES)


def _map_rows(fn, cache, config: TransformerConfig, skip: tuple[str, ...] = ()):
  """`fn(entry, row_axis)` on every cache entry with one row per sentence or beam.

  The step counters have no rows; scanned layers stack their entries behind a layer axis.
  """
  row_axis = 1 if config.scan_layers else 0
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if _named(path, _COUNTERS + skip) else fn(x, row_axis), cache)


def beam_search(params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int,
                beam_size: int, alpha: float) -> tuple[jax.Array, jax.Array]:
  """The `beam_size` best hypotheses [B, K, max_len] (EOS included, PAD after) and scores [B, K].

  Scores are log-probability / ((5 + length) / 6) ** alpha, best first. A row stops when its
  K finished hypotheses all beat what its best live hypothesis could still reach.
  """
  model = Transformer(decode_config(config))
  batch_size, beam_size = inputs_BS.shape[0], int(beam_size)
  encoded_BSE = model.apply({'params': params}, inputs_BS, method=Transformer.encode)
  # The first step sees one row per sentence; its cache is then copied to every beam.
  log_probs_BV, cache = _decode_step(model, params, init_cache(config, batch_size, max_len),
                                     encoded_BSE, inputs_BS, jnp.zeros((batch_size,), jnp.int32))
  empty_BKL = jnp.zeros((batch_size, beam_size, max_len), jnp.int32)
  only_first_beam_BK = jnp.where(jnp.arange(beam_size) == 0, 0.0, _NEG)[None].repeat(
      batch_size, 0)
  state = BeamState(jnp.array(0), empty_BKL, only_first_beam_BK, empty_BKL,
                    jnp.full((batch_size, beam_size), _NEG))
  state, _ = _beam_update(state, jnp.broadcast_to(log_probs_BV[:, None], (
      batch_size, beam_size, log_probs_BV.shape[-1])), max_len, alpha)
  cache = _map_rows(lambda x, axis: jnp.repeat(x, beam_size, axis=axis), cache, config)
  inputs_NS = jnp.repeat(inputs_BS, beam_size, axis=0)

  def step(carry):
    state, cache = carry
    previous_N = state.live_tokens_BKL[:, :, state.step - 1].reshape(-1)
    log_probs_NV, cache = _decode_step(model, params, cache, None, inputs_NS, previous_N)
    state, parent_BK = _beam_update(state, log_probs_NV.reshape(batch_size, beam_size, -1),
                                    max_len, alpha)
    return state, _reorder_cache(cache, parent_BK, config)

  def not_done(carry):
    state, _ = carry
    return (state.step < max_len) & _can_improve(state, max_len, alpha)

  state, _ = jax.lax.while_loop(not_done, step, (state, cache))
  return state.finished_tokens_BKL, state.finished_scores_BK


def _best_beam(params, inputs_BS, config, max_len, beam_size, alpha):
  return beam_search(params, inputs_BS, config, max_len, beam_size, alpha)[0][:, 0]


class Translator:
  """Decodes lists of id sequences in length-sorted batches sharded over the mesh's batch axes.

  Batches of one length bucket always have the same shape, so each bucket compiles once.
  A batch holds at most `batch_tokens` tokens counted over all beams (rows x beam x padded
  source length). Beam size 1 is greedy search, as in tensor2tensor.
  """

  def __init__(self, config: TransformerConfig, mesh, axis_rules, batch_tokens: int,
               min_bucket: int, max_extra_len: int, beam_size: int = 1, alpha: float = 0.6):
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    self.config, self.mesh, self.axis_rules = config, mesh, axis_rules
    self.batch_tokens, self.min_bucket, self.max_extra_len = batch_tokens, min_bucket, max_extra_len
    self.beam_size, self.alpha = beam_size, alpha
    self._compiled = {}

  def _search(self, max_len: int, beam_size: int, alpha: float):
    key = (max_len, beam_size, alpha if beam_size > 1 else None)
    if key not in self._compiled:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      if beam_size == 1:
        search = functools.partial(greedy_search, config=self.config, max_len=max_len)
      else:
        search = functools.partial(_best_beam, config=self.config, max_len=max_len,
                                   beam_size=beam_size, alpha=alpha)
      self._compiled[key] = jax.jit(search, out_shardings=replicated)
    return self._compiled[key]

  def translate(self, params, inputs: Sequence[np.ndarray], beam_size: int | None = None,
                alpha: float | None = None,
                progress: Callable[[int], object] | None = None) -> list[np.ndarray]:
    """Output ids (EOS included) for each input, in the input order; [] for an empty input.

    `progress(n)` is called with the number of sentences each finished batch held.
    """
    from t2t_jax import sharding  # Decoding needs only the batch placement helpers.
    beam_size = self.beam_size if beam_size is None else beam_size
    alpha = self.alpha if alpha is None else alpha
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    shards = sharding.batch_shards(self.mesh)
    outputs = [np.zeros((0,), np.int32)] * len(inputs)
    by_length = collections.defaultdict(list)
    for index, seq in enumerate(inputs):
      if len(seq) > self.config.max_len:
        raise ValueError(f'input {index} has {len(seq)} tokens, more than the model\'s '
                         f'max_len={self.config.max_len}: truncate it first')
      if len(seq):
        bucket = -(-len(seq) // self.min_bucket) * self.min_bucket
        by_length[min(bucket, self.config.max_len)].append(index)
    for length, members in sorted(by_length.items()):
      rows = max(shards, self.batch_tokens // (length * beam_size) // shards * shards)
      max_len = max_decode_length(length, self.max_extra_len, self.config.max_len)
      for start in range(0, len(members), rows):
        chunk = members[start:start + rows]
        batch = np.full((rows, length), PAD_ID, np.int32)
        for row, index in enumerate(chunk):
          batch[row, :len(inputs[index])] = inputs[index]
        with sharding.mesh_context(self.mesh, self.axis_rules):
          tokens = self._search(max_len, beam_size, alpha)(params, sharding.global_batch(
              {'inputs': batch}, self.mesh, whole=True)['inputs'])
        tokens = np.asarray(jax.device_get(tokens))
        for row, index in enumerate(chunk):
          outputs[index] = tokens[row]
        if progress:
          progress(len(chunk))
    if progress and len(inputs) > sum(len(m) for m in by_length.values()):
      progress(len(inputs) - sum(len(m) for m in by_length.values()))  # The empty inputs.
    return outputs
