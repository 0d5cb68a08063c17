"""ReLU then dropout with the output as its only residual (model/relu_dropout.py), against
flax's `nn.Dropout` after `nn.relu`: the same masks, outputs and gradients bit for bit, the
gradient's formula, what the backward pass keeps, and a whole train step unchanged."""

import contextlib
import io

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax import sharding
from t2t_jax.model import moe
from t2t_jax.model import relu_dropout
from t2t_jax.model import transformer
from t2t_jax.training import build as setup_lib


class _Unfused(nn.Dropout):
  """The pair ReluDropout replaces, as the feed-forward networks applied it before."""

  def __call__(self, inputs, deterministic=None, rng=None):
    return super().__call__(nn.relu(inputs), deterministic, rng)


class _Layer(nn.Module):
  rate: float
  kind: type

  @nn.compact
  def __call__(self, x, deterministic=False):
    return self.kind(self.rate, name='Dropout_0')(x, deterministic)


def _output_and_grad(kind, rate, x, dy, deterministic=False):
  """Compiled, as a train step is (op by op, XLA may round a division differently)."""
  def forward(x):
    return _Layer(rate, kind).apply({}, x, deterministic,
                                    rngs={'dropout': jax.random.PRNGKey(7)})

  @jax.jit
  def both(x, dy):
    y, pullback = jax.vjp(forward, x)
    return y, pullback(dy)[0]
  return both(x, dy)


def _inputs(dtype, shape=(6, 5, 64)):
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape)
  x.reshape(-1)[:8] = 0.0  # Exact zeros: ReLU's derivative there is 0 in both.
  return jnp.asarray(x, dtype), jnp.asarray(rng.normal(size=shape), dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('rate', [0.1, 0.5, 0.0, 1.0])
def test_outputs_and_gradients_equal_flax_dropout_after_relu_bit_for_bit(dtype, rate):
  x, dy = _inputs(dtype)
  y, dx = _output_and_grad(relu_dropout.ReluDropout, rate, x, dy)
  y_ref, dx_ref = _output_and_grad(_Unfused, rate, x, dy)
  assert y.dtype == dx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))


def test_gradient_passes_where_the_output_is_positive_scaled_by_the_kept_fraction():
  rate = 0.25
  x, dy = _inputs(jnp.float32)
  y, dx = _output_and_grad(relu_dropout.ReluDropout, rate, x, dy)
  y, dx, x, dy = (np.asarray(a) for a in (y, dx, x, dy))
  kept = y != 0
  # Where kept, the output is the input scaled up; where the input is positive, about 3 in 4
  # are kept (binomial over the about 960 positive of 1,920 elements: 6 sigma is 0.084).
  np.testing.assert_allclose(y[kept], x[kept] / (1 - rate), rtol=1e-6)
  assert abs(kept[x > 0].mean() - (1 - rate)) < 0.084
  np.testing.assert_allclose(dx, np.where(kept, dy / (1 - rate), 0.0), rtol=1e-6)


def test_deterministic_is_relu():
  x, dy = _inputs(jnp.float32)
  y, dx = _output_and_grad(relu_dropout.ReluDropout, 0.3, x, dy, deterministic=True)
  np.testing.assert_array_equal(y, np.maximum(np.asarray(x), 0))
  np.testing.assert_array_equal(dx, np.where(np.asarray(x) > 0, dy, 0))


def test_the_backward_pass_keeps_only_the_output():
  """flax's pair keeps the mask and ReLU's comparison (two booleans per element) beside
  zeros; the fused layer keeps the output, which the next matmul keeps anyway."""
  x, _ = _inputs(jnp.float32, (4, 8))

  def saved(kind):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
      jax.ad_checkpoint.print_saved_residuals(
          lambda x: _Layer(0.3, kind).apply({}, x, rngs={'dropout': jax.random.PRNGKey(1)}), x)
    return [line for line in text.getvalue().splitlines() if line.strip()]

  unfused = saved(_Unfused)
  assert sum(line.startswith('bool[4,8]') for line in unfused) == 2, unfused
  fused = saved(relu_dropout.ReluDropout)
  assert [line.split()[0] for line in fused] == ['f32[4,8]'], fused


def test_broadcast_masks_are_refused():
  x, _ = _inputs(jnp.float32)
  layer = relu_dropout.ReluDropout(0.1, broadcast_dims=(1,))
  with pytest.raises(NotImplementedError, match='one mask element per activation'):
    layer.apply({}, x, False, rngs={'dropout': jax.random.PRNGKey(0)})


@pytest.mark.parametrize('experts', [0, 2])
def test_a_train_step_with_relu_dropout_is_unchanged(tiny_config, monkeypatch, experts):
  """The tiny model (feed-forward or mixture of experts) with dropout 0.1 everywhere: one
  step's loss, gradients (Adam's first moments) and updated weights with the fused layer equal
  those with flax's pair as the model applied it before (auto-named), bit for bit."""
  tiny_config.model.dropout = tiny_config.model.relu_dropout = 0.1
  if experts:
    tiny_config.model.moe_experts, tiny_config.model.moe_top_k = experts, 1
    tiny_config.model.moe_layers = 'all'
  rng = np.random.default_rng(3)
  batch = {'inputs': rng.integers(2, 16, (8, 8)).astype(np.int32),
           'targets': rng.integers(2, 16, (8, 8)).astype(np.int32)}
  def unchanged(rate, name):  # The code before: flax names the module, as it named it then.
    del name
    dropout = nn.Dropout(rate)
    return lambda x, deterministic: dropout(nn.relu(x), deterministic)

  results = []
  for kind in (relu_dropout.ReluDropout, unchanged):
    monkeypatch.setattr(transformer, 'ReluDropout', kind)
    monkeypatch.setattr(moe, 'ReluDropout', kind)
    setup = setup_lib.build(tiny_config, 16)
    state, metrics = setup.train_step(setup.init(jax.random.PRNGKey(0)),
                                      sharding.global_batch(batch, setup.mesh),
                                      jax.random.PRNGKey(1))
    results.append((float(metrics['loss']), jax.device_get(state.params),
                    jax.device_get(state.opt_state)))
  assert results[0][0] == results[1][0]
  for a, b in zip(jax.tree.leaves(results[0][1:]), jax.tree.leaves(results[1][1:])):
    np.testing.assert_array_equal(a, b)
