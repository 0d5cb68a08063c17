"""Deterministic batch plans over token ids: length buckets or packed rows, sharded by process.

A plan is a function of (data, config, seed, epoch) only, identical on every process. Each
global batch has a fixed row count per shape; process p of P collates only rows
[p * R / P, (p + 1) * R / P), so P processes read disjoint examples and together see every
example exactly once per epoch. The iterator's state is (epoch, batch), so a restored run
continues with exactly the batches an uninterrupted one would have produced.

The row counts are the token budget over the batch length, rounded down to a multiple of the
plan's row multiple (config.data.row_multiple, or the batch shards x micro-batches of the mesh
the run started on). Nothing else of the mesh enters the plan: a run resumed on other devices,
processes or micro-batches reads the same global batches, as long as they split its rows
evenly (`split_problem`).
"""

import hashlib
import json
import math
from typing import Iterator, Sequence

import grain
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import PAD_ID
from t2t_jax.data.sources import DataError
from t2t_jax.data.token_cache import Ragged

BATCHING_MODES = ('buckets', 'packed')
_OPEN_ROWS = 64  # Packing keeps this many rows open and puts each example in the first that fits.


def bucket_boundaries(max_len: int, min_bucket: int, scale: float) -> list[int]:
  """Bucket lengths: multiples of `min_bucket` growing by about `scale`, the last = max_len."""
  boundaries = [min(min_bucket, max_len)]
  while boundaries[-1] < max_len:
    grown = math.ceil(boundaries[-1] * scale / min_bucket) * min_bucket
    boundaries.append(min(max(grown, boundaries[-1] + min_bucket), max_len))
  return boundaries


