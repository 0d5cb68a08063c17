"""Dry runs, the one place for them: the train step compiled for this machine's (simulated)
CPU devices, from the command line and in-process; and for named accelerator targets, the
real train step, eval step and search compiled by the TPU compiler (libtpu) and XLA's GPU
compiler on this CPU, with no TPU or GPU here.

Expectations are independent of the compiler: the state a device must hold (parameters and
Adam's two moments, float32), the gradient bytes data parallelism must reduce, the FLOPs
counted from the shapes (flops.py), and what fits a device's published memory.
"""

import json
import math
import os
import re
import subprocess
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.compile import dry_run as dry_run_lib
from t2t_jax.compile import hlo_cost
from t2t_jax.compile import hlo_text
from t2t_jax.compile import mesh_choice
from t2t_jax.compile import report as report_lib
from t2t_jax.compile import roofline
from t2t_jax.compile import targets
from t2t_jax.data import pipeline as data
from t2t_jax.model import flash_attention
from t2t_jax.model import flops
from t2t_jax.model import pallas_attention
from t2t_jax.model import transformer as model_lib
from t2t_jax.training import build as setup_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_state_and_step(result, params):
  """What any target's report of the tiny data-parallel step must say."""
  train = result['programs']['train_step']
  memory = train['memory_per_device_bytes']
  # Each device holds float32 parameters and Adam's two moments (a TPU pads small arrays to
  # its tiles, so at least that), and gets the state back in place (donated).
  assert memory['argument'] >= 3 * 4 * params and memory['alias'] >= 3 * 4 * params
  assert train['fits'] and 0 < train['needs_bytes'] < result['usable_memory_bytes']
  assert set(result['programs']) == {'train_step', 'eval_step', 'search'}
  assert all(p['fits'] and p['compile_seconds'] > 0 for p in result['programs'].values())
  # The compiled kernels do exactly the matmuls the shapes call for (this model has no
  # other matmul): the analytic count split over the 8 devices.
  assert result['compiled_flops_per_device'] * 8 == pytest.approx(
      result['analytic_flops_per_step'], rel=1e-6)
  prediction = result['prediction']
  assert prediction['step_seconds'] >= max(prediction['compute_seconds'],
                                           prediction['memory_seconds']) > 0
  assert 0 < prediction['mfu'] < 1 and prediction['unknown_trip_counts'] == 0


