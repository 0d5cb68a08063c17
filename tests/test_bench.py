"""bench/: compare.py end to end on a tiny shape against the reference (if it is here), the
helpers it shares, its flags, no bench module named as one of the reference's, accelerator.py
in its CPU mode and its table, accelerator_compare.py at its tiny size. The import graph,
bench/ included: tests/test_architecture.py."""

import json
import math
import os
import re
import subprocess
import sys

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from conftest import load_script
from conftest import ROOT
from t2t_jax import runtime

REFERENCE_DIR = os.path.join(ROOT, '..', 'shared', 'anchor', 'flax_wmt')


def _load(name: str):
  return load_script(f'bench/{name}.py')


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(REFERENCE_DIR, 'models.py')),
                    reason=f"Flax's WMT example (the reference) is not at {REFERENCE_DIR}")
def test_compare_runs_one_round_on_a_tiny_packed_shape(capsys):
  compare = _load('compare')
  [result] = compare.compare_shapes(compare.parse_flags([
      '--shapes=tiny_packed', '--rounds=1', '--steps=1', '--warmup=1',
      f'--reference_dir={REFERENCE_DIR}']))
  assert json.loads(capsys.readouterr().out.strip()) == result
  assert {'shape', 'vocab', 'd_model', 'rows', 'length', 'device_kind', 'device_count', 'dtype',
          'ratio_per_round', 'ratio_median', 'ratio_min', 'ratio_max',
          'matmul_flops_per_second', 't2t_jax', 'reference'} <= set(result)
  for ratio in result['ratio_per_round'] + [result['ratio_median']]:
    assert 0 < ratio < math.inf
  t2t, reference = result['t2t_jax'], result['reference']
  for side in (t2t, reference):
    assert {'step_seconds', 'tokens_per_second', 'xla_flops_per_step', 'model_flops_per_step',
            'share_of_matmul', 'mfu', 'compile_seconds'} <= set(side)
    assert 0 < side['share_of_matmul'] < math.inf and side['mfu'] is None  # No CPU peak.
    # XLA counts the matmuls and the elementwise rest: more than the model FLOPs, not double.
    assert 1 < side['xla_flops_per_step'] / side['model_flops_per_step'] < 2
  # Equal work: the same parameters and model FLOPs on both sides.
  assert t2t['params'] == reference['params']
  assert t2t['model_flops_per_step'] == reference['model_flops_per_step']


def test_cpu_copies_times_the_in_place_step_beside_the_usual_and_the_undonated_one():
  cpu_copies, common = _load('cpu_copies'), _load('common')
  result = cpu_copies.time_shape('tiny', cpu_copies.parse_flags(['--rounds=2', '--steps=1']),
                                 common.Matmul(256))
  # runtime.train_compiler_options on one CPU device: XLA's usual copy insertion copies the
  # donated weights, region analysis none, nor does a step that donates nothing; all three
  # compute the same state. The tiny model is under the product's threshold.
  copies = result['weight_copies']
  assert copies['usual'] > 0 and copies['in_place'] == copies['not_donated'] == 0
  assert result['same_state_bit_for_bit'] and result['product_side'] == 'usual'
  assert 0 < result['weight_bytes'] < 64 << 20
  seconds = result['step_seconds']
  for side in ('in_place', 'not_donated'):
    assert len(result['speed_up_over_usual'][side]) == len(seconds[side]) == 2
    assert result['speed_up_median'][side] == pytest.approx(
        sum(result['speed_up_over_usual'][side]) / 2, rel=1e-3)  # Two rounds: their mean.
  assert len(result['matmul_flops_per_second']) == 2
  assert runtime.CPU_IN_PLACE_WEIGHT_BYTES == 64 << 20  # The product's threshold restored.


