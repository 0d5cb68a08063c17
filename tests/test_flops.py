"""Analytic model FLOPs against the step's matmuls and XLA's count; peaks; MFU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from conftest import dot_flops

from t2t_jax import sharding
from t2t_jax.model import flops
from t2t_jax.model import model_config as model_config_lib
from t2t_jax.model.transformer import Transformer
from t2t_jax.training import step as step_lib
from t2t_jax.training import train

ROWS, SOURCE_LENGTH, TARGET_LENGTH, VOCAB = 8, 16, 12, 256


@pytest.fixture
def setup(tiny_config):
  tiny_config.model.d_model, tiny_config.model.d_ff = 64, 256
  tiny_config.model.num_encoder_layers = 1
  tiny_config.model.num_decoder_layers = 2  # Unequal stacks: the two sides are told apart.
  return train.build(tiny_config, VOCAB)


def _batch(rows=ROWS):
  return {'inputs': jax.ShapeDtypeStruct((rows, SOURCE_LENGTH), jnp.int32),
          'targets': jax.ShapeDtypeStruct((rows, TARGET_LENGTH), jnp.int32)}


def test_analytic_flops_equal_the_matmuls_of_the_train_step(setup):
  step = functools.partial(step_lib.train_step, model=Transformer(setup.model_config),
                           optimizer=setup.optimizer, label_smoothing=0.1)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    jaxpr = jax.make_jaxpr(step)(setup.abstract_state, _batch(), jax.random.PRNGKey(0))
  expected = flops.train_step_flops(setup.model_config, ROWS, SOURCE_LENGTH, TARGET_LENGTH)
  assert dot_flops(jaxpr.jaxpr) == expected


def test_analytic_flops_against_xla_cost_analysis(setup):
  """XLA counts every op; the analytic count only the matmuls.

  The elementwise rest (softmax, layer norm, dropout, the loss over the vocabulary, Adam's
  per-parameter update) adds 9.8% at this d_model 64; 19% at d_model 32, 6% at 128: it
  grows with d while the matmuls grow with d^2.
  """
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  cost = setup.train_step.lower(setup.abstract_state, _batch(), rng).cost_analysis()
  model = flops.train_step_flops(setup.model_config, ROWS, SOURCE_LENGTH, TARGET_LENGTH)
  assert 1.0 < cost['flops'] / model < 1.12


def test_flops_grow_with_each_term():
  kwargs = dict(d_model=4, d_ff=8, num_encoder_layers=1, num_decoder_layers=1, vocab_size=10,
                source_tokens=6, target_tokens=4, source_length=3, target_length=2)
  # Hand count: per source token 4*16 + 2*32 + 2*16 = 160; per target token 6*16 + 64 + 40
  # = 200; dense 6 * (160*6 + 200*4) = 10560; attention 12*4*(6*3 + 4*(2+3)) = 1824.
  assert flops.model_flops_per_step(**kwargs) == 10560 + 1824


def test_mfu_of_the_measured_h100_point_is_the_one_recorded():
  """docs/results/performance.md, 2026-11-22: Transformer-big in bfloat16, 384 x 64 tokens a
  step, one H100 (989 TFLOP/s): 86.1 ms at 37.5% MFU (cuDNN) and 88.4 ms at 36.5% (einsum),
  31.9 TFLOP of model FLOPs a step (370 TFLOP/s x 86.1 ms)."""
  from configs import wmt14_ende  # pylint: disable=g-import-not-at-top
  config = wmt14_ende.get_config('big')
  model_config = model_config_lib.TransformerConfig.from_config(config.model,
                                                                config.data.vocab_size, 'gpu')
  step_flops = flops.train_step_flops(model_config, 384, 64, 64)
  assert step_flops == pytest.approx(31.9e12, rel=2e-3)
  peak = flops.peak_flops_per_second('NVIDIA H100 80GB HBM3', 'bfloat16')
  assert round(100 * flops.mfu(step_flops, 0.0861, peak), 1) == 37.5
  assert round(100 * flops.mfu(step_flops, 0.0884, peak), 1) == 36.5


# Dense peaks from each chip's architecture: matrix units x multiply-adds per unit and clock x 2
# FLOPs x clock (Google's TPU system architecture pages; NVIDIA's A100 and H100 whitepapers),
# against the datasheet figures the table holds.
@pytest.mark.parametrize('kind, dtype, units, macs_per_clock, clock_ghz', [
    ('TPU v4', 'bfloat16', 2 * 4, 128 * 128, 1.05),  # 2 TensorCores x 4 MXUs of 128 x 128.
    ('TPU v5 lite', 'bfloat16', 4, 128 * 128, 1.5),  # 1 TensorCore x 4 MXUs.
    ('TPU v5p', 'bfloat16', 2 * 4, 128 * 128, 1.75),
    ('NVIDIA A100-SXM4-80GB', 'bfloat16', 108 * 4, 256, 1.41),  # SMs x 4 tensor cores.
    ('NVIDIA A100-SXM4-40GB', 'float32', 108 * 4, 128, 1.41),  # TF32: half the rate.
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 132 * 4, 512, 1.83),
    ('NVIDIA H100 80GB HBM3', 'float32', 132 * 4, 256, 1.83),
    ('NVIDIA H200', 'bfloat16', 132 * 4, 512, 1.83),  # The H100 SXM's compute.
])
def test_peaks_are_the_chips_arithmetic(kind, dtype, units, macs_per_clock, clock_ghz):
  expected = units * macs_per_clock * 2 * clock_ghz * 1e9
  assert flops.peak_flops_per_second(kind, dtype) == pytest.approx(expected, rel=3e-3)


@pytest.mark.parametrize('kind,dtype,peak', [
    ('TPU v4', 'bfloat16', 275e12),
    ('TPU v5 lite', 'bfloat16', 197e12),
    ('TPU v5e', 'bfloat16', 197e12),
    ('TPU v5p', 'bfloat16', 459e12),
    ('TPU v5', 'bfloat16', 459e12),
    ('TPU v6 lite', 'bfloat16', 918e12),
    ('TPU v6e', 'float32', 918e12),
    ('NVIDIA A100-SXM4-40GB', 'bfloat16', 312e12),
    ('NVIDIA A100-SXM4-80GB', 'float16', 312e12),
    ('NVIDIA A100-SXM4-40GB', 'float32', 156e12),
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 989e12),
    ('NVIDIA H100 80GB HBM3', jnp.float32, 494.7e12),
    ('NVIDIA H100 PCIe', 'bfloat16', 756e12),
    ('NVIDIA H200', jnp.bfloat16, 989e12),
])
def test_device_kind_strings_find_their_chip(kind, dtype, peak):
  assert flops.peak_flops_per_second(kind, dtype) == peak


@pytest.mark.parametrize('kind', ['cpu', 'TPU v4 lite', 'NVIDIA H100 NVL', 'NVIDIA GH200 480GB'])
def test_unknown_kinds_have_no_peak(kind):
  assert flops.peak_flops_per_second(kind, 'bfloat16') is None


def test_no_peak_on_cpu():
  assert flops.peak_flops_per_second(jax.devices('cpu')[0].device_kind, 'float32') is None


# The family against XLA's count of the whole train step on CPU, on rows of 64 tokens where
# windows and blocks are far shorter than the rows. XLA also counts the elementwise rest
# (about 10% at d_model 64, see above) and what the members compute beyond their model FLOPs:
# the blocked local layers score 3w keys per query (2w when causal) for the 2w + 1 counted;
# experts fill ceil(1.25 x k x group / X) slots each and the one-hot dispatch and combine are
# matmuls too. So the tolerance is 1.0 < XLA / analytic < 1.3 for every member. (At these
# sizes the dense count also lands in that band for local and compressed layers: the band
# checks the member counts are not wrong, the hand counts in flops.py say what they count.)
@pytest.mark.parametrize('overrides', [
    {'attention_pattern': 'local', 'local_half_width': 4},
    {'attention_pattern': 'compressed', 'compression_stride': 4},
    {'attention_pattern': 'local,compressed', 'kind': 'decoder_only'},
    {'moe_experts': 4, 'moe_top_k': 2, 'moe_layers': 'all', 'moe_group_size': 16},
    {'moe_experts': 8, 'moe_top_k': 1, 'moe_layers': 'every_other', 'moe_group_size': 16,
     'kind': 'decoder_only'},
])
def test_each_members_analytic_flops_against_xla_cost_analysis(tiny_config, overrides):
  config = tiny_config
  config.model.d_model, config.model.d_ff = 64, 256
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  config.model.max_len, config.data.max_len = 256, 128
  for key, value in overrides.items():
    config.model[key] = value
  setup = train.build(config, VOCAB)
  length = 64
  batch = {'inputs': jax.ShapeDtypeStruct((8, length), jnp.int32),
           'targets': jax.ShapeDtypeStruct((8, length), jnp.int32)}
  cost = setup.train_step.lower(setup.abstract_state, batch,
                                jax.ShapeDtypeStruct((2,), jnp.uint32)).cost_analysis()
  analytic = flops.train_step_flops(setup.model_config, 8, length, length)
  dense = flops.train_step_flops(
      dataclasses.replace(setup.model_config, attention_pattern='full', moe_experts=0),
      8, length, length)
  assert 1.0 < cost['flops'] / analytic < 1.3, cost['flops'] / analytic
  assert analytic != dense  # The member's own terms are counted, not the dense model's.
