"""The fused output layer and loss (training/fused_loss.py, opt.loss_impl='fused'), run in the
Pallas interpreter on the CPU, against the XLA path's formulas."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax import sharding
from t2t_jax.compile import hlo_cost
from t2t_jax.model.decoder_only import make_model
from t2t_jax.model import model_config
from t2t_jax.training import config_check
from t2t_jax.training import fused_loss
from t2t_jax.training import optim
from t2t_jax.training import step
from t2t_jax.training import tasks
from t2t_jax import ConfigError

P = jax.sharding.PartitionSpec


def _inputs(tokens_shape, width, vocab, seed=0, dtype=jnp.float32):
  """Hidden states, an output matrix and targets: a quarter of the tokens PAD, and a quarter
  whose target is their logits' maximum (so 'correct' counts something)."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=tokens_shape + (width,))
  weight = rng.normal(size=(vocab, width)) * 0.5
  targets = rng.integers(1, vocab, size=tokens_shape)
  best = (hidden @ weight.T).argmax(-1)
  flat, best = targets.reshape(-1), best.reshape(-1)
  flat[::4] = best[::4]
  flat[1::4] = 0
  return (jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype),
          jnp.asarray(flat.reshape(tokens_shape), jnp.int32))


def _reference(hidden, weight, targets, smoothing):
  logits = jnp.einsum('...E,VE->...V', hidden.astype(jnp.float32), weight.astype(jnp.float32))
  return optim.compute_metrics(logits, targets, smoothing)


@pytest.mark.parametrize('tokens_shape,vocab,width,smoothing,programs', [
    ((2, 25), 300, 32, 0.1, None),  # 50 tokens: not whole blocks; 300 entries: a part block.
    ((3, 7), 37, 48, 0.0, None),  # Fewer entries than a block; the width in slices of 16.
    ((4, 64), 1000, 32, 0.2, None),  # Several spans.
    ((2, 9), 200, 192, 0.1, None),  # The width in three slices of 64 (float32).
    # Two spans of three blocks over 300 entries: the last block of the second is padding only.
    ((2, 25), 300, 32, 0.1, 4)])
def test_sums_and_gradients_equal_the_float32_formulas(tokens_shape, vocab, width, smoothing,
                                                       programs, monkeypatch):
  if programs:
    monkeypatch.setattr(fused_loss, 'PROGRAMS', programs)
  hidden, weight, targets = _inputs(tokens_shape, width, vocab)
  fused = fused_loss.fused_metrics(hidden, weight, targets, smoothing)
  expected = _reference(hidden, weight, targets, smoothing)
  assert float(expected['correct']) > 0 and float(expected['weight']) < targets.size
  for name in ('loss', 'nll', 'correct', 'weight'):
    np.testing.assert_allclose(fused[name], expected[name], rtol=1e-5, err_msg=name)
  grads = jax.grad(lambda h, w: fused_loss.fused_metrics(h, w, targets, smoothing)['loss'],
                   argnums=(0, 1))(hidden, weight)
  expected_grads = jax.grad(lambda h, w: _reference(h, w, targets, smoothing)['loss'],
                            argnums=(0, 1))(hidden, weight)
  for got, want in zip(grads, expected_grads):
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


def test_only_the_loss_is_differentiated_and_its_cotangent_scales_the_gradient():
  hidden, weight, targets = _inputs((2, 16), 16, 50)
  def scaled(h):
    sums = fused_loss.fused_metrics(h, weight, targets, 0.1)
    return 3.0 * sums['loss'] + sums['nll'] + sums['correct']
  once = jax.grad(lambda h: fused_loss.fused_metrics(h, weight, targets, 0.1)['loss'])(hidden)
  np.testing.assert_allclose(jax.grad(scaled)(hidden), 3.0 * once,
                             atol=1e-6 * float(jnp.abs(once).max()))


@pytest.mark.parametrize('tokens_shape,weight_spec', [
    ((8, 12), P(None, 'fsdp')),  # The matrix split as FSDP splits it, gathered for the kernels.
    ((3, 7), P('tensor', None))])  # 21 tokens the 4 batch shards do not divide: whole on each.
def test_sharded_over_the_batch_equals_one_device(tiny_config, tokens_shape, weight_spec):
  """Under a mesh each device runs the kernels on its tokens, the matrix whole: the sums and
  gradients equal the single device's."""
  tiny_config.mesh.shape = (2, 2, 2)
  mesh = sharding.make_mesh(tiny_config.mesh)
  hidden, weight, targets = _inputs(tokens_shape, 32, 200)
  def sums_and_grads(h, w):
    value, grads = jax.value_and_grad(
        lambda h, w: fused_loss.fused_metrics(h, w, targets, 0.1)['loss'], argnums=(0, 1))(h, w)
    return value, grads
  single = sums_and_grads(hidden, weight)
  with sharding.mesh_context(mesh, sharding.rules(tiny_config.mesh)):
    assert 'shard_map' in str(jax.make_jaxpr(sums_and_grads)(hidden, weight))
    weight = jax.device_put(weight, jax.sharding.NamedSharding(mesh, weight_spec))
    sharded = jax.jit(sums_and_grads)(hidden, weight)
  for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('tie_output', [True, False])
