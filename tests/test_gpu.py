"""The accelerator path on a GPU (T2T_TEST_GPU=1; skipped with the reason elsewhere): the model
and the train step compute on the GPU what they compute on the CPU, within the rounding of the
GPU's arithmetic, with t2t_jax's XLA flags in effect.

Tolerances, from the arithmetic (relative L2 error, ||gpu - cpu|| / ||cpu||):
  - float32 at 'highest' precision: true float32 products (unit roundoff u = 2^-24 = 6e-8)
    summed in another order; a sum of K <= 64 terms moves by at most K u = 4e-6, and the
    model chains a few dozen such sums: 1e-5.
  - float32 at the default precision: NVIDIA GPUs since Ampere multiply float32 matrices in
    TF32 (10-bit mantissa, u = 2^-11 = 4.9e-4). Each product rounds both operands once
    (relative error up to 2u = 1e-3) and accumulates in float32; along the 2+2 layers a
    logit passes through about 10 products, whose errors add in quadrature when independent:
    sqrt(10) x 1e-3 = 3e-3, so 1e-2 for logits. Gradients take about twice the products
    (forward and backward), and softmax's backward subtracts nearly equal terms, which
    magnifies relative error: 3e-2.
  - bfloat16 compute: 8-bit mantissa, u = 2^-9 = 2e-3, four times TF32's 2u: 4e-2 for logits,
    1e-1 for gradients (the bound test_attention.py's cuDNN test uses for 2 layers is 5e-2).
"""

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_cached_decoding_matches_teacher_forcing
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.model import flash_attention
from t2t_jax.model import flash_masks
from t2t_jax.model import flops
from t2t_jax.model import pallas_attention
from t2t_jax.model import transformer as model_lib
from t2t_jax.training import fused_loss
from t2t_jax.training import optim
from t2t_jax.training import train

pytestmark = pytest.mark.gpu

VOCAB = 64
CONFIG = model_lib.TransformerConfig(
    vocab_size=VOCAB, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
    num_decoder_layers=2, max_len=32, attention_dropout=0.0, deterministic=True)


def _batch():
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, VOCAB, (4, 12)).astype(np.int32)
  targets = rng.integers(2, VOCAB, (4, 10)).astype(np.int32)
  inputs[0, 7:], targets[1, 4:] = 0, 0
  return inputs, targets


def _params(device):
  tokens = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model_lib.Transformer(CONFIG).init)(jax.random.PRNGKey(0), tokens,
                                                       tokens)['params']
  return jax.device_put(params, device)


def _logits_and_grads(config, device, precision=None):
  inputs, targets = jax.device_put(_batch(), device)

  def loss(params):
    logits = model_lib.Transformer(config).apply({'params': params}, inputs, targets)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    weights = (targets > 0).astype(jnp.float32)
    return (nll * weights).sum() / weights.sum(), logits.astype(jnp.float32)

  with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(_params(device))
  return jax.device_get((logits, grads))


def _relative_error(tree, reference) -> float:
  diff = sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64))**2)
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)))
  norm = sum(np.sum(np.asarray(b, np.float64)**2) for b in jax.tree.leaves(reference))
  return float(np.sqrt(diff / norm))


@pytest.mark.parametrize('dtype, precision, logits_bound, grads_bound', [
    (jnp.float32, 'highest', 1e-5, 1e-5),
    (jnp.float32, None, 1e-2, 3e-2),
    (jnp.bfloat16, None, 4e-2, 1e-1),
])
def test_the_gpu_computes_the_cpus_logits_and_gradients(gpu_device, dtype, precision,
                                                         logits_bound, grads_bound):
  cpu = jax.devices('cpu')[0]
  expected = _logits_and_grads(CONFIG, cpu, 'highest')
  actual = _logits_and_grads(dataclasses.replace(CONFIG, dtype=dtype), gpu_device, precision)
  assert _relative_error(actual[0], expected[0]) <= logits_bound
  assert _relative_error(actual[1], expected[1]) <= grads_bound


def test_cached_decoding_matches_teacher_forcing_on_the_gpu(gpu_device):
  inputs, targets = _batch()
  targets = np.where(targets == 0, 5, targets)  # Decoding emits no padding: compare no padding.
  inputs, targets = jax.device_put((inputs, targets), gpu_device)
  assert_cached_decoding_matches_teacher_forcing(CONFIG, _params(gpu_device), inputs, targets)


def test_the_train_step_on_the_gpu_gives_the_cpus_first_loss(gpu_device, tiny_config):
  """The tiny config's first update in bfloat16 on the GPU against float32 on the CPU.

  At initialisation the loss is about ln(vocab) and the logits are O(1); the loss moves by at
  most twice the largest logit error, 4e-2 x O(1) by the bound above, so 2e-2 relative.
  """
  tiny_config.model.dropout = tiny_config.model.relu_dropout = 0.0  # Same masks needn't hold.
  tiny_config.mesh.shape = (1, 1, 1)
  inputs, targets = _batch()
  losses = {}
  for side, device, dtype in (('cpu', jax.devices('cpu')[0], 'float32'),
                              ('gpu', gpu_device, 'bfloat16')):
    config = tiny_config.copy_and_resolve_references()
    config.model.dtype = dtype
    mesh = sharding.make_mesh(config.mesh, [device])
    setup = train.build(config, VOCAB, mesh)
    batch = sharding.global_batch({'inputs': inputs, 'targets': targets}, mesh)
    state, metrics = setup.train_step(setup.init(jax.random.PRNGKey(0)), batch,
                                      jax.random.PRNGKey(1))
    assert jax.tree.leaves(state.params)[0].devices() == {device}
    losses[side] = float(metrics['loss']) / float(metrics['weight'])
  assert np.isfinite(losses['gpu'])
  assert abs(losses['gpu'] - losses['cpu']) <= 2e-2 * losses['cpu']


