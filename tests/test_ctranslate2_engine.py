"""translate and evaluate with --engine=ctranslate2 (ctranslate2_engine.py): the same outputs
and labels as t2t_jax's engine, the length penalty both engines share, and the cache of
exported models in the workdir (reused, rebuilt when its checkpoint changes, never left half
written). The small models are tests/test_ctranslate2.py's: sinusoidal positions, trained
just enough that outputs depend on the source, no label smoothing (PAD keeps a small
probability, which CTranslate2's softmax leaves out: that module's docstring)."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, write_lines
from test_ctranslate2 import (BEAM, MAX_OUTPUT, NUM_SYMBOLS, VARIANTS, _best, _config,
                              _inputs, _sources, _teacher_forced, _translator, _untied,
                              _until_eos, beam_search_over_ct2_softmax)
from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import bleu as bleu_lib
from t2t_jax.decoding import decode
from t2t_jax.deploy import ctranslate2_engine
from t2t_jax.deploy import optional
from t2t_jax.deploy import trained_run
from t2t_jax.model import decoder_only
from t2t_jax.model.model_config import TransformerConfig


def _trained_config(model_overrides: dict):
  """_config, its closing evaluation without BLEU: no test here reads that score, and decoding
  for it is a search compiled and run for nothing."""
  config = _config(model_overrides)
  config.eval.bleu_sentences = 0
  return config


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
  """The paper's layout (post-LN, shared embeddings, sinusoids) trained 100 steps."""
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp('ct2_engine'))
  train.train_and_evaluate(_trained_config(VARIANTS['post_shared']), workdir)
  return workdir


# t2t_jax's beam search, jitted once for the module, alpha traced (only arithmetic reads it):
# one program per model, length and penalty, whatever the alpha.
_beam_search = jax.jit(decode.beam_search, static_argnums=(2, 3, 4), static_argnames='penalty')


def _random_run(workdir, overrides: dict | None = None, step: int = 5, seed: int = 0,
                config=None, adjust=None) -> str:
  """A run directory with config.json (of `config`, or _config(`overrides`)) and, at
  checkpoints/<step>, random params-only weights, changed in place by `adjust(params)`."""
  config = config or _config(overrides or {})
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort())
  _write_random_params(workdir, config, step, seed, adjust)
  return str(workdir)


@functools.cache
def _init(model_config: TransformerConfig):
  """The model's init, jitted once per config: one compile, not its eager operations each."""
  return jax.jit(decoder_only.make_model(model_config).init)


def _write_random_params(workdir, config, step: int, seed: int, adjust=None) -> str:
  model_config = TransformerConfig.from_config(config.model, NUM_SYMBOLS + 2)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = jax.tree.map(np.array, nn.meta.unbox(_init(model_config)(
      jax.random.PRNGKey(seed), tokens, tokens)['params']))
  if adjust:
    adjust(params)
  return saved_params.write_params(os.path.join(workdir, 'checkpoints', str(step)), params,
                                   config.to_json_best_effort(), {'kind': 'test'})


def _run(module, *args, stdin=None):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, env=env, input=stdin,
                        capture_output=True, text=True, timeout=300)


def _constant_output_run(workdir, model_overrides: dict, symbol_logit: float, eos_logit: float,
                         max_len: int = 32) -> str:
  """A run whose every decoding step's output is one constant distribution: the last decoder
  layer's output LayerNorm has scale 0 and a bias along the first embedding axis, where only
  CONSTANT_ID's and EOS's (shared) embeddings are non-zero, so their logits are
  `symbol_logit` and `eos_logit` and every other token's 0. What a search finds then follows
  from the length penalty's formula alone."""
  config = _config(model_overrides)
  config.model.max_len = config.data.max_len = max_len

  def constant(params):
    last = params[f'decoder_{config.model.num_decoder_layers - 1}']['ffn_block']['norm']
    last['scale'][:] = 0.0
    last['bias'][:] = 0.0
    last['bias'][0] = 1.0
    params['embedding']['embedding'][:, 0] = 0.0
    params['embedding']['embedding'][CONSTANT_ID, 0] = symbol_logit
    params['embedding']['embedding'][EOS_ID, 0] = eos_logit
  return _random_run(workdir, config=config, adjust=constant)


