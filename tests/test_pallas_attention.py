"""Splash attention ('pallas', in the Pallas interpreter on CPU) equals the einsum path: padded,
packed, causal and cross-attention rows, forward and gradients, alone, in the model and sharded."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import adam_moments
from conftest import assert_cached_decoding_matches_teacher_forcing
from conftest import assert_close_to_scale
from conftest import attention_inputs
from conftest import quick_jit
from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.model import attention
from t2t_jax.model import attention_variants
from t2t_jax.model import flash_attention
from t2t_jax.model import model_config
from t2t_jax.model import pallas_attention
from t2t_jax.model.decoder_only import make_model
from t2t_jax.training import build as setup_lib

# Both paths compute in float32 from the same inputs and differ only in rounding (unit
# roundoff u = 2^-24 = 6e-8). An output is a weighted mean of unit values; its weights come
# from logits of D products (scaled queries, unit keys: |logit| ~ 1), and the kernel's online
# softmax rescales its running sums once per block of keys: each weight is off by a few u,
# and the outputs by a few u of their scale (measured at most 2.9e-7 over the cases below).
# The gradients go through dS = P (dO.v - dO.o), a difference of two D-term dot products of
# size ~sqrt(D) that nearly cancel, so their rounding, ~D u relative, is left over in dS; the
# key gradient sums Q such terms and is the worst: measured 5.7e-6 of its scale (300 keys,
# D = 64), the query and value gradients at most 1.8e-6. The tolerances keep a margin of
# about 10 over these maxima; a wrong mask (one key seen or not) moves outputs by 1e-2 of
# their scale and more.
OUTPUT_TOLERANCE = 3e-6
GRADIENT_TOLERANCE = 5e-5
# Through the tiny models (attention layers with projections and layer norms around them)
# and the sharded step the same roundings, relative to each array's scale: measured at most
# 8.7e-7 over their logits, loss gradients and Adam moments; a margin of about 10 again.
MODEL_TOLERANCE = 8e-6


# The two Pallas kernels behind attention_impl: splash attention ('pallas') and t2t_jax's flash
# kernels ('flash', here without dropout: test_flash_attention.py has it). Both take the rows
# as SplashRows and must give the einsum path's arithmetic.
KERNELS = {'pallas': pallas_attention.splash_attention,
           'flash': lambda q, k, v, rows: flash_attention.flash_attention(q, k, v, rows)}
IMPLS = pytest.mark.parametrize('impl', list(KERNELS))


def _outputs_and_grads(attend, q, k, v, weights_BQ):
  """The attention output and the gradients w.r.t. q, k, v of a random linear function of
  the outputs at the rows `weights_BQ` selects (the outputs the model uses)."""
  probe = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  probe = probe * jnp.asarray(weights_BQ, jnp.float32)[:, :, None, None]
  loss = lambda q, k, v: (attend(q, k, v) * probe).sum()
  return attend(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _compare(q, k, v, mask_B1QK, rows, used_BQ, impl):
  """The `impl` kernel under `rows` against the einsum path under `mask_B1QK`: equal outputs
  at the used queries, finite everywhere, and equal gradients."""
  einsum = lambda q, k, v: attention_variants.dense_attention(q, k, v, mask_B1QK,
                                                              lambda w: w)[0]
  splash = lambda q, k, v: KERNELS[impl](q, k, v, rows)
  # Each path one program, its forward and backward passes together (eagerly, the einsum
  # path's operations would compile one by one).
  expected = quick_jit(functools.partial(_outputs_and_grads, einsum))(q, k, v, used_BQ)
  actual = quick_jit(functools.partial(_outputs_and_grads, splash))(q, k, v, used_BQ)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(actual))
  assert_close_to_scale(actual[0], expected[0], OUTPUT_TOLERANCE, np.asarray(used_BQ))
  assert_close_to_scale(actual[1], expected[1], GRADIENT_TOLERANCE)
  return actual, expected


def _valid(lengths, length):
  return jnp.arange(length)[None] < jnp.asarray(lengths)[:, None]


def _packed_segments(layout, length):
  """Segment ids [B, L] from each row's segment lengths, the rest padding (0)."""
  rows = [sum(([s + 1] * n for s, n in enumerate(row)), []) for row in layout]
  return jnp.asarray([row + [0] * (length - len(row)) for row in rows], jnp.int32)


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('length, head_dim', [(40, 32), (300, 64), (128, 16)])
@IMPLS
def test_padded_self_attention_equals_einsum(length, head_dim, causal, impl):
  """Bucketed rows of different lengths; lengths off and on the 128-key block, several
  blocks, head sizes of the tiny configs and of Transformer-base."""
  lengths = [length, length // 3, 1, 0]  # 0: a row of padding only.
  valid_BL = _valid(lengths, length)
  q, k, v = attention_inputs(len(lengths), length, length, 2, head_dim)
  mask_B1QK = attention.attention_mask(valid_BL, causal=causal)
  rows = pallas_attention.self_rows(valid_BL, None, causal)
  # Padding queries see the real keys as in the einsum path: their outputs compare too, but
  # for the empty row's, which see its padding keys here, uniformly weighted there (unused).
  _compare(q, k, v, mask_B1QK, rows, jnp.broadcast_to(valid_BL.any(-1, keepdims=True),
                                                       valid_BL.shape), impl)


@pytest.mark.parametrize('causal', [False, True])
@IMPLS
def test_packed_self_attention_equals_einsum_at_real_tokens(causal, impl):
  length = 150  # Two blocks of 128 keys, a segment across their border.
  segments_BL = _packed_segments([[60, 70, 5], [1, 140], [150]], length)
  valid_BL = segments_BL > 0
  q, k, v = attention_inputs(3, length, length, 2, 32)
  mask_B1QK = attention.attention_mask(valid_BL, segments_BL, segments_BL, causal=causal)
  rows = pallas_attention.self_rows(valid_BL, segments_BL, causal)
  # Padding queries (segment 0) see other keys than in the einsum path; their output is unused.
  _, expected = _compare(q, k, v, mask_B1QK, rows, valid_BL, impl)
  # Without the segments each token would see its neighbours' tokens too: far off.
  unsegmented = pallas_attention.self_rows(valid_BL, None, causal)
  wrong = KERNELS[impl](q, k, v, unsegmented)
  error = np.abs(np.asarray(wrong - expected[0])[np.asarray(valid_BL)]).max()
  assert error > 1000 * OUTPUT_TOLERANCE * np.abs(expected[0]).max()


@IMPLS
def test_cross_attention_over_padded_sources_equals_einsum(impl):
  queries, keys = 24, 140  # Targets and sources of other lengths.
  valid_BK = _valid([140, 30, 1], keys)
  q, k, v = attention_inputs(3, queries, keys, 4, 64)
  mask_B1QK = attention.attention_mask(valid_BK)
  rows = pallas_attention.cross_rows(mask_B1QK, queries)
  _compare(q, k, v, mask_B1QK, rows, jnp.ones((3, queries), bool), impl)


@pytest.mark.parametrize('source_layout', [[[20, 30, 9], [59]], [[20, 39, 1], [60]]])
@IMPLS
def test_packed_cross_attention_equals_einsum_at_real_targets(source_layout, impl):
  """Each target segment sees its own source segment; the ids come from the mask. The second
  layout fills the source rows: no padding key for the padding queries to see."""
  queries, keys = 30, 60
  target_segments_BQ = _packed_segments([[10, 12, 3], [25]], queries)
  source_segments_BK = _packed_segments(source_layout, keys)
  q, k, v = attention_inputs(2, queries, keys, 2, 32, seed=3)
  mask_B1QK = attention.attention_mask(source_segments_BK > 0, target_segments_BQ,
                                       source_segments_BK)
  rows = pallas_attention.cross_rows(mask_B1QK, queries)
  _compare(q, k, v, mask_B1QK, rows, target_segments_BQ > 0, impl)


def test_segment_ids_from_the_packed_cross_mask_give_the_same_mask():
  target_segments_BQ = _packed_segments([[3, 4, 2, 1], [6], [2, 2]], 12)
  source_segments_BK = _packed_segments([[5, 1, 2, 4], [9], [3, 3]], 14)
  mask_BQK = attention.attention_mask(source_segments_BK > 0, target_segments_BQ,
                                      source_segments_BK)[:, 0]
  rows = pallas_attention.cross_rows(mask_BQK[:, None], 12)
  implied_BQK = rows.query_ids_BQ[:, :, None] == rows.key_ids_BK[:, None, :]
  real_BQ = target_segments_BQ > 0
  np.testing.assert_array_equal(implied_BQK[real_BQ], mask_BQK[real_BQ])
  assert implied_BQK.any(-1).all()  # Padding queries too see some key.


def _config_with(tiny_config, impl, **overrides):
  """The tiny config with `impl` attention, no attention dropout, and `overrides` (model keys)."""
  tiny_config.model.attention_dropout = 0.0
  tiny_config.model.attention_impl = impl
  for key, value in overrides.items():
    setattr(tiny_config.model, key, value)
  return tiny_config


def _tiny(tiny_config, impl, **overrides):
  return model_config.TransformerConfig.from_config(
      _config_with(tiny_config, impl, **overrides).model, 16, platform='cpu', deterministic=True)


def _model_batches():
  """A bucketed batch (rows of different lengths) and a packed one (positions, segments)."""
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, 16, (4, 12)).astype(np.int32)
  targets = rng.integers(2, 16, (4, 10)).astype(np.int32)
  inputs[0, 7:], inputs[1, 3:], targets[0, 4:], targets[2, 8:] = 0, 0, 0, 0
  # The last row's sources fill it while its targets end in padding.
  segments = [np.asarray(_packed_segments(layout, length)) for layout, length in (
      ([[5, 6], [12], [3, 3, 3], [6, 6]], 12), ([[4, 5], [10], [2, 3, 1], [3, 2]], 10))]
  tokens = [np.where(s > 0, rng.integers(2, 16, s.shape), 0).astype(np.int32) for s in segments]
  positions = [np.where(s > 0, np.arange(s.shape[1]) - _segment_starts(s), 0).astype(np.int32)
               for s in segments]
  return {'padded': (inputs, targets), 'packed': (*tokens, *positions, *segments)}


