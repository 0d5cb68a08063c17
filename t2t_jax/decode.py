"""Greedy and beam search over the decoder's key/value cache, and batched translation.

Shapes in names: B batch, K beam, N = B*K rows of beams, S source length, L output length,
V vocabulary, C = 2*K candidates per step.

The encoder runs once per batch, and so do the cross-attention key/value projections: the
first decoding step stores them in the cache, later steps only read them. A decoder-only
model reads its (right-padded) sources once too, in a prefill pass that fills every layer's
self-attention cache at [0, S); its steps then write S, S + 1, ... (`_start`). Output lengths
count generated tokens, EOS included; a hypothesis that reaches the maximum length without
EOS ends there. PAD is never generated.
"""

import collections
import dataclasses
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.decoder_only import make_model
from t2t_jax.model import TransformerConfig

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


DECODE_DTYPES = ('auto', 'model', 'float32', 'bfloat16')


def decoding_config(config: TransformerConfig, dtype: str, platform: str) -> TransformerConfig:
  """The model config searches run with: activations and caches in `dtype`.

  'model' keeps the training dtype; 'auto' is bfloat16 on accelerators (GPU, TPU) and float32
  on CPU, where bfloat16 arithmetic is slower. Parameters stay as stored; the logits are
  float32 either way.
  """
  if dtype not in DECODE_DTYPES:
    raise ConfigError(f'config.eval.dtype={dtype!r} must be one of {DECODE_DTYPES}')
  if dtype == 'model':
    return config
  if dtype == 'auto':
    dtype = 'float32' if platform == 'cpu' else 'bfloat16'
  return dataclasses.replace(config, dtype=jnp.dtype(dtype))


def max_decode_length(source_length: int, extra: int, model_max_len: int,
                      decoder_only: bool = False) -> int:
  """Source length + `extra`, capped by the position table.

  A decoder-only model's output positions follow its source's, so the source takes its
  share of the table first.
  """
  room = model_max_len - source_length if decoder_only else model_max_len
  return min(source_length + extra, room)