CONSTANT_ID = 5  # The symbol _constant_output_run's model ranks first at every step.


# The length penalty both engines have.


@pytest.mark.slow
@pytest.mark.parametrize('alpha', ['recipe', 0.6])
def test_length_penalty_beam_search_is_ctranslate2s(trained_workdir, alpha):
  """eval.length_penalty='length' at configs/multi30k.py's alpha (1.4) and at 0.6 on a
  trained model: CTranslate2's beam search (through the engine's arguments) finds the
  hypotheses of t2t_jax's over CTranslate2's normaliser wherever its best two are apart, each
  engine's scored log p / length^alpha with its own softmax (t2t_jax's counts PAD,
  CTranslate2's does not)."""
  from configs import multi30k  # pylint: disable=g-import-not-at-top
  if alpha == 'recipe':
    alpha = multi30k.get_config().eval.alpha
    assert alpha == 1.4
  run = trained_run.load(trained_workdir)
  model_dir, _ = ctranslate2_engine.exported_model(run.config, run.vocab, trained_workdir)
  sources = _sources()
  inputs = jnp.asarray(_inputs(run.vocab, sources))
  tokens, scores = (np.asarray(x) for x in _beam_search(
      run.params, inputs, run.model_config, MAX_OUTPUT, BEAM, alpha, penalty='length'))
  ct2_tokens, ct2_norm_scores = beam_search_over_ct2_softmax(
      run.params, inputs, run.model_config, MAX_OUTPUT, BEAM, alpha, penalty='length')
  options = ctranslate2_engine.Decoding(BEAM, alpha, 'length').options(MAX_OUTPUT)
  results = _translator(model_dir).translate_batch(sources, **options, return_scores=True)
  best, ct2_best = _best(tokens), _best(ct2_tokens)
  # The search over CTranslate2's normaliser (PAD left out) finds CTranslate2's hypotheses.
  untied = _untied(ct2_norm_scores)
  assert untied  # Something is compared. Both ways of ending, and the penalty deciding, are
  # the next test's, on a model built for them.
  for row in untied:
    expected = [run.vocab.piece(i) for i in _until_eos(ct2_best[row])]
    assert results[row].hypotheses[0] == expected, row
  lengths_of = lambda b: np.array([len(x) for x in b], np.float64)  # EOS counted, as both
  # engines count.
  full, _ = _teacher_forced(run, np.asarray(inputs), best)
  np.testing.assert_allclose(scores[:, 0], full / lengths_of(best)**alpha, atol=1e-4)
  _, without_pad = _teacher_forced(run, np.asarray(inputs), ct2_best)
  expected_ct2 = without_pad / lengths_of(ct2_best)**alpha
  np.testing.assert_allclose(ct2_norm_scores[:, 0], expected_ct2, atol=1e-4)
  ct2_scores = np.array([r.scores[0] for r in results])
  np.testing.assert_allclose(ct2_scores[untied], expected_ct2[untied], atol=1e-4)