def _segment_starts(segments_BL):
  return np.asarray([[list(row).index(s) for s in row] for row in segments_BL])


def _logits_and_grads(config, params, batch):
  model = make_model(config)

  def loss(params):
    logits = model.apply({'params': params}, *[jnp.asarray(x) for x in batch])
    return (jax.nn.log_softmax(logits).max(-1) * (batch[1] != 0)).sum(), logits

  return quick_jit(jax.grad(loss, has_aux=True))(params)[::-1]


def _einsum_and_pallas(tiny_config, impl='pallas', **overrides):
  """The tiny model's config with einsum and with `impl` attention, and its parameters."""
  einsum = _tiny(tiny_config, 'einsum', **overrides)
  pallas = dataclasses.replace(einsum, attention_impl=impl)
  assert _tiny(tiny_config, impl, **overrides) == pallas  # Accepted on cpu.
  tokens = jnp.ones((1, 4), jnp.int32)
  return einsum, pallas, make_model(einsum).init(jax.random.PRNGKey(0), tokens, tokens)['params']


# The decoder-only model joins source and target in one causal stack: causal and segments.
@pytest.mark.parametrize('model_kind', ['encoder_decoder', 'decoder_only'])
@pytest.mark.parametrize('kind', ['padded', 'packed'])
@IMPLS
def test_tiny_model_with_pallas_equals_einsum(tiny_config, kind, model_kind, impl):
  einsum, pallas, params = _einsum_and_pallas(tiny_config, impl, kind=model_kind)
  batch = _model_batches()[kind]
  expected = _logits_and_grads(einsum, params, batch)
  actual = _logits_and_grads(pallas, params, batch)
  used = batch[1] != 0  # Predicting padding: unused, and packed padding sees other keys.
  assert_close_to_scale(actual[0], expected[0], MODEL_TOLERANCE, used)
  assert_close_to_scale(actual[1], expected[1], MODEL_TOLERANCE)


