"""Greedy and beam search: beam 1 = greedy, exactness against enumeration, EOS, batching."""

import dataclasses
import functools
import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import quick_jit
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.decoding import decode
from t2t_jax.decoding import top_k as top_k_lib
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.model import decoder_only
from t2t_jax.model import transformer as model_lib

CONFIG = model_lib.TransformerConfig(
    vocab_size=9, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
    num_decoder_layers=2, max_len=32, norm='pre', deterministic=True)


def _random_params(config=CONFIG, seed=1, std=1.0):
  """Weights drawn N(0, std), of either model kind: unlike the init, they give varied outputs
  and EOS positions."""
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(decoder_only.make_model(config).init(jax.random.PRNGKey(0), tokens,
                                                              tokens)['params'])
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape) * std
                                   for k, x in zip(keys, leaves)])


# Compiled as Translator compiles them.
greedy_search = runtime.jit_search(decode.greedy_search, static_argnames=('config', 'max_len'))
beam_search = runtime.jit_search(decode.beam_search, static_argnames=(
    'config', 'max_len', 'beam_size', 'alpha', 'penalty'))
# The length penalties, written out: what a finished hypothesis of n tokens is divided by.
PENALTIES = {'gnmt': lambda n, alpha: ((5 + n) / 6) ** alpha,
             'length': lambda n, alpha: n ** alpha}


def _sources(vocab=9, rows=8, length=5, seed=0):
  """A padded batch of mixed source lengths (rows 4.. are 3 tokens long)."""
  tokens = np.random.default_rng(seed).integers(2, vocab, (rows, length))
  tokens[rows // 2:, 3:] = PAD_ID
  return jnp.asarray(tokens, jnp.int32)


def _trim(tokens) -> tuple[int, ...]:
  """Tokens up to and including the first EOS (all of them if there is none)."""
  tokens = [int(t) for t in tokens]
  return tuple(tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens)


@functools.partial(quick_jit, static_argnames='config')
def _teacher_forced_log_probs(params, source_S, sequences_BL, config):
  """The summed log-probabilities [B] of each row's tokens, its padding (PAD) left out."""
  logits_BLV = model_lib.Transformer(config).apply(
      {'params': params}, jnp.broadcast_to(source_S, (len(sequences_BL), len(source_S))),
      sequences_BL)
  log_probs_BLV = jax.nn.log_softmax(logits_BLV)
  log_probs_BL = jnp.take_along_axis(log_probs_BLV, sequences_BL[:, :, None], axis=2)[..., 0]
  return jnp.where(sequences_BL != PAD_ID, log_probs_BL, 0.0).sum(1)


def _sequence_log_probs(params, config, source, sequences, width: int) -> list[float]:
  """log p(sequence | source) of each sequence (PAD-free, at most `width` tokens), from the
  teacher-forced (uncached) pass. One batch of rows padded to `width`, one program for every
  call: the causal decoder's output at a token does not see the padding after it."""
  rows = [list(s) + [PAD_ID] * (width - len(s)) for s in sequences]
  return np.asarray(_teacher_forced_log_probs(params, source, jnp.asarray(rows, jnp.int32),
                                              config=config)).tolist()


def test_length_penalties_are_gnmts_and_length_to_the_alpha():
  assert float(decode.length_penalty(3, 0.6)) == pytest.approx((8 / 6) ** 0.6)  # The default.
  assert float(decode.length_penalty(3, 0.6, 'gnmt')) == pytest.approx(1.18840, abs=1e-5)
  assert float(decode.length_penalty(3, 1.4, 'length')) == pytest.approx(4.65554, abs=1e-5)
  assert float(decode.length_penalty(1, 1.4, 'length')) == 1.0
  for kind in decode.LENGTH_PENALTIES:
    assert float(decode.length_penalty(7, 0.0, kind)) == 1.0
    lengths = np.arange(1, 60)
    np.testing.assert_allclose(decode.length_penalty(lengths, 1.4, kind),
                               PENALTIES[kind](lengths, 1.4), rtol=1e-6)
  with pytest.raises(ValueError, match="'fairseq' must be one of"):
    decode.length_penalty(3, 0.6, 'fairseq')
  assert decode.max_decode_length(20, 50, 64) == 64
  assert decode.max_decode_length(10, 50, 512) == 60


def test_beam_size_one_equals_greedy():
  params, inputs = _random_params(), _sources()
  greedy = np.asarray(greedy_search(params, inputs, config=CONFIG, max_len=8))
  tokens, scores = beam_search(params, inputs, config=CONFIG, max_len=8, beam_size=1, alpha=0.0)
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], greedy)
  # Both ways of ending occur in this batch: EOS, and running into the length limit.
  ended = [EOS_ID in row for row in greedy]
  assert any(ended) and not all(ended)


