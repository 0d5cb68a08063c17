"""The CTranslate2 export: CTranslate2 computes t2t_jax's log-probabilities, greedy and beam
outputs on tiny trained models (post-LN with shared embeddings, pre-LN with separate ones);
every member of the model family, enumerated from the configs and the keys' values, is
exported with equal greedy outputs and scores or refused with one line naming the setting and
why.

PAD: t2t_jax never generates it but keeps its probability in the softmax's normaliser.
CTranslate2 can only disable a token before its log-softmax, so the export keeps PAD out of
the softmax (ctranslate2_layers.PAD_LOGIT_BIAS): greedy search is unaffected, and a beam
score is higher by -log(1 - p_PAD) per token. Where p_PAD is large (label smoothing spreads
0.1 over a 14-token vocabulary: 0.8% on PAD) that can reorder close candidates and change a
beam's path; with 37k tokens it is 3e-6. The trained fixtures use no label smoothing, which
leaves PAD a small probability (its scores still differ, by up to about 0.01 a token), which
can still reorder two candidates at a step's cut-off: the beam tests compare CTranslate2 with
t2t_jax's search run over CTranslate2's normaliser (`beam_search_over_ct2_softmax`), and check
each engine's score against its own normaliser.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from unittest import mock

import ctranslate2
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ROOT
from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import runtime
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import decode
from t2t_jax.deploy import ctranslate2_decoder_only
from t2t_jax.deploy import export_ctranslate2
from t2t_jax.deploy import trained_run
from t2t_jax.model.decoder_only import make_model
from t2t_jax.model.transformer import Transformer
from t2t_jax.model.attention_variants import ATTENTION_KINDS
from t2t_jax.model.model_config import MODEL_KINDS, PREFIX_ATTENTION, TransformerConfig
from t2t_jax.model.positions import POSITION_KINDS

# Trained through the training loop and exported from its workdir: the paper (post-LN, one
# shared embedding) and its opposite on every layout key (pre-LN, separate embeddings and output
# layer, scanned layers). The layouts in between are the family's members below, exported from
# briefly trained parameters and compared greedy and by score.
VARIANTS = {
    'post_shared': dict(norm='post', share_embeddings=True, tie_output=True),
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


def beam_search_over_ct2_softmax(params, inputs_BS, config, max_len: int, beam_size: int,
                                 alpha: float, max_lengths_B=None, penalty: str = 'gnmt'):
  """decode.beam_search with each step's log-softmax leaving PAD out of its normaliser, as
  CTranslate2's exported output layer does: t2t_jax's search over the distribution CTranslate2
  searches. (t2t_jax's own scores count PAD's share, which can reorder two close candidates at
  a step's cut-off and so part the two engines' paths.) Compiled anew each call, under the
  change, from a function of its own."""
  top_log_probs = decode._top_log_probs  # pylint: disable=protected-access

  def normalised_without_pad(logits_BWV, count):
    return top_log_probs(decode.without_pad(logits_BWV), count)

  def search(*args):
    return decode.beam_search(*args, penalty=penalty)

  with mock.patch.object(decode, '_top_log_probs', normalised_without_pad):
    tokens, scores = runtime.jit_search(search, static_argnums=(2, 3, 4, 5))(
        params, jnp.asarray(inputs_BS), config, max_len, beam_size, alpha, max_lengths_B)
  return np.asarray(tokens), np.asarray(scores)


def _best(tokens_BWL) -> list[list[int]]:
  """Each row's best hypothesis of a beam search's tokens, PAD dropped."""
  return [[int(i) for i in row[0] if i != PAD_ID] for row in np.asarray(tokens_BWL)]


def _untied(scores_BW) -> list[int]:
  """The rows whose best two scores are more than 1e-3 apart: within that, rounding may swap
  them; the others' best hypothesis is the search's answer."""
  scores_BW = np.asarray(scores_BW)
  return np.flatnonzero(scores_BW[:, 0] - scores_BW[:, 1] > 1e-3).tolist()


def _until_eos(ids) -> list[int]:
  ids = [int(i) for i in ids]
  return ids[:ids.index(EOS_ID)] if EOS_ID in ids else [i for i in ids if i != PAD_ID]


@dataclasses.dataclass
class Trained:
  variant: str
  run: trained_run.Run
  model_dir: str
  sources: list
  inputs: np.ndarray


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def trained(request, tmp_path_factory):
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp(f'ct2_{request.param}'))
  train.train_and_evaluate(_config(VARIANTS[request.param]), workdir)
  model_dir = export_ctranslate2.export(workdir, output=os.path.join(workdir, 'ct2'))
  run = trained_run.load(workdir)
  sources = _sources()
  return Trained(request.param, run, model_dir, sources, _inputs(run.vocab, sources))


def _translator(model_dir, compute_type='float32'):
  return ctranslate2.Translator(model_dir, device='cpu', compute_type=compute_type,
                                inter_threads=1, intra_threads=1)


def _teacher_forced(run: trained_run.Run, inputs: np.ndarray, outputs: list[list[int]]):
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
  # Not a vacuous agreement: outputs differ, some end by EOS early, some are not empty (a
  # guard, held low: how many do is where training landed).
  assert len({tuple(p) for p in expected_pieces}) > 1
  assert any(EOS_ID in row for row in expected.tolist())
  assert any(len(p) > 0 for p in expected_pieces)


@pytest.mark.slow
def test_beam_output_and_scores_are_t2t_jax_beam_search(trained):
  """Beam 4 with no length penalty: CTranslate2 divides by length^alpha, t2t_jax by GNMT's
  ((5 + length) / 6)^alpha, which agree only at alpha = 0."""
  run = trained.run
  tokens, scores = jax.jit(decode.beam_search, static_argnums=(2, 3, 4, 5))(
      run.params, jnp.asarray(trained.inputs), run.model_config, MAX_OUTPUT, BEAM, 0.0)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  ct2_tokens, ct2_norm_scores = beam_search_over_ct2_softmax(
      run.params, trained.inputs, run.model_config, MAX_OUTPUT, BEAM, 0.0)
  results = _translator(trained.model_dir).translate_batch(
      trained.sources, beam_size=BEAM, length_penalty=0.0, max_decoding_length=MAX_OUTPUT,
      min_decoding_length=0, return_scores=True)
  # The search over CTranslate2's normaliser finds CTranslate2's hypotheses.
  untied = _untied(ct2_norm_scores)
  assert untied  # Something is compared.
  best, ct2_best = _best(tokens), _best(ct2_tokens)
  for row in untied:
    expected = [run.vocab.piece(i) for i in _until_eos(ct2_best[row])]
    assert results[row].hypotheses[0] == expected, row
  # Scores: t2t_jax's is log p over the whole vocabulary; CTranslate2's output layer keeps PAD
  # out of the softmax (PAD_LOGIT_BIAS), so it is log p over the rest. Both from one
  # teacher-forced pass of t2t_jax's model on each search's best hypotheses.
  full, without_pad = _teacher_forced(run, trained.inputs, best)
  np.testing.assert_allclose(scores[:, 0], full, atol=1e-4)
  assert np.all(without_pad > full)  # PAD's probability is small, but not 0.
  _, ct2_without_pad = _teacher_forced(run, trained.inputs, ct2_best)
  np.testing.assert_allclose(ct2_norm_scores[:, 0], ct2_without_pad, atol=1e-4)
  ct2_scores = np.array([r.scores[0] for r in results])
  np.testing.assert_allclose(ct2_scores[untied], ct2_without_pad[untied], atol=1e-4)


# Conversion of untrained models, every table and layout: CTranslate2's per-token scores of
# given outputs equal t2t_jax's teacher-forced ones.


TOKENS = ['<pad>', '</s>'] + [str(i) for i in range(NUM_SYMBOLS)]


def _batch(rows: list[list[str]]) -> np.ndarray:
  """Symbol rows as t2t_jax's ids, each ending in EOS, right-padded with PAD."""
  ids = [[TOKENS.index(s) for s in row] + [EOS_ID] for row in rows]
  batch = np.full((len(ids), max(map(len, ids))), PAD_ID, np.int32)
  for row, seq in enumerate(ids):
    batch[row, :len(seq)] = seq
  return batch


