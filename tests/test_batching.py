"""Batch plans: coverage per epoch across processes, packing, exact resume, packed attention."""

import jax
import numpy as np
import pytest

from t2t_jax.compile import dry_run as dry_run_lib
from t2t_jax.data import batching
from t2t_jax.data import pipeline
from t2t_jax.model.transformer import Transformer, TransformerConfig


def _split(count=300, longest=30, seed=0):
  """Pairs whose first token is the example's index + 2, so every row names its example."""
  rng = np.random.default_rng(seed)
  inputs, targets = [], []
  for index in range(count):
    body = rng.integers(2, 50, rng.integers(0, longest - 1))
    inputs.append(np.array([index + 2, *body, 1], np.int32))
    targets.append(np.array([index + 2, *rng.integers(2, 50, rng.integers(0, longest - 1)), 1],
                            np.int32))
  return pipeline.Split(inputs, targets, [], [])


def _batchers(mode, split, process_index=0, process_count=1, row_multiple=4, seed=5):
  if mode == 'buckets':
    return pipeline.TokenBudgetBatches(split, 512, pipeline.bucket_boundaries(32, 8, 1.5), row_multiple,
                                   shuffle=True, seed=seed, process_index=process_index,
                                   process_count=process_count)
  return pipeline.PackedBatches(split, 512, 32, row_multiple, shuffle=True, seed=seed,
                            process_index=process_index, process_count=process_count)


def _first_tokens(batch):
  """Example indices in a batch, read from the tokens themselves (segment starts)."""
  if 'inputs_positions' in batch:
    starts = (batch['inputs_positions'] == 0) & (batch['inputs_segments'] > 0)
  else:
    starts = np.zeros_like(batch['inputs'], bool)
    starts[:, 0] = batch['inputs'][:, 0] > 0
  return sorted((batch['inputs'][starts] - 2).tolist())


@pytest.mark.parametrize('mode', batching.BATCHING_MODES)
@pytest.mark.parametrize('process_count', [2, 4])
def test_processes_read_disjoint_parts_and_together_every_example_once(mode, process_count):
  split = _split()
  whole = _batchers(mode, split)
  shards = [_batchers(mode, split, p, process_count) for p in range(process_count)]
  for epoch in (0, 1):
    seen = []
    for position in range(whole.epoch_length(epoch)):
      local = [shard.get(epoch, position) for shard in shards]
      per_process = [_first_tokens(batch) for batch in local]
      assert per_process == [sorted(s.examples(epoch, position).tolist()) for s in shards]
      seen += [index for indices in per_process for index in indices]
      # The processes' rows, stacked, are exactly the single-process global batch.
      global_batch = whole.get(epoch, position)
      for key, value in global_batch.items():
        np.testing.assert_array_equal(np.concatenate([b[key] for b in local]), value)
    assert sorted(seen) == list(range(len(split)))  # Each example exactly once per epoch.
  assert [s.signature() for s in shards] == [whole.signature()] * process_count


def test_process_count_must_divide_rows():
  with pytest.raises(ValueError, match=r'3 processes cannot split batches of \[64, 32, 20, 16\] rows'):
    _batchers('buckets', _split(), 0, 3)


def test_packed_rows_hold_whole_examples_with_segments_and_positions():
  split = _split(count=200, longest=12)
  batches = _batchers('packed', split)
  packed_examples, used_rows = 0, 0
  for position in range(batches.epoch_length(0)):
    batch = batches.get(0, position)
    assert batch['inputs'].shape == (16, 32)  # 512 tokens / 32 per row.
    used_rows += int((batch['inputs'][:, 0] > 0).sum())
    for row in range(16):
      for side in ('inputs', 'targets'):
        segments = batch[f'{side}_segments'][row]
        ids = batch[side][row]
        assert ((segments > 0) == (ids > 0)).all()
        for segment in range(1, segments.max() + 1):
          columns = np.flatnonzero(segments == segment)
          assert (np.diff(columns) == 1).all()  # Contiguous, in order.
          np.testing.assert_array_equal(batch[f'{side}_positions'][row, columns],
                                        np.arange(len(columns)))
          example = ids[columns[0]] - 2
          np.testing.assert_array_equal(ids[columns], getattr(split, side)[example])
          packed_examples += side == 'inputs'
  assert packed_examples == len(split)
  fewest_rows = np.ceil(max(split.inputs.lengths.sum(), split.targets.lengths.sum()) / 32)
  assert fewest_rows <= used_rows <= 1.1 * fewest_rows  # One pair per row would need 200.
  assert batches.epoch_length(0) == np.ceil(used_rows / 16)  # Only the last batch has empty rows.


