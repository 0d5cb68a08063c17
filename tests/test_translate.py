"""The translate and evaluate commands end to end on a run trained a few steps by configs/tiny.py."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, write_lines
from t2t_jax import plot
from t2t_jax.checkpoints import checkpoint
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import bleu as bleu_lib
from t2t_jax.deploy import trained_run
from t2t_jax.model import transformer as model_lib


@pytest.fixture
def workdir(tiny_run):
  """The session's tiny run (conftest.py), trained once for this file and test_train.py."""
  return tiny_run[0]


def _run(module, *args, stdin=None):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, env=env, input=stdin,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_training_records_the_best_bleu_step(workdir):
  best = json.load(open(os.path.join(workdir, 'best_bleu.json')))
  assert best['label'] == 'sacreBLEU' and 'tok:13a' in best['signature']
  logged = plot.read_scalars(workdir)['bleu']  # What the run logged at each evaluation.
  assert list(logged.steps) == [10, 20]
  highest = max(logged.values)
  assert best['bleu'] == pytest.approx(highest, abs=1e-4)
  assert best['step'] == logged.steps[list(logged.values).index(highest)]  # The first such.


def test_the_best_bleu_record_keeps_the_first_highest_score(tmp_path):
  scores = {100: 12.5, 200: 31.0, 300: 30.9, 400: 31.0, 500: 7.0}
  kept = [bleu_lib.record_best_bleu(str(tmp_path), step, bleu_lib.Bleu(score, 'sacreBLEU', 's'))
          for step, score in scores.items()]
  assert kept == [True, True, False, False, False]
  assert json.load(open(tmp_path / 'best_bleu.json')) == {
      'step': 200, 'bleu': 31.0, 'label': 'sacreBLEU', 'signature': 's'}
  # A resumed run that evaluates step 200 again replaces its own record, even lower.
  assert bleu_lib.record_best_bleu(str(tmp_path), 200, bleu_lib.Bleu(30.0, 'sacreBLEU', 's'))
  assert json.load(open(tmp_path / 'best_bleu.json'))['bleu'] == 30.0


def test_a_config_saved_before_eval_length_penalty_existed_loads_with_gnmts(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  saved = json.loads(config.to_json_best_effort())
  del saved['eval']['length_penalty']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert trained_run.load_config(str(tmp_path)).eval.length_penalty == 'gnmt'
  assert checkpoint.config_differences(json.dumps(saved), config) == {}  # A resume sees none.
  config.eval.length_penalty = 'length'
  assert checkpoint.config_differences(json.dumps(saved), config) == {
      'eval.length_penalty': ('gnmt', 'length')}


@pytest.mark.slow
def test_restore_params_reads_the_checkpointed_parameters(workdir):
  run = trained_run.load(workdir, checkpoint='10')
  state_dir = os.path.join(workdir, 'checkpoints', '10', 'state')
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  saved = ocp.PyTreeCheckpointer().restore(state_dir)['params']  # Everything, unsharded.
  for restored, expected in zip(jax.tree.leaves(run.params), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(expected))
  latest = trained_run.load(workdir)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(latest.params),
                                                      jax.tree.leaves(run.params)))
  with pytest.raises(checkpoint.CheckpointError, match=r'no checkpoint of step 7 .* \[10, 20\]'):
    trained_run.load(workdir, checkpoint='7')
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in'):
    saved_params.restore_params(os.path.join(workdir, 'nothing'), run.params)


@pytest.mark.slow
def test_translate_cli_keeps_order_blank_lines_and_warns_on_truncation(workdir, tmp_path):
  lines = ['3 1 4 1 5', '', '2 7', ' '.join(['6'] * 40), '0 0 1']
  source = write_lines(tmp_path / 'in.txt', lines)
  output = tmp_path / 'out.txt'
  result = _run('t2t_jax.translate', f'--workdir={workdir}', f'--input={source}',
                f'--output={output}', '--beam_size=2', '--alpha=0.6')
  assert result.returncode == 0, result.stderr
  translations = output.read_text().split('\n')
  assert len(translations) == len(lines) + 1 and translations[-1] == ''
  assert translations[1] == ''
  assert f'{source}:4: 40 tokens, truncated to the first 31' in result.stderr
  assert result.stderr.count('truncated') == 1  # Only line 4 is named.
  run = trained_run.load(workdir, beam_size=2, alpha=0.6)
  assert trained_run.translate_lines(run, lines)[0] == translations[:-1]
  # stdin to stdout gives the same text.
  piped = _run('t2t_jax.translate', f'--workdir={workdir}', '--beam_size=2', '--alpha=0.6',
               stdin='\n'.join(lines) + '\n')
  assert piped.returncode == 0 and piped.stdout == output.read_text()


