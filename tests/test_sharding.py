"""Meshes give the same training, weights are split as the rules say, accumulation and bf16."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from conftest import GRADIENT_NOISE, assert_adam_runs_agree
from t2t_jax import sharding
from t2t_jax.data import pipeline as data
from t2t_jax.model import transformer
from t2t_jax.training import train

STEPS = 4


def _batches(config, count, rows=32):
  """`count` fixed training batches of `rows` rows, the same whatever the mesh."""
  task = data.load(config, '')
  batches = data.TokenBudgetBatches(task.train, rows * 16, [16], rows, shuffle=True, seed=0)
  return [batches[i] for i in range(count)]


def _losses(config, batches, devices=None, mesh_shape=None):
  """Per-step losses, the final parameters and state, and (params, opt_state) on the host after
  each of `len(batches)` steps on the given mesh."""
  if mesh_shape:
    config.mesh.shape = mesh_shape
  mesh = sharding.make_mesh(config.mesh, devices)
  setup = train.build(config, data.vocab_size(config), mesh)
  state = setup.init(jax.random.PRNGKey(0))
  losses, history = [], []
  for batch in batches:
    state, metrics = setup.train_step(state, sharding.global_batch(batch, mesh),
                                      jax.random.PRNGKey(1))
    losses.append(float(metrics['loss'] / metrics['weight']))
    history.append(jax.device_get((state.params, state.opt_state)))
  return np.array(losses), jax.device_get(state.params), state, history


def _config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.model.dropout = 0.0  # Dropout masks depend on how the batch is split.
  config.model.attention_dropout = 0.0
  config.model.relu_dropout = 0.0
  config.opt.schedule = 'constant'
  config.opt.lr_scale = LR
  return config


LR = 3e-3


@pytest.fixture
def config():
  return _config()


@pytest.fixture(scope='module')
def reference():
  """Losses, parameters and per-step states on one device: what every mesh must reproduce
  (computed once for the module)."""
  config = _config()
  batches = _batches(config, STEPS)
  losses, params, _, history = _losses(config, batches, jax.devices()[:1], (1, 1, 1))
  return batches, losses, params, history


@pytest.mark.slow
@pytest.mark.parametrize('mesh_shape', [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_meshes_give_the_single_device_trajectory(config, reference, mesh_shape):
  batches, expected_losses, _, expected_history = reference
  losses, _, _, history = _losses(config, batches, mesh_shape=mesh_shape)
  assert expected_losses[-1] < expected_losses[0]  # It trains, so the comparison means something.
  np.testing.assert_allclose(losses, expected_losses, rtol=2e-5)
  # Weights after 4 Adam steps: within what rounding can move them (conftest.py, GRADIENT_NOISE).
  assert_adam_runs_agree(history, expected_history, [LR] * STEPS)


def _expected_fraction(path, mesh):
  """The share of a weight one device holds, from the model's layout and the base rules."""
  name = '/'.join(str(getattr(k, 'key', k)) for k in path)
  fsdp, tensor = mesh.shape['fsdp'], mesh.shape['tensor']
  if name.endswith(('query', 'key', 'value', 'out')):  # (embed, heads, kv) / (heads, kv, embed)
    return 1 / (fsdp * tensor)
  if name.endswith('wi/kernel') or name.endswith('wo/kernel'):  # (embed, mlp) / (mlp, embed)
    return 1 / (fsdp * tensor)
  if name.endswith('wi/bias'):  # (mlp,)
    return 1 / tensor
  if name.endswith(('wo/bias', 'scale', 'norm/bias')):  # (embed,)
    return 1 / fsdp
  if name.endswith('embedding'):  # (vocab, embed)
    return 1 / (fsdp * tensor)
  raise AssertionError(f'no expectation for {name}')