def _random_params(config: TransformerConfig, seed: int = 0):
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(make_model(config).init(jax.random.PRNGKey(seed), tokens,
                                                 tokens)['params'])
  # Biases and norms start at 0 and 1: move them, so a misplaced one shows.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def _random_model(overrides: dict, seed: int = 0):
  sizes = dict(vocab_size=NUM_SYMBOLS + 2, d_model=32, d_ff=48, num_heads=4,
               num_encoder_layers=2, num_decoder_layers=3, max_len=24, deterministic=True)
  if overrides.get('kind') == 'decoder_only':
    sizes['num_encoder_layers'] = 0  # As TransformerConfig.from_config sets it.
  config = TransformerConfig(**{**sizes, **overrides})
  return config, _random_params(config, seed)


def _briefly_trained(config: TransformerConfig, steps: int = 200):
  """`_random_params` after `steps` Adam steps on copying sources of 1..12 symbols: enough
  that greedy outputs differ with the source (some copy part of it, some stop early), where
  untrained ones repeat one token."""
  model = make_model(config)
  rng = np.random.default_rng(3)
  rows = [[str(s) for s in rng.integers(0, NUM_SYMBOLS, rng.integers(1, 13))]
          for _ in range(steps * 16)]
  batches = _batch(rows).reshape(steps, 16, -1)

  def loss(params, batch):
    logits = model.apply({'params': params}, batch, batch)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch[..., None], -1)[..., 0]
    return -jnp.where(batch != PAD_ID, picked, 0).sum() / (batch != PAD_ID).sum()

  optimizer = optax.adam(3e-3)

  def step(state, batch):
    params, opt_state = state
    updates, opt_state = optimizer.update(jax.grad(loss)(params, batch), opt_state)
    return (optax.apply_updates(params, updates), opt_state), None

  params = _random_params(config)
  (params, _), _ = jax.jit(lambda state: jax.lax.scan(step, state, jnp.asarray(batches)))(
      (params, optimizer.init(params)))
  return params


