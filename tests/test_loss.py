"""The loss over chunks of tokens against the whole-logits loss: sums, gradients, memory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax import PAD_ID
from t2t_jax import sharding
from t2t_jax.model.transformer import Transformer, TransformerConfig
from t2t_jax.training import optim
from t2t_jax.training import step as step_lib
from t2t_jax.training import train

VOCAB = 37


def _model_and_batch(tie_output: bool, norm: str):
  """A tiny model and a padded batch whose last real targets are the model's argmax."""
  config = TransformerConfig(VOCAB, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                             num_decoder_layers=2, tie_output=tie_output, norm=norm,
                             max_len=16, deterministic=True)
  model = Transformer(config)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, VOCAB, (3, 7))
  inputs[2, 4:] = 0
  targets = rng.integers(1, VOCAB, (3, 5))
  targets[1, 3:] = 0

  def init_and_logits(key, inputs, targets):  # Arguments, not constants: targets change below.
    params = nn.meta.unbox(model.init(key, inputs, targets)['params'])
    return params, model.apply({'params': params}, inputs, targets)

  # One compile, not the model's eager operations compiled one by one. Logits at a position
  # see only earlier targets, so the last real target can be set to the argmax there:
  # 'correct' then counts at least one token per row.
  params, logits = jax.jit(init_and_logits)(jax.random.PRNGKey(0), inputs, targets)
  for row, last in enumerate((targets != 0).sum(1) - 1):
    targets[row, last] = int(np.argmax(logits[row, last]))
  return model, params, {'inputs': jnp.asarray(inputs), 'targets': jnp.asarray(targets)}


@pytest.mark.parametrize('tie_output, norm', [(True, 'post'), (False, 'pre')])
def test_chunked_loss_and_gradients_equal_whole_logits(tie_output, norm):
  model, params, batch = _model_and_batch(tie_output, norm)

  def loss_fn(params, chunk_tokens):
    metrics = step_lib.model_metrics(model, params, batch, 0.1, chunk_tokens)
    return metrics['loss'], metrics

  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True), static_argnums=1)
  whole_grads, whole = grad_fn(params, 0)
  # 15 token places (2 of them padding) in chunks of at most 4: four chunks, one PAD added.
  chunked_grads, chunked = grad_fn(params, 4)
  assert float(whole['weight']) == float(chunked['weight']) == 13
  assert float(whole['correct']) == float(chunked['correct']) >= 3
  for name in ('loss', 'nll'):
    np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-6)
  output = 'embedding' if tie_output else 'output_projection'
  assert float(jnp.abs(whole_grads[output][next(iter(whole_grads[output]))]).max()) > 1e-3
  flat_whole = jax.tree_util.tree_leaves_with_path(whole_grads)
  assert len(flat_whole) == len(jax.tree.leaves(chunked_grads))
  for (path, expected), actual in zip(flat_whole, jax.tree.leaves(chunked_grads)):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  # Evaluation (no gradient) gives the same sums too.
  evaluated = jax.jit(step_lib.model_metrics, static_argnums=(0, 3, 4))(model, params, batch, 0.1, 4)
  np.testing.assert_allclose(evaluated['loss'], whole['loss'], rtol=1e-6)


def test_sharded_train_step_with_chunks_takes_the_whole_logits_step(tiny_config):
  tiny_config.mesh.shape = (2, 2, 2)  # The vocabulary split over 'tensor' as well.
  tiny_config.opt.grad_accum_steps = 2
  tiny_config.opt.eps = 1.0  # Updates proportional to the gradient, so they compare closely.
  rng = np.random.default_rng(1)
  targets = rng.integers(1, 40, (8, 16))
  targets[::3, 10:] = 0
  batch = {'inputs': rng.integers(1, 40, (8, 16)), 'targets': targets}
  results = []
  for chunk_tokens in (0, 24):  # 64 tokens per micro-batch do not split into 24s.
    tiny_config.opt.loss_chunk_tokens = chunk_tokens
    setup = train.build(tiny_config, 40)
    state = setup.init(jax.random.PRNGKey(0))
    state, metrics = setup.train_step(state, sharding.global_batch(batch, setup.mesh),
                                      jax.random.PRNGKey(3))
    evaluated = setup.eval_step(state.params, sharding.global_batch(batch, setup.mesh))
    results.append(jax.device_get((state.params, metrics, evaluated)))
  (whole_params, *whole_sums), (chunked_params, *chunked_sums) = results
  for whole, chunked in zip(whole_sums, chunked_sums):
    for name in whole:
      np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-5, err_msg=name)
  for expected, actual in zip(jax.tree.leaves(whole_params), jax.tree.leaves(chunked_params)):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


def test_chunked_loss_never_holds_the_whole_logits(tiny_config):
  for name in ('dropout', 'attention_dropout', 'relu_dropout'):
    tiny_config.model[name] = 0.0  # Keeps the rest of the step's memory small.
  mesh = sharding.make_mesh(tiny_config.mesh, devices=jax.devices()[:1])
  vocab, rows, length = 4096, 256, 16  # Short rows: small attention.
  logits_bytes = rows * length * vocab * 4  # 64 MiB of float32 logits.
  temp_bytes = {}
  for chunk_tokens in (0, 256):
    tiny_config.opt.loss_chunk_tokens = chunk_tokens
    setup = train.build(tiny_config, vocab, mesh)
    batch = {key: jax.ShapeDtypeStruct((rows, length), jnp.int32,
                                       sharding=sharding.batch_sharding(mesh))
             for key in ('inputs', 'targets')}
    compiled = setup.train_step.lower(setup.abstract_state, batch,
                                      jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
    temp_bytes[chunk_tokens] = compiled.memory_analysis().temp_size_in_bytes
  # Measured on CPU: 285 MiB whole (logits, log-probs, their gradient...), 42 MiB in chunks
  # of 256 tokens (three 4 MiB chunk buffers, the rest the model's own activations). Less
  # than one logits tensor in all: the whole [B L, V] float32 logits never exist at once.
  assert temp_bytes[0] - temp_bytes[256] > 3 * logits_bytes, temp_bytes
  assert temp_bytes[256] < logits_bytes, temp_bytes


def test_fused_logits_gradient_equals_autodiff_of_the_loss():
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(37, 29)) * 3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 29, 37), jnp.int32).at[:5].set(PAD_ID)
  # Jitted as the train step runs them, the fused pass and autodiff's each a program of its
  # own: two compiles, not one per eager operation.
  metrics, grad = jax.jit(optim.metrics_and_logits_grad, static_argnums=2)(logits, targets, 0.1)

  def autodiff(x):
    expected = optim.compute_metrics(x[None], targets[None], 0.1)
    return expected['loss'], expected
  expected_grad, expected = jax.jit(jax.grad(autodiff, has_aux=True))(logits)
  for name in ('loss', 'nll', 'correct', 'weight'):
    np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(grad, expected_grad, atol=1e-6)
  assert float(metrics['correct']) > 0 and not np.any(np.asarray(grad)[:5])