def test_packing_is_deterministic_and_reshuffled_each_epoch():
  split = _split()
  one, two = _batchers('packed', split), _batchers('packed', split)
  np.testing.assert_array_equal(one.plan(1)[0], two.plan(1)[0])
  assert not np.array_equal(one.plan(0)[0], one.plan(1)[0])


def test_pairs_longer_than_a_packed_row_are_refused():
  with pytest.raises(ValueError, match='config.data.pack_length must be at least'):
    pipeline.PackedBatches(_split(longest=40), 512, 32, 4, shuffle=True, seed=0)


@pytest.mark.parametrize('mode', batching.BATCHING_MODES)
def test_resume_after_n_batches_yields_the_same_next_batches(mode):
  split = _split(count=120)
  batches = _batchers(mode, split)
  iterator = pipeline.train_iterator(batches)
  for _ in range(batches.epoch_length(0) - 2):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(5)]  # Crosses into epoch 1.
  assert iterator.get_state()['epoch'] == 1
  # A new iterator (as after a restart), and one with the rows split over two processes.
  resumed = pipeline.train_iterator(_batchers(mode, split))
  resumed.set_state(state)
  halves = [pipeline.train_iterator(_batchers(mode, split, p, 2)) for p in range(2)]
  for half in halves:
    half.set_state(state)
  for want in expected:
    got = next(resumed)
    split_rows = [next(half) for half in halves]
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
      np.testing.assert_array_equal(np.concatenate([b[key] for b in split_rows]), want[key])


def test_resume_from_another_plan_is_refused():
  iterator = pipeline.train_iterator(_batchers('buckets', _split()))
  next(iterator)
  state = iterator.get_state()
  other = pipeline.train_iterator(_batchers('buckets', _split(), seed=6))
  with pytest.raises(pipeline.DataError, match='another global plan'):
    other.set_state(state)
  with pytest.raises(pipeline.DataError, match='another format'):
    other.set_state({'next_index': 3})


def test_packed_segments_never_attend_to_each_other():
  """Packed logits equal each example's own logits, and perturbing one leaves the other."""
  config = TransformerConfig(vocab_size=60, d_model=32, d_ff=64, num_heads=2,
                             num_encoder_layers=1, num_decoder_layers=1, max_len=32,
                             deterministic=True)
  model = Transformer(config)
  rng = np.random.default_rng(0)
  first = (rng.integers(2, 60, 7), rng.integers(2, 60, 6))
  second = (rng.integers(2, 60, 9), rng.integers(2, 60, 11))
  split = pipeline.Split([first[0], second[0]], [first[1], second[1]], [], [])
  batches = pipeline.PackedBatches(split, 32, 32, 1, shuffle=False, seed=0)
  batch = batches.get(0, 0)
  assert batch['inputs_segments'].max() == 2 and batch['inputs'].shape == (1, 32)
  keys = ('inputs', 'targets', 'inputs_positions', 'targets_positions', 'inputs_segments',
          'targets_segments')
  params = {'params': model.init(jax.random.PRNGKey(0), batch['inputs'],
                                batch['targets'])['params']}
  apply = jax.jit(model.apply)
  logits = lambda b: np.asarray(apply(params, *(b[k] for k in keys)))
  packed = logits(batch)
  segments = batch['targets_segments'][0]
  for segment, (source, target) in enumerate((first, second), start=1):
    alone = apply(params, source[None], target[None])
    np.testing.assert_allclose(packed[0, segments == segment], alone[0], atol=1e-5)
  changed = {k: v.copy() for k, v in batch.items()}
  for side in ('inputs', 'targets'):
    where = changed[f'{side}_segments'] == 2
    changed[side][where] = (changed[side][where] + 7) % 58 + 2
  other = logits(changed)
  np.testing.assert_allclose(other[0, segments == 1], packed[0, segments == 1], atol=1e-5)
  assert np.abs(other[0, segments == 2] - packed[0, segments == 2]).max() > 1e-3