def test_packing_cuts_rows_into_segments_with_restarting_positions():
  batch = _load('compare').make_batch(_load('common').SHAPES['m30k_packed'], rows=5, length=64)
  segments, positions = batch['inputs_segments'], batch['inputs_positions']
  assert (segments[:, 0] == 1).all() and (segments[:, -1] == 4).all()
  assert (segments[:, 1:] - segments[:, :-1] >= 0).all()
  starts = segments[:, 1:] != segments[:, :-1]
  assert (positions[:, 1:][starts] == 0).all()
  assert (positions[:, 1:][~starts] == positions[:, :-1][~starts] + 1).all()


def test_t2t_config_takes_the_recipe_dropout_and_overrides():
  compare, common = _load('compare'), _load('common')
  args = compare.parse_flags(['--recipe=m30k', '--t2t_override', 'model.norm=post',
                              '--t2t_override', 'opt.warmup_steps=100'])
  config = compare.shape_config(common.SHAPES['m30k'], args)
  assert (config.model.dropout, config.model.attention_dropout,
          config.model.relu_dropout) == (0.3, 0.0, 0.0)
  assert config.model.norm == 'post' and config.opt.warmup_steps == 100
  assert (config.model.d_model, config.model.num_encoder_layers) == (128, 4)
  with pytest.raises(ValueError, match='model.no_such_key'):
    common.apply_override(config, 'model.no_such_key=1')


def test_compare_flags_keep_their_names_and_defaults():
  compare = _load('compare')
  args = compare.parse_flags([])
  assert {name: args[name].value for name in args} == {
      'shapes': ['small', 'm30k', 'm30k_packed', 'base'], 'rows': 0, 'length': 0,
      'dtype': 'float32', 'dropout': 0.1, 'attention_dropout': 0.1, 'relu_dropout': 0.1,
      'recipe': 'none', 'norm': 'pre', 't2t_override': [], 'rounds': 5, 'steps': 3,
      'warmup': 2, 'reference_dir': '../shared/anchor/flax_wmt'}
  args = compare.parse_flags(['--shapes=tiny,m30k', '--rounds', '7', '--steps=2'])
  assert (args.shapes, args.rounds, args.steps) == (['tiny', 'm30k'], 7, 2)
  with pytest.raises(flags.IllegalFlagValueError, match='no_such_shape'):
    compare.parse_flags(['--shapes=small,no_such_shape'])


@pytest.mark.parametrize('sentences, beam_size, source_length', [(2, 1, 5), (3, 4, 7)])
def test_matmul_floor_does_the_matrix_products_it_claims(sentences, beam_size, source_length):
  """XLA's count of the floor's FLOPs is the formula's, plus a little elementwise work.

  At two steps the loop's body (counted once by XLA) runs once; the formula also grows
  step i's self-attention by i + 1 positions and runs the first step on one row per sentence.
  """
  floor, shape = _load('floor'), _load('common').Shape(96, 32, 80, 2, 4, 0, 0)
  search_floor, x = floor.search_floor(shape, sentences, beam_size, source_length, 2)
  counted = _load('common').xla_flops(search_floor.lower(x).compile())
  e, f, layers, v, s = 32, 80, 2, 96, source_length
  tokens, rows = sentences * s, [sentences, sentences * beam_size]
  by_hand = layers * (4 * 2 * tokens * e * e + 2 * 2 * tokens * e * f  # The encoder.
                      + 2 * 2 * tokens * s * e + 2 * 2 * tokens * e * e)  # Cross keys/values.
  for i, r in enumerate(rows):
    by_hand += layers * 2 * r * e * (6 * e + 2 * f + 2 * s + 2 * (i + 1)) + 2 * r * e * v
  assert by_hand == floor.floor_flops(shape, sentences, beam_size, source_length, 2)
  assert 0.97 <= counted / by_hand < 1.05
  assert search_floor(x).shape == (sentences * beam_size, e)


