"""Batched translation over a trained model: sources sorted by length, padded to a few bucket
lengths, searched in batches sharded over the mesh, and returned in the input order.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import collections
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import PAD_ID
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.decoding.decode import LENGTH_PENALTIES, beam_search, greedy_search, max_decode_length
from t2t_jax.decoding.sampling import Sampling, sample_search
from t2t_jax.model.model_config import TransformerConfig

DECODE_DTYPES = ('auto', 'model', 'float32', 'bfloat16')


def eval_dtype(name: str, model_dtype: str, platform: str) -> str:
  """config.eval.dtype (or translate's --dtype) resolved for `platform`: 'model' is the
  training dtype; 'auto' is bfloat16 on accelerators (GPU, TPU) and float32 on CPU, where
  bfloat16 arithmetic is slower. resolve.py calls it for a run's config."""
  if name not in DECODE_DTYPES:
    raise ConfigError(f'config.eval.dtype={name!r} must be one of {DECODE_DTYPES}')
  if name == 'model':
    return model_dtype
  if name == 'auto':
    return 'float32' if platform == 'cpu' else 'bfloat16'
  return name


def decoding_config(config: TransformerConfig, dtype: str, platform: str) -> TransformerConfig:
  """The model config searches run with: activations and caches in `dtype` (`eval_dtype`).
  Parameters stay as stored; the logits are float32 either way."""
  return dataclasses.replace(config, dtype=jnp.dtype(
      eval_dtype(dtype, jnp.dtype(config.dtype).name, platform)))


def _best_beam(params, inputs_BS, config, max_len, beam_size, alpha, max_lengths_B, penalty):
  """The best hypothesis [B, max_len] of each row's beam search."""
  return beam_search(params, inputs_BS, config, max_len, beam_size, alpha, max_lengths_B,
                     penalty)[0][:, 0]


def search_function(config: TransformerConfig, max_len: int, beam_size: int, alpha: float,
                    length_penalty: str = 'gnmt', sampling: Sampling | None = None) -> Callable:
  """search(params, inputs_BS, max_lengths_B=...) -> the best output [B, max_len] of each
  row: greedy search for beam size 1, as in tensor2tensor, else beam search with
  `length_penalty` (decode.LENGTH_PENALTIES). With `sampling`, sampling.sample_search, which
  also takes each row's lines_B and samples_B (and prompts_BP for a language model)."""
  if sampling is not None:
    return functools.partial(sample_search, config=config, max_len=max_len, sampling=sampling)
  if beam_size == 1:
    return functools.partial(greedy_search, config=config, max_len=max_len)
  return functools.partial(_best_beam, config=config, max_len=max_len, beam_size=beam_size,
                           alpha=alpha, penalty=length_penalty)


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
  search_seconds: float = 0.0  # The host in compiled searches: dispatching, awaiting results.
  seconds: float = 0.0  # Whole `translate` calls (batching, searching, unpacking).
  text_seconds: float = 0.0  # Tokenising and detokenising around them (translate.py's).

  def as_dict(self) -> dict:
    return {key: round(value, 3) if isinstance(value, float) else value
            for key, value in dataclasses.asdict(self).items()}


def from_config(config, model_config: TransformerConfig, mesh, axis_rules,
                beam_size: int | None = None, alpha: float | None = None,
                batch_tokens: int | None = None, dtype: str | None = None,
                length_penalty: str | None = None, sampling: Sampling | None = None,
                prompts: bool = False, max_extra_len: int | None = None) -> 'Translator':
  """The translator a run's config asks for (config.data batching, config.eval decoding);
  the arguments given override the config's values (`Translator` says what `sampling` and
  `prompts` do)."""
  return Translator(
      model_config, mesh, axis_rules,
      config.data.batch_tokens if batch_tokens is None else batch_tokens,
      config.data.min_bucket,
      config.eval.max_extra_len if max_extra_len is None else max_extra_len,
      beam_size=config.eval.beam_size if beam_size is None else beam_size,
      alpha=config.eval.alpha if alpha is None else alpha,
      dtype=config.eval.dtype if dtype is None else dtype,
      length_penalty=config.eval.length_penalty if length_penalty is None else length_penalty,
      sampling=sampling, prompts=prompts)


def check_input_lengths(inputs: Sequence[np.ndarray], config: TransformerConfig) -> None:
  """Refuses an input longer than the model's positions hold; a decoder-only model's source
  also leaves one position to write an output at. Both engines check this."""
  decoder_only = config.kind == 'decoder_only'
  for index, seq in enumerate(inputs):
    if len(seq) > config.max_len - decoder_only:
      raise ValueError(f'input {index} has {len(seq)} tokens, more than the model\'s '
                       f'max_len={config.max_len}' + (
                           ' less one position to write an output at' if decoder_only
                           else '') + ': truncate it first')


class Translator:
  """Decodes lists of id sequences in length-sorted batches sharded over the mesh's batch axes.

  Sources are sorted by length and padded to a few bucket lengths (`bucket_lengths`); a batch
  holds at most `batch_tokens` tokens counted over all beams (rows x beam x padded source
  length). Sentences left over in one bucket join the next longer one's batches, and the very
  last batch shrinks to a power-of-two number of rows, so little work goes to padding rows.
  Each output is at most its own source length + `max_extra_len` tokens (capped by the
  model's max_len), whichever batch it lands in: outputs do not depend on the batching.
  Beam size 1 is greedy search, as in tensor2tensor. `dtype` is one of DECODE_DTYPES,
  `length_penalty` one of decode.LENGTH_PENALTIES. With `sampling` every output is drawn
  (sampling.sample_search) instead, the beam size unused. With `prompts` the inputs are a
  language model's prompts, which its outputs continue (and hold); an empty prompt is a
  start from nothing.
  """

  engine = 't2t_jax'  # translate --engine's name for it.

  def __init__(self, config: TransformerConfig, mesh, axis_rules, batch_tokens: int,
               min_bucket: int, max_extra_len: int, beam_size: int = 1, alpha: float = 0.6,
               dtype: str = 'model', length_penalty: str = 'gnmt',
               sampling: Sampling | None = None, prompts: bool = False):
    runtime.start()  # Done already where a command made it; a library caller's first.
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    if length_penalty not in LENGTH_PENALTIES:
      raise ConfigError(f'length penalty {length_penalty!r} must be one of {LENGTH_PENALTIES}')
    config = decoding_config(config, dtype, mesh.devices.flat[0].platform)
    self.config, self.mesh, self.axis_rules = config, mesh, axis_rules
    self.batch_tokens, self.min_bucket, self.max_extra_len = batch_tokens, min_bucket, max_extra_len
    self.beam_size, self.alpha, self.length_penalty = beam_size, alpha, length_penalty
    self.sampling, self.prompts = sampling, prompts
    if prompts and (sampling is None or config.kind != 'decoder_only'):
      raise ValueError('prompts are continued by a decoder-only model, sampling (temperature 0: '
                       'greedy)')
    self.buckets = bucket_lengths(min_bucket, config.max_len)
    self.stats = TranslateStats()
    self._compiled = {}

  def _search(self, params, inputs_BS, length: int, beam_size: int, alpha: float, extra: dict):
    """The compiled search for this batch's shape, compiled (and timed) on first use; `length`
    is its sources' (or prompts') padded length, `extra` the arrays it takes by name."""
    rows = inputs_BS.shape[0]
    max_len = max_decode_length(length, self.max_extra_len, self.config.max_len)
    key = (rows, length, self.sampling or beam_size,
           (alpha, self.length_penalty) if beam_size > 1 and not self.sampling else None)
    if key not in self._compiled:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      search = search_function(self.config, max_len, beam_size, alpha, self.length_penalty,
                               self.sampling)
      start = time.perf_counter()
      self._compiled[key] = runtime.jit_search(
          search, self.mesh.devices.flat[0].platform, out_shardings=replicated).lower(
              params, inputs_BS, **extra).compile()
      self.stats.compile_seconds += time.perf_counter() - start
      self.stats.shapes_compiled += 1
    return self._compiled[key]

  def _batches(self, lengths: Sequence[int], beam_size: int) -> list[tuple[int, int, list[int]]]:
    """(padded length, rows, input indices) of every batch, shortest sources first."""
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

  def _dispatch(self, params, inputs, rows_of_inputs: np.ndarray, first_line: int,
                length: int, rows: int, members: list[int], beam_size: int,
                alpha: float) -> jax.Array:
    """Starts one batch's search (compiling its shape first if new); returns its tokens.

    `rows_of_inputs[m]` is output m's (line, sample): its input is inputs[line - first_line].
    """
    batch = np.full((rows, length), PAD_ID, np.int32)
    arrays = {'max_lengths_B': np.zeros((rows,), np.int32)}
    if self.sampling:
      arrays['lines_B'] = np.zeros((rows,), np.int32)
      arrays['samples_B'] = np.zeros((rows,), np.int32)
    for row, index in enumerate(members):
      ids = inputs[rows_of_inputs[index, 0] - first_line]
      batch[row, :len(ids)] = ids
      arrays['max_lengths_B'][row] = (
          min(len(ids) + self.max_extra_len, self.config.max_len) if self.prompts else
          max_decode_length(len(ids), self.max_extra_len, self.config.max_len,
                            self.config.kind == 'decoder_only'))
      if self.sampling:
        arrays['lines_B'][row], arrays['samples_B'][row] = rows_of_inputs[index]
    if self.prompts:  # The prompts are the outputs' first tokens; the source is empty.
      arrays['prompts_BP'] = batch
      batch = np.full((rows, 1), PAD_ID, np.int32)
    with sharding.mesh_context(self.mesh, self.axis_rules):
      placed = sharding.global_batch({'inputs': batch, **arrays}, self.mesh, whole=True)
      extra = {name: placed[name] for name in arrays}
      search = self._search(params, placed['inputs'], length, beam_size, alpha, extra)
      search_start = time.perf_counter()
      tokens = search(params, placed['inputs'], **extra)
    self.stats.search_seconds += time.perf_counter() - search_start
    self.stats.batches += 1
    self.stats.padding_rows += rows - len(members)
    return tokens

  def _collect(self, tokens, members: list[int], outputs: list, progress) -> None:
    """Waits for a dispatched batch's tokens and puts each row's output in its place."""
    wait_start = time.perf_counter()
    tokens = np.asarray(jax.device_get(tokens))
    self.stats.search_seconds += time.perf_counter() - wait_start
    for row, index in enumerate(members):
      outputs[index] = tokens[row][tokens[row] != PAD_ID]  # PAD is never generated.
    if progress:
      progress(len(members))

  def translate(self, params, inputs: Sequence[np.ndarray], beam_size: int | None = None,
                alpha: float | None = None,
                progress: Callable[[int], object] | None = None, samples: int = 1,
                first_line: int = 0) -> list[np.ndarray]:
    """Output ids (EOS included, no padding) of each input, in order; [] for an empty input
    (but an empty prompt is continued).

    Sampling, each input has `samples` outputs, one after the other; `first_line` is the
    index of inputs[0] in the whole input, which the sampled outputs' keys fold in.
    `progress(n)` is called with the number of outputs each finished batch held.
    """
    start = time.perf_counter()
    beam_size = self.beam_size if beam_size is None else beam_size
    alpha = self.alpha if alpha is None else alpha
    if beam_size < 1:
      raise ValueError(f'beam size must be at least 1, got {beam_size}')
    if samples != 1 and not self.sampling:
      raise ValueError(f'{samples} samples per input need sampling: a search without it '
                       'gives one output')
    check_input_lengths(inputs, self.config)
    rows_of_inputs = np.stack(np.meshgrid(np.arange(len(inputs)) + first_line,
                                          np.arange(samples), indexing='ij'), -1).reshape(-1, 2)
    lengths = [max(len(inputs[n - first_line]), self.prompts) for n, _ in rows_of_inputs]
    outputs = [np.zeros((0,), np.int32)] * len(lengths)
    pending = None  # The dispatched batch whose results are not fetched yet.
    for length, rows, members in self._batches(lengths, 1 if self.sampling else beam_size):
      # Batch k + 1 is dispatched before batch k's results are fetched: the device never
      # waits on the host's batching and unpacking.
      dispatched = self._dispatch(params, inputs, rows_of_inputs, first_line, length, rows,
                                  members, beam_size, alpha)
      if pending:
        self._collect(*pending, outputs, progress)
      pending = dispatched, members
    if pending:
      self._collect(*pending, outputs, progress)
    empty = sum(1 for n in lengths if not n)
    if progress and empty:
      progress(empty)
    self.stats.sentences += len(outputs)
    self.stats.seconds += time.perf_counter() - start
    return outputs
