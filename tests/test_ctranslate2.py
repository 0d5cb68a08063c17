"""The CTranslate2 export: CTranslate2 computes t2t_jax's log-probabilities, greedy and beam
outputs on tiny trained models (post-/pre-LN, shared/separate embeddings), and refuses the
family members it cannot express with one line naming the setting.

PAD: t2t_jax never generates it but keeps its probability in the softmax's normaliser.
CTranslate2 can only disable a token before its log-softmax, so the export keeps PAD out of
the softmax (export_ctranslate2.PAD_LOGIT_BIAS): greedy search is unaffected, and a beam
score is higher by -log(1 - p_PAD) per token. Where p_PAD is large (label smoothing spreads
0.1 over a 14-token vocabulary: 0.8% on PAD) that can reorder close candidates and change a
beam's path; with 37k tokens it is 3e-6. The trained fixtures use no label smoothing, which
leaves PAD a small probability (its scores still differ, by up to about 0.01 a token), and the
beam test checks each engine's score against its own normaliser.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import ctranslate2
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import decode
from t2t_jax import export_ctranslate2
from t2t_jax import saved_params
from t2t_jax import translate
from t2t_jax.model import Transformer
from t2t_jax.model_config import TransformerConfig

# Trained variants: the paper (post-LN, one shared embedding) and the others. Two also take
# the export's other paths: scanned layers (unstacked) and learned position tables.
VARIANTS = {
    'post_shared': dict(norm='post', share_embeddings=True, tie_output=True),
    'post_separate': dict(norm='post', share_embeddings=False, tie_output=True,
                          positions='learned'),
    'pre_shared': dict(norm='pre', share_embeddings=True, tie_output=True),
    'pre_separate': dict(norm='pre', share_embeddings=False, tie_output=False, scan_layers=True),
}
NUM_SYMBOLS = 12
MAX_OUTPUT = 20  # Tokens per output, EOS included, on both sides.
BEAM = 4


def _config(model_overrides: dict):
  """configs/tiny.py with 2+2 layers and 4 heads, trained just enough (about 30 s) that its
  outputs depend on the source: some copy it partly, some stop early, some run to the limit."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.data.num_symbols = NUM_SYMBOLS
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  config.model.num_heads = 4
  config.model.dropout = config.model.attention_dropout = config.model.relu_dropout = 0.0
  config.model.update(model_overrides)
  config.opt.lr_scale, config.opt.warmup_steps = 1.0, 50
  # Label smoothing gives PAD a share of every target (0.1 / 13 here), so the model would keep
  # PAD's probability near 1% a step, and CTranslate2's search, which cannot keep PAD in the
  # softmax without generating it, would rank some hypotheses differently (module docstring).
  config.opt.label_smoothing = 0.0
  config.train.num_steps = config.ckpt.every = 100
  config.train.eval_every = 1000
  config.train.log_every = 50
  return config


def _sources(count: int = 48) -> list[list[str]]:
  rng = np.random.default_rng(1)
  return [[str(s) for s in rng.integers(0, NUM_SYMBOLS, rng.integers(1, 12))]
          for _ in range(count)]


def _inputs(vocab, sources) -> np.ndarray:
  """t2t_jax's batch of the sources: ids, EOS, PAD after."""
  ids = [vocab.encode([' '.join(s)])[0] + [EOS_ID] for s in sources]
  batch = np.full((len(ids), max(map(len, ids))), PAD_ID, np.int32)
  for row, seq in enumerate(ids):
    batch[row, :len(seq)] = seq
  return batch


def _until_eos(ids) -> list[int]:
  ids = [int(i) for i in ids]
  return ids[:ids.index(EOS_ID)] if EOS_ID in ids else [i for i in ids if i != PAD_ID]