@pytest.mark.parametrize('vocab, max_len, beam, alpha, penalty', [
    (4, 2, 4, 0.6, 'gnmt'), (5, 2, 5, 2.0, 'gnmt'), (4, 3, 9, 0.0, 'gnmt'),
    (5, 2, 5, 2.0, 'length'), (4, 3, 9, 1.4, 'length')])
def test_wide_beam_returns_the_exhaustive_best(vocab, max_len, beam, alpha, penalty):
  config = dataclasses.replace(CONFIG, vocab_size=vocab)
  params, inputs = _random_params(config, seed=3, std=0.7), _sources(vocab, rows=3, seed=4)
  tokens, scores = beam_search(params, inputs, config=config, max_len=max_len, beam_size=beam,
                                alpha=alpha, penalty=penalty)
  symbols = [t for t in range(vocab) if t not in (PAD_ID, EOS_ID)]
  hypotheses = [prefix + (EOS_ID,) for n in range(max_len)
                for prefix in itertools.product(symbols, repeat=n)]
  hypotheses += list(itertools.product(symbols, repeat=max_len))  # Cut by the length limit.
  for row in range(inputs.shape[0]):
    log_probs = _sequence_log_probs(params, config, inputs[row], hypotheses, max_len)
    scored = sorted(((p / PENALTIES[penalty](len(h), alpha), h)
                     for p, h in zip(log_probs, hypotheses)), reverse=True)
    assert _trim(tokens[row, 0]) == scored[0][1]
    k = min(beam, len(scored))
    np.testing.assert_allclose(np.asarray(scores[row, :k]), [s for s, _ in scored[:k]],
                               atol=1e-4)


def test_scores_are_length_normalised_log_probs_and_eos_ends_each_hypothesis():
  params, inputs = _random_params(seed=2), _sources()
  tokens, scores = beam_search(params, inputs, config=CONFIG, max_len=8, beam_size=3, alpha=0.6)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  assert np.all(np.diff(scores, axis=1) <= 0)
  for row in range(inputs.shape[0]):
    hypotheses = [_trim(tokens[row, k]) for k in range(3)]
    log_probs = _sequence_log_probs(params, CONFIG, inputs[row], hypotheses, 8)
    for k, (hypothesis, log_prob) in enumerate(zip(hypotheses, log_probs)):
      assert PAD_ID not in hypothesis and EOS_ID not in hypothesis[:-1]
      assert hypothesis[-1] == EOS_ID or len(hypothesis) == 8
      assert np.all(tokens[row, k, len(hypothesis):] == PAD_ID)
      expected = log_prob / float(decode.length_penalty(len(hypothesis), 0.6))
      assert scores[row, k] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize('penalty', decode.LENGTH_PENALTIES)