@pytest.mark.parametrize('mesh_shape', [(2, 2, 2), (1, 4, 2), (1, 8, 1)])
def test_each_device_holds_its_fraction_of_each_weight(config, mesh_shape):
  config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 4
  config.data.num_symbols = 14  # 16 ids with pad and EOS: divisible by the axes.
  config.mesh.shape = mesh_shape
  mesh = sharding.make_mesh(config.mesh)
  setup = train.build(config, data.vocab_size(config), mesh)
  state = setup.init(jax.random.PRNGKey(0))

  def check(path, param, *moments):
    expected = _expected_fraction(path, mesh)
    for array in (param,) + moments:
      for shard in array.addressable_shards:
        assert shard.data.size == pytest.approx(array.size * expected), jax.tree_util.keystr(path)

  adam = state.opt_state[0]
  jax.tree_util.tree_map_with_path(check, state.params, adam.mu, adam.nu)
  devices_per_weight = {len({str(s.index) for s in p.addressable_shards})
                        for p in jax.tree.leaves(state.params)}
  assert max(devices_per_weight) == mesh.shape['fsdp'] * mesh.shape['tensor']


def test_batch_that_does_not_divide_the_batch_axes_is_refused(config):
  config.mesh.shape = (2, 4, 1)
  mesh = sharding.make_mesh(config.mesh)
  batch = {'inputs': np.ones((12, 16), np.int32), 'targets': np.ones((12, 16), np.int32)}
  with pytest.raises(ValueError, match=r"batch field 'inputs' has 12 rows, which do not divide "
                                       r'into 8 equal parts \(data=2 x fsdp=4\)'):
    sharding.global_batch(batch, mesh)


def test_weight_that_does_not_divide_its_axes_is_refused(config):
  config.data.num_symbols = 13  # A vocabulary of 15 cannot split over tensor=2.
  config.mesh.shape = (2, 2, 2)
  with pytest.raises(ValueError, match=r"\['embedding'\]\['embedding'\] of shape \(15, 32\): "
                                       r"dimension 0 \(logical axis 'vocab'\) has size 15, which "
                                       r"does not split 2 ways over mesh axes \('tensor',\)"):
    train.build(config, data.vocab_size(config))


def test_accumulation_rows_must_divide(config):
  config.opt.grad_accum_steps = 3
  setup = train.build(config, data.vocab_size(config))
  state = setup.init(jax.random.PRNGKey(0))
  batch = sharding.global_batch(_batches(config, 1, rows=32)[0], setup.mesh)
  with pytest.raises(ValueError, match=r'32 rows, which do not split into '
                                       r'config.opt.grad_accum_steps=3'):
    setup.train_step(state, batch, jax.random.PRNGKey(1))


def test_dcn_slices_must_match_the_processes(config):
  config.mesh.shape = (4, 2, 1)
  config.mesh.dcn_data = 2
  with pytest.raises(ValueError, match=r'dcn_data=2 slices were asked for, but the devices form '
                                       r'1 \(processes\)'):
    sharding.make_mesh(config.mesh)
  config.mesh.dcn_data = 3
  with pytest.raises(ValueError, match=r'dcn_data=3 must be a positive divisor of the data axis'):
    sharding.make_mesh(config.mesh)


@pytest.mark.slow
def test_accumulating_four_micro_batches_matches_one_batch(config, reference):
  batches, expected_losses, _, expected_history = reference
  config.opt.grad_accum_steps = 4
  losses, _, _, history = _losses(config, batches, mesh_shape=(8, 1, 1))
  np.testing.assert_allclose(losses, expected_losses, rtol=2e-5)
  assert_adam_runs_agree(history, expected_history, [LR] * STEPS)


@pytest.mark.slow
def test_accumulation_normalises_by_the_tokens_of_the_whole_batch(config):
  """Micro-batches with very different token counts: a per-micro-batch mean would differ."""
  batch = _batches(config, 1)[0]
  batch['targets'][::2, 2:] = 0  # Even rows (micro-batches 0 and 2) keep 2 target tokens.
  config.opt.schedule = 'constant'
  grads = {}
  for accumulation in (1, 4):
    config.opt.grad_accum_steps = accumulation
    setup = train.build(config, data.vocab_size(config))
    state = setup.init(jax.random.PRNGKey(0))
    new_state, _ = setup.train_step(state, sharding.global_batch(batch, setup.mesh),
                                    jax.random.PRNGKey(1))
    # Adam's first step moves each weight by about lr * sign(gradient): compare the moments.
    grads[accumulation] = jax.device_get(new_state.opt_state[0].mu)
  # First step from the same weights: the gradients agree to float32 summation noise.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=GRADIENT_NOISE * np.abs(b).max()), grads[1], grads[4])