def _export(config: TransformerConfig, params, directory) -> str:
  spec = export_ctranslate2.build_spec(
      config, export_ctranslate2.float32_params(params, config), TOKENS, None)
  return export_ctranslate2._Converter(spec).convert(str(directory))  # pylint: disable=protected-access


def _t2t_jax_log_probs(config, params, sources, outputs) -> list[np.ndarray]:
  """t2t_jax's teacher-forced log-probabilities of each output and its EOS, over every token
  but PAD (as the exported output layer normalises them)."""
  targets = _batch(outputs)
  # Jitted: one compile, where the model's eager operations would compile one by one.
  logits = jax.jit(make_model(config).apply)({'params': params}, jnp.asarray(_batch(sources)),
                                             jnp.asarray(targets))
  log_probs = np.asarray(jax.nn.log_softmax(logits.at[..., PAD_ID].set(-jnp.inf)))
  return [log_probs[row, np.arange(len(output) + 1), targets[row, :len(output) + 1]]
          for row, output in enumerate(outputs)]


def _ctranslate2_log_probs(model_dir, config, sources, outputs) -> list[np.ndarray]:
  """CTranslate2's log-probabilities of each output and its EOS: the Translator's scores, or
  for a decoder-only model the Generator's over the prompt and output as one sequence."""
  if config.kind == 'decoder_only':
    sequences = [ctranslate2_decoder_only.prompt(source, TOKENS) + output + ['</s>']
                 for source, output in zip(sources, outputs)]
    results = _generator(model_dir).score_batch(sequences)
    return [np.asarray(r.log_probs[-(len(o) + 1):]) for r, o in zip(results, outputs)]
  results = _translator(model_dir).score_batch(sources, outputs)
  for result, output in zip(results, outputs):
    assert result.tokens == output + ['</s>']
  return [np.asarray(r.log_probs) for r in results]


def _generator(model_dir):
  return ctranslate2.Generator(model_dir, device='cpu', inter_threads=1, intra_threads=1)