@pytest.mark.slow
def test_translate_cli_names_a_bad_symbol_and_a_missing_run(workdir, tmp_path):
  result = _run('t2t_jax.translate', f'--workdir={workdir}', stdin='1 2\n1 x 2\n')
  assert result.returncode != 0 and "<stdin>:2: unknown symbol 'x'" in result.stderr
  result = _run('t2t_jax.translate', f'--workdir={tmp_path}', stdin='1 2\n')
  assert result.returncode != 0 and 'config.json' in result.stderr
  assert 'Traceback' not in result.stderr


@pytest.mark.slow
def test_attention_pictures_one_per_decoder_layer(workdir, tmp_path):
  run = trained_run.load(workdir)
  translations, inputs, outputs = trained_run.translate_lines(run, ['3 1 4 1 5'])
  weights = trained_run.cross_attention(run, inputs[0], trained_run._strip_to_eos(outputs[0]))
  assert len(weights) == run.model_config.num_decoder_layers
  heads, queries, keys = weights[0].shape
  assert heads == run.model_config.num_heads and keys == len(inputs[0])
  np.testing.assert_allclose(weights[0].sum(-1), 1.0, atol=1e-5)
  paths = trained_run.save_attention_pngs(run, inputs[0], outputs[0], str(tmp_path), 'line1')
  assert [os.path.basename(p) for p in paths] == ['line1_layer1.png']
  with open(paths[0], 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_attention_of_scanned_layers_is_that_of_unrolled_layers():
  config = model_lib.TransformerConfig(vocab_size=9, d_model=16, d_ff=32, num_heads=2,
                                       num_encoder_layers=1, num_decoder_layers=2, max_len=16)
  scanned = dataclasses.replace(config, scan_layers=True)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(model_lib.Transformer(config).init(jax.random.PRNGKey(0), tokens,
                                                            tokens)['params'])
  source, output = [3, 5, 2, 1], [4, 6, 1]
  expected = trained_run.cross_attention(types.SimpleNamespace(model_config=config, params=params),
                                       source, output)
  weights = trained_run.cross_attention(types.SimpleNamespace(
      model_config=scanned, params=model_lib.stack_layer_params(params, config)), source, output)
  assert len(weights) == 2 and weights[0].shape == (2, 3, 4)
  for actual, wanted in zip(weights, expected):
    np.testing.assert_allclose(actual, wanted, atol=1e-6)


@pytest.mark.slow
def test_evaluate_cli_prints_every_bleu_with_its_label(workdir, tmp_path):
  src = write_lines(tmp_path / 'src', ['3 1 4', '2 7 7 1', '5 5'])
  ref = write_lines(tmp_path / 'ref', ['3 1 4', '2 7 7 1', '5 5'])
  result = _run('t2t_jax.evaluate', f'--workdir={workdir}', f'--src={src}', f'--ref={ref}',
                f'--tokenized_ref={ref}', '--lowercase', '--beam_size=1')
  assert result.returncode == 0, result.stderr
  printed = result.stdout.strip().splitlines()
  assert printed[0].startswith(f'3 sentences of {src}, checkpoint latest, beam 1')
  assert printed[1].startswith('sacreBLEU ') and 'tok:13a' in printed[1]
  assert printed[2].startswith('tokenised BLEU, compound split (Moses de') and 'tok:none' in printed[2]
  assert printed[3].startswith('tokenised BLEU (tokenised references, lowercased) ')


@pytest.mark.slow
def test_evaluate_cli_needs_files_for_a_run_without_text_files(workdir, tmp_path):
  result = _run('t2t_jax.evaluate', f'--workdir={workdir}')
  assert result.returncode != 0
  assert "--src and --ref are required: this run reads config.data.source='synthetic'" in (
      result.stderr)
  result = _run('t2t_jax.evaluate', f'--workdir={workdir}', f'--src={tmp_path}/src')
  assert result.returncode != 0 and 'pass both --src and --ref, or neither' in result.stderr



@pytest.mark.slow
def test_decoding_dtype_comes_from_the_flag_or_the_config(workdir):
  assert trained_run.load(workdir, dtype='bfloat16').translator.config.dtype == jnp.bfloat16
  assert trained_run.load(workdir, dtype='model').translator.config.dtype == jnp.float32
  # config.eval.dtype 'auto': float32 on CPU, where bfloat16 arithmetic is slower.
  assert trained_run.load(workdir).translator.config.dtype == jnp.float32