@dataclasses.dataclass
class Trained:
  variant: str
  run: translate.Run
  model_dir: str
  sources: list
  inputs: np.ndarray


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def trained(request, tmp_path_factory):
  from t2t_jax import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp(f'ct2_{request.param}'))
  train.train_and_evaluate(_config(VARIANTS[request.param]), workdir)
  model_dir = export_ctranslate2.export(workdir, output=os.path.join(workdir, 'ct2'))
  run = translate.load(workdir)
  sources = _sources()
  return Trained(request.param, run, model_dir, sources, _inputs(run.vocab, sources))


def _translator(model_dir, compute_type='float32'):
  return ctranslate2.Translator(model_dir, device='cpu', compute_type=compute_type,
                                inter_threads=1, intra_threads=1)


def _teacher_forced(run: translate.Run, inputs: np.ndarray, outputs: list[list[int]]):
  """Per-token log-probabilities of `outputs` (EOS included where they have one) under
  t2t_jax's model in training mode: over the whole vocabulary, and over all but PAD."""
  targets = np.full((len(outputs), MAX_OUTPUT), PAD_ID, np.int32)
  for row, seq in enumerate(outputs):
    targets[row, :len(seq)] = seq
  config = dataclasses.replace(run.model_config, deterministic=True, decode=False)
  logits = Transformer(config).apply({'params': run.params}, jnp.asarray(inputs),
                                     jnp.asarray(targets))
  full = jax.nn.log_softmax(logits)
  without_pad = jax.nn.log_softmax(logits.at[..., PAD_ID].set(-jnp.inf))
  pick = lambda table: np.take_along_axis(np.asarray(table), targets[..., None], -1)[..., 0]
  mask = targets != PAD_ID
  return (np.where(mask, pick(full), 0).sum(-1),
          np.where(mask, pick(without_pad), 0).sum(-1))


@pytest.mark.slow
def test_greedy_output_is_t2t_jax_greedy_output(trained):
  run = trained.run
  expected = np.asarray(jax.jit(decode.greedy_search, static_argnums=(2, 3))(
      run.params, jnp.asarray(trained.inputs), run.model_config, MAX_OUTPUT))
  # min_decoding_length=0: t2t_jax may end with EOS at once (CTranslate2's default is 1).
  results = _translator(trained.model_dir).translate_batch(
      trained.sources, beam_size=1, max_decoding_length=MAX_OUTPUT, min_decoding_length=0)
  expected_pieces = [[run.vocab.piece(i) for i in _until_eos(row)] for row in expected]
  assert [r.hypotheses[0] for r in results] == expected_pieces
  # Not a vacuous agreement: outputs differ, some end by EOS early, some are not empty.
  assert len({tuple(p) for p in expected_pieces}) >= 8
  assert sum(EOS_ID in row for row in expected.tolist()) >= 8
  assert sum(len(p) > 0 for p in expected_pieces) >= 8


@pytest.mark.slow
def test_beam_output_and_scores_are_t2t_jax_beam_search(trained):
  """Beam 4 with no length penalty: CTranslate2 divides by length^alpha, t2t_jax by GNMT's
  ((5 + length) / 6)^alpha, which agree only at alpha = 0."""
  run = trained.run
  tokens, scores = jax.jit(decode.beam_search, static_argnums=(2, 3, 4, 5))(
      run.params, jnp.asarray(trained.inputs), run.model_config, MAX_OUTPUT, BEAM, 0.0)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  results = _translator(trained.model_dir).translate_batch(
      trained.sources, beam_size=BEAM, length_penalty=0.0, max_decoding_length=MAX_OUTPUT,
      min_decoding_length=0, return_scores=True)
  # Rows whose best two hypotheses are within 1e-3 may swap on rounding; the rest must agree.
  untied = [row for row in range(len(results)) if scores[row, 0] - scores[row, 1] > 1e-3]
  assert len(untied) >= len(results) // 2
  best = [[int(i) for i in tokens[row, 0] if i != PAD_ID] for row in range(len(results))]
  for row in untied:
    assert results[row].hypotheses[0] == [run.vocab.piece(i) for i in _until_eos(best[row])], row
  # Scores: t2t_jax's is log p over the whole vocabulary; CTranslate2's output layer keeps PAD
  # out of the softmax (PAD_LOGIT_BIAS), so it is log p over the rest. Both from one
  # teacher-forced pass of t2t_jax's model on t2t_jax's best hypotheses.
  full, without_pad = _teacher_forced(run, trained.inputs, best)
  np.testing.assert_allclose(scores[:, 0], full, atol=1e-4)
  ct2_scores = np.array([r.scores[0] for r in results])
  np.testing.assert_allclose(ct2_scores[untied], without_pad[untied], atol=1e-4)
  assert np.all(without_pad > full)  # PAD's probability is small, but not 0.