def test_op_profile_splits_matrix_products_from_other_ops():
  common = _load('common')
  a = jnp.ones((256, 256))
  matmuls = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda _, y: (y @ a) * 1e-3, a))
  elementwise = jax.jit(lambda a: jnp.tanh(jnp.exp(a * 0.5) + 1.0))
  for fn in (matmuls, elementwise):
    fn(a).block_until_ready()  # Compiled before the traced call.
  heavy = common.op_profile(lambda: matmuls(a).block_until_ready())
  light = common.op_profile(lambda: elementwise(a).block_until_ready())
  assert heavy['matmul_op_seconds'] > 0.5 * heavy['op_seconds'] > 0
  assert light['matmul_op_seconds'] == 0 < light['op_seconds']
  assert not any(kind.startswith(('dot', 'ynn_fusion')) for kind in light['top_op_kinds'])
  for profile in (heavy, light):
    assert profile['wall_seconds'] > 0 and len(profile['top_op_kinds']) <= 5


def test_no_bench_module_shadows_the_references_modules():
  """flax_reference imports the reference's modules by bare name, with bench/ on sys.path."""
  bench = {name[:-3] for name in os.listdir(os.path.join(ROOT, 'bench')) if name.endswith('.py')}
  assert not bench & set(_load('flax_reference').REFERENCE_MODULES)


# bench/accelerator.py in its CPU mode (--size=auto is tiny on CPU), run as the command a GPU
# session runs, in a subprocess: it applies XLA flags and starts subprocesses of its own. One
# run of every part (accelerator), read by the two tests below: a process and its start-up
# (JAX, the reference's imports) once, not once per test.


@pytest.fixture(scope='module')
def accelerator(tmp_path_factory) -> list[dict]:
  """The lines of one run of every part, the A/B test of two flag sets."""
  # --token_slots reversed from tiny's own (64, 128): the train steps follow the flag.
  return _run_accelerator(tmp_path_factory.mktemp('accelerator'),
                          '--parts=train_step,attention,loss,xla_ab,decode,compare,speedrun',
                          '--ab_sets=xla_defaults,no_triton_gemm', '--models=tiny',
                          '--token_slots=128,64')


def _run_accelerator(tmp_path, *args) -> list[dict]:
  """The command's printed lines, checked to be the lines it appended to its --out file."""
  out = tmp_path / 'results' / 'accelerator.jsonl'
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=os.path.expanduser(
      os.environ.get('T2T_JAX_TEST_CACHE', '~/.cache/t2t_jax/xla')))
  env.pop('XLA_FLAGS', None)  # Not conftest's 8 simulated devices: one, as a user runs it.
  process = subprocess.run([sys.executable, os.path.join(ROOT, 'bench', 'accelerator.py'),
                            f'--out={out}', f'--anchor_dir={REFERENCE_DIR}', *args], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=600, check=False)
  assert process.returncode == 0, process.stderr[-3000:]
  printed = [json.loads(line) for line in process.stdout.splitlines() if line.startswith('{')]
  assert [json.loads(line) for line in out.read_text().splitlines()] == printed
  for line in printed:
    assert 'error' not in line, line
    assert (line['benchmark'], line['size'], line['platform'], line['device_count']) == (
        'accelerator', 'tiny', 'cpu', 1)
  return printed


def _check_step(line, rows, length):
  """A train-step line's figures agree with each other and with the batch it names."""
  assert (line['rows'], line['length'], line['target_slots']) == (rows, length, rows * length)
  # Rows are filled to more than half their length, the rest padding.
  assert rows * length // 2 < line['target_tokens'] < rows * length
  assert math.isclose(line['target_tokens_per_second'] * line['step_seconds'],
                      line['target_tokens'], rel_tol=1e-9)
  assert math.isclose(line['model_flops_per_second'] * line['step_seconds'],
                      line['model_flops_per_step'], rel_tol=1e-9)
  # The tiny shape (d 32, FFN 64, 1+1 layers, vocab 128), padding counted, by hand:
  d, ff, vocab, tokens = 32, 64, 128, rows * length
  dense = 6 * tokens * ((4 * d * d + 2 * d * ff) + 2 * d * d + (6 * d * d + 2 * d * ff) + d * vocab)
  attention = 3 * 4 * d * (tokens * length + tokens * 2 * length)
  assert line['model_flops_per_step'] == dense + attention
  assert 1 < line['xla_flops_per_step'] / line['model_flops_per_step'] < 2
  # No published peak for a CPU: MFU is null, with the reason.
  assert line['peak_flops_per_second'] is None and line['mfu'] is None
  assert "'cpu'" in line['null_reasons']['mfu']
  assert line['dtype'] == 'bfloat16' and line['compile_seconds'] > 0