@IMPLS
def test_cached_decoding_with_pallas_matches_its_teacher_forcing(tiny_config, impl):
  """Decode mode keeps XLA's attention (one query a step) and gives what the kernel does."""
  _, pallas, params = _einsum_and_pallas(tiny_config, impl)
  inputs, _ = _model_batches()['padded']  # Padded sources; every target token decodes.
  targets = np.random.default_rng(2).integers(2, 16, (4, 6)).astype(np.int32)
  assert_cached_decoding_matches_teacher_forcing(pallas, params, jnp.asarray(inputs),
                                                 jnp.asarray(targets))


@IMPLS
def test_one_sharded_train_step_with_pallas_equals_einsum(tiny_config, impl):
  """On a (2, 2, 2) mesh of the 8 CPU devices (rows split 4 ways, heads 2): one step's loss
  and gradients (Adam's first moments, (1 - b1) g) as einsum's."""
  tiny_config.mesh.shape = (2, 2, 2)
  tiny_config.model.dropout = tiny_config.model.relu_dropout = 0.0
  inputs, targets = _model_batches()['padded']
  batch = {'inputs': np.tile(inputs, (2, 1)), 'targets': np.tile(targets, (2, 1))}
  results = {}
  for name in ('einsum', impl):
    setup = setup_lib.build(_config_with(tiny_config, name), 16)
    assert setup.model_config.attention_impl == name
    state, metrics = setup.train_step(setup.init(jax.random.PRNGKey(0)),
                                      sharding.global_batch(batch, setup.mesh),
                                      jax.random.PRNGKey(1))
    results[name] = metrics['loss'], adam_moments(state.opt_state)[0]
  np.testing.assert_allclose(results[impl][0], results['einsum'][0], rtol=MODEL_TOLERANCE)
  assert_close_to_scale(results[impl][1], results['einsum'][1], MODEL_TOLERANCE)