def _rows(batch_tokens: int, length: int, row_multiple: int) -> int:
  return max(row_multiple, batch_tokens // length // row_multiple * row_multiple)


def train_rows(data_config, row_multiple: int) -> list[int]:
  """The row count of each train batch shape (per length bucket, or the packed row) in a plan
  whose rows are multiples of `row_multiple`: what a mesh must split evenly."""
  if data_config.batching == 'packed':
    lengths = [pack_length(data_config)]
  else:
    lengths = bucket_boundaries(data_config.max_len, data_config.min_bucket,
                                data_config.bucket_scale)
  return [_rows(data_config.batch_tokens, length, row_multiple) for length in lengths]


def split_problem(rows: Sequence[int], shards: int, accumulation: int, processes: int) -> str:
  """Why train batches of `rows` rows cannot be split over `shards` batch shards x
  `accumulation` micro-batches, each of `processes` processes collating a whole block of rows
  ('' if they can)."""
  whole = math.gcd(*rows)
  parts = math.lcm(shards * accumulation, processes)
  if whole % parts == 0:
    return ''
  return (f'the train batches have {sorted(set(rows))} rows (all multiples of {whole}), which '
          f'{shards} batch shard{"s" * (shards > 1)} x {accumulation} '
          f'micro-batch{"es" * (accumulation > 1)}'
          + (f' over {processes} processes' if processes > 1 else '')
          + f' cannot split evenly: {parts} must divide {whole}')


def _gather(ragged: Ragged, examples: np.ndarray, rows: np.ndarray, columns: np.ndarray,
            out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Writes each example's ids into `out[row, column:]`; returns (token rows, positions)."""
  lengths = ragged.lengths[examples].astype(np.int64)
  ends = np.cumsum(lengths)
  positions = np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths, lengths)
  token_rows = np.repeat(rows, lengths)
  out[token_rows, np.repeat(columns, lengths) + positions] = ragged.tokens[
      np.repeat(ragged.starts[examples], lengths) + positions]
  return token_rows, positions


class _Batches:
  """What both modes share: the data, the process slice and the plan cache."""

  def __init__(self, split, shuffle: bool, seed: int, process_index: int, process_count: int):
    self.split, self.shuffle, self.seed = split, shuffle, seed
    # Language modelling has no source: its 'inputs' fields are zero columns wide.
    self.has_source = bool(split.inputs.lengths.any())
    self.process_index, self.process_count = process_index, process_count
    self._cached = (None, None)  # (epoch, plan), swapped as one object: grain reads it in threads.

  def _check_processes(self, rows: Sequence[int]) -> None:
    if any(count % self.process_count for count in rows):
      raise ConfigError(f'{self.process_count} processes cannot split batches of {list(rows)} '
                        'rows evenly: the mesh batch axes must be a multiple of the process '
                        'count')

  def _local(self, rows: int) -> slice:
    per_process = rows // self.process_count
    return slice(self.process_index * per_process, (self.process_index + 1) * per_process)

  def plan(self, epoch: int) -> list:
    cached_epoch, plan = self._cached
    if cached_epoch != epoch:
      plan = self._make_plan(epoch)
      self._cached = (epoch, plan)
    return plan

  def signature(self) -> str:
    """Identifies the global plan: a restored iterator state must come from the same one."""
    fields = {'mode': type(self).__name__, 'pairs': len(self.split), 'seed': self.seed,
              'shuffle': self.shuffle, **self._shape_fields()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class TokenBudgetBatches(_Batches):
  """Pairs grouped into length buckets, rows x length <= budget (tensor2tensor).

  Every bucket has a fixed row count (a multiple of `row_multiple`, for the mesh), so each
  bucket compiles once; a bucket's last, partial batch is filled with empty rows rather
  than dropped. Training plans reshuffle every epoch from (seed, epoch).
  """

  def __init__(self, split, batch_tokens: int, boundaries: Sequence[int], row_multiple: int,
               shuffle: bool, seed: int, process_index: int = 0, process_count: int = 1):
    super().__init__(split, shuffle, seed, process_index, process_count)
    lengths = np.maximum(split.inputs.lengths, split.targets.lengths)
    self.boundaries = list(boundaries)
    self.bucket_of = np.searchsorted(self.boundaries, lengths, side='left')
    if len(lengths) and self.bucket_of.max() >= len(self.boundaries):
      raise ValueError(f'a pair of length {lengths.max()} exceeds the longest bucket '
                       f'{self.boundaries[-1]}')
    self.rows = [_rows(batch_tokens, b, row_multiple) for b in self.boundaries]
    self._check_processes(self.rows)
    self.batches_per_epoch = sum(
        math.ceil(np.sum(self.bucket_of == k) / self.rows[k]) for k in range(len(self.rows)))

  def _shape_fields(self) -> dict:
    return {'boundaries': self.boundaries, 'rows': self.rows}

  def _make_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """The epoch's batches as (bucket, example indices)."""
    rng = np.random.default_rng([self.seed, epoch])
    batches = []
    for k, rows in enumerate(self.rows):
      members = np.flatnonzero(self.bucket_of == k)
      if self.shuffle:
        members = rng.permutation(members)
      batches += [(k, members[i:i + rows]) for i in range(0, len(members), rows)]
    if self.shuffle:
      batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches

  def examples(self, epoch: int, position: int) -> np.ndarray:
    """The example indices this process reads for one batch, row by row."""
    bucket, indices = self.plan(epoch)[position]
    return indices[self._local(self.rows[bucket])]

  def collate(self, bucket: int, indices: np.ndarray) -> dict[str, np.ndarray]:
    """This process's rows of one global batch (all rows when there is one process)."""
    length, rows = self.boundaries[bucket], self.rows[bucket] // self.process_count
    indices = indices[self._local(self.rows[bucket])]
    batch = {'inputs': np.full((rows, length if self.has_source else 0), PAD_ID, np.int32),
             'targets': np.full((rows, length), PAD_ID, np.int32)}
    row_ids, columns = np.arange(len(indices)), np.zeros(len(indices), np.int64)
    _gather(self.split.inputs, indices, row_ids, columns, batch['inputs'])
    _gather(self.split.targets, indices, row_ids, columns, batch['targets'])
    return batch

  def epoch_length(self, epoch: int) -> int:
    return self.batches_per_epoch

  def __len__(self):
    return self.batches_per_epoch

  def get(self, epoch: int, position: int) -> dict[str, np.ndarray]:
    return self.collate(*self.plan(epoch)[position])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.get(*divmod(index, self.batches_per_epoch))


class PackedBatches(_Batches):
  """Several pairs per row of `length`, with segment ids and positions (Flax, t5x).

  Each epoch shuffles the pairs from (seed, epoch) and places each in the first of a few open
  rows where both its source and its target still fit; a row that takes nothing more is
  closed. Segment ids count 1, 2, ... within a row (0 is padding); positions restart at 0.
  """

  def __init__(self, split, batch_tokens: int, length: int, row_multiple: int, shuffle: bool,
               seed: int, process_index: int = 0, process_count: int = 1):
    super().__init__(split, shuffle, seed, process_index, process_count)
    self.length = length
    self.rows = _rows(batch_tokens, length, row_multiple)
    self._check_processes([self.rows])
    longest = max(split.inputs.lengths.max(initial=0), split.targets.lengths.max(initial=0))
    if longest > length:
      raise ValueError(f'a pair of {longest} tokens does not fit a packed row of {length}: '
                       'config.data.pack_length must be at least config.data.max_len')

  def _shape_fields(self) -> dict:
    return {'length': self.length, 'rows': self.rows, 'open_rows': _OPEN_ROWS}

  def _make_plan(self, epoch: int) -> list[np.ndarray]:
    """The epoch's batches, each an array of rows (example indices, -1 for none) [rows, k]."""
    order = np.arange(len(self.split))
    if self.shuffle:
      order = np.random.default_rng([self.seed, epoch]).permutation(order)
    input_lengths = self.split.inputs.lengths[order].tolist()
    target_lengths = self.split.targets.lengths[order].tolist()
    free_inputs, free_targets, open_rows, closed = [], [], [], []
    for example, need_inputs, need_targets in zip(order.tolist(), input_lengths, target_lengths):
      for k in range(len(open_rows)):
        if free_inputs[k] >= need_inputs and free_targets[k] >= need_targets:
          open_rows[k].append(example)
          free_inputs[k] -= need_inputs
          free_targets[k] -= need_targets
          break
      else:
        if len(open_rows) == _OPEN_ROWS:  # Close the fullest row to make room.
          k = min(range(len(open_rows)), key=lambda k: free_inputs[k] + free_targets[k])
          closed.append(open_rows.pop(k))
          free_inputs.pop(k)
          free_targets.pop(k)
        open_rows.append([example])
        free_inputs.append(self.length - need_inputs)
        free_targets.append(self.length - need_targets)
    closed += open_rows
    width = max((len(row) for row in closed), default=1)
    table = np.full((math.ceil(len(closed) / self.rows) * self.rows, width), -1, np.int64)
    for r, row in enumerate(closed):
      table[r, :len(row)] = row
    return [table[i:i + self.rows] for i in range(0, len(table), self.rows)]

  def examples(self, epoch: int, position: int) -> np.ndarray:
    rows = self.plan(epoch)[position][self._local(self.rows)]
    return rows[rows >= 0]

  def collate(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    rows = rows[self._local(self.rows)]
    width = {'inputs': self.length if self.has_source else 0, 'targets': self.length}
    batch = {key: np.full((len(rows), width[key.split('_')[0]]), PAD_ID, np.int32) for key in (
        'inputs', 'targets', 'inputs_positions', 'targets_positions', 'inputs_segments',
        'targets_segments')}
    row_ids, slot = np.nonzero(rows >= 0)
    examples = rows[row_ids, slot]
    for side in ('inputs', 'targets'):
      ragged = getattr(self.split, side)
      lengths = ragged.lengths[rows.clip(0)] * (rows >= 0)
      columns = (np.cumsum(lengths, axis=1) - lengths)[row_ids, slot]
      token_rows, positions = _gather(ragged, examples, row_ids, columns, batch[side])
      token_columns = np.repeat(columns, ragged.lengths[examples]) + positions
      batch[f'{side}_positions'][token_rows, token_columns] = positions
      batch[f'{side}_segments'][token_rows, token_columns] = np.repeat(
          slot + 1, ragged.lengths[examples])
    return batch

  def epoch_length(self, epoch: int) -> int:
    return len(self.plan(epoch))

  def __len__(self):  # Packing differs slightly per epoch; this is epoch 0's count.
    return self.epoch_length(0)

  def get(self, epoch: int, position: int) -> dict[str, np.ndarray]:
    return self.collate(self.plan(epoch)[position])


class _EpochView:
  """One epoch's batches, indexable for grain."""

  def __init__(self, batches, epoch: int):
    self.batches, self.epoch = batches, epoch
    self.length = batches.epoch_length(epoch)

  def __len__(self):
    return self.length

  def __getitem__(self, position: int):
    return self.batches.get(self.epoch, position)


class TrainIterator:
  """Endless training batches, prefetched by grain; `get_state`/`set_state` for checkpoints."""

  def __init__(self, batches, prefetch: int = 2):
    self.batches, self.prefetch = batches, prefetch
    self._start(0, 0)

  def _start(self, epoch: int, position: int) -> None:
    self.epoch, self.position = epoch, position
    dataset = grain.MapDataset.source(_EpochView(self.batches, epoch))[position:]
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch)
    self._iterator = iter(dataset.to_iter_dataset(options))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.position >= self.batches.epoch_length(self.epoch):
      self._start(self.epoch + 1, 0)
    batch = next(self._iterator)
    self.position += 1
    return batch

  def get_state(self) -> dict:
    return {'epoch': self.epoch, 'batch': self.position, 'plan': self.batches.signature()}

  def set_state(self, state: dict) -> None:
    if set(state) != {'epoch', 'batch', 'plan'}:
      raise DataError(f'the checkpoint holds a data iterator state {state} of another format; '
                      'start from a new workdir')
    if state['plan'] != self.batches.signature():
      raise DataError(
          'the checkpoint was saved by a data pipeline with another global plan (data, seed, '
          'batching mode, batch_tokens, bucket or pack shapes, or row multiple differ), so '
          'resuming would repeat or skip examples: restore the data config it was saved with '
          '(a checkpoint from before t2t_jax recorded its row multiple also needs the mesh batch '
          'shards x opt.grad_accum_steps it was saved with), or start from a new workdir')
    self._start(state['epoch'], state['batch'])


def train_iterator(batches, prefetch: int = 2) -> TrainIterator:
  """An endless, checkpointable iterator (`get_state`/`set_state`) over training batches."""
  return TrainIterator(batches, prefetch)


def eval_batches(batches: TokenBudgetBatches, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """One pass over the evaluation batches (all of them when `limit` is 0)."""
  count = len(batches) if limit <= 0 else min(limit, len(batches))
  for index in range(count):
    yield batches[index]


def plan_row_multiple(config, batch_shards: int) -> int:
  """The row multiple of a new run's train plan: config.data.row_multiple, or (0) the batch
  shards x micro-batches it starts on, so that every micro-batch splits over the shards."""
  return config.data.row_multiple or batch_shards * config.opt.grad_accum_steps


def make_batchers(config, train_split, eval_split, row_multiple: int, process_index: int = 0,
                  process_count: int = 1, train_row_multiple: int = 0) -> tuple:
  """(train, eval) batchers from `config.data`; evaluation always uses length buckets.

  `row_multiple`: the batch shards, which split each eval batch; `train_row_multiple`: the
  train plan's (default: `plan_row_multiple`; a resumed run passes its saved one).
  """
  data_config = config.data
  if data_config.batching not in BATCHING_MODES:
    raise ConfigError(f'config.data.batching must be one of {BATCHING_MODES}, '
                      f'got {data_config.batching!r}')
  boundaries = bucket_boundaries(data_config.max_len, data_config.min_bucket,
                                 data_config.bucket_scale)
  shard = dict(process_index=process_index, process_count=process_count)
  multiple = train_row_multiple or plan_row_multiple(config, row_multiple)
  problem = split_problem(train_rows(data_config, multiple), row_multiple,
                          config.opt.grad_accum_steps, process_count)
  if problem:
    raise ConfigError(problem)
  if data_config.batching == 'buckets':
    train = TokenBudgetBatches(train_split, data_config.batch_tokens, boundaries, multiple,
                               shuffle=True, seed=config.seed, **shard)
  else:
    train = PackedBatches(train_split, data_config.batch_tokens, pack_length(data_config),
                          multiple, shuffle=True, seed=config.seed, **shard)
  evaluation = TokenBudgetBatches(eval_split, data_config.batch_tokens, boundaries, row_multiple,
                                  shuffle=False, seed=config.seed, **shard)
  return train, evaluation


def pack_length(data_config) -> int:
  """Length of a packed row: config.data.pack_length, or max_len when that is 0."""
  return data_config.pack_length or data_config.max_len