def _best_of_constant_output(symbol_logit: float, eos_logit: float, vocab_size: int,
                             alpha: float, penalty: str, limit: int) -> tuple[list[int], float]:
  """The best hypothesis of _constant_output_run's model and its score, by enumeration: the
  constant symbol n - 1 times then EOS (n = 1 .. limit), or `limit` times without EOS, each
  log p over `vocab_size` tokens divided by the penalty's formula, written out here. (With
  0 < eos_logit < symbol_logit, EOS ranks second at every step, so a beam search scores every
  one of them; any other hypothesis has a lower log p than the one of its length here.)"""
  assert 0 < eos_logit < symbol_logit
  log_z = np.log(np.exp(symbol_logit) + np.exp(eos_logit) + vocab_size - 2)  # Others: 0.
  symbol, eos = symbol_logit - log_z, eos_logit - log_z
  formula = {'gnmt': lambda n: ((5.0 + n) / 6.0) ** alpha, 'length': lambda n: n ** alpha}
  candidates = [([CONSTANT_ID] * (n - 1) + [EOS_ID], (n - 1) * symbol + eos)
                for n in range(1, limit + 1)] + [([CONSTANT_ID] * limit, limit * symbol)]
  scored = sorted(((log_p / formula[penalty](len(ids)), ids) for ids, log_p in candidates),
                  reverse=True)
  assert scored[0][0] - scored[1][0] > 5e-3  # Far above float32 rounding: one best.
  return scored[0][1], scored[0][0]


@pytest.mark.parametrize('alpha, symbol_logit, eos_logit', [('recipe', 2.0, 0.5),
                                                             (0.6, 3.0, 2.0)])
def test_each_length_penalty_finds_the_hypothesis_its_formula_ranks_first(
    tmp_path, alpha, symbol_logit, eos_logit):
  """On a model whose every step is one constant distribution, the best hypothesis under each
  penalty follows from the formulas alone (_best_of_constant_output): t2t_jax's beam search
  finds it under both, with its score, and CTranslate2's under 'length' (GNMT's it refuses).
  The logits are chosen so that the two penalties rank different hypotheses first: at
  configs/multi30k.py's alpha EOS alone and one cut at the limit, at 0.6 two that end with
  EOS."""
  from configs import multi30k  # pylint: disable=g-import-not-at-top
  if alpha == 'recipe':
    alpha = multi30k.get_config().eval.alpha
    assert alpha == 1.4
  workdir = _constant_output_run(str(tmp_path / 'run'), {}, symbol_logit, eos_logit)
  run = trained_run.load(workdir)
  sources = _sources(6)
  inputs = jnp.asarray(_inputs(run.vocab, sources))
  vocab_size = NUM_SYMBOLS + 2  # t2t_jax's softmax counts PAD; CTranslate2's leaves it out.
  expected = {}
  for penalty in decode.LENGTH_PENALTIES:
    best, score = _best_of_constant_output(symbol_logit, eos_logit, vocab_size, alpha, penalty,
                                           MAX_OUTPUT)
    expected[penalty] = best
    tokens, scores = _beam_search(run.params, inputs, run.model_config, MAX_OUTPUT, BEAM, alpha,
                                  penalty=penalty)
    for row in range(len(sources)):
      assert [int(i) for i in np.asarray(tokens)[row, 0] if i != PAD_ID] == best, (penalty, row)
    np.testing.assert_allclose(np.asarray(scores)[:, 0], score, atol=1e-4)
  assert expected['gnmt'] != expected['length']  # The penalty decides.
  model_dir, _ = ctranslate2_engine.exported_model(run.config, run.vocab, workdir)
  best, score = _best_of_constant_output(symbol_logit, eos_logit, vocab_size - 1, alpha,
                                         'length', MAX_OUTPUT)
  assert best == expected['length']
  options = ctranslate2_engine.Decoding(BEAM, alpha, 'length').options(MAX_OUTPUT)
  results = _translator(model_dir).translate_batch(sources, **options, return_scores=True)
  for result in results:
    assert result.hypotheses[0] == [run.vocab.piece(i) for i in _until_eos(best)]
    assert result.scores[0] == pytest.approx(score, abs=1e-4)
  with pytest.raises(ConfigError, match="GNMT's length penalty"):
    ctranslate2_engine.Decoding(BEAM, alpha, 'gnmt').check()


# The command line: both engines, same files, same labels.


def _greedy_text(run: trained_run.Run, lines) -> str:
  """`run`'s translations of `lines` as the translate command writes them, a line each."""
  return ''.join(t + '\n' for t in trained_run.translate_lines(run, lines)[0])