@IMPLS
def test_the_kernel_runs_per_device_under_a_mesh(tiny_config, impl):
  """Under the mesh and its rules the kernel runs in a shard_map over 'batch' and 'heads'."""
  tiny_config.mesh.shape = (2, 2, 2)
  mesh = sharding.make_mesh(tiny_config.mesh)
  q, k, v = attention_inputs(4, 40, 40, 2, 32)
  rows = pallas_attention.self_rows(_valid([40, 3, 20, 9], 40), None, causal=True)
  attend = lambda q, k, v: KERNELS[impl](q, k, v, rows)
  with sharding.mesh_context(mesh, sharding.rules(tiny_config.mesh)):
    jaxpr = str(jax.make_jaxpr(attend)(q, k, v))
    sharded = jax.jit(attend)(q, k, v)
  assert 'shard_map' in jaxpr and "'data', 'fsdp'" in jaxpr and "'tensor'" in jaxpr, jaxpr
  np.testing.assert_allclose(sharded, attend(q, k, v), atol=1e-6)


@pytest.mark.parametrize('overrides, message', [
    ({'positions': 'alibi'}, "attention_impl='{impl}' .*config.model.positions='alibi'"),
    ({'positions': 'relative'}, "attention_impl='{impl}' .*config.model.positions='relative'"),
    ({'attention_pattern': 'local'}, "attention_impl='{impl}' .*runs 'full' attention only"),
    ({'kind': 'decoder_only', 'prefix_attention': 'full'},
     "attention_impl='{impl}' .*config.model.prefix_attention='full'"),
])
@IMPLS
def test_pallas_refuses_what_it_cannot_compute(tiny_config, overrides, message, impl):
  with pytest.raises(ConfigError, match=message.format(impl=impl)):
    _tiny(tiny_config, impl, **overrides)


def test_splash_refuses_attention_dropout(tiny_config):
  """Splash attention has no dropout on the weights (the flash kernels have)."""
  with pytest.raises(ConfigError, match='config.model.attention_dropout=0.1 is not 0'):
    _tiny(tiny_config, 'pallas', attention_dropout=0.1)


def test_pallas_is_refused_on_gpu_and_accepted_on_tpu_and_cpu(caplog):
  with pytest.raises(ConfigError, match="config.model.attention_impl='pallas' .*use 'cudnn' "
                     "or 'xla'"):
    model_config.resolve_attention_impl('pallas', jnp.bfloat16, 64, 0.0, 'gpu')
  caplog.set_level('INFO')
  model_config._log_once.cache_clear()  # pylint: disable=protected-access
  for platform in ('tpu', 'cpu'):
    assert model_config.resolve_attention_impl('pallas', jnp.bfloat16, 64, 0.0,
                                            platform) == 'pallas'
    assert ('Pallas interpreter' in caplog.text) == (platform == 'cpu')
  # 'auto' is unchanged: the default model keeps its einsum attention everywhere.
  assert {model_config.resolve_attention_impl('auto', jnp.bfloat16, 64, 0.0, platform)
          for platform in ('tpu', 'cpu', 'gpu')} == {'einsum'}