# Conversion of untrained models, every table and layout: CTranslate2's per-token scores of
# given outputs equal t2t_jax's teacher-forced ones.


def _random_model(overrides: dict, seed: int = 0):
  config = TransformerConfig(vocab_size=NUM_SYMBOLS + 2, d_model=32, d_ff=48, num_heads=4,
                             num_encoder_layers=2, num_decoder_layers=3, max_len=24,
                             deterministic=True, **overrides)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(Transformer(config).init(jax.random.PRNGKey(seed), tokens,
                                                  tokens)['params'])
  # Biases and norms start at 0 and 1: move them, so a misplaced one shows.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])
  return config, params


TOKENS = ['<pad>', '</s>'] + [str(i) for i in range(NUM_SYMBOLS)]


# The paper's layout in the fast tier; the others with the slow tier.
@pytest.mark.parametrize('overrides', [dict()] + [pytest.param(o, marks=pytest.mark.slow) for o in (
    dict(norm='pre'), dict(share_embeddings=False, tie_output=False),
    dict(positions='predictive'), dict(positions='learned', norm='pre'),
    dict(positions='none'), dict(scan_layers=True, share_embeddings=False))],
    ids=lambda o: ','.join(f'{k}={v}' for k, v in o.items()) or 'paper')
def test_ctranslate2_scores_are_t2t_jax_log_probabilities(overrides, tmp_path):
  config, params = _random_model(overrides)
  spec = export_ctranslate2.build_spec(
      config, export_ctranslate2.float32_params(params, config), TOKENS, None)
  model_dir = export_ctranslate2._Converter(spec).convert(str(tmp_path / 'ct2'))  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  sources = [[str(s) for s in rng.integers(0, NUM_SYMBOLS, n)] for n in (1, 5, 9, 16)]
  outputs = [[str(s) for s in rng.integers(0, NUM_SYMBOLS, n)] for n in (3, 0, 12, 7)]
  results = _translator(model_dir).score_batch(sources, outputs)
  targets = np.full((4, 14), PAD_ID, np.int32)
  inputs = np.full((4, 17), PAD_ID, np.int32)
  for row, (source, output) in enumerate(zip(sources, outputs)):
    inputs[row, :len(source) + 1] = [TOKENS.index(s) for s in source] + [EOS_ID]
    targets[row, :len(output) + 1] = [TOKENS.index(s) for s in output] + [EOS_ID]
  logits = Transformer(config).apply({'params': params}, jnp.asarray(inputs),
                                     jnp.asarray(targets))
  log_probs = np.asarray(jax.nn.log_softmax(logits.at[..., PAD_ID].set(-jnp.inf)))
  for row, result in enumerate(results):
    assert result.tokens == outputs[row] + ['</s>']
    length = len(outputs[row]) + 1
    expected = log_probs[row, np.arange(length), targets[row, :length]]
    np.testing.assert_allclose(result.log_probs, expected, atol=2e-5)


