"""The flash kernels' dropout (t2t_jax/model/flash_attention.py, its GPU kernels and
flash_attention_tpu.py's TPU ones, both in the Pallas interpreter): against the explicit
softmax(q k^T) v with the same masks, the masks' statistics, their independence of the mesh,
and the model with attention_impl='flash'. Without dropout the kernels are checked against
the einsum path beside splash attention, in test_pallas_attention.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close_to_scale
from conftest import attention_inputs
from conftest import quick_jit
from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.model import attention
from t2t_jax.model import flash_attention
from t2t_jax.model import flash_attention_tpu
from t2t_jax.model import flash_masks
from t2t_jax.model import model_config
from t2t_jax.model import pallas_attention
from t2t_jax.model.decoder_only import make_model

# As in test_pallas_attention.py (float32 rounding of the online softmax and of the backward's
# dS = P (dP - delta)): dropout scales the kept weights by 1 / (1 - rate), up to 1.4 here, which
# the margins of 10 there absorb.
OUTPUT_TOLERANCE = 3e-6
GRADIENT_TOLERANCE = 5e-5


def _explicit(q_BQHD, k_BKHD, v_BKHD, mask_B1QK, keep_BHQK, rate):
  """softmax(q k^T) v in float32 with the weights dropped where keep_BHQK is False."""
  logits_BHQK = jnp.einsum('BQHD,BKHD->BHQK', q_BQHD, k_BKHD)
  logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, flash_masks.MASKED)
  weights_BHQK = jax.nn.softmax(logits_BHQK, axis=-1)
  dropped_BHQK = jnp.where(keep_BHQK, weights_BHQK / (1.0 - rate), 0.0)
  return jnp.einsum('BHQK,BKHD->BQHD', dropped_BHQK, v_BKHD)


def _outputs_and_grads(attend, q, k, v):
  probe = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  loss = lambda q, k, v: (attend(q, k, v) * probe).sum()
  return attend(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _kernel_keys(keys: int, kernels: str) -> int:
  """The key length the kernels pad to (their masks' counter stride): whole blocks."""
  block = (flash_attention_tpu.block(keys) if kernels == 'mosaic'
           else flash_attention._block(keys, 64))  # pylint: disable=protected-access
  return -(-keys // block) * block


KERNELS = ('triton', 'mosaic')  # The GPU kernels and the TPU ones, in the interpreter here.


@pytest.mark.parametrize('kernels', KERNELS)
@pytest.mark.parametrize('causal, queries, keys, rate, seed', [
    (True, 40, 40, 0.1, 1234),           # The decoder's self-attention, one partial block.
    (True, 100, 100, 0.2, 3_000_000_000),  # GPU blocks: two each way; a seed above 2^31.
    (True, 300, 300, 0.2, 99),           # Several blocks each way: 5 x 64 (GPU), 3 x 128 (TPU).
    (False, 24, 300, 0.3, 1234),         # Cross-attention: other lengths, several key blocks.
    (False, 70, 70, 0.5, 77),
])
def test_dropout_equals_the_explicit_path_with_the_same_masks(causal, queries, keys, rate,
                                                              seed, kernels):
  """Outputs and gradients as softmax(q k^T) v with the weights that reference_keep drops
  dropped, over right-padded rows. (A row without real keys sees its padding keys here and
  none on the einsum path, an unused output: test_pallas_attention.py leaves it out too.)"""
  lengths = [keys, keys // 3, 1]
  valid_BK = jnp.arange(keys)[None] < jnp.asarray(lengths)[:, None]
  batch, heads = len(lengths), 2
  q, k, v = attention_inputs(batch, queries, keys, heads, 32)
  if causal:
    rows = pallas_attention.self_rows(valid_BK, None, causal=True)
    mask_B1QK = attention.attention_mask(valid_BK, causal=True)
  else:
    mask_B1QK = attention.attention_mask(valid_BK)
    rows = pallas_attention.cross_rows(mask_B1QK, queries)
  keep_BHQK = flash_masks.reference_keep(seed, batch, heads, queries,
                                         _kernel_keys(keys, kernels), rate)[..., :keys]
  kernel = lambda q, k, v, seed=seed: flash_attention.flash_attention(
      q, k, v, rows, rate, jnp.uint32(seed), kernels=kernels)
  explicit = lambda q, k, v: _explicit(q, k, v, mask_B1QK, keep_BHQK, rate)
  actual = quick_jit(functools.partial(_outputs_and_grads, kernel))(q, k, v)
  expected = quick_jit(functools.partial(_outputs_and_grads, explicit))(q, k, v)
  assert_close_to_scale(actual[0], expected[0], OUTPUT_TOLERANCE)
  assert_close_to_scale(actual[1], expected[1], GRADIENT_TOLERANCE)
  # Another seed draws other masks: the outputs move by far more than the tolerance.
  other = kernel(q, k, v, seed=seed + 1)
  assert np.abs(np.asarray(other - actual[0])).max() > 100 * OUTPUT_TOLERANCE


def test_the_masks_keep_each_weight_with_probability_one_minus_rate():
  """Over 4 rows x 4 heads x 128 x 128 = 262,144 draws per rate: the kept share within 5
  standard deviations of 1 - rate; neighbours along either axis, other heads and other seeds
  uncorrelated (their agreement that of independent draws, p^2 + (1 - p)^2, within 5 sd)."""
  for rate in (0.1, 0.3, 0.5):
    keep = np.asarray(flash_masks.reference_keep(7, 4, 4, 128, 128, rate))
    n, p = keep.size, 1.0 - rate
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n), (rate, keep.mean())
    agree = p * p + (1 - p) * (1 - p)
    other_seed = np.asarray(flash_masks.reference_keep(8, 4, 4, 128, 128, rate))
    # The seed enters the first round as an xor on the counter: without its second use, seed
    # 8's mask would be seed 7's with the keys permuted by k ^ 15.
    permuted = other_seed[..., np.arange(128) ^ (7 ^ 8)]
    for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[:, :, 1:], keep[:, :, :-1]),
                 (keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1]), (keep, other_seed),
                 (keep, permuted)):
      m = a.size
      assert abs((a == b).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / m), rate