def test_early_stop_bound_is_the_best_score_an_open_length_could_reach(penalty):
  """Brute force over the lengths: a live hypothesis of log-probability p may still finish at
  any length n from step + 1 to the limit, with a log-probability as high as p (the rest of
  its tokens certain), so the search may stop only where no p / penalty(n) beats the worst
  finished score."""
  rng = np.random.default_rng(0)
  seen = set()
  for _ in range(300):
    step, alpha = int(rng.integers(0, 10)), float(rng.choice([0.0, 0.6, 1.0, 1.4, 2.0]))
    limit = int(rng.integers(step + 1, 40))
    live, worst_finished = -rng.exponential(3.0), -rng.exponential(1.0)
    state = decode.BeamState(jnp.array(step), None, jnp.array([[live]], jnp.float32), None,
                             jnp.array([[worst_finished]], jnp.float32))
    expected = any(live / PENALTIES[penalty](n, alpha) > worst_finished
                   for n in range(step + 1, limit + 1))
    assert bool(decode._can_improve(state, jnp.array([limit]), alpha, penalty)) == expected, (
        step, limit, alpha, live, worst_finished)
    # Not the shortcut of the current length alone, which stops too early where longer wins.
    seen.add((expected, expected != (live / PENALTIES[penalty](step + 1, alpha) >
                                     worst_finished)))
  assert seen == {(False, False), (True, False), (True, True)}


@pytest.mark.parametrize('penalty, alpha', [('gnmt', 0.6), ('length', 0.6)])
def test_early_stop_returns_what_the_full_search_returns(monkeypatch, penalty, alpha):
  params, inputs = _random_params(seed=1, std=0.5), _sources(rows=6)
  original, steps = decode._can_improve, []

  def recording(state, max_len, alpha, penalty):
    jax.debug.callback(lambda step: steps.append(int(step)), state.step)
    return original(state, max_len, alpha, penalty)

  def search():  # A new function each time, so each call traces `beam_search` afresh.
    return jax.jit(lambda p, i: decode.beam_search(p, i, CONFIG, 12, 3, alpha,
                                                   penalty=penalty))(params, inputs)

  monkeypatch.setattr(decode, '_can_improve', recording)
  stopped = jax.block_until_ready(search())
  assert max(steps) < 12  # It did stop early: every row's finished beams were out of reach.
  monkeypatch.setattr(decode, '_can_improve', lambda *args: jnp.array(True))
  full = search()
  np.testing.assert_array_equal(stopped[0], full[0])
  np.testing.assert_allclose(stopped[1], full[1], atol=1e-6)


def test_greedy_stops_at_eos_and_pads_after_it():
  params, inputs = _random_params(), _sources()
  greedy = np.asarray(greedy_search(params, inputs, config=CONFIG, max_len=8))
  for row in greedy:
    hypothesis = _trim(row)
    assert PAD_ID not in hypothesis and np.all(row[len(hypothesis):] == PAD_ID)


@pytest.mark.parametrize('beam_size', [1, 3])
def test_translator_keeps_input_order_through_length_sorting(beam_size):
  config = dataclasses.replace(CONFIG, max_len=24)
  params = _random_params(config)
  mesh_config = _mesh_config()
  mesh = sharding.make_mesh(mesh_config)
  rng = np.random.default_rng(5)
  inputs = [rng.integers(2, 9, n).astype(np.int32) for n in (3, 11, 0, 7, 2, 12, 5, 9, 1, 4)]
  translator = translator_lib.Translator(config, mesh, sharding.rules(mesh_config),
                                 batch_tokens=64 * beam_size, min_bucket=4, max_extra_len=3,
                                 beam_size=beam_size, alpha=0.6)
  outputs = translator.translate(params, inputs)
  assert len(outputs) == len(inputs) and len(outputs[2]) == 0  # The empty input.
  # Translated one at a time (other batch shapes, the same length limits), nothing can move.
  for seq, output in zip(inputs, outputs):
    assert _trim(output) == _trim(translator.translate(params, [seq])[0])
  assert len(set(_trim(o) for o in outputs)) > 3  # Distinct outputs, so a swap would show.
  assert translator.translate(params, []) == []