@pytest.mark.slow
def test_bfloat16_computes_in_bf16_with_float32_state_and_close_loss(config, reference):
  batches, expected_losses, _, _ = reference
  config.model.dtype = 'bfloat16'
  losses, params, state, _ = _losses(config, batches, mesh_shape=(8, 1, 1))
  assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype('float32')}
  assert {m.dtype for m in jax.tree.leaves(state.opt_state[0].mu)} == {np.dtype('float32')}
  np.testing.assert_allclose(losses, expected_losses, rtol=2e-2)
  assert not np.allclose(losses, expected_losses, rtol=1e-6)  # It did compute differently.
  setup = train.build(config, data.vocab_size(config))
  hlo = setup.train_step.lower(setup.abstract_state, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(
          setup.mesh)), batches[0]), jax.ShapeDtypeStruct((2,), jnp.uint32)).as_text()
  matmuls = [line for line in hlo.splitlines() if 'dot_general' in line]
  assert matmuls and sum('bf16' in line for line in matmuls) > 0.8 * len(matmuls)


@pytest.mark.parametrize('mesh_shape', [(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 4, 2)])
def test_embedding_lookup_by_columns_equals_the_whole_table_lookup(config, mesh_shape):
  """model.Embed under a mesh: where 'embed' splits the table over axes that also split the
  batch (and 'vocab' is whole), each device looks up its columns for its column sharers' tokens
  and an all-to-all hands the rows over (no gather of the [vocab, width] table); elsewhere the
  table is read whole. Rows and the table's gradient equal the meshless lookup's."""
  vocab, width, rows, length = 54, 32, 16, 6
  embed = transformer.Embed(vocab, width, dtype=jnp.float32, embedding_init=(
      nn.with_logical_partitioning(nn.initializers.normal(1.0), ('vocab', 'embed'))))
  ids = jax.random.randint(jax.random.PRNGKey(1), (rows, length), 0, vocab)
  params = nn.unbox(embed.init(jax.random.PRNGKey(0), ids))
  cotangent = jax.random.normal(jax.random.PRNGKey(2), (rows, length, width))
  loss = lambda p, i: jnp.sum(embed.apply(p, i) * cotangent)
  expected_rows, expected_grad = embed.apply(params, ids), jax.grad(loss)(params, ids)
  config.mesh.shape = mesh_shape
  mesh = sharding.make_mesh(config.mesh)
  with sharding.mesh_context(mesh, sharding.rules(config.mesh)):
    table_split = nn.logical_to_mesh_axes(('vocab', 'embed'))
    params = jax.device_put(params, NamedSharding(mesh, P(*table_split)))
    ids = jax.device_put(ids, NamedSharding(mesh, P(nn.logical_to_mesh_axes(('batch',))[0])))
    got_rows = jax.jit(embed.apply)(params, ids)
    got_grad = jax.jit(jax.grad(loss))(params, ids)
    hlo = jax.jit(embed.apply).lower(params, ids).compile().as_text()
  np.testing.assert_array_equal(got_rows, expected_rows)  # A lookup moves values exactly.
  # Rows met by several tokens add up in another order: float32 rounding only.
  np.testing.assert_allclose(got_grad['params']['embedding'],
                             expected_grad['params']['embedding'], rtol=1e-6, atol=1e-5)
  by_columns = mesh_shape[2] == 1  # 'vocab' maps to 'tensor': split at (1, 4, 2).
  assert ('all-to-all' in hlo) == by_columns
  # The table (or its 'vocab' shards) gathered across its 'embed' split: [rows, width] results.
  table_gathered = re.search(rf'\[\d+,{width}\][^\n]*all-gather', hlo) is not None
  assert table_gathered != by_columns, mesh_shape