@pytest.mark.slow
def test_accelerator_command_measures_train_steps_and_attention_on_cpu(accelerator):
  lines = [line for line in accelerator if line['part'] in ('train_step', 'attention')]
  steps = [line for line in lines if line['part'] == 'train_step']
  assert [(line['model'], line['rows']) for line in steps] == [('tiny', 8), ('tiny', 4)]
  for line in steps:
    _check_step(line, line['rows'], 16)
  attention = {line['impl']: line for line in lines if line['part'] == 'attention'}
  assert list(attention) == ['einsum', 'xla', 'cudnn', 'flash']
  assert 'the platform is cpu, not gpu' in attention['cudnn']['skipped']
  einsum, fused, flash = attention['einsum'], attention['xla'], attention['flash']
  for line in (einsum, fused, flash):
    _check_step(line, 4, 32)
    assert line['attention_impl'] == line['impl']
    assert line['einsum_errors_against_float32_einsum'] == einsum['errors_against_float32_einsum']
    for error in line['errors_against_float32_einsum'].values():
      assert 0 < error < 0.2  # bfloat16 is not float32, and not far from it.
  # XLA's attention on CPU computes einsum's arithmetic: no further from float32 than einsum;
  # the flash kernels (interpreted) multiply float32 blocks: no further either.
  assert einsum['equal_to_einsum'] and fused['equal_to_einsum'] and flash['equal_to_einsum']
  losses = {line['loss_impl']: line for line in accelerator if line['part'] == 'loss'}
  assert list(losses) == ['xla', 'fused']
  for line in losses.values():
    _check_step(line, 4, 16)


@pytest.mark.slow
def test_accelerator_command_and_gpu_session_refuse_unknown_names(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, OUT=str(tmp_path))
  process = subprocess.run([sys.executable, os.path.join(ROOT, 'bench', 'accelerator.py'),
                            '--models=tiny,huge', f'--out={tmp_path / "a.jsonl"}'], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300, check=False)
  assert process.returncode != 0
  assert "--models: unknown ['huge']" in process.stderr
  process = subprocess.run([sys.executable, os.path.join(ROOT, 'bench', 'accelerator.py'),
                            '--token_slots=64,12x', f'--out={tmp_path / "a.jsonl"}'], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300, check=False)
  assert process.returncode != 0
  assert '--token_slots: 64,12x is not a list of whole numbers above 0' in process.stderr
  assert 'Traceback' not in process.stderr
  assert not (tmp_path / 'a.jsonl').exists()
  process = subprocess.run(['bash', os.path.join(ROOT, 'bench', 'gpu_session.sh'), 'everything'],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                           check=False)
  assert process.returncode == 2
  assert process.stderr.splitlines() == [
      "error: bench/gpu_session.sh: unknown part 'everything' (all, tests, bench or profile)"]
  assert list(tmp_path.iterdir()) == []  # Nothing ran: not even nvidia-smi's line.