@pytest.mark.slow
def test_dry_run_cli_prints_size_and_cost_on_a_simulated_4_2_1_mesh(tiny_config):
  """`--dry_run --dry_run_devices=8` (this process's 8 simulated devices not inherited): the
  JSON line's size and cost of the train step on a data x FSDP mesh."""
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py', '--dry_run',
             '--dry_run_devices=8', '--config.mesh.shape=(4,2,1)']
  run = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=''),
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  config = tiny_config
  config.mesh.shape = (4, 2, 1)
  model_config = model_lib.TransformerConfig.from_config(config.model, data.vocab_size(config),
                                                         'cpu')
  tokens = jax.ShapeDtypeStruct((1, 4), np.int32)
  shapes = jax.eval_shape(model_lib.Transformer(model_config).init, jax.random.PRNGKey(0),
                          tokens, tokens)
  params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes['params']))
  rows, length = result['batch_shape']
  assert result['config'] == 'tiny' and result['params'] == params
  assert result['mesh'] == {'data': 4, 'fsdp': 2, 'tensor': 1, 'expert': 1}
  assert result['device_count'] == 8
  analytic = flops.train_step_flops(model_config, rows, length, length)
  assert result['analytic_flops_per_step'] == analytic
  # The compiled kernels' matmuls: each device its share of the rows.
  assert result['compiled_flops_per_device'] * 8 == analytic
  assert analytic < result['flops_per_step'] < 1.3 * analytic  # XLA adds elementwise work.
  # Each device's arguments: its shard of the float32 params and two Adam moments (split two
  # ways over fsdp, as the abstract state's shardings say: no compile), its rows of the
  # batch's two int32 arrays, and a few scalars (step, counts, the key).
  abstract = setup_lib.build(config, data.vocab_size(config)).abstract_state.params
  state = 3 * 4 * sum(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(abstract))
  assert state == pytest.approx(3 * 4 * params / 2, rel=0.01)  # The replicated biases aside.
  memory = result['memory_per_device_bytes']
  assert 0 <= memory['argument'] - (state + 2 * 4 * rows * length // 8) <= 64
  assert memory['temp'] > 0 and memory['output'] > 0


@pytest.mark.slow
def test_dry_run_counts_params_and_flops_of_every_layer_scanned_or_not_on_any_mesh(
    tiny_config):
  config = tiny_config
  # Two layers a stack: a count of one layer's FLOPs (a scan's body) would be half.
  layers = config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  config.mesh.shape = (2, 2, 2)
  config.data.batch_tokens = 512  # 16 rows of 32: whole micro-batches on both meshes below.
  result = dry_run_lib.dry_run(config)
  assert (result['scan_layers'], result['remat']) == (False, 'none')
  d, f, v = config.model.d_model, config.model.d_ff, data.vocab_size(config)
  layer = 4 * d * d + 2 * d * f + f + d + 4 * d  # Attention, FFN, biases, two LayerNorms.
  decoder_layer = 8 * d * d + 2 * d * f + f + d + 6 * d
  assert result['params'] == v * d + layers * (layer + decoder_layer)
  assert result['device_count'] == 8 and result['mesh'] == {'data': 2, 'fsdp': 2, 'tensor': 2,
                                                               'expert': 1}
  # Forward and backward cost at least 6 FLOPs per weight of every matmul per token.
  rows, length = result['batch_shape']
  matmul_weights = layers * (2 * (4 * d * d + 2 * d * f) + 4 * d * d) + v * d
  assert result['flops_per_step'] > 6 * matmul_weights * rows * length
  assert result['flops_per_step'] < 3 * 6 * matmul_weights * rows * length
  assert result['flops_per_step_per_device'] == result['flops_per_step'] / 8
  memory = result['memory_per_device_bytes']
  assert memory['argument'] > 0 and memory['temp'] > 0
  assert math.isclose(memory['total'], memory['argument'] + memory['output'] + memory['temp']
                      - memory['alias'])
  # The same arithmetic scanned, in two micro-batches, on another mesh, in one compile (each
  # of this step for 8 CPU devices takes seconds). XLA analyses a loop's body once: the scan's
  # counted once would lose half the layers' FLOPs, the micro-batches' half of all, and either
  # only lowers the figure, so neither hides the other.
  config.model.scan_layers = True
  config.mesh.shape = (8, 1, 1)
  config.opt.grad_accum_steps = 2
  scanned = dry_run_lib.dry_run(config)
  assert (scanned['scan_layers'], scanned['remat'], scanned['grad_accum_steps']) == (
      True, 'none', 2)
  assert scanned['params'] == result['params'] and scanned['mesh']['data'] == 8
  assert scanned['flops_per_step'] == pytest.approx(result['flops_per_step'], rel=1e-3)
  assert scanned['compile_seconds'] > 0 and scanned['memory_per_device_bytes']['temp'] > 0


@pytest.mark.slow
def test_tiny_compiles_for_a_tpu_slice(libtpu, tiny_config):
  del libtpu
  result = dry_run_lib.dry_run(tiny_config, 'tpu:v5e-8')
  assert (result['device_kind'], result['device_count'], result['dtype']) == (
      'TPU v5 lite', 8, 'float32')
  assert result['compiler'].startswith('libtpu ')
  assert result['usable_memory_bytes'] == 16 * 2**30
  _check_state_and_step(result, result['params'])
  # Data parallelism: the float32 gradient of every weight is summed over the 8 devices, and
  # nothing else of that size crosses them.
  assert set(result['collectives']) == {'all-reduce'}
  reduced = result['collectives']['all-reduce']['bytes']
  assert 4 * result['params'] <= reduced <= 4 * result['params'] * 1.01 + 1024
  table = report_lib.table(result)
  assert 'tpu:v5e-8' in table and 'train_step' in table and 'predicted' in table
  _check_by_part(result, table)


def _check_by_part(result, table):
  """The train step's bytes by part add up to its bytes; every part of the model has some;
  the optimiser writes each weight and both of Adam's moments; the collectives' row is the
  gradients' all-reduce; the heaviest kernels come heaviest first."""
  train = result['programs']['train_step']
  parts = train['cost_by_part']
  assert {'embedding', 'attention', 'feed-forward', 'layer norms', 'loss', 'optimiser'} <= set(
      parts)
  kernel_bytes = sum(row['hbm_bytes'] for part, row in parts.items() if part != 'collectives')
  assert kernel_bytes == pytest.approx(result['hbm_bytes_per_device'], rel=1e-3)
  assert parts['optimiser']['hbm_bytes'] >= 3 * 4 * result['params']
  assert parts['collectives']['hbm_bytes'] == pytest.approx(
      sum(row['bytes'] for row in result['collectives'].values()), rel=1e-3)
  assert sum(row['seconds'] for part, row in parts.items() if part != 'collectives') == \
      pytest.approx(result['prediction']['kernel_seconds'], rel=1e-2)
  heaviest = train['heaviest_kernels']
  assert len(heaviest) == 10 and heaviest[0]['seconds'] >= heaviest[-1]['seconds'] > 0
  assert 'by part' in table and heaviest[0]['kernel'] in table


@pytest.mark.slow
def test_auto_dtype_is_the_targets_and_its_gradients_are_summed_in_bfloat16(libtpu,
                                                                              tiny_config):
  """'auto' resolves for the TPU compiled for, not for this CPU; in bfloat16 the weight
  gradients are bfloat16 matmul outputs, and XLA sums them over the devices before they
  become float32: 2 bytes per weight cross the interconnect (docs/accelerators.md)."""
  del libtpu
  tiny_config.model.dtype = 'auto'
  result = dry_run_lib.dry_run(tiny_config, 'tpu:v5e-8', evaluation=False)
  assert result['dtype'] == 'bfloat16'
  reduced = result['collectives']['all-reduce']['bytes']
  assert 2 * result['params'] <= reduced < 2.2 * result['params']


@pytest.mark.slow
def test_tiny_compiles_for_eight_h100s(cuda_compiler, tiny_config):
  del cuda_compiler
  tiny_config.mesh.shape = (2, 4, 1)
  result = dry_run_lib.dry_run(tiny_config, 'gpu:h100x8')
  assert result['device_kind'] == 'NVIDIA H100 80GB HBM3' and result['platform'] == 'gpu'
  assert result['compiler'].startswith('jax-cuda12-plugin ')
  # JAX preallocates 75% of a GPU's memory: that is what a step may use.
  assert result['usable_memory_bytes'] == int(0.75 * targets.CHIPS['h100'].memory_bytes)
  train = result['programs']['train_step']['memory_per_device_bytes']
  # FSDP over 4: each device holds a quarter of the state (plus the replicated biases and
  # norms, all of whose sizes are d_model or d_ff, which do divide by 4 but are tiny).
  assert 3 * 4 * result['params'] / 4 <= train['argument'] < 3 * 4 * result['params'] / 2
  assert {'all-gather', 'reduce-scatter'} <= set(result['collectives'])
  assert result['compiled_flops_per_device'] * 8 == pytest.approx(
      result['analytic_flops_per_step'], rel=1e-6)


def _train_step_hlo(config, attention_impl: str, target: str) -> tuple[str, int, int]:
  """The optimised HLO of `config`'s train step with `attention_impl`, compiled for `target`'s
  compile-only devices, and the rows and length of the abstract batch it was compiled for."""
  config.model.attention_impl = attention_impl
  mesh = sharding.make_mesh(config.mesh, targets.devices(targets.parse(target)))
  setup = setup_lib.build(config, 12, mesh=mesh)
  assert setup.model_config.attention_impl == attention_impl
  batch, rows, length = dry_run_lib.abstract_batch(config, mesh)
  compiled = setup.train_step.lower(setup.abstract_state, batch,
                                    jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
  return compiled.as_text(), rows, length


def _collective_shapes(hlo: str, kind: str) -> list[str]:
  """The printed result shapes of the program's `kind` collectives (sync or started)."""
  found = []
  for line in hlo.splitlines():
    head, _, rest = line.partition(f' {kind}')
    if rest.startswith(('(', '-start(')) and ' = ' in head:
      found.append(head.split(' = ', 1)[1])
  return found


def _combined_bytes(shape: str, kind: str) -> tuple[int, int]:
  """(arrays, bytes of the whole arrays) of one started collective's printed shape, which is
  (operands, results): a reduce-scatter's operands (the gradients before scattering), an
  all-gather's results (the gathered weights)."""
  operands, results = hlo_text.tuple_elements(shape)[:2]
  whole = operands if kind == 'reduce-scatter' else results
  return len(hlo_text.tuple_elements(whole)), hlo_text.total_bytes(whole)


@pytest.mark.slow
def test_fsdp_on_gpus_gathers_the_embedding_in_bfloat16_and_combines_as_asked(
    cuda_compiler, tiny_config, no_persistent_cache):
  """FSDP over 8 H100s: the [vocab, d_model] table crosses the links in bfloat16 (XLA gathered
  it in float32 and cast it inside the lookup until model.Embed cast it where it is split),
  and mesh.collective_combine_bytes caps the whole arrays each combined collective carries:
  the gradients into a reduce-scatter (XLA counts its scattered result, 1/8 of them) and the
  weights out of an all-gather, so there are more, smaller ones that the roofline can run
  beside the backward's kernels."""
  del cuda_compiler, no_persistent_cache
  config = tiny_config
  config.model.dtype, config.mesh.shape = 'bfloat16', (1, 8, 1)
  config.model.d_model, config.model.d_ff = 128, 256
  # The table's gathers, as [vocab, width] or transposed (_train_step_hlo's vocabulary: 12).
  table = re.compile(r'(bf16|f32)\[(12,128|128,12)\]')
  hlo_default, _, _ = _train_step_hlo(config, 'einsum', 'gpu:h100x8')
  dtypes = {found.group(1) for shape in _collective_shapes(hlo_default, 'all-gather')
            for found in table.finditer(shape)}
  assert dtypes == {'bf16'}, dtypes
  cap = 3 * 128 * 256 * 2  # Three of the feed-forward's [128, 256] bfloat16 gradients.
  config.mesh.collective_combine_bytes = cap
  hlo_small, _, _ = _train_step_hlo(config, 'einsum', 'gpu:h100x8')
  combined = len(_collective_shapes(hlo_default, 'reduce-scatter'))
  capped = len(_collective_shapes(hlo_small, 'reduce-scatter'))
  assert capped > combined >= 1, (capped, combined)
  for kind in ('reduce-scatter', 'all-gather'):
    carried = [_combined_bytes(shape, kind) for shape in _collective_shapes(hlo_small, kind)]
    # An array over the cap goes alone; combined ones stay within it, and some do combine.
    assert all(size <= cap for arrays, size in carried if arrays > 1), (kind, carried)
    assert any(arrays > 1 for arrays, _ in carried), (kind, carried)
  target = targets.parse('gpu:h100x8')
  for hlo in (hlo_default, hlo_small):
    prediction = roofline.predict(hlo_cost.analyse(hlo, 8), target, [0] * 8)
    assert 0 <= prediction.overlapped_collective_seconds <= prediction.collective_seconds


@pytest.mark.slow
def test_cudnn_attention_lowers_for_an_h100(cudnn_compiler, tiny_config, no_persistent_cache):
  """cuDNN's fused attention, with the sequence-length path of padded rows, in the train step."""
  del cudnn_compiler, no_persistent_cache
  config = tiny_config
  config.model.dtype, config.model.attention_dropout = 'bfloat16', 0.0
  hlo, rows, length = _train_step_hlo(config, 'cudnn', 'gpu:h100x1')
  calls = [line for line in hlo.splitlines() if 'custom_call_target="__cudnn$fmha' in line]
  # Forward and backward of the encoder's, decoder's and cross-attention.
  assert len([c for c in calls if 'Backward' in c]) == 3
  assert len([c for c in calls if 'Backward' not in c]) == 3
  # Counted as flash attention: 2 (forward) + 5 (backward) matmuls of B Q K H D each.
  cost = hlo_cost.analyse(hlo, 1)
  fused = sum(k.flops for k in cost.kernels if 'cudnn' in k.name or 'attention' in k.name)
  assert fused == 3 * 2 * (2 + 5) * rows * length * length * config.model.d_model


@pytest.mark.slow
def test_flash_attention_compiles_for_an_h100_inside_the_train_step(cuda_compiler, tiny_config,
                                                                     no_persistent_cache):
  """t2t_jax's flash kernels with attention dropout, compiled by XLA's Triton path for an
  H100 (not interpreted): forward, dq and dkv for each of the three attention layers, counted
  as 2 + 3 + 4 matmuls of B Q K H D (the lengths padded to the kernels' blocks)."""
  del cuda_compiler, no_persistent_cache
  config = tiny_config
  config.model.dtype, config.model.attention_dropout = 'bfloat16', 0.1
  hlo, rows, length = _train_step_hlo(config, 'flash', 'gpu:h100x1')
  calls = [line for line in hlo.splitlines() if '__gpu$xla.gpu.triton' in line]
  for kernel in ('t2t_flash_fwd', 't2t_flash_dq', 't2t_flash_dkv'):
    assert len([c for c in calls if f'"{kernel}"' in c.replace('\\"', '"')]) == 3, kernel
  cost = hlo_cost.analyse(hlo, 1)
  flash = sum(k.flops * k.count for k in cost.kernels if '__gpu' not in k.name and
              k.opcode == 'custom-call')
  block = flash_attention._block(length, 64)  # pylint: disable=protected-access
  padded = -(-length // block) * block
  assert flash == 3 * 2 * (2 + 3 + 4) * rows * padded * padded * config.model.d_model


@pytest.mark.slow
def test_the_fused_loss_compiles_for_an_h100_inside_the_train_step(cuda_compiler, tiny_config,
                                                                 no_persistent_cache):
  """opt.loss_impl='fused': its two kernels compiled by XLA's Triton path for an H100 (not
  interpreted), each counted as one matrix product of the tokens by the padded vocabulary,
  and no [tokens, vocab] logits left but the backward's gradient, which the two library
  matrix products read."""
  del cuda_compiler, no_persistent_cache
  config = tiny_config
  config.model.dtype, config.opt.loss_impl = 'bfloat16', 'fused'
  hlo, rows, length = _train_step_hlo(config, 'einsum', 'gpu:h100x1')
  calls = [line for line in hlo.splitlines() if '__gpu$xla.gpu.triton' in line]
  for kernel in ('t2t_fused_loss_fwd', 't2t_fused_loss_grad'):
    assert len([c for c in calls if f'"{kernel}"' in c.replace('\\"', '"')]) == 1, kernel
  cost = hlo_cost.analyse(hlo, 1)
  fused = [k for k in cost.kernels if k.opcode == 'custom-call' and '__gpu' not in k.name]
  tokens, width = rows * length, config.model.d_model
  padded_vocab = fused[0].flops / (2 * tokens * width)
  assert len(fused) == 2 and fused[0].flops == fused[1].flops
  assert padded_vocab == int(padded_vocab) and 12 <= padded_vocab < 12 + 64


def test_sizes_and_times_read_without_exponents():
  assert report_lib.human_bytes(1010 * 2**20) == '1010 MiB'
  assert report_lib.human_bytes(2.314 * 2**30) == '2.31 GiB'
  assert report_lib.human_bytes(100) == '100 B'
  assert report_lib.human_seconds(0.0012345) == '1.23 ms'
  assert report_lib.human_seconds(2.5) == '2500 ms'
  assert report_lib.human_seconds(0.000999) == '999 us'
  assert report_lib.human_bytes(999.7 * 2**20) == '1000 MiB'  # Rounds up to four digits.
  assert report_lib.human_seconds(0.9997) == '1000 ms'


@pytest.mark.slow
def test_two_slices_reduce_over_the_data_centre_network(libtpu, tiny_config):
  del libtpu
  tiny_config.mesh.shape = (2, 8, 1)  # config.mesh.dcn_data left at 1: the target sets it.
  tiny_config.data.batch_tokens = 512
  devices = targets.devices(targets.parse('tpu:2xv5e-8'))
  with pytest.raises(ConfigError, match=r'the devices form 2 TPU slices.*dcn_data=2'):
    sharding.make_mesh(tiny_config.mesh, devices)  # Real slices without it: one line.
  result = dry_run_lib.dry_run(tiny_config, 'tpu:2xv5e-8', evaluation=False)
  assert result['device_count'] == 16
  prediction = result['prediction']
  assert 0 < prediction['network_collective_seconds'] <= prediction['collective_seconds']


@pytest.mark.slow
def test_a_step_that_does_not_fit_is_one_error_line():
  # No BLEU in the evaluation, so no search to compile: the train step is what is refused,
  # and the search of a model this size takes the TPU compiler most of the command's time.
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py', '--dry_run',
             '--dry_run_target=tpu:v5e-8', '--config.model.d_model=8192',
             '--config.model.d_ff=32768', '--config.model.num_heads=8', '--compilation_cache=',
             '--config.eval.bleu_sentences=0']
  run = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=600)
  if 'libtpu' in run.stderr and 'not installed' in run.stderr:
    pytest.skip('libtpu is not installed')
  assert run.returncode == 1, run.stderr[-2000:]
  error = run.stderr.strip().splitlines()[-1]
  assert error.startswith('error: the train_step does not fit a tpu:v5e-8 device')
  assert 'Traceback' not in run.stderr
  for advice in ('config.mesh.shape=(4,2,1)', 'config.model.remat=full',
                 'config.opt.grad_accum_steps=2'):
    assert advice in error
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert result['fits'] is False
  assert 'compiler_error' in result['programs']['train_step']
  assert 'refused by the compiler' in run.stdout


@pytest.mark.slow
def test_mesh_search_ranks_the_meshes_that_fit_by_predicted_time(libtpu, tiny_config):
  """On the 2 chips of a v4-4 with one head: two splits, each a compile, then the best
  unrolled, the best with its update split over 'data' if it has one, then the winner's eval
  step and search (each candidate costs seconds; the splits of more chips and heads are
  test_candidate_splits')."""
  del libtpu
  tiny_config.model.num_heads = 1
  ranked = mesh_choice.search(tiny_config, 'tpu:v4-4')
  meshes = {(c.mesh, c.scan_layers, c.remat) for c in ranked}
  # Every split of the 2 chips, scanned (no tensor split: it must divide the one head); the
  # best unrolled.
  assert {m for m, scan, remat in meshes if scan} == set(mesh_choice.splits(2, 1)) == {
      (2, 1, 1), (1, 2, 1)}
  assert any(not scan for _, scan, _ in meshes)
  # The best without mesh.shard_update, again with it where it splits the batch over 'data'.
  best_whole = min((c for c in ranked if c.fits and not c.shard_update),
                   key=lambda c: c.step_seconds)
  assert [(c.mesh, c.scan_layers, c.remat) for c in ranked if c.shard_update] == (
      [(best_whole.mesh, best_whole.scan_layers, best_whole.remat)]
      if best_whole.mesh[0] > 1 else [])
  fitting = [c for c in ranked if c.fits]
  assert fitting and ranked[:len(fitting)] == fitting
  times = [c.step_seconds for c in fitting]
  assert times == sorted(times)
  assert set(ranked[0].result['programs']) == {'train_step', 'eval_step', 'search'}
  assert mesh_choice.table(ranked).splitlines()[1].lstrip().startswith('1 ')


@pytest.mark.slow
def test_the_update_split_over_data_keeps_less_state_on_a_tpu_slice(libtpu, tiny_config):
  """mesh.shard_update compiled for the 2 chips of a v4-4 at (2, 1, 1): the state each chip
  keeps between steps (the train step's arguments) shrinks by Adam's moments' half; the dry
  run reports the split. (Where the mesh search tries it: the test with a stand-in compiler,
  test_the_mesh_search_splits_the_update_before_it_rematerialises.)"""
  del libtpu
  tiny_config.mesh.shape = (2, 1, 1)
  held = {}
  for split in (False, True):
    tiny_config.mesh.shard_update = split
    result = dry_run_lib.dry_run(tiny_config, 'tpu:v4-4', evaluation=False)
    assert result['shard_update'] == split and result['programs']['train_step']['fits']
    held[split] = result['memory_per_device_bytes']['argument']
  params = result['params']  # float32 weights; Adam's two moments of each, halved.
  # Within the padding of the TPU's tiled layouts.
  assert held[False] - held[True] == pytest.approx(2 * 4 * params / 2, rel=0.1), held


@pytest.mark.slow
@pytest.mark.parametrize('changes', [
    {'model.positions': 'relative', 'model.attention_pattern': 'full,local'},
    {'model.moe_experts': 4, 'model.moe_layers': 'all', 'mesh.shape': (2, 1, 1, 4),
     'model.attention_pattern': 'compressed'},
    {'model.kind': 'decoder_only', 'data.max_len': 32, 'model.positions': 'rotary'},
    {'data.batching': 'packed', 'data.max_len': 32, 'eval.beam_size': 4,
     'model.scan_layers': True, 'model.remat': 'full', 'mesh.shape': (2, 2, 2)},
], ids=lambda changes: ','.join(f'{k}={v}' for k, v in changes.items()))
def test_family_members_compile_for_a_tpu_slice(libtpu, tiny_config, changes):
  """Every program of each family member: the eval and decode paths too."""
  del libtpu
  for key, value in changes.items():
    section, name = key.split('.')
    setattr(getattr(tiny_config, section), name, value)
  result = dry_run_lib.dry_run(tiny_config, 'tpu:v5e-8')
  assert result['fits'] and set(result['programs']) == {'train_step', 'eval_step', 'search'}
  assert result['prediction']['unknown_trip_counts'] == 0


def _bert_tiny(variant: str):
  """configs/bert.py:tiny (masked LM with next-sentence prediction) or its fine-tuning run,
  labels given: a dry run reads no data."""
  from configs import bert  # pylint: disable=g-import-not-at-top
  config = bert.get_config(variant)
  config.model.next_sentence = variant == 'tiny'
  if variant.endswith('finetune'):
    config.data.labels = ('negative', 'neutral', 'positive')
  return config


@pytest.mark.slow
@pytest.mark.parametrize('variant', ['tiny', 'tiny,finetune'])
def test_encoder_only_models_compile_for_a_tpu_slice(libtpu, variant):
  """Pre-training and fine-tuning compile for 8 TPU chips, data-parallel: every weight's
  float32 gradient is summed over them, and the compiled FLOPs are the analytic count's."""
  del libtpu
  result = dry_run_lib.dry_run(_bert_tiny(variant), 'tpu:v5e-8')
  assert result['fits'] and set(result['programs']) == {'train_step', 'eval_step'}
  reduced = result['collectives']['all-reduce']['bytes']
  assert 4 * result['params'] <= reduced <= 4 * result['params'] * 1.01 + 1024
  assert result['compiled_flops_per_device'] * 8 == pytest.approx(
      result['analytic_flops_per_step'], rel=0.15)


@pytest.mark.slow
def test_encoder_only_pretraining_compiles_for_eight_h100s(cuda_compiler):
  del cuda_compiler
  config = _bert_tiny('tiny')
  config.mesh.shape = (2, 4, 1)
  result = dry_run_lib.dry_run(config, 'gpu:h100x8')
  assert result['fits'] and result['platform'] == 'gpu'
  assert {'all-gather', 'reduce-scatter'} <= set(result['collectives'])


@pytest.mark.slow
def test_splash_attention_compiles_for_a_tpu_inside_the_train_step(libtpu, tiny_config,
                                                                    no_persistent_cache):
  """The Pallas kernel, compiled by the TPU compiler (not interpreted): forward, dq and dkv
  kernels for each of the three attention layers, counted as flash attention's FLOPs."""
  del libtpu, no_persistent_cache
  config = tiny_config
  config.model.attention_dropout = 0.0
  hlo, rows, _ = _train_step_hlo(config, 'pallas', 'tpu:v5e-8')
  for kernel in ('splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv'):
    assert len([line for line in hlo.splitlines()
                if f'%{kernel}' in line and 'tpu_custom_call' in line]) == 3, kernel
  cost = hlo_cost.analyse(hlo, 8)
  splash = sum(k.flops * k.count for k in cost.kernels if k.name.startswith('splash'))
  # 18 B H Q K D per layer (4 forward, 6 dq, 8 dkv) on the rows each device holds, the
  # lengths padded to the kernel's 128-wide blocks.
  heads, head_dim, padded = config.model.num_heads, 32 // config.model.num_heads, 128
  assert splash == 3 * 18 * (rows // 8) * heads * padded * padded * head_dim


@pytest.mark.slow
def test_flash_attention_compiles_for_a_tpu_inside_the_train_step(libtpu, tiny_config,
                                                                   no_persistent_cache):
  """t2t_jax's flash kernels with attention dropout, compiled by Mosaic for a v5e slice (not
  interpreted; flash_attention_tpu.py): forward, dq and dkv for each of the three attention
  layers, counted as 2 + 3 + 4 matmuls of B Q K H D on each device's rows, the lengths padded
  to the kernels' 128-wide blocks; no [B, H, Q, K] array left in the program."""
  del libtpu, no_persistent_cache
  config = tiny_config
  config.model.dtype, config.model.attention_dropout = 'bfloat16', 0.1
  hlo, rows, length = _train_step_hlo(config, 'flash', 'tpu:v5e-8')
  for kernel in ('t2t_flash_fwd', 't2t_flash_dq', 't2t_flash_dkv'):
    assert len([line for line in hlo.splitlines()
                if kernel in line.split(' = ')[0] and 'tpu_custom_call' in line]) == 3, kernel
  cost = hlo_cost.analyse(hlo, 8)
  flash = sum(k.flops * k.count for k in cost.kernels if 't2t_flash' in k.name)
  padded = 128
  assert flash == 3 * 2 * (2 + 3 + 4) * (rows // 8) * padded * padded * config.model.d_model
  heads = config.model.num_heads
  scores = re.compile(rf'\[{rows // 8},{heads},{length},{length}\]|'
                      rf'\[{rows // 8},{heads},{padded},{padded}\]')
  assert not [line for line in hlo.splitlines() if scores.search(line.split(' = ')[-1][:80])]


@pytest.mark.slow
@pytest.mark.parametrize('length, causal', [(640, True), (1024, False), (200, False)])
def test_the_tpu_flash_kernels_compile_over_several_blocks(libtpu, no_persistent_cache, length,
                                                           causal):
  """Rows of 5 blocks of 128, 2 of 512 and one padded block: the kernels' loops over key and
  query blocks (dynamic slices along sublanes and lanes) compile through Mosaic for a v5e,
  forward and backward."""
  del libtpu, no_persistent_cache
  mesh = jax.sharding.Mesh(np.array(targets.devices(targets.parse('tpu:v5e-1'))), ('x',))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def loss(q, k, v, valid_BL):
    rows = pallas_attention.self_rows(valid_BL, None, causal=causal)
    out = flash_attention.flash_attention(q, k, v, rows, 0.1, jnp.uint32(3))
    return (out.astype(jnp.float32) ** 2).sum()
  shapes = [jax.ShapeDtypeStruct((2, length, 4, 64), jnp.bfloat16)] * 3 + [
      jax.ShapeDtypeStruct((2, length), jnp.bool_)]
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(whole,) * 4).lower(
        *shapes).compile().as_text()
  assert sum('tpu_custom_call' in line and 't2t_flash' in line.split(' = ')[0]
             for line in hlo.splitlines()) == 3


@pytest.mark.slow
def test_a_compile_for_a_target_stays_out_of_the_persistent_cache(libtpu, tmp_path):
  """JAX decides once per process whether to use the persistent cache, so turning it off for a
  compile-only target must reset that decision: otherwise the target's program is written to
  the cache, and read back by the next run with a warning (seen in CI's second run)."""
  del libtpu
  saved = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update('jax_compilation_cache_dir', str(tmp_path))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  compilation_cache.reset_cache()
  try:
    jax.jit(lambda x: jnp.sin(x) * 3.0).lower(jnp.ones(5)).compile()  # Here: cached.
    on_cpu = set(os.listdir(tmp_path))
    assert on_cpu
    mesh = jax.sharding.Mesh(np.array(targets.devices(targets.parse('tpu:v5e-1'))), ('x',))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    lower = lambda: jax.jit(lambda x: jnp.cos(x) * 5.0, in_shardings=whole).lower(
        jax.ShapeDtypeStruct((7,), jnp.float32))
    program = dry_run_lib._compile(lower, mesh)  # pylint: disable=protected-access
    assert program.cost is not None
    assert set(os.listdir(tmp_path)) == on_cpu
  finally:
    jax.config.update('jax_compilation_cache_dir', saved[0])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', saved[1])
    compilation_cache.reset_cache()


@pytest.mark.parametrize('devices, heads, slices, expected', [
    (4, 2, 1, [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]),
    (8, 16, 2, [(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4)]),
])
def test_candidate_splits(devices, heads, slices, expected):
  assert mesh_choice.splits(devices, heads, slices) == expected


def test_the_mesh_search_splits_the_update_before_it_rematerialises(tiny_config, monkeypatch):
  """Candidates in order, from a stand-in for the compiler: a data mesh that does not fit is
  compiled with its update split first, and rematerialised only if that does not fit either;
  a mesh without a data axis goes straight to remat. (2, 1, 1) fits split, (1, 2, 1) with
  remat 'full' only."""
  compiled = []

  def fake_dry_run(config, target, evaluation=True):
    mesh, update = tuple(config.mesh.shape[:3]), config.mesh.shard_update
    compiled.append((mesh, config.model.scan_layers, config.model.remat, update, evaluation))
    fits = (mesh == (2, 1, 1) and update) or config.model.remat == 'full'
    step = {(2, 1, 1): 2.0, (1, 2, 1): 1.0}[mesh] + (0.5 if config.model.scan_layers else 0)
    prediction = {'step_seconds': step, 'bound': 'memory', 'target_tokens_per_second': 1,
                  'mfu': 0.1}
    return {'fits': fits, 'prediction': prediction, 'programs': {'train_step': {
        'fits': fits, 'needs_bytes': 1, 'compile_seconds': 0.0}}}
  monkeypatch.setattr(mesh_choice.dry_run_lib, 'dry_run', fake_dry_run)
  tiny_config.model.num_heads = 1  # No tensor split: the two meshes above.
  ranked = mesh_choice.search(tiny_config, 'tpu:v4-4')
  assert [c[:4] for c in compiled if not c[4]] == [
      ((2, 1, 1), True, 'none', False), ((1, 2, 1), True, 'none', False),
      ((2, 1, 1), True, 'none', True),  # The data mesh, its update split: it fits.
      ((1, 2, 1), True, 'dots', False), ((1, 2, 1), True, 'full', False),
      ((1, 2, 1), False, 'full', False)]  # The best (1.5 s) unrolled: 1.0 s.
  assert compiled[-1] == ((1, 2, 1), False, 'full', False, True)  # The winner, whole.
  assert [(c.mesh, c.scan_layers, c.remat, c.shard_update) for c in ranked if c.fits] == [
      ((1, 2, 1), False, 'full', False), ((1, 2, 1), True, 'full', False),
      ((2, 1, 1), True, 'none', True)]


def test_a_refused_program_counts_what_the_compiler_says_it_needs():
  refused = dry_run_lib.Program(1.0, {}, None, 'Ran out of memory on HBM, the total memory '
                                'required for HLO temporaries (24.02G) exceeds available HBM '
                                '(15.75G)')
  report = refused.report(16 * 2**30, 0)
  assert not report['fits'] and report['needs_bytes'] == int(24.02 * 2**30)
  fitting = dry_run_lib.Program(1.0, {'total': 100, 'generated_code': 20}, None)
  assert fitting.report(200, 50) == {'compile_seconds': 1.0, 'needs_bytes': 170, 'fits': True,
                                     'memory_per_device_bytes': fitting.memory}
  assert not fitting.report(160, 50)['fits']


@pytest.mark.slow
def test_fsdp_embedding_gradient_needs_no_full_rematerialisation(cuda_compiler, tiny_config,
                                                                 capfd):
  """The embedding lookup's gradient under FSDP: XLA's partitioner logged "Involuntary full
  rematerialization" (every row gathered to every device) until model.Embed read its table
  whole along 'embed'; on this mesh it now looks up by columns, which needs no resharding."""
  del cuda_compiler
  config = tiny_config
  config.mesh.shape, config.data.batch_tokens = (4, 2, 1), 1024
  config.model.d_model, config.model.d_ff = 128, 256
  capfd.readouterr()
  result = dry_run_lib.dry_run(config, 'gpu:h100x8', evaluation=False)
  assert result['fits']
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