@pytest.mark.slow
def test_packed_training_runs_and_resumes(tiny_config, tmp_path):
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  tiny_config.data.batching = 'packed'
  tiny_config.data.pack_length = 32
  tiny_config.train.num_steps = 4
  tiny_config.train.eval_every = 4
  tiny_config.ckpt.every = 2
  tiny_config.eval.bleu_sentences = 0
  assert dry_run_lib.dry_run(tiny_config)['batch_shape'] == [8, 32]
  results = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert results['step'] == 4 and np.isfinite(results['eval_loss'])
  tiny_config.train.num_steps = 6
  assert train.train_and_evaluate(tiny_config, str(tmp_path))['step'] == 6


@pytest.mark.parametrize('mode', batching.BATCHING_MODES)
def test_the_global_batches_do_not_depend_on_shards_processes_or_micro_batches(mode, tiny_config):
  """A plan of rows in multiples of 8, read by 8 shards in 1 process, 4 shards x 2 micro-batches
  in 2 processes, 2 shards in 2 processes and 1 shard x 8 micro-batches: the processes' rows,
  stacked, are the same global batches, bit for bit, in the same order, over two epochs."""
  tiny_config.data.batching = mode
  tiny_config.data.max_len = tiny_config.data.pack_length = 32
  tiny_config.data.batch_tokens = 512
  split = _split(count=120)

  def global_batches(shards, processes, accumulation):
    tiny_config.opt.grad_accum_steps = accumulation
    trains = [pipeline.make_batchers(tiny_config, split, split, shards, p, processes,
                                 train_row_multiple=8)[0] for p in range(processes)]
    assert len({train.signature() for train in trains}) == 1
    iterators = [pipeline.train_iterator(train) for train in trains]
    steps = 2 * trains[0].epoch_length(0) + 1  # Into the third epoch.
    return trains[0].signature(), [
        {key: np.concatenate([b[key] for b in local]) for key in local[0]}
        for local in ([next(it) for it in iterators] for _ in range(steps))]

  signature, expected = global_batches(8, 1, 1)
  for shards, processes, accumulation in ((4, 2, 2), (2, 2, 1), (1, 1, 8)):
    other_signature, batches = global_batches(shards, processes, accumulation)
    assert other_signature == signature
    assert len(batches) == len(expected)
    for batch, want in zip(batches, expected):
      assert batch.keys() == want.keys()
      for key in want:
        np.testing.assert_array_equal(batch[key], want[key])


def test_a_split_the_rows_do_not_allow_is_named_with_the_rows_and_the_parts():
  rows = [16, 8, 8]
  assert batching.split_problem(rows, 8, 1, 1) == ''
  assert batching.split_problem(rows, 4, 2, 2) == ''
  assert batching.split_problem(rows, 2, 2, 4) == ''  # 4 processes each collate 2 rows.
  assert batching.split_problem(rows, 16, 1, 1) == (
      'the train batches have [8, 16] rows (all multiples of 8), which 16 batch shards x 1 '
      'micro-batch cannot split evenly: 16 must divide 8')
  assert batching.split_problem([12, 24], 4, 2, 2).endswith('8 must divide 12')
  assert 'over 3 processes' in batching.split_problem([16], 1, 1, 3)