@pytest.mark.slow
def test_accelerator_command_measures_flags_decoding_reference_and_speedrun_on_cpu(accelerator):
  by_part = {}
  for line in accelerator:
    by_part.setdefault(line['part'], []).append(line)
  assert list(by_part) == ['train_step', 'attention', 'loss', 'xla_ab', 'xla_ab_summary',
                           'decode', 'compare', 'speedrun']  # Each part's lines, in the order asked.
  ab = {line['flag_set']: line for line in by_part['xla_ab']}
  assert ab['xla_defaults']['xla_flags'] == []
  assert ab['no_triton_gemm']['xla_flags'] == [
      '--xla_gpu_enable_latency_hiding_scheduler=true', '--xla_gpu_enable_triton_gemm=false']
  for line in ab.values():
    _check_step(line, 4, 16)
  [summary] = by_part['xla_ab_summary']
  seconds = {name: line['step_seconds'] for name, line in ab.items()}
  assert summary['step_seconds'] == seconds and summary['fastest'] == min(seconds, key=seconds.get)
  for name, speedup in summary['speedup_over_xla_defaults'].items():
    assert math.isclose(speedup, seconds['xla_defaults'] / seconds[name], rel_tol=1e-9)
  greedy, beam = by_part['decode']
  assert (greedy['beam_size'], beam['beam_size'], greedy['sentences']) == (1, 4, 4)
  for line in (greedy, beam):
    assert math.isclose(line['sentences_per_second'] * line['seconds'], line['sentences'],
                        rel_tol=1e-9)
  [side_by_side] = by_part['compare']
  if os.path.isfile(os.path.join(REFERENCE_DIR, 'models.py')):
    assert side_by_side['shape'] == 'tiny' and side_by_side['dtype'] == 'bfloat16'
    assert (side_by_side['ratio_min'] <= side_by_side['ratio_median']
            <= side_by_side['ratio_max'])
    assert side_by_side['t2t_jax']['params'] == side_by_side['reference']['params']
  else:
    assert 'anchor_dir' in side_by_side['skipped']
  [speedrun] = by_part['speedrun']
  assert speedrun['config'] == 'tiny' and speedrun['timed_updates'] == 4
  assert math.isclose(speedrun['updates_per_second'] * speedrun['seconds'], 4, rel_tol=1e-9)
  assert math.isclose(speedrun['target_tokens_per_second'] * speedrun['seconds'],
                      speedrun['target_tokens'], rel_tol=1e-9)
  assert speedrun['target_tokens'] > 0


# bench/accelerator_compare.py at --size=tiny: both train steps compiled for one chip of a
# TPU and of a GPU (when JAX's CUDA plugin is here), read by t2t_jax's cost model.


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(REFERENCE_DIR, 'models.py')),
                    reason=f"Flax's WMT example (the reference) is not at {REFERENCE_DIR}")
@pytest.mark.parametrize('target, compiler, attention, loss', [
    ('tpu:v5e-1', 'libtpu', 'einsum', 'xla'), ('gpu:h100x1', 'cuda_compiler', 'einsum', 'xla'),
    ('gpu:h100x1', 'cuda_compiler', 'flash', 'xla'),
    ('gpu:h100x1', 'cuda_compiler', 'einsum', 'fused')])