@pytest.mark.slow
def test_both_engines_write_the_same_greedy_file_and_bleu_lines(trained_workdir, tmp_path):
  """translate and evaluate with --engine=ctranslate2 against t2t_jax's engine in process,
  from the same library calls as those commands (whose runs with t2t_jax's engine are
  tests/test_translate.py's): the same file, the same figures under the same labels."""
  lines = [' '.join(s) for s in _sources()] + ['', '3 1 4']
  source, output = write_lines(tmp_path / 'in.txt', lines), tmp_path / 'ctranslate2.txt'
  result = _run('t2t_jax.translate', f'--workdir={trained_workdir}', f'--input={source}',
                f'--output={output}', '--beam_size=1', '--engine=ctranslate2')
  assert result.returncode == 0, result.stderr
  assert f'Translated {len(lines)} sentences' in result.stderr
  ours = trained_run.load(trained_workdir, beam_size=1)
  text = _greedy_text(ours, lines)
  assert output.read_text() == text
  translations = text.split('\n')
  assert len(translations) == len(lines) + 1 and translations[-3] == ''  # Blank lines kept.
  assert len(set(translations)) > 1  # Not one answer for every sentence.
  result = _run('t2t_jax.evaluate', f'--workdir={trained_workdir}', f'--src={source}',
                f'--ref={source}', '--beam_size=1', '--engine=ctranslate2')
  assert result.returncode == 0, result.stderr
  printed = result.stdout.strip().splitlines()
  assert bleu_lib.search_label(ours.translator) == 'beam 1, alpha 0.6'
  assert printed[0] == (f'{len(lines)} sentences of {source}, checkpoint latest, beam 1, '
                        'alpha 0.6, CTranslate2 float32')
  hypotheses = translations[:-1]
  figures = [str(bleu_lib.sacrebleu_score(hypotheses, lines)),
             str(bleu_lib.compound_split_bleu(hypotheses, lines))]
  assert printed[1:] == figures  # Same labels, same figures.
  assert figures[0].startswith('sacreBLEU ')
  assert figures[1].startswith('tokenised BLEU, compound split')


@pytest.mark.slow
def test_a_decoder_only_model_translates_through_the_generator(tmp_path):
  """A causal decoder-only model (Transformer-D with prefix_attention='causal', the kind the
  export writes as CTranslate2's decoder-only model) runs in ctranslate2.Generator, prompted
  with source, EOS and the start token: the same greedy file as t2t_jax's, including outputs
  cut at their limit (which counts the source's positions first), and at beam 4, alpha 0
  (where the two penalties agree) the hypotheses of t2t_jax's search over CTranslate2's
  normaliser (PAD left out) wherever its two best scores are apart."""
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'decoder_only')
  config = _trained_config(dict(kind='decoder_only', prefix_attention='causal'))
  config.model.max_len = config.data.max_len = 24  # A long source leaves its output less room
  # than max_extra_len.
  train.train_and_evaluate(config, workdir)
  lines = [' '.join(s) for s in _sources()] + ['', '3 1 4', ' '.join(['5'] * 14)]
  # In process: the command's file is the test above's, the same for either kind of model.
  outputs = {engine: _greedy_text(load(workdir, beam_size=1), lines).split('\n')
             for engine, load in (('t2t_jax', trained_run.load),
                                  ('ctranslate2', trained_run.load_ctranslate2))}
  assert outputs['ctranslate2'] == outputs['t2t_jax']
  assert len(set(outputs['t2t_jax'])) > 1
  # The longest source (14 symbols + EOS) leaves 24 - 15 = 9 positions: an output that has
  # not ended is cut there in both engines.
  assert len(outputs['t2t_jax'][-2].split()) <= 9
  run = trained_run.load(workdir)  # Its parameters and vocabulary; the search is below.
  ct2 = trained_run.load_ctranslate2(workdir, beam_size=BEAM, alpha=0.0)
  assert isinstance(ct2.translator._model, ctranslate2_engine._ctranslate2().Generator)
  inputs = _inputs(run.vocab, _sources())
  rows = [row[:list(row).index(EOS_ID) + 1] for row in inputs]
  theirs = ct2.translator.translate(None, rows)
  # One padded batch with each row's own limit, as the translator searches it.
  extra = run.config.eval.max_extra_len
  limits = np.array([decode.max_decode_length(len(row), extra, 24, True) for row in rows])
  tokens, scores = beam_search_over_ct2_softmax(
      run.params, inputs, run.model_config, decode.max_decode_length(inputs.shape[1], extra, 24),
      BEAM, 0.0, jnp.asarray(limits, jnp.int32))
  untied, best = _untied(scores), _best(tokens)
  assert untied  # Something is compared.
  for row in untied:
    np.testing.assert_array_equal(theirs[row], best[row], err_msg=str(row))