def test_the_flash_kernels_compute_on_the_gpu_what_the_explicit_path_does_on_the_cpu(
    gpu_device):
  """attention_impl='flash' compiled by Triton, with dropout, against softmax(q k^T) v on the
  CPU in float32 with the same masks (flash_masks.reference_keep): the kernels multiply
  float32 blocks at the default precision (TF32 on this GPU), so the bounds above for
  float32 at the default precision: 1e-2 for outputs, 3e-2 for gradients."""
  rng = np.random.default_rng(0)
  batch, length, heads, depth, rate, seed = 3, 80, 2, 32, 0.2, 99
  q, k, v = (np.asarray(rng.normal(size=(batch, length, heads, depth)), np.float32)
             for _ in range(3))
  q *= depth**-0.5
  probe = np.asarray(rng.normal(size=q.shape), np.float32)
  valid = np.arange(length)[None] < np.asarray([80, 33, 5])[:, None]

  def kernel(q, k, v):
    rows = pallas_attention.self_rows(jnp.asarray(valid), None, causal=True)
    return flash_attention.flash_attention(q, k, v, rows, rate, jnp.uint32(seed))

  def explicit(q, k, v):
    block = flash_attention._block(length, 64)  # pylint: disable=protected-access
    padded = block * -(-length // block)
    keep = flash_masks.reference_keep(seed, batch, heads, length, padded,
                                      rate)[..., :length]
    causal = np.tril(np.ones((length, length), bool))
    mask = valid[:, None, None, :] & causal
    logits = jnp.einsum('BQHD,BKHD->BHQK', q, k, precision='highest')
    weights = jax.nn.softmax(jnp.where(mask, logits, flash_masks.MASKED), axis=-1)
    return jnp.einsum('BHQK,BKHD->BQHD', jnp.where(keep, weights / (1 - rate), 0.0), v,
                      precision='highest')

  def outputs_and_grads(attend, device):
    args = jax.device_put((q, k, v), device)
    loss = lambda q, k, v: (attend(q, k, v) * probe).sum()
    out = jax.jit(attend)(*args)
    return jax.device_get((out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)))

  on_gpu = outputs_and_grads(kernel, gpu_device)
  on_cpu = outputs_and_grads(explicit, jax.devices('cpu')[0])
  assert _relative_error(on_gpu[0], on_cpu[0]) <= 1e-2
  assert _relative_error(on_gpu[1], on_cpu[1]) <= 3e-2


def test_the_fused_loss_computes_on_the_gpu_what_the_formulas_do_on_the_cpu(gpu_device):
  """opt.loss_impl='fused' compiled by Triton (float32 blocks at the default precision, TF32
  on this GPU) against optim.compute_metrics of float32 logits on the CPU: the bounds above
  for float32 at the default precision, 1e-2 for the sums and 3e-2 for the gradients. 300
  tokens and 1,000 entries: part blocks, several spans."""
  rng = np.random.default_rng(0)
  hidden = np.asarray(rng.normal(size=(3, 100, 64)), np.float32)
  weight = np.asarray(rng.normal(size=(1000, 64)) * 0.2, np.float32)
  targets = rng.integers(1, 1000, size=(3, 100)).astype(np.int32)
  targets[2, 60:] = 0

  def sums_and_grads(metrics, device):
    h, w = jax.device_put((hidden, weight), device)
    loss = lambda h, w: metrics(h, w)['loss']
    return jax.device_get((jax.jit(metrics)(h, w),
                           jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)))

  kernels = lambda h, w: fused_loss.fused_metrics(h, w, jnp.asarray(targets), 0.1)
  formulas = lambda h, w: optim.compute_metrics(
      jnp.einsum('BLE,VE->BLV', h, w, precision='highest'), jnp.asarray(targets), 0.1)
  on_gpu = sums_and_grads(kernels, gpu_device)
  on_cpu = sums_and_grads(formulas, jax.devices('cpu')[0])
  for name in ('loss', 'nll'):
    assert abs(on_gpu[0][name] - on_cpu[0][name]) <= 1e-2 * abs(on_cpu[0][name]), name
  assert on_gpu[0]['weight'] == on_cpu[0]['weight']
  # A token whose two largest logits lie within TF32's rounding may count either way.
  assert abs(on_gpu[0]['correct'] - on_cpu[0]['correct']) <= 0.01 * on_cpu[0]['weight']
  assert _relative_error(on_gpu[1], on_cpu[1]) <= 3e-2


def test_the_gpu_runs_with_the_projects_xla_flags_and_a_known_peak(gpu_device):
  for flag in runtime.GPU_XLA_FLAGS:
    assert flag in os.environ['XLA_FLAGS'].split()
  assert flops.device_family(gpu_device.device_kind), (
      f'{gpu_device.device_kind!r} has no published peak in t2t_jax/model/flops.py: MFU would be '
      'null; add its peak there')