def length_penalty(length, alpha: float):
  """((5 + length) / 6) ** alpha, the GNMT penalty tensor2tensor and the paper use."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _decode_step(model, params, cache, encoded_BSE, inputs_BS, previous_B):
  """Next-token logits [B, V] in float32 and the updated cache.

  Logits, not log-probabilities: greedy search needs only their argmax, and beam search
  normalises just the few candidates it keeps. Both model kinds take the same arguments
  (a decoder-only model has no `encoded_BSE`).
  """
  logits_B1V, variables = model.apply({'params': params, 'cache': cache}, encoded_BSE,
                                      inputs_BS, previous_B[:, None], mutable=['cache'],
                                      method='decode')
  return logits_B1V[:, 0], variables['cache']


def _start(model, params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int):
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
    return _decode_step(model, params, variables['cache'], None, inputs_BS, start_B)
  encoded_BSE = model.apply({'params': params}, inputs_BS, method='encode')
  return _decode_step(model, params, init_cache(config, batch_size, max_len), encoded_BSE,
                      inputs_BS, start_B)


def _without_pad(logits_BV: jax.Array) -> jax.Array:
  """PAD is never generated (its probability still counts in the softmax's normaliser)."""
  return logits_BV.at[..., PAD_ID].set(_NEG)


def _row_limits(max_lengths_B: jax.Array | None, batch_size: int, max_len: int) -> jax.Array:
  """Each row's longest output: `max_lengths_B` capped by `max_len` (the cache size)."""
  if max_lengths_B is None:
    return jnp.full((batch_size,), max_len, jnp.int32)
  return jnp.minimum(jnp.asarray(max_lengths_B, jnp.int32), max_len)


def greedy_search(params, inputs_BS: jax.Array, config: TransformerConfig, max_len: int,
                  max_lengths_B: jax.Array | None = None) -> jax.Array:
  """Argmax decoding; returns [B, max_len] tokens, EOS included, PAD after it.

  Row b generates at most `max_lengths_B[b]` tokens (default: `max_len` for every row).
  """
  model = make_model(decode_config(config))
  batch_size = inputs_BS.shape[0]
  limit_B = _row_limits(max_lengths_B, batch_size, max_len)
  logits_BV, cache = _start(model, params, inputs_BS, config, max_len)
  first_B = _without_pad(logits_BV).argmax(-1)
  tokens_BL = jnp.zeros((batch_size, max_len), jnp.int32).at[:, 0].set(first_B)

  def step(carry):
    i, cache, tokens_BL, finished_B = carry
    logits_BV, cache = _decode_step(model, params, cache, None, inputs_BS, tokens_BL[:, i - 1])
    next_B = jnp.where(finished_B, PAD_ID, _without_pad(logits_BV).argmax(-1))
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
  live_tokens_BKL: jax.Array
  live_log_probs_BK: jax.Array  # Sorted, best first.
  finished_tokens_BKL: jax.Array
  finished_scores_BK: jax.Array  # Log-probability / length penalty; sorted, best first.


def _top_log_probs(logits_BKV: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """The `count` largest log-softmax entries [B, K, count] of each row, and their tokens.

  Log-softmax shifts a row's logits by one constant, so its largest entries are those of the
  largest logits: only they are normalised, never the whole [B, K, V] array.
  """
  max_BK1 = jax.lax.stop_gradient(logits_BKV.max(-1, keepdims=True))
  log_norm_BK1 = jnp.log(jnp.exp(logits_BKV - max_BK1).sum(-1, keepdims=True))
  top_logits_BKC, token_BKC = jax.lax.top_k(_without_pad(logits_BKV), count)
  return (top_logits_BKC - max_BK1) - log_norm_BK1, token_BKC


def _beam_update(state: BeamState, logits_BKV: jax.Array, limit_B: jax.Array,
                 alpha: float) -> tuple[BeamState, jax.Array]:
  """Extends every live hypothesis by one token; returns the new state and live parents [B, K].

  A row whose length limit this step reaches ends all its candidates, and its live
  hypotheses die (log-probability _NEG), so nothing longer can enter its finished set.
  """
  batch_size, beam_size, vocab_size = logits_BKV.shape
  i = state.step
  # Two stages: each beam's best 2K tokens, then the best 2K of those K * 2K candidates. A
  # candidate among the best 2K overall is among its own beam's best 2K, and ties resolve
  # as one top-k over [K * V] would (lower beam, then lower token, first).
  per_beam = min(2 * beam_size, vocab_size)
  log_probs_BKC, token_BKC = _top_log_probs(logits_BKV, per_beam)
  candidates_BKC = state.live_log_probs_BK[:, :, None] + log_probs_BKC
  log_probs_BC, flat_BC = jax.lax.top_k(candidates_BKC.reshape(batch_size, -1), 2 * beam_size)
  parent_BC = flat_BC // per_beam
  token_BC = jnp.take_along_axis(token_BKC.reshape(batch_size, -1), flat_BC, axis=1)
  tokens_BCL = jnp.take_along_axis(state.live_tokens_BKL, parent_BC[:, :, None], axis=1)
  tokens_BCL = tokens_BCL.at[:, :, i].set(token_BC)
  is_last_B1 = (i + 1 >= limit_B)[:, None]
  # EOS ends a hypothesis only if it ranks among the best K candidates (so beam 1 is greedy);
  # at the length limit every candidate ends.
  ends_BC = ((token_BC == EOS_ID) & (jnp.arange(2 * beam_size) < beam_size)) | is_last_B1
  scores_BC = jnp.where(ends_BC, log_probs_BC / length_penalty(i + 1, alpha), _NEG)
  finished_scores_BK, keep_BK = jax.lax.top_k(
      jnp.concatenate([state.finished_scores_BK, scores_BC], axis=1), beam_size)
  finished_tokens_BKL = jnp.take_along_axis(
      jnp.concatenate([state.finished_tokens_BKL, tokens_BCL], axis=1), keep_BK[:, :, None],
      axis=1)
  live_log_probs_BK, keep_BK = jax.lax.top_k(
      jnp.where((token_BC == EOS_ID) | is_last_B1, _NEG, log_probs_BC), beam_size)
  live_tokens_BKL = jnp.take_along_axis(tokens_BCL, keep_BK[:, :, None], axis=1)
  parent_BK = jnp.take_along_axis(parent_BC, keep_BK, axis=1)
  return BeamState(i + 1, live_tokens_BKL, live_log_probs_BK, finished_tokens_BKL,
                   finished_scores_BK), parent_BK


def _can_improve(state: BeamState, limit_B: jax.Array, alpha: float) -> jax.Array:
  """Whether any row's best live hypothesis could still enter its finished top K."""
  # Log-probabilities only fall as a hypothesis grows, so its best reachable score divides
  # today's by the largest penalty of the lengths still open (the penalty is monotonic).
  largest_penalty_B = jnp.maximum(length_penalty(state.step + 1, alpha),
                                  length_penalty(limit_B, alpha))
  best_live_B = state.live_log_probs_BK[:, 0] / largest_penalty_B
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
                beam_size: int, alpha: float,
                max_lengths_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The `beam_size` best hypotheses [B, K, max_len] (EOS included, PAD after) and scores [B, K].

  Scores are log-probability / ((5 + length) / 6) ** alpha, best first. Row b's hypotheses
  end by `max_lengths_B[b]` tokens (default: `max_len`, the cache size, for every row). A row
  stops when its K finished hypotheses all beat what its best live one could still reach.
  """
  model = make_model(decode_config(config))
  batch_size, beam_size = inputs_BS.shape[0], int(beam_size)
  limit_B = _row_limits(max_lengths_B, batch_size, max_len)
  # The first step sees one row per sentence; its cache is then copied to every beam.
  logits_BV, cache = _start(model, params, inputs_BS, config, max_len)
  empty_BKL = jnp.zeros((batch_size, beam_size, max_len), jnp.int32)
  only_first_beam_BK = jnp.where(jnp.arange(beam_size) == 0, 0.0, _NEG)[None].repeat(
      batch_size, 0)
  state = BeamState(jnp.array(0), empty_BKL, only_first_beam_BK, empty_BKL,
                    jnp.full((batch_size, beam_size), _NEG))
  state, _ = _beam_update(state, jnp.broadcast_to(logits_BV[:, None], (
      batch_size, beam_size, logits_BV.shape[-1])), limit_B, alpha)
  cache = _map_rows(lambda x, axis: jnp.repeat(x, beam_size, axis=axis), cache, config)
  inputs_NS = jnp.repeat(inputs_BS, beam_size, axis=0)

  def step(carry):
    state, cache = carry
    previous_N = state.live_tokens_BKL[:, :, state.step - 1].reshape(-1)
    logits_NV, cache = _decode_step(model, params, cache, None, inputs_NS, previous_N)
    state, parent_BK = _beam_update(state, logits_NV.reshape(batch_size, beam_size, -1),
                                    limit_B, alpha)
    return state, _reorder_cache(cache, parent_BK, config)

  def not_done(carry):
    state, _ = carry
    return (state.step < max_len) & _can_improve(state, limit_B, alpha)

  state, _ = jax.lax.while_loop(not_done, step, (state, cache))
  return state.finished_tokens_BKL, state.finished_scores_BK


def _best_beam(params, inputs_BS, config, max_len, beam_size, alpha, max_lengths_B):
  return beam_search(params, inputs_BS, config, max_len, beam_size, alpha, max_lengths_B)[0][:, 0]


def bucket_lengths(min_bucket: int, max_len: int) -> list[int]:
  """Padded source lengths of decoding batches: two per octave, so few shapes compile.

  `min_bucket` times 1, 2, 3, 4, 6, 8, 12, ..., then `max_len`: a source is padded by at
  most a third of its length (a bucket of its own per `min_bucket` tokens would compile
  tens of shapes for news text).
  """
  lengths, unit = set(), 1
  while min_bucket * unit < max_len:
    lengths.update(min_bucket * m for m in (unit, unit * 3 // 2 if unit > 1 else unit))
    unit *= 2
  return sorted({n for n in lengths if n < max_len} | {max_len})


@dataclasses.dataclass
class TranslateStats:
  """Where the time of `Translator.translate` calls went, summed over the calls."""
  sentences: int = 0
  batches: int = 0
  padding_rows: int = 0  # Batch rows that held no sentence.
  shapes_compiled: int = 0
  compile_seconds: float = 0.0
  search_seconds: float = 0.0  # In compiled searches: dispatch to results on the host.
  seconds: float = 0.0  # Whole `translate` calls (batching, searching, unpacking).
  text_seconds: float = 0.0  # Tokenising and detokenising around them (translate.py's).

  def as_dict(self) -> dict:
    return {key: round(value, 3) if isinstance(value, float) else value
            for key, value in dataclasses.asdict(self).items()}


class Translator:
  """Decodes lists of id sequences in length-sorted batches sharded over the mesh's batch axes.

  Sources are sorted by length and padded to a few bucket lengths (`bucket_lengths`); a batch
  holds at most `batch_tokens` tokens counted over all beams (rows x beam x padded source
  length). Sentences left over in one bucket join the next longer one's batches, and the very
  last batch shrinks to a power-of-two number of rows, so little work goes to padding rows.
  Each output is at most its own source length + `max_extra_len` tokens (capped by the
  model's max_len), whichever batch it lands in: outputs do not depend on the batching.
  Beam size 1 is greedy search, as in tensor2tensor. `dtype` is one of DECODE_DTYPES.
  """

  def __init__(self, config: TransformerConfig, mesh, axis_rules, batch_tokens: int,
               min_bucket: int, max_extra_len: int, beam_size: int = 1, alpha: float = 0.6,
               dtype: str = 'model'):
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    config = decoding_config(config, dtype, mesh.devices.flat[0].platform)
    self.config, self.mesh, self.axis_rules = config, mesh, axis_rules
    self.batch_tokens, self.min_bucket, self.max_extra_len = batch_tokens, min_bucket, max_extra_len
    self.beam_size, self.alpha = beam_size, alpha
    self.buckets = bucket_lengths(min_bucket, config.max_len)
    self.stats = TranslateStats()
    self._compiled = {}

  def _search(self, params, inputs_BS, max_lengths_B, beam_size: int, alpha: float):
    """The compiled search for this batch's shape, compiled (and timed) on first use."""
    rows, length = inputs_BS.shape
    max_len = max_decode_length(length, self.max_extra_len, self.config.max_len)
    key = (rows, length, beam_size, alpha if beam_size > 1 else None)
    if key not in self._compiled:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      if beam_size == 1:
        search = functools.partial(greedy_search, config=self.config, max_len=max_len)
      else:
        search = functools.partial(_best_beam, config=self.config, max_len=max_len,
                                   beam_size=beam_size, alpha=alpha)
      start = time.perf_counter()
      self._compiled[key] = jax.jit(search, out_shardings=replicated).lower(
          params, inputs_BS, max_lengths_B=max_lengths_B).compile()
      self.stats.compile_seconds += time.perf_counter() - start
      self.stats.shapes_compiled += 1
    return self._compiled[key]

  def _batches(self, lengths: Sequence[int], beam_size: int) -> list[tuple[int, int, list[int]]]:
    """(padded length, rows, input indices) of every batch, shortest sources first."""
    from t2t_jax import sharding  # Decoding needs only the batch placement helpers.
    shards = sharding.batch_shards(self.mesh)
    def rows_of(length):
      return max(shards, self.batch_tokens // (length * beam_size) // shards * shards)
    def bucket_of(index):
      return next(b for b in self.buckets if b >= lengths[index])
    by_bucket = collections.defaultdict(list)
    for index in sorted((i for i, n in enumerate(lengths) if n), key=lambda i: lengths[i]):
      by_bucket[bucket_of(index)].append(index)
    batches, waiting = [], []
    for length in sorted(by_bucket):
      waiting += by_bucket[length]  # With any left over from the shorter buckets.
      rows = rows_of(length)
      while len(waiting) >= rows:
        batches.append((length, rows, waiting[:rows]))
        waiting = waiting[rows:]
    if waiting:  # The last, partial batch: a power of two times the shards in rows.
      length, rows = bucket_of(waiting[-1]), shards
      while rows < len(waiting):
        rows *= 2
      batches.append((length, min(rows, rows_of(length)), waiting))
    return batches

  def translate(self, params, inputs: Sequence[np.ndarray], beam_size: int | None = None,
                alpha: float | None = None,
                progress: Callable[[int], object] | None = None) -> list[np.ndarray]:
    """Output ids (EOS included, no padding) of each input, in order; [] for an empty input.

    `progress(n)` is called with the number of sentences each finished batch held.
    """
    from t2t_jax import sharding  # Decoding needs only the batch placement helpers.
    start = time.perf_counter()
    beam_size = self.beam_size if beam_size is None else beam_size
    alpha = self.alpha if alpha is None else alpha
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    decoder_only = self.config.kind == 'decoder_only'
    for index, seq in enumerate(inputs):
      if len(seq) > self.config.max_len - decoder_only:
        raise ValueError(f'input {index} has {len(seq)} tokens, more than the model\'s '
                         f'max_len={self.config.max_len}' + (
                             ' less one position to write an output at' if decoder_only
                             else '') + ': truncate it first')
    lengths = [len(seq) for seq in inputs]
    outputs = [np.zeros((0,), np.int32)] * len(inputs)
    for length, rows, members in self._batches(lengths, beam_size):
      batch = np.full((rows, length), PAD_ID, np.int32)
      max_lengths = np.zeros((rows,), np.int32)
      for row, index in enumerate(members):
        batch[row, :lengths[index]] = inputs[index]
        max_lengths[row] = max_decode_length(lengths[index], self.max_extra_len,
                                             self.config.max_len, decoder_only)
      with sharding.mesh_context(self.mesh, self.axis_rules):
        placed = sharding.global_batch({'inputs': batch, 'max_lengths': max_lengths},
                                       self.mesh, whole=True)
        search = self._search(params, placed['inputs'], placed['max_lengths'], beam_size, alpha)
        search_start = time.perf_counter()
        tokens = np.asarray(jax.device_get(search(params, placed['inputs'],
                                                  max_lengths_B=placed['max_lengths'])))
        self.stats.search_seconds += time.perf_counter() - search_start
      for row, index in enumerate(members):
        outputs[index] = tokens[row][tokens[row] != PAD_ID]  # PAD is never generated.
      self.stats.batches += 1
      self.stats.padding_rows += rows - len(members)
      if progress:
        progress(len(members))
    empty = sum(1 for n in lengths if not n)
    if progress and empty:
      progress(empty)
    self.stats.sentences += len(inputs)
    self.stats.seconds += time.perf_counter() - start
    return outputs