@pytest.mark.slow
def test_the_cli_refuses_in_one_line_what_ctranslate2_cannot_do(tmp_path):
  workdir = _random_run(tmp_path / 'run')
  gnmt = _run('t2t_jax.translate', f'--workdir={workdir}', '--engine=ctranslate2',
              '--beam_size=4', '--alpha=0.6', stdin='3 4\n')
  assert gnmt.returncode == 1 and 'Traceback' not in gnmt.stderr
  assert gnmt.stderr.strip().splitlines()[-1].startswith(
      "error: --engine=ctranslate2 cannot run beam search (beam 4) with GNMT's length penalty")
  assert not os.path.exists(os.path.join(workdir, 'ctranslate2'))  # Refused before exporting.
  # What cannot be exported: refused by the same ConfigError path as the GNMT search above,
  # which shows it as the command's one line; in process here.
  moe = _random_run(tmp_path / 'moe', dict(moe_experts=4, moe_layers='all'))
  with pytest.raises(ConfigError) as refused:
    trained_run.load_ctranslate2(moe, beam_size=1)
  assert str(refused.value) == (
      'config.model.moe_experts=4 cannot be exported to CTranslate2: CTranslate2 has no '
      'mixture-of-experts feed-forward layers')
  assert not os.path.exists(os.path.join(moe, 'ctranslate2'))  # Refused before any work.
  misplaced = _run('t2t_jax.translate', f'--workdir={workdir}', '--ct2_compute_type=int8',
                   stdin='3 4\n')
  assert misplaced.returncode != 0
  assert 'error: --ct2_compute_type applies to --engine=ctranslate2' in misplaced.stderr


def test_a_compute_type_this_cpu_lacks_is_refused_naming_those_it_has(tmp_path):
  import ctranslate2  # pylint: disable=g-import-not-at-top
  lacking = sorted(set(ctranslate2_engine.COMPUTE_TYPES) - {'default', 'auto'} -
                   ctranslate2.get_supported_compute_types('cpu'))
  if not lacking:
    pytest.skip('this CPU runs every compute type')
  workdir = _random_run(tmp_path / 'run')
  with pytest.raises(ConfigError, match=f'--ct2_compute_type={lacking[0]}: .*this CPU runs'):
    trained_run.load_ctranslate2(workdir, beam_size=1, compute_type=lacking[0])