def test_bfloat16_beam_search_scores_within_the_rounding_bound_and_caches_in_bfloat16():
  config = dataclasses.replace(CONFIG, dtype=jnp.bfloat16)
  params, inputs = _random_params(seed=2, std=0.5), _sources()  # 7 distinct float32 outputs.
  tokens, scores = beam_search(params, inputs, config=config, max_len=8, beam_size=2, alpha=0.6)
  expected_tokens, expected_scores = beam_search(params, inputs, config=CONFIG, max_len=8,
                                                 beam_size=2, alpha=0.6)
  assert tokens.shape == (8, 2, 8) and np.all(np.diff(np.asarray(scores), axis=1) <= 0)
  # A score sums at most 8 steps' log-probabilities. The logits are below 2 in magnitude here,
  # and bfloat16 rounds to 2^-8 of a value: allowing each step three roundings of a logit,
  # a score is within 8 x 3 x 2 x 2^-8 = 0.19 of float32's (measured 0.021).
  bound = 8 * 3 * 2 * 2**-8
  logits = _logits(params, inputs, expected_tokens[:, 0], config=CONFIG)
  assert float(jnp.max(jnp.abs(logits))) < 2
  # A near-tie may flip under bfloat16 rounding (which hypotheses must stay is the next
  # test's, against the logits' measured deviation); the hypotheses both find score alike.
  same = np.all(np.asarray(tokens) == np.asarray(expected_tokens), axis=-1)
  assert same.any()
  np.testing.assert_allclose(np.asarray(scores)[same], np.asarray(expected_scores)[same],
                             atol=bound)
  cache = decode.init_cache(config, 2, 8)
  assert cache['decoder_0']['self_attention']['key'].dtype == jnp.bfloat16


@functools.partial(quick_jit, static_argnames='config')  # One program, not each operation.
def _logits(params, inputs_BS, targets_BL, config):
  return model_lib.Transformer(config).apply({'params': params}, inputs_BS, targets_BL)


def _mesh_config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  return tiny.get_config().mesh


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_scanned_layers_decode_like_unrolled_ones(remat):
  scanned = dataclasses.replace(CONFIG, scan_layers=True, remat=remat)
  params, inputs = _random_params(seed=2), _sources()
  stacked = model_lib.stack_layer_params(params, CONFIG)
  cache = decode.init_cache(scanned, 8, 8)
  # One cache per decoder layer, stacked ahead of the rows, heads-major ([layers, B, H, L, D]);
  # no cross-attention entries yet.
  assert cache['decoder_layers']['self_attention']['key'].shape == (2, 8, 2, 8, 8)
  assert cache['decoder_layers']['self_attention']['index'].shape == (2,)
  assert cache['decoder_layers']['cross_attention'] == {}
  np.testing.assert_array_equal(greedy_search(stacked, inputs, config=scanned, max_len=8),
                                greedy_search(params, inputs, config=CONFIG, max_len=8))
  # Beam search copies each sentence's cache rows to its beams, then reorders them by parent.
  tokens, scores = beam_search(stacked, inputs, config=scanned, max_len=8, beam_size=3,
                               alpha=0.6)
  expected_tokens, expected_scores = beam_search(params, inputs, config=CONFIG, max_len=8,
                                                 beam_size=3, alpha=0.6)
  np.testing.assert_array_equal(tokens, expected_tokens)
  np.testing.assert_allclose(scores, expected_scores, atol=1e-5)


@functools.partial(quick_jit, static_argnames='config')
def _next_log_probs(params, source_S, prefixes_BL, lengths_B, config):
  """log p(next token | source, prefix) [B, V] over the whole vocabulary, uncached.

  Each prefix fills the start of a fixed-length row; the rest holds a non-PAD filler, which
  causal attention keeps from the position read (the prefix's length).
  """
  logits_BLV = model_lib.Transformer(config).apply(
      {'params': params}, jnp.broadcast_to(source_S, (len(prefixes_BL), len(source_S))),
      prefixes_BL)
  return jax.nn.log_softmax(logits_BLV[jnp.arange(len(prefixes_BL)), lengths_B])