def test_position_table_is_t2t_jax_interleaved_sinusoids():
  """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same): not CTranslate2's own table,
  which puts every sine before every cosine."""
  config, params = _random_model({})
  spec = export_ctranslate2.build_spec(
      config, export_ctranslate2.float32_params(params, config), TOKENS, None)
  table = spec.encoder.position_encodings.encodings
  assert table.shape == (24, 32)
  for position, i in ((0, 0), (3, 0), (7, 5), (23, 15)):
    angle = position / 10000 ** (2 * i / 32)
    assert table[position, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
    assert table[position, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)
  np.testing.assert_array_equal(spec.decoder.position_encodings.encodings, table)
  assert spec.encoder.scale_embeddings == pytest.approx(math.sqrt(32))


@pytest.mark.parametrize('overrides, named', [
    (dict(moe_experts=4, moe_layers='all'), "config.model.moe_experts=4"),
    (dict(attention_pattern='local'), "config.model.attention_pattern='local'"),
    (dict(attention_pattern='full,compressed'),
     "config.model.attention_pattern='full,compressed'"),
    (dict(positions='relative'), "config.model.positions='relative'"),
    (dict(kind='decoder_only'), "config.model.kind='decoder_only'"),
])
def test_refuses_what_ctranslate2_cannot_express(overrides, named):
  config = TransformerConfig(vocab_size=10, **overrides)
  with pytest.raises(ConfigError, match='^' + named.replace('(', r'\(') +
                     ' cannot be exported to CTranslate2: '):
    export_ctranslate2.check_exportable(config)


def _run_export(*args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, '-m', 't2t_jax.export', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def _random_run(workdir, overrides: dict) -> str:
  """A run directory holding only config.json (of `_config(overrides)`); that config."""
  config = _config(overrides)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort())
  return config


@pytest.mark.slow
def test_export_cli_writes_a_model_and_names_what_it_refuses(tmp_path):
  config = _random_run(tmp_path / 'run', {})
  model_config = TransformerConfig.from_config(config.model, NUM_SYMBOLS + 2)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(Transformer(model_config).init(jax.random.PRNGKey(0), tokens,
                                                        tokens)['params'])
  params_dir = saved_params.write_params(str(tmp_path / 'params'), params,
                                         config.to_json_best_effort(), {'kind': 'test'})
  output = str(tmp_path / 'ct2')
  result = _run_export('--format=ctranslate2', f'--workdir={tmp_path / "run"}',
                       f'--checkpoint={params_dir}', f'--output={output}',
                       '--quantization=int8')
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == output
  assert sorted(os.listdir(output)) == ['config.json', 'model.bin', 'shared_vocabulary.json']
  with open(os.path.join(output, 'config.json')) as f:
    ct2_config = json.load(f)
  assert (ct2_config['decoder_start_token'], ct2_config['eos_token']) == ('<pad>', '</s>')
  assert ct2_config['add_source_eos'] and ct2_config['layer_norm_epsilon'] == 1e-6
  with open(os.path.join(output, 'shared_vocabulary.json')) as f:
    assert json.load(f) == TOKENS
  # int8 weights: a quarter of float32's bytes, near enough, for the big matrices.
  float_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert os.path.getsize(os.path.join(output, 'model.bin')) < 0.6 * float_bytes
  assert _translator(output, 'int8').translate_batch([['3', '4']], max_decoding_length=5)
  again = _run_export('--format=ctranslate2', f'--workdir={tmp_path / "run"}',
                      f'--checkpoint={params_dir}', f'--output={output}')
  assert again.returncode == 1
  assert again.stderr.strip().splitlines()[-1] == (f'error: {output} already exists: remove it or choose '
                                  'another --output')
  _random_run(tmp_path / 'moe', dict(moe_experts=4, moe_layers='all'))
  refused = _run_export('--format=ctranslate2', f'--workdir={tmp_path / "moe"}')
  assert refused.returncode == 1 and 'Traceback' not in refused.stderr
  assert refused.stderr.strip().splitlines()[-1] == (
      'error: config.model.moe_experts=4 cannot be exported to CTranslate2: CTranslate2 has '
      'no mixture-of-experts feed-forward layers')