def test_accelerator_compare_reads_both_steps_with_one_cost_model(target, compiler, attention,
                                                                  loss, request, tmp_path):
  request.getfixturevalue(compiler)  # Skips, with the reason, where the compiler is missing.
  out = tmp_path / 'results' / 'compare.jsonl'
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop('XLA_FLAGS', None)
  process = subprocess.run([sys.executable, os.path.join(ROOT, 'bench', 'accelerator_compare.py'),
                            '--size=tiny', f'--targets={target}', f'--out={out}',
                            f'--attention_impl={attention}', f'--loss_impl={loss}',
                            f'--hlo_dir={tmp_path / "hlo"}',
                            f'--reference_dir={REFERENCE_DIR}'], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300, check=False)
  assert process.returncode == 0, process.stderr[-3000:]
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert [json.loads(line) for line in process.stdout.splitlines()
          if line.startswith('{')] == lines
  t2t, reference, ratio = lines
  assert [line['implementation'] for line in lines] == ['t2t_jax', 'reference', 'ratio']
  assert {(line['target'], line['model'], line['rows'], line['length']) for line in lines} == {
      (target, 'tiny', 4, 16)}
  # The tiny shape (d 32, FFN 64, 1+1 layers, vocab 128), 4 x 16 tokens a side, by hand.
  d, ff, vocab, tokens, length = 32, 64, 128, 64, 16
  by_hand = (6 * tokens * ((4 * d * d + 2 * d * ff) + 2 * d * d + (6 * d * d + 2 * d * ff)
                           + d * vocab) + 3 * 4 * d * (tokens * length + tokens * 2 * length))
  assert {line['attention_impl'] for line in lines} == {attention}
  assert {line['loss_impl'] for line in lines} == {loss}
  # The flash kernels' backward computes the scores again: 2 + 3 + 4 products of B Q K D per
  # head and layer where einsum's forward and backward do 2 + 4. The fused loss computes the
  # logits again too: one more [tokens, vocab] product (the vocabulary is whole blocks here).
  per_layer = 2 * tokens * length * d * (0 if attention == 'einsum' else 9 - 6)
  output_layer = 2 * tokens * vocab * d * (loss == 'fused')
  for line, extra in ((t2t, per_layer * 3 + output_layer), (reference, 0)):
    assert line['hbm_bytes_per_step'] > 0 and line['kernels_per_step'] > 0
    assert line['analytic_flops_per_step'] == by_hand
    # The cost model counts the matrix products, which are the analytic count.
    assert line['flops_per_step'] == pytest.approx(by_hand + extra, rel=0.02)
    assert 0 < line['mfu'] < 1 and line['predicted_step_seconds'] > 0
    # Each kernel takes the longer of its compute and its memory time.
    compute, memory = line['compute_seconds'], line['memory_seconds']
    assert (max(compute, memory) * (1 - 1e-9) <= line['predicted_step_seconds']
            <= (compute + memory) * (1 + 1e-9))
    compiler_cost = line['compiler_cost_analysis']
    if target.startswith('tpu'):
      assert compiler_cost['flops'] > 0 and compiler_cost['bytes_accessed'] > 0
      assert line['gaps']['flops'] == round(line['flops_per_step'] / compiler_cost['flops'] - 1,
                                            4)
      # Every gap above 20% (at tiny dims: all three) carries its explanation.
      explained = {note.split(':')[0] for note in line['gap_notes']}
      assert explained == {key.split('_')[0] for key, gap in line['gaps'].items()
                           if gap is not None and abs(gap) > 0.2}
      rebuilt = line['bytes_rebuilt']
      assert rebuilt['hbm'] == line['hbm_bytes_per_step'] and rebuilt['other_memory'] > 0
    else:  # The GPU compiler gives no cost analysis without a GPU: null, with the reason.
      assert set(compiler_cost.values()) == {None}
      assert 'compile-only' in line['null_reasons']['compiler_flops']
    # Each kernel's longer time is its memory time plus what its compute time exceeds that by,
    # so one chip's step (no collectives) is the memory time plus the compute-bound slack.
    assert math.isclose(line['predicted_step_seconds'],
                        line['memory_seconds'] + line['compute_slack_seconds'], rel_tol=1e-9)
    # Copies are charged only where the program has asynchronous copies or slices.
    hlo = (tmp_path / 'hlo' / f'{target.replace(":", "_")}_tiny_{line["implementation"]}.hlo')
    copies = re.search(r' (copy|slice)-start\(', hlo.read_text()) is not None
    assert (line['async_copy_seconds'] > 0) == copies
    assert line['async_copy_seconds'] < line['predicted_step_seconds']
  assert math.isclose(ratio['tokens_per_second_ratio'],
                      t2t['predicted_target_tokens_per_second']
                      / reference['predicted_target_tokens_per_second'], rel_tol=1e-12)
  assert math.isclose(ratio['hbm_bytes_ratio'],
                      t2t['hbm_bytes_per_step'] / reference['hbm_bytes_per_step'], rel_tol=1e-12)
  assert f'{target:<11} tiny  ratio' in process.stdout  # The table.