def _plain_beam_search(log_probs_of, limit: int, beam: int, alpha: float, vocab: int,
                       penalty: str = 'gnmt'):
  """Beam search as written down, one sentence, no cache, no early stop, no arrays of beams.

  Each step extends every live hypothesis by every token but PAD, ranks the extensions
  (log-probability, then lower beam, then lower token) and keeps the best 2 * beam: an EOS
  among the best `beam` of them finishes (score log p / PENALTIES[penalty](length, alpha)),
  other EOS are dropped, the best `beam` others live on. At `limit` tokens every kept extension
  finishes. Returns [(score, hypothesis)], best first.
  """
  live, finished = [((), 0.0)], []
  for step in range(limit):
    log_probs = log_probs_of([hypothesis for hypothesis, _ in live])
    extensions = sorted(((total + float(log_probs[b, token]), b, token)
                         for b, (_, total) in enumerate(live)
                         for token in range(vocab) if token != PAD_ID),
                        key=lambda e: (-e[0], e[1], e[2]))[:2 * beam]
    divisor = PENALTIES[penalty](step + 1, alpha)
    next_live = []
    for rank, (total, b, token) in enumerate(extensions):
      hypothesis = live[b][0] + (token,)
      if step + 1 == limit or (token == EOS_ID and rank < beam):
        finished.append((total / divisor, hypothesis))
      elif token != EOS_ID:
        next_live.append((hypothesis, total))
    finished = sorted(finished, key=lambda f: -f[0])[:beam]  # Stable: earlier ones first.
    live = next_live[:beam]
  return finished


@pytest.mark.parametrize('penalty, alpha', [('gnmt', 0.6), ('length', 1.4)])
def test_beam_search_equals_a_plain_beam_search_over_many_seeds(penalty, alpha):
  vocab, beam, max_len = 7, 3, 6
  config = dataclasses.replace(CONFIG, vocab_size=vocab)
  limits = np.array([6, 4, 1, 6, 3, 5])  # Per-row output limits; row 2 may emit one token.
  seen = {'finished_at_step_1': False, 'finished_early': False, 'cut_by_limit': False}
  for seed in range(12):
    params = _random_params(config, seed=seed, std=1.5)
    inputs = _sources(vocab, rows=len(limits), seed=100 + seed)
    tokens, scores = beam_search(params, inputs, config=config, max_len=max_len,
                                 beam_size=beam, alpha=alpha, max_lengths_B=limits,
                                 penalty=penalty)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    for row, limit in enumerate(limits):
      def log_probs_of(prefixes, row=row):
        # Always `beam` rows (the unused ones all filler), so one program serves every step.
        rows = np.full((beam, max_len + 1), 2, np.int32)
        lengths = np.zeros(beam, np.int32)
        for r, prefix in enumerate(prefixes):
          rows[r, :len(prefix)], lengths[r] = prefix, len(prefix)
        return np.asarray(_next_log_probs(params, inputs[row], jnp.asarray(rows),
                                          jnp.asarray(lengths), config=config))[:len(prefixes)]
      expected = _plain_beam_search(log_probs_of, int(limit), beam, alpha, vocab, penalty)
      got = [_trim(t[t != PAD_ID]) for t in tokens[row]]
      assert got == [hypothesis for _, hypothesis in expected], (seed, row)
      np.testing.assert_allclose(scores[row], [s for s, _ in expected], rtol=2e-5, atol=2e-5)
      best = expected[0][1]
      seen['finished_at_step_1'] |= any(h == (EOS_ID,) for _, h in expected)
      seen['finished_early'] |= best[-1] == EOS_ID and len(best) < limit
      seen['cut_by_limit'] |= best[-1] != EOS_ID
  assert all(seen.values()), seen  # The seeds cover every way a hypothesis ends.