def test_split_over_data_takes_the_first_dimension_that_splits_evenly():
  mesh = jax.make_mesh((4, 2, 1, 1), sharding.MESH_AXES)
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  cases = [  # (spec, shape, expected spec)
      (P('fsdp', None, None), shape(512, 8, 64), P(('fsdp', 'data'), None, None)),
      (P(None, 'fsdp'), shape(6, 8), P(None, ('fsdp', 'data'))),  # 6 rows: not 4 ways.
      (P(), shape(6, 8), P(None, 'data')),
      (P('fsdp'), shape(12), P('fsdp')),  # 6 per fsdp shard: not 4 ways again.
      (P(), shape(3, 5), P()),  # Nothing divides: unchanged.
      (P(), shape(), P()),  # Adam's step count.
      (P('data', None), shape(8, 8), P('data', None)),  # Already split over data.
  ]
  for spec, leaf, expected in cases:
    got = sharding.split_over_data(NamedSharding(mesh, spec), leaf, mesh)
    assert got.spec == expected, (spec, leaf.shape, got.spec)
  alone = jax.make_mesh((1, 8, 1, 1), sharding.MESH_AXES)  # data=1: nothing to split over.
  assert sharding.split_over_data(NamedSharding(alone, P()), shape(8, 8), alone).spec == P()


def _optimiser_bytes(setup, batch) -> float:
  """HBM bytes per device of the compiled step's kernels under the 'optimizer' scope."""
  from t2t_jax.compile import hlo_cost  # pylint: disable=g-import-not-at-top
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding.batch_sharding(setup.mesh)), batch)
  text = setup.train_step.lower(setup.abstract_state, shapes,
                                jax.ShapeDtypeStruct((2,), jnp.uint32)).compile().as_text()
  cost = hlo_cost.analyse(text, setup.mesh.size)
  return sum(k.bytes_by_part().get('optimiser', 0.0) * k.count for k in cost.kernels)


@pytest.mark.slow
def test_update_split_over_data_trains_the_same_with_a_data_th_of_the_optimiser(config,
                                                                                  reference):
  """mesh.shard_update on (4, 2, 1), with and without accumulation: the single-device
  trajectory; Adam's moments and the moving average held a quarter as much per device as
  without it, the parameters as before;
  the compiled update moves under 0.4 times the bytes it moves without it."""
  batches, expected_losses, _, expected_history = reference
  config.opt.ema_decay = 0.9
  runs, optimiser_bytes = {}, {}
  for split in (False, True):
    config.mesh.shard_update = split
    runs[split] = _losses(config, batches, mesh_shape=(4, 2, 1))
    setup = train.build(config, data.vocab_size(config))
    optimiser_bytes[split] = _optimiser_bytes(setup, batches[0])
  losses, _, state, history = runs[True]
  np.testing.assert_allclose(losses, expected_losses, rtol=2e-5)
  assert_adam_runs_agree(history, expected_history, [LR] * STEPS)
  _, _, unsplit_state, unsplit_history = runs[False]
  # Against the same mesh without it: the same sums, reduced in another order at most.
  for got, expected in zip(jax.tree.leaves((history[-1], jax.device_get(state.ema))),
                           jax.tree.leaves((unsplit_history[-1],
                                            jax.device_get(unsplit_state.ema)))):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

  def per_device(tree):
    return sum(a.addressable_shards[0].data.size for a in jax.tree.leaves(tree))
  adam = state.opt_state[0]
  for split_tree, whole_tree in ((adam.mu, unsplit_state.opt_state[0].mu),
                                 (adam.nu, unsplit_state.opt_state[0].nu),
                                 (state.ema, unsplit_state.ema)):
    assert per_device(split_tree) == pytest.approx(per_device(whole_tree) / 4, rel=0.02)
  assert per_device(state.params) == per_device(unsplit_state.params)
  # Accumulating: each micro-batch's gradients scattered to the split, their sum kept there.
  config.opt.grad_accum_steps = 2
  accumulated = _losses(config, batches, mesh_shape=(4, 2, 1))[3]
  assert_adam_runs_agree(accumulated, expected_history, [LR] * STEPS)
  # Near a quarter (without the split: the whole update on every device).
  assert 0 < optimiser_bytes[True] < 0.4 * optimiser_bytes[False], optimiser_bytes