@pytest.mark.parametrize('kernels', KERNELS)
def test_the_masks_do_not_depend_on_the_mesh(tiny_config, kernels):
  """Each device draws its rows' and heads' masks by their global indices: split 4 ways over
  rows and 2 over heads (2 rows and 2 heads a device), the outputs and gradients are the
  single device's."""
  tiny_config.mesh.shape = (2, 2, 2)
  mesh = sharding.make_mesh(tiny_config.mesh)
  q, k, v = attention_inputs(8, 40, 40, 4, 32)
  valid_BL = jnp.arange(40)[None] < jnp.asarray([40, 3, 20, 9, 1, 40, 17, 33])[:, None]
  rows = pallas_attention.self_rows(valid_BL, None, causal=True)
  attend = lambda q, k, v: flash_attention.flash_attention(q, k, v, rows, 0.3, jnp.uint32(5),
                                                           kernels=kernels)
  single = _outputs_and_grads(attend, q, k, v)
  with sharding.mesh_context(mesh, sharding.rules(tiny_config.mesh)):
    assert 'shard_map' in str(jax.make_jaxpr(attend)(q, k, v))
    sharded = jax.jit(functools.partial(_outputs_and_grads, attend))(q, k, v)
  assert_close_to_scale(sharded, single, 1e-6)


def _tiny_flash(tiny_config, deterministic):
  tiny_config.model.attention_impl = 'flash'
  tiny_config.model.attention_dropout = 0.3
  return model_config.TransformerConfig.from_config(tiny_config.model, 16, platform='cpu',
                                                    deterministic=deterministic)