def test_two_stage_top_k_is_lax_top_k_ties_included():
  rng = np.random.default_rng(0)
  # (vocabulary, count, block): two stages with one-entry, odd, even and partial last blocks;
  # and one stage (fewer than 4 x count blocks). Each shape compiles once for its ten arrays.
  shapes = [(40, 1, 1), (123, 8, 2), (700, 3, 5), (511, 8, 8), (64, 4, 8), (700, 8, 1)]
  for vocab, count, block in shapes:
    top_k = jax.jit(functools.partial(top_k_lib.top_k, count=count, block=block))
    reference = jax.jit(functools.partial(jax.lax.top_k, k=count))
    for trial in range(10):
      # Few distinct values: many ties, across blocks and inside them; -inf entries too.
      x = rng.integers(0, [2, 4, 50, 10**6][trial % 4], (2, 3, vocab)).astype(np.float32)
      x[0, 0, rng.integers(0, vocab, 5)] = -np.inf
      got_values, got_indices = top_k(jnp.asarray(x))
      values, indices = reference(x)
      where = f'vocab {vocab}, count {count}, block {block}, trial {trial}'
      np.testing.assert_array_equal(got_values, values, err_msg=where)
      np.testing.assert_array_equal(got_indices, indices, err_msg=where)
  assert top_k_lib.TOP_K_BLOCK * 4 * 8 <= 8000  # Beam 4 over an 8k vocabulary takes two stages.


def test_beam_search_with_two_stage_top_k_is_bit_identical(monkeypatch):
  vocab = 400
  config = dataclasses.replace(CONFIG, vocab_size=vocab)
  params, inputs = _random_params(config, seed=3, std=1.5), _sources(vocab, rows=6, seed=4)
  results = {}
  for block in (5, vocab):  # 80 blocks: two stages; one block: lax.top_k.
    monkeypatch.setattr(top_k_lib, 'TOP_K_BLOCK', block)
    # A new function each time, so each traces `beam_search` afresh.
    search = runtime.jit_search(lambda p, i: decode.beam_search(p, i, config, 10, 4, 0.6))
    results[block] = [np.asarray(x) for x in search(params, inputs)]
  np.testing.assert_array_equal(results[5][0], results[vocab][0])
  np.testing.assert_array_equal(results[5][1], results[vocab][1])
  assert len({tuple(row[0]) for row in results[5][0]}) > 1  # Not one degenerate output.


def _loop_body_ops(hlo_text: str) -> list[str]:
  """The instructions of the (first) while loop's body in XLA's optimised HLO text."""
  body = re.search(r'body=%?([\w.\-]+)', hlo_text).group(1)
  computations, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if header:
      current = computations.setdefault(header.group(1), [])
    elif current is not None:
      current.append(line)
  return computations[body]


def test_beam_search_steps_update_the_caches_in_place_without_copying_them():
  # Heads 2, sentences 6, head dim 8, beams 4, length 10: keys [H, B, D, W, L] and values
  # [H, N, L, D] (attention_cache.BeamCache), in each of the 2 decoder layers.
  params, inputs = _random_params(seed=3), _sources(rows=6)
  cache_shape = re.compile(r'= f32\[(2,6,8,4,10|2,24,10,8)\]\{[\d,]+\} (\S+)\((\S+?)[,)]')
  writes = {}
  for name, jit in (('default', jax.jit), ('t2t_jax', runtime.jit_search)):
    compiled = jit(lambda p, i: decode.beam_search(p, i, CONFIG, 10, 4, 0.6)).lower(
        params, inputs).compile()
    made = [cache_shape.search(line).groups()[1:] for line in
            _loop_body_ops(compiled.as_text()) if cache_shape.search(line)]
    writes[name] = [(op, operand) for op, operand in made  # Views of a buffer make nothing.
                    if op not in ('get-tuple-element', 'bitcast', 'tuple')]
  # Each step writes each of the 4 caches once, into the buffer the loop passed in; nothing
  # else makes a cache-sized array.
  assert len(writes['t2t_jax']) == 4, writes['t2t_jax']
  assert all(op == 'fusion' and operand.startswith('%get-tuple-element')
             for op, operand in writes['t2t_jax']), writes['t2t_jax']
  # XLA:CPU's default copy insertion copies them (what runtime.jit_search's options are for).
  assert any(op == 'copy' for op, _ in writes['default']), writes['default']