def test_the_accelerator_table_shows_each_rows_latest_result_in_target_order(tmp_path):
  table = _load('accelerator_table')

  def row(config, target, step_ms, commit):
    return {'part': 'table', 'config': config, 'target': target, 'commit': commit,
            'mesh': [1, 8, 1], 'scan_layers': False, 'remat': 'none', 'needs_bytes': 2**30,
            'usable_memory_bytes': 16 * 2**30, 'step_seconds': step_ms / 1e3,
            'target_tokens_per_second': 1000, 'mfu': 0.25, 'bound': 'memory',
            'predicted_schedule_hours': 100_000 * step_ms / 1e3 / 3600, 'paper_steps': 100_000,
            'paper_schedule_hours': 12.0}
  flash = {**row('base', 'gpu:h100x8', 3.151, 'c'), 'overrides': ['model.attention_impl=flash']}
  rows = [row('base', 'gpu:h100x8', 7, 'a'), flash, row('base', 'tpu:v5e-8', 19, 'a'),
          {'part': 'pallas', 'config': 'big'},
          {**row('base', 'tpu:v5e-8', 20, 'b'), 'shard_update': True},
          {'part': 'table', 'config': 'big', 'target': 'tpu:v5e-8'}]  # Nothing fitted.
  path = tmp_path / 'table.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  lines = table.markdown(str(path)).splitlines()[2:]
  assert [line.split(' | ')[1] for line in lines] == ['tpu:v5e-8', 'gpu:h100x8', 'gpu:h100x8',
                                                      'tpu:v5e-8']
  assert ' 20 ms ' in lines[0] and '0.6 h (paper: 12 h' in lines[0]  # The recheck's row.
  assert lines[0].endswith('| b |') and lines[1].endswith('| a |')
  # The search's mesh.shard_update where it won; rows before the key read as without it.
  assert '| unrolled, none, update split |' in lines[0]
  assert '| unrolled, none |' in lines[1]
  # A row with overrides sits beside the plain one, named by them, its step to three digits.
  assert lines[2].startswith('| base<br>`model.attention_impl=flash` |')
  assert ' 3.15 ms ' in lines[2] and lines[2].endswith('| c |')
  assert 'nothing fits' in lines[3]


def test_the_accelerator_table_recheck_compiles_the_searched_rows_with_the_overrides(
    tmp_path, monkeypatch):
  """--parts=recheck reads the searched rows of --rows, sets each row's mesh (and its update
  split, where the search chose it) and the overrides on its config, and appends a row naming
  both commits and the overrides to --out."""
  table = _load('accelerator_table')
  seen = []

  def fake_dry_run(config, target):
    seen.append((target, tuple(config.mesh.shape), config.model.attention_impl,
                 config.mesh.collective_combine_bytes, config.mesh.shard_update))
    prediction = {'step_seconds': 0.5, 'bound': 'memory', 'target_tokens_per_second': 7,
                  'mfu': 0.4}
    return {'prediction': prediction, 'programs': {'train_step': {'needs_bytes': 3}},
            'usable_memory_bytes': 4, 'batch_shape': [96, 256], 'compiler': 'x',
            'collectives': {}}
  monkeypatch.setattr(table.dry_run, 'dry_run', fake_dry_run)
  searched = tmp_path / 'old.jsonl'
  searched.write_text(json.dumps({'part': 'table', 'config': 'base', 'target': 'gpu:h100x8',
                                  'commit': 's', 'mesh': [1, 8, 1], 'scan_layers': False,
                                  'remat': 'none', 'shard_update': True}) + '\n')
  out = tmp_path / 'new.jsonl'
  table.recheck_part(['base'], ['gpu:h100x8'], {'commit': 'n'}, str(out), str(searched),
                     ['model.attention_impl=flash', 'mesh.collective_combine_bytes=4194304'])
  assert seen == [('gpu:h100x8', (1, 8, 1, 1), 'flash', 4194304, True)]
  row = json.loads(out.read_text())
  assert (row['commit'], row['search_commit'], row['step_seconds']) == ('n', 's', 0.5)
  assert row['overrides'] == ['model.attention_impl=flash',
                              'mesh.collective_combine_bytes=4194304']
  assert searched.read_text().count('\n') == 1  # The searched rows' file is left as it was.