def test_ctranslate2_search_arguments():
  """Greedy and alpha 0 stop as CTranslate2 always does (then exactly t2t_jax's); a beam with
  a penalty searches to the limit unless a patience is given."""
  greedy = ctranslate2_engine.Decoding(1, 0.6, 'gnmt').options(30)
  assert (greedy['beam_size'], greedy['length_penalty'], greedy['patience']) == (1, 0.0, 1.0)
  assert ctranslate2_engine.Decoding(4, 0.0, 'gnmt').options(30)['patience'] == 1.0
  assert ctranslate2_engine.Decoding(4, 1.4, 'length').options(30)['patience'] == 30.0
  options = ctranslate2_engine.Decoding(4, 1.4, 'length', patience=1.0).options(30)
  assert (options['length_penalty'], options['patience']) == (1.4, 1.0)
  assert (options['max_decoding_length'], options['min_decoding_length']) == (30, 0)
  with pytest.raises(ConfigError, match="GNMT's length penalty"):
    ctranslate2_engine.Decoding(4, 0.6, 'gnmt').check()
  with pytest.raises(ConfigError, match='--ct2_patience=0.0 must be above 0'):
    ctranslate2_engine.Decoding(4, 0.6, 'length', 0.0).check()


# The cache of exported models.


def _model_bin(model_dir: str) -> tuple[int, int, bytes]:
  path = os.path.join(model_dir, 'model.bin')
  with open(path, 'rb') as f:
    return os.stat(path).st_ino, os.stat(path).st_mtime_ns, f.read()


def test_the_export_is_reused_then_rebuilt_when_its_checkpoint_changes(tmp_path):
  workdir = _random_run(tmp_path / 'run', step=5)
  config = trained_run.load_config(workdir)
  vocab = trained_run.load_vocabulary(config, workdir)
  model_dir, exported = ctranslate2_engine.exported_model(config, vocab, workdir)
  assert exported and model_dir == os.path.join(workdir, 'ctranslate2', 'step_5')
  assert sorted(os.listdir(model_dir)) == ['config.json', 'model.bin', 'shared_vocabulary.json',
                                           'source.json']
  first = _model_bin(model_dir)
  again, exported = ctranslate2_engine.exported_model(config, vocab, workdir, '5')
  assert (again, exported) == (model_dir, False)
  assert _model_bin(model_dir) == first  # Not rewritten.
  # The same step written again, with other weights (a run restarted in this workdir).
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '5'))
  _write_random_params(workdir, config, 5, seed=1)
  again, exported = ctranslate2_engine.exported_model(config, vocab, workdir)
  assert (again, exported) == (model_dir, True)
  assert _model_bin(model_dir)[2] != first[2]
  # Another checkpoint, its own entry; an averaged directory outside checkpoints/ too.
  _write_random_params(workdir, config, 6, seed=2)
  latest, exported = ctranslate2_engine.exported_model(config, vocab, workdir)
  assert exported and os.path.basename(latest) == 'step_6'
  averaged = _write_random_params(tmp_path / 'elsewhere', config, 7, seed=3)
  outside, exported = ctranslate2_engine.exported_model(config, vocab, workdir, averaged,
                                                        'params')
  assert exported and os.path.basename(outside).startswith('7_')
  assert sorted(os.listdir(os.path.join(workdir, 'ctranslate2'))) == sorted(
      ['step_5', 'step_6', os.path.basename(outside)])  # Nothing partial is left.
  with open(os.path.join(latest, 'source.json')) as f:
    assert json.load(f)['checkpoint'] == os.path.join(workdir, 'checkpoints', '6')


def test_a_failed_export_leaves_no_model_directory(tmp_path, monkeypatch):
  workdir = _random_run(tmp_path / 'run')
  config = trained_run.load_config(workdir)
  vocab = trained_run.load_vocabulary(config, workdir)
  real_export = optional.export_ctranslate2

  def failing(workdir, checkpoint, output, quantization=None, weights='params'):
    real_export(workdir, checkpoint, output, quantization, weights)  # Written, then...
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(optional, 'export_ctranslate2', failing)
  with pytest.raises(OSError, match='No space left'):
    ctranslate2_engine.exported_model(config, vocab, workdir)
  assert os.listdir(os.path.join(workdir, 'ctranslate2')) == []
  monkeypatch.setattr(optional, 'export_ctranslate2', real_export)
  model_dir, exported = ctranslate2_engine.exported_model(config, vocab, workdir)
  assert exported and os.path.isfile(os.path.join(model_dir, 'source.json'))