def _max_score_difference(model_dir, config, params, sources, outputs) -> float:
  """The largest per-token difference of the two engines' log-probabilities of `outputs`."""
  expected = _t2t_jax_log_probs(config, params, sources, outputs)
  got = _ctranslate2_log_probs(model_dir, config, sources, outputs)
  assert [len(g) for g in got] == [len(e) for e in expected]
  return max(float(np.abs(g - e).max()) for g, e in zip(got, expected))


# Per-token log-probabilities agree to rounding: both engines compute in float32, summing in
# different orders through a few layers (measured: at most 2e-6 on these models).
SCORE_TOLERANCE = 2e-5
RANDOM_SOURCES = [[str(s) for s in np.random.default_rng(0).integers(0, NUM_SYMBOLS, n)]
                  for n in (1, 5, 9, 16)]
RANDOM_OUTPUTS = [[str(s) for s in np.random.default_rng(1).integers(0, NUM_SYMBOLS, n)]
                  for n in (3, 0, 12, 7)]


# The paper's layout and multi30k:speedrun's (rotary, pre-LN) in the fast tier; the others with
# the slow tier.
SLOW_LAYOUTS = (
    dict(norm='pre'), dict(share_embeddings=False, tie_output=False),
    dict(positions='predictive'), dict(positions='learned', norm='pre'),
    dict(positions='none'), dict(scan_layers=True, share_embeddings=False),
    dict(positions='relative', max_relative_distance=3),  # Clipped inside the sentences.
    dict(kind='decoder_only', positions='relative', scan_layers=True),
    # Six heads: ALiBi's slopes for a head count that is not a power of two.
    dict(kind='decoder_only', positions='alibi', d_model=48, num_heads=6, tie_output=False))


@pytest.mark.parametrize(
    'overrides', [dict(), dict(positions='rotary', norm='pre')] +
    [pytest.param(o, marks=pytest.mark.slow) for o in SLOW_LAYOUTS],
    ids=lambda o: ','.join(f'{k}={v}' for k, v in o.items()) or 'paper')
def test_ctranslate2_scores_are_t2t_jax_log_probabilities(overrides, tmp_path):
  config, params = _random_model(overrides)
  model_dir = _export(config, params, tmp_path / 'ct2')
  assert _max_score_difference(model_dir, config, params, RANDOM_SOURCES,
                               RANDOM_OUTPUTS) < SCORE_TOLERANCE


@pytest.mark.slow
def test_language_model_is_a_generator_from_the_start_token(tmp_path):
  """configs/lm.py's models read no source (zero width, no EOS): the Generator's sequence is
  PAD, then the text."""
  config, params = _random_model(dict(kind='decoder_only', norm='pre'))
  model_dir = _export(config, params, tmp_path / 'ct2')
  targets = _batch(RANDOM_OUTPUTS)
  logits = make_model(config).apply({'params': params}, jnp.zeros((len(targets), 0), jnp.int32),
                                    jnp.asarray(targets))
  log_probs = np.asarray(jax.nn.log_softmax(logits.at[..., PAD_ID].set(-jnp.inf)))
  results = _generator(model_dir).score_batch([['<pad>'] + text + ['</s>']
                                               for text in RANDOM_OUTPUTS])
  for row, (result, text) in enumerate(zip(results, RANDOM_OUTPUTS)):
    expected = log_probs[row, np.arange(len(text) + 1), targets[row, :len(text) + 1]]
    np.testing.assert_allclose(result.log_probs, expected, atol=SCORE_TOLERANCE)


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


# The family: each distinct model that configs/multi30k.py's and configs/lm.py's variants
# build, and every value of the keys that choose a member (model.kind, model.prefix_attention,
# model.positions, the attention kinds) on multi30k's model, all shrunk to seconds. Each is
# exported and computes t2t_jax's greedy outputs and scores, or is refused in one line that
# names the setting and says why (EXPECTED_REFUSALS). A member added to those lists later is
# tested the same way, and fails unless it is one or the other.
SHRUNK = dict(d_model=32, d_ff=48, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
              max_len=48, dropout=0.0, attention_dropout=0.0, relu_dropout=0.0)