def test_bytes_by_part_reads_a_kept_program_as_the_dry_run_does(tmp_path):
  """HLO text kept from a compile (here a CPU one, scopes named as the train step's) is read
  by this commit's cost model: every byte in some part, the parts' seconds the kernels'."""
  bytes_by_part = _load('bytes_by_part')

  def step(x, w):
    with jax.named_scope('attention'):
      h = jnp.tanh(x @ w)
    with jax.named_scope('optimizer'):
      return jnp.sum(h), w - 0.1 * jnp.exp(w)
  shape = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  weights = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  text = jax.jit(step).lower(shape, weights).compile().as_text()
  result = bytes_by_part.report(text, 1, 'tpu:v5e-8')
  parts = result['cost_by_part']
  assert {'attention', 'optimiser'} <= set(parts)
  assert sum(row['hbm_bytes'] for row in parts.values()) == pytest.approx(
      result['hbm_bytes_per_device'], rel=1e-3)
  assert sum(row['seconds'] for row in parts.values()) == pytest.approx(
      result['prediction']['kernel_seconds'], rel=1e-2)
  assert 'attention' in bytes_by_part.table(result)


def _evaluated_run(root, name: str, bleu: float, seconds: float | None = None) -> None:
  """A run folder as bench/backtranslation_table.py reads it: evaluate's output, final.json."""
  os.makedirs(root / name)
  (root / name / 'eval_avg10_beam5.txt').write_text(
      '1014 sentences of valid.en, checkpoint avg10, beam 5\n'
      'sacreBLEU 13a 1.00 (nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0)\n'
      f'tokenised BLEU (as configured) {bleu:.2f} (nrefs:1|case:mixed|eff:no|tok:none|'
      'smooth:exp|version:2.6.0)\n')
  if seconds is not None:
    (root / name / 'final.json').write_text(json.dumps({'train_seconds': seconds}))


def test_backtranslation_table_averages_seeds_and_measures_the_gap_closed(tmp_path, capsys):
  table = _load('backtranslation_table')
  for name, bleu in (('parallel_s0', 30.0), ('parallel_s1', 32.0), ('all_s0', 40.0),
                     ('all_s1', 42.0), ('mix_beam_s0', 37.5)):
    _evaluated_run(tmp_path, name, bleu, seconds=600.0)
  _evaluated_run(tmp_path, 'mix_beam_s1', 38.5, seconds=100.0)
  for process in (1, 2):  # Resumed: a second process wrote a second events file.
    (tmp_path / 'mix_beam_s1' / f'events.out.tfevents.{process}.vm').write_text('')
  _evaluated_run(tmp_path, 'unscored_s0', 0.0)
  os.remove(tmp_path / 'unscored_s0' / 'eval_avg10_beam5.txt')  # Still training: left out.
  os.makedirs(tmp_path / 'not_a_run')
  found = table.settings(str(tmp_path))
  assert sorted(found) == ['all', 'mix_beam', 'parallel']
  parallel = table.summary(found['parallel'])
  assert (parallel['mean'], parallel['min'], parallel['max']) == (31.0, 30.0, 32.0)
  assert parallel['std'] == pytest.approx(math.sqrt(2.0))  # Sample deviation of 30 and 32.
  mix = table.summary(found['mix_beam'])
  assert mix['mean'] == 38.0 and mix['train_seconds'] == [600.0, None]
  # Bounds 31 and 41: 37.5 closes 6.5 of the 10 points.
  assert table.recovered(37.5, 31.0, 41.0) == pytest.approx(0.65)
  assert table.recovered(37.5, None, 41.0) is None
  given = table.summary(table.given_runs(['42.70', '42.46', '41.86']))  # Measured elsewhere.
  assert (given['seeds'], given['min'], given['max']) == ([0, 1, 2], 41.86, 42.70)
  assert given['mean'] == pytest.approx(42.34) and given['std'] == pytest.approx(0.43, abs=0.005)
  with pytest.raises(table.DataError, match='must be a number'):
    table.given_runs(['42.7', 'n/a'])
  with pytest.raises(table.DataError, match='holds no BLEU'):
    (tmp_path / 'broken.txt').write_text('Traceback ...\n')
    table.bleu_of(str(tmp_path / 'broken.txt'))