@pytest.mark.slow
def test_bfloat16_decoding_gives_the_float32_outputs_where_scores_are_not_tied():
  params, inputs = _random_params(seed=7), _sources(rows=8)
  bfloat16 = translator_lib.decoding_config(CONFIG, 'bfloat16', 'cpu')
  assert bfloat16.dtype == jnp.bfloat16
  assert translator_lib.decoding_config(CONFIG, 'auto', 'cpu').dtype == jnp.float32
  assert translator_lib.decoding_config(CONFIG, 'auto', 'gpu').dtype == jnp.bfloat16
  expected = np.asarray(greedy_search(params, inputs, config=CONFIG, max_len=8))
  got = np.asarray(greedy_search(params, inputs, config=bfloat16, max_len=8))
  # Clear choices only: at every step the best token's logit (PAD aside, never chosen) leads
  # the runner-up's by more than twice the largest bfloat16 deviation of these logits.
  logits = np.asarray(model_lib.Transformer(CONFIG).apply({'params': params}, inputs,
                                                          jnp.asarray(expected)))
  deviation = np.abs(logits - np.asarray(model_lib.Transformer(bfloat16).apply(
      {'params': params}, inputs, jnp.asarray(expected)), np.float32)).max()
  assert 0 < deviation < 0.5
  top2 = np.sort(np.delete(logits, PAD_ID, axis=-1), axis=-1)[..., -2:]
  compared = 0
  for row in range(len(inputs)):
    steps = len(_trim(expected[row]))
    if (top2[row, :steps, 1] - top2[row, :steps, 0]).min() > 2 * deviation:
      assert _trim(got[row]) == _trim(expected[row]), row
      compared += 1
  assert compared >= 4
  tokens, scores = beam_search(params, inputs, config=CONFIG, max_len=8, beam_size=3, alpha=0.6)
  tokens16, scores16 = beam_search(params, inputs, config=bfloat16, max_len=8, beam_size=3,
                                   alpha=0.6)
  gaps = np.diff(-np.asarray(scores), axis=1).min(axis=1)  # Between ranked hypotheses.
  clear = gaps > 2 * deviation
  assert clear.sum() >= 4
  np.testing.assert_array_equal(np.asarray(tokens16)[clear], np.asarray(tokens)[clear])
  # A score sums at most 8 log-probabilities, each off by at most twice the logits' deviation.
  np.testing.assert_allclose(np.asarray(scores16)[clear], np.asarray(scores)[clear],
                             atol=8 * 2 * deviation)


def test_greedy_token_pick_is_numpys_argmax_without_pad_ties_and_nan_included():
  rng = np.random.default_rng(0)
  logits = rng.integers(0, 4, (64, 11)).astype(np.float32)  # Many ties.
  logits[3] = np.nan  # A whole NaN row (an id outside the vocabulary gives one).
  logits[5, 7] = np.nan  # NaN ranks first, as in argmax.
  logits[9, PAD_ID] = 99.0  # PAD is never picked.
  expected = np.where(np.arange(11) == PAD_ID, -np.inf, logits).argmax(-1)
  np.testing.assert_array_equal(jax.jit(decode.best_token)(logits), expected)