# The setting a refusal names -> what its reason must say. A refusal naming another setting
# fails the test until it is added here (and to docs/translation.md) with why.
EXPECTED_REFUSALS = {
    "config.model.kind='encoder_only'": 'translates nothing',
    'config.model.moe_experts=': 'no mixture-of-experts',
    'config.model.attention_pattern=': "dense ('full') attention only",
    "config.model.prefix_attention='full'": 'causal over the whole sequence',
    'config.model.share_embeddings=False': 'embeds every token with one',
    "config.model.positions='learned'": 'adds one table by position',
    "config.model.positions='alibi'": 'its encoder has no attention bias',
}


@dataclasses.dataclass(frozen=True)
class Member:
  names: tuple[str, ...]  # The variants and settings that build this model.
  config: TransformerConfig

  def refusal(self) -> str | None:
    try:
      export_ctranslate2.check_exportable(self.config)
    except ConfigError as e:
      return str(e)
    return None


def _family() -> list[Member]:
  from configs import lm, multi30k  # pylint: disable=g-import-not-at-top
  suffixes = (multi30k.DECODER_ONLY, *multi30k.MEMBERS, *multi30k.RECIPES)
  models = {}
  for files in multi30k.FILES:
    for suffix in ('',) + suffixes:
      variant = f'{files}_{suffix}' if suffix else files
      models[f'multi30k:{variant}'] = multi30k.get_config(variant).model
  models.update({f'lm:{variant}': lm.get_config(variant).model for variant in lm.VARIANTS})
  settings = [dict(kind=kind, prefix_attention=prefix, positions=positions)
              for kind in MODEL_KINDS for positions in POSITION_KINDS
              for prefix in (PREFIX_ATTENTION if kind == 'decoder_only' else ('causal',))]
  settings += [dict(kind=kind, **layout) for kind in MODEL_KINDS for layout in (
      dict(norm='post'), dict(share_embeddings=False), dict(tie_output=False))]
  settings += [dict(attention_pattern=kind) for kind in ATTENTION_KINDS]
  for setting in settings:
    model = multi30k.get_config().model.copy_and_resolve_references()
    model.update(setting)
    models[','.join(f'{k}={v}' for k, v in setting.items())] = model
  members: dict[TransformerConfig, list[str]] = {}
  for name, model in models.items():
    model = model.copy_and_resolve_references()
    model.update(SHRUNK)
    config = TransformerConfig.from_config(model, NUM_SYMBOLS + 2, 'cpu', deterministic=True)
    members.setdefault(config, []).append(name)
  return [Member(tuple(names), config) for config, names in members.items()]


FAMILY = _family()
FAMILY_SOURCES = [[str(s) for s in np.random.default_rng(2).integers(0, NUM_SYMBOLS, n)]
                  for n in (1, 3, 4, 6, 8, 11, 13, 16)]


@pytest.fixture(scope='module')
def family_table(request):
  """Rows (member, exported or refused, greedy equal, max score difference), printed at the
  end of the module's tests."""
  rows = []
  yield rows
  capture = request.config.pluginmanager.getplugin('capturemanager')
  with capture.global_and_fixture_disabled():  # Shown with the test results, not captured.
    print('\nCTranslate2 export of the model family:')
    for row in [('member', 'outcome', 'greedy equal', 'max score difference')] + rows:
      print(' | '.join(map(str, row)))


def _greedy_pieces(config, params, sources) -> list[list[str]]:
  """t2t_jax's greedy outputs, as pieces, EOS and what follows removed."""
  tokens = runtime.jit_search(decode.greedy_search, static_argnums=(2, 3))(
      params, jnp.asarray(_batch(sources)), config, MAX_OUTPUT)
  return [[TOKENS[i] for i in _until_eos(row)] for row in np.asarray(tokens)]


def _ctranslate2_greedy(model_dir, config, sources) -> list[list[str]]:
  if config.kind == 'decoder_only':
    # max_length counts generated tokens (EOS included) when the prompt is not returned.
    results = _generator(model_dir).generate_batch(
        [ctranslate2_decoder_only.prompt(source, TOKENS) for source in sources],
        max_length=MAX_OUTPUT, include_prompt_in_result=False)
    return [r.sequences[0] for r in results]
  # min_decoding_length=0: t2t_jax may end with EOS at once (CTranslate2's default is 1).
  results = _translator(model_dir).translate_batch(
      sources, beam_size=1, max_decoding_length=MAX_OUTPUT, min_decoding_length=0)
  return [r.hypotheses[0] for r in results]