def test_the_model_with_flash_attention_draws_dropout_from_its_key(tiny_config):
  """attention_impl='flash' keeps the config's attention dropout: in training the output
  depends on the dropout key, the same key gives the same output, and at evaluation there is
  none (the output equals the einsum model's)."""
  tiny_config.model.dropout = tiny_config.model.relu_dropout = 0.0
  train = _tiny_flash(tiny_config, deterministic=False)
  evaluate = _tiny_flash(tiny_config, deterministic=True)
  tiny_config.model.attention_impl = 'einsum'
  einsum = model_config.TransformerConfig.from_config(tiny_config.model, 16, platform='cpu',
                                                      deterministic=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 16, (2, 9)), jnp.int32)
  params = make_model(evaluate).init(jax.random.PRNGKey(0), tokens, tokens)['params']
  run = lambda config, key: make_model(config).apply(
      {'params': params}, tokens, tokens, rngs={'dropout': jax.random.PRNGKey(key)})
  np.testing.assert_array_equal(run(train, 1), run(train, 1))
  assert np.abs(np.asarray(run(train, 1) - run(train, 2))).max() > 1e-3
  np.testing.assert_allclose(run(evaluate, 1), run(einsum, 1), atol=1e-5)


@pytest.mark.parametrize('kernels', KERNELS)
def test_a_query_that_sees_no_key_gets_zero_and_no_gradient(kernels):
  """Packed rows can leave a query with no visible key (its id on no key): output 0, and
  nothing flows back from it into the keys and values."""
  q, k, v = attention_inputs(1, 16, 16, 1, 16)
  rows = pallas_attention.SplashRows(jnp.asarray([[1] * 8 + [-1] * 8], jnp.int32),
                                     jnp.ones((1, 16), jnp.int32), causal=False)
  attend = lambda q, k, v: flash_attention.flash_attention(q, k, v, rows, 0.2, jnp.uint32(3),
                                                           kernels=kernels)
  out = attend(q, k, v)
  assert np.all(np.asarray(out[0, 8:]) == 0) and np.all(np.isfinite(np.asarray(out)))
  seen_only = jax.grad(lambda k, v: attend(q, k, v)[0, :8].sum(), argnums=(0, 1))(k, v)
  every_query = jax.grad(lambda k, v: attend(q, k, v).sum(), argnums=(0, 1))(k, v)
  assert_close_to_scale(every_query, seen_only, 1e-6)


def test_flash_needs_a_power_of_two_head_size():
  for head in (8, 48, 80, 96):
    with pytest.raises(ConfigError, match=f'the head size {head} .*not a power of two'):
      model_config.resolve_attention_impl('flash', jnp.bfloat16, head, 0.1, 'gpu')


def test_flash_takes_dropout_on_every_platform():
  for platform in ('gpu', 'tpu', 'cpu'):
    assert model_config.resolve_attention_impl('flash', jnp.bfloat16, 64, 0.1,
                                               platform) == 'flash'
  # 'auto' stays einsum: the default model's attention is unchanged.
  for platform in ('gpu', 'tpu'):
    assert model_config.resolve_attention_impl('auto', jnp.bfloat16, 64, 0.1,
                                               platform) == 'einsum'


def test_the_gpu_and_tpu_kernels_draw_the_same_masks_at_the_same_padded_length():
  """At 128 queries and keys neither kernel set pads, so their masks' counters agree: the two
  give the same outputs and gradients (independently written layouts: [Q, K] blocks against
  transposed [K, Q] ones)."""
  q, k, v = attention_inputs(2, 128, 128, 2, 32)
  valid_BL = jnp.arange(128)[None] < jnp.asarray([128, 70])[:, None]
  rows = pallas_attention.self_rows(valid_BL, None, causal=True)
  results = [
      quick_jit(functools.partial(_outputs_and_grads, lambda q, k, v, kernels=kernels:
                                  flash_attention.flash_attention(q, k, v, rows, 0.25,
                                                                  jnp.uint32(9),
                                                                  kernels=kernels)))(q, k, v)
      for kernels in KERNELS]
  assert_close_to_scale(results[1], results[0], GRADIENT_TOLERANCE)


def test_rows_too_long_for_the_tpu_kernels_are_one_clear_error():
  q = jnp.zeros((1, 8300, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match=r'8320 \(padded\) outgrow: at most 8192'):
    flash_attention.flash_attention(q, q, q, None, 0.1, jnp.uint32(1), kernels='mosaic')