def test_the_model_metrics_and_gradients_equal_the_chunked_path(tiny_config, tie_output):
  """step.model_metrics with loss_impl='fused' against the chunked XLA path on a tiny
  Transformer in float32 (the same arithmetic up to rounding), tied and untied output."""
  tiny_config.model.tie_output = tie_output
  tiny_config.model.dropout = tiny_config.model.attention_dropout = 0.0
  tiny_config.model.relu_dropout = 0.0
  tiny_config.model.dtype = 'float32'
  config = model_config.TransformerConfig.from_config(tiny_config.model, 40, platform='cpu',
                                                      deterministic=True)
  model = make_model(config)
  rng = np.random.default_rng(1)
  inputs = jnp.asarray(rng.integers(2, 40, (3, 11)), jnp.int32)
  targets = jnp.asarray(rng.integers(2, 40, (3, 9)), jnp.int32).at[2, 5:].set(0)
  batch = {'inputs': inputs, 'targets': targets}
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), inputs, targets)['params'])
  metrics = lambda impl, p: step.model_metrics(model, p, batch, 0.1, loss_chunk_tokens=8,
                                               loss_impl=impl)
  fused, chunked = metrics('fused', params), metrics('xla', params)
  for name in ('loss', 'nll', 'correct', 'weight'):
    np.testing.assert_allclose(fused[name], chunked[name], rtol=1e-5, err_msg=name)
  grads = [jax.grad(lambda p: metrics(impl, p)['loss'])(params) for impl in ('fused', 'xla')]
  for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(jnp.abs(want).max())))


def test_in_bfloat16_the_loss_is_within_the_xla_paths_rounding():
  """In bfloat16 the XLA path rounds each logit to 8 bits of mantissa before its float32
  softmax; the kernels keep float32 logits. Both stay within that rounding of the float32
  loss."""
  hidden, weight, targets = _inputs((4, 32), 64, 500, dtype=jnp.bfloat16)
  exact = _reference(hidden, weight, targets, 0.1)['loss']
  fused = fused_loss.fused_metrics(hidden, weight, targets, 0.1)['loss']
  logits = jnp.einsum('TLE,VE->TLV', hidden, weight)  # bfloat16, as the XLA path has them.
  xla = optim.compute_metrics(logits, targets, 0.1)['loss']
  assert abs(float(fused - exact)) <= 1e-5 * abs(float(exact))
  assert abs(float(xla - exact)) <= 2**-7 * abs(float(exact))


def test_the_task_uses_the_fused_objective_only_when_asked(tiny_config):
  assert tasks.for_config(tiny_config).objective is step.model_metrics
  tiny_config.opt.loss_impl = 'fused'
  objective = tasks.for_config(tiny_config).objective
  assert isinstance(objective, functools.partial)
  assert objective.func is step.model_metrics and objective.keywords == {'loss_impl': 'fused'}


def test_fused_is_refused_on_a_tpu_for_encoder_only_models_and_odd_widths(tiny_config):
  tiny_config.opt.loss_impl = 'fused'
  config_check.check(tiny_config, mesh=False)  # The tiny model on the CPU: accepted.
  problems = config_check._loss_problems(tiny_config, 'tpu')  # pylint: disable=protected-access
  assert len(problems) == 1 and "loss_impl='xla'" in problems[0] and 'TPU' in problems[0]
  tiny_config.model.kind = 'encoder_only'
  tiny_config.model.d_model = 40
  problems = config_check._loss_problems(tiny_config, 'gpu')  # pylint: disable=protected-access
  assert len(problems) == 2
  assert 'encoder-only' in problems[0] and 'd_model (got 40)' in problems[1]
  tiny_config.model.kind, tiny_config.model.d_model = 'encoder_decoder', 32
  tiny_config.opt.loss_impl = 'chunked'
  with pytest.raises(ConfigError, match=r"config.opt.loss_impl='chunked' must be one of"):
    config_check.check(tiny_config, mesh=False)


def test_the_widths_the_kernels_take():
  assert [w for w in range(8, 200, 8) if fused_loss.supported_width(w)] == list(range(16, 200, 16))
  block = fused_loss._width_block  # pylint: disable=protected-access
  assert [block(w, jnp.bfloat16) for w in (16, 48, 96, 320, 384, 512, 1024)] == [
      16, 16, 32, 64, 128, 128, 128]
  assert block(1024, jnp.float32) == 64


def test_the_cost_model_counts_one_matrix_product_per_kernel():
  """hlo_cost reads each fused loss kernel as 2 T V E FLOPs, from its operands' shapes."""
  hlo = '''HloModule m

ENTRY %main (h: bf16[96,64], w: bf16[448,64], t: s32[96]) -> f32[4,96] {
  %h = bf16[96,64]{1,0} parameter(0)
  %w = bf16[448,64]{1,0} parameter(1)
  %t = s32[96]{0} parameter(2)
  ROOT %k = f32[4,96]{1,0} custom-call(%h, %w, %t), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 2 : i32, name = "t2t_fused_loss_fwd"}
}
'''
  cost = hlo_cost.analyse(hlo, 1)
  kernel = next(k for k in cost.kernels if k.opcode == 'custom-call')
  assert kernel.flops == 2 * 96 * 448 * 64