@pytest.mark.parametrize('member', [
    pytest.param(m, id=m.names[0], marks=() if m.refusal() else pytest.mark.slow)
    for m in FAMILY])
def test_each_family_member_is_exported_equal_or_refused(member, family_table, tmp_path):
  name = ' = '.join(member.names)
  refusal = member.refusal()
  if refusal is not None:
    setting, _, why = refusal.partition(' cannot be exported to CTranslate2: ')
    key, _, value = setting.removeprefix('config.model.').partition('=')
    assert why and '\n' not in refusal and value == repr(getattr(member.config, key)), refusal
    expected = [w for s, w in EXPECTED_REFUSALS.items() if setting.startswith(s)]
    assert expected, f'{name}: a refusal the test does not know: {refusal}'
    assert expected[0] in why, refusal
    family_table.append((name, f'refused: {setting}', '-', '-'))
    return
  params = _briefly_trained(member.config)
  model_dir = _export(member.config, params, tmp_path / 'ct2')
  expected = _greedy_pieces(member.config, params, FAMILY_SOURCES)
  got = _ctranslate2_greedy(model_dir, member.config, FAMILY_SOURCES)
  difference = _max_score_difference(model_dir, member.config, params,
                                     FAMILY_SOURCES + RANDOM_SOURCES, expected + RANDOM_OUTPUTS)
  family_table.append((name, 'exported', got == expected, f'{difference:.1e}'))
  assert got == expected
  assert difference < SCORE_TOLERANCE
  # Not a vacuous agreement: outputs differ with the source, and some end by EOS.
  assert len({tuple(p) for p in expected}) >= 4, expected
  assert min(map(len, expected)) < MAX_OUTPUT, expected


def test_every_expected_refusal_is_met():
  """No stale entry: each refusal the family test knows is what some member gets."""
  refusals = [m.refusal() for m in FAMILY]
  for setting in EXPECTED_REFUSALS:
    assert any(r and r.startswith(setting) for r in refusals), setting


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


@pytest.mark.slow
@pytest.mark.parametrize('variant, overrides', [
    ('speedrun', {}),  # Rotary positions: the command died on a KeyError before.
    ('decoder_only', dict(prefix_attention='causal')),
    ('decoder_only', {}),  # A prefix language model: refused.
    ('alibi', {}),  # ALiBi in the encoder: refused.
], ids=['speedrun', 'decoder_only_causal', 'decoder_only', 'alibi'])
def test_export_cli_on_multi30k_members(variant, overrides, tmp_path):
  """The command on the model of a multi30k variant (shrunk): a CTranslate2 model that
  computes t2t_jax's scores, or one `error:` line, no traceback, before any checkpoint is
  read (the one named here does not exist)."""
  from configs import multi30k  # pylint: disable=g-import-not-at-top
  config = _random_run(tmp_path / 'run', {})
  config.model.update(multi30k.get_config(variant).model)
  config.model.update(dict(SHRUNK, **overrides))
  with open(tmp_path / 'run' / 'config.json', 'w') as f:
    f.write(config.to_json_best_effort())
  model_config = TransformerConfig.from_config(config.model, NUM_SYMBOLS + 2, 'cpu',
                                               deterministic=True)
  refusal = Member((variant,), model_config).refusal()
  output = str(tmp_path / 'ct2')
  args = ('--format=ctranslate2', f'--workdir={tmp_path / "run"}', f'--output={output}')
  if refusal is not None:
    result = _run_export(*args, f'--checkpoint={tmp_path / "no_such_checkpoint"}')
    assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f'error: {refusal}'
    assert not os.path.exists(output)
    return
  params = _random_params(model_config)
  params_dir = saved_params.write_params(str(tmp_path / 'params'), params,
                                         config.to_json_best_effort(), {'kind': 'test'})
  result = _run_export(*args, f'--checkpoint={params_dir}')
  assert result.returncode == 0, result.stderr
  assert _max_score_difference(output, model_config, params, RANDOM_SOURCES,
                               RANDOM_OUTPUTS) < SCORE_TOLERANCE