@pytest.mark.slow
def test_a_killed_export_leaves_no_model_directory_and_the_next_run_exports(tmp_path):
  workdir = _random_run(tmp_path / 'run')
  cache = os.path.join(workdir, 'ctranslate2')
  env = dict(os.environ, PYTHONPATH=ROOT)
  process = subprocess.Popen(
      [sys.executable, '-m', 't2t_jax.translate', f'--workdir={workdir}', '--beam_size=1',
       '--engine=ctranslate2'], cwd=ROOT, env=env, stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  process.stdin.write('3 4\n')
  process.stdin.close()
  deadline, partial = time.monotonic() + 120, []
  while not partial and time.monotonic() < deadline and process.poll() is None:
    partial = [n for n in os.listdir(cache) if n.startswith('.partial-')] if os.path.isdir(
        cache) else []
    time.sleep(0.002)
  os.kill(process.pid, signal.SIGKILL)
  process.wait()
  assert partial, f'the export ended before it was seen: {process.stderr.read()[-2000:]}'
  left = os.listdir(cache)
  assert left == partial  # The export died unfinished: no model directory, whole or not.
  assert not os.path.exists(os.path.join(cache, partial[0], 'model', 'source.json'))
  result = _run('t2t_jax.translate', f'--workdir={workdir}', '--beam_size=1',
                '--engine=ctranslate2', stdin='3 4\n')
  assert result.returncode == 0, result.stderr
  assert os.listdir(cache) == ['step_5']  # Exported; the dead process's partial one removed.
  assert os.path.isfile(os.path.join(cache, 'step_5', 'source.json'))




@pytest.mark.parametrize('beam_size', [1, BEAM])
def test_a_decoder_only_model_stops_at_its_position_limit_in_both_engines(tmp_path, beam_size):
  """Sources of every length up to the model's max_len, in one batch: each output runs to
  its own limit, max_len - (source + EOS) capped by source + EOS + max_extra_len, in t2t_jax's
  engine and in CTranslate2's Generator alike (whose calls once took a shorter source's limit
  for a longer one and ran past the position table)."""
  workdir = _constant_output_run(  # EOS never wins: no output ends by itself.
      str(tmp_path / 'run'), dict(kind='decoder_only', prefix_attention='causal'),
      symbol_logit=1.0, eos_logit=-100.0, max_len=24)
  max_len = 24
  run = trained_run.load(workdir, beam_size=beam_size, alpha=0.0)
  ct2 = trained_run.load_ctranslate2(workdir, beam_size=beam_size, alpha=0.0)
  assert run.config.eval.max_extra_len + 2 < max_len  # Both caps are reached below.
  rows = [np.array([2 + (i % NUM_SYMBOLS) for i in range(n)] + [EOS_ID], np.int32)
          for n in range(max_len)]  # 1 to max_len tokens, EOS included.
  too_long = rows.pop()  # max_len tokens leave no position for an output: both refuse it.
  refusals = []
  for translator, params in ((run.translator, run.params), (ct2.translator, None)):
    with pytest.raises(ValueError) as refusal:
      translator.translate(params, rows + [too_long])
    refusals.append(str(refusal.value))
  assert refusals[0] == refusals[1] == (
      f'input {len(rows)} has {max_len} tokens, more than the model\'s max_len={max_len} less '
      'one position to write an output at: truncate it first')
  ours = run.translator.translate(run.params, rows)
  theirs = ct2.translator.translate(None, rows)
  for row, ids in enumerate(rows):
    limit = min(len(ids) + run.config.eval.max_extra_len, max_len - len(ids))
    assert limit == decode.max_decode_length(len(ids), run.config.eval.max_extra_len, max_len,
                                             decoder_only=True)
    expected = [CONSTANT_ID] * limit
    assert list(ours[row]) == expected, row
    assert list(theirs[row]) == expected, row
